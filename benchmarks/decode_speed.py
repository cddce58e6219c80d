"""Decoding with KV caches: tokens/s and keys read per new token, NSA vs dense, side by side.

    python benchmarks/decode_speed.py [--contexts 2048 8192 32768] [--steps 16] [--layers 2]

A model of M7C width (dim 768, 12 heads, 2 KV groups, head dim 64; NSA l=32, d=16, l'=64, n=16,
w=512) with `--layers` blocks and random weights, fp32 on the CPU: prefill a context of C
tokens, then time `--steps` single-token decoding steps. Keys read per token and KV group are
counted from the cache layout (cmp + sel + win for NSA, all C for dense); the cache's bytes per position and
layer are its buffers', allocated once for the model's declared maximum context (C + steps + 1), over it.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nsa_titan.config import Model  # noqa: E402
from nsa_titan.models.decode import Decoder  # noqa: E402
from nsa_titan.models.transformer import Transformer  # noqa: E402


def run(attention: str, context: int, steps: int, layers: int) -> tuple[float, int, float]:
    cfg = Model(attention=attention, attn_impl="fast", dim=768, n_layers=layers, n_heads=12, n_kv_groups=2,
                head_dim=64, vocab_size=4096)
    model = Transformer(cfg, context + steps + 1)
    model.init_weights(0)
    model.eval()
    tokens = torch.randint(0, 4096, (1, context + steps), generator=torch.Generator().manual_seed(0))
    decoder = Decoder(model)
    decoder.prefill(tokens[:, :context])
    start = time.perf_counter()
    for t in range(context, context + steps):
        decoder.step(tokens[:, t:t + 1])
    tokens_per_s = steps / (time.perf_counter() - start)
    cache = sum(c.nbytes() for c in decoder.caches) / model.max_seq_len / layers  # per position and layer
    return tokens_per_s, sum(decoder.keys_read(context).values()), cache


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192, 32768])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    print("| context | NSA tokens/s | dense tokens/s | NSA / dense speed | keys read per token: NSA | dense | dense / NSA "
          "| cache bytes per position and layer: NSA | dense | NSA / dense |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for c in args.contexts:
        nsa_tps, nsa_keys, nsa_cache = run("nsa", c, args.steps, args.layers)
        dense_tps, dense_keys, dense_cache = run("dense", c, args.steps, args.layers)
        print(f"| {c:,} | {nsa_tps:.1f} | {dense_tps:.1f} | {nsa_tps / dense_tps:.2f}x | {nsa_keys:,} | {dense_keys:,} | "
              f"{dense_keys / nsa_keys:.1f}x | {nsa_cache:,.0f} | {dense_cache:,.0f} | {nsa_cache / dense_cache:.2f}x |",
              flush=True)


if __name__ == "__main__":
    main()
