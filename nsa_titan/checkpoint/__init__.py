"""Distributed checkpointing on torch.distributed.checkpoint (DCP): exact, atomic, reshardable.

`manager.py` saves and resumes a run; `folders.py` knows which step folders are complete;
`states.py` holds what a checkpoint is made of; `model_file.py` reads and writes a model alone.
Each is imported on first use (DCP takes a second to import): the launcher reads `hf_folder.py` alone.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .errors import CheckpointError

if TYPE_CHECKING:
    from .folders import inspect_folder, recorded_kernels, scan
    from .manager import CheckpointManager, folder_check
    from .model_file import check_fit, load_tensors, read_model_file, shapes, write_model_file
    from .states import TrainState

_ON_USE = {"inspect_folder": "folders", "recorded_kernels": "folders", "scan": "folders",
           "CheckpointManager": "manager", "folder_check": "manager", "check_fit": "model_file",
           "load_tensors": "model_file", "read_model_file": "model_file", "shapes": "model_file",
           "write_model_file": "model_file", "TrainState": "states"}

__all__ = ["CheckpointError", "CheckpointManager", "TrainState", "check_fit", "folder_check", "inspect_folder",
           "load_tensors", "read_model_file", "recorded_kernels", "scan", "shapes", "write_model_file"]


def __getattr__(name: str) -> Any:
    if name in _ON_USE:
        return getattr(importlib.import_module(f".{_ON_USE[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
