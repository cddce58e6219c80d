"""What the startup kernel check costs (`runtime/kernel_check.py`): the family check and the decoding step's, each
from no verdict (`verify_kernels = always`), on this machine, for the shipped configs' models; and a run that finds
the verdicts kept (`once`).

    python benchmarks/kernels/kernel_check.py [--configs train_configs/debug_model.toml train_configs/m7c.toml]
                                              [--dtype float32] [--repeats 3]

Each row: the family `auto` takes here and its check's seconds, the decoding step's kernel and its check's seconds
(medians of the repeats), the worst relative error found, and the seconds of both checks when their verdicts are
kept. The target: under 10 s on 2 CPU cores, under 3 s on a GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from nsa_titan.config import DTYPES, load_config  # noqa: E402
from nsa_titan.models.transformer import nsa_spec  # noqa: E402
from nsa_titan.runtime import kernel_check  # noqa: E402


def timed(run, repeats: int) -> tuple[float, object]:
    """The median seconds of `repeats` calls of `run`, and its last result."""
    times, out = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        out = run()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=["train_configs/debug_model.toml", "train_configs/m7c.toml"])
    parser.add_argument("--dtype", default="float32", choices=list(DTYPES))
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(f"device {device}, {torch.get_num_threads()} threads, torch {torch.__version__}, dtype {args.dtype}")
    print("config | family, check s (worst error) | decoding step, check s (worst error) | both, verdicts kept s")
    with tempfile.TemporaryDirectory() as cache:
        os.environ["NSA_TITAN_CACHE"] = cache  # the benchmark's own verdicts
        for config in args.configs:
            cfg, _ = load_config(["--config", str(ROOT / config), "--training.mixed_precision_param", args.dtype,
                                  "--model.verify_kernels", "always"])
            m, dtype = cfg.model, DTYPES[args.dtype]
            family, _ = kernel_check.verified_family(cfg, device)  # warm: the C++ kernels loaded, the family chosen
            docs, parts = cfg.training.document_masking, cfg.parallelism.context_parallel_degree > 1
            fam_s, found = timed(lambda: kernel_check.family_errors(family, m, device, dtype, docs, parts), args.repeats)
            kernel = kernel_check.verified_decode(m, device, dtype, family)
            dec_s, errors = (0.0, None) if kernel == "torch" else timed(lambda: kernel_check.decode_errors(
                kernel_check.check_model(m, kernel, device, dtype, family), kernel), args.repeats)
            once = dataclasses.replace(cfg, model=dataclasses.replace(m, verify_kernels="once"))
            kept, _ = timed(lambda: kernel_check.checked_kernels(once, device), args.repeats)
            decode_worst = "-" if errors is None else f"{float(errors.max()):.1e}"
            print(f"{Path(config).name} (T {kernel_check.check_length(nsa_spec(m))}) | {family.name}, {fam_s:.2f} "
                  f"({max(found.values()):.1e}) | {kernel}, {dec_s:.2f} ({decode_worst}) | {kept:.2f}", flush=True)


if __name__ == "__main__":
    main()
