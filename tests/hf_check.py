"""Runs in a fresh interpreter for test_hf.py: loads exported folders the way a transformers user does
(`trust_remote_code=True`, nothing of nsa_titan imported first) and records what the tests compare.

    python tests/hf_check.py REQUEST.json RESULT.pt

REQUEST.json: {"folders": {name: {"dir", "ids": [[...]], "prompt": [...]}}, "new_tokens": N, "texts": [...]}.
Per folder: the class's module, the logits of `ids`, greedy generate() of `prompt` with the tokens the
blocks ran through a full forward and the incremental steps taken, the logits of one more token after a
prefilled cache (and whether the prefix was recomputed for it), and AutoTokenizer's ids of `texts`.
"""

from __future__ import annotations

import json
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def check(folder: str, ids: list[list[int]], prompt: list[int], req: dict) -> dict:
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
    from nsa_titan.models.decode import Decoder  # the installed nsa_titan the remote code runs
    from nsa_titan.models.transformer import TransformerBlock

    counts = {"block_tokens": 0, "steps": 0}
    block_forward, step = TransformerBlock.forward, Decoder.step

    def counted_forward(self, x, *args, **kwargs):
        counts["block_tokens"] += x.shape[1]
        return block_forward(self, x, *args, **kwargs)

    def counted_step(self, token):
        counts["steps"] += 1
        return step(self, token)

    TransformerBlock.forward, Decoder.step = counted_forward, counted_step
    try:
        return _record(model, tokenizer, ids, prompt, req, counts)
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
    return {"module": type(model).__module__, "dtype": str(model.dtype), "logits": logits,
            "generated": out[0, prompt.shape[1]:].tolist(), "generate_counts": generated, "n_layers": n_layers,
            "one_token_counts": after, "one_token_logits": one, "one_token_full": full,
            "eos": tokenizer.eos_token_id, "bos": tokenizer.bos_token_id,
            "encoded": [tokenizer(t, add_special_tokens=False).input_ids for t in req["texts"]],
            "decoded": [tokenizer.decode(tokenizer(t, add_special_tokens=False).input_ids) for t in req["texts"]]}


def main() -> None:
    req = json.loads(open(sys.argv[1]).read())
    torch.save({name: check(f["dir"], f["ids"], f["prompt"], req) for name, f in req["folders"].items()}, sys.argv[2])


if __name__ == "__main__":
    main()
