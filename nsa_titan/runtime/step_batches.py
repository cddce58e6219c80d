"""A training step's micro-batches: all fetched before any compute and, for a file source, agreed by every rank
first (one small all-reduce), so that a source that stayed unreadable, or one read to its end, stops every rank
before the step changes anything, with the loader's position before the step kept for the save."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from ..data import DataError, DataUnavailable, Sample, SourceEnded
from .failure import relayed

Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]
"""A micro-batch on the device: inputs, labels, document ids (None without document masking)."""
UNREADABLE, ENDED = 1, 2
"""What a rank tells the others in the step's agreement (the most severe wins: a source's end)."""


class StepBatches:
    """Fetches a step's `micro` micro-batches from a rank's loader; keeps what the step's lines need: the last
    micro-batch, the sources of each, and the loader's position before the step. `shares` (`SourceShares`)
    counts the batches of every step that all ranks agreed; `data_wait` times the fetch."""

    def __init__(self, loader: Any, micro: int, device: torch.device, agree: bool, masking: bool, rank: int,
                 shares: Any, data_wait: Callable[[], Any]):
        self.loader, self.micro, self.device, self.agree, self.masking = loader, micro, device, agree, masking
        self.rank, self.shares, self.data_wait = rank, shares, data_wait
        self.last: Batch | None = None  # the NSA statistics' forward
        self.sources: list[torch.Tensor] = []  # each micro-batch's sources (a spike's line)
        self.loader_at_start: dict | None = None  # the loader's position before this step's batches

    def documents(self, document_ids: torch.Tensor) -> torch.Tensor | None:
        """The batch's document ids (on the host) when `[training] document_masking` is on, else None."""
        return document_ids if self.masking else None

    def _next(self, batches: Iterator[Sample], fed: list[tuple[torch.Tensor, torch.Tensor]]) -> Batch:
        try:
            with self.data_wait():
                inputs, labels, document_ids, sources = next(batches)
        except StopIteration:
            raise DataError(f"rank {self.rank} ran out of training data: its share of the [data] sources is empty "
                            f"(fewer shard files or documents than ranks x workers?)") from None
        fed.append((inputs, sources))
        self.last = inputs.to(self.device), labels.to(self.device), self.documents(document_ids)
        return self.last

    def fetch(self, batches: Iterator[Sample]) -> list[Batch]:
        """This step's micro-batches; DataUnavailable or SourceEnded on every rank where any rank met one."""
        fed: list[tuple[torch.Tensor, torch.Tensor]] = []
        if not self.agree:
            micro = [self._next(batches, fed) for _ in range(self.micro)]
        else:
            self.loader_at_start = self.loader.state_dict()
            try:
                micro, failure = [self._next(batches, fed) for _ in range(self.micro)], None
            except (DataUnavailable, SourceEnded) as e:
                micro, failure = [], e
            code = torch.tensor([0 if failure is None else ENDED if isinstance(failure, SourceEnded) else UNREADABLE],
                                device=self.device, dtype=torch.int32)
            dist.all_reduce(code, op=dist.ReduceOp.MAX)
            if code.item() == ENDED:
                raise SourceEnded(failure.reason if isinstance(failure, SourceEnded) else "another rank's source is "
                                  "read to its end and repeat = false (its line says which): training ends here")
            if code.item() == UNREADABLE:
                raise DataUnavailable(failure.reason if failure else relayed("data"))
        self.sources = [s for _, s in fed]
        for inputs, sources in fed:
            self.shares.add(inputs, sources)
        return micro
