"""The interface every NSA kernel family implements: the whole attention, forward and backward, in one call.

A family takes the queries, the cmp / sel / win keys and values, the gates and the document geometry
(`Documents`, or None) and returns the gated output with the sel blocks each query's group read. The
off-paper block-score gradient (`routing.with_score_grad`) wraps the output the same way in every family;
`score_kernel` says which of its kernels computes it. Families are chosen once, when a layer is built
(`families.choose_family`), and each says why it cannot run on a device, dtype or shape (`problem`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import torch

from ..documents import Documents
from ..routing import with_score_grad
from ..spec import NSASpec

Tensor = torch.Tensor


class Family:
    """One NSA attention op; subclasses implement `attend` and, where they cannot run everywhere, `problem`."""

    name: ClassVar[str]
    """The `[model] kernels` value that asks for it."""
    label: ClassVar[str]
    """What the startup log calls it."""
    score_kernel: ClassVar[str] = "torch"
    """The kernel of the block scores' straight-through gradient (`routing.with_score_grad`)."""
    win_flash: ClassVar[bool] = False
    """Whether the win branch reads flash-attn's varlen boundaries (`Documents.varlen`)."""

    @staticmethod
    def problem(device: torch.device, dtype: torch.dtype, spec: NSASpec, heads_per_group: int, head_dim: int
                ) -> str | None:
        """Why this family cannot run on `device` in `dtype` at this shape, or None."""
        return None

    def prepare(self, docs: Documents, spec: NSASpec, parts: Sequence[tuple[int, int]]) -> Documents:
        """What the family needs of a batch's documents, built once for every layer (the query `parts` (q0, q1)
        attention takes): `docs` as they are, unless a family keeps more in them."""
        return docs

    def attend(self, q: Tensor, k_cmp: Tensor, v_cmp: Tensor, k_sel: Tensor, v_sel: Tensor, k_win: Tensor,
               v_win: Tensor, gates: Tensor, spec: NSASpec, docs: Documents | None, q0: int,
               branches: tuple[bool, bool, bool]) -> tuple[Tensor, Tensor, Tensor]:
        """(o, idx, valid): the gated output (B, Tq, H, D) and the sel blocks read (B, G, Tq, n')."""
        raise NotImplementedError

    def __call__(self, q: Tensor, k_cmp: Tensor, v_cmp: Tensor, k_sel: Tensor, v_sel: Tensor, k_win: Tensor,
                 v_win: Tensor, gates: Tensor, spec: NSASpec, docs: Documents | None = None, q0: int = 0,
                 branches: tuple[bool, bool, bool] = (True, True, True), return_selection: bool = False,
                 score_grad: float = 0.0, explore: int = 0, seed: Tensor | int = 0
                 ) -> Tensor | tuple[Tensor, Tensor, Tensor]:
        """NSA attention of the queries q (B, Tq, H, D) at positions q0 .. q0 + Tq - 1 (q0 a multiple of l'
        under context parallelism) over the keys of the whole sequence: k_cmp, v_cmp (B, Nc, G, D) compressed
        (with `docs`: the slots of `docs.cmp_start`), k_sel .. v_win (B, T, G, D), gates (B, Tq, H, 3) in
        (cmp, sel, win) order. `branches`: those summed (one left out is not computed); `score_grad`,
        `explore`, `seed`: the block scores' straight-through gradient (`routing.with_score_grad`).
        Returns o (B, Tq, H, D), with `return_selection` (o, idx, valid) (`common.select_blocks`)."""
        o, idx, valid = self.attend(q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates, spec, docs, q0, branches)
        if score_grad:
            o = with_score_grad(o, q, k_cmp, k_sel, v_sel, gates, spec, score_grad, docs, q0, explore, seed,
                                (idx, valid), self.score_kernel)
        return (o, idx, valid) if return_selection else o
