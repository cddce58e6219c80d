"""Context parallelism: per-rank peak memory, tokens/s and bytes moved, cp = 2 against cp = 1.

    python benchmarks/training/context_parallel.py [--seq 8192 16384] [--steps 5] [--layers 2] [--ac full]

Trains M7C's width (`train_configs/m7c.toml`, `--layers` blocks, fp32, batch 1, synthetic tokens)
through `run_train.sh`, once on 1 rank (cp = 1) and once on 2 ranks splitting every sequence
(cp = 2), at each sequence length. Reports each rank's peak of live tensor memory in the
profiled step (the profiler's allocation events; the largest over ranks), its peak resident memory
(the heartbeat's `rss_gib`: with the allocator's retained pages and the runtime), the mean tokens/s
of the steps after the profiled one (each token counted once), and the bytes the context-parallel collectives moved into
one rank in one step, read from the profiler trace of step 2 (`[debug] profile_step`: the
functional all-gathers of the K/V and the reduce-scatters of their gradients), against the
planner's prediction (`plan.comm_bytes`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from nsa_titan.config import load_config  # noqa: E402
from nsa_titan.plan import comm_bytes  # noqa: E402

PROFILED_STEP = 2


def overrides(T: int, cp: int, layers: int, steps: int, ac: str) -> list[str]:
    return ["--config", str(ROOT / "train_configs" / "m7c.toml"), "--model.n_layers", str(layers),
            "--activation_checkpoint.mode", ac,
            "--training.seq_len", str(T), "--training.local_batch_size", "1", "--training.steps", str(steps),
            "--training.mixed_precision_param", "float32", "--data.source", "synthetic", "--model.vocab_size", "4096",
            "--data.num_workers", "1", "--compile.enable", "false", "--checkpoint.enable", "false",
            "--optimizer.implementation", "foreach", "--metrics.log_freq", "1", "--debug.profile_step",
            str(PROFILED_STEP), "--parallelism.context_parallel_degree", str(cp)]


def peak_tensor_bytes(trace: Path) -> float:
    """The profiled step's peak of live tensor memory on this rank (the profiler's allocation events)."""
    return max((e["args"]["Total Allocated"] for e in json.loads(trace.read_text())["traceEvents"]
                if e.get("name") == "[memory]" and "Total Allocated" in e.get("args", {})), default=0.0)


def collective_bytes(trace: Path, group: int) -> float:
    """Bytes received by this rank in the trace's functional all-gathers and reduce-scatters over
    `group` ranks (fp32): FSDP's own collectives are not functional ones."""
    total = 0.0
    for e in json.loads(trace.read_text())["traceEvents"]:
        name, args = e.get("name", ""), e.get("args", {})
        if e.get("ph") != "X" or not name.startswith("_c10d_functional::") or not args.get("Input Dims"):
            continue
        numel = math.prod(args["Input Dims"][0])
        if "all_gather" in name:
            total += numel * 4 * (group - 1)  # the others' parts
        elif "reduce_scatter" in name:
            total += numel * 4 * (group - 1) / group  # the others' contributions to this rank's part
    return total


def run(T: int, cp: int, layers: int, steps: int, ac: str, dump: Path) -> dict:
    env = {**os.environ, "NGPU": str(cp)}
    proc = subprocess.run([str(ROOT / "run_train.sh"), *overrides(T, cp, layers, steps, ac), "--job.dump_folder",
                           str(dump)], env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"T={T} cp={cp} failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    beats = {r: [json.loads(line) for line in (dump / "heartbeat" / f"rank{r}.jsonl").read_text().splitlines()]
             for r in range(cp)}
    traces = [dump / "profile" / f"rank{r}_step{PROFILED_STEP}.trace.json" for r in range(cp)]
    trace = traces[0]
    cfg, _ = load_config(overrides(T, cp, layers, steps, ac), world_size=cp)
    predicted = comm_bytes(cfg, 0, cp).get("context-parallel K/V", 0.0)
    return {"rss": max(b["rss_gib"] for r in beats for b in beats[r]), "tokens_per_s": statistics.mean(
                b["tokens_per_s"] for b in beats[0] if b["step"] > PROFILED_STEP),
            "tensors": max(peak_tensor_bytes(t) for t in traces) / 2**30,
            "moved": collective_bytes(trace, cp) if cp > 1 else 0.0, "predicted": predicted}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, nargs="+", default=[8192, 16384])
    parser.add_argument("--steps", type=int, default=5, help=f"steps (tokens/s: those after step {PROFILED_STEP})")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--ac", choices=("full", "none"), default="full",
                        help="activation checkpointing (m7c.toml: full)")
    args = parser.parse_args()
    print(f"M7C width, {args.layers} blocks, AC {args.ac}, fp32, batch 1, {os.cpu_count()} CPU cores, "
          f"{args.steps} steps\n")
    print("| T | peak live tensors per rank, cp=1 (GiB) | cp=2 (GiB) | cp=2 / cp=1 | peak RSS per rank, cp=1 (GiB) | "
          "cp=2 (GiB) | cp=2 / cp=1 | tokens/s cp=1 | cp=2 | cp bytes moved per step per rank (MiB) | planner (MiB) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for T in args.seq:
            one, two = (run(T, cp, args.layers, args.steps, args.ac, Path(tmp) / f"{T}-{cp}") for cp in (1, 2))
            print(f"| {T:,} | {one['tensors']:.2f} | {two['tensors']:.2f} | {two['tensors'] / one['tensors']:.2f}x | "
                  f"{one['rss']:.2f} | {two['rss']:.2f} | {two['rss'] / one['rss']:.2f}x | "
                  f"{one['tokens_per_s']:,.0f} | {two['tokens_per_s']:,.0f} | {two['moved'] / 2**20:,.1f} | "
                  f"{two['predicted'] / 2**20:,.1f} |", flush=True)


if __name__ == "__main__":
    main()
