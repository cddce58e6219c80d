"""Attention: what every NSA kernel family shares (the rules and spec `common`, `documents`, the exact `reference`,
the block scores' straight-through gradient `routing`), the families themselves (`families/`: reference,
pytorch, cpp, triton, one folder each), and the dense causal baseline (`dense`)."""

from .common import BRANCHES, cmp_visibility, mix_branches, select_blocks, sel_members, top_n
from .dense import dense_causal
from .documents import Documents
from .families.choose import FAMILIES, Family, choose_family, describe_attention, model_family
from .families.pytorch.fast import nsa_fast
from .families.pytorch.kernels import Kernels
from .reference import masked_attention, nsa_reference
from .routing import set_explore_step, with_score_grad
from .spec import NSASpec

__all__ = [
    "BRANCHES", "Documents", "FAMILIES", "Family", "Kernels", "NSASpec", "choose_family", "cmp_visibility",
    "dense_causal", "describe_attention", "masked_attention", "mix_branches", "model_family",
    "nsa_fast", "nsa_reference", "select_blocks", "sel_members", "set_explore_step", "top_n", "with_score_grad",
]
