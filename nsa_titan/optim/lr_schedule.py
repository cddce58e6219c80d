"""The learning-rate schedule: warmup, then cosine, WSD (warmup-stable-decay) or constant."""

from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LambdaLR

from ..config import LRScheduler


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
