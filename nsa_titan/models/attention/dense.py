"""Dense causal attention: the baseline NSA is compared against.

Without documents it is SDPA's causal kernel (flash, cuDNN on GPUs). With documents on a GPU it is
FlexAttention with a block-causal document mask, built once a batch from each token's document
start (`with_block_masks`: no T x T tensor, and fully masked tiles skipped), as torchtitan runs
document masking; elsewhere SDPA with a (B, 1, Tq, T) boolean mask.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from .documents import Documents


@functools.cache
def _flex() -> Callable:
    """flex_attention compiled once (its fused kernel; eager flex materialises the scores)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def document_block_mask(start: torch.Tensor, q0: int, q1: int):
    """FlexAttention's BlockMask of the queries q0 .. q1 - 1 against every key of documents starting
    at `start` (B, T): key s is seen by query t iff start[t] <= s <= t."""
    from torch.nn.attention.flex_attention import create_block_mask

    def inside(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        t = q + q0
        return (s <= t) & (s >= start[b, t])

    return create_block_mask(inside, B=start.shape[0], H=None, Q_LEN=q1 - q0, KV_LEN=start.shape[1],
                             device=start.device, _compile=start.is_cuda)  # compiled: no T x T mask in memory


def with_block_masks(docs: Documents | None, parts: Sequence[tuple[int, int]]) -> Documents | None:
    """`docs` with FlexAttention's block mask of each query part (q0, q1), on a GPU; as it is elsewhere
    (FlexAttention's backward runs on GPUs only)."""
    if docs is None or not docs.start.is_cuda:
        return docs
    return dataclasses.replace(docs, block_masks={p: document_block_mask(docs.start, *p) for p in parts})


def dense_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: Documents | None = None,
                 q0: int = 0) -> torch.Tensor:
    """Causal GQA attention; with `docs`, each token attends only to its own document (through its
    block mask when `docs` has one for these queries, else a boolean mask).

    q: (B, Tq, H, D), the queries at positions q0 .. q0 + Tq - 1 (all of them, unless context
    parallelism passes a part); k, v: (B, T, G, D) of the whole sequence. Returns (B, Tq, H, D).
    """
    Tq, T = q.shape[1], k.shape[1]
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if docs is not None and (q0, q0 + Tq) in docs.block_masks:
        return _flex()(q, k, v, block_mask=docs.block_masks[q0, q0 + Tq], enable_gqa=True).transpose(1, 2)
    if docs is not None:
        mask = docs.same_past(q0, q0 + Tq, 0, T)[:, None]
    elif Tq != T:
        mask = torch.arange(T, device=q.device) <= torch.arange(q0, q0 + Tq, device=q.device)[:, None]
    else:
        mask = None
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=True)
    return out.transpose(1, 2)
