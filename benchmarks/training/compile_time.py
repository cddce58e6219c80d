"""Compile time and compiled speed of one NSA block, by sequence length.

    python benchmarks/training/compile_time.py [--T 2048 8192 32768] [--repeats 3] [--variants compiled eager]

One M7C block (`TransformerBlock`: dim 768, 12 query heads, 2 KV groups, head dim 64; NSA l=32,
d=16, l'=64, n=16, w=512; attn_impl = "fast"), batch 1, fp32 on CPU (bf16 on a GPU), forward +
backward on x (1, T, 768):

  compiled  torch.compile(block, fullgraph=True) with inductor, as `apply_compile` does: the time
            of the first call (tracing, compiling forward and backward, and running them once),
            then the median of `--repeats` calls; in the same process, the same block uncompiled
            called before each of them: eager / compiled taken call by call ("side by side", the
            median of the repeats), free of the drift between processes
  eager     the same block uncompiled: one warm-up call, then the median of `--repeats` calls

Each (variant, T) runs in its own process with inductor's caches off (TORCHINDUCTOR_FORCE_DISABLE_
CACHES=1), so each first call compiles from nothing. The first call also runs the step, which at 32k
takes more than half as long as compiling on a 2-core CPU: the first call less the median call is the
compile itself (and the first touch of the step's memory), the part that must not grow with T.
Also prints the nodes of the graph dynamo captured, its subgraphs included: without unrolled chunk
loops it is the same at every T.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch._dynamo
from torch._inductor.compile_fx import compile_fx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from nsa_titan.config import Model  # noqa: E402
from nsa_titan.system.env import MALLOC_TUNING  # noqa: E402
from nsa_titan.models.rope import rope_tables  # noqa: E402
from nsa_titan.models.transformer import TransformerBlock  # noqa: E402

M7C = dict(dim=768, n_heads=12, n_kv_groups=2, head_dim=64, cmp_block_size=32, cmp_stride=16, sel_block_size=64,
           sel_top_n=16, window_size=512, attn_impl="fast")


def run_one(variant: str, T: int, repeats: int) -> dict:
    """In a fresh process: the first call's seconds, the median of the next `repeats`, graph nodes."""
    torch.manual_seed(0)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    block = TransformerBlock(Model(**M7C)).to(device, dtype)
    block.init_weights(0.02, 0.02, torch.Generator().manual_seed(0))
    x = torch.randn(1, T, M7C["dim"], device=device, dtype=dtype, requires_grad=True)
    rope = rope_tables(Model(head_dim=M7C["head_dim"]), T, device).to(dtype)
    nodes: list[int] = []
    fn = block
    if variant == "compiled":
        def count(gm: torch.fx.GraphModule, example_inputs: list) -> object:
            nodes.append(sum(len(m.graph.nodes) for m in gm.modules() if isinstance(m, torch.fx.GraphModule)))
            return compile_fx(gm, example_inputs)

        torch._dynamo.reset()
        fn = torch.compile(block, backend=count, fullgraph=True)

    def step(call: Callable = fn) -> float:
        t0 = time.perf_counter()
        call(x, rope).float().square().mean().backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    first = step()
    if variant == "eager":
        return {"first": first, "seconds": statistics.median(step() for _ in range(repeats)), "nodes": 0}
    step(block)  # the eager block's warm-up, then eager and compiled call by call
    rounds = [(step(block), step()) for _ in range(repeats)]
    return {"first": first, "seconds": statistics.median(c for _, c in rounds), "nodes": sum(nodes),
            "side_by_side": statistics.median(e / c for e, c in rounds)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--T", type=int, nargs="+", default=[2048, 8192, 32768])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--variants", nargs="+", choices=["compiled", "eager"], default=["compiled", "eager"])
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        variant, T, repeats = json.loads(args.one)
        print(json.dumps(run_one(variant, T, repeats)))
        return
    env = {**os.environ, "TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1"}
    if not torch.cuda.is_available():
        env.update(MALLOC_TUNING)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{'GPU ' + torch.cuda.get_device_name() if torch.cuda.is_available() else 'CPU fp32, host allocator tuned'}")
    print("| T | variant | first call (s) | first call / first at the smallest T | first call - median (s) | that / "
          "at the smallest T | fwd+bwd median (s) | eager / this | eager / compiled, side by side | graph nodes |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    first_at: dict[str, float] = {}
    extra_at: dict[str, float] = {}
    for T in args.T:
        results = {}
        for variant in args.variants:
            out = subprocess.run([sys.executable, __file__, "--one", json.dumps([variant, T, args.repeats])], env=env,
                                 capture_output=True, text=True)
            if out.returncode != 0:
                raise SystemExit(f"{variant} at T={T} failed:\n{out.stderr[-3000:]}")
            results[variant] = json.loads(out.stdout.strip().splitlines()[-1])
        for variant, r in results.items():
            extra = r["first"] - r["seconds"]  # compiled: the compile itself, without the step it runs
            first_at.setdefault(variant, r["first"])
            extra_at.setdefault(variant, extra)
            speed = f"{results['eager']['seconds'] / r['seconds']:.2f}x" if "eager" in results else ""
            side = f"{r['side_by_side']:.3f}x" if "side_by_side" in r else ""
            print(f"| {T:,} | {variant} | {r['first']:.1f} | {r['first'] / first_at[variant]:.2f}x | {extra:.1f} | "
                  f"{extra / extra_at[variant]:.2f}x | {r['seconds']:.2f} | {speed} | {side} | {r['nodes'] or ''} |",
                  flush=True)


if __name__ == "__main__":
    main()
