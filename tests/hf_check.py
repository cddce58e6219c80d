"""Runs in a fresh interpreter for test_hf.py: loads exported folders the way a transformers user does
(`trust_remote_code=True`, nothing of nsa_titan imported first) and records what the tests compare.

    python tests/hf_check.py REQUEST.json RESULT.pt

REQUEST.json: {"folders": {name: {"dir", "ids": [[...]], "prompt": [...]}}, "new_tokens": N, "texts": [...],
"batch_texts": [...]}.
Per folder: the decoding step's kernel (as exported, and with `decode_kernels="torch"` given), the class's module, the logits of `ids`, greedy generate() of `prompt` with the tokens the
blocks ran through a full forward and the incremental steps taken, the logits of one more token after a
prefilled cache (and whether the prefix was recomputed for it), AutoTokenizer's ids of `texts`, and greedy
generate() of `batch_texts` in one left-padded batch and each alone, and what a right-padded batch gets.
"""

from __future__ import annotations

import json
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def check(folder: str, ids: list[list[int]], prompt: list[int], req: dict) -> dict:
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
    model.decode_kernel(len(prompt) + req["new_tokens"])  # the generate() request's timing, before anything is counted
    kernels = {"decode_kernel": model.decode_kernel(),  # its check, once, before anything is counted
               "decode_kernel_torch": AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True,
                                                                         decode_kernels="torch").decode_kernel()}
    from nsa_titan.models.decode import Decoder  # the installed nsa_titan the remote code runs
    from nsa_titan.models.transformer import TransformerBlock

    counts = {"block_tokens": 0, "steps": 0}
    block_forward, step = TransformerBlock.forward, Decoder.step

    def counted_forward(self, x, *args, **kwargs):
        counts["block_tokens"] += x.shape[1]
        return block_forward(self, x, *args, **kwargs)

    def counted_step(self, token, starts=None):
        counts["steps"] += 1
        return step(self, token, starts)

    TransformerBlock.forward, Decoder.step = counted_forward, counted_step
    try:
        return {**_record(model, tokenizer, ids, prompt, req, counts), **kernels}
    finally:
        TransformerBlock.forward, Decoder.step = block_forward, step


def _record(model, tokenizer, ids: torch.Tensor, prompt: torch.Tensor, req: dict, counts: dict) -> dict:
    ids, prompt = torch.tensor(ids), torch.tensor([prompt])
    with torch.no_grad():
        logits = model(ids).logits
        n_layers = model.config.num_hidden_layers
        counts.update(block_tokens=0, steps=0)
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=req["new_tokens"],
                             do_sample=False)
        generated = dict(counts)
        counts.update(block_tokens=0, steps=0)
        first = model(prompt, use_cache=True)
        cache = first.cache if hasattr(first, "cache") else first.past_key_values
        before = dict(counts)
        one = model(ids[:1, :1], cache=cache).logits
        after = {k: counts[k] - before[k] for k in counts}
        full = model(torch.cat([prompt, ids[:1, :1]], 1)).logits[:, -1:]
        batched, alone = _batched_and_alone(model, tokenizer, req["batch_texts"], req["new_tokens"])
        try:  # right padding: refused
            model.generate(torch.cat([prompt, prompt]), attention_mask=torch.tensor([[1] * prompt.shape[1]] * 2)
                           .index_fill(1, torch.tensor([prompt.shape[1] - 1]), 0), max_new_tokens=2, do_sample=False)
            right_padded = "not refused"
        except ValueError as e:
            right_padded = str(e)
    return {"batched": batched, "alone": alone, "right_padded": right_padded, "module": type(model).__module__, "dtype": str(model.dtype), "logits": logits,
            "generated": out[0, prompt.shape[1]:].tolist(), "generate_counts": generated, "n_layers": n_layers,
            "one_token_counts": after, "one_token_logits": one, "one_token_full": full,
            "eos": tokenizer.eos_token_id, "bos": tokenizer.bos_token_id,
            "encoded": [tokenizer(t, add_special_tokens=False).input_ids for t in req["texts"]],
            "decoded": [tokenizer.decode(tokenizer(t, add_special_tokens=False).input_ids) for t in req["texts"]]}


def _batched_and_alone(model, tokenizer, texts: list[str], new_tokens: int) -> tuple[list, list]:
    """Greedy generate() of `texts` in one left-padded batch, and of each alone: the new tokens of each."""
    tokenizer.padding_side = "left"
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    batch = tokenizer(texts, return_tensors="pt", padding=True) if tokenizer.pad_token_id is not None else \
        _left_padded([tokenizer(t).input_ids for t in texts], pad)
    out = model.generate(**batch, max_new_tokens=new_tokens, do_sample=False, pad_token_id=pad)
    batched = out[:, batch["input_ids"].shape[1]:].tolist()
    alone = []
    for t in texts:
        ids = torch.tensor([tokenizer(t).input_ids])
        alone.append(model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                    do_sample=False, pad_token_id=pad)[0, ids.shape[1]:].tolist())
    return batched, alone


def _left_padded(rows: list[list[int]], pad: int) -> dict[str, torch.Tensor]:
    width = max(map(len, rows))
    return {"input_ids": torch.tensor([[pad] * (width - len(r)) + r for r in rows]),
            "attention_mask": torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])}


def main() -> None:
    req = json.loads(open(sys.argv[1]).read())
    torch.save({name: check(f["dir"], f["ids"], f["prompt"], req) for name, f in req["folders"].items()}, sys.argv[2])


if __name__ == "__main__":
    main()
