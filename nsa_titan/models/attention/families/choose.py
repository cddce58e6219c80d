"""NSA attention kernel families: one module each, one interface (`base.Family`), chosen once per run.

  reference  dense masks for every branch, the exact definition (O(T^2) memory): the yardstick
  torch      PyTorch chunks and tiles through ATen's fused attention kernels (CPUs, CUDA)
  flash      torch, with the win branch through flash-attn (CUDA, fp16 / bf16)
  cpp        NSA's C++ kernels (CPUs, fp32 compute)
  triton     Triton kernels (CUDA; on the CPU under TRITON_INTERPRET=1, for checks)
  flex       FlexAttention for cmp and win, sel by the torch family's op (CUDA; forward on a CPU, for checks)

A run's `[model] kernels = auto` takes the fastest family that passes its check, timed at startup
(`runtime.kernel_timing`); a model built without a run (inference) takes the first of `AUTO_ORDER` that runs here.
Naming one that cannot run is a ConfigError that says why, at startup.
"""

from __future__ import annotations

import torch

from ....config import ConfigError, Model
from ..spec import NSASpec
from .base import Family, Tensor
from .cpp.family import Cpp
from .flex.family import Flex
from .pytorch.family import Flash, PyTorch
from .reference import Reference
from .triton.family import Triton

FAMILIES: dict[str, type[Family]] = {f.name: f for f in (Reference, PyTorch, Flash, Cpp, Triton, Flex)}
AUTO_ORDER = ("triton", "flex", "cpp", "flash", "torch")
"""The families `auto` considers, the likely fastest first (what it takes untimed); torch runs everywhere."""


def choose_family(choice: str, device: torch.device, dtype: torch.dtype, spec: NSASpec, heads_per_group: int,
                  head_dim: int) -> Family:
    """The family for `[model] kernels = choice` (or `reference`) on `device` in compute `dtype`; a ConfigError
    naming the reason if the family asked for by name cannot run."""
    if choice != "auto":
        family = FAMILIES[choice]
        problem = family.problem(device, dtype, spec, heads_per_group, head_dim)
        if problem:
            raise ConfigError(f"[model] kernels = '{choice}' cannot run: {problem}; use kernels = 'auto' (the fastest "
                              f"that runs) or 'torch'")
        return family()
    name = next(n for n in AUTO_ORDER if not FAMILIES[n].problem(device, dtype, spec, heads_per_group, head_dim))
    return FAMILIES[name]()


def model_family(m: Model, device: torch.device, dtype: torch.dtype, spec: NSASpec) -> Family:
    """The family of the NSA model `m` (`attn_impl`, `kernels`) for a run on `device` in `dtype`."""
    return choose_family("reference" if m.attn_impl == "reference" else m.kernels, device, dtype, spec,
                         m.n_heads // m.n_kv_groups, m.head_dim)


class Auto(Family):
    """`auto`, chosen at each call for the tensors it gets (a model built without a run's device)."""

    name, label = "auto", "chosen per call"

    def __call__(self, q: Tensor, k_cmp: Tensor, v_cmp: Tensor, k_sel: Tensor, v_sel: Tensor, k_win: Tensor,
                 v_win: Tensor, gates: Tensor, spec: NSASpec, **kwargs):
        family = choose_family("auto", q.device, q.dtype, spec, q.shape[2] // k_sel.shape[2], q.shape[3])
        return family(q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates, spec, **kwargs)


def describe_attention(m: Model, family: Family | None) -> str:
    """The attention that runs and its family (the startup log)."""
    if m.attention == "dense":
        return "dense attention (causal SDPA)"
    branch = f", only the {m.nsa_branch} branch" if m.nsa_branch != "all" else ""
    family = family or Auto()
    return f"NSA attention, {family.name} family ({family.label}{branch})"


__all__ = ["AUTO_ORDER", "Auto", "FAMILIES", "Family", "choose_family", "describe_attention", "model_family"]
