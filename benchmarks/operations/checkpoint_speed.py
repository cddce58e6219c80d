"""Checkpoint size, save time, training-loop blocking and resume time: sync vs async, content hashes off vs on.

    python benchmarks/operations/checkpoint_speed.py [--ranks 1 2] [--modes disabled async] [--dim 768] [--layers 12] [--saves 2]
                                          [--rounds 3]

Trains the default config at `--dim` x `--layers` (M7C's 768 x 12 by default: model and AdamW state about
1.5 GB) on each number of CPU ranks, saving every 2 steps, then resumes from the last save for one
more step. Each (ranks, mode) runs `--rounds` times with `[checkpoint] content_hashes` false (no
hashes, as before they were recorded) and true (every rank hashes what it wrote; the ranks check the
files before a resume reads them), in turn, the order swapped every round. Reads the trainer's own log
lines: `checkpoint ...: X MB in T s (training blocked B s, mode)` and `resumed from ... in R s`; each
figure is the median over rounds (and saves); the last column is hashes on / off. Last, the rate at
which `file_hash` reads and hashes a checkpoint's files here, from the page cache: the cost itself.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from nsa_titan.system.hashing import file_hash  # noqa: E402

SAVE = re.compile(r"checkpoint \S+: ([\d.]+) MB in ([\d.]+) s \(training blocked ([\d.]+) s, (\w+)\)")
RESUME = re.compile(r"resumed from \S+ at step \d+ in ([\d.]+) s")
RATES: list[float] = []


def train(dump: str, ranks: int, steps: int, mode: str, hashes: bool, args: argparse.Namespace) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks),
           "-m", "nsa_titan.train", "--job.dump_folder", dump, "--model.dim", str(args.dim),
           "--model.n_layers", str(args.layers), "--model.n_heads", str(args.dim // 64), "--model.n_kv_groups", "2",
           "--model.head_dim", "64", "--training.seq_len", "128", "--training.local_batch_size", "2",
           "--training.steps", str(steps), "--validation.enable", "false", "--eval.enable", "false", "--metrics.log_freq", "1",
           "--metrics.enable_tensorboard", "false", "--checkpoint.enable", "true", "--checkpoint.interval", "2",
           "--checkpoint.async_mode", mode, "--checkpoint.content_hashes", str(hashes).lower(),
           "--data.num_workers", "0"]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True).stdout


def measure(ranks: int, mode: str, hashes: bool, args: argparse.Namespace) -> tuple[float, list[list[float]], float]:
    """(size MB, [save seconds, blocked seconds] of each save, resume seconds); with hashes, also the
    GiB/s at which `file_hash` reads and hashes the last checkpoint's files."""
    with tempfile.TemporaryDirectory() as dump:
        saves = SAVE.findall(train(dump, ranks, 2 * args.saves, mode, hashes, args))
        resume = float(RESUME.search(train(dump, ranks, 2 * args.saves + 1, mode, hashes, args))[1])
        if hashes:
            files = [p for p in (Path(dump) / "checkpoint" / f"step-{2 * args.saves}").iterdir() if p.is_file()]
            start = time.perf_counter()
            for p in files:
                file_hash(p)
            RATES.append(sum(p.stat().st_size for p in files) / 2**30 / (time.perf_counter() - start))
    return float(saves[-1][0]), [[float(m[1]), float(m[2])] for m in saves], resume


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--modes", nargs="+", choices=["disabled", "async"], default=["disabled", "async"])
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--saves", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(f"dim {args.dim}, {args.layers} layers, a save every 2 steps, {args.saves} saves, then a resume; "
          f"{args.rounds} rounds")
    print("| ranks | mode | hashes | checkpoint (MB) | save, median (s) | blocked, median (s) | resume, median (s) | "
          "on / off: save, blocked, resume |")
    print("|---|---|---|---|---|---|---|---|")
    for ranks in args.ranks:
        for mode in args.modes:
            runs: dict[bool, list] = {False: [], True: []}
            for k in range(args.rounds):
                for hashes in (False, True) if k % 2 == 0 else (True, False):
                    runs[hashes].append(measure(ranks, mode, hashes, args))
            rows = {}
            for hashes, results in runs.items():
                saves = [s for _, per_save, _ in results for s in per_save]
                rows[hashes] = (statistics.median(s[0] for s in saves), statistics.median(s[1] for s in saves),
                                statistics.median(r[2] for r in results))
            for hashes, (total, blocked, resume) in rows.items():
                ratio = ", ".join(f"{a / b:.2f}x" for a, b in zip(rows[True], rows[False])) if hashes else ""
                print(f"| {ranks} | {'sync' if mode == 'disabled' else mode} | {'on' if hashes else 'off'} | "
                      f"{runs[hashes][0][0]:,.0f} | {total:.2f} | {blocked:.2f} | {resume:.2f} | {ratio} |", flush=True)
    print(f"file_hash here: {statistics.median(RATES):.1f} GiB/s (median of {len(RATES)} checkpoints read from the "
          f"page cache and hashed)")


if __name__ == "__main__":
    main()
