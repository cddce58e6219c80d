"""The kernel of each branch of the branch-by-branch path (`fast.nsa_fast`), and why each cannot run.

  cmp  PyTorch chunks (`fast_shared.py`) or NSA's C++ kernel (`cpu_attention.py`)
  sel  PyTorch block-centric tiles (`fast_sel.py`) or NSA's C++ kernel
  win  PyTorch chunks, flash-attn's sliding window (`window_flash`), or NSA's C++ kernel
On CPUs and CUDA devices the PyTorch kernels run their chunks and tiles through ATen's fused
attention kernels (`fused_attention.py`): they are what SDPA runs there. The kernel families
(`families/`) fix these per run; Triton runs on the CPU only under TRITON_INTERPRET=1 (for checks).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...documents import Documents, varlen_boundaries
from ...spec import NSASpec

try:
    from flash_attn import flash_attn_func, flash_attn_varlen_func
except ImportError:  # optional GPU extra
    flash_attn_func = flash_attn_varlen_func = None

NAMES = {"torch": "PyTorch", "flash": "flash-attn", "cpp": "C++"}


@dataclass(frozen=True)
class Kernels:
    """The kernel of each branch: `torch`, `cpp` or (win) `flash`."""

    cmp: str = "torch"
    sel: str = "torch"
    win: str = "torch"

    def describe(self) -> str:
        return ", ".join(f"{b} {NAMES[getattr(self, b)]}" for b in ("cmp", "sel", "win"))


def flash_problem(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why flash-attn cannot run the win branch here, or None."""
    if flash_attn_func is None:
        return "flash-attn is not installed (pip install flash-attn)"
    if device.type != "cuda":
        return f"flash-attn runs on CUDA devices and this run is on {device.type}"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"flash-attn takes float16 or bfloat16, and the compute dtype is {dtype}"
    return None


def window_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: NSASpec, docs: Documents | None,
                 q0: int) -> torch.Tensor:
    """The win branch by flash-attn's sliding window: q (B, Tq, H, D) at positions q0 .. q0 + Tq - 1,
    k, v (B, T, G, D) of the whole sequence -> (B, G, Tq, r, D). Query t reads keys t - w + 1 .. t
    (window_size = (w - 1, 0)); the keys passed are those from the first query's window on, which
    flash-attn's causal mask aligns with the queries at the bottom right. With `docs`, through the
    varlen entry point, each document's part of the queries and of the keys one sequence."""
    B, Tq, H, D = q.shape
    lo, hi = max(0, q0 - spec.w + 1), q0 + Tq
    k, v = k[:, lo:hi], v[:, lo:hi]
    window = (spec.w - 1, 0)
    if docs is None:
        o = flash_attn_func(q, k, v, causal=True, window_size=window)  # (B, Tq, H, D)
    else:
        flat = lambda x: x.reshape(-1, *x.shape[2:])  # noqa: E731
        cu_q, cu_k = docs.varlen.get((lo, q0, hi)) or varlen_boundaries(docs.start, lo, q0, hi)
        o = flash_attn_varlen_func(flat(q), flat(k), flat(v), cu_q, cu_k, Tq, hi - lo, causal=True,
                                   window_size=window).view(B, Tq, H, D)
    return o.view(B, Tq, k.shape[2], H // k.shape[2], D).transpose(1, 2)
