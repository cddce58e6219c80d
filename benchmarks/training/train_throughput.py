"""Trainer throughput side by side: NSA vs dense, activation checkpointing and compile on/off.

    python benchmarks/training/train_throughput.py [--config train_configs/debug_model.toml] [--steps 16]
                                          [--ranks 1] [--variants NAME ...] [--allocators tuned default]
                                          [--rounds 1] [-- extra overrides...]

Each variant runs the real trainer (`python -m torch.distributed.run ... nsa_titan.train`) in
its own process, so the peak memory is its own; tokens/s is taken over the last log interval,
after the warm-up (compile) steps. Prints a Markdown table with ratios to the first row. Host
allocator (CPU): `tuned`, the glibc settings `run_train.sh`'s launcher gives CPU ranks (the
default), and/or `default`, glibc as it comes; each variant runs under each, side by side.
With `--rounds N`, the whole list runs N times, one round after another, and each row's ratio to the
first row is taken within its round (a box's speed drifts between runs minutes apart); then the median
ratio of each row over the rounds.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from nsa_titan.system.env import allocator_env  # noqa: E402

LINE = re.compile(r"step +(\d+)/\d+ \| loss +([\d.]+) .*\| tok/s ([\d,]+) (?:\| mfu +([\d.]+)% )?.*\| mem ([\d.]+)GiB")

VARIANTS = {
    "nsa-eager": ["--model.attention", "nsa", "--compile.enable", "false", "--activation_checkpoint.mode", "none"],
    "nsa-eager-torch": ["--model.attention", "nsa", "--compile.enable", "false", "--activation_checkpoint.mode", "none",
                        "--model.kernels", "torch"],  # the PyTorch kernels (auto: NSA's C++ kernel on CPUs)
    "nsa-eager-ac": ["--model.attention", "nsa", "--compile.enable", "false", "--activation_checkpoint.mode", "full"],
    "nsa-compiled": ["--model.attention", "nsa", "--compile.enable", "true", "--activation_checkpoint.mode", "none"],
    "nsa-compiled-ac": ["--model.attention", "nsa", "--compile.enable", "true", "--activation_checkpoint.mode", "full"],
    "dense-eager": ["--model.attention", "dense", "--compile.enable", "false", "--activation_checkpoint.mode", "none"],
    "dense-compiled": ["--model.attention", "dense", "--compile.enable", "true", "--activation_checkpoint.mode", "none"],
    "dense-compiled-ac": ["--model.attention", "dense", "--compile.enable", "true", "--activation_checkpoint.mode",
                          "full"],
}


def run_variant(config: str, steps: int, ranks: int, args: list[str], env: dict[str, str]
                ) -> tuple[float, str, float, float]:
    """(tokens/s over the last log interval, its MFU (GPUs), peak memory GiB of rank 0, final loss)."""
    log_freq = steps // 2
    with tempfile.TemporaryDirectory(prefix="nsa_titan_bench_") as folder:  # fresh: no run resumes another's save
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks),
               "-m", "nsa_titan.train", "--config", config, "--training.steps", str(steps),
               "--metrics.log_freq", str(log_freq), "--metrics.enable_tensorboard", "false",
               "--job.dump_folder", folder, *args]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    last = [m for m in map(LINE.search, proc.stdout.splitlines()) if m][-1]
    mfu = f"{last.group(4)}%" if last.group(4) else "-"
    return float(last.group(3).replace(",", "")), mfu, float(last.group(5)), float(last.group(2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(ROOT / "train_configs" / "debug_model.toml"))
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS), metavar="NAME",
                        help="a subset of: " + ", ".join(VARIANTS) + " (ac: activation checkpointing full; torch: the "
                             "PyTorch kernels)")
    parser.add_argument("--allocators", nargs="+", choices=["tuned", "default"], default=["tuned"])
    parser.add_argument("--rounds", type=int, default=1, help="run every row this many times, round by round")
    parser.add_argument("overrides", nargs="*", help="extra --section.key value overrides for every variant")
    opts = parser.parse_args()
    print(f"config {opts.config}, {opts.steps} steps, {opts.ranks} rank(s), overrides {opts.overrides}")
    print("| round | variant | allocator | tokens/s | vs first row | MFU | peak memory (GiB) | loss at last step |")
    print("|---|---|---|---|---|---|---|---|")
    ratios: dict[tuple[str, str], list[float]] = {}
    for r in range(1, opts.rounds + 1):
        base = None
        for name in opts.variants:
            for allocator in opts.allocators:
                tps, mfu, mem, loss = run_variant(opts.config, opts.steps, opts.ranks,
                                                  [*VARIANTS[name], *opts.overrides], allocator_env(allocator))
                base = base or tps
                ratios.setdefault((name, allocator), []).append(tps / base)
                print(f"| {r} | {name} | {allocator} | {tps:,.0f} | {tps / base:.2f}x | {mfu} | {mem:.2f} | "
                      f"{loss:.4f} |", flush=True)
    if opts.rounds > 1:
        print("\n| variant | allocator | vs first row, median of the rounds | each round |\n|---|---|---|---|")
        for (name, allocator), rs in ratios.items():
            print(f"| {name} | {allocator} | {statistics.median(rs):.3f}x | {', '.join(f'{x:.3f}' for x in rs)} |")


if __name__ == "__main__":
    main()
