"""What updates the weights: AdamW and gradient clipping (`optimizer`), the learning-rate schedule
(`lr_schedule`)."""

from .lr_schedule import build_lr_scheduler, lr_factor
from .optimizer import build_optimizer, clip_grad_norm_

__all__ = ["build_lr_scheduler", "build_optimizer", "clip_grad_norm_", "lr_factor"]
