"""Checkpoint size, save time, training-loop blocking and resume time: sync vs async, content hashes off vs on.

    python benchmarks/checkpoint_speed.py [--ranks 1 2] [--modes disabled async] [--dim 768] [--layers 12] [--saves 2]

Trains the default config at `--dim` x `--layers` (M7C's 768 x 12 by default: model and AdamW state about
1.5 GB) on each number of CPU ranks, saving every 2 steps, then resumes from the last save for one
more step. Each (ranks, mode) runs twice in a row, `[checkpoint] content_hashes` false (no hashes, as
before they were recorded) then true (every rank hashes what it wrote; the ranks check the files before
a resume reads them). Reads the trainer's own log lines: `checkpoint ...: X MB in T s (training blocked
B s, mode)` and `resumed from ... in R s`; the last columns are hashes on / off of the same (ranks, mode).
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SAVE = re.compile(r"checkpoint \S+: ([\d.]+) MB in ([\d.]+) s \(training blocked ([\d.]+) s, (\w+)\)")
RESUME = re.compile(r"resumed from \S+ at step \d+ in ([\d.]+) s")


def train(dump: str, ranks: int, steps: int, mode: str, hashes: bool, args: argparse.Namespace) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks),
           "-m", "nsa_titan.train", "--job.dump_folder", dump, "--model.dim", str(args.dim),
           "--model.n_layers", str(args.layers), "--model.n_heads", str(args.dim // 64), "--model.n_kv_groups", "2",
           "--model.head_dim", "64", "--training.seq_len", "128", "--training.local_batch_size", "2",
           "--training.steps", str(steps), "--validation.enable", "false", "--metrics.log_freq", "1",
           "--metrics.enable_tensorboard", "false", "--checkpoint.enable", "true", "--checkpoint.interval", "2",
           "--checkpoint.async_mode", mode, "--checkpoint.content_hashes", str(hashes).lower(),
           "--data.num_workers", "0"]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True).stdout


def measure(ranks: int, mode: str, hashes: bool, args: argparse.Namespace) -> tuple[float, float, float, float]:
    """(size MB, save seconds, blocked seconds (medians over the saves), resume seconds)."""
    with tempfile.TemporaryDirectory() as dump:
        saves = [(float(m[0]), float(m[1]), float(m[2])) for m in SAVE.findall(train(dump, ranks, 2 * args.saves,
                                                                                      mode, hashes, args))]
        resume = float(RESUME.search(train(dump, ranks, 2 * args.saves + 1, mode, hashes, args))[1])
    return saves[-1][0], statistics.median(s[1] for s in saves), statistics.median(s[2] for s in saves), resume


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--modes", nargs="+", choices=["disabled", "async"], default=["disabled", "async"])
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--saves", type=int, default=2)
    args = parser.parse_args()
    print(f"dim {args.dim}, {args.layers} layers, a save every 2 steps, {args.saves} saves, then a resume")
    print("| ranks | mode | hashes | checkpoint (MB) | save, median (s) | blocked, median (s) | resume (s) | "
          "on / off: save, blocked, resume |")
    print("|---|---|---|---|---|---|---|---|")
    for ranks in args.ranks:
        for mode in args.modes:
            off = measure(ranks, mode, False, args)
            on = measure(ranks, mode, True, args)
            for hashes, (size, total, blocked, resume) in (("off", off), ("on", on)):
                ratio = ", ".join(f"{a / b:.2f}x" for a, b in zip(on[1:], off[1:])) if hashes == "on" else ""
                print(f"| {ranks} | {'sync' if mode == 'disabled' else mode} | {hashes} | {size:,.0f} | {total:.2f} | "
                      f"{blocked:.2f} | {resume:.2f} | {ratio} |", flush=True)


if __name__ == "__main__":
    main()
