"""The flex family: cmp and win through FlexAttention (`torch.nn.attention.flex_attention`), the kernels PyTorch
maintains and tunes for each GPU generation; sel through the Triton family's kernels (`triton/family.selected`:
on CUDA, or interpreted under TRITON_INTERPRET=1), its blocks chosen by their top-n pass from the log-sum-exp Flex
returns for cmp (a bounded number of launches at any T). Where those cannot run, the blocks are chosen from the cmp
probabilities recomputed in chunks of queries from that log-sum-exp, and sel is the torch family's op
(`pytorch/ops.selected`).

Block masks are built on the device from the documents and the query part (`q0`): with documents once a batch, for
every layer (`prepare`, stored in `Documents.block_masks`), without them once a shape; never a host sync. Flex's
backward runs on CUDA only (torch 2.13), so the family trains on GPUs; on a CPU its forward runs (eager Flex, which
materialises the scores: for checks at small sizes, never `auto`'s choice).
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable, Sequence

import torch

from ...common import choose_blocks, mix_branches
from ...documents import Documents
from ...routing import _visible
from ...spec import NSASpec
from ..base import Family, Tensor
from ..pytorch import ops
from ..triton import family as triton_family
from ..triton import triton_nsa

SELECT_CHUNK = 256
"""Queries whose cmp probabilities are recomputed at once to choose their sel blocks ((B, G, chunk, r, Nc) fp32)."""


@functools.cache
def _compiled() -> Callable:
    """flex_attention compiled once (its fused kernel on a GPU)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def _flex(q: Tensor, k: Tensor, v: Tensor, mask) -> tuple[Tensor, Tensor]:
    """Flex attention of q (B, H, Tq, D) over k, v (B, G, S, D) under the block mask: (out, lse (B, H, Tq) fp32)."""
    from torch.nn.attention.flex_attention import AuxRequest, flex_attention

    if q.is_cuda:
        out, aux = _compiled()(q, k, v, block_mask=mask, enable_gqa=True, return_aux=AuxRequest(lse=True))
        return out, aux.lse
    with warnings.catch_warnings():  # compiled Flex on a CPU has no log-sum-exp: eager, for checks
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        out, aux = flex_attention(q, k, v, block_mask=mask, enable_gqa=True, return_aux=AuxRequest(lse=True))
    return out, aux.lse


def _mask_mod(kind: str, spec: NSASpec, docs: Documents | None, q0: int) -> Callable:
    """Whether query q0 + qi sees key (win) or cmp slot (cmp) i: the NSA rules of `common` and `Documents`."""
    start = docs.start if docs is not None else None
    cmp_start = docs.cmp_start if docs is not None else None

    def cmp(b: Tensor, h: Tensor, qi: Tensor, i: Tensor) -> Tensor:
        t = qi + q0
        if cmp_start is None:
            return i * spec.d + spec.l - 1 <= t
        c = cmp_start[b, i]
        return (c >= start[b, t]) & (c + spec.l - 1 <= t)

    def win(b: Tensor, h: Tensor, qi: Tensor, s: Tensor) -> Tensor:
        t = qi + q0
        inside = (s <= t) & (s > t - spec.w)
        return inside if start is None else inside & (s >= start[b, t])

    return cmp if kind == "cmp" else win


def block_mask(kind: str, spec: NSASpec, docs: Documents | None, q0: int, Tq: int, S: int, B: int,
               device: torch.device):
    """The BlockMask of branch `kind` (cmp: S compressed slots; win: S keys) for the queries q0 .. q0 + Tq - 1."""
    from torch.nn.attention.flex_attention import create_block_mask

    return create_block_mask(_mask_mod(kind, spec, docs, q0), B=B if docs is not None else None, H=None, Q_LEN=Tq,
                             KV_LEN=S, device=device, _compile=device.type == "cuda")


def chosen_blocks(q: Tensor, k_cmp: Tensor, lse: Tensor, spec: NSASpec, docs: Documents | None, q0: int, T: int
                  ) -> tuple[Tensor, Tensor]:
    """The sel blocks (idx, valid (B, G, Tq, n')) of the queries q (B, Tq, H, D) at q0..: their cmp probabilities
    exp(q . k / sqrt(D) - lse) over the slots they see, summed over a group's heads, `choose_blocks` in chunks."""
    B, Tq, H, D = q.shape
    Nc, G = k_cmp.shape[1], k_cmp.shape[2]
    r = H // G
    kc = k_cmp.float().transpose(1, 2)  # (B, G, Nc, D)
    found = []
    with torch.no_grad():
        for c0 in range(0, Tq, SELECT_CHUNK):
            c1 = min(Tq, c0 + SELECT_CHUNK)
            qg = q[:, c0:c1].float().reshape(B, c1 - c0, G, r, D).transpose(1, 2)  # (B, G, C, r, D)
            s = (qg.reshape(B, G, -1, D) @ kc.transpose(2, 3)).view(B, G, c1 - c0, r, Nc) * D**-0.5
            chunk_lse = lse[:, :, c0:c1].reshape(B, G, r, c1 - c0).transpose(2, 3)  # (B, G, C, r)
            visible = _visible(spec, docs, q0 + c0, q0 + c1, Nc, q.device)
            p = torch.where(visible, torch.exp(s - chunk_lse[..., None]), 0.0)
            found.append(choose_blocks(p.sum(3), spec, q0 + c0, T, docs))
    return torch.cat([f[0] for f in found], 2), torch.cat([f[1] for f in found], 2)


