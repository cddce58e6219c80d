"""Sample text from a trained model, streaming tokens to the terminal.

    python -m nsa_titan.generate outputs/debug_model/checkpoint/step-300 --prompt "The with statement" \\
        [--max_new_tokens 200] [--temperature 0.8] [--top_k 50] [--top_p 0.95] [--seed 0] [--section.key value]
    python -m nsa_titan.generate CHECKPOINT --prompt "def" --prompt "The with" [--prompts_file F] [--batch_size 8]

Several prompts are decoded in batches, each row at its own position, and printed `[i] prompt + text` when
done; prompt i samples with seed + i, so its text does not depend on the batch it is in.

The prompt is prefilled by the training forward; every new token is one incremental step over
the per-branch KV caches (see nsa_titan/models/decode.py), whose logits equal a full forward's.
The prompt and the new tokens fit the model's declared maximum context (docs/long-context.md);
config overrides (`--model.max_seq_len 8192`, `--model.decode_kernels torch`) apply to the checkpoint's config.
The decoding step's kernel is checked against the model's forward first (`[model] verify_kernels`).
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from pathlib import Path

import torch

from .checkpoint.inference import load_model
from .config import ConfigError
from .data import Tokenizer
from .data.batch import document_ids
from .models.decode import Decoder
from .models.transformer import Transformer
from .runtime.kernel_check import verified_decode
from .system.cli import ArgumentParser, leave, run_command


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


def decode_rows(decoder: Decoder, tokenizer: Tokenizer, prompts: list[list[int]], max_new_tokens: int,
                temperature: float, top_k: int, top_p: float, seeds: list[int], document_masking: bool
                ) -> Iterator[torch.Tensor]:
    """Each step's new token (B,) of every prompt, the prompts (token ids) left-padded into one batch (the
    padding a document of its own; each row decodes at its own position) and decoded by `decoder` (the path
    transformers' generate() takes: nsa_titan/hf). Row b samples with its own generator, seeded `seeds[b]`, so its
    tokens do not depend on the rows beside it."""
    eos, width = tokenizer.eos_id, max(map(len, prompts))
    ids = torch.tensor([[eos] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    gens = [torch.Generator().manual_seed(s) for s in seeds]
    logits = decoder.prefill(ids, document_ids(ids, mask, eos if document_masking else None))[:, -1]
    for k in range(max_new_tokens):
        token = torch.cat([sample_next(logits[b:b + 1], temperature, top_k, top_p, g) for b, g in enumerate(gens)])
        yield token
        if k + 1 < max_new_tokens:
            logits = decoder.step(token[:, None])[:, -1]


def request_decoder(model: Transformer, prompts: list[list[int]], max_new_tokens: int, kernel: str) -> Decoder:
    """A decoder whose caches hold the longest prompt and its new tokens (the last is never fed back), reused
    batch after batch."""
    return Decoder(model, kernel, max(map(len, prompts)) + max_new_tokens - 1)


def generate(model: Transformer, tokenizer: Tokenizer, prompt: str, max_new_tokens: int, temperature: float = 0.8,
             top_k: int = 50, top_p: float = 1.0, seed: int = 0, document_masking: bool = False,
             kernel: str = "auto") -> Iterator[int]:
    """Yield new token ids one at a time (stops at <eos>). With `document_masking` (as the model was
    trained), an <eos> in the prompt ends a document and the new tokens continue the last one."""
    ids = [prompt_ids(tokenizer, prompt)]
    for token in decode_rows(request_decoder(model, ids, max_new_tokens, kernel), tokenizer, ids, max_new_tokens,
                             temperature, top_k, top_p, [seed], document_masking):
        if int(token) == tokenizer.eos_id:
            return
        yield int(token)


def generate_batch(model: Transformer, tokenizer: Tokenizer, prompts: list[str], max_new_tokens: int,
                   temperature: float = 0.8, top_k: int = 50, top_p: float = 1.0, seed: int = 0,
                   document_masking: bool = False, batch_size: int = 8, kernel: str = "auto") -> list[list[int]]:
    """The new token ids of each prompt (up to <eos>), `batch_size` prompts decoded at once; prompt i samples
    with seed `seed + i`, so each row's tokens are those of `generate(prompt, seed=seed + i)`."""
    ids = [prompt_ids(tokenizer, p) for p in prompts]
    decoder, out = request_decoder(model, ids, max_new_tokens, kernel), []
    for first in range(0, len(prompts), batch_size):
        chunk = ids[first:first + batch_size]
        rows: list[list[int]] = [[] for _ in chunk]
        done = torch.zeros(len(chunk), dtype=torch.bool)
        seeds = [seed + first + i for i in range(len(chunk))]
        for token in decode_rows(decoder, tokenizer, chunk, max_new_tokens, temperature, top_k, top_p, seeds,
                                 document_masking):
            done |= token == tokenizer.eos_id
            for b in (~done).nonzero().flatten().tolist():
                rows[b].append(int(token[b]))
            if bool(done.all()):
                break
        out += rows
    return out


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="nsa_titan.generate", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="a step-N checkpoint folder or an exported .pt file")
    parser.add_argument("--prompt", action="append", help="a prompt; repeat it for several, decoded in batches")
    parser.add_argument("--prompts_file", help="a text file of prompts, one a line (with or beside --prompt)")
    parser.add_argument("--batch_size", type=int, default=8, help="prompts decoded at once")
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
                     (not 0 < args.top_p <= 1, "--top_p must lie in (0, 1]"),
                     (args.batch_size < 1, "--batch_size must be >= 1")):
        if bad:
            parser.error(why)
    return run_command("nsa_titan.generate", lambda: _generate(args, overrides))


