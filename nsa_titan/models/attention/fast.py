"""Fast NSA attention in PyTorch: the cost grows with the keys a query attends to, not with T^2.

Each branch is a flash-style autograd Function that keeps only its inputs (and, for sel, the
output and the logsumexp of each (query, head)) and recomputes its scores once in backward,
chunk by chunk: memory is linear in T and no T x T tensor exists.
  cmp, win (`_Shared`, here): chunks of queries against the keys the whole chunk may read, the Nv
      compressed keys visible to its last query, or the C + w - 1 keys covering its windows
      (with documents and host bounds, only the chunk's documents' keys). The r query heads of a
      KV group are stacked, so a chunk is two matmuls per group; only the columns where the mask
      varies are masked. The cmp forward also picks each chunk's sel blocks from its probabilities.
  sel (`fast_sel.py`): the forced blocks as dense products, the blocks chosen by score as
      block-centric tiles.
The loops are over chunks, never over tokens. `kernels.py` chooses where sel runs as Triton
kernels (`triton_sel.py`) and win through flash-attn instead.
"""

from __future__ import annotations

import torch

from . import kernels as kernel_choice
from . import triton_sel
from .fast_sel import Selected
from .common import N_FORCED_INITIAL, N_FORCED_LOCAL, NSASpec, choose_blocks, mix_branches
from .documents import ChunkBounds, Documents
from .kernels import Kernels

