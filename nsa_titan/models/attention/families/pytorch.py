"""The PyTorch family: each branch one custom op of chunks and tiles through ATen's fused attention kernels
(`fast_shared`, `fast_sel`); on CUDA in fp16 / bf16, optionally with the win branch through flash-attn."""

from __future__ import annotations

import torch

from ..common import NSASpec
from ..kernels import Kernels, flash_problem
from .base import Branchwise


class PyTorch(Branchwise):
    name, label, kernels = "torch", "PyTorch: chunks and tiles through ATen's fused attention", Kernels()


class Flash(Branchwise):
    name, label, kernels, win_flash = "flash", "PyTorch, win by flash-attn", Kernels(win="flash"), True

    @staticmethod
    def problem(device: torch.device, dtype: torch.dtype, spec: NSASpec, heads_per_group: int, head_dim: int
                ) -> str | None:
        return flash_problem(device, dtype)
