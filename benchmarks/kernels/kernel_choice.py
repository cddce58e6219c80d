"""What `auto`'s measurement costs at startup (`runtime/kernel_timing.py`) and what it finds: every family that passes
its check here timed, forward and backward of one layer over one sequence, beside dense attention, from no kept
timing; then a start that reads the kept timings. Then `decode_kernels = auto`'s measurement for a request of each
config's length (`kernel_timing.fastest_decode`: each step that runs here, one layer and row), and a kept one.

    python benchmarks/kernels/kernel_choice.py [--configs train_configs/debug_model.toml train_configs/m7c.toml]
                                               [--seq 256 8192] [--dtype float32]

Each row: the config and length, each family's and dense attention's milliseconds, NSA's ratio to dense, the family
taken, the measurement's seconds (the checks excluded: benchmarks/kernels/kernel_check.py) and a kept start's. The
budget: 20 s on 2 CPU cores for M7C at 8k, 5 s on a GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from nsa_titan.config import DTYPES, ConfigError, Model, load_config  # noqa: E402
from nsa_titan.models.attention import FAMILIES, choose_family  # noqa: E402
from nsa_titan.models.attention.families.choose import AUTO_ORDER  # noqa: E402
from nsa_titan.models.decode import DECODE_KERNELS  # noqa: E402
from nsa_titan.models.transformer import nsa_spec  # noqa: E402
from nsa_titan.runtime import kernel_check, kernel_timing, verdicts  # noqa: E402


def runs_here(m: Model, kernel: str, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the decoding step `kernel` runs here (unchecked: the checks are benchmarks/kernels/kernel_check.py's)."""
    try:
        return kernel_check.verified_decode(dataclasses.replace(m, decode_kernels=kernel, verify_kernels="off"),
                                            device, dtype) == kernel
    except ConfigError:
        return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=["train_configs/debug_model.toml", "train_configs/m7c.toml"])
    parser.add_argument("--seq", nargs="+", type=int, default=[256, 8192], help="the length of each config")
    parser.add_argument("--dtype", default="float32", choices=list(DTYPES))
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(f"device {device}, {torch.get_num_threads()} threads, torch {torch.__version__}, dtype {args.dtype}")
    print("config | seq | times (ms, fwd+bwd, one layer, one sequence) | NSA / dense | taken | measured s | kept s")
    decoding = []
    for config, seq in zip(args.configs, args.seq):
        cfg, _ = load_config(["--config", str(ROOT / config), "--training.mixed_precision_param", args.dtype,
                              "--training.seq_len", str(seq)])
        m, dtype, documents = cfg.model, DTYPES[args.dtype], cfg.training.document_masking
        r = m.n_heads // m.n_kv_groups
        names = [n for n in AUTO_ORDER if FAMILIES[n].problem(device, dtype, nsa_spec(m), r, m.head_dim) is None]
        passed = {n: choose_family(n, device, dtype, nsa_spec(m), r, m.head_dim) for n in names}
        keys = {n: verdicts.family_key(n, device, dtype, m, documents, False) for n in names}
        for family in passed.values():  # what a run does first: the checks (their kernels loaded, warm)
            kernel_check.family_errors(family, m, device, dtype, documents, False)
        with tempfile.TemporaryDirectory() as cache:
            os.environ["NSA_TITAN_CACHE"] = cache  # no timing kept yet
            start = time.perf_counter()
            speed = kernel_timing.fastest(passed, list(AUTO_ORDER), m, seq, device, dtype, documents, keys)
            measured = time.perf_counter() - start
            start = time.perf_counter()
            kernel_timing.fastest(passed, list(AUTO_ORDER), m, seq, device, dtype, documents, keys)
            kept = time.perf_counter() - start
        times = ", ".join(f"{n} {ms:.4g}" for n, ms in sorted(speed.families.items(), key=lambda kv: kv[1]))
        print(f"{Path(config).name} | {seq} | {times}; dense {speed.dense:.4g} | {speed.ratio:.3g}x | {speed.taken} | "
              f"{measured:.1f} | {kept:.2f}", flush=True)
        decoding.append((config, seq, m, dtype))
    print("\nconfig | request's context | decoding step (ms, one layer and row) | taken | measured s | kept s")
    for config, seq, m, dtype in decoding:
        names = [k for k in DECODE_KERNELS if runs_here(m, k, device, dtype)]
        keys = {k: verdicts.decode_key(k, device, dtype, m) for k in names}
        with tempfile.TemporaryDirectory() as cache:
            os.environ["NSA_TITAN_CACHE"] = cache
            start = time.perf_counter()
            found = kernel_timing.fastest_decode(names, keys, m, device, dtype, seq)
            measured = time.perf_counter() - start
            start = time.perf_counter()
            kernel_timing.fastest_decode(names, keys, m, device, dtype, seq)
            kept = time.perf_counter() - start
        times = ", ".join(f"{k} {ms:.4g}" for k, ms in sorted(found.kernels.items(), key=lambda kv: kv[1]))
        print(f"{Path(config).name} | {found.context} | {times} | {found.taken} | {measured:.1f} | {kept:.2f}",
              flush=True)


if __name__ == "__main__":
    main()