class Flex(Family):
    name, label = "flex", "FlexAttention for cmp and win, sel in PyTorch"

    def __init__(self) -> None:
        self.masks: dict[tuple, object] = {}  # without documents: a mask per (branch, q0, Tq, S), built once

    @staticmethod
    def problem(device: torch.device, dtype: torch.dtype, spec: NSASpec, heads_per_group: int, head_dim: int
                ) -> str | None:
        if device.type != "cuda":
            return "FlexAttention's backward runs on CUDA devices only (torch 2.13): the flex family trains on GPUs"
        return None

    def prepare(self, docs: Documents, spec: NSASpec, parts: Sequence[tuple[int, int]]) -> Documents:
        """`docs` with the cmp and win block masks of each query part (q0, q1), built once a batch for every layer
        (with documents the compressed keys are a slot a stride: T / d)."""
        B, T = docs.start.shape
        masks = {(kind, a, b): block_mask(kind, spec, docs, a, b - a, T // spec.d if kind == "cmp" else T, B,
                                          docs.start.device) for kind in ("cmp", "win") for a, b in parts}
        return dataclasses.replace(docs, block_masks={**docs.block_masks, **masks})

    def mask(self, kind: str, spec: NSASpec, docs: Documents | None, q0: int, Tq: int, S: int, device: torch.device):
        """The block mask of `kind` for these queries: the batch's (`prepare`), the shape's, or built now."""
        if docs is not None:
            found = docs.block_masks.get((kind, q0, q0 + Tq))
            return found if found is not None else block_mask(kind, spec, docs, q0, Tq, S, docs.start.shape[0], device)
        key = (kind, q0, Tq, S, device)
        if key not in self.masks:
            self.masks[key] = block_mask(kind, spec, None, q0, Tq, S, 1, device)
        return self.masks[key]

    def attend(self, q: Tensor, k_cmp: Tensor, v_cmp: Tensor, k_sel: Tensor, v_sel: Tensor, k_win: Tensor,
               v_win: Tensor, gates: Tensor, spec: NSASpec, docs: Documents | None, q0: int,
               branches: tuple[bool, bool, bool]) -> tuple[Tensor, Tensor, Tensor]:
        B, Tq, H, D = q.shape
        T, G = k_sel.shape[1], k_sel.shape[2]
        r, acc = H // G, torch.promote_types(q.dtype, torch.float32)
        qh = q.transpose(1, 2)

        def heads(o: Tensor) -> Tensor:  # (B, H, Tq, D) -> (B, G, Tq, r, D)
            return o.view(B, G, r, Tq, D).transpose(2, 3).to(acc)

        o_cmp = o_sel = o_win = idx = valid = sel_gated = None
        if branches[0] or branches[1]:  # sel reads the cmp probabilities
            mask = self.mask("cmp", spec, docs, q0, Tq, k_cmp.shape[1], q.device)
            cmp_in = [x if branches[0] else x.detach() for x in (qh, k_cmp.transpose(1, 2), v_cmp.transpose(1, 2))]
            out, lse = _flex(*cmp_in, mask)  # sel alone: its log-sum-exp, no gradient
            o_cmp = heads(out) if branches[0] else None
            if branches[1] and triton_nsa.problem(q.device, q.dtype, spec, r, D) is None:
                sel_gated, idx, valid = triton_family.selected(q, k_cmp, v_cmp, k_sel, v_sel, gates, lse, spec, docs,
                                                               q0)
            else:
                idx, valid = chosen_blocks(q, k_cmp, lse, spec, docs, q0, T)
        if branches[1] and sel_gated is None:
            qs = q.to(acc).view(B, Tq, G, r, D).transpose(1, 2).contiguous()
            o_sel = ops.selected(qs, k_sel.to(acc).transpose(1, 2).contiguous(),
                                 v_sel.to(acc).transpose(1, 2).contiguous(), idx, valid, spec, q0, docs)
        if branches[2]:
            out, _ = _flex(qh, k_win.transpose(1, 2), v_win.transpose(1, 2),
                           self.mask("win", spec, docs, q0, Tq, T, q.device))
            o_win = heads(out)
        outs = [o if on else None for o, on in zip((o_cmp, o_sel, o_win), branches)]
        if not any(o is not None for o in outs):  # sel alone, by the Triton kernels
            return sel_gated, idx, valid
        g = gates.to(acc).view(B, Tq, G, r, 3).transpose(1, 2)
        out = mix_branches(g, *outs).transpose(1, 2).reshape(B, Tq, H, D)
        return (out if sel_gated is None else out + sel_gated.to(acc)).to(q.dtype), idx, valid
