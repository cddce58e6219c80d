"""The whole NSA attention as Triton kernels: two launches forward, a fill, three kernels and a cast backward.

Every kernel takes the tensors as the layer has them (q, out (B, Tq, H, D); keys and values (B, S, G, D);
gates (B, Tq, H, 3)), by their strides: no copies, no transposes. A program owns a tile of BT consecutive
queries of one KV group, all r heads of each as rows of one tensor-core tile (BT = 64 // r: 10 queries,
60 of 64 rows at M7C's r = 6; the group is never padded to 16).
  `_fwd_cmp` per tile: cmp attention (online softmax over the visible slots) -> its output and
      logsumexp; then the sel block scores again from that logsumexp, q . k_cmp summed over the group's
      heads (a one-hot product) and over each block's cmp members, the forced blocks, and the top n
      kept in registers while the blocks stream past, 16 at a time: no T x T/d tensor, no sort.
  `_fwd_sel_win` per tile: sel attention over the union of the tile's chosen blocks (each block loaded
      once for the tile, each row reading its own), win attention, and the gated sum.
  backward, after one zero fill of an fp32 buffer for the six key and value gradients:
      `_bwd_q` per tile: the gate gradients, dQ of all three branches, and sel's dK, dV by fp32
      atomic adds from the tile's union of blocks (each block once per tile);
      `_bwd_kv` per tile of cmp slots (in segments of queries, added atomically), then per tile of win
      keys: dK, dV; then one cast of the buffer to the keys' dtype (none in fp32).
Shapes depend only on T, loops run inside the kernels, and no value is read back to the host: the op can
be captured in a CUDA graph. Rules of the kernels: l and l' multiples of d (sel block j's cmp members are
the l/d + l'/d - 1 slots from j l'/d - l/d + 1), head dim and l' powers of two >= 16 (`problem`). Block
sizes are set so that no kernel spills registers on sm_90 in bf16 (`benchmarks/triton_compile.py`).
Checked on the CPU under TRITON_INTERPRET=1 against the reference (tests/test_families.py);
`benchmarks/triton_work.py` counts its launches.
"""

from __future__ import annotations

import torch

from .common import NSASpec
from .documents import Documents

try:
    import triton
    import triton.language as tl
except ImportError:  # optional: CPU machines run the other families
    triton = None

ROWS = 64
"""Rows (query x head) of a tile."""
WARPS = 8
"""Warps a program: with 4, a tile's fp32 accumulators (64 x 64) and operands took 255 registers and spilled."""
BLOCK_N = 64
"""cmp slots and win keys per step."""
CHUNK = 16
"""sel blocks scored per step of the top-n (32 spilled on sm_90)."""
KV_BLOCK = 32
"""Keys per program of `_bwd_kv` (64, with the dK, dV accumulators, spilled on sm_90)."""
KV_SEGMENT = 512
"""Queries per program of the cmp dK, dV kernel: a slot is seen by every later query, so the queries are
cut into segments whose parts are added atomically (the slot tiles alone would be too few programs)."""
BIG = 1 << 30


def problem(device: torch.device, dtype: torch.dtype, spec: NSASpec, heads_per_group: int, head_dim: int
            ) -> str | None:
    """Why the fused Triton op cannot run here, or None."""
    import os

    if triton is None:
        return "Triton is not installed (pip install triton)"
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return (f"the Triton kernels run on CUDA devices and this run is on {device.type} (TRITON_INTERPRET=1 "
                f"runs them interpreted, for checks)")
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return f"the Triton kernels take float32, float16 or bfloat16, and the compute dtype is {dtype}"
    if not all(x >= 16 and x & (x - 1) == 0 for x in (head_dim, spec.l_sel)):
        return (f"tl.dot needs head_dim and sel_block_size to be powers of two >= 16 (they are {head_dim} and "
                f"{spec.l_sel})")
    if not spec.strided_members():
        return (f"the Triton top-n adds each sel block's cmp members by stride: cmp_block_size and sel_block_size "
                f"must be multiples of cmp_stride (they are {spec.l}, {spec.l_sel} and {spec.d})")
    if heads_per_group > ROWS:
        return f"a tile holds at most {ROWS} query heads of a group, and this model has {heads_per_group}"
    return None


