"""ATen's fused attention kernels with a bias, on the fast path's chunks and tiles (CPUs, CUDA).

The kernels behind `scaled_dot_product_attention` that take an additive bias and return each row's
logsumexp: on CPUs `aten._scaled_dot_product_flash_attention_for_cpu`, on CUDA devices
`aten._scaled_dot_product_efficient_attention` (the memory-efficient kernel), and their backwards.
Scores, softmax and both products run tile by tile in cache (shared memory), one pass over the keys
instead of a separate op (and a pass over memory, and a launch on a GPU) for each step.
They take a batch of independent problems with an additive bias, so the fast path hands them its
chunks (cmp, win) and its sel tiles, loc and ini blocks as they are: queries (N, M, D) against
keys (N, S, D), the mask as a 0 / -inf bias. The backward takes the forward's output and
logsumexp of each row; since it computes the softmax's row term as d_out . out, a part of a row's
keys (one sel tile) gets its exact gradient from the row's whole output and logsumexp. A row whose
keys are all masked gets 0 (with logsumexp 0), as the reference's `masked_softmax` gives.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CUDA_ALIGN = 16
"""The CUDA kernel reads the bias's rows at this alignment (elements)."""
CUDA_LSE_ROWS = 32
"""The CUDA kernel's logsumexp has its rows padded to a multiple of this."""


def fused(x: torch.Tensor) -> bool:
    """Whether the fused kernels serve this tensor's device (CPUs, CUDA)."""
    return x.device.type in ("cpu", "cuda")


def _cuda_bias(bias: torch.Tensor | None, N: int, M: int, S: int) -> torch.Tensor | None:
    """`bias` as the CUDA kernel takes it: (N, 1, M, S), each row starting at an aligned element."""
    if bias is None:
        return None
    if bias.stride(-1) != 1 or bias.stride(-2) % CUDA_ALIGN:
        aligned = bias.new_empty(*bias.shape[:-1], S + (-S % CUDA_ALIGN))[..., :S]
        bias = aligned.copy_(bias)
    return bias.expand(N, 1, M, S)


def bias_of(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The additive 0 / -inf bias of a boolean mask (True: the key is read)."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def bias_rows(mask: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The bias of a mask broadcast to `shape` (..., M, r, S) as the fused kernels' (N, 1, M * r, S):
    the rows (query, head) of N independent problems."""
    return bias_of(mask, dtype).expand(shape).reshape(-1, 1, shape[-3] * shape[-2], shape[-1])


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None, scale: float
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of q (N, M, D) over k, v (N, S, D) with `bias` (broadcast to (N, 1, M, S), or
    None) and scores scaled by `scale` -> out (N, M, D) and the logsumexp of each row (N, M)."""
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q[:, None], k[:, None], v[:, None], 0.0, False, attn_mask=bias, scale=scale)
        return out[:, 0], lse[:, 0]
    (N, M, _), S = q.shape, k.shape[1]
    out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
        q[:, None], k[:, None], v[:, None], _cuda_bias(bias, N, M, S), True, 0.0, False, scale=scale)
    return out[:, 0], lse[:, 0, :M]


def attend_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                    lse: torch.Tensor, bias: torch.Tensor | None, scale: float
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients (dq, dk, dv) of `attend` for d_out `do`, from each row's output and logsumexp
    (those of all the row's keys when k, v are a part of them)."""
    if q.device.type == "cpu":
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            do[:, None], q[:, None], k[:, None], v[:, None], out[:, None], lse[:, None], 0.0, False,
            attn_mask=bias, scale=scale)
        return dq[:, 0], dk[:, 0], dv[:, 0]
    (N, M, _), S = q.shape, k.shape[1]
    no_dropout = torch.empty((), dtype=torch.long)  # the philox seed and offset: unused without dropout
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        do.contiguous()[:, None], q[:, None], k[:, None], v[:, None], _cuda_bias(bias, N, M, S), out[:, None],
        F.pad(lse, (0, -M % CUDA_LSE_ROWS))[:, None], no_dropout, no_dropout, 0.0, [True, True, True, False],
        False, scale=scale)
    return dq[:, 0], dk[:, 0], dv[:, 0]
