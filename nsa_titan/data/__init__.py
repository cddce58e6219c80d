"""Data: tokenizers, text sources through `datasets`, packing, and the per-rank stateful loaders.

The loaders (and `datasets` under them) are imported on first use: the launcher and the tools that only name a
data error start a second sooner."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .batch import Sample
from .errors import DataError, DataUnavailable, SourceEnded
from .tokenizer import Tokenizer, build_tokenizer

if TYPE_CHECKING:
    from .loader import build_dataloader, dead_workers, shutdown_workers
    from .validation import HeldOutSets

_ON_USE = {"build_dataloader": "loader", "dead_workers": "loader", "shutdown_workers": "loader",
           "HeldOutSets": "validation"}

__all__ = ["DataError", "DataUnavailable", "HeldOutSets", "Sample", "SourceEnded", "Tokenizer", "build_dataloader", "build_tokenizer",
           "dead_workers", "shutdown_workers"]


def __getattr__(name: str) -> Any:
    if name in _ON_USE:
        return getattr(importlib.import_module(f".{_ON_USE[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
