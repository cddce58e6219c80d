"""Data pipeline throughput per rank, against what the M7C model consumes, and the default run's data wait.

    python benchmarks/training/data_throughput.py [--batches 40] [--train_steps 100]

1. Prepare: tokens/s of `python -m nsa_titan.data.prepare` on the embedded corpus, 1 and 2 processes.
2. Tokens/s one rank's StatefulDataLoader delivers (embedded corpus, sentencepiece, M7C's
   seq 2048 x batch 8, rank 0 of 2): streamed text with 0, 1 and 2 workers beside prepared shards (read in
   the training process).
3. Tokens/s one GPU consumes training M7C, from its FLOPs per token at a stated MFU and peak.
4. The default run (`./run_train.sh`): the share of step time spent waiting for data, streamed and prepared.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from nsa_titan.config import derive, load_config, padded_vocab  # noqa: E402
from nsa_titan.data import build_dataloader, build_tokenizer  # noqa: E402
from nsa_titan.observe.metrics import PEAK_BF16_FLOPS  # noqa: E402
from nsa_titan.models.transformer import Transformer  # noqa: E402

M7C_ON_LOCAL_DATA = ["--config", str(ROOT / "train_configs" / "m7c.toml"), "--data.path", "data/python_docs", "--data.name=",
                     "--data.tokenizer", "sentencepiece", "--data.tokenizer_path", "data/python_docs/tokenizer.model"]


def prepare_tokens_per_s(output: Path, processes: int, *config: str) -> float:
    """Prepare the embedded corpus (as `config` reads it; default: the default run's) into `output` with
    `processes`: tokens written per second of the whole command."""
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "nsa_titan.data.prepare", "--output", str(output), "--processes",
                    str(processes), *config], check=True, capture_output=True, cwd=ROOT)
    seconds = time.perf_counter() - start
    manifest = json.loads((output / "manifest.json").read_text())
    return sum(s["tokens"] for s in manifest["sources"].values()) / seconds


def loader_tokens_per_s(workers: int, batches: int, ranks: int, prepared: str = "") -> float:
    """Rank 0 of `ranks`: with 2 ranks each holds 4 of the 8 shards, enough for 2 workers."""
    cfg, _ = load_config([*M7C_ON_LOCAL_DATA, "--data.num_workers", str(workers), "--data.prepared", prepared],
                         world_size=ranks)
    t = cfg.training
    tok = build_tokenizer(cfg.data.tokenizer, cfg.data.tokenizer_path)
    loader = build_dataloader(cfg.data, tok, t.seq_len, padded_vocab(tok.vocab_size), t.local_batch_size, 0, ranks)
    it = iter(loader)
    for _ in range(3):  # start the workers and fill the shuffle buffer
        next(it)
    start = time.perf_counter()
    for _ in range(batches):
        next(it)
    return batches * t.local_batch_size * t.seq_len / (time.perf_counter() - start)


def m7c_consumption(mfu: float, peak: float) -> tuple[float, float]:
    """(FLOPs per token, tokens/s one GPU consumes at `mfu` of `peak`)."""
    cfg, _ = load_config(M7C_ON_LOCAL_DATA, world_size=8)
    cfg = derive(cfg, 8, build_tokenizer(cfg.data.tokenizer, cfg.data.tokenizer_path).vocab_size)
    with torch.device("meta"):
        f = Transformer(cfg.model, cfg.training.seq_len).flops_per_token(cfg.training.seq_len)
    return f, mfu * peak / f


def default_run_data_wait(steps: int, prepared: str = "") -> list[float]:
    with tempfile.TemporaryDirectory(prefix="nsa_titan_bench_") as folder:  # fresh: not resuming an earlier run
        proc = subprocess.run([str(ROOT / "run_train.sh"), "--training.steps", str(steps), "--data.prepared", prepared,
                               "--metrics.enable_tensorboard", "false", "--job.dump_folder", folder],
                              capture_output=True, text=True, check=True)
    return [float(m.group(1)) for m in re.finditer(r"\| data ([\d.]+)% \|", proc.stdout)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, default=40)
    parser.add_argument("--train_steps", type=int, default=100)
    parser.add_argument("--mfu", type=float, default=0.4)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="nsa_titan_prepared_") as work:
        print("| prepare processes | tokens/s |")
        print("|---|---|")
        for processes in (1, 2):
            print(f"| {processes} | {prepare_tokens_per_s(Path(work) / f'p{processes}', processes):,.0f} |", flush=True)
        prepared = Path(work) / "m7c"  # as M7C reads it (its 0.1% held out)
        prepare_tokens_per_s(prepared, 2, *M7C_ON_LOCAL_DATA)
        shards = loader_tokens_per_s(0, 4 * args.batches, 2, str(prepared))  # read in the training process
        print("\n| streamed text, loader workers | streamed: tokens/s to rank 0 of 2 (seq 2048, batch 8) | prepared "
              "shards (in the training process) | prepared / streamed |")
        print("|---|---|---|---|")
        for workers in (0, 1, 2):
            streamed = loader_tokens_per_s(workers, args.batches, 2)
            print(f"| {workers} | {streamed:,.0f} | {shards:,.0f} | {shards / streamed:.1f}x |", flush=True)
        print()
        for gpu in ("A100", "H100"):
            f, tps = m7c_consumption(args.mfu, PEAK_BF16_FLOPS[gpu])
            print(f"M7C on one {gpu} at {args.mfu:.0%} MFU: {f / 1e9:.2f} GFLOP/token -> {tps:,.0f} tokens/s consumed")
        for name, folder in (("streamed", ""), ("prepared", str(Path(work) / "p2"))):
            waits = default_run_data_wait(args.train_steps, folder)
            steady = waits[1:]  # the first line includes starting the worker
            print(f"\ndefault run, {name}, {args.train_steps} steps: data wait {waits[0]:.1f}% at step 1, then "
                  f"mean {sum(steady) / len(steady):.2f}% (max {max(steady):.1f}%) of step time")


if __name__ == "__main__":
    main()
