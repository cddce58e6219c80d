"""Data: tokenizers, text sources through `datasets`, packing, and the per-rank stateful loaders."""

from .errors import DataError
from .loader import build_dataloader, build_validation_dataloader, shutdown_workers
from .tokenizer import Tokenizer, build_tokenizer, padded_vocab_size, vocab_for_model

__all__ = ["DataError", "Tokenizer", "build_dataloader", "build_tokenizer", "build_validation_dataloader",
           "padded_vocab_size", "shutdown_workers", "vocab_for_model"]
