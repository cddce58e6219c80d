"""The training loss: next-token cross-entropy in fp32, the one every entry point computes."""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100
"""The label of a position without a target (cross-entropy skips it)."""


def cross_entropy_loss(logits: torch.Tensor, labels: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy (mean, or `sum`) of logits (B, T, V) against labels (B, T), computed in fp32;
    labels equal to IGNORE_INDEX are skipped."""
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX,
                           reduction=reduction)
