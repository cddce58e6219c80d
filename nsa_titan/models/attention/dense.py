"""Dense causal attention: the baseline NSA is compared against."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def dense_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal GQA attention through scaled_dot_product_attention.

    q: (B, T, H, D); k, v: (B, T, G, D). Returns (B, T, H, D).
    """
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
    )
    return out.transpose(1, 2)
