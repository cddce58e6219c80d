"""Soak: a long run of the default job on 2 ranks with everything on, watching for hangs and leaks.

    python benchmarks/operations/soak.py [--steps 1000] [--dump outputs/soak]

Runs `run_train.sh` (train_configs/debug_model.toml, NGPU=2) with activation checkpointing, compile,
async checkpoints every 50 steps (keep 3) and validation every 100 steps. Passes when the job exits 0
(no hang: the watchdog would stop it), and each rank's resident memory, read from the heartbeat
(`rss_gib`, one record per step), grows by less than 5% from step 100 to the end. Prints the memory
curve as a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_GROWTH = 0.05


def rss_curve(dump: Path) -> dict[int, dict[int, float]]:
    """{rank: {step: rss_gib}} from the heartbeat files."""
    curves = {}
    for f in sorted((dump / "heartbeat").glob("rank*.jsonl")):
        records = [json.loads(line) for line in f.read_text().splitlines()]
        curves[int(f.stem[4:])] = {r["step"]: r["rss_gib"] for r in records if "rss_gib" in r}
    return curves


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--dump", type=Path, default=ROOT / "outputs" / "soak")
    args = parser.parse_args()
    if args.dump.exists():
        sys.exit(f"{args.dump} exists: the soak starts from scratch; remove it or pass another --dump")
    cmd = [str(ROOT / "run_train.sh"), "--job.dump_folder", str(args.dump), "--training.steps", str(args.steps),
           "--activation_checkpoint.mode", "full", "--compile.enable", "true", "--checkpoint.enable", "true",
           "--checkpoint.async_mode", "async", "--checkpoint.interval", "50", "--checkpoint.keep_latest_k", "3",
           "--validation.enable", "true", "--validation.freq", "100", "--metrics.log_freq", "100"]
    start = time.monotonic()
    proc = subprocess.run(cmd, env={**os.environ, "NGPU": "2"}, text=True, capture_output=True)
    wall = time.monotonic() - start
    print(proc.stdout[-3000:], proc.stderr[-2000:], sep="\n")
    curves = rss_curve(args.dump)
    print(f"\nsoak: {args.steps} steps, 2 ranks, AC full + compile + async checkpoints every 50 (keep 3) + validation "
          f"every 100; exit code {proc.returncode}, wall {wall / 60:.1f} min; {platform.processor() or platform.machine()},"
          f" {os.cpu_count()} cores, torch CPU, gloo\n")
    print("| step | " + " | ".join(f"rank {r} RSS (GiB)" for r in curves) + " |")
    print("|---|" + "---|" * len(curves))
    marks = sorted({s for c in curves.values() for s in c if s == 1 or s % 100 == 0})
    for s in marks:
        print(f"| {s} | " + " | ".join(f"{c[s]:.3f}" if s in c else "-" for c in curves.values()) + " |")
    ok = proc.returncode == 0
    for rank, c in curves.items():
        base, last = c.get(100), c[max(c)]
        if base is None:
            continue
        growth = last / base - 1
        print(f"rank {rank}: RSS {base:.3f} GiB at step 100 -> {last:.3f} GiB at step {max(c)}: {100 * growth:+.2f}%")
        ok &= growth < MAX_GROWTH
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
