"""The held-out batches validation scores: one set per source of a mixture (or the one of `[validation] path`),
read from a prepared folder's holdout parts or streamed, shared out among the data-parallel ranks, and read
once a run, so that every validation scores the same tokens without reading the source again."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator

import numpy as np
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from ..config import Data, Source, Validation, validation_sets
from .batch import Sample, eos_documents
from .loader import own_generator
from .prepared import PreparedSource, open_prepared
from .tokenizer import Tokenizer


def prepared_batches(source: PreparedSource, seq_len: int, eos_id: int, local_batch: int, dp_rank: int,
                     dp_size: int) -> Iterator[Sample]:
    """A prepared source's held-out tokens as windows of seq_len + 1 cut end to end, in order; rank r takes
    windows r, r + dp_size, ... (every rank as many), `local_batch` a batch (the last may hold fewer)."""
    n = seq_len + 1
    mine = range(dp_rank, source.tokens // n // dp_size * dp_size, dp_size)
    for b in range(0, len(mine), local_batch):
        window = torch.from_numpy(np.stack([source.read(w * n, n) for w in mine[b:b + local_batch]]).astype(np.int64))
        inputs = window[:, :-1]
        yield Sample(inputs, window[:, 1:], eos_documents(inputs, eos_id), torch.zeros_like(inputs))


def streamed_batches(data: Data, held: Source, tokenizer: Tokenizer, seq_len: int, local_batch: int, dp_rank: int,
                     dp_size: int) -> StatefulDataLoader:
    """One pass over a set's documents (its `[data] holdout` share, or its whole split), in order, packed as
    training packs them, shared out among the dp ranks."""
    from .packing import PackedTextDataset  # `datasets` under these: imported only for streamed sets
    from .sources import node_stream
    stream = node_stream(held, data, dp_rank, dp_size, held=True)
    dataset = PackedTextDataset([stream], [held], tokenizer, seq_len, 0, data.seed, dp_rank,
                                (data.read_retries, data.retry_wait_seconds), data.bad_documents, epochs=1)
    return StatefulDataLoader(dataset, batch_size=local_batch, num_workers=0, generator=own_generator(data.seed, dp_rank))


class HeldOutSets:
    """A run's validation sets (`config.validation_sets`) and, once read, the batches of each."""

    def __init__(self, data: Data, v: Validation, tokenizer: Tokenizer, seq_len: int, local_batch: int,
                 dp_rank: int, dp_size: int):
        self.data, self.steps, self.tokenizer = data, v.steps, tokenizer
        self.shape = (seq_len, local_batch, dp_rank, dp_size)
        self.sets = validation_sets(data, v)
        self.prepared = bool(data.prepared and data.holdout)  # the holdout parts prepare wrote
        self.read: list[list[Sample]] | None = None

    def loaders(self) -> list[Iterable[Sample]]:
        """Each set's batches on this rank, read as they are iterated."""
        if self.prepared:
            sources = open_prepared(self.data, self.tokenizer, held_out=True)
            return [prepared_batches(s, self.shape[0], self.tokenizer.eos_id, *self.shape[1:]) for s in sources]
        return [streamed_batches(self.data, s, self.tokenizer, *self.shape) for s in self.sets]

    def batches(self) -> list[list[Sample]]:
        """Each set's batches on this rank (up to `[validation] steps`), read on the first call and kept."""
        if self.read is None:
            self.read = [list(itertools.islice(loader, self.steps)) for loader in self.loaders()]
        return self.read

    def describe(self, i: int) -> str:
        """Where set `i`'s documents come from, for an error line."""
        s = self.sets[i]
        if self.prepared:
            return f"the held-out documents of '{s.label}' in [data] prepared = '{self.data.prepared}'"
        if self.data.holdout:
            return f"[data] holdout = {self.data.holdout:g} of '{s.label}' ({s.path})"
        return f"[validation] split '{s.split}' of '{s.label}' ({s.path})"
