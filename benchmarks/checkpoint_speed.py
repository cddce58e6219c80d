"""Checkpoint size, save time and training-loop blocking: sync vs async, side by side.

    python benchmarks/checkpoint_speed.py [--ranks 2] [--dim 512] [--layers 8] [--saves 4]

Trains the default config widened to `--dim` x `--layers` on `--ranks` CPU ranks, saving every
2 steps, once with `async_mode = "disabled"` and once with `"async"`, and reads the trainer's
own log lines: `checkpoint ...: X MB in T s (training blocked B s, mode)`.
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
LINE = re.compile(r"checkpoint \S+: ([\d.]+) MB in ([\d.]+) s \(training blocked ([\d.]+) s, (\w+)\)")
STEP = re.compile(r"step +\d+/\d+ .*\| tok/s ([\d,]+)")


def run(mode: str, args: argparse.Namespace) -> tuple[list[tuple[float, float, float]], float]:
    with tempfile.TemporaryDirectory() as dump:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(args.ranks),
               "-m", "nsa_titan.train", "--job.dump_folder", dump, "--model.dim", str(args.dim),
               "--model.n_layers", str(args.layers), "--model.n_heads", str(args.dim // 64), "--model.n_kv_groups", "2",
               "--model.head_dim", "64", "--training.seq_len", "128", "--training.local_batch_size", "2",
               "--training.steps", str(2 * args.saves), "--validation.enable", "false", "--metrics.log_freq", "1",
               "--metrics.enable_tensorboard", "false", "--checkpoint.enable", "true", "--checkpoint.interval", "2",
               "--checkpoint.async_mode", mode, "--data.num_workers", "0"]
        out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True).stdout
    saves = [(float(m[0]), float(m[1]), float(m[2])) for m in LINE.findall(out)]
    tps = [float(m.replace(",", "")) for m in STEP.findall(out)][1:]
    return saves, statistics.median(tps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--saves", type=int, default=4)
    args = parser.parse_args()
    print(f"{args.ranks} ranks, dim {args.dim}, {args.layers} layers, a save every 2 steps, {args.saves} saves")
    print("| mode | checkpoint size (MB) | save time, median (s) | training blocked, median (s) | tokens/s, median |")
    print("|---|---|---|---|---|")
    for mode in ("disabled", "async"):
        saves, tps = run(mode, args)
        size = saves[-1][0]
        total = statistics.median(s[1] for s in saves)
        blocked = statistics.median(s[2] for s in saves)
        print(f"| {'sync' if mode == 'disabled' else mode} | {size:.1f} | {total:.2f} | {blocked:.2f} | {tps:,.0f} |",
              flush=True)


if __name__ == "__main__":
    main()
