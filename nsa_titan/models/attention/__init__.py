"""Attention implementations: NSA's kernel families (`families/`: reference, PyTorch, C++, Triton), the dense causal baseline, the
rules they share, and the block scores' straight-through gradient (`routing`)."""

from .common import BRANCHES, NSASpec, cmp_visibility, mix_branches, select_blocks, sel_members, top_n
from .documents import Documents
from .dense import dense_causal
from .fast import nsa_fast
from .families import FAMILIES, Family, choose_family, describe_attention, model_family
from .kernels import Kernels
from .reference import masked_attention, nsa_reference
from .routing import set_explore_step, with_score_grad

__all__ = [
    "BRANCHES", "Documents", "FAMILIES", "Family", "Kernels", "NSASpec", "choose_family", "cmp_visibility",
    "dense_causal", "describe_attention", "masked_attention", "mix_branches", "model_family",
    "nsa_fast", "nsa_reference", "select_blocks", "sel_members", "set_explore_step", "top_n", "with_score_grad",
]
