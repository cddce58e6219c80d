"""The training loss: next-token cross-entropy in fp32, the one every entry point computes."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def cross_entropy_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of logits (B, T, V) against labels (B, T), computed in fp32."""
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
