"""The Triton family: the Triton kernels (`triton_shared` for cmp and win, `triton_sel`), on CUDA, or on the CPU
under TRITON_INTERPRET=1 (for checks)."""

from __future__ import annotations

import torch

from ..common import NSASpec
from ..kernels import Kernels, triton_problem
from .base import Branchwise


class Triton(Branchwise):
    name, label, kernels = "triton", "Triton kernels", Kernels("triton", "triton", "triton")

    @staticmethod
    def problem(device: torch.device, dtype: torch.dtype, spec: NSASpec, heads_per_group: int, head_dim: int
                ) -> str | None:
        return triton_problem(device, head_dim, spec, dtype)
