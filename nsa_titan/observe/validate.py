"""Validation inside a run: the model's loss on each held-out set (`data.HeldOutSets`), reduced over the ranks."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..data import DataError, DataUnavailable, HeldOutSets, Sample
from ..runtime.failure import relayed


@dataclass
class ValidationLoss:
    loss: float
    """The run's: its one set's mean batch loss, or a mixture's per-source means weighted by the sources' weights."""
    batches: int
    """Batches a rank scored, all sets together."""
    by_source: dict[str, float] = field(default_factory=dict)
    """A mixture's mean batch loss per source label (empty for one set)."""


def agreed_batches(sets: HeldOutSets, device: torch.device, what: str) -> tuple[list[list[Sample]], list[int]]:
    """Each set's batches on this rank and how many of them every rank scores (a forward is collective: the
    fewest any rank holds). A source unreadable on any rank is DataUnavailable on all; a set some rank has no
    batch of, a DataError naming it. `what`: the source's role, for the line of a rank that read fine."""
    n = len(sets.sets)
    try:
        read, failure = sets.batches(), None
    except DataUnavailable as e:  # the others still reduce: tell them
        read, failure = [[]] * n, e.reason
    fewest = torch.tensor([len(b) for b in read] + [-int(failure is not None)], device=device)
    dist.all_reduce(fewest, op=dist.ReduceOp.MIN)
    counts = fewest.tolist()
    if counts[n] < 0:
        raise DataUnavailable(failure or relayed(what))
    if empty := [i for i in range(n) if counts[i] == 0]:
        raise DataError(f"{sets.describe(empty[0])} gave no batch of seq_len {sets.shape[0]} on some rank: hold out "
                        f"more (a larger split or holdout), widen the source's length bounds, or use a smaller seq_len")
    return read, counts[:n]


@torch.no_grad()
def validate(model: torch.nn.Module, sets: HeldOutSets, loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
             documents: Callable[[torch.Tensor], torch.Tensor | None], device: torch.device,
             world_size: int) -> ValidationLoss:
    """Score every set's batches on every rank (as many on each); a set some rank has no batch of is a DataError
    naming it."""
    read, counts = agreed_batches(sets, device, "validation")
    n = len(read)
    total = torch.zeros(n, device=device)  # per set: the sum of its batch losses
    model.eval()
    try:
        for i, batches in enumerate(read):
            for inputs, labels, document_ids, _ in batches[:counts[i]]:
                total[i] += loss(model(inputs.to(device), documents(document_ids)), labels.to(device))
    finally:
        model.train()
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    means = [float(t) / (c * world_size) for t, c in zip(total.tolist(), counts)]
    weights = [s.weight for s in sets.sets]
    by_source = {s.label: m for s, m in zip(sets.sets, means)} if n > 1 else {}
    return ValidationLoss(sum(w * m for w, m in zip(weights, means)) / sum(weights), sum(counts[:n]), by_source)
