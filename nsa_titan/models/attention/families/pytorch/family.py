"""The branch-by-branch families: each branch one custom op of chunks and tiles (`fast.nsa_fast`), by the kernel
`kernels` names for it. The PyTorch family takes ATen's fused attention kernels (`fast_shared`, `fast_sel`);
on CUDA in fp16 / bf16, optionally with the win branch through flash-attn (`flash`). The C++ family
(`cpp/family.py`) is one of them too."""

from __future__ import annotations

import torch

from ...documents import Documents
from ...spec import NSASpec
from ..base import Family, Tensor
from .fast import nsa_fast
from .kernels import Kernels, flash_problem


class Branchwise(Family):
    """`fast.nsa_fast` with one kernel per branch (`kernels`)."""

    kernels: Kernels

    def attend(self, q: Tensor, k_cmp: Tensor, v_cmp: Tensor, k_sel: Tensor, v_sel: Tensor, k_win: Tensor,
               v_win: Tensor, gates: Tensor, spec: NSASpec, docs: Documents | None, q0: int,
               branches: tuple[bool, bool, bool]) -> tuple[Tensor, Tensor, Tensor]:
        return nsa_fast(q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates, spec, self.kernels, docs, q0, branches,
                        return_selection=True)


class PyTorch(Branchwise):
    name, label, kernels = "torch", "PyTorch: chunks and tiles through ATen's fused attention", Kernels()


class Flash(Branchwise):
    name, label, kernels, win_flash = "flash", "PyTorch, win by flash-attn", Kernels(win="flash"), True

    @staticmethod
    def problem(device: torch.device, dtype: torch.dtype, spec: NSASpec, heads_per_group: int, head_dim: int
                ) -> str | None:
        return flash_problem(device, dtype)
