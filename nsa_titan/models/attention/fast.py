"""Fast NSA attention in PyTorch: the cost grows with the keys a query attends to, not with T^2.

Each branch is a flash-style autograd Function: the forward keeps only its output and the
logsumexp of each (query, head); the backward recomputes the scores once, chunk by chunk.
  cmp, win (`_Shared`): chunks of queries against the keys the whole chunk may read, the Nv
      compressed keys visible to its last query, or the C + w - 1 keys covering its windows.
      The query heads of a KV group are stacked, so a chunk is two matmuls per group. The cmp
      forward also picks each chunk's sel blocks from its probabilities.
  sel (`_Selected`): block-centric. The (query, group) -> block choices of a chunk are sorted
      by block and cut into tiles of R queries that share one block, so a tile is a dense
      (R * heads x D) @ (D x l') product over a block loaded once; the per-query results are
      summed back with index_add. Gathered bytes: R queries' rows per block, not l' x D keys
      per query. Tile counts have a static bound, so there is no host sync.
No T x T tensor exists, nothing data-dependent reaches Python, and the loops are over chunks.
"""

from __future__ import annotations

import math

import torch

from .common import NSASpec, choose_blocks

CHUNK_CMP = 256
"""Queries per cmp chunk."""
CHUNK_WIN = 128
"""Queries per win chunk: the chunk reads C + w - 1 keys for its C windows of w."""
CHUNK_SEL = 4096
"""Queries per sel chunk: bounds the gathered rows (C x n x heads x D per KV group)."""
TILE = 32
"""R: queries per sel tile (one block each)."""


