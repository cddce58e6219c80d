"""Dense causal attention: the baseline NSA is compared against."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .documents import Documents


def dense_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: Documents | None = None) -> torch.Tensor:
    """Causal GQA attention through scaled_dot_product_attention; with `docs`, each token attends
    only to its own document (a (B, 1, T, T) boolean mask: dense attention is T x T anyway).

    q: (B, T, H, D); k, v: (B, T, G, D). Returns (B, T, H, D).
    """
    T = q.shape[1]
    mask = None if docs is None else docs.same_past(0, T, 0, T)[:, None]
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, is_causal=docs is None,
        enable_gqa=True,
    )
    return out.transpose(1, 2)
