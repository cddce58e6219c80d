"""Process-wide settings, in one place: every environment variable nsa_titan sets, and the log
levels of libraries it quiets. Nothing here runs at import; each entry point calls what it needs.

Set by the launcher (`nsa_titan.launch`) for its ranks:
  NSA_TITAN_LAUNCHER=1                 ranks leave their one-line errors to the launcher (cli.report)
  NSA_TITAN_JOB                        the job that holds the output folder (runtime/ownership.py), shared by
                                       the ranks and their restarts
  TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 each restart attempt gets its own store: on a shared one,
                                       restarted ranks read stale addresses and hang (pytorch#135712)
  MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_, MALLOC_TOP_PAD_
                                       on machines without CUDA, unless NSA_TITAN_MALLOC=default or
                                       any of them is set already: glibc keeps large blocks in its heap
                                       and reuses them (`MALLOC_TUNING`)
Set by a rank when it joins the job (`init_distributed`), unless already set:
  MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE   a single process without torchrun
  TORCH_NCCL_TRACE_BUFFER_SIZE, TORCH_NCCL_DUMP_ON_TIMEOUT, TORCH_NCCL_DEBUG_INFO_TEMP_FILE
                                       on GPUs: the NCCL flight recorder, dumped to the fault folder
Set with [debug] deterministic = true:
  CUBLAS_WORKSPACE_CONFIG=:4096:8      what deterministic cuBLAS needs
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from .signals import LAUNCHER

LAUNCHED_BY = LAUNCHER
"""Set by the launcher for its ranks, to its own pid: they leave their bad-input line to it (no duplicate lines),
and die with it (`signals.end_with_launcher`)."""
JOB_KEY = "NSA_TITAN_JOB"
"""Set by the launcher for its ranks: the key of the job that holds the output folder for them."""
MALLOC_TUNING = {"MALLOC_MMAP_THRESHOLD_": str(16 * 2**30), "MALLOC_TRIM_THRESHOLD_": str(16 * 2**30),
                 "MALLOC_TOP_PAD_": str(2**30)}
"""glibc malloc for CPU training. By default glibc serves each block above its mmap threshold (128
KiB, adapting up to 32 MiB) with a fresh mmap and unmaps it on free, so every large temporary of
every step costs a page fault per 4 KiB page: seconds of system time per step at long T. These
keep such blocks in the heap for reuse, never trim it, and grow it 1 GiB at a time (the price: a
rank's resident memory stays at its peak). glibc reads them when a process starts, so the
launcher sets them for its ranks."""


def malloc_tuning() -> dict[str, str]:
    """The glibc settings the launcher gives CPU ranks (empty on CUDA machines, with
    NSA_TITAN_MALLOC=default, or when the user set any of them)."""
    if (torch.cuda.is_available() or os.environ.get("NSA_TITAN_MALLOC", "tuned") == "default"
            or any(k in os.environ for k in MALLOC_TUNING)):
        return {}
    return dict(MALLOC_TUNING)


def allocator_env(allocator: str) -> dict[str, str]:
    """This process's environment for a child under `allocator`: "tuned", with the launcher's glibc
    settings (`MALLOC_TUNING`), or "default", without any of them (benchmarks run both side by side)."""
    clean = {k: v for k, v in os.environ.items() if k not in MALLOC_TUNING}
    return {**clean, **MALLOC_TUNING} if allocator == "tuned" else clean


def allocator_setup() -> str:
    """This process's host allocator setup, in words (for logs and benchmark reports)."""
    preload = os.environ.get("LD_PRELOAD", "")
    for name in ("tcmalloc", "jemalloc"):
        if name in preload:
            return f"{name} (LD_PRELOAD)"
    tuned = {k: os.environ[k] for k in MALLOC_TUNING if k in os.environ}
    if not tuned:
        return "glibc malloc, default settings"
    return "glibc malloc, " + " ".join(f"{k}={v}" for k, v in tuned.items())


CACHE = "NSA_TITAN_CACHE"
"""Read, never set: the folder of what a machine keeps between runs (the kernels' verdicts); default
$XDG_CACHE_HOME/nsa_titan, else ~/.cache/nsa_titan."""


def cache_dir() -> Path:
    """The folder of what this machine keeps between runs (`CACHE`)."""
    if os.environ.get(CACHE):
        return Path(os.environ[CACHE])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "nsa_titan"


def set_launcher_env(job: str | None) -> None:
    """The launcher's variables for its ranks (`job`: the key of the job holding the output folder), and
    torchrun's failure report silenced (it repeats what the ranks said; the launcher prints one line)."""
    os.environ[LAUNCHED_BY] = str(os.getpid())
    if job is not None:
        os.environ[JOB_KEY] = job
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    os.environ.update(malloc_tuning())
    for name in ("torch.distributed.elastic", "torch.distributed.run"):  # also its OMP_NUM_THREADS = 1 banner
        logging.getLogger(name).setLevel(logging.CRITICAL)


def set_rank_env(device: torch.device, trace_folder: Path | None) -> None:
    """A rank's defaults before it joins the process group (see the module doc)."""
    if device.type == "cuda" and trace_folder is not None:
        trace_folder.mkdir(parents=True, exist_ok=True)
        os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", "20000")
        os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
        os.environ.setdefault("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", str(trace_folder / "nccl_trace_rank_"))
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500"), ("RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(key, value)


def set_deterministic() -> None:
    """Deterministic algorithms everywhere (slower); cuBLAS needs its workspace setting for that."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)


def own_streaming_retries() -> None:
    """`datasets` retries a failed remote read itself (20 times, 5 s apart, warning each time); nsa_titan's
    own retries (`data/retry.py`: a budget from the config, exact position) replace them. Set in the
    process that opens a remote source, before its loader workers fork."""
    import datasets.config

    datasets.config.STREAMING_READ_MAX_RETRIES = datasets.config.STREAMING_OPEN_MAX_RETRIES = 1
    for name in ("STREAMING_READ_RETRY_INTERVAL", "STREAMING_OPEN_RETRY_INTERVAL",
                 "STREAMING_READ_SERVER_UNAVAILABLE_RETRY_INTERVAL", "STREAMING_READ_RATE_LIMIT_RETRY_INTERVAL"):
        setattr(datasets.config, name, 0)
    logging.getLogger("datasets.utils.file_utils").setLevel(logging.ERROR)  # its "Retrying in 0sec" lines


def quiet_libraries() -> None:
    """Log levels of libraries whose messages mean nothing to a user here."""
    logging.getLogger("huggingface_hub.repocard").setLevel(logging.ERROR)  # a local folder's README has no card
