"""The optimizer (AdamW, weight decay on matrices only) and the global gradient norm's clipping."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ..config import Optimizer


def build_optimizer(model: nn.Module, o: Optimizer) -> torch.optim.Optimizer:
    """AdamW; weight decay on matrices (ndim >= 2) only, not on norms, biases or tables."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": o.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    impl = {"foreach": {"foreach": True}, "fused": {"fused": True}, "for-loop": {"foreach": False}}
    return torch.optim.AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, **impl[o.implementation])


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
