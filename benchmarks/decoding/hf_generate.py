"""transformers' generate() on an nsa_titan model: the cost of one new token as the context grows,
with NSA's per-branch KV cache (what an export runs), without a cache (a full forward per token),
and for dense attention with its cache, side by side in one run.

    python benchmarks/decoding/hf_generate.py [--contexts 1024 4096 16384] [--steps 16] [--layers 2]

A model of M7C width (dim 768, 12 heads, 2 KV groups, head dim 64; NSA l=32, d=16, l'=64, n=16,
w=512) with `--layers` blocks and random weights, fp32 on the CPU, as the Hugging Face class an
export loads (NSATitanForCausalLM). For each context C: one greedy generate() of 1 + steps tokens
after a prompt of C tokens (min_new_tokens: none stops early); a logits processor stamps the time
at each new token, and the median gap between stamps is one new token's time (the prefill before
the first is left out). Without a cache, 3 steps are timed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import LogitsProcessor, LogitsProcessorList

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from nsa_titan.config import Model  # noqa: E402
from nsa_titan.hf import NSATitanForCausalLM  # noqa: E402
from nsa_titan.hf.export import model_config  # noqa: E402
from nsa_titan.models.decode import Decoder  # noqa: E402

VOCAB = 4096


def build(attention: str, layers: int, max_len: int) -> NSATitanForCausalLM:
    cfg = Model(attention=attention, dim=768, n_layers=layers, n_heads=12, n_kv_groups=2, head_dim=64, vocab_size=VOCAB)
    model = NSATitanForCausalLM(model_config(cfg, max_len, eos_token_id=VOCAB - 1))
    model.model.init_weights(0)
    return model.eval()


class Stamps(LogitsProcessor):
    """Records the time at which generate() asks for each new token's scores."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.times.append(time.perf_counter())
        return scores


def per_token_ms(model: NSATitanForCausalLM, context: int, steps: int, cache: bool) -> float:
    """The median time between consecutive new tokens of one greedy generate() (the prefill before the
    first is not in it)."""
    prompt = torch.randint(0, VOCAB - 1, (1, context), generator=torch.Generator().manual_seed(context))
    stamps = Stamps()
    with torch.no_grad():
        model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=steps + 1,
                       min_new_tokens=steps + 1, do_sample=False, use_cache=cache, pad_token_id=VOCAB - 1,
                       logits_processor=LogitsProcessorList([stamps]))
    return 1e3 * statistics.median(b - a for a, b in zip(stamps.times, stamps.times[1:]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args()
    torch.manual_seed(0)
    max_len = max(args.contexts) + args.steps + 2
    runs = {"NSA, cache": (build("nsa", args.layers, max_len), True, args.steps),
            "NSA, no cache": (build("nsa", args.layers, max_len), False, 3),
            "dense, cache": (build("dense", args.layers, max_len), True, args.steps)}
    print(f"ms per new token, generate(), {args.layers} M7C layers, fp32, {torch.get_num_threads()} threads "
          f"(x: to the first context's)")
    print("| context | NSA keys read per token | " + " | ".join(runs) + " |\n|---|---|" + "---|" * len(runs))
    first: dict[str, float] = {}
    for context in args.contexts:
        cells = []
        for name, (model, cache, steps) in runs.items():
            ms = per_token_ms(model, context, steps, cache)
            first.setdefault(name, ms)
            cells.append(f"{ms:.1f} ({ms / first[name]:.2f}x)")
        keys = sum(Decoder(runs["NSA, cache"][0].model).keys_read(context).values())
        print(f"| {context:,} | {keys:,} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
