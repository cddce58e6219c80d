"""The C++ sel backward (or forward) alone: query by query against block by block at several query-chunk sizes.

    python benchmarks/kernels/sel_backward.py [--T 8192 32768] [--chunk_mib 0 1 2 4] [--batch 1] [--docs] [--repeats 3]
                                      [--forward]

Per T, in one process: random q (batch, 2 KV groups, T, 6 heads, 64) and sel keys and values at the
M7C shape, the sel blocks chosen by the cmp branch over random compressed keys (as training picks
them), the forward once, then the backward `repeats` times per setting; prints the minimum seconds.
`--chunk_mib 0` is the block-by-block backward with all queries in one chunk (the first block-by-block version).
Sets `cpu_attention.ROWS_MAX_KEYS` and `CHUNK_BYTES` per row; what training uses is their defaults.
`--forward` times the forward instead (`FORWARD_ROWS_MAX_KEYS` for the query-by-query row).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from nsa_titan.models.attention import NSASpec  # noqa: E402
from nsa_titan.models.attention.families.cpp import cpu_attention  # noqa: E402
from test_cpu_attention import sel_inputs  # noqa: E402  (the kernel tests' inputs, at the M7C shape)

SPEC = NSASpec(l=32, d=16, l_sel=64, n=16, w=512)


def seconds(run: Callable[[], object], repeats: int) -> float:
    """The least seconds of `repeats` calls of run()."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--T", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--chunk_mib", type=float, nargs="+", default=[0, 1, 2, 4])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--docs", action="store_true", help="random documents (~4 per row)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--forward", action="store_true", help="time the forward instead of the backward")
    a = parser.parse_args()
    if problem := cpu_attention.problem(torch.device("cpu"), torch.float32, SPEC, 6, 64):
        sys.exit(problem)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, batch {a.batch}, documents {a.docs}, "
          f"{'forward' if a.forward else 'backward'}")
    print("| T | query by query | " + " | ".join(f"blocks, {c:g} MiB chunks" if c else "blocks, one chunk"
                                                  for c in a.chunk_mib) + " |")
    print("|---" * (len(a.chunk_mib) + 2) + "|")
    for T in a.T:
        args = sel_inputs(a.batch, 2, T, 6, 64, SPEC, a.docs, seed=0)
        out, lse = cpu_attention.sel_forward(*args[:5], SPEC, args[5], 0)
        d_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
        if a.forward:
            threshold, run = "FORWARD_ROWS_MAX_KEYS", lambda: cpu_attention.sel_forward(*args[:5], SPEC, args[5], 0)
        else:
            threshold, run = "ROWS_MAX_KEYS", lambda: cpu_attention.sel_backward(d_out, *args[:5], out, lse, SPEC,
                                                                                   args[5], 0)
        setattr(cpu_attention, threshold, 1 << 30)
        row = [seconds(run, a.repeats)]
        setattr(cpu_attention, threshold, 0)
        for c in a.chunk_mib:
            cpu_attention.CHUNK_BYTES = int(c * 2**20) if c else 1 << 40
            row.append(seconds(run, a.repeats))
        print(f"| {T:,} | " + " | ".join(f"{s:.3f}" for s in row) + " |", flush=True)


if __name__ == "__main__":
    main()
