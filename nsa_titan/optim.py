"""Optimizer (AdamW) and learning-rate schedule (warmup, then cosine / WSD / constant)."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LambdaLR

from .config import LRScheduler, Optimizer


def build_optimizer(model: nn.Module, o: Optimizer) -> torch.optim.Optimizer:
    """AdamW; weight decay on matrices (ndim >= 2) only, not on norms, biases or tables."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": o.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    impl = {"foreach": {"foreach": True}, "fused": {"fused": True}, "for-loop": {"foreach": False}}
    return torch.optim.AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, **impl[o.implementation])


def lr_factor(step: int, total_steps: int, s: LRScheduler) -> float:
    """Multiplier of the base lr for training step `step` (1-based)."""
    if step <= s.warmup_steps:
        return step / s.warmup_steps
    if s.decay_type == "constant":
        return 1.0
    if s.decay_type == "cosine":
        progress = (step - s.warmup_steps) / max(1, total_steps - s.warmup_steps)
        return s.min_lr_factor + (1 - s.min_lr_factor) * 0.5 * (1 + math.cos(math.pi * progress))
    # wsd: stable at 1, then a linear decay over the last decay_ratio of the steps.
    decay_steps = max(1, round(s.decay_ratio * total_steps))
    decay_start = max(s.warmup_steps, total_steps - decay_steps)
    if step <= decay_start:
        return 1.0
    progress = (step - decay_start) / max(1, total_steps - decay_start)
    return 1.0 - (1 - s.min_lr_factor) * progress


def build_lr_scheduler(opt: torch.optim.Optimizer, total_steps: int, s: LRScheduler) -> LambdaLR:
    """LambdaLR stepped once per optimizer step; its k-th value is for step k + 1."""
    return LambdaLR(opt, lambda k: lr_factor(k + 1, total_steps, s))


def clip_grad_norm_(params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """Global gradient norm over all (sharded) parameters; clips to max_norm when > 0.

    With DTensor gradients the per-shard norms are reduced across the mesh, so every rank
    gets the norm of the full gradient. No host sync.
    """
    grads = [p.grad for p in params if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=True)
    return total
