"""Data: token sources and the stateful loader that feeds each data-parallel rank."""

from .loader import build_dataloader
from .synthetic import SyntheticTokens

__all__ = ["SyntheticTokens", "build_dataloader"]
