"""The Triton kernels of the whole NSA attention, forward (the backward ones: `triton_nsa_backward.py`).

Every kernel takes the tensors as the layer has them (q, out (B, Tq, H, D); keys and values (B, S, G, D);
gates (B, Tq, H, 3)), by their strides: no copies, no transposes. A program owns a tile of BT consecutive
queries of one KV group, all r heads of each as rows of one tensor-core tile (BT = 64 // r: 10 queries,
60 of 64 rows at M7C's r = 6; the group is never padded to 16).
  `_fwd_cmp` per tile: cmp attention (online softmax over the visible slots) -> its output and
      logsumexp; then one more pass over the slots for the sel block scores from that logsumexp: q . k_cmp
      summed over the group's heads (a one-hot product) and over each block's cmp members (a 0/1 product
      of a step's slots into its NB blocks), the forced blocks; the running top n, kept in registers as
      packed (score, block) keys, is merged with a step's blocks (a bitonic top-k of both) only where one
      of them can enter it: no T x T/d tensor, no sort of all blocks. Each chosen block's readers are
      counted (the inverse index's sizes).
  `_fwd_win` per tile: win attention; each query enters itself in its blocks' reader lists (offsets: a
      cumulative sum of the counts between the two), noting where.
  `triton_nsa_sel._fwd_sel` over equal spans of the reader lists: each chosen block's keys loaded once,
      its readers' sel output and logsumexp over it, per entry.
  `_fwd_mix` per tile: a query's n block outputs merged by their logsumexps, and the gated sum.
  backward (`triton_nsa_backward.py`): `triton_nsa_sel._bwd_sel_kv` over the spans: sel's dK, dV and each
      entry's dQ rows (written, not added); `_bwd_q` per tile: the gate gradients and the whole dQ (cmp, win and
      the sum of its entries' sel rows); `_bwd_kv` per tile of cmp slots (in segments of queries) and of win
      keys: dK, dV; the gradients in one fp32 buffer.
The host side, the custom op and its backward are `family.py` beside this file. Shapes depend only on T, loops
run inside the kernels, and no value is read back to the host: the op can be captured in a CUDA graph.
Rules of the kernels: l and l' multiples of d (sel block j's cmp members are the l/d + l'/d - 1 slots from
j l'/d - l/d + 1), head dim and l' powers of two >= 16 (`problem`). Block sizes are set so that no kernel
spills registers on sm_90 in bf16 or fp16 (`benchmarks/gpu/triton_compile.py`).
Checked on the CPU under TRITON_INTERPRET=1 against the reference (tests/test_families.py);
`benchmarks/gpu/triton_work.py` counts its launches.
"""

from __future__ import annotations

import torch

from ...spec import NSASpec

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
TOPN_SLOTS = 64
"""cmp slots a step of the top-n's pass (its NB = TOPN_SLOTS / (l'/d) blocks, at least n's power of two)."""
NONE = 2**31 - 1
"""The block part of a packed top-n key is NONE - block: the larger key takes the lower block on a tie."""
LOWEST = (((0xFF800000 - 2**32) ^ 0x7FFFFFFF) << 32)
"""The packed key of no block: -inf's ordered bits, block NONE; every candidate's key is above it."""
KV_BLOCK = 32
"""Keys per program of `_bwd_kv` (64, with the dK, dV accumulators, spilled on sm_90)."""
KV_SEGMENT = 512
"""Queries per program of the cmp dK, dV kernel: a slot is seen by every later query, so the queries are
cut into segments whose parts are added atomically (the slot tiles alone would be too few programs)."""
SEL_KV_ROWS = 32
"""Rows (queries x heads) of a step of `triton_nsa_sel._bwd_sel_kv`: with 64 it spilled on sm_90 (48 bytes with
the dQ rows' atomic add, 72 with the load of sel's output for delta that replaced it)."""
READER_STEPS = 32
"""Steps of a program over the inverse index (`triton_nsa_sel`): its span is READER_STEPS tiles of
readers, so the first block, which every query reads, is shared among Tq / span programs (64: 0.68 ms predicted
at 8k, 32: 0.56, 16: 0.57; `benchmarks/gpu/gpu_prediction.py`)."""


