"""transformers' generate() as lm-eval and a chat user run it: tokens a second and peak memory of the debug model
exported (train_configs/debug_model.toml, random weights), NSA beside dense, at batch 1, 8 and 32, side by side.

    python benchmarks/decoding/generate_batches.py [--batches 1 8 32] [--declared 256 32768] [--new_tokens 50]
        [--repeats 5] [--package DIR]

Each model is exported to a Hugging Face folder as declared (`[model] max_seq_len`: the debug config's 256, and
32k as an adapted model declares) and loaded by AutoModelForCausalLM (trust_remote_code), in a fresh process per
measure. A batch of B prompts of 80-120 tokens (left-padded) gets `--new_tokens` greedy tokens (none stops
early), once to warm up and `--repeats` times timed: tokens a second = B x new tokens / the fastest call's
seconds (its prefill included; this 2-core box's timings vary by a third from call to call). Memory: the cache's bytes, and the process's peak resident memory during the call above
what it held before it (sampled every millisecond). `--package DIR`: the nsa_titan checkout to measure (a
worktree of an earlier commit: before and after in the same way).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MiB = 1 << 20


def rss() -> int:
    """This process's resident bytes now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def export_debug_model(folder: Path, attention: str, declared: int) -> Path:
    """The debug model (random weights, seeded), `attention`, declared for `declared` tokens, as an HF folder."""
    from nsa_titan import export
    from nsa_titan.checkpoint import write_model_file
    from nsa_titan.config import derive, load_config, to_toml
    from nsa_titan.data import build_tokenizer
    from nsa_titan.models.transformer import Transformer

    cfg, _ = load_config(["--config", str(ROOT / "train_configs" / "debug_model.toml"), "--model.attention", attention,
                          "--model.max_seq_len", str(declared)], world_size=1)
    cfg = derive(cfg, 1, build_tokenizer(cfg.data.tokenizer, cfg.data.tokenizer_path).vocab_size)
    model = Transformer(cfg.model, declared)
    model.init_weights(0)
    name = f"{attention}-{declared}"
    write_model_file(model.state_dict(), folder / f"{name}.pt", "float32", to_toml(cfg))
    assert export.main([str(folder / f"{name}.pt"), "--format", "hf", "--output", str(folder / name), "--dtype",
                        "float32"]) == 0
    return folder / name


def measure(folder: str, batch: int, new_tokens: int, repeats: int) -> dict:
    """`repeats` timed generate() calls of `batch` prompts in this process: tokens a second (the fastest call's),
    cache bytes, peak memory."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    gen, vocab, eos = torch.Generator().manual_seed(batch), model.config.vocab_size, model.config.eos_token_id
    lengths = torch.randint(80, 121, (batch,), generator=gen).tolist()
    width = max(lengths)
    ids = torch.stack([torch.cat([torch.full((width - n,), eos), torch.randint(0, eos, (n,), generator=gen)])
                       for n in lengths])
    mask = (torch.arange(width) >= width - torch.tensor(lengths)[:, None]).long()
    run = dict(attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
               pad_token_id=eos, return_dict_in_generate=True)
    assert eos < vocab
    with torch.no_grad():
        model.generate(ids, **run)  # warm-up: kernels built, the decoding step checked
        before, peak, done = rss(), [0], threading.Event()

        def sample() -> None:
            while not done.is_set():
                peak[0] = max(peak[0], rss())
                time.sleep(0.001)

        sampler = threading.Thread(target=sample)
        sampler.start()
        seconds = []
        for _ in range(repeats):
            start = time.perf_counter()
            out = model.generate(ids, **run)
            seconds.append(time.perf_counter() - start)
        done.set()
        sampler.join()
    cache = getattr(out, "cache", None) or out.past_key_values
    return {"tokens_per_s": batch * new_tokens / min(seconds), "cache_bytes": sum(c.nbytes() for c in cache.decoder.caches),
            "peak_bytes": max(peak[0], rss()) - before}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--declared", type=int, nargs="+", default=[256, 32768])
    parser.add_argument("--new_tokens", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--package", default=str(ROOT), help="the nsa_titan checkout to measure")
    parser.add_argument("--measure", nargs=4, metavar=("FOLDER", "BATCH", "NEW_TOKENS", "REPEATS"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    sys.path.insert(0, args.package)
    if args.measure:
        print(json.dumps(measure(args.measure[0], *map(int, args.measure[1:]))))
        return
    import torch

    print(f"generate(), debug model exported (fp32, random weights), prompts of 80-120 tokens + {args.new_tokens} new, "
          f"{torch.get_num_threads()} threads, nsa_titan at {args.package}")
    print("| declared | batch | NSA tokens/s | dense tokens/s | NSA / dense | NSA cache MiB | NSA peak MiB | "
          "dense cache MiB | dense peak MiB |\n|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:  # the remote code copied here too: this run's package's
        env = {**os.environ, "PYTHONPATH": args.package, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": tmp}
        for declared in args.declared:
            folders = {a: export_debug_model(Path(tmp), a, declared) for a in ("nsa", "dense")}
            for batch in args.batches:
                got = {}
                for attention, folder in folders.items():
                    proc = subprocess.run([sys.executable, __file__, "--package", args.package, "--measure",
                                           str(folder), str(batch), str(args.new_tokens), str(args.repeats)],
                                          env=env, capture_output=True, text=True, cwd=tmp)
                    assert proc.returncode == 0, proc.stderr[-3000:]
                    got[attention] = json.loads(proc.stdout.strip().splitlines()[-1])
                n, d = got["nsa"], got["dense"]
                print(f"| {declared:,} | {batch} | {n['tokens_per_s']:,.0f} | {d['tokens_per_s']:,.0f} | "
                      f"{n['tokens_per_s'] / d['tokens_per_s']:.2f}x | {n['cache_bytes'] / MiB:,.1f} | "
                      f"{n['peak_bytes'] / MiB:,.1f} | {d['cache_bytes'] / MiB:,.1f} | {d['peak_bytes'] / MiB:,.1f} |",
                      flush=True)


if __name__ == "__main__":
    main()