def _key_range(kind: str, spec: NSASpec, t0: int, t1: int, S: int, device: torch.device
               ) -> tuple[int, int, torch.Tensor, list[tuple[int, int]]]:
    """Keys [lo, hi) that queries t0 .. t1 - 1 may read in branch `kind`, the mask (C, hi - lo),
    and the column ranges (relative to lo) where it is not all True: the only ones to mask."""
    t = torch.arange(t0, t1, device=device)[:, None]
    if kind == "cmp":  # block i is visible to t when i*d + l - 1 <= t
        lo, hi = 0, min(S, max(0, (t1 - spec.l) // spec.d + 1))
        seen_by_all = min(hi, max(0, (t0 - spec.l) // spec.d + 1))
        i = torch.arange(lo, hi, device=device)[None, :]
        return lo, hi, i * spec.d + spec.l - 1 <= t, [(seen_by_all, hi)]
    lo, hi = max(0, t0 - spec.w + 1), t1
    s = torch.arange(lo, hi, device=device)[None, :]
    left = max(lo, t1 - spec.w) - lo  # keys before it leave some query's window
    return lo, hi, (s <= t) & (s > t - spec.w), [(0, left), (t0 + 1 - lo, hi - lo)]


def _probs(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor, edges: list[tuple[int, int]]) -> torch.Tensor:
    """Softmax probabilities (B, G, C, r, S) of the queries q (B, G, C, r, D) over the keys
    k (B, G, S, D) where mask (C, S) allows, rounded as the reference rounds them: scores
    scaled after the product, `masked_softmax` (0 for no key)."""
    B, G, C, r, D = q.shape
    s = (q.reshape(B, G, C * r, D) @ k.transpose(-1, -2)).view(B, G, C, r, -1).mul_(D**-0.5)
    for a, b in edges:
        s[..., a:b].masked_fill_(~mask[:, None, a:b], float("-inf"))
    m = s.amax(-1, keepdim=True)
    e = s.sub_(torch.where(torch.isfinite(m), m, torch.zeros_like(m))).exp_()
    total = e.sum(-1, keepdim=True)
    return e.div_(torch.where(total > 0, total, torch.ones_like(total)))


class _Shared(torch.autograd.Function):
    """cmp or win attention over the keys each chunk of queries shares (see the module doc)."""

    @staticmethod
    def forward(ctx, q, k, v, kind: str, spec: NSASpec, T: int):
        """q (B, G, T, r, D); k, v (B, G, S, D). Returns out (B, G, T, r, D) and, for cmp, the
        chosen sel blocks idx / valid (B, G, T, n') (see `choose_blocks`)."""
        B, G, _, r, D = q.shape
        chunk = CHUNK_CMP if kind == "cmp" else CHUNK_WIN
        out, idx, valid = torch.zeros_like(q), [], []
        for t0 in range(0, T, chunk):
            t1 = min(T, t0 + chunk)
            lo, hi, mask, edges = _key_range(kind, spec, t0, t1, k.shape[2], q.device)
            if hi == lo:  # no complete cmp block yet: no key, output 0
                p = q.new_zeros(B, G, t1 - t0, r, 0)
            else:
                p = _probs(q[:, :, t0:t1], k[:, :, lo:hi], mask, edges)  # (B, G, C, r, hi - lo)
                out[:, :, t0:t1] = (p.view(B, G, -1, hi - lo) @ v[:, :, lo:hi]).view(B, G, -1, r, D)
            if kind == "cmp":
                chosen = choose_blocks(p.sum(3), spec, t0, T)
                idx.append(chosen[0])
                valid.append(chosen[1])
        ctx.save_for_backward(q, k, v)
        ctx.kind, ctx.spec, ctx.T = kind, spec, T
        if kind != "cmp":
            return out, None, None
        idx, valid = torch.cat(idx, 2), torch.cat(valid, 2)
        ctx.mark_non_differentiable(idx, valid)
        return out, idx, valid

    @staticmethod
    def backward(ctx, d_out, *_):
        q, k, v = ctx.saved_tensors
        B, G, T, r, D = q.shape
        chunk = CHUNK_CMP if ctx.kind == "cmp" else CHUNK_WIN
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for t0 in range(0, T, chunk):
            t1 = min(T, t0 + chunk)
            lo, hi, mask, edges = _key_range(ctx.kind, ctx.spec, t0, t1, k.shape[2], q.device)
            if hi == lo:
                continue
            p = _probs(q[:, :, t0:t1], k[:, :, lo:hi], mask, edges)  # the forward's, recomputed
            do = d_out[:, :, t0:t1].reshape(B, G, -1, D)
            p2 = p.view(B, G, -1, hi - lo)
            dv[:, :, lo:hi] += p2.transpose(-1, -2) @ do
            dp = (do @ v[:, :, lo:hi].transpose(-1, -2)).view_as(p)
            # softmax backward with delta = sum(p * dp), not d_out . out: one row's keys are all
            # in this chunk, and this form keeps a one-key row's exact zero.
            ds = dp.sub_((p * dp).sum(-1, keepdim=True)).mul_(p).mul_(D**-0.5).view(B, G, -1, hi - lo)
            dq[:, :, t0:t1] = (ds @ k[:, :, lo:hi]).view(B, G, -1, r, D)
            dk[:, :, lo:hi] += ds.transpose(-1, -2) @ q[:, :, t0:t1].reshape(B, G, -1, D)
        return dq, dk, dv, None, None, None


def _tiles(idx: torch.Tensor, valid: torch.Tensor, t0: int, spec: NSASpec
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tiles of the (query, group) -> block choices of the queries t0 .. t0 + C - 1.

    idx, valid (B, G, C, n'). Returns rows (NT, R): each lane's chunk-local query row
    (b*G + g)*C + c, or the dummy row B*G*C for an empty lane; bg, j (NT,): the (batch, group)
    and the block shared by the tile; t (NT, R): each lane's position (-1 when empty).
    NT = ceil(pairs / R) + B*G*Ns_c is a static bound (Ns_c: the blocks the chunk can choose).
    """
    B, G, C, n = idx.shape
    R, dev = TILE, idx.device
    Ns_c = (t0 + C - 1) // spec.l_sel + 1
    K, P = B * G * Ns_c, B * G * C * n
    NT = -(-P // R) + K
    bg = torch.arange(B * G, device=dev).view(B, G, 1, 1)
    key = torch.where(valid, bg * Ns_c + idx, K).flatten()  # (P,): the block, K when not a candidate
    row = (bg * C + torch.arange(C, device=dev).view(1, 1, C, 1)).expand(B, G, C, n).flatten()
    order = torch.argsort(key, stable=True)
    key, row = key[order], row[order]
    counts = torch.zeros(K + 1, dtype=torch.long, device=dev).index_add_(0, key, torch.ones_like(key))
    key_start = torch.cumsum(counts, 0) - counts
    tiles = (counts[:K] + R - 1) // R
    tile_start = torch.cumsum(tiles, 0) - tiles
    rank = torch.arange(P, device=dev) - key_start[key]  # position among the block's queries
    real = key < K
    tile = torch.where(real, tile_start[key.clamp(max=K - 1)] + rank // R, NT)  # NT: a trash tile
    rows = torch.full(((NT + 1) * R,), B * G * C, dtype=torch.long, device=dev)
    rows = rows.scatter_(0, tile * R + rank % R, torch.where(real, row, B * G * C))[:NT * R].view(NT, R)
    block = torch.zeros(NT + 1, dtype=torch.long, device=dev).scatter_(0, tile, key)[:NT]
    t = torch.where(rows < B * G * C, t0 + rows % C, -1)
    return rows, block // Ns_c, block % Ns_c, t


def _tile_scores(q: torch.Tensor, kb: torch.Tensor, rows: torch.Tensor, blocks: torch.Tensor,
                 j: torch.Tensor, t: torch.Tensor, l_sel: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gathered queries Qt (NT, R*r, D) and keys Kt = kb[blocks] (NT, l', D), and the masked
    scores (NT, R, r, l') of each tile; q (rows + 1, r, D), already scaled by D^-1/2, ends with
    the dummy (zero) row."""
    NT, R = rows.shape
    r, D = q.shape[1:]
    qt = q.index_select(0, rows.flatten()).view(NT, R * r, D)
    kt = kb.index_select(0, blocks)
    s = (qt @ kt.transpose(1, 2)).view(NT, R, r, l_sel)
    causal = (j[:, None] * l_sel + torch.arange(l_sel, device=j.device))[:, None, :] <= t[:, :, None]
    return qt, kt, s.masked_fill_(~causal[:, :, None], float("-inf"))


def _with_dummy(x: torch.Tensor) -> torch.Tensor:
    """(B, G, C, r, ...) -> (B*G*C + 1, r, ...) with a trailing zero row for empty lanes."""
    x = x.reshape(-1, *x.shape[3:])
    return torch.cat([x, x.new_zeros(1, *x.shape[1:])])


class _Selected(torch.autograd.Function):
    """sel attention: each (query, group) reads its own n blocks of l' keys (see the module doc)."""

    @staticmethod
    def forward(ctx, q, ks, vs, idx, valid, spec: NSASpec):
        """q (B, G, T, r, D); ks, vs (B, G, T, D); idx, valid (B, G, T, n') -> (B, G, T, r, D)."""
        B, G, T, r, D = q.shape
        L, Ns = spec.l_sel, spec.num_sel_blocks(T)
        pad = (0, 0, 0, Ns * L - T)
        kb, vb = (torch.nn.functional.pad(x, pad).view(B * G * Ns, L, D) for x in (ks, vs))
        out, lse = torch.empty_like(q), q.new_empty(B, G, T, r)
        for t0 in range(0, T, CHUNK_SEL):
            t1 = min(T, t0 + CHUNK_SEL)
            rows, bg, j, t = _tiles(idx[:, :, t0:t1], valid[:, :, t0:t1], t0, spec)
            blocks = bg * Ns + j
            _, _, s = _tile_scores(_with_dummy(q[:, :, t0:t1] * D**-0.5), kb, rows, blocks, j, t, L)
            NT, R = rows.shape
            lanes = rows.flatten()
            m = s.new_full((B * G * (t1 - t0) + 1, r), float("-inf"))
            m = m.scatter_reduce_(0, lanes[:, None].expand(-1, r), s.amax(-1).view(-1, r), "amax")
            m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # the dummy row
            e = s.sub_(m.index_select(0, lanes).view(NT, R, r, 1)).exp_()  # in place: s is not needed again
            total = torch.zeros_like(m).index_add_(0, lanes, e.sum(-1).view(-1, r))
            o = (e.view(NT, R * r, L) @ vb.index_select(0, blocks)).view(NT * R, r, D)
            o = q.new_zeros(m.shape[0], r, D).index_add_(0, lanes, o)[:-1]
            out[:, :, t0:t1] = (o / total[:-1, :, None]).view(B, G, -1, r, D)
            lse[:, :, t0:t1] = (m + torch.log(total))[:-1].view(B, G, -1, r)
        ctx.save_for_backward(q, kb, vb, idx, valid, out, lse)
        ctx.spec = spec
        return out

    @staticmethod
    def backward(ctx, d_out):
        q, kb, vb, idx, valid, out, lse = ctx.saved_tensors
        spec = ctx.spec
        B, G, T, r, D = q.shape
        L, Ns = spec.l_sel, spec.num_sel_blocks(T)
        dq, dkb, dvb = torch.empty_like(q), torch.zeros_like(kb), torch.zeros_like(vb)
        delta = (d_out * out).sum(-1, keepdim=True)  # (B, G, T, r, 1): sum over keys of p * dp
        for t0 in range(0, T, CHUNK_SEL):
            t1 = min(T, t0 + CHUNK_SEL)
            rows, bg, j, t = _tiles(idx[:, :, t0:t1], valid[:, :, t0:t1], t0, spec)
            blocks = bg * Ns + j
            qt, kt, s = _tile_scores(_with_dummy(q[:, :, t0:t1] * D**-0.5), kb, rows, blocks, j, t, L)
            NT, R = rows.shape
            lanes = rows.flatten()
            stats = _with_dummy(torch.cat([lse[:, :, t0:t1, :, None], delta[:, :, t0:t1]], -1))
            stats = stats.index_select(0, lanes).view(NT, R, r, 2, 1)
            p = s.sub_(stats[:, :, :, 0]).exp_()  # (NT, R, r, L); 0 where masked
            dot = _with_dummy(d_out[:, :, t0:t1]).index_select(0, lanes).view(NT, R * r, D)
            dvb.index_add_(0, blocks, p.view(NT, R * r, L).transpose(1, 2) @ dot)
            ds = (dot @ vb.index_select(0, blocks).transpose(1, 2)).view_as(p)  # dp
            ds = ds.sub_(stats[:, :, :, 1]).mul_(p).view(NT, R * r, L)  # p * (dp - delta)
            dkb.index_add_(0, blocks, ds.transpose(1, 2) @ qt)
            dq_c = q.new_zeros(B * G * (t1 - t0) + 1, r, D).index_add_(0, lanes, (ds @ kt).view(NT * R, r, D))
            dq[:, :, t0:t1] = dq_c[:-1].view(B, G, -1, r, D) * D**-0.5
        dks, dvs = (x.view(B, G, Ns * L, D)[:, :, :T] for x in (dkb, dvb))
        return dq, dks, dvs, None, None, None


def nsa_fast(
    q: torch.Tensor,
    k_cmp: torch.Tensor,
    v_cmp: torch.Tensor,
    k_sel: torch.Tensor,
    v_sel: torch.Tensor,
    k_win: torch.Tensor,
    v_win: torch.Tensor,
    gates: torch.Tensor,
    spec: NSASpec,
) -> torch.Tensor:
    """Same contract as `nsa_reference` (see there), computed branch by branch in chunks."""
    B, T, H, D = q.shape
    G = k_sel.shape[2]
    acc = torch.promote_types(q.dtype, torch.float32)
    # (B, G, T, r, D): the r = H/G query heads of a group side by side; keys (B, G, S, D).
    qg = q.to(acc).view(B, T, G, H // G, D).transpose(1, 2).contiguous()
    kc, vc, ks, vs, kw, vw = (x.to(acc).transpose(1, 2).contiguous() for x in (k_cmp, v_cmp, k_sel, v_sel, k_win, v_win))
    o_cmp, idx, valid = _Shared.apply(qg, kc, vc, "cmp", spec, T)
    o_sel = _Selected.apply(qg, ks, vs, idx, valid, spec)
    o_win, _, _ = _Shared.apply(qg, kw, vw, "win", spec, T)
    g = gates.to(acc).view(B, T, G, H // G, 3).transpose(1, 2)
    out = g[..., 0:1] * o_cmp + g[..., 1:2] * o_sel + g[..., 2:3] * o_win  # (B, G, T, r, D)
    return out.transpose(1, 2).reshape(B, T, H, D).to(q.dtype)