def topn_blocks(spec: NSASpec, n: int) -> int:
    """NB: sel blocks a step of the top-n's pass scores (TOPN_SLOTS slots), at least n's power of two."""
    return max(1 << (n - 1).bit_length(), TOPN_SLOTS * spec.d // spec.l_sel)


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
    if spec.l - spec.d >= spec.l_sel:
        return (f"the Triton top-n takes a block's members before its first slot from the step before: "
                f"cmp_block_size - cmp_stride must be below sel_block_size (they are {spec.l}, {spec.d} and "
                f"{spec.l_sel})")
    if heads_per_group > ROWS:
        return f"a tile holds at most {ROWS} query heads of a group, and this model has {heads_per_group}"
    return None


if triton is not None:
    _NONE, _LOWEST = tl.constexpr(NONE), tl.constexpr(LOWEST)

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
    def _tile(Q, START, FIRST, Tq, q0, G, H, sqb, sqt, sdb, R: tl.constexpr, BT: tl.constexpr, M: tl.constexpr,
              D: tl.constexpr, DOCS: tl.constexpr):
        """The program's tile (axis 0) of group bg = b G + g (axis 1): `_rows` of its BT queries, the offsets of
        its rows in the (contiguous) outputs and per-row statistics, and its first and last positions."""
        tile, bg = tl.program_id(0), tl.program_id(1)
        b, g = bg // G, bg % G
        mm, i, live, hq, t, s, fs, q = _rows(Q, START, FIRST, b, g * R, tile * BT, Tq, q0, sqb, sqt, sdb, R, BT, M,
                                             D, DOCS)
        dd = tl.arange(0, D)
        o_off = (b * Tq * H + i * H + hq)[:, None] * D + dd[None, :]
        st_off = b * Tq * H + i * H + hq
        t_first = q0 + tile * BT
        t_last = tl.minimum(q0 + Tq, t_first + BT) - 1
        return tile, bg, b, g, mm, i, live, hq, t, s, fs, q, dd, o_off, st_off, t_first, t_last

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
    def _chosen(IDX, VALID, bg, i, live, s, Tq, L: tl.constexpr, N: tl.constexpr, NP: tl.constexpr):
        """The first key of each row's chosen blocks (M, NP), -1 for none."""
        nn = tl.arange(0, NP)
        at = (bg * Tq + i)[:, None] * N + nn[None, :]
        ok = live[:, None] & (nn < N)[None, :]
        j = tl.load(IDX + at, mask=ok, other=0).to(tl.int32)
        valid = tl.load(VALID + at, mask=ok, other=0) != 0
        return tl.where(valid & ok, s[:, None] + j * L, -1)  # int32: fewer registers

    @triton.jit
    def _fwd_cmp(Q, KC, VC, CSTART, START, FIRST, OB, LSE, CMP_LSE, IDX, VALID, COUNT, sqb, sqt, skcb, skct, svcb, svct,
                 sdb, scb, slb, slh, slt, Tq, T, Nc, Ns, q0, G, H, scale, d, l,
                 R: tl.constexpr, BT: tl.constexpr, M: tl.constexpr, BTP: tl.constexpr, D: tl.constexpr,
                 L: tl.constexpr, N: tl.constexpr, NP: tl.constexpr, NB: tl.constexpr, BN: tl.constexpr,
                 STRIDE: tl.constexpr, BEFORE: tl.constexpr, DOCS: tl.constexpr, GIVEN: tl.constexpr):
        """A tile's cmp attention (output, logsumexp) and its queries' top-n sel blocks, each counted in COUNT
        (B G x T: the readers of the block starting at each key position). GIVEN: cmp was computed elsewhere (the
        flex family's Flex), its logsumexp read from CMP_LSE (B, H, Tq) by its strides: the top-n pass alone."""
        tile, bg, b, g, mm, i, live, hq, t, s, fs, q, dd, o_off, st_off, t_first, t_last = _tile(
            Q, START, FIRST, Tq, q0, G, H, sqb, sqt, sdb, R, BT, M, D, DOCS)

        if GIVEN:
            lse_c = tl.load(CMP_LSE + b * slb + hq * slh + i * slt, mask=live, other=0.0)
        else:  # cmp: the visible slots of the tile's documents
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
                sc = tl.where(seen, tl.dot(q, tl.trans(k), input_precision="ieee").to(tl.float32) * scale,
                              float("-inf"))
                m, total, acc = _online(m, total, acc, sc, v)
            o_c, lse_c = _finish(m, total, acc)
            tl.store(OB + o_off, o_c.to(OB.dtype.element_ty), mask=live[:, None])
            tl.store(LSE + st_off, lse_c, mask=live)

        # top n: the group's block scores from cmp's logsumexp, NB blocks (their NB x STRIDE slots) a step
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
        ss = tl.arange(0, NB * STRIDE)  # a step's slots
        jn = tl.arange(0, NB)  # its blocks
        members = ((ss[:, None] >= jn[None, :] * STRIDE - BEFORE) & (ss[:, None] < jn[None, :] * STRIDE + STRIDE)
                   ).to(tl.float32)  # (slots, blocks); a block's members before the step: `carry`
        top = tl.full([BTP, NP], _LOWEST, tl.int64)  # the running top n, packed (`_pack`), largest first
        cur = tl.min(tl.where(qlive, sq, 1 << 30), 0)
        while cur < (1 << 30):  # each document of the tile (one without documents)
            inq = qlive & (sq == cur)
            rows_in = live & (s == cur)
            f0 = tl.min(tl.where(inq, fsq, 1 << 30), 0)
            j_hi = tl.max(tl.where(inq, jt, -1), 0) + 1
            carry = tl.zeros([BTP], tl.float32)  # the last BEFORE slots of the step before
            for j0 in range(0, j_hi, NB):
                slot = f0 + j0 * STRIDE + ss
                ok = slot < Nc
                kc = tl.load(KC + (b * skcb + slot * skct + g * D)[:, None] + dd[None, :], mask=ok[:, None], other=0.0)
                if DOCS:  # the document's slots: past its start by construction (f0 on)
                    c = tl.load(CSTART + b * scb + slot, mask=ok, other=T).to(tl.int32)
                else:
                    c = slot * d
                seen = (c[None, :] + l - 1 <= t[:, None]) & ok[None, :] & rows_in[:, None]
                sc = tl.dot(q, tl.trans(kc), input_precision="ieee").to(tl.float32) * scale
                p = tl.where(seen, tl.exp(sc - lse_c[:, None]), 0.0)
                slot_score = tl.dot(agg, p, input_precision="ieee")  # (BTP, slots): the group's sum
                # members in order: the carried ones first, then the step's (as `common.block_scores` adds them)
                score = tl.dot(slot_score, members, tl.where(jn[None, :] == 0, carry[:, None], 0.0),
                               input_precision="ieee")
                carry = tl.sum(tl.where(ss[None, :] >= NB * STRIDE - BEFORE, slot_score, 0.0), 1)
                jj = j0 + jn
                cand = inq[:, None] & (jj[None, :] <= jt[:, None]) & (jj < Ns)[None, :]
                forced = (jj[None, :] == 0) | (jj[None, :] >= jt[:, None] - 1)
                key = tl.where(cand, _pack(tl.where(forced, float("inf"), score), jj[None, :]), _LOWEST)
                if tl.max((tl.max(key, 1) > tl.min(top, 1)).to(tl.int32), 0) > 0:  # one of them enters a top n
                    if NB > NP:
                        key = tl.topk(key, NP)
                    top = tl.topk(tl.reshape(tl.join(top, key), (BTP, 2 * NP)), NP)
            cur = tl.min(tl.where(qlive & (sq > cur), sq, 1 << 30), 0)
        out_at = (bg * Tq + qi) * N
        slots = tl.arange(0, NP)[None, :]
        for n in range(N):  # in order: the largest score first, ties to the lower block
            key = tl.max(tl.where(slots == n, top, _LOWEST), 1)
            real = key > _LOWEST
            at = (-(key & _NONE) + _NONE).to(tl.int32)
            tl.store(IDX + out_at + n, tl.where(real, at, n).to(tl.int64), mask=qlive)  # none: block n, invalid
            tl.store(VALID + out_at + n, real.to(tl.int8), mask=qlive)
            tl.atomic_add(COUNT + bg * T + sq + at * L, 1, mask=qlive & real, sem="relaxed")

    @triton.jit
    def _pack(score, block):
        """(score, block) as one int64 that orders as the score, then the lower block: the float's bits made
        to order as integers (a negative one's magnitude bits flipped), above NONE - block."""
        bits = score.to(tl.int32, bitcast=True)
        ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
        return (ordered.to(tl.int64) << 32) | (-block.to(tl.int64) + _NONE)

    @triton.jit
    def _fwd_win(Q, KW, VW, START, FIRST, OB, LSE, IDX, VALID, OFFSETS, FILL, READERS, ENTRY, sqb, sqt, skwb, skwt,
                 svwb, svwt, sdb, Tq, T, q0, G, H, scale, w, ob_c, st_c, R: tl.constexpr, BT: tl.constexpr,
                 M: tl.constexpr, D: tl.constexpr, L: tl.constexpr, N: tl.constexpr, NP: tl.constexpr,
                 BN: tl.constexpr, DOCS: tl.constexpr, SEL: tl.constexpr, WIN: tl.constexpr):
        """A tile's win attention; and each of its queries enters itself in the reader lists of its chosen blocks
        (READERS[OFFSETS[key] ..], key = (b G + g) T + first key of the block, in the order the atomic adds of
        FILL give), noting each entry's place (ENTRY (B G Tq n), -1 for no block, for `_fwd_mix` and `_bwd_q`)."""
        tile, bg, b, g, mm, i, live, hq, t, s, fs, q, dd, o_off, st_off, t_first, t_last = _tile(
            Q, START, FIRST, Tq, q0, G, H, sqb, sqt, sdb, R, BT, M, D, DOCS)
        if SEL:
            chosen = _chosen(IDX, VALID, bg, i, live, s, Tq, L, N, NP)
            key = bg * T + chosen
            listed = (live & (mm % R == 0))[:, None] & (chosen >= 0)  # a query once (its first head's row)
            e = tl.load(OFFSETS + key, mask=listed, other=0) + tl.atomic_add(FILL + key, 1, mask=listed, sem="relaxed")
            tl.store(READERS + e, i[:, None] + chosen * 0, mask=listed)
            first_head = (live & (mm % R == 0))[:, None] & (tl.arange(0, NP) < N)[None, :]
            tl.store(ENTRY + (bg * Tq + i)[:, None] * N + tl.arange(0, NP)[None, :], tl.where(listed, e, -1),
                     mask=first_head)
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

    @triton.jit
    def _fwd_mix(GATE, O, OB, LSE, VALID, ENTRY, PART, PLSE, sgb, sgt, Tq, G, H, ob_c, st_c, R: tl.constexpr,
                 BT: tl.constexpr, M: tl.constexpr, D: tl.constexpr, N: tl.constexpr, CMP: tl.constexpr,
                 SEL: tl.constexpr, WIN: tl.constexpr):
        """A tile's sel output and logsumexp from its queries' n block outputs (`triton_nsa_sel._fwd_sel`), merged
        by their logsumexps, and the gated sum of the three branches."""
        tile, bg = tl.program_id(0), tl.program_id(1)
        b, g = bg // G, bg % G
        mm = tl.arange(0, M)
        dd = tl.arange(0, D)
        i = tile * BT + mm // R
        live = (mm < BT * R) & (i < Tq)
        hq = g * R + mm % R
        o_off = (b * Tq * H + i * H + hq)[:, None] * D + dd[None, :]
        g_off = b * sgb + i * sgt + hq * 3
        out = tl.zeros([M, D], tl.float32)
        if CMP:
            o_c = tl.load(OB + o_off, mask=live[:, None], other=0.0).to(tl.float32)
            out += tl.load(GATE + g_off, mask=live, other=0.0)[:, None] * o_c
        if SEL:
            m = tl.full([M], float("-inf"), tl.float32)
            total = tl.zeros([M], tl.float32)
            acc = tl.zeros([M, D], tl.float32)
            for n in range(N):
                at = (bg * Tq + i) * N + n
                ok = live & (tl.load(VALID + at, mask=live, other=0) != 0)
                row = tl.load(ENTRY + at, mask=ok, other=0) * R + mm % R
                lse_e = tl.load(PLSE + row, mask=ok, other=float("-inf"))
                m_new = tl.maximum(m, lse_e)
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                alpha, beta = tl.exp(m - m_safe), tl.exp(lse_e - m_safe)
                o_e = tl.load(PART + row[:, None] * D + dd[None, :], mask=ok[:, None], other=0.0)
                m, total, acc = m_new, total * alpha + beta, acc * alpha[:, None] + beta[:, None] * o_e
            o_s, lse_s = _finish(m, total, acc)
            tl.store(OB + ob_c + o_off, o_s.to(OB.dtype.element_ty), mask=live[:, None])
            tl.store(LSE + st_c + b * Tq * H + i * H + hq, lse_s, mask=live)
            out += tl.load(GATE + g_off + 1, mask=live, other=0.0)[:, None] * o_s
        if WIN:
            o_w = tl.load(OB + 2 * ob_c + o_off, mask=live[:, None], other=0.0).to(tl.float32)
            out += tl.load(GATE + g_off + 2, mask=live, other=0.0)[:, None] * o_w
        tl.store(O + o_off, out.to(O.dtype.element_ty), mask=live[:, None])
