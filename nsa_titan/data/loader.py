"""The per-rank StatefulDataLoader (its state can be saved and restored exactly)."""

from __future__ import annotations

from torchdata.stateful_dataloader import StatefulDataLoader

from ..config import Data
from .synthetic import SyntheticTokens


def build_dataloader(data: Data, seq_len: int, vocab_size: int, local_batch: int,
                     dp_rank: int, dp_size: int) -> StatefulDataLoader:
    """Batches of (inputs, labels), each (local_batch, seq_len) long, for one dp rank."""
    dataset = SyntheticTokens(data.seed, seq_len, vocab_size, dp_rank, dp_size, local_batch)
    return StatefulDataLoader(dataset, batch_size=local_batch, num_workers=data.num_workers)
