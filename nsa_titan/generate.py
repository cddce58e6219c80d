"""Sample text from a trained model, streaming tokens to the terminal.

    python -m nsa_titan.generate outputs/debug_model/checkpoint/step-300 --prompt "The with statement" \\
        [--max_new_tokens 200] [--temperature 0.8] [--top_k 50] [--top_p 0.95] [--seed 0] [--section.key value]

The prompt is prefilled by the training forward; every new token is one incremental step over
the per-branch KV caches (see nsa_titan/models/decode.py), whose logits equal a full forward's.
The prompt and the new tokens fit the model's declared maximum context (docs/long-context.md);
config overrides (`--model.max_seq_len 8192`) apply to the checkpoint's config.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator

import torch

from .cli import ArgumentParser, run_command
from .data import Tokenizer
from .data.batch import eos_documents
from .inference import load_model
from .models.decode import Decoder
from .models.transformer import Transformer


def sample_next(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                gen: torch.Generator) -> torch.Tensor:
    """One token id per row of logits (B, V): greedy at temperature 0, else top-k / top-p sampling."""
    if temperature <= 0:
        return logits.argmax(-1)
    logits = logits.float() / temperature
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = torch.softmax(sorted_logits, -1).cumsum(-1)
        drop = cum - torch.softmax(sorted_logits, -1) > top_p  # keep the smallest set reaching top_p
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return torch.multinomial(torch.softmax(logits, -1), 1, generator=gen).squeeze(-1)


def prompt_ids(tokenizer: Tokenizer, prompt: str) -> list[int]:
    """The prompt's token ids (<eos> for an empty prompt)."""
    return tokenizer.encode(prompt) or [tokenizer.eos_id]


def generate(model: Transformer, tokenizer: Tokenizer, prompt: str, max_new_tokens: int, temperature: float = 0.8,
             top_k: int = 50, top_p: float = 1.0, seed: int = 0, document_masking: bool = False) -> Iterator[int]:
    """Yield new token ids one at a time (stops at <eos>). With `document_masking` (as the model was
    trained), an <eos> in the prompt ends a document and the new tokens continue the last one."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.tensor([prompt_ids(tokenizer, prompt)])
    decoder = Decoder(model)
    logits = decoder.prefill(ids, eos_documents(ids, tokenizer.eos_id) if document_masking else None)[:, -1]
    for _ in range(max_new_tokens):
        token = sample_next(logits, temperature, top_k, top_p, gen)
        if int(token) == tokenizer.eos_id:
            return
        yield int(token)
        logits = decoder.step(token.view(1, 1))[:, -1]


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="nsa_titan.generate", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="a step-N checkpoint folder or an exported .pt file")
    parser.add_argument("--prompt", default="")
    parser.add_argument("--max_new_tokens", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top_k", type=int, default=50)
    parser.add_argument("--top_p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--config", help="the training config (default: the checkpoint's config.toml)")
    args, overrides = parser.parse_known_args(argv)
    for bad, why in ((args.max_new_tokens < 1, "--max_new_tokens must be >= 1"),
                     (args.temperature < 0, "--temperature must be >= 0 (0: greedy)"),
                     (args.top_k < 0, "--top_k must be >= 0 (0: off)"),
                     (not 0 < args.top_p <= 1, "--top_p must lie in (0, 1]")):
        if bad:
            parser.error(why)
    return run_command("nsa_titan.generate", lambda: _generate(args, overrides))


def _generate(args: argparse.Namespace, overrides: list[str]) -> int:
    context = lambda tok: len(prompt_ids(tok, args.prompt)) + args.max_new_tokens  # noqa: E731
    model, tokenizer, cfg = load_model(args.checkpoint, args.config, overrides,
                                       context=("the prompt and --max_new_tokens", context))
    ids: list[int] = []
    shown = ""
    print(args.prompt, end="", flush=True)
    for token in generate(model, tokenizer, args.prompt, args.max_new_tokens, args.temperature, args.top_k,
                          args.top_p, args.seed, cfg.training.document_masking):
        ids.append(token)
        text = tokenizer.decode(ids)
        print(text[len(shown):], end="", flush=True)  # stream what the new token added
        shown = text
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
