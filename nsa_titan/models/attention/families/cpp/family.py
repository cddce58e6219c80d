"""The C++ family: NSA's C++ kernels (`cpu_attention`, CPUs, fp32 compute) for every branch, the gated sum
and the block scores' gradient, each branch one custom op."""

from __future__ import annotations

import torch

from ...spec import NSASpec
from ..pytorch.family import Branchwise
from ..pytorch.kernels import Kernels
from . import cpu_attention


class Cpp(Branchwise):
    name, label, kernels, score_kernel = "cpp", "NSA's C++ kernels", Kernels("cpp", "cpp", "cpp"), "cpp"

    @staticmethod
    def problem(device: torch.device, dtype: torch.dtype, spec: NSASpec, heads_per_group: int, head_dim: int
                ) -> str | None:
        return cpu_attention.problem(device, dtype, spec, heads_per_group, head_dim)
