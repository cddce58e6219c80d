"""The training loss: next-token cross-entropy in fp32, the one every entry point computes."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from ..distributed.context_parallel import ContextSplit

IGNORE_INDEX = -100
"""The label of a position without a target (cross-entropy skips it)."""


def cross_entropy_loss(logits: torch.Tensor, labels: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy (mean, or `sum`) of logits (B, T, V) against labels (B, T), computed in fp32;
    labels equal to IGNORE_INDEX are skipped."""
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX,
                           reduction=reduction)


def lm_loss(logits: torch.Tensor, labels: torch.Tensor, cp: ContextSplit | None = None) -> torch.Tensor:
    """The batch's mean cross-entropy; with a context split, this rank's share of it: logits (B, Tl, V) of its
    tokens, labels (B, T) of the whole sequences. The cp ranks' shares average (as data-parallel gradients do)
    to the unsplit batch's mean loss."""
    if cp is None:
        return cross_entropy_loss(logits, labels)
    count = (labels != IGNORE_INDEX).sum()
    return cross_entropy_loss(logits, cp.shard(labels, IGNORE_INDEX), reduction="sum") * cp.size / count
