"""Dense causal attention: the baseline NSA is compared against."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .documents import Documents


def dense_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: Documents | None = None,
                 q0: int = 0) -> torch.Tensor:
    """Causal GQA attention through scaled_dot_product_attention; with `docs`, each token attends
    only to its own document (a (B, 1, Tq, T) boolean mask: dense attention is T x T anyway).

    q: (B, Tq, H, D), the queries at positions q0 .. q0 + Tq - 1 (all of them, unless context
    parallelism passes a part); k, v: (B, T, G, D) of the whole sequence. Returns (B, Tq, H, D).
    """
    Tq, T = q.shape[1], k.shape[1]
    if docs is not None:
        mask = docs.same_past(q0, q0 + Tq, 0, T)[:, None]
    elif Tq != T:
        mask = torch.arange(T, device=q.device) <= torch.arange(q0, q0 + Tq, device=q.device)[:, None]
    else:
        mask = None
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, is_causal=mask is None,
        enable_gqa=True,
    )
    return out.transpose(1, 2)
