"""What holding the output folder costs: the owner record's heartbeat against the step time, side by side,
and the time a second run on a held folder takes to be refused.

    python benchmarks/operations/folder_owner.py [--rounds 5] [--steps 20] [--refusals 3]

Step time: the default config's model (train_configs/debug_model.toml) on one CPU process, forward +
backward + AdamW per step on random tokens, in interleaved rounds of three variants: no owner record, the
record renewed every 30 s (the default `[job] owner_heartbeat_seconds`), and renewed every 10 ms (3,000x
as often, to make any cost visible). Ratios are taken within each round; the median is reported.
Refusal: this process holds a folder; `./run_train.sh --job.dump_folder FOLDER` is timed until it exits 2.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from nsa_titan.config import load_config  # noqa: E402
from nsa_titan.models.transformer import Transformer  # noqa: E402
from nsa_titan.optim import build_optimizer  # noqa: E402
from nsa_titan.runtime.ownership import FolderOwner  # noqa: E402


def step_times(steps: int, heartbeat_s: float | None, folder: Path) -> float:
    """Median seconds per training step with the folder held at `heartbeat_s` (None: not held)."""
    cfg, _ = load_config(["--model.vocab_size", "4096"], world_size=1)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Transformer(cfg.model, cfg.training.seq_len)
    model.to_empty(device="cpu")
    model.init_weights(0)
    opt = build_optimizer(model, cfg.optimizer)
    tokens = torch.randint(0, cfg.model.vocab_size, (cfg.training.local_batch_size, cfg.training.seq_len + 1))
    owner = FolderOwner.claim(folder, heartbeat_s, 300, job=f"bench {heartbeat_s}") if heartbeat_s else None
    times = []
    try:
        for _ in range(steps):
            start = time.perf_counter()
            logits = model(tokens[:, :-1])
            F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten()).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - start)
    finally:
        if owner is not None:
            owner.release()
    return statistics.median(times[2:])


def refusal_seconds(folder: Path) -> float:
    """Seconds from starting `run_train.sh` on `folder`, held by this process, to its exit with code 2."""
    start = time.perf_counter()
    proc = subprocess.run([str(ROOT / "run_train.sh"), "--job.dump_folder", str(folder)], capture_output=True,
                          text=True, env={**os.environ, "NGPU": "1"})
    took = time.perf_counter() - start
    assert proc.returncode == 2 and "is in use by" in proc.stderr, proc.stderr[-2000:]
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--refusals", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(2)
    variants = {"no record": None, "heartbeat 30 s": 30.0, "heartbeat 10 ms": 0.01}
    ratios: dict[str, list[float]] = {k: [] for k in variants}
    base: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            got = {name: step_times(args.steps, hb, Path(tmp) / f"run{r}") for name, hb in variants.items()}
            base.append(got["no record"])
            for name in variants:
                ratios[name].append(got[name] / got["no record"])
            print(f"round {r}: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in got.items()), flush=True)
        held = Path(tmp) / "held"
        owner = FolderOwner.claim(held, 30, 300, job="bench holder")
        try:
            refusals = [refusal_seconds(held) for _ in range(args.refusals)]
        finally:
            owner.release()
    print(f"\nstep time without a record: {statistics.median(base) * 1e3:.1f} ms (median of round medians)")
    print("| variant | step time / no record (median of rounds) |\n|---|---|")
    for name in variants:
        print(f"| {name} | {statistics.median(ratios[name]):.3f} |")
    print(f"\nrefused in {statistics.median(refusals):.1f} s (median of {len(refusals)}; each {', '.join(f'{x:.1f}' for x in refusals)} s)")


if __name__ == "__main__":
    main()
