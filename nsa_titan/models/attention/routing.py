"""A gradient for the selection's block scores (`[model] sel_score_grad`, off-paper).

In NSA a sel block's score s_j is the cmp attention probability summed over the block's cmp members
(Eq. 9-10), and the top-n choice passes no gradient: the compressed keys learn only from the cmp
output. Where that output is of no use, nothing teaches the scores to point at the block a query
needs (docs/recall.md).

This module gives the scores the gradient they would get if the sel logits of block j's keys were
biased by log s_j (a straight-through estimate): the forward is unchanged (the bias is log s_j minus
itself, 0), and in backward

    dL/dlog s_j = sum over the group's heads h, keys k of block j:  p_hk (dL/do_h . (v_k - o_h)),

p_hk the sel attention probability, v_k the sel value, o_h the sel output, dL/do_h the gradient
reaching the sel output (the layer's gradient times the sel gate). A chosen block whose keys, read
more, would lower the loss gets a higher score, one whose keys mislead a lower one. Only the blocks
chosen by score get it (forced blocks are chosen whatever their score): the blocks the sel branch read,
which the attention returns (`return_selection`). The scores' gradient then reaches the queries and the
compressed keys through the cmp probabilities. Backward recomputes those and the sel logits of every
earlier key, a chunk of queries at a time, as matrix products: T^2 / 2 products per head, nothing of
that size kept from forward. This is for research runs at moderate T.

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

from .common import choose_blocks, forced_blocks, masked_softmax, member_slots, query_positions
from .documents import Documents
from .families.cpp import cpu_attention
from .families.pytorch import ops
from .spec import NSASpec

CHUNK_LOGITS = 2**23
"""How many logits (batch x group heads x queries x keys) backward takes at once: it takes the queries a chunk
at a time (256 at the recall task's shape): 2 x 32 MiB of fp32 sel logits and products a chunk, and the cmp
probabilities, d times fewer."""


def with_score_grad(o: torch.Tensor, q: torch.Tensor, kc: torch.Tensor, k_sel: torch.Tensor, v_sel: torch.Tensor,
                    gates: torch.Tensor, spec: NSASpec, weight: float, docs: Documents | None = None, q0: int = 0,
                    explore: int = 0, seed: torch.Tensor | int = 0,
                    chosen: tuple[torch.Tensor, torch.Tensor] | None = None, kernel: str | None = None) -> torch.Tensor:
    """o (B, Tq, H, D), the attention output of the queries q (B, Tq, H, D) at q0 .. q0 + Tq - 1,
    unchanged; in backward q and the compressed keys also get the block scores' straight-through gradient,
    times `weight`, the chosen blocks' and that of `explore` unchosen candidates per query, drawn by `seed`
    (the step).

    kc: (B, Nc, G, D) compressed keys (with `docs`: the slots of `docs.cmp_start`); k_sel, v_sel:
    (B, T, G, D) the sel keys and values of the whole sequence; gates (B, Tq, H, 3); chosen: the blocks
    idx, valid (B, G, Tq, n) the sel branch read (`nsa_fast(..., return_selection=True)`; None: chosen
    here from the cmp probabilities); kernel: `cpp` takes dL/dlog s_j query by query in NSA's C++ kernel,
    `torch` in PyTorch (`score_grad`), None the C++ kernel where it can run (fp32 on CPUs)."""
    B, Tq, H, D = q.shape
    T, G = k_sel.shape[1], k_sel.shape[2]
    if chosen is None:
        with torch.no_grad():
            qg = _groups(q, G)
            p = _probabilities(qg, kc.to(qg.dtype).transpose(1, 2), _visible(spec, docs, q0, q0 + Tq, kc.shape[1], q.device))
            chosen = choose_blocks(p.sum(3), spec, q0, T, docs)
    idx, valid = chosen  # (B, G, Tq, n)
    t = query_positions(q0, Tq, q.device, docs)
    free = valid & ~forced_blocks(idx, t[:, None], spec)
    n_read = idx.shape[-1]
    if kernel is None:
        kernel = "torch" if cpu_attention.problem(q.device, q.dtype, spec, H // G, D) else "cpp"
    if explore:
        draw = ops.explore_blocks if kernel == "cpp" else explore_blocks
        extra, ok = draw(idx, t, spec.num_sel_blocks(T), spec, explore, seed)
        idx, valid, free = torch.cat([idx, extra], -1), torch.cat([valid, ok], -1), torch.cat([free, ok], -1)
    return _ScoreStraightThrough.apply(o, q, kc, k_sel.detach(), v_sel.detach(), gates[..., 1].detach(), idx, valid,
                                       free, spec, docs, q0, weight, n_read, kernel)


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


EXPLORE_MAX_BLOCKS = 2**20
"""explore_blocks' keys take the block index in their low 20 bits (no two keys tie)."""


def explore_blocks(idx: torch.Tensor, t: torch.Tensor, Ns: int, spec: NSASpec, m: int, seed: torch.Tensor | int = 0
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """m unchosen, unforced candidate blocks per query, drawn uniformly by a hash of (seed, row, group, t, j):
    extra (B, G, C, m') long, m' = min(m, Ns), and whether each is real (fewer candidates: False). The
    candidates with the largest keys hash 2^20 + 2^20 - 1 - j, by descending key (NSA's C++ kernel draws
    the same: `cpu_attention.explore_blocks`).

    idx (B, G, C, n): the chosen blocks of Ns; t (1 or B, C): the query positions blocks count from."""
    if Ns >= EXPLORE_MAX_BLOCKS:
        raise ValueError(f"sel_score_explore draws among fewer than {EXPLORE_MAX_BLOCKS} blocks per sequence, got {Ns}")
    B, G, C, _ = idx.shape
    dev = idx.device
    j = torch.arange(Ns, device=dev)
    candidate = (j <= torch.div(t, spec.l_sel, rounding_mode="floor")[..., None]) & ~forced_blocks(j, t, spec)
    candidate = candidate[:, None].expand(B, G, C, Ns).clone()
    candidate.scatter_(-1, idx, False)
    row = torch.arange(B * G, device=dev).view(B, G, 1, 1)
    key = _hash32(_hash32(seed * 0x27D4EB2F + row) * 0x9E3779B1 ^ t[:, None, :, None] * 0x85EBCA77 ^ j * 0xC2B2AE3D)
    key = key * EXPLORE_MAX_BLOCKS + (EXPLORE_MAX_BLOCKS - 1 - j)  # uniform in the high bits, then the lower block
    key, extra = torch.topk(torch.where(candidate, key, -1), min(m, Ns), dim=-1)
    return extra, key >= 0


def _groups(x: torch.Tensor, G: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Queries or their gradients (B, Tq, H, D) as (B, G, Tq, r, D), the r = H/G heads of a group side by side,
    in `dtype` (default: fp32 or wider)."""
    B, Tq, H, D = x.shape
    dtype = torch.promote_types(x.dtype, torch.float32) if dtype is None else dtype
    return x.to(dtype).view(B, Tq, G, H // G, D).transpose(1, 2)


def _visible(spec: NSASpec, docs: Documents | None, t0: int, t1: int, Nv: int, device: torch.device) -> torch.Tensor:
    """Which of the first Nv cmp blocks (slots) queries t0 .. t1 - 1 see, broadcast to (B, G, C, r, Nv)."""
    if docs is not None:
        return docs.cmp_visible(spec, t0, t1, Nv)[:, None, :, None]
    t, i = torch.arange(t0, t1, device=device), torch.arange(Nv, device=device)
    return ((i * spec.d + spec.l - 1)[None, :] <= t[:, None])[:, None, :]  # (C, 1, Nv)


def _probabilities(qg: torch.Tensor, kc: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """The cmp probabilities (B, G, C, r, Nv) of the queries qg (B, G, C, r, D) over the compressed keys kc
    (B, G, Nv, D) they may see (`visible`), in place; a row that sees none is all 0."""
    B, G, C, r, D = qg.shape
    p = (qg.reshape(B, G, C * r, D) @ kc.transpose(2, 3)).view(B, G, C, r, -1).mul_(D**-0.5)
    p.masked_fill_(~visible, float("-inf"))
    m = p.amax(-1, keepdim=True)
    p.sub_(torch.where(torch.isfinite(m), m, 0.0)).exp_()
    denom = p.sum(-1, keepdim=True)
    return p.div_(torch.where(denom > 0, denom, 1.0))


class _ScoreStraightThrough(torch.autograd.Function):
    """o unchanged; backward: `score_grad` into log s_j, and on through the cmp probabilities into q and kc."""

    @staticmethod
    def forward(ctx, o, q, kc, k_sel, v_sel, g_sel, idx, valid, free, spec, docs, q0, weight, n_read, kernel):
        ctx.save_for_backward(q, kc, k_sel, v_sel, g_sel, idx, valid, free)
        ctx.spec, ctx.docs, ctx.q0, ctx.weight, ctx.n_read, ctx.kernel = spec, docs, q0, weight, n_read, kernel
        return o.view_as(o)

    @staticmethod
    def backward(ctx, d_o):
        q, kc, k_sel, v_sel, g_sel, idx, valid, free = ctx.saved_tensors
        dq, dkc = scores_backward(d_o, q, kc, k_sel, v_sel, g_sel, idx, valid, free, ctx.spec, ctx.docs, ctx.q0,
                                  ctx.weight, ctx.n_read, ctx.kernel)
        return d_o, dq, dkc, *(None,) * 12


@torch.no_grad()
def scores_backward(d_o: torch.Tensor, q: torch.Tensor, kc: torch.Tensor, k_sel: torch.Tensor, v_sel: torch.Tensor,
                    g_sel: torch.Tensor, idx: torch.Tensor, valid: torch.Tensor, free: torch.Tensor, spec: NSASpec,
                    docs: Documents | None, q0: int, weight: float, n_read: int, kernel: str = "torch"
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients (dq, dkc) of `with_score_grad`: for a chunk of queries at a time, dL/dlog s_j of the
    blocks `free` (`score_grad`, or with kernel `cpp` NSA's C++ kernel for all queries first) times `weight`,
    carried to the group's cmp probabilities (s_j sums its cmp members', Eq. 9-10) and through their softmax,
    recomputed, to q (B, Tq, H, D) and kc (B, Nc, G, D); with kernel `cpp` and no documents, all of it in the
    kernel, query by query (`cpu_attention.cmp_scores_backward`)."""
    B, Tq, H, D = q.shape
    T, Nc, G = k_sel.shape[1], kc.shape[1], kc.shape[2]
    qg = _groups(q, G)  # (B, G, Tq, r, D)
    kcg = kc.to(qg.dtype).transpose(1, 2)  # (B, G, Nc, D)
    r, n = H // G, idx.shape[-1]
    if kernel == "cpp":
        d_read = ops.sel_weight_grad(_groups(d_o * g_sel[..., None], G), qg, k_sel.transpose(1, 2), v_sel.transpose(1, 2),
                                     idx, valid, n_read, spec, q0, docs)
        if docs is None:  # all of it in the kernel
            dq, dkc = ops.cmp_scores_backward(qg, kcg, idx, d_read * free * weight, spec, q0)
            return dq.transpose(1, 2).reshape(q.shape).to(q.dtype), dkc.transpose(1, 2).to(kc.dtype)
    dq, dkc = torch.zeros_like(qg), torch.zeros_like(kcg)
    chunk = max(1, CHUNK_LOGITS // (B * G * r * (q0 + Tq)))
    for c0 in range(0, Tq, chunk):
        c1 = min(Tq, c0 + chunk)
        C, rows = c1 - c0, slice(c0, c1)
        Nv = Nc if docs is not None else spec.num_cmp_blocks(q0 + c1)  # no document: the blocks the chunk sees
        if Nv == 0:  # every score 0: no gradient
            continue
        d_log_s = (d_read[:, :, rows] if kernel == "cpp" else
                   score_grad(d_o[:, rows], qg[:, :, rows], k_sel, v_sel, g_sel[:, rows], idx[:, :, rows],
                              valid[:, :, rows], spec, docs, q0 + c0, n_read)) * free[:, :, rows] * weight
        p = _probabilities(qg[:, :, rows], kcg[:, :, :Nv], _visible(spec, docs, q0 + c0, q0 + c1, Nv, q.device))
        slots = member_slots(idx[:, :, rows], spec, T, Nv, docs, q0 + c0).flatten(-2)  # (B, G, C, n K)
        p_group = torch.nn.functional.pad(p.sum(3), (0, 1))  # (B, G, C, Nv + 1), Nv: no member
        s = p_group.gather(-1, slots).view(*idx.shape[:2], C, n, -1).sum(-1)
        d_s = torch.where(s >= 1e-30, d_log_s / s.clamp_min(1e-30), 0.0)  # through log(s.clamp_min(1e-30))
        d_group = torch.zeros_like(p_group).scatter_add_(-1, slots, d_s.repeat_interleave(slots.shape[-1] // n, -1))
        d_logits = p * d_group[:, :, :, None, :Nv]  # softmax backward: p (dp - sum p dp), dp = d_group for every head
        d_logits = d_logits.addcmul_(p, d_logits.sum(-1, keepdim=True), value=-1.0).view(B, G, C * r, Nv) * D**-0.5
        dq[:, :, rows] = (d_logits @ kcg[:, :, :Nv]).view(B, G, C, r, D)
        dkc[:, :, :Nv] += d_logits.transpose(2, 3) @ qg[:, :, rows].reshape(B, G, C * r, D)
    return dq.transpose(1, 2).reshape(q.shape).to(q.dtype), dkc.transpose(1, 2).to(kc.dtype)


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
    d_sel = _groups(d_o.to(qg.dtype) * g_sel.to(qg.dtype)[..., None], G, qg.dtype)  # (B, G, Tq, r, D)
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
