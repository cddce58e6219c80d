"""The sel branch as Triton kernels (GPU), after the paper's group-centric kernel, over tiles of queries.

One program per (tile of BT consecutive queries, batch b, KV group g): it loads the query rows of
all r heads of the group for its BT queries once (BT = 64 // r queries, their BT * r heads packed
into the 64 rows of one tensor-core tile: 10 queries, 60 rows at r = 6),
walks the union of the blocks of l' keys those queries chose (neighbouring queries mostly choose
the same ones: each is loaded once for the tile, not once per query), and runs an online softmax
per row over its own query's blocks. The backward recomputes the probabilities from the
logsumexp in two kernels, neither with atomics: dQ by the same tiles, and dK, dV block-centric,
one program per (key block, head) over the queries that chose it (a reverse index: the chosen
blocks sorted by block), each head's part written once and the r parts summed. Each loop is over a
tile's blocks or a block's readers, never over T; memory is the inputs and outputs, the tiles'
unions, and the heads' parts of dK, dV in fp32.

Used by `nsa_fast` when `kernels.py` chooses it (CUDA, Triton installed, head dim and l' powers of
two >= 16); checked on CPU against the PyTorch path under TRITON_INTERPRET=1 (tests/test_nsa_triton.py).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # optional: CPU machines run the PyTorch path
    triton = None

from .common import NSASpec, block_readers

AVAILABLE = triton is not None
"""Whether the kernels can be used (Triton importable)."""
ROWS = 64
"""Rows of the forward's and dQ's tiles, (query, head) packed: 10 queries at M7C's r = 6 (8 with the
heads padded to 8, a quarter of the rows idle)."""
DKV_ROWS, DKV_WARPS = 32, 8
"""The block-centric backward's rows (readers, one head a program) per step and warps: at M7C's
shape (head dim 64, l' = 64) in bf16 it takes 163 registers on sm_90, no spills (64 rows, or 4
warps, take 249-254 of the 255; tests/test_triton_compile.py)."""

if AVAILABLE:

    @triton.jit
    def online_step(m, total, acc, sc, v):
        """One tile of an online softmax: the scores sc (rows, keys; -inf where not read) and values v
        (keys, D) folded into the rows' running max m, sum total and output acc (fp32)."""
        m_new = tl.maximum(m, tl.max(sc, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_safe)
        p = tl.exp(sc - m_safe[:, None])
        return m_new, total * alpha + tl.sum(p, 1), acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)

    @triton.jit
    def tile_grads(q, do, k, v, seen, lse, delta, scale, PRECISION: tl.constexpr):
        """A tile's probabilities again from the rows' logsumexp, and the gradient of its scores:
        p, ds (rows, keys), 0 where `seen` is False. PRECISION: tl.dot's input_precision of the
        scores (None: Triton's default)."""
        sc = tl.dot(q, tl.trans(k), input_precision=PRECISION).to(tl.float32) * scale
        p = tl.where(seen, tl.exp(sc - lse[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v)).to(tl.float32)
        return p, p * (dp - delta[:, None]) * scale

    @triton.jit
    def _tile(Q, CHOSEN, COUNT, bg, Tq, q0, sq_t, slse_t,
              R: tl.constexpr, M: tl.constexpr, BT: tl.constexpr, D: tl.constexpr, N: tl.constexpr,
              NP: tl.constexpr):
        """The M rows of query tile `pid 0` (BT queries x R heads, packed; M a power of two >= BT R,
        the rows past BT R idle): whether each is real, its position,
        its (B, G, Tq, r, D) offsets and (B, G, Tq, r) logsumexp offsets, q, the first keys of its
        query's chosen blocks (rows, NP; -1: none), and where the tile's union of blocks
        (`_tile_blocks`) starts and how many it holds."""
        tile = tl.program_id(0)
        mm = tl.arange(0, M)  # row mm: head mm % R of query row tile * BT + mm // R
        tq = tile * BT + mm // R
        live = (tq < Tq) & (mm < BT * R)
        q_off = bg * Tq * sq_t + tq[:, None] * sq_t + (mm % R)[:, None] * D + tl.arange(0, D)[None, :]
        q = tl.load(Q + q_off, mask=live[:, None], other=0.0)
        nn = tl.arange(0, NP)  # N padded to a power of two
        chosen = tl.load(CHOSEN + (bg * Tq + tq[:, None]) * N + nn[None, :], mask=live[:, None] & (nn < N)[None, :],
                         other=-1)
        at = bg * tl.num_programs(0) + tile
        stat_off = bg * Tq * slse_t + tq * slse_t + mm % R
        return live, q0 + tq, q_off, stat_off, q, chosen, at * BT * N, tl.load(COUNT + at)

    @triton.jit
    def _union_block(K, V, UNION, u, chosen, t, bg, Tk, D: tl.constexpr, L: tl.constexpr):
        """Keys and values (L, D) of the tile's u-th block and which of them each row reads: those
        of its query's blocks, up to its position (rows, L)."""
        p0 = tl.load(UNION + u)
        pos = p0 + tl.arange(0, L)
        kv_off = bg * Tk * D + pos[:, None] * D + tl.arange(0, D)[None, :]
        k = tl.load(K + kv_off, mask=pos[:, None] < Tk, other=0.0)
        v = tl.load(V + kv_off, mask=pos[:, None] < Tk, other=0.0)
        reads = tl.sum((chosen == p0).to(tl.int32), 1) > 0
        return k, v, reads[:, None] & (pos[None, :] <= t[:, None])

    @triton.jit
    def _sel_fwd(Q, K, V, CHOSEN, UNION, COUNT, O, LSE, scale, sq_t, slse_t, Tq, Tk, q0,
                 R: tl.constexpr, M: tl.constexpr, BT: tl.constexpr, D: tl.constexpr, L: tl.constexpr,
                 N: tl.constexpr, NP: tl.constexpr):
        """out and logsumexp of a tile of BT queries (all r heads of their group as rows): each block
        any of them chose is loaded once for the tile, an online softmax per row over its own."""
        bg = tl.program_id(1)  # b * G + g: q, o (B, G, Tq, r, D), k, v (B, G, Tk, D), chosen (B, G, Tq, N)
        live, t, q_off, stat_off, q, chosen, u0, count = _tile(Q, CHOSEN, COUNT, bg, Tq, q0, sq_t, slse_t, R, M, BT,
                                                               D, N, NP)
        m = tl.full([M], float("-inf"), tl.float32)
        total = tl.zeros([M], tl.float32)
        acc = tl.zeros([M, D], tl.float32)
        for u in range(u0, u0 + count):
            k, v, ok = _union_block(K, V, UNION, u, chosen, t, bg, Tk, D, L)
            sc = tl.dot(q, tl.trans(k)).to(tl.float32) * scale
            m, total, acc = online_step(m, total, acc, tl.where(ok, sc, float("-inf")), v)
        total = tl.where(live, total, 1.0)  # a real row reads its own block: total > 0
        tl.store(O + q_off, (acc / total[:, None]).to(O.dtype.element_ty), mask=live[:, None])
        tl.store(LSE + stat_off, m + tl.log(total), mask=live)

    @triton.jit
    def _sel_bwd_dq(Q, K, V, CHOSEN, UNION, COUNT, DO, LSE, DELTA, DQ, scale, sq_t, slse_t, Tq, Tk, q0,
                    R: tl.constexpr, M: tl.constexpr, BT: tl.constexpr, D: tl.constexpr, L: tl.constexpr,
                    N: tl.constexpr, NP: tl.constexpr):
        """dQ of a tile of BT queries: the tile's blocks' probabilities again, from the logsumexp."""
        bg = tl.program_id(1)
        live, t, q_off, stat_off, q, chosen, u0, count = _tile(Q, CHOSEN, COUNT, bg, Tq, q0, sq_t, slse_t, R, M, BT,
                                                               D, N, NP)
        do = tl.load(DO + q_off, mask=live[:, None], other=0.0)
        lse = tl.load(LSE + stat_off, mask=live, other=float("inf"))  # other rows: p = 0
        delta = tl.load(DELTA + stat_off, mask=live, other=0.0)
        dq = tl.zeros([M, D], tl.float32)
        for u in range(u0, u0 + count):
            k, v, ok = _union_block(K, V, UNION, u, chosen, t, bg, Tk, D, L)
            _, ds = tile_grads(q, do, k, v, ok, lse, delta, scale, None)  # (rows, L)
            dq += tl.dot(ds.to(k.dtype), k).to(tl.float32)
        tl.store(DQ + q_off, dq.to(DQ.dtype.element_ty), mask=live[:, None])

    @triton.jit
    def _sel_bwd_dkv(Q, K, V, DO, LSE, DELTA, OFFSETS, READERS, DK, DV, scale,
                     sq_t, slse_t, Tq, Tk, q0,
                     R: tl.constexpr, BQ: tl.constexpr, D: tl.constexpr, L: tl.constexpr):
        """Head h's part of dK, dV of the blocks of L keys that start at positions c0 .. c0 + L - 1
        (one without documents; one per document starting there with them): one program per (c0 / L,
        b * G + g, h) walks the queries that chose each (READERS[OFFSETS[i] : OFFSETS[i + 1]],
        i = bg * Tk + p0), BQ of them at a time, and writes the part (B, G, r, Tk, D) once, in fp32:
        no atomics; the wrapper sums the r parts. A block every query reads (block 0 is forced)
        takes Tq / BQ steps, not the r-fold that rows of all r heads would."""
        bg = tl.program_id(1)
        h = tl.program_id(2)
        starts = tl.program_id(0) * L + tl.arange(0, L)  # the positions a block may start at
        firsts = tl.load(OFFSETS + bg * Tk + starts, mask=starts < Tk, other=0)
        lasts = tl.load(OFFSETS + bg * Tk + starts + 1, mask=starts < Tk, other=0)
        chosen = lasts > firsts
        rank = tl.cumsum(chosen.to(tl.int32), 0) - 1
        dd = tl.arange(0, D)
        ee = tl.arange(0, BQ)
        for i in range(tl.sum(chosen.to(tl.int32), 0)):  # the chosen blocks starting here, in order
            this = chosen & (rank == i)
            p0 = tl.sum(tl.where(this, starts, 0), 0)
            first = tl.sum(tl.where(this, firsts, 0), 0)
            last = tl.sum(tl.where(this, lasts, 0), 0)
            pos = p0 + tl.arange(0, L)
            kv_off = bg * Tk * D + pos[:, None] * D + dd[None, :]
            k = tl.load(K + kv_off, mask=pos[:, None] < Tk, other=0.0)
            v = tl.load(V + kv_off, mask=pos[:, None] < Tk, other=0.0)
            dk = tl.zeros([L, D], tl.float32)
            dv = tl.zeros([L, D], tl.float32)
            t_max = -1
            for e0 in range(first, last, BQ):
                e = e0 + ee
                live = e < last
                tq = tl.load(READERS + e, mask=live, other=0)
                t = q0 + tq
                q_off = bg * Tq * sq_t + tq[:, None] * sq_t + h * D + dd[None, :]
                q = tl.load(Q + q_off, mask=live[:, None], other=0.0)
                do = tl.load(DO + q_off, mask=live[:, None], other=0.0)
                stat_off = bg * Tq * slse_t + tq * slse_t + h
                lse = tl.load(LSE + stat_off, mask=live, other=float("inf"))  # other rows: p = 0
                delta = tl.load(DELTA + stat_off, mask=live, other=0.0)
                ok = pos[None, :] <= t[:, None]  # the reader's causal part of the block
                p, ds = tile_grads(q, do, k, v, ok, lse, delta, scale, None)  # (BQ, L)
                dv += tl.dot(tl.trans(p.to(do.dtype)), do).to(tl.float32)
                dk += tl.dot(tl.trans(ds.to(q.dtype)), q).to(tl.float32)
                t_max = tl.maximum(t_max, tl.max(tl.where(live, t, -1), 0))
            written = pos[:, None] <= t_max  # the keys some reader read (blocks of other documents follow)
            part_off = ((bg * R + h) * Tk + pos[:, None]) * D + dd[None, :]
            tl.store(DK + part_off, dk, mask=written)
            tl.store(DV + part_off, dv, mask=written)


def _prepared(idx: torch.Tensor, valid: torch.Tensor, start: torch.Tensor | None, B: int, Tq: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels' int32 block indices (-1: not a candidate) and document starts (0: none)."""
    idx32 = torch.where(valid, idx, -1).to(torch.int32).contiguous()
    start32 = (torch.zeros(B, Tq, device=idx.device) if start is None else start).to(torch.int32).contiguous()
    return idx32, start32


def _tile_blocks(idx32: torch.Tensor, start32: torch.Tensor, L: int, r: int
                 ) -> tuple[torch.Tensor, int, torch.Tensor, torch.Tensor]:
    """What the tile kernels read: the first key of each chosen block, -1 for none (B, G, Tq, N);
    BT, the queries of a tile (ROWS // r: their heads packed into ROWS rows); and each tile's union of
    its queries' blocks, in position order (B, G, tiles, BT * N, padding after it) with its size
    (B, G, tiles). Two sorts per tile of BT * N entries, no host sync."""
    B, G, Tq, N = idx32.shape
    chosen = torch.where(idx32 >= 0, start32[:, None, :, None] + idx32 * L, -1).contiguous()
    BT = max(1, ROWS // r)
    none = torch.iinfo(torch.int32).max
    x = torch.nn.functional.pad(chosen, (0, 0, 0, -Tq % BT), value=-1).view(B, G, -1, BT * N)
    x = torch.where(x < 0, none, x).sort(-1).values
    x = torch.cat([x[..., :1], torch.where(x[..., 1:] == x[..., :-1], none, x[..., 1:])], -1).sort(-1).values
    return chosen, BT, x.contiguous(), (x < none).sum(-1, dtype=torch.int32)


def _tile_args(q: torch.Tensor, ks: torch.Tensor, chosen: torch.Tensor, spec: NSASpec, q0: int, BT: int) -> dict:
    B, G, Tq, r, D = q.shape
    N = chosen.shape[-1]
    return dict(scale=D**-0.5, sq_t=r * D, slse_t=r, Tq=Tq, Tk=ks.shape[2], q0=q0, R=r,
                M=triton.next_power_of_2(BT * r), BT=BT, D=D, L=spec.l_sel, N=N, NP=triton.next_power_of_2(N))


def sel_forward(q: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor, idx: torch.Tensor, valid: torch.Tensor,
                spec: NSASpec, start: torch.Tensor | None, q0: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as fast_sel.selected_forward: q (B, G, Tq, r, D), the queries at q0 .. q0 + Tq - 1;
    ks, vs (B, G, T, D) of the whole sequence; idx, valid (B, G, Tq, n'); start (B, Tq) or None ->
    out (B, G, Tq, r, D) and the fp32 logsumexp of each (query, head) (B, G, Tq, r). Head dim and l'
    must be powers of two >= 16. `ops.selected_triton` is its custom op (one node under compile)."""
    q, ks, vs = q.contiguous(), ks.contiguous(), vs.contiguous()
    B, G, Tq, r, D = q.shape
    chosen, BT, union, count = _tile_blocks(*_prepared(idx, valid, start, B, Tq), spec.l_sel, r)
    out = torch.empty_like(q)
    lse = torch.empty(B, G, Tq, r, dtype=torch.float32, device=q.device)
    _sel_fwd[(count.shape[-1], B * G)](q, ks, vs, chosen, union, count, out, lse,
                                       **_tile_args(q, ks, chosen, spec, q0, BT))
    return out, lse


def sel_backward(d_out: torch.Tensor, q: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor, idx: torch.Tensor,
                 valid: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, spec: NSASpec,
                 start: torch.Tensor | None, q0: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients (dq, dks, dvs) of `sel_forward`'s `out` (with its logsumexp `lse`) for `d_out`:
    dq query by query, dks and dvs block by block through the reverse index (`block_readers`)."""
    q, ks, vs, d_out, lse = q.contiguous(), ks.contiguous(), vs.contiguous(), d_out.contiguous(), lse.contiguous()
    B, G, Tq, r, D = q.shape
    Tk = ks.shape[2]
    idx32, start32 = _prepared(idx, valid, start, B, Tq)
    chosen, BT, union, count = _tile_blocks(idx32, start32, spec.l_sel, r)
    delta = (d_out.float() * out.float()).sum(-1).contiguous()  # (B, G, Tq, r)
    args = _tile_args(q, ks, chosen, spec, q0, BT)
    dq = torch.empty_like(q)
    _sel_bwd_dq[(count.shape[-1], B * G)](q, ks, vs, chosen, union, count, d_out, lse, delta, dq, **args)
    offsets, readers = block_readers(idx32, start32, spec.l_sel, Tk)
    parts = torch.zeros(2, B, G, r, Tk, D, dtype=torch.float32, device=q.device)  # keys no query chose: 0
    _sel_bwd_dkv[(triton.cdiv(Tk, spec.l_sel), B * G, r)](
        q, ks, vs, d_out, lse, delta, offsets, readers, parts[0], parts[1], args["scale"], args["sq_t"],
        args["slse_t"], Tq, Tk, q0, R=r, BQ=DKV_ROWS, D=D, L=spec.l_sel, num_warps=DKV_WARPS)
    dks, dvs = parts[0].sum(2).to(ks.dtype), parts[1].sum(2).to(vs.dtype)  # the r heads' parts
    return dq, dks, dvs
