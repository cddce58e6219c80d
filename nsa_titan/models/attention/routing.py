"""A gradient for the selection's block scores (`[model] sel_score_grad`, off-paper).

In NSA a sel block's score s_j is the cmp attention probability summed over the block's cmp members
(Eq. 9-10), and the top-n choice passes no gradient: the compressed keys learn only from the cmp
output. Where that output is of no use, nothing teaches the scores to point at the block a query
needs (README "Long-range recall").

This module gives the scores the gradient they would get if the sel logits of block j's keys were
biased by log s_j (a straight-through estimate): the forward is unchanged (the bias is log s_j minus
itself, 0), and in backward

    dL/dlog s_j = sum over the group's heads h, keys k of block j:  p_hk (dL/do_h . (v_k - o_h)),

p_hk the sel attention probability, v_k the sel value, o_h the sel output, dL/do_h the gradient
reaching the sel output (the layer's gradient times the sel gate). A chosen block whose keys, read
more, would lower the loss gets a higher score, one whose keys mislead a lower one. Only the blocks
chosen by score get it (forced blocks are chosen whatever their score). The scores' gradient then
reaches the queries and the compressed keys through the cmp probabilities, recomputed densely here:
a (T, T/d) matrix per layer, so this is for research runs at moderate T.
"""

from __future__ import annotations

import torch

from .common import NSASpec, block_scores, choose_blocks, cmp_visibility, forced_blocks, masked_softmax
from .documents import Documents

CHUNK = 256
"""Queries whose selected keys and values are gathered at once in backward (memory: CHUNK x n x l' x 2 keys)."""


def with_score_grad(o: torch.Tensor, q: torch.Tensor, kc: torch.Tensor, k_sel: torch.Tensor, v_sel: torch.Tensor,
                    gates: torch.Tensor, spec: NSASpec, weight: float, docs: Documents | None = None, q0: int = 0
                    ) -> torch.Tensor:
    """o (B, Tq, H, D), the attention output of the queries q (B, Tq, H, D) at q0 .. q0 + Tq - 1,
    unchanged; in backward the block scores also get the straight-through gradient, times `weight`.

    kc: (B, Nc, G, D) compressed keys (with `docs`: the slots of `docs.cmp_start`); k_sel, v_sel:
    (B, T, G, D) the sel keys and values of the whole sequence; gates (B, Tq, H, 3)."""
    B, Tq, H, D = q.shape
    T, G = k_sel.shape[1], k_sel.shape[2]
    acc = torch.promote_types(q.dtype, torch.float32)
    qg = q.to(acc).view(B, Tq, G, H // G, D).transpose(1, 2)  # (B, G, Tq, r, D)
    if docs is None:
        visible = cmp_visibility(spec, T, q.device)[q0:q0 + Tq, None, :]  # (Tq, 1, Nc)
    else:
        visible = docs.cmp_visible(spec, q0, q0 + Tq, kc.shape[1])[:, None, :, None]  # (B, 1, Tq, 1, Nc)
    logits = torch.einsum("bgtrd,bsgd->bgtrs", qg, kc.to(acc)) * D**-0.5
    p_group = masked_softmax(logits, visible).sum(3)  # (B, G, Tq, Nc): Eq. 10's sum over the group's heads
    scores, t = block_scores(p_group, spec, q0, T, docs)
    idx, valid = choose_blocks(p_group.detach(), spec, q0, T, docs)  # (B, G, Tq, n)
    free = valid & ~forced_blocks(idx, t[:, None], spec)
    log_s = torch.log(scores.gather(-1, idx).clamp_min(1e-30))
    return _ScoreStraightThrough.apply(o, log_s, qg.detach(), k_sel.detach(), v_sel.detach(),
                                       gates[..., 1].detach(), idx, valid, free, spec, docs, q0, weight)


class _ScoreStraightThrough(torch.autograd.Function):
    """o unchanged; backward: `score_grad` into log_s."""

    @staticmethod
    def forward(ctx, o, log_s, qg, k_sel, v_sel, g_sel, idx, valid, free, spec, docs, q0, weight):
        ctx.save_for_backward(qg, k_sel, v_sel, g_sel, idx, valid, free)
        ctx.spec, ctx.docs, ctx.q0, ctx.weight = spec, docs, q0, weight
        return o.view_as(o)

    @staticmethod
    def backward(ctx, d_o):
        qg, k_sel, v_sel, g_sel, idx, valid, free = ctx.saved_tensors
        d_log_s = score_grad(d_o, qg, k_sel, v_sel, g_sel, idx, valid, ctx.spec, ctx.docs, ctx.q0) * free * ctx.weight
        return d_o, d_log_s, *(None,) * 11


@torch.no_grad()
def score_grad(d_o: torch.Tensor, qg: torch.Tensor, k_sel: torch.Tensor, v_sel: torch.Tensor, g_sel: torch.Tensor,
               idx: torch.Tensor, valid: torch.Tensor, spec: NSASpec, docs: Documents | None, q0: int) -> torch.Tensor:
    """dL/dlog s_j (B, G, Tq, n) for the chosen blocks idx, valid (B, G, Tq, n): d_o (B, Tq, H, D) the
    gradient of the layer's attention output, qg (B, G, Tq, r, D), k_sel, v_sel (B, T, G, D), g_sel
    (B, Tq, H) the sel gates."""
    B, G, Tq, r, D = qg.shape
    T, n, L = k_sel.shape[1], idx.shape[-1], spec.l_sel
    d_sel = (d_o.to(qg.dtype) * g_sel.to(qg.dtype)[..., None]).view(B, Tq, G, r, D).transpose(1, 2)  # (B, G, Tq, r, D)
    kv = torch.cat([k_sel, v_sel], -1).to(qg.dtype).transpose(1, 2)  # (B, G, T, 2D)
    out = []
    for c0 in range(0, Tq, CHUNK):
        c1 = min(Tq, c0 + CHUNK)
        t = torch.arange(q0 + c0, q0 + c1, device=qg.device)  # absolute positions
        start = 0 if docs is None else docs.start[:, None, q0 + c0:q0 + c1, None]  # (B, 1, C, 1)
        pos = ((start + idx[:, :, c0:c1] * L)[..., None] + torch.arange(L, device=qg.device)).flatten(-2)
        ok = valid[:, :, c0:c1].repeat_interleave(L, -1) & (pos <= t[:, None])  # (B, G, C, n L)
        gathered = kv.gather(2, pos.clamp(max=T - 1).flatten(2)[..., None].expand(-1, -1, -1, 2 * D))
        k, v = gathered.view(B, G, c1 - c0, n * L, 2 * D).split(D, -1)
        p = masked_softmax(torch.einsum("bgcrd,bgckd->bgcrk", qg[:, :, c0:c1], k) * D**-0.5, ok[:, :, :, None])
        d = d_sel[:, :, c0:c1]
        o_h = torch.einsum("bgcrk,bgckd->bgcrd", p, v)
        contrib = p * (torch.einsum("bgcrd,bgckd->bgcrk", d, v) - (d * o_h).sum(-1, keepdim=True))
        out.append(contrib.view(B, G, c1 - c0, r, n, L).sum((3, 5)))
    return torch.cat(out, 2)
