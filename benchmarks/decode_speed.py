"""Decoding with KV caches: tokens/s, attention time and keys read per new token, NSA vs dense, side by side.

    python benchmarks/decode_speed.py [--contexts 2048 8192 32768] [--steps 16] [--layers 2] [--batch 1]

A model of M7C width (dim 768, 12 heads, 2 KV groups, head dim 64; NSA l=32, d=16, l'=64, n=16,
w=512) with `--layers` blocks and random weights, fp32 on the CPU: prefill a context of C
tokens in `--batch` rows, then time `--steps` single-token decoding steps from that same state three ways:
NSA's step by its C++ kernels (the default on CPUs), NSA's step in PyTorch, and dense. "Attention" is a
layer's attention of the new token over its cache (`decode._attention`: for NSA a new compressed block where
one completes, cmp, the top-n, sel, win and the gated mix; for dense SDPA over every key), without the
projections in and out. Keys read per token and KV group are counted from the cache layout (cmp + sel + win for NSA,
all C for dense); the cache's bytes per position and layer are its buffers', allocated once for the model's
declared maximum context (C + steps + 1), over it.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nsa_titan.config import Model  # noqa: E402
from nsa_titan.models import decode  # noqa: E402
from nsa_titan.models.decode import Decoder  # noqa: E402
from nsa_titan.models.transformer import Transformer  # noqa: E402


def decoded(decoder: Decoder, tokens: torch.Tensor, context: int, steps: int) -> tuple[float, float]:
    """(tokens/s of `steps` steps from the decoder's state, seconds of attention per layer and step)."""
    spent, real = [0.0], decode._attention

    def timed(*args: object) -> torch.Tensor:
        start = time.perf_counter()
        out = real(*args)
        spent[0] += time.perf_counter() - start
        return out

    decode._attention = timed
    try:
        start = time.perf_counter()
        for t in range(context, context + steps):
            decoder.step(tokens[:, t:t + 1])
        elapsed = time.perf_counter() - start
    finally:
        decode._attention = real
    return steps * tokens.shape[0] / elapsed, spent[0] / steps / len(decoder.caches)


def run(attention: str, context: int, steps: int, layers: int, batch: int) -> dict[str, tuple[float, float, int, float]]:
    """{path: (tokens/s, attention seconds per layer and token, keys read, cache bytes per position and layer)}."""
    cfg = Model(attention=attention, attn_impl="fast", dim=768, n_layers=layers, n_heads=12, n_kv_groups=2,
                head_dim=64, vocab_size=4096)
    model = Transformer(cfg, context + steps + 1)
    model.init_weights(0)
    model.eval()
    tokens = torch.randint(0, 4096, (batch, context + steps), generator=torch.Generator().manual_seed(0))
    prefilled = Decoder(model)
    prefilled.prefill(tokens[:, :context])
    keys = sum(prefilled.keys_read(context).values())
    cache = sum(c.nbytes() for c in prefilled.caches) / model.max_seq_len / layers / batch
    paths = {"cpp": None, "pytorch": lambda: None} if attention == "nsa" else {"dense": None}
    results = {}
    for path, no_kernels in paths.items():
        real = decode.cpu_attention.kernels
        decode.cpu_attention.kernels = no_kernels or real
        try:
            results[path] = (*decoded(copy.deepcopy(prefilled), tokens, context, steps), keys, cache)
        finally:
            decode.cpu_attention.kernels = real
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192, 32768])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=1)
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    print(f"batch {args.batch}, {args.layers} layers; tokens/s over the batch; attention: ms per layer and token")
    print("| context | tokens/s: NSA C++ / NSA PyTorch / dense | NSA C++ / dense | attention ms: NSA C++ / NSA "
          "PyTorch / dense | dense / NSA C++ | keys read: NSA / dense | cache bytes: NSA / dense |")
    print("|---|---|---|---|---|---|---|")
    for c in args.contexts:
        nsa = run("nsa", c, args.steps, args.layers, args.batch)
        dense = run("dense", c, args.steps, args.layers, args.batch)["dense"]
        (cpp, cpp_ms, keys, cache), (py, py_ms, _, _) = nsa["cpp"], nsa["pytorch"]
        print(f"| {c:,} | {cpp:.1f} / {py:.1f} / {dense[0]:.1f} | {cpp / dense[0]:.2f}x | {1e3 * cpp_ms:.2f} / "
              f"{1e3 * py_ms:.2f} / {1e3 * dense[1]:.2f} | {dense[1] / cpp_ms:.2f}x | {keys:,} / {dense[2]:,} "
              f"({dense[2] / keys:.1f}x fewer) | {cache:,.0f} / {dense[3]:,.0f} ({cache / dense[3]:.2f}x) |", flush=True)


if __name__ == "__main__":
    main()