if triton is not None:

    @triton.jit
    def _rows(Q, START, FIRST, b, hq0, first, end, q0, sqb, sqt, sdb, R: tl.constexpr, BT: tl.constexpr,
              M: tl.constexpr, D: tl.constexpr, DOCS: tl.constexpr):
        """The rows of the BT queries from query row `first`: query row i (< end: live), head, position t,
        document start s and first slot fs, and q itself (M, D), from q's (B, Tq, H, D) by its strides."""
        mm = tl.arange(0, M)
        i = first + mm // R
        live = (mm < BT * R) & (i < end)
        hq = hq0 + mm % R
        t = q0 + i
        if DOCS:
            s = tl.load(START + b * sdb + t, mask=live, other=0).to(tl.int32)  # positions < 2^31: int32
            fs = tl.load(FIRST + b * sdb + t, mask=live, other=0).to(tl.int32)
        else:
            s = t * 0
            fs = t * 0
        dd = tl.arange(0, D)
        q = tl.load(Q + (b * sqb + i * sqt + hq * D)[:, None] + dd[None, :], mask=live[:, None], other=0.0)
        return mm, i, live, hq, t, s, fs, q

    @triton.jit
    def _kv(K, V, b, g, j, ok, skb, skt, svb, svt, D: tl.constexpr):
        """Keys and values (len(j), D) at rows j of (B, S, G, D) tensors (0 where not ok)."""
        dd = tl.arange(0, D)
        k = tl.load(K + (b * skb + j * skt + g * D)[:, None] + dd[None, :], mask=ok[:, None], other=0.0)
        v = tl.load(V + (b * svb + j * svt + g * D)[:, None] + dd[None, :], mask=ok[:, None], other=0.0)
        return k, v

    @triton.jit
    def _cmp_seen(CSTART, b, j, ok, t, s, live, scb, d, l, T, DOCS: tl.constexpr):
        """Which rows see cmp slots j: the block wholly in the past (and in the row's document)."""
        if DOCS:
            c = tl.load(CSTART + b * scb + j, mask=ok, other=T).to(tl.int32)
            seen = (c[None, :] >= s[:, None]) & (c[None, :] + l - 1 <= t[:, None])
        else:
            seen = j[None, :] * d + l - 1 <= t[:, None]
        return seen & ok[None, :] & live[:, None]

    @triton.jit
    def _online(m, total, acc, sc, v):
        m_new = tl.maximum(m, tl.max(sc, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_safe)
        p = tl.exp(sc - m_safe[:, None])
        return m_new, total * alpha + tl.sum(p, 1), acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)

    @triton.jit
    def _finish(m, total, acc):
        has = total > 0  # a row that sees no key: output 0, logsumexp 0
        lse = tl.where(has, m + tl.log(tl.where(has, total, 1.0)), 0.0)
        return acc / tl.where(has, total, 1.0)[:, None], lse

    @triton.jit
    def _next_block(chosen, cur):
        """The smallest first key of a chosen block above cur (BIG: none)."""
        return tl.min(tl.min(tl.where(chosen > cur, chosen, 1 << 30), 1), 0)

    @triton.jit
    def _chosen(IDX, VALID, bg, i, live, s, Tq, L: tl.constexpr, N: tl.constexpr, NP: tl.constexpr):
        """The first key of each row's chosen blocks (M, NP), -1 for none."""
        nn = tl.arange(0, NP)
        at = (bg * Tq + i)[:, None] * N + nn[None, :]
        ok = live[:, None] & (nn < N)[None, :]
        j = tl.load(IDX + at, mask=ok, other=0).to(tl.int32)
        valid = tl.load(VALID + at, mask=ok, other=0) != 0
        return tl.where(valid & ok, s[:, None] + j * L, -1)  # int32: fewer registers

    @triton.jit
    def _fwd_cmp(Q, KC, VC, CSTART, START, FIRST, OB, LSE, IDX, VALID, sqb, sqt, skcb, skct, svcb, svct, sdb, scb,
                 Tq, T, Nc, Ns, q0, G, H, scale, d, l,
                 R: tl.constexpr, BT: tl.constexpr, M: tl.constexpr, BTP: tl.constexpr, D: tl.constexpr,
                 L: tl.constexpr, N: tl.constexpr, NP: tl.constexpr, NB: tl.constexpr, BN: tl.constexpr,
                 STRIDE: tl.constexpr, BEFORE: tl.constexpr, DOCS: tl.constexpr):
        """A tile's cmp attention (output, logsumexp) and its queries' top-n sel blocks."""
        tile, bg = tl.program_id(0), tl.program_id(1)
        b, g = bg // G, bg % G
        mm, i, live, hq, t, s, fs, q = _rows(Q, START, FIRST, b, g * R, tile * BT, Tq, q0, sqb, sqt, sdb, R, BT, M,
                                             D, DOCS)
        dd = tl.arange(0, D)
        o_off = (b * Tq * H + i * H + hq)[:, None] * D + dd[None, :]  # out and the branch outputs: contiguous
        st_off = b * Tq * H + i * H + hq
        t_first = q0 + tile * BT
        t_last = tl.minimum(q0 + Tq, t_first + BT) - 1

        # cmp: the visible slots of the tile's documents
        n_lo = tl.min(tl.where(live, fs, Nc), 0)
        n_hi = tl.minimum(Nc, (t_last + 1) // d)
        m = tl.full([M], float("-inf"), tl.float32)
        total = tl.zeros([M], tl.float32)
        acc = tl.zeros([M, D], tl.float32)
        for n0 in range(n_lo, n_hi, BN):
            j = n0 + tl.arange(0, BN)
            ok = j < Nc
            k, v = _kv(KC, VC, b, g, j, ok, skcb, skct, svcb, svct, D)
            seen = _cmp_seen(CSTART, b, j, ok, t, s, live, scb, d, l, T, DOCS)
            sc = tl.where(seen, tl.dot(q, tl.trans(k), input_precision="ieee").to(tl.float32) * scale, float("-inf"))
            m, total, acc = _online(m, total, acc, sc, v)
        o_c, lse_c = _finish(m, total, acc)
        tl.store(OB + o_off, o_c.to(OB.dtype.element_ty), mask=live[:, None])
        tl.store(LSE + st_off, lse_c, mask=live)

        # top n: the group's block scores from cmp's logsumexp, streamed a chunk of blocks at a time
        qq = tl.arange(0, BTP)
        qi = tile * BT + qq
        qlive = (qq < BT) & (qi < Tq)
        if DOCS:
            sq = tl.load(START + b * sdb + q0 + qi, mask=qlive, other=0).to(tl.int32)
            fsq = tl.load(FIRST + b * sdb + q0 + qi, mask=qlive, other=0).to(tl.int32)
        else:
            sq = qi * 0
            fsq = qi * 0
        jt = (q0 + qi - sq) // L  # the block holding the query, in its document
        agg = (((mm // R)[None, :] == qq[:, None]) & live[None, :]).to(tl.float32)  # (BTP, M): a query's heads
        slots = tl.arange(0, NP)[None, :]
        vals = tl.full([BTP, NP], float("-inf"), tl.float32)  # the running top: score, block
        ids = tl.full([BTP, NP], 1 << 20, tl.int32)
        cur = tl.min(tl.where(qlive, sq, 1 << 30), 0)
        while cur < (1 << 30):  # each document of the tile (one without documents)
            inq = qlive & (sq == cur)
            rows_in = live & (s == cur)
            f0 = tl.min(tl.where(inq, fsq, 1 << 30), 0)
            j_hi = tl.max(tl.where(inq, jt, -1), 0) + 1
            for j0 in range(0, j_hi, NB):
                jj = j0 + tl.arange(0, NB)
                score = tl.zeros([BTP, NB], tl.float32)
                for k in range(STRIDE + BEFORE):  # a loop, not unrolled: unrolled, the loads of all five spilled
                    member = jj * STRIDE - BEFORE + k
                    slot = f0 + member
                    ok = (member >= 0) & (slot < Nc)
                    kc = tl.load(KC + (b * skcb + slot * skct + g * D)[:, None] + dd[None, :], mask=ok[:, None],
                                 other=0.0)
                    if DOCS:  # the document's slots: past its start by construction (f0 on)
                        c = tl.load(CSTART + b * scb + slot, mask=ok, other=T).to(tl.int32)
                    else:
                        c = slot * d
                    seen = (c[None, :] + l - 1 <= t[:, None]) & ok[None, :] & rows_in[:, None]
                    sc = tl.dot(q, tl.trans(kc), input_precision="ieee").to(tl.float32) * scale
                    p = tl.where(seen, tl.exp(sc - lse_c[:, None]), 0.0)
                    score += tl.dot(agg, p, input_precision="ieee")
                cand = inq[:, None] & (jj[None, :] <= jt[:, None]) & (jj < Ns)[None, :]
                forced = (jj[None, :] == 0) | (jj[None, :] >= jt[:, None] - 1)
                score = tl.where(cand, tl.where(forced, float("inf"), score), float("-inf"))
                for _ in range(N):  # insert the chunk's best n, each over the running worst
                    best = tl.max(score, 1)
                    at = tl.min(tl.where(score == best[:, None], jj[None, :], 1 << 20), 1)
                    worst = tl.min(vals, 1)
                    key = tl.where(vals == worst[:, None], ids * NP + slots, -1)
                    wkey = tl.max(key, 1)
                    better = (best > float("-inf")) & ((best > worst) | ((best == worst) & (at < wkey // NP)))
                    swap = (key == wkey[:, None]) & better[:, None]
                    vals = tl.where(swap, best[:, None], vals)
                    ids = tl.where(swap, at[:, None], ids)
                    score = tl.where(jj[None, :] == at[:, None], float("-inf"), score)
            cur = tl.min(tl.where(qlive & (sq > cur), sq, 1 << 30), 0)
        out_at = (bg * Tq + qi) * N
        for n in range(N):  # in order: the largest score first, ties to the lower block
            best = tl.max(vals, 1)
            at = tl.min(tl.where(vals == best[:, None], ids, 1 << 20), 1)
            real = best > float("-inf")
            tl.store(IDX + out_at + n, tl.where(real, at, n).to(tl.int64), mask=qlive)  # none: block n, invalid
            tl.store(VALID + out_at + n, real.to(tl.int8), mask=qlive)
            vals = tl.where((ids == at[:, None]) & real[:, None], float("-inf"), vals)
            ids = tl.where((ids == at[:, None]) & real[:, None], 1 << 20, ids)

    @triton.jit
    def _fwd_sel_win(Q, KS, VS, KW, VW, GATE, START, FIRST, O, OB, LSE, IDX, VALID, sqb, sqt, sksb, skst, svsb,
                     svst, skwb, skwt, svwb, svwt, sgb, sgt, sdb, Tq, T, q0, G, H, scale, w, ob_c, st_c,
                     R: tl.constexpr, BT: tl.constexpr, M: tl.constexpr, D: tl.constexpr, L: tl.constexpr,
                     N: tl.constexpr, NP: tl.constexpr, BN: tl.constexpr, DOCS: tl.constexpr, CMP: tl.constexpr,
                     SEL: tl.constexpr, WIN: tl.constexpr):
        """A tile's sel attention over the union of its chosen blocks, win attention, and the gated sum."""
        tile, bg = tl.program_id(0), tl.program_id(1)
        b, g = bg // G, bg % G
        mm, i, live, hq, t, s, fs, q = _rows(Q, START, FIRST, b, g * R, tile * BT, Tq, q0, sqb, sqt, sdb, R, BT, M,
                                             D, DOCS)
        dd = tl.arange(0, D)
        o_off = (b * Tq * H + i * H + hq)[:, None] * D + dd[None, :]  # out and the branch outputs: contiguous
        st_off = b * Tq * H + i * H + hq
        t_first = q0 + tile * BT
        t_last = tl.minimum(q0 + Tq, t_first + BT) - 1

        if SEL:  # the union of the tile's chosen blocks, each loaded once
            chosen = _chosen(IDX, VALID, bg, i, live, s, Tq, L, N, NP)
            m = tl.full([M], float("-inf"), tl.float32)
            total = tl.zeros([M], tl.float32)
            acc = tl.zeros([M, D], tl.float32)
            p0 = _next_block(chosen, -1)
            while p0 < (1 << 30):
                pos = p0 + tl.arange(0, L)
                k, v = _kv(KS, VS, b, g, pos, pos < T, sksb, skst, svsb, svst, D)
                reads = (tl.sum((chosen == p0).to(tl.int32), 1) > 0)[:, None] & (pos[None, :] <= t[:, None])
                sc = tl.where(reads, tl.dot(q, tl.trans(k)).to(tl.float32) * scale, float("-inf"))
                m, total, acc = _online(m, total, acc, sc, v)
                p0 = _next_block(chosen, p0)
            o_s, lse_s = _finish(m, total, acc)
            tl.store(OB + ob_c + o_off, o_s.to(OB.dtype.element_ty), mask=live[:, None])
            tl.store(LSE + st_c + st_off, lse_s, mask=live)

        o_w = tl.zeros([M, D], tl.float32)
        if WIN:
            k_lo = tl.maximum(tl.maximum(t_first - w + 1, 0), tl.min(tl.where(live, s, 1 << 30), 0))
            m = tl.full([M], float("-inf"), tl.float32)
            total = tl.zeros([M], tl.float32)
            acc = tl.zeros([M, D], tl.float32)
            for n0 in range(k_lo, t_last + 1, BN):
                j = n0 + tl.arange(0, BN)
                k, v = _kv(KW, VW, b, g, j, j <= t_last, skwb, skwt, svwb, svwt, D)
                seen = (j[None, :] <= t[:, None]) & (j[None, :] > t[:, None] - w) & (j[None, :] >= s[:, None])
                sc = tl.where(seen & live[:, None], tl.dot(q, tl.trans(k)).to(tl.float32) * scale, float("-inf"))
                m, total, acc = _online(m, total, acc, sc, v)
            o_w, lse_w = _finish(m, total, acc)
            tl.store(OB + 2 * ob_c + o_off, o_w.to(OB.dtype.element_ty), mask=live[:, None])
            tl.store(LSE + 2 * st_c + st_off, lse_w, mask=live)

        tl.debug_barrier()  # the gated sum reads the sel output back from other threads (not kept in registers)
        g_off = b * sgb + i * sgt + hq * 3
        out = tl.zeros([M, D], tl.float32)
        if CMP:
            o_c = tl.load(OB + o_off, mask=live[:, None], other=0.0).to(tl.float32)
            out += tl.load(GATE + g_off, mask=live, other=0.0)[:, None] * o_c
        if SEL:
            o_s = tl.load(OB + ob_c + o_off, mask=live[:, None], other=0.0).to(tl.float32)
            out += tl.load(GATE + g_off + 1, mask=live, other=0.0)[:, None] * o_s
        if WIN:
            out += tl.load(GATE + g_off + 2, mask=live, other=0.0)[:, None] * o_w
        tl.store(O + o_off, out.to(O.dtype.element_ty), mask=live[:, None])

    @triton.jit
    def _grads(q, do, k, v, seen, lse, gate, delta, scale, PRECISION: tl.constexpr):
        """A tile's probabilities again from the rows' logsumexp and the gradient of its scores, for the
        branch's output gradient gate * do: p, ds (rows, keys), 0 where not seen."""
        sc = tl.dot(q, tl.trans(k), input_precision=PRECISION).to(tl.float32) * scale
        p = tl.where(seen, tl.exp(sc - lse[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v)).to(tl.float32) * gate[:, None]
        return p, p * (dp - delta[:, None]) * scale

    @triton.jit
    def _add(GK, at, x, ok):
        """x (keys, D) added into the fp32 gradient buffer at `at` (keys, D)."""
        tl.atomic_add(GK + at, x, mask=ok[:, None])

    @triton.jit
    def _bwd_q(Q, KC, VC, KS, VS, KW, VW, GATE, CSTART, START, FIRST, DO, OB, LSE, IDX, VALID, DQ, DG, DELTA, GK,
               sqb, sqt, skcb, skct, svcb, svct, sksb, skst, svsb, svst, skwb, skwt, svwb, svwt, sgb, sgt, sdb, scb,
               sdob, sdot, Tq, T, Nc, q0, G, H, scale, d, l, w, ob_c, st_c, gk_ks, gk_vs,
               R: tl.constexpr, BT: tl.constexpr, M: tl.constexpr, D: tl.constexpr, L: tl.constexpr,
               N: tl.constexpr, NP: tl.constexpr, BN: tl.constexpr, DOCS: tl.constexpr, CMP: tl.constexpr,
               SEL: tl.constexpr, WIN: tl.constexpr):
        """A tile's gate gradients, dQ of every branch, and sel's dK, dV (atomic adds, each chosen block of the
        tile once); the rows' delta (gate * dO . o) of cmp and win for `_bwd_kv`."""
        tile, bg = tl.program_id(0), tl.program_id(1)
        b, g = bg // G, bg % G
        mm, i, live, hq, t, s, fs, q = _rows(Q, START, FIRST, b, g * R, tile * BT, Tq, q0, sqb, sqt, sdb, R, BT, M,
                                             D, DOCS)
        dd = tl.arange(0, D)
        o_off = (b * Tq * H + i * H + hq)[:, None] * D + dd[None, :]
        st_off = b * Tq * H + i * H + hq
        do = tl.load(DO + (b * sdob + i * sdot + hq * D)[:, None] + dd[None, :], mask=live[:, None], other=0.0)
        g_off = b * sgb + i * sgt + hq * 3
        t_first = q0 + tile * BT
        t_last = tl.minimum(q0 + Tq, t_first + BT) - 1
        dq = tl.zeros([M, D], tl.float32)
        dof = do.to(tl.float32)  # the gate gradients dO . o of the branches summed, 0 for the others
        zero = tl.zeros([M], tl.float32)
        dg_c = tl.sum(dof * tl.load(OB + o_off, mask=live[:, None], other=0.0).to(tl.float32), 1) if CMP else zero
        dg_s = tl.sum(dof * tl.load(OB + ob_c + o_off, mask=live[:, None], other=0.0).to(tl.float32), 1) if SEL else zero
        dg_w = tl.sum(dof * tl.load(OB + 2 * ob_c + o_off, mask=live[:, None], other=0.0).to(tl.float32), 1) if WIN \
            else zero
        tl.store(DG + st_off * 3, dg_c, mask=live)
        tl.store(DG + st_off * 3 + 1, dg_s, mask=live)
        tl.store(DG + st_off * 3 + 2, dg_w, mask=live)
        if CMP:
            gate = tl.load(GATE + g_off, mask=live, other=0.0)
            lse = tl.load(LSE + st_off, mask=live, other=0.0)
            delta = gate * dg_c
            tl.store(DELTA + st_off, delta, mask=live)
            n_lo = tl.min(tl.where(live, fs, Nc), 0)
            for n0 in range(n_lo, tl.minimum(Nc, (t_last + 1) // d), BN):
                j = n0 + tl.arange(0, BN)
                ok = j < Nc
                k, v = _kv(KC, VC, b, g, j, ok, skcb, skct, svcb, svct, D)
                seen = _cmp_seen(CSTART, b, j, ok, t, s, live, scb, d, l, T, DOCS)
                _, ds = _grads(q, do, k, v, seen, lse, gate, delta, scale, "ieee")
                dq += tl.dot(ds.to(k.dtype), k).to(tl.float32)
        if SEL:
            gate = tl.load(GATE + g_off + 1, mask=live, other=0.0)
            lse = tl.load(LSE + st_c + st_off, mask=live, other=0.0)
            delta = gate * dg_s
            chosen = _chosen(IDX, VALID, bg, i, live, s, Tq, L, N, NP)
            p0 = _next_block(chosen, -1)
            while p0 < (1 << 30):
                pos = p0 + tl.arange(0, L)
                ok = pos < T
                k, v = _kv(KS, VS, b, g, pos, ok, sksb, skst, svsb, svst, D)
                reads = (tl.sum((chosen == p0).to(tl.int32), 1) > 0)[:, None] & (pos[None, :] <= t[:, None])
                p, ds = _grads(q, do, k, v, reads, lse, gate, delta, scale, None)
                dq += tl.dot(ds.to(k.dtype), k).to(tl.float32)
                at = (b * T + pos)[:, None] * (G * D) + g * D + dd[None, :]
                _add(GK + gk_ks, at, tl.dot(tl.trans(ds.to(q.dtype)), q).to(tl.float32), ok)
                _add(GK + gk_vs, at, tl.dot(tl.trans((p * gate[:, None]).to(do.dtype)), do).to(tl.float32), ok)
                p0 = _next_block(chosen, p0)
        if WIN:
            gate = tl.load(GATE + g_off + 2, mask=live, other=0.0)
            lse = tl.load(LSE + 2 * st_c + st_off, mask=live, other=0.0)
            delta = gate * dg_w
            tl.store(DELTA + st_c + st_off, delta, mask=live)
            k_lo = tl.maximum(tl.maximum(t_first - w + 1, 0), tl.min(tl.where(live, s, 1 << 30), 0))
            for n0 in range(k_lo, t_last + 1, BN):
                j = n0 + tl.arange(0, BN)
                k, v = _kv(KW, VW, b, g, j, j <= t_last, skwb, skwt, svwb, svwt, D)
                seen = (j[None, :] <= t[:, None]) & (j[None, :] > t[:, None] - w) & (j[None, :] >= s[:, None])
                _, ds = _grads(q, do, k, v, seen & live[:, None], lse, gate, delta, scale, None)
                dq += tl.dot(ds.to(k.dtype), k).to(tl.float32)
        tl.store(DQ + o_off, dq.to(DQ.dtype.element_ty), mask=live[:, None])

    @triton.jit
    def _bwd_kv(Q, K, V, GATE, CSTART, START, FIRST, DO, LSE, DELTA, GK,
                sqb, sqt, skb, skt, svb, svt, sgb, sgt, sdb, scb, sdob, sdot,
                Tq, T, S, q0, G, H, scale, d, l, w, lse_at, delta_at, gk_k, gk_v, SEGS, SEG,
                R: tl.constexpr, BT: tl.constexpr, M: tl.constexpr, D: tl.constexpr, BN: tl.constexpr,
                DOCS: tl.constexpr, WIN: tl.constexpr):
        """dK, dV of a tile of BN cmp slots over one segment of SEG query rows, or (WIN) of BN win keys over
        the queries whose window holds them; all r heads as rows; added into the fp32 buffer."""
        bg = tl.program_id(1)
        b, g = bg // G, bg % G
        dd = tl.arange(0, D)
        if WIN:
            n0 = tl.program_id(0) * BN
            r_lo = tl.maximum(n0 - q0, 0)
            r_hi = tl.minimum(Tq, n0 + BN + w - 1 - q0)
        else:
            n0 = (tl.program_id(0) // SEGS) * BN
            seg = tl.program_id(0) % SEGS
            if DOCS:
                t_lo = tl.load(CSTART + b * scb + n0).to(tl.int32) + l - 1
            else:
                t_lo = n0 * d + l - 1
            r_lo = tl.maximum(tl.maximum(t_lo - q0, 0), seg * SEG)
            r_hi = tl.minimum(Tq, seg * SEG + SEG)
        j = n0 + tl.arange(0, BN)
        ok = j < S
        k, v = _kv(K, V, b, g, j, ok, skb, skt, svb, svt, D)
        dk = tl.zeros([BN, D], tl.float32)
        dv = tl.zeros([BN, D], tl.float32)
        for first in range(r_lo, r_hi, BT):
            mm, i, live, hq, t, s, fs, q = _rows(Q, START, FIRST, b, g * R, first, r_hi, q0, sqb, sqt, sdb, R, BT,
                                                 M, D, DOCS)
            st_off = b * Tq * H + i * H + hq
            do = tl.load(DO + (b * sdob + i * sdot + hq * D)[:, None] + dd[None, :], mask=live[:, None], other=0.0)
            gate = tl.load(GATE + b * sgb + i * sgt + hq * 3 + 2 * WIN, mask=live, other=0.0)
            lse = tl.load(LSE + lse_at + st_off, mask=live, other=0.0)
            delta = tl.load(DELTA + delta_at + st_off, mask=live, other=0.0)
            if WIN:
                seen = (j[None, :] <= t[:, None]) & (j[None, :] > t[:, None] - w) & (j[None, :] >= s[:, None])
                p, ds = _grads(q, do, k, v, seen & live[:, None] & ok[None, :], lse, gate, delta, scale, None)
            else:
                seen = _cmp_seen(CSTART, b, j, ok, t, s, live, scb, d, l, T, DOCS)
                p, ds = _grads(q, do, k, v, seen, lse, gate, delta, scale, "ieee")
            dv += tl.dot(tl.trans((p * gate[:, None]).to(do.dtype)), do).to(tl.float32)
            dk += tl.dot(tl.trans(ds.to(q.dtype)), q).to(tl.float32)
        at = (b * S + j)[:, None] * (G * D) + g * D + dd[None, :]
        _add(GK + gk_k, at, dk, ok)
        _add(GK + gk_v, at, dv, ok)


def _keys(x: torch.Tensor) -> torch.Tensor:
    """x (B, S, G, D) as the kernels read it: D and G packed (a view from the projections is)."""
    return x if x.stride(3) == 1 and x.stride(2) == x.shape[3] else x.contiguous()


def _geometry(q: torch.Tensor, keys: list[torch.Tensor], gates: torch.Tensor, spec: NSASpec,
              docs: Documents | None, q0: int) -> tuple[dict, dict]:
    """The pointers and the arguments every kernel shares: strides, sizes, block geometry."""
    B, Tq, H, D = q.shape
    kc, vc, ks, vs, kw, vw = keys
    T, G = ks.shape[1], ks.shape[2]
    r = H // G
    bt = max(1, ROWS // r)
    docs_args = (dict(CSTART=docs.cmp_start, START=docs.start, FIRST=docs.first_slot) if docs is not None
                 else dict(CSTART=q, START=q, FIRST=q))  # unread without documents
    ptrs = dict(Q=q, KC=kc, VC=vc, KS=ks, VS=vs, KW=kw, VW=vw, GATE=gates, **docs_args)
    args = dict(sqb=q.stride(0), sqt=q.stride(1), skcb=kc.stride(0), skct=kc.stride(1), svcb=vc.stride(0),
                svct=vc.stride(1), sksb=ks.stride(0), skst=ks.stride(1), svsb=vs.stride(0), svst=vs.stride(1),
                skwb=kw.stride(0), skwt=kw.stride(1), svwb=vw.stride(0), svwt=vw.stride(1), sgb=gates.stride(0),
                sgt=gates.stride(1), sdb=T if docs is not None else 0,
                scb=docs.cmp_start.stride(0) if docs is not None else 0, Tq=Tq, T=T, Nc=kc.shape[1], q0=q0, G=G,
                H=H, scale=D**-0.5, d=spec.d, l=spec.l, w=spec.w, ob_c=B * Tq * H * D, st_c=B * Tq * H,
                R=r, BT=bt, M=triton.next_power_of_2(bt * r), D=D, DOCS=docs is not None)
    return ptrs, args


def forward(q: torch.Tensor, keys: list[torch.Tensor], gates: torch.Tensor, spec: NSASpec, docs: Documents | None,
            q0: int, branches: tuple[bool, bool, bool]
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """out (B, Tq, H, D), the branch outputs (3, B, Tq, H, D) and logsumexps (3, B, Tq, H) fp32, and the
    chosen blocks idx (B, G, Tq, n') long, valid bool: two launches."""
    B, Tq, H, D = q.shape
    keys = [_keys(x) for x in keys]
    T, G = keys[2].shape[1], keys[2].shape[2]
    ptrs, args = _geometry(q, keys, gates, spec, docs, q0)
    Ns = spec.num_sel_blocks(T)
    n = min(spec.n, Ns)
    out = torch.empty(B, Tq, H, D, dtype=q.dtype, device=q.device)
    ob = torch.empty(3, B, Tq, H, D, dtype=q.dtype, device=q.device)
    lse = torch.empty(3, B, Tq, H, dtype=torch.float32, device=q.device)
    idx = torch.empty(B, G, Tq, n, dtype=torch.long, device=q.device)
    valid = torch.empty(B, G, Tq, n, dtype=torch.bool, device=q.device)
    bt, grid = args["BT"], (triton.cdiv(Tq, args["BT"]), B * G)
    pick = lambda *names: {k: v for k, v in {**ptrs, **args}.items() if k in names}  # noqa: E731
    shared = ("Q", "START", "FIRST", "sqb", "sqt", "sdb", "Tq", "T", "q0", "G", "H", "scale", "R", "BT", "M", "D",
              "DOCS")
    _fwd_cmp[grid](**pick(*shared, "KC", "VC", "CSTART", "skcb", "skct", "svcb", "svct", "scb", "Nc", "d", "l"),
                   OB=ob, LSE=lse, IDX=idx, VALID=valid.view(torch.int8), Ns=Ns,
                   BTP=max(16, triton.next_power_of_2(bt)), L=spec.l_sel, N=n, NP=triton.next_power_of_2(n),
                   NB=CHUNK, BN=BLOCK_N, STRIDE=spec.l_sel // spec.d, BEFORE=spec.l // spec.d - 1, num_warps=WARPS)
    _fwd_sel_win[grid](**pick(*shared, "KS", "VS", "KW", "VW", "GATE", "sksb", "skst", "svsb", "svst", "skwb", "skwt",
                              "svwb", "svwt", "sgb", "sgt", "w", "ob_c", "st_c"),
                       O=out, OB=ob, LSE=lse, IDX=idx, VALID=valid.view(torch.int8), L=spec.l_sel, N=n,
                       NP=triton.next_power_of_2(n), BN=BLOCK_N, CMP=branches[0], SEL=branches[1], WIN=branches[2],
                       num_warps=WARPS)
    return out, ob, lse, idx, valid


def backward(d_out: torch.Tensor, q: torch.Tensor, keys: list[torch.Tensor], gates: torch.Tensor, ob: torch.Tensor,
             lse: torch.Tensor, idx: torch.Tensor, valid: torch.Tensor, spec: NSASpec, docs: Documents | None,
             q0: int, branches: tuple[bool, bool, bool]) -> list[torch.Tensor]:
    """dq, the six key and value gradients in one flat buffer (`key_grads`) and d_gates of `forward`'s output:
    a zero fill, three kernels and one conversion to the keys' dtype."""
    B, Tq, H, D = q.shape
    keys = [_keys(x) for x in keys]
    T, G, Nc = keys[2].shape[1], keys[2].shape[2], keys[0].shape[1]
    ptrs, args = _geometry(q, keys, gates, spec, docs, q0)
    sizes = [B * Nc * G * D] * 2 + [B * T * G * D] * 4
    at = [sum(sizes[:i]) for i in range(6)]
    gk = torch.zeros(sum(sizes), dtype=torch.float32, device=q.device)
    dq = torch.empty(B, Tq, H, D, dtype=q.dtype, device=q.device)
    dg = torch.empty(B, Tq, H, 3, dtype=torch.float32, device=q.device)
    delta = torch.empty(2, B, Tq, H, dtype=torch.float32, device=q.device)
    bt, n = args["BT"], idx.shape[-1]
    _bwd_q[(triton.cdiv(Tq, bt), B * G)](**ptrs, **args, DO=d_out, sdob=d_out.stride(0), sdot=d_out.stride(1),
                                         LSE=lse, DELTA=delta, GK=gk, BN=BLOCK_N, CMP=branches[0], WIN=branches[2],
                                         OB=ob, IDX=idx, VALID=valid.view(torch.int8), DQ=dq,
                                         DG=dg, gk_ks=at[2], gk_vs=at[3], L=spec.l_sel, N=n,
                                         NP=triton.next_power_of_2(n), SEL=branches[1], num_warps=WARPS)
    common = {k: v for k, v in args.items() if k not in ("ob_c", "st_c", "Nc") and not k.startswith(("skc", "svc",
                                                                                                  "sks", "svs", "skw", "svw"))}
    common.update(Q=q, GATE=gates, CSTART=ptrs["CSTART"], START=ptrs["START"], FIRST=ptrs["FIRST"], DO=d_out,
                  sdob=d_out.stride(0), sdot=d_out.stride(1), LSE=lse, DELTA=delta, GK=gk, BN=KV_BLOCK)
    if branches[0]:  # cmp: slot tiles x segments of queries
        segs = triton.cdiv(Tq, KV_SEGMENT)
        kc, vc = keys[:2]
        _bwd_kv[(triton.cdiv(Nc, KV_BLOCK) * segs, B * G)](
            **common, K=kc, V=vc, skb=kc.stride(0), skt=kc.stride(1), svb=vc.stride(0), svt=vc.stride(1), S=Nc,
            lse_at=0, delta_at=0, gk_k=at[0], gk_v=at[1], SEGS=segs, SEG=KV_SEGMENT, WIN=False, num_warps=WARPS)
    if branches[2]:
        kw, vw = keys[4:]
        _bwd_kv[(triton.cdiv(T, KV_BLOCK), B * G)](
            **common, K=kw, V=vw, skb=kw.stride(0), skt=kw.stride(1), svb=vw.stride(0), svt=vw.stride(1), S=T,
            lse_at=2 * B * Tq * H, delta_at=B * Tq * H, gk_k=at[4], gk_v=at[5], SEGS=1, SEG=Tq, WIN=True, num_warps=WARPS)
    return [dq, gk if keys[0].dtype == torch.float32 else gk.to(keys[0].dtype), dg.to(gates.dtype)]


def key_grads(flat: torch.Tensor, kc: torch.Tensor, ks: torch.Tensor) -> list[torch.Tensor]:
    """`backward`'s buffer of the six key and value gradients as views: (B, Nc, G, D) x 2, (B, T, G, D) x 4."""
    B, Nc, G, D = kc.shape
    T = ks.shape[1]
    sizes, shapes = [B * Nc * G * D] * 2 + [B * T * G * D] * 4, [kc.shape] * 2 + [ks.shape] * 4
    at = [sum(sizes[:i]) for i in range(6)]
    return [flat[a:a + size].view(shape) for a, size, shape in zip(at, sizes, shapes)]


Tensor = torch.Tensor
OptTensor = Tensor | None


def _docs(start: OptTensor, cmp_start: OptTensor, first_slot: OptTensor) -> Documents | None:
    """The geometry the kernels read (the end of each document is not: the rules need only starts)."""
    return None if start is None else Documents(start, start, cmp_start, first_slot)


def _spec(spec: list[int]) -> NSASpec:
    return NSASpec(*spec)


@torch.library.custom_op("nsa_titan::nsa_triton", mutates_args=())
def _op(q: Tensor, kc: Tensor, vc: Tensor, ks: Tensor, vs: Tensor, kw: Tensor, vw: Tensor, gates: Tensor,
        spec: list[int], q0: int, branches: list[bool], start: OptTensor, cmp_start: OptTensor, first_slot: OptTensor
        ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    return forward(q, [kc, vc, ks, vs, kw, vw], gates, _spec(spec), _docs(start, cmp_start, first_slot), q0,
                   tuple(branches))


@_op.register_fake
def _(q, kc, vc, ks, vs, kw, vw, gates, spec, q0, branches, start, cmp_start, first_slot):
    B, Tq, H, D = q.shape
    T, G = ks.shape[1], ks.shape[2]
    n = min(spec[3], _spec(spec).num_sel_blocks(T))
    return (q.new_empty(B, Tq, H, D), q.new_empty(3, B, Tq, H, D), q.new_empty(3, B, Tq, H, dtype=torch.float32),
            q.new_empty(B, G, Tq, n, dtype=torch.long), q.new_empty(B, G, Tq, n, dtype=torch.bool))


@torch.library.custom_op("nsa_titan::nsa_triton_backward", mutates_args=())
def _backward_op(d_out: Tensor, q: Tensor, kc: Tensor, vc: Tensor, ks: Tensor, vs: Tensor, kw: Tensor, vw: Tensor,
                 gates: Tensor, ob: Tensor, lse: Tensor, idx: Tensor, valid: Tensor, spec: list[int], q0: int,
                 branches: list[bool], start: OptTensor, cmp_start: OptTensor, first_slot: OptTensor) -> list[Tensor]:
    return backward(d_out, q, [kc, vc, ks, vs, kw, vw], gates, ob, lse, idx, valid, _spec(spec),
                    _docs(start, cmp_start, first_slot), q0, tuple(branches))


@_backward_op.register_fake
def _(d_out, q, kc, vc, ks, vs, kw, vw, gates, ob, lse, idx, valid, spec, q0, branches, start, cmp_start, first_slot):
    B, Nc, G, D = kc.shape
    return [torch.empty_like(q, memory_format=torch.contiguous_format),
            kc.new_empty(2 * B * Nc * G * D + 4 * ks.numel()), torch.empty_like(gates, memory_format=torch.contiguous_format)]


def _setup(ctx, inputs, output) -> None:
    q, kc, vc, ks, vs, kw, vw, gates, spec, q0, branches, start, cmp_start, first_slot = inputs
    _, ob, lse, idx, valid = output
    ctx.save_for_backward(q, kc, vc, ks, vs, kw, vw, gates, ob, lse, idx, valid, start, cmp_start, first_slot)
    ctx.spec, ctx.q0, ctx.branches = spec, q0, branches
    ctx.mark_non_differentiable(ob, lse, idx, valid)
    ctx.set_materialize_grads(False)  # no zero-filled gradients of the saved outputs


def _grad(ctx, d_out, _d_ob, _d_lse, _d_idx, _d_valid):
    q, kc, vc, ks, vs, kw, vw, gates, ob, lse, idx, valid, start, cmp_start, first_slot = ctx.saved_tensors
    dq, flat, dg = _backward_op(d_out.contiguous(), q, kc, vc, ks, vs, kw, vw, gates, ob, lse, idx, valid, ctx.spec,
                                ctx.q0, ctx.branches, start, cmp_start, first_slot)
    return dq, *key_grads(flat, kc, ks), dg, None, None, None, None, None, None


_op.register_autograd(_grad, setup_context=_setup)


def nsa_attention(q: Tensor, k_cmp: Tensor, v_cmp: Tensor, k_sel: Tensor, v_sel: Tensor, k_win: Tensor, v_win: Tensor,
                  gates: Tensor, spec: NSASpec, docs: Documents | None, q0: int, branches: tuple[bool, bool, bool]
                  ) -> tuple[Tensor, Tensor, Tensor]:
    """(out, idx, valid) of the fused op: `families.base.Family.attend`'s contract."""
    fields = (None,) * 3 if docs is None else (docs.start, docs.cmp_start, docs.first_slot)
    out, _, _, idx, valid = _op(q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates,
                                [spec.l, spec.d, spec.l_sel, spec.n, spec.w], q0, list(branches), *fields)
    return out, idx, valid
