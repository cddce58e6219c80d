"""Process-wide settings, in one place: every environment variable nsa_titan sets, and the log
levels of libraries it quiets. Nothing here runs at import; each entry point calls what it needs.

Set by the launcher (`nsa_titan.launch`) for its ranks:
  NSA_TITAN_LAUNCHER=1                 ranks leave their one-line errors to the launcher (cli.report)
  TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 each restart attempt gets its own store: on a shared one,
                                       restarted ranks read stale addresses and hang (pytorch#135712)
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

LAUNCHED_BY = "NSA_TITAN_LAUNCHER"
"""Set by the launcher for its ranks: they leave their bad-input line to it (no duplicate lines)."""


def set_launcher_env() -> None:
    """The launcher's variables for its ranks, and torchrun's failure report silenced (it repeats what
    the ranks said; the launcher prints one line)."""
    os.environ[LAUNCHED_BY] = "1"
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
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


def quiet_libraries() -> None:
    """Log levels of libraries whose messages mean nothing to a user here."""
    logging.getLogger("huggingface_hub.repocard").setLevel(logging.ERROR)  # a local folder's README has no card
