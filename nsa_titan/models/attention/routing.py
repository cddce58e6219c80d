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
reaches the queries and the compressed keys through the cmp probabilities, recomputed densely here
(a (T, T/d) matrix per layer), and backward takes the sel logits of every earlier key (T^2 / 2 products
per head, a chunk of queries at a time): this is for research runs at moderate T.

Exploration (`[model] sel_score_explore` = m): a block that is never chosen never learns that it
would help. m unchosen candidate blocks per query (drawn by a hash of the step, row, group, position
and block: no RNG state, the same under AC recompute, compile and context parallelism) also get
dL/dlog s_j, as the gradient of a weight e_j on the block's keys in the sel softmax (exp(z) e_j) at
e_j = 0, where they are now (a chosen block's bias gradient is the same derivative at e_j = 1):

    dL/de_j = sum over h, keys k of block j:  exp(z_hk - lse_h) (dL/do_h . (v_k - o_h)),

z_hk the sel logit, lse_h the log-sum-exp over the chosen keys: what adding a little of the block
would do, largest for a useful block whose keys match (the derivative at e_j = 1, as if the block
were read, fades as its keys dominate: it learned less in a recall run). The forward reads nothing
more.
"""

from __future__ import annotations

import torch

from .common import NSASpec, block_scores, choose_blocks, cmp_visibility, forced_blocks, masked_softmax
from .documents import Documents

CHUNK_LOGITS = 2**23
"""How many logits (batch x group heads x queries x keys) backward takes at once: it takes the queries a chunk
at a time (256 at the recall task's shape), 2 x 32 MiB of fp32 products a chunk."""


def with_score_grad(o: torch.Tensor, q: torch.Tensor, kc: torch.Tensor, k_sel: torch.Tensor, v_sel: torch.Tensor,
                    gates: torch.Tensor, spec: NSASpec, weight: float, docs: Documents | None = None, q0: int = 0,
                    explore: int = 0, seed: torch.Tensor | int = 0) -> torch.Tensor:
    """o (B, Tq, H, D), the attention output of the queries q (B, Tq, H, D) at q0 .. q0 + Tq - 1,
    unchanged; in backward the block scores also get the straight-through gradient, times `weight`,
    the chosen blocks' and that of `explore` unchosen candidates per query, drawn by `seed` (the step).

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
    p_group = _GroupProbabilities.apply(qg, kc.to(acc).transpose(1, 2), visible)  # (B, G, Tq, Nc)
    scores, t = block_scores(p_group, spec, q0, T, docs)
    idx, valid = choose_blocks(p_group.detach(), spec, q0, T, docs)  # (B, G, Tq, n)
    free = valid & ~forced_blocks(idx, t[:, None], spec)
    n_read = idx.shape[-1]
    if explore:
        extra, ok = explore_blocks(idx, t, scores.shape[-1], spec, explore, seed)
        idx, valid, free = torch.cat([idx, extra], -1), torch.cat([valid, ok], -1), torch.cat([free, ok], -1)
    log_s = torch.log(scores.gather(-1, idx).clamp_min(1e-30))
    return _ScoreStraightThrough.apply(o, log_s, qg.detach(), k_sel.detach(), v_sel.detach(),
                                       gates[..., 1].detach(), idx, valid, free, spec, docs, q0, weight, n_read)


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """Integers (int64, >= 0) -> integers in [0, 2^32), well mixed (a 32-bit integer hash)."""
    x = x & 0xFFFFFFFF
    for _ in range(2):
        x = ((x ^ (x >> 16)) * 0x45D9F3B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def set_explore_step(model: torch.nn.Module, step: int) -> None:
    """Seed every NSA layer's draw of explored blocks (`sel_score_explore`) with the training step, so
    that each step explores other blocks (a buffer: no recompile, the same in AC's recompute)."""
    for module in model.modules():
        if isinstance(getattr(module, "explore_step", None), torch.Tensor):
            module.explore_step.fill_(step)


def explore_blocks(idx: torch.Tensor, t: torch.Tensor, Ns: int, spec: NSASpec, m: int, seed: torch.Tensor | int = 0
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """m unchosen, unforced candidate blocks per query, drawn uniformly by a hash of (seed, row, group, t, j):
    extra (B, G, C, m') long, m' = min(m, Ns), and whether each is real (fewer candidates: False).

    idx (B, G, C, n): the chosen blocks of Ns; t (1 or B, C): the query positions blocks count from."""
    B, G, C, _ = idx.shape
    dev = idx.device
    j = torch.arange(Ns, device=dev)
    candidate = (j <= torch.div(t, spec.l_sel, rounding_mode="floor")[..., None]) & ~forced_blocks(j, t, spec)
    candidate = candidate[:, None].expand(B, G, C, Ns).clone()
    candidate.scatter_(-1, idx, False)
    row = torch.arange(B * G, device=dev).view(B, G, 1, 1)
    key = _hash32(_hash32(seed * 0x27D4EB2F + row) * 0x9E3779B1 ^ t[:, None, :, None] * 0x85EBCA77 ^ j * 0xC2B2AE3D)
    key = key.double() / 2**32  # uniform in [0, 1)
    key, extra = torch.topk(torch.where(candidate, key, -1.0), min(m, Ns), dim=-1)
    return extra, key >= 0


class _GroupProbabilities(torch.autograd.Function):
    """The cmp probabilities summed over a group's heads (Eq. 10), p_group (B, G, Tq, Nc), from qg (B, G,
    Tq, r, D), kc (B, G, Nc, D) and `visible` (broadcast to (B, G, Tq, r, Nc)): autograd's softmax with
    fewer passes over the (B, G, Tq, r, Nc) probabilities, which are all it keeps for backward."""

    @staticmethod
    def forward(ctx, qg, kc, visible):
        B, G, Tq, r, D = qg.shape
        p = (qg.reshape(B, G, Tq * r, D) @ kc.transpose(2, 3)).view(B, G, Tq, r, -1).mul_(D**-0.5)
        p.masked_fill_(~visible, float("-inf"))
        m = p.amax(-1, keepdim=True)
        p.sub_(torch.where(torch.isfinite(m), m, 0.0)).exp_()  # a row with nothing visible: all 0
        denom = p.sum(-1, keepdim=True)
        p.div_(torch.where(denom > 0, denom, 1.0))
        ctx.save_for_backward(qg, kc, p)
        return p.sum(3)

    @staticmethod
    def backward(ctx, d_group):
        qg, kc, p = ctx.saved_tensors
        B, G, Tq, r, D = qg.shape
        d_logits = p * d_group[:, :, :, None]  # softmax backward: p (dp - sum p dp), dp = d_group for every head
        d_logits.addcmul_(p, d_logits.sum(-1, keepdim=True), value=-1.0)
        d_logits = d_logits.view(B, G, Tq * r, -1)
        dq = (d_logits @ kc).view(B, G, Tq, r, D) * D**-0.5
        dk = (d_logits.transpose(2, 3) @ qg.reshape(B, G, Tq * r, D)) * D**-0.5
        return dq, dk, None


class _ScoreStraightThrough(torch.autograd.Function):
    """o unchanged; backward: `score_grad` into log_s."""

    @staticmethod
    def forward(ctx, o, log_s, qg, k_sel, v_sel, g_sel, idx, valid, free, spec, docs, q0, weight, n_read):
        ctx.save_for_backward(qg, k_sel, v_sel, g_sel, idx, valid, free)
        ctx.spec, ctx.docs, ctx.q0, ctx.weight, ctx.n_read = spec, docs, q0, weight, n_read
        return o.view_as(o)

    @staticmethod
    def backward(ctx, d_o):
        qg, k_sel, v_sel, g_sel, idx, valid, free = ctx.saved_tensors
        d_log_s = score_grad(d_o, qg, k_sel, v_sel, g_sel, idx, valid, ctx.spec, ctx.docs, ctx.q0, ctx.n_read)
        return d_o, d_log_s * free * ctx.weight, *(None,) * 12


@torch.no_grad()
def score_grad(d_o: torch.Tensor, qg: torch.Tensor, k_sel: torch.Tensor, v_sel: torch.Tensor, g_sel: torch.Tensor,
               idx: torch.Tensor, valid: torch.Tensor, spec: NSASpec, docs: Documents | None, q0: int,
               n_read: int | None = None) -> torch.Tensor:
    """dL/dlog s_j (B, G, Tq, n) for the blocks idx, valid (B, G, Tq, n), of which the first n_read
    (default all) are the chosen ones the sel branch reads, the rest explored: d_o (B, Tq, H, D) the
    gradient of the layer's attention output, qg (B, G, Tq, r, D), k_sel, v_sel (B, T, G, D), g_sel
    (B, Tq, H) the sel gates.

    A chunk of queries takes its logits q.k and products dL/do.v against every key before it in two
    matrix products, then picks out the blocks' keys: at the recall task's shape (T = 1,024, 24 blocks
    of 8 keys) about 3x the arithmetic of the chosen keys alone, but not a gather of 192 key rows per query."""
    B, G, Tq, r, D = qg.shape
    n, L = idx.shape[-1], spec.l_sel
    R = (n if n_read is None else n_read) * L  # the first R of a query's n L keys are read, the rest explored
    d_sel = (d_o.to(qg.dtype) * g_sel.to(qg.dtype)[..., None]).view(B, Tq, G, r, D).transpose(1, 2)  # (B, G, Tq, r, D)
    k, v = (x.to(qg.dtype).transpose(1, 2) for x in (k_sel, v_sel))  # (B, G, T, D)
    out, chunk = [], max(1, CHUNK_LOGITS // (B * G * r * (q0 + Tq)))
    for c0 in range(0, Tq, chunk):
        c1 = min(Tq, c0 + chunk)
        S, C = q0 + c1, c1 - c0  # the chunk's queries see keys 0 .. S - 1
        t = torch.arange(q0 + c0, q0 + c1, device=qg.device)  # absolute positions
        start = 0 if docs is None else docs.start[:, None, q0 + c0:q0 + c1, None]  # (B, 1, C, 1)
        pos = ((start + idx[:, :, c0:c1] * L)[..., None] + torch.arange(L, device=qg.device)).flatten(-2)
        ok = (valid[:, :, c0:c1].repeat_interleave(L, -1) & (pos <= t[:, None]))[:, :, :, None]  # (B, G, C, 1, n L)
        at = pos.clamp(0, S - 1)[:, :, :, None].expand(B, G, C, r, n * L)
        z = (qg[:, :, c0:c1].reshape(B, G, C * r, D) @ k[:, :, :S].transpose(2, 3)).view(B, G, C, r, S)
        z = z.gather(-1, at) * D**-0.5  # (B, G, C, r, n L)
        dv = (d_sel[:, :, c0:c1].reshape(B, G, C * r, D) @ v[:, :, :S].transpose(2, 3)).view(B, G, C, r, S)
        dv = dv.gather(-1, at)  # dL/do_h . v_k
        p = masked_softmax(z[..., :R], ok[..., :R])
        d_o_h = (p * dv[..., :R]).sum(-1, keepdim=True)  # dL/do_h . o_h
        contrib = p * (dv[..., :R] - d_o_h)
        if R < n * L:  # explored keys: their weight in the read keys' softmax, were they added at weight 0
            lse = z[..., :R].masked_fill(~ok[..., :R], float("-inf")).logsumexp(-1, keepdim=True)
            e = torch.where(ok[..., R:], torch.exp(z[..., R:] - lse), 0.0)  # e^z / Z, unbounded
            contrib = torch.cat([contrib, e * (dv[..., R:] - d_o_h)], -1)
        out.append(contrib.view(B, G, C, r, n, L).sum((3, 5)))
    return torch.cat(out, 2)
