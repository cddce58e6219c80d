"""The Triton family: the whole NSA attention as one op of Triton kernels (`triton_nsa`): one launch forward,
a zero fill, three kernels and a conversion backward, on CUDA, or on the CPU under TRITON_INTERPRET=1 (checks)."""

from __future__ import annotations

import torch

from .. import triton_nsa
from ..common import NSASpec
from ..documents import Documents
from .base import Family, Tensor


class Triton(Family):
    name, label = "triton", "Triton kernels, one op"

    @staticmethod
    def problem(device: torch.device, dtype: torch.dtype, spec: NSASpec, heads_per_group: int, head_dim: int
                ) -> str | None:
        return triton_nsa.problem(device, dtype, spec, heads_per_group, head_dim)

    def attend(self, q: Tensor, k_cmp: Tensor, v_cmp: Tensor, k_sel: Tensor, v_sel: Tensor, k_win: Tensor,
               v_win: Tensor, gates: Tensor, spec: NSASpec, docs: Documents | None, q0: int,
               branches: tuple[bool, bool, bool]) -> tuple[Tensor, Tensor, Tensor]:
        return triton_nsa.nsa_attention(q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates, spec, docs, q0, branches)
