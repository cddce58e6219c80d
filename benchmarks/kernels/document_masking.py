"""Document masking's cost: NSA with documents vs NSA without, and vs dense attention with the same mask.

    python benchmarks/kernels/document_masking.py [--T 8192 32768] [--mean 1024 4096] [--repeats 3] [--dense_repeats 1]
                                          [--variants nsa nsa-docs dense-docs] [--compile]

One M7C attention layer *module* (dim 768, 12 query heads, 2 KV groups, head dim 64; NSA l=32,
d=16, l'=64, n=16, w=512), batch 1, fp32 on CPU (bf16 on a GPU), forward + backward on x (1, T, 768),
projections and compression included:

  nsa           NSAAttention (attn_impl = "fast"), no documents: the unmasked cost at this T
  nsa-docs      the same with document_ids: documents with log-normal lengths of the given mean
  dense-docs    DenseAttention with the same documents (SDPA with a block-diagonal causal mask)

Each (variant, T, mean) runs in its own process: the median of `--repeats` timed runs after one
warm-up, and the peak resident memory it added. With `--compile` the module is
`torch.compile(module, fullgraph=True)` (the warm-up compiles it; one graph serves every layout). The ratios are taken between runs of this one
invocation, on the same machine. Also prints the keys a query attends to, averaged over the window.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from nsa_titan.config import Model  # noqa: E402
from nsa_titan.system.env import MALLOC_TUNING  # noqa: E402
from nsa_titan.models.attention import Documents  # noqa: E402
from nsa_titan.models.rope import rope_tables  # noqa: E402
from nsa_titan.models.transformer import DenseAttention, NSAAttention, nsa_spec  # noqa: E402

VARIANTS = ("nsa", "nsa-docs", "dense-docs")
M7C = dict(dim=768, n_heads=12, n_kv_groups=2, head_dim=64, cmp_block_size=32, cmp_stride=16, sel_block_size=64,
           sel_top_n=16, window_size=512)


def document_ids(T: int, mean: int, seed: int = 0) -> torch.Tensor:
    """(1, T): documents with log-normal lengths of the given mean (sigma 0.5), the last cut at T."""
    gen = torch.Generator().manual_seed(seed)
    sigma = 0.5
    lengths: list[int] = []
    while sum(lengths) < T:
        z = float(torch.randn(1, generator=gen))
        lengths.append(max(1, round(math.exp(math.log(mean) - sigma**2 / 2 + sigma * z))))
    ids = torch.cat([torch.full((n,), k) for k, n in enumerate(lengths)])[:T]
    return ids[None]


def keys_per_query(ids: torch.Tensor | None, T: int) -> float:
    """Mean keys a query attends to (per KV group) with these documents: NSA's count per document."""
    spec = nsa_spec(Model(**M7C))
    t = torch.arange(T, dtype=torch.float64)
    rel = t if ids is None else t - Documents.of(ids).start[0].double()
    return float(sum(spec.keys_per_query(rel).values()).mean())


def run_one(variant: str, T: int, mean: int, repeats: int, compile: bool) -> dict:
    """In a fresh process: median seconds of forward + backward, and the peak memory added (GiB)."""
    torch.manual_seed(0)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cfg = Model(**M7C, attention="dense" if variant.startswith("dense") else "nsa", attn_impl="fast")
    module = (DenseAttention(cfg) if cfg.attention == "dense" else NSAAttention(cfg)).to(device, dtype)
    for p in module.parameters():
        torch.nn.init.normal_(p, std=0.02)
    ids = None if variant == "nsa" else document_ids(T, mean)  # on the host, as the loader gives them
    x = torch.randn(1, T, cfg.dim, device=device, dtype=dtype, requires_grad=True)
    forward = torch.compile(module, fullgraph=True) if compile else module
    table = rope_tables(cfg, T, device).to(dtype)

    def step() -> None:
        docs, rope = None, table
        if ids is not None:
            docs = Documents.of(ids, module.spec if isinstance(module, NSAAttention) else None).to(device)
            rope = table[docs.positions]
        forward(x, rope, docs=docs).float().square().mean().backward()
        if device.type == "cuda":
            torch.cuda.synchronize()

    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    step()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return {"seconds": statistics.median(times), "peak_gib": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 2**20,
            "docs": 1 if ids is None else int(ids.max()) + 1}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--T", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--mean", type=int, nargs="+", default=[1024, 4096], help="mean document length")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dense_repeats", type=int, default=1, help="timed runs of dense-docs (slow: T^2)")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--compile", action="store_true", help="torch.compile the module (fullgraph)")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        variant, T, mean, repeats, compile = json.loads(args.one)
        print(json.dumps(run_one(variant, T, mean, repeats, compile)))
        return
    env = {**os.environ, **MALLOC_TUNING} if not torch.cuda.is_available() else dict(os.environ)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{'GPU ' + torch.cuda.get_device_name() if torch.cuda.is_available() else 'CPU fp32'}, host allocator tuned, "
          f"{'compiled' if args.compile else 'eager'}")
    print("| T | mean doc | docs | keys/query NSA (docs / none) | nsa s | nsa-docs s | dense-docs s | nsa-docs / nsa "
          "| dense-docs / nsa-docs | peak GiB nsa / nsa-docs / dense-docs |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for T in args.T:
        plain = None
        for mean in args.mean:
            results = {}
            for variant in args.variants:
                if variant == "nsa" and plain is not None:
                    results[variant] = plain
                    continue
                repeats = args.dense_repeats if variant == "dense-docs" else args.repeats
                out = subprocess.run([sys.executable, __file__, "--one",
                                      json.dumps([variant, T, mean, repeats, args.compile])],
                                     env=env, capture_output=True, text=True, check=True)
                results[variant] = json.loads(out.stdout.strip().splitlines()[-1])
            plain = results.get("nsa")
            r = {v: results.get(v, {"seconds": math.nan, "peak_gib": math.nan, "docs": 0}) for v in VARIANTS}
            ids = document_ids(T, mean)
            print(f"| {T:,} | {mean:,} | {int(ids.max()) + 1} | {keys_per_query(ids, T):,.0f} / "
                  f"{keys_per_query(None, T):,.0f} | {r['nsa']['seconds']:.2f} | {r['nsa-docs']['seconds']:.2f} | "
                  f"{r['dense-docs']['seconds']:.2f} | {r['nsa-docs']['seconds'] / r['nsa']['seconds']:.2f}x | "
                  f"{r['dense-docs']['seconds'] / r['nsa-docs']['seconds']:.2f}x | {r['nsa']['peak_gib']:.2f} / "
                  f"{r['nsa-docs']['peak_gib']:.2f} / {r['dense-docs']['peak_gib']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
