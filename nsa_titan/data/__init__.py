"""Data: tokenizers, text sources through `datasets`, packing, and the per-rank stateful loaders."""

from .batch import Sample
from .errors import DataError, DataUnavailable
from .loader import build_dataloader, build_validation_dataloader, dead_workers, shutdown_workers
from .tokenizer import Tokenizer, build_tokenizer

__all__ = ["DataError", "DataUnavailable", "Sample", "Tokenizer", "build_dataloader", "build_tokenizer",
           "build_validation_dataloader", "dead_workers", "shutdown_workers"]