def _prompts(args: argparse.Namespace) -> list[str]:
    """The prompts of --prompt and --prompts_file, in that order (one empty prompt if none)."""
    prompts = list(args.prompt or [])
    if args.prompts_file:
        try:
            prompts += Path(args.prompts_file).read_text().splitlines()
        except OSError as e:
            raise ConfigError(f"--prompts_file {args.prompts_file}: {e.strerror}: give a text file, one prompt a line")
    return prompts or [""]


def _generate(args: argparse.Namespace, overrides: list[str]) -> int:
    prompts = _prompts(args)
    context = lambda tok: max(len(prompt_ids(tok, p)) for p in prompts) + args.max_new_tokens  # noqa: E731
    model, tokenizer, cfg = load_model(args.checkpoint, args.config, overrides,
                                       context=("the prompt and --max_new_tokens", context))
    weight = model.output.weight  # the decoding step's kernel, checked here ([model] decode_kernels, verify_kernels)
    wrap = None
    if cfg.debug.fault_kernel:  # (tests: a wrong or slow step)
        from .runtime.fault_injection import kernel_fault

        wrap = kernel_fault(cfg.debug)[1]
    kernel = verified_decode(cfg.model, weight.device, weight.dtype, wrap=wrap, context=context(tokenizer))
    sampling = (args.temperature, args.top_k, args.top_p, args.seed, cfg.training.document_masking)
    if len(prompts) > 1:
        rows = generate_batch(model, tokenizer, prompts, args.max_new_tokens, *sampling, batch_size=args.batch_size,
                              kernel=kernel)
        for i, (prompt, row) in enumerate(zip(prompts, rows)):
            print(f"[{i}] {prompt}{tokenizer.decode(row)}")
        return 0
    ids: list[int] = []
    shown = ""
    print(prompts[0], end="", flush=True)
    for token in generate(model, tokenizer, prompts[0], args.max_new_tokens, *sampling, kernel=kernel):
        ids.append(token)
        text = tokenizer.decode(ids)
        print(text[len(shown):], end="", flush=True)  # stream what the new token added
        shown = text
    print()
    return 0


if __name__ == "__main__":
    leave(main())
