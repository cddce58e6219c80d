"""Decoding with KV caches: tokens/s, attention time and what a new token reads, NSA vs dense, side by side.

    python benchmarks/decoding/decode_speed.py [--contexts 8192 32768] [--batch 1 8] [--dtype float32 bfloat16]
        [--layers 2] [--steps 16] [--fill prefill|random] [--pytorch]

Models of M7C width (dim 768, 12 heads, 2 KV groups, head dim 64, M7C's vocabulary of 49,152; NSA l=32, d=16,
l'=64, n=16, w=512) with `--layers` blocks and random weights, on the CPU, in each `--dtype` (the caches in
it too): bring B = `--batch` rows to a context of C tokens, then time `--steps` single-token steps (after 16
unmeasured ones) of NSA (its C++ decode step; with `--pytorch` also its PyTorch step) and of dense (SDPA over
its cache), in turn: a step of each, then the next (the machine's drift falls on both alike). `--fill prefill`
runs the prompt through the model; `--fill random` writes random keys and values of the right shapes into the
caches instead (what a step reads is the same; long contexts fit in minutes).
"Attention" is a layer's attention of the new token over its cache (`decode._attention`: for NSA a new
compressed block where one completes, cmp, the top-n, sel, win and the gated mix; for dense SDPA over every
key), without the projections in (q, keys, values, NSA's gates) and out. Keys read per token and KV group are
counted from the cache layout (cmp + sel + win for NSA, all C for dense); the limit is the bytes of keys and
values a token reads per layer, dense's over NSA's (the speed-up of a step bound by memory); the cache's bytes
per position and layer are its buffers', allocated once for the declared maximum context (C + steps + 17).
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from nsa_titan.config import Model  # noqa: E402
from nsa_titan.models import decode  # noqa: E402
from nsa_titan.models.decode import Decoder  # noqa: E402
from nsa_titan.models.transformer import NSAAttention, Transformer  # noqa: E402

VOCAB = 49152
"""M7C's vocabulary (SmolLM2's tokenizer): the output layer a token's logits read."""
WARMUP = 16
"""Unmeasured steps first: d = 16 of them, so that a compression step is among them (its first call's costs)."""


def random_fill(decoder: Decoder, batch: int, context: int, dtype: torch.dtype) -> None:
    """Each layer's caches as a prefill of `context` tokens in `batch` rows leaves them, with random entries."""
    gen = torch.Generator().manual_seed(0)
    length = torch.full((batch,), context)
    for block, cache in zip(decoder.model.layers.values(), decoder.caches):
        attn = block.attention
        G, D = attn.n_groups, attn.head_dim
        if isinstance(attn, NSAAttention):
            cache.n_cmp = torch.full((batch,), attn.spec.num_cmp_blocks(context))
        for name, size in cache.sizes.items():
            filled = int(cache.n_cmp[0]) if name in ("kc", "vc") else min(size, context)
            cache.put(name, torch.randn(batch, filled, G, D, generator=gen).to(dtype), length)
    decoder.t, decoder.at = length, [context] * batch
    decoder.last = torch.zeros(batch, 1, dtype=torch.long)


def timed(decoders: dict[str, Decoder], tokens: dict[str, torch.Tensor], steps: int
          ) -> dict[str, tuple[float, float]]:
    """{path: (tokens/s of `steps` steps, seconds of attention per layer and step)}, from the decoders' states after
    WARMUP unmeasured steps; the decoders take their steps in turn (one of each, then the next), so that the
    machine's drift (a neighbour's memory traffic) falls on every path alike. The path "pytorch" decodes with NSA's
    C++ kernels off."""
    spent, total, now, real = dict.fromkeys(decoders, 0.0), dict.fromkeys(decoders, 0.0), [""], decode._attention

    def attention(*args: object) -> torch.Tensor:
        start = time.perf_counter()
        out = real(*args)
        spent[now[0]] += time.perf_counter() - start
        return out

    def step(path: str, i: int) -> None:
        now[0] = path
        start = time.perf_counter()
        decoders[path].step(tokens[path][:, i:i + 1])
        total[path] += time.perf_counter() - start

    try:
        for i in range(WARMUP):
            for path in decoders:
                step(path, i)
        total = dict.fromkeys(decoders, 0.0)
        decode._attention = attention
        for i in range(WARMUP, WARMUP + steps):
            for path in decoders:
                step(path, i)
    finally:
        decode._attention = real
    return {path: (steps * tokens[path].shape[0] / total[path], spent[path] / steps / len(decoders[path].caches))
            for path in decoders}


