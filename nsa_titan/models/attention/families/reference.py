"""The reference family: the exact definition, every branch a masked attention over a dense mask (O(T^2))."""

from __future__ import annotations

from ..documents import Documents
from ..reference import nsa_reference
from ..spec import NSASpec
from .base import Family, Tensor


class Reference(Family):
    """`reference.nsa_reference`: the yardstick every other family is checked against; all the queries at once."""

    name, label = "reference", "reference: dense masks for every branch"

    def attend(self, q: Tensor, k_cmp: Tensor, v_cmp: Tensor, k_sel: Tensor, v_sel: Tensor, k_win: Tensor,
               v_win: Tensor, gates: Tensor, spec: NSASpec, docs: Documents | None, q0: int,
               branches: tuple[bool, bool, bool]) -> tuple[Tensor, Tensor, Tensor]:
        if q0 or q.shape[1] != k_sel.shape[1]:
            raise ValueError("the reference family takes every query of the sequence at once (no context-parallel "
                             "parts): use a fast family")
        return nsa_reference(q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates, spec, docs, branches, True)