CHUNK_CMP = 256
"""Queries per cmp chunk."""
CHUNK_WIN = 64
"""Queries per win chunk: the chunk reads C + w - 1 keys for its C windows of w."""
def _key_range(kind: str, spec: NSASpec, t0: int, t1: int, S: int, device: torch.device, docs: Documents | None,
               bounds: ChunkBounds | None) -> tuple[int, int, torch.Tensor]:
    """Keys [lo, hi) that queries t0 .. t1 - 1 may read in branch `kind`, and the mask (C, 1, hi - lo),
    or with `docs` (B, 1, C, 1, hi - lo). With `docs` the cmp keys are slots: those visible to
    t1 - 1 are among the first t1 // d (see documents.py), which bounds the range without a host
    sync; with host `bounds` too, the range is cut to the chunk's documents."""
    t = torch.arange(t0, t1, device=device)[:, None]
    if kind == "cmp" and docs is not None:
        lo, hi = (0, min(S, t1 // spec.d)) if bounds is None else bounds.cmp_slots(t0, t1)
        return lo, hi, docs.cmp_visible(spec, t0, t1, hi, lo)[:, None, :, None]
    if kind == "cmp":  # block i is visible to t when i*d + l - 1 <= t
        hi = min(S, max(0, (t1 - spec.l) // spec.d + 1))
        i = torch.arange(hi, device=device)[None, :]
        return 0, hi, (i * spec.d + spec.l - 1 <= t)[:, None]
    lo, hi = max(0, t0 - spec.w + 1) if bounds is None else bounds.window_start(t0, spec.w), t1
    s = torch.arange(lo, hi, device=device)[None, :]
    in_window = (s <= t) & (s > t - spec.w)
    if docs is not None:
        return lo, hi, (in_window & docs.same_past(t0, t1, lo, hi))[:, None, :, None]
    return lo, hi, in_window[:, None]


def _probs(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Softmax probabilities (B, G, C, r, S) of the queries q (B, G, C, r, D) over the keys
    k (B, G, S, D) where mask (broadcast to the same shape) allows, rounded as the reference
    rounds them: scores scaled after the product, `masked_softmax` (0 for no key). The mask
    rides in the product (baddbmm onto a 0 / -inf bias, the same bits as masking afterwards)."""
    B, G, C, r, D = q.shape
    S = k.shape[2]
    bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, float("-inf"))
    s = bias.expand(B, G, C, r, S).contiguous()
    s.view(B * G, C * r, S).baddbmm_(q.reshape(B * G, C * r, D), k.reshape(B * G, S, D).transpose(-1, -2))
    s.mul_(D**-0.5)
    m = s.amax(-1, keepdim=True)
    e = s.sub_(torch.where(torch.isfinite(m), m, torch.zeros_like(m))).exp_()
    total = e.sum(-1, keepdim=True)
    return e.div_(torch.where(total > 0, total, torch.ones_like(total)))


class _Shared(torch.autograd.Function):
    """cmp or win attention over the keys each chunk of queries shares (see the module doc)."""

    @staticmethod
    def forward(ctx, q, k, v, kind: str, spec: NSASpec, T: int, q0: int, bounds: ChunkBounds | None, *doc_fields):
        """q (B, G, Tq, r, D): the queries at positions q0 .. q0 + Tq - 1 of a sequence of T tokens
        (all of them unless context parallelism splits it); k, v (B, G, S, D) of the whole sequence;
        doc_fields: the tensors of a `Documents` of the whole sequence, or none; bounds: its host
        bounds, or None. Returns out
        (B, G, Tq, r, D) and, for cmp, the chosen sel blocks idx / valid (B, G, Tq, n') (see
        `choose_blocks`)."""
        B, G, Tq, r, D = q.shape
        docs = Documents(*doc_fields) if doc_fields else None
        chunk = CHUNK_CMP if kind == "cmp" else CHUNK_WIN
        out, idx, valid = torch.zeros_like(q), [], []
        for t0 in range(q0, q0 + Tq, chunk):
            t1 = min(q0 + Tq, t0 + chunk)
            lo, hi, mask = _key_range(kind, spec, t0, t1, k.shape[2], q.device, docs, bounds)
            if hi == lo:  # no complete cmp block yet: no key, output 0
                p = q.new_zeros(B, G, t1 - t0, r, 0)
            else:
                p = _probs(q[:, :, t0 - q0:t1 - q0], k[:, :, lo:hi], mask)  # (B, G, C, r, hi - lo)
                out[:, :, t0 - q0:t1 - q0] = (p.view(B, G, -1, hi - lo) @ v[:, :, lo:hi]).view(B, G, -1, r, D)
            if kind == "cmp":
                chosen = choose_blocks(p.sum(3), spec, t0, T, docs, slot0=lo)
                idx.append(chosen[0])
                valid.append(chosen[1])
        ctx.save_for_backward(q, k, v, *doc_fields)
        ctx.kind, ctx.spec, ctx.q0, ctx.bounds = kind, spec, q0, bounds
        if kind != "cmp":
            return out, None, None
        idx, valid = torch.cat(idx, 2), torch.cat(valid, 2)
        ctx.mark_non_differentiable(idx, valid)
        return out, idx, valid

    @staticmethod
    def backward(ctx, d_out, *_):
        q, k, v, *doc_fields = ctx.saved_tensors
        B, G, Tq, r, D = q.shape
        q0 = ctx.q0
        docs = Documents(*doc_fields) if doc_fields else None
        chunk = CHUNK_CMP if ctx.kind == "cmp" else CHUNK_WIN
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for t0 in range(q0, q0 + Tq, chunk):
            t1 = min(q0 + Tq, t0 + chunk)
            lo, hi, mask = _key_range(ctx.kind, ctx.spec, t0, t1, k.shape[2], q.device, docs, ctx.bounds)
            if hi == lo:
                continue
            a, b = t0 - q0, t1 - q0  # the chunk's rows of q
            p = _probs(q[:, :, a:b], k[:, :, lo:hi], mask)  # the forward's, recomputed
            do = d_out[:, :, a:b].reshape(B, G, -1, D)
            p2 = p.view(B, G, -1, hi - lo)
            dv[:, :, lo:hi] += p2.transpose(-1, -2) @ do
            dp = (do @ v[:, :, lo:hi].transpose(-1, -2)).view_as(p)
            # softmax backward with delta = sum(p * dp), not d_out . out: one row's keys are all
            # in this chunk, and this form keeps a one-key row's exact zero.
            ds = dp.sub_((p * dp).sum(-1, keepdim=True)).mul_(p).mul_(D**-0.5).view(B, G, -1, hi - lo)
            dq[:, :, a:b] = (ds @ k[:, :, lo:hi]).view(B, G, -1, r, D)
            dk[:, :, lo:hi] += ds.transpose(-1, -2) @ q[:, :, a:b].reshape(B, G, -1, D)
        return dq, dk, dv, None, None, None, None, None, *(None for _ in doc_fields)


def nsa_fast(q: torch.Tensor, k_cmp: torch.Tensor, v_cmp: torch.Tensor, k_sel: torch.Tensor, v_sel: torch.Tensor,
             k_win: torch.Tensor, v_win: torch.Tensor, gates: torch.Tensor, spec: NSASpec,
             kernels: Kernels | None = None, docs: Documents | None = None, q0: int = 0) -> torch.Tensor:
    """Same contract as `nsa_reference` (see there), computed branch by branch in chunks, each branch
    by its kernel in `kernels` (None: `auto` for these tensors).

    Context parallelism passes a part of the queries: q (B, Tq, H, D) and gates are those of positions
    q0 .. q0 + Tq - 1 (q0 a multiple of l'), the keys, values and `docs` those of the whole sequence."""
    B, Tq, H, D = q.shape
    T, G = k_sel.shape[1], k_sel.shape[2]
    acc = torch.promote_types(q.dtype, torch.float32)
    if spec.n < N_FORCED_INITIAL + N_FORCED_LOCAL:
        raise ValueError(f"nsa_fast needs n >= {N_FORCED_INITIAL + N_FORCED_LOCAL} (the forced blocks), got n = {spec.n}")
    if kernels is None:
        kernels = kernel_choice.choose_kernels("auto", q.device, q.dtype, spec, D)
    fields = () if docs is None else (docs.start, docs.end, docs.cmp_start, docs.first_slot)
    start = None if docs is None else docs.start[:, q0:q0 + Tq]
    # The host bounds cut each chunk to its documents in eager runs; a compiled graph keeps the
    # static ranges, so that one graph serves every layout.
    bounds = None if docs is None or torch.compiler.is_compiling() else docs.bounds

    def grouped(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Keys / values (B, S, G, D) -> (B, G, S, D)."""
        return x.to(dtype).transpose(1, 2).contiguous()

    # (B, G, T, r, D): the r = H/G query heads of a group side by side.
    qg = q.to(acc).view(B, Tq, G, H // G, D).transpose(1, 2).contiguous()
    o_cmp, idx, valid = _Shared.apply(qg, grouped(k_cmp, acc), grouped(v_cmp, acc), "cmp", spec, T, q0, bounds, *fields)
    if kernels.sel == "triton":  # the Triton kernels take bf16 / fp16 as they are
        o_sel = triton_sel.SelectedTriton.apply(qg.to(q.dtype), grouped(k_sel, q.dtype), grouped(v_sel, q.dtype),
                                                idx, valid, spec, start, q0).to(acc)
    else:
        o_sel = Selected.apply(qg, grouped(k_sel, acc), grouped(v_sel, acc), idx, valid, spec, start, q0, bounds)
    if kernels.win == "flash":
        o_win = kernel_choice.window_flash(q, k_win, v_win, spec, docs, q0).to(acc)
    else:
        o_win, _, _ = _Shared.apply(qg, grouped(k_win, acc), grouped(v_win, acc), "win", spec, T, q0, bounds, *fields)
    g = gates.to(acc).view(B, Tq, G, H // G, 3).transpose(1, 2)
    out = mix_branches(g, o_cmp, o_sel, o_win)  # (B, G, Tq, r, D)
    return out.transpose(1, 2).reshape(B, Tq, H, D).to(q.dtype)