def decoder(attention: str, args: argparse.Namespace, context: int, batch: int, dtype: torch.dtype,
            copies: int = 1) -> tuple[list[Decoder], torch.Tensor, tuple[int, float, float]]:
    """`copies` decoders of a fresh model (`attention`: nsa or dense) brought to `context` tokens, the tokens of their
    steps, and (keys read per token and KV group, bytes of keys and values read per token and layer, cache bytes
    per position and layer)."""
    cfg = Model(attention=attention, attn_impl="fast", dim=768, n_layers=args.layers, n_heads=12, n_kv_groups=2,
                head_dim=64, vocab_size=VOCAB)
    model = Transformer(cfg, context + args.steps + WARMUP + 1)
    model.init_weights(0)
    model = model.to(dtype).eval()
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (batch, context + WARMUP + args.steps), generator=gen)
    first = Decoder(model, context=model.max_seq_len)  # its prompt and every step
    if args.fill == "prefill":
        first.prefill(tokens[:, :context])
    else:
        random_fill(first, batch, context, dtype)
    decoders = [first] + [copy.deepcopy(first) for _ in range(copies - 1)]
    keys = sum(first.keys_read(context).values())
    read = keys * cfg.n_kv_groups * 2 * cfg.head_dim * dtype.itemsize
    cache = sum(c.nbytes() for c in first.caches) / model.max_seq_len / args.layers / batch
    return decoders, tokens[:, context:], (keys, read, cache)


def run(args: argparse.Namespace, context: int, batch: int, dtype: torch.dtype
        ) -> dict[str, tuple[float, float, int, float, float]]:
    """{path: (tokens/s, attention seconds per layer and token, keys read per token and KV group, bytes of keys
    and values read per token and layer, cache bytes per position and layer)}: NSA's C++ step ("cpp"), with
    `--pytorch` its PyTorch step, and dense, timed in turn."""
    nsa, nsa_tokens, nsa_counts = decoder("nsa", args, context, batch, dtype, 2 if args.pytorch else 1)
    dense, dense_tokens, dense_counts = decoder("dense", args, context, batch, dtype)
    if args.pytorch:
        nsa[1].kernel = "torch"  # its PyTorch step
    paths = {"cpp": nsa[0], "dense": dense[0], **({"pytorch": nsa[1]} if args.pytorch else {})}
    tokens = {"cpp": nsa_tokens, "pytorch": nsa_tokens, "dense": dense_tokens}
    counts = {"cpp": nsa_counts, "pytorch": nsa_counts, "dense": dense_counts}
    return {path: (*speed, *counts[path]) for path, speed in timed(paths, tokens, args.steps).items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--batch", type=int, nargs="+", default=[1])
    parser.add_argument("--dtype", nargs="+", choices=["float32", "bfloat16"], default=["float32"])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--fill", choices=["prefill", "random"], default="prefill")
    parser.add_argument("--pytorch", action="store_true", help="also time NSA's PyTorch step")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    print(f"{args.layers} layers, caches by {args.fill}; tokens/s over the batch; attention: ms per layer and token"
          + ("; [PyTorch step's attention ms]" if args.pytorch else ""))
    print("| dtype | batch | context | tokens/s: NSA / dense | NSA / dense | attention ms: NSA / dense | dense / NSA | "
          "keys read: NSA / dense | limit: KV bytes read, dense / NSA | cache bytes/position: NSA / dense |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in args.dtype:
        for batch in args.batch:
            for c in args.contexts:
                results = run(args, c, batch, getattr(torch, name))
                dense, (tps, ms, keys, read, cache) = results["dense"], results["cpp"]
                extra = f" [{1e3 * results['pytorch'][1]:.2f}]" if "pytorch" in results else ""
                print(f"| {name} | {batch} | {c:,} | {tps:.1f} / {dense[0]:.1f} | {tps / dense[0]:.2f}x | "
                      f"{1e3 * ms:.3f}"
                      f"{extra} / {1e3 * dense[1]:.3f} | {dense[1] / ms:.2f}x | {keys:,} / {dense[2]:,} | "
                      f"{read / 1e6:.2f} / {dense[3] / 1e6:.2f} MB ({dense[3] / read:.2f}x) | {cache:,.0f} / "
                      f"{dense[4]:,.0f} ({cache / dense[4]:.2f}x) |", flush=True)


if __name__ == "__main__":
    main()
