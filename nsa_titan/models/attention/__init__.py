"""Attention implementations: reference NSA, dense causal baseline, and the rules they share."""

from .common import NSASpec, cmp_visibility, select_blocks, sel_members
from .dense import dense_causal
from .fast import nsa_fast
from .reference import masked_attention, nsa_reference

NSA_IMPLS = {"reference": nsa_reference, "fast": nsa_fast}
"""`[model] attn_impl` -> function with nsa_reference's signature."""

__all__ = [
    "NSASpec", "NSA_IMPLS", "cmp_visibility", "dense_causal", "masked_attention",
    "nsa_fast", "nsa_reference", "select_blocks", "sel_members",
]
