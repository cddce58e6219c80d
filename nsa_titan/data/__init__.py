"""Data: tokenizers, text sources through `datasets`, packing, and the per-rank stateful loaders."""

from .batch import Sample
from .errors import DataError, DataUnavailable, SourceEnded
from .loader import build_dataloader, dead_workers, shutdown_workers
from .tokenizer import Tokenizer, build_tokenizer
from .validation import HeldOutSets

__all__ = ["DataError", "DataUnavailable", "HeldOutSets", "Sample", "SourceEnded", "Tokenizer", "build_dataloader", "build_tokenizer",
           "dead_workers", "shutdown_workers"]
