"""The cmp and win branches as Triton kernels (GPU): forward with the sel block scores, backward.

Both branches are softmax attention of every query over a run of keys; only which keys a query
sees differs. Key j of k, v (B, G, S, D) is seen by the query at position t (document start s):
  cmp  the compressed block starting at c_j (j * d, or with documents `Documents.cmp_start`):
       c_j + l - 1 <= t, and with documents c_j >= s;
  win  the key at position j: t - w < j <= t, and with documents j >= s.
The r query heads of a group are rows of one tile: a program holds BM queries as BM * RP rows (r
padded to a power of two), read once, and walks only the key tiles its queries can see (causal
per tile, not per chunk).
  forward   flash attention (online softmax) -> the output and the logsumexp of each row; for
            cmp a second pass turns each tile's scores into probabilities through the logsumexp
            and sums them over the group's heads: the importance scores the group shares (the
            paper's Eq. 10) per compressed block, (B, G, C, S) for a chunk of C queries. The
            per-head probabilities are never written.
  choose    one launch per chunk for `common.choose_blocks` over those scores: each query's sel
            block scores (the sums of their cmp members) and its top n, the same blocks in the
            same order (in PyTorch each chunk's choice was about 35 small ops).
  backward  the probabilities again from the logsumexp, in two kernels without atomics: dQ one
            program per tile of queries, dK and dV one program per tile of keys over the queries
            that can see it.
Used by `fast_shared` when `kernels.py` chooses them (CUDA, the conditions of the Triton sel
kernels); checked on CPU against the reference under TRITON_INTERPRET=1 (tests/test_nsa_triton.py).
"""

from __future__ import annotations

import torch

from . import common
from .common import NSASpec
from .documents import Documents
from .triton_sel import AVAILABLE

BLOCK_N = 64
"""Keys per tile (a power of two >= 16)."""
ROWS = 64
"""Rows (queries x padded heads) per tile."""
DKV_ROWS, DKV_WARPS = 32, 8
"""Rows per step and warps of the dK, dV kernel: 156-190 registers on sm_90 in bf16; with 64 rows the
cmp kernel with documents spills (255 and a 72-byte stack), with 4 warps it takes 252 (test_triton_compile.py)."""
DKV_PROGRAMS, DKV_SEGMENT, DKV_SEGMENT_MAX_D = 1024, 512, 64
"""The cmp dK, dV kernel runs one head a program and splits the queries into segments of at least
DKV_SEGMENT rows until about DKV_PROGRAMS programs run: a slot tile is seen by every later query,
so with all r heads as rows of one program M7C at 8k ran 16 programs, the first 2,048 steps long.
Only for head dims up to DKV_SEGMENT_MAX_D: on an H100 (Triton 3.6) the segmented kernel at D 128 gave
k_cmp gradients 3% off the reference in fp16 and bf16 (T 4097, r 1), one segment 4e-4 (fp16); D 64 was
exact either way. Cause not found (benchmarks/gpu_reports/2026-11-28-h100.md)."""
CHOOSE_SCORES, CHOOSE_WARPS = 4096, 8
"""Block scores (rows x sel blocks, padded to a power of two) and warps per program of the choice: 16 a
thread, 104-128 registers on sm_90 (with 4 warps Triton 3.6 spilled with documents; test_triton_compile.py)."""

if AVAILABLE:
    import triton
    import triton.language as tl

    from .triton_sel import online_step, tile_grads

    @triton.jit
    def _keys(K, V, bg, n0, S, BN: tl.constexpr, D: tl.constexpr):
        """Keys and values (BN, D) j = n0 .. n0 + BN - 1 (0 past S)."""
        j = n0 + tl.arange(0, BN)
        kv_off = bg * S * D + j[:, None] * D + tl.arange(0, D)[None, :]
        return tl.load(K + kv_off, mask=j[:, None] < S, other=0.0), tl.load(V + kv_off, mask=j[:, None] < S, other=0.0)

    @triton.jit
    def _seen(CSTART, b, t, s, live, n0, S, s_cstart, d, l, w, WIN: tl.constexpr, DOCS: tl.constexpr,
              BN: tl.constexpr):
        """Which of the keys n0 .. n0 + BN - 1 each row (position t, document start s; `live`: a
        real row) sees: (rows, BN)."""
        j = n0 + tl.arange(0, BN)
        if WIN:
            seen = (j[None, :] <= t[:, None]) & (j[None, :] > t[:, None] - w)
            if DOCS:
                seen = seen & (j[None, :] >= s[:, None])
        elif DOCS:
            c = tl.load(CSTART + b * s_cstart + j, mask=j < S, other=0)
            seen = (c[None, :] >= s[:, None]) & (c[None, :] + l - 1 <= t[:, None])
        else:
            seen = j[None, :] * d + l - 1 <= t[:, None]
        return seen & (j < S)[None, :] & live[:, None]

    @triton.jit
    def _queries(Q, QSTART, b, bg, row, head, Tq, q0, s_qstart, R: tl.constexpr, DOCS: tl.constexpr,
                 D: tl.constexpr):
        """The rows (query row < Tq, head < R) of q: whether each is real, its position, its
        document start, the offsets of its (B, G, Tq, r, D) entries and the loaded tile."""
        live = (row < Tq) & (head < R)
        t = q0 + row
        if DOCS:
            s = tl.load(QSTART + b * s_qstart + t, mask=row < Tq, other=0)
        else:
            s = t * 0
        off = bg * Tq * R * D + row[:, None] * (R * D) + head[:, None] * D + tl.arange(0, D)[None, :]
        return live, t, s, off, tl.load(Q + off, mask=live[:, None], other=0.0)

    @triton.jit
    def _row_grads(DO, LSE, DELTA, bg, row, head, off, live, Tq, R: tl.constexpr):
        """The rows' d_out tile, logsumexp and delta = d_out . out."""
        stat = bg * Tq * R + row * R + head
        return (tl.load(DO + off, mask=live[:, None], other=0.0), tl.load(LSE + stat, mask=live, other=0.0),
                tl.load(DELTA + stat, mask=live, other=0.0))

    @triton.jit
    def _span(t_first, t_last, S, d, w, WIN: tl.constexpr):
        """The keys [lo, hi) that queries t_first .. t_last may see (the cmp slots visible to t are
        among the first (t + 1) // d, documents.py)."""
        if WIN:
            return tl.maximum(t_first - w + 1, 0), tl.minimum(S, t_last + 1)
        return 0, tl.minimum(S, (t_last + 1) // d)

    @triton.jit
    def _fwd(Q, K, V, CSTART, QSTART, O, LSE, P, scale, Tq, S, a, C, q0, s_cstart, s_qstart, G, d, l, w,
             WIN: tl.constexpr, DOCS: tl.constexpr, R: tl.constexpr, RP: tl.constexpr, BM: tl.constexpr,
             BN: tl.constexpr, D: tl.constexpr):
        """Rows a .. a + C - 1 of q: out, lse; for cmp the group's scores of those rows (B, G, C, S)."""
        bg = tl.program_id(1)  # b * G + g: q, o (B, G, Tq, r, D), lse (B, G, Tq, r), k, v (B, G, S, D)
        b = bg // G
        mm = tl.arange(0, BM * RP)  # row mm: head mm % RP of query row a + first + mm // RP
        first = tl.program_id(0) * BM
        row = tl.where(first + mm // RP < C, a + first + mm // RP, Tq)  # Tq: past the chunk, not a row
        live, t, s, q_off, q = _queries(Q, QSTART, b, bg, row, mm % RP, Tq, q0, s_qstart, R, DOCS, D)
        n_lo, n_hi = _span(q0 + a + first, q0 + a + tl.minimum(C, first + BM) - 1, S, d, w, WIN)
        m = tl.full([BM * RP], float("-inf"), tl.float32)
        total = tl.zeros([BM * RP], tl.float32)
        acc = tl.zeros([BM * RP, D], tl.float32)
        for n0 in range(n_lo, n_hi, BN):
            k, v = _keys(K, V, bg, n0, S, BN, D)
            seen = _seen(CSTART, b, t, s, live, n0, S, s_cstart, d, l, w, WIN, DOCS, BN)
            sc = tl.where(seen, tl.dot(q, tl.trans(k), input_precision="ieee").to(tl.float32) * scale, float("-inf"))
            m, total, acc = online_step(m, total, acc, sc, v)
        has = total > 0  # a row that sees no key: output 0, logsumexp 0
        lse = tl.where(has, m + tl.log(tl.where(has, total, 1.0)), 0.0)
        tl.store(O + q_off, (acc / tl.where(has, total, 1.0)[:, None]).to(O.dtype.element_ty), mask=live[:, None])
        tl.store(LSE + bg * Tq * R + row * R + mm % RP, lse, mask=live)
        if not WIN:  # the group's scores: the probabilities again, summed over the heads
            prow = first + tl.arange(0, BM)
            for n0 in range(n_lo, n_hi, BN):  # past n_hi the scores stay 0
                k, v = _keys(K, V, bg, n0, S, BN, D)
                seen = _seen(CSTART, b, t, s, live, n0, S, s_cstart, d, l, w, WIN, DOCS, BN)
                sc = tl.dot(q, tl.trans(k), input_precision="ieee").to(tl.float32) * scale
                p = tl.where(seen, tl.exp(sc - lse[:, None]), 0.0)
                j = n0 + tl.arange(0, BN)
                tl.store(P + bg * C * S + prow[:, None] * S + j[None, :], tl.sum(tl.reshape(p, (BM, RP, BN)), 1),
                         mask=(prow[:, None] < C) & (j[None, :] < S))

    @triton.jit
    def _bwd_dq(Q, K, V, CSTART, QSTART, DO, LSE, DELTA, DQ, scale, Tq, S, q0, s_cstart, s_qstart, G, d, l, w,
                WIN: tl.constexpr, DOCS: tl.constexpr, R: tl.constexpr, RP: tl.constexpr, BM: tl.constexpr,
                BN: tl.constexpr, D: tl.constexpr):
        bg = tl.program_id(1)
        b = bg // G
        mm = tl.arange(0, BM * RP)
        row = tl.program_id(0) * BM + mm // RP
        live, t, s, q_off, q = _queries(Q, QSTART, b, bg, row, mm % RP, Tq, q0, s_qstart, R, DOCS, D)
        do, lse, delta = _row_grads(DO, LSE, DELTA, bg, row, mm % RP, q_off, live, Tq, R)
        first = q0 + tl.program_id(0) * BM
        n_lo, n_hi = _span(first, tl.minimum(q0 + Tq, first + BM) - 1, S, d, w, WIN)
        dq = tl.zeros([BM * RP, D], tl.float32)
        for n0 in range(n_lo, n_hi, BN):
            k, v = _keys(K, V, bg, n0, S, BN, D)
            seen = _seen(CSTART, b, t, s, live, n0, S, s_cstart, d, l, w, WIN, DOCS, BN)
            _, ds = tile_grads(q, do, k, v, seen, lse, delta, scale, "ieee")
            dq += tl.dot(ds.to(k.dtype), k).to(tl.float32)
        tl.store(DQ + q_off, dq.to(DQ.dtype.element_ty), mask=live[:, None])

    @triton.jit
    def _bwd_dkv(Q, K, V, CSTART, QSTART, DO, LSE, DELTA, DK, DV, scale, Tq, S, q0, s_cstart, s_qstart, G, d, l, w,
                 SEG, WIN: tl.constexpr, DOCS: tl.constexpr, R: tl.constexpr, RP: tl.constexpr, BM: tl.constexpr,
                 BN: tl.constexpr, D: tl.constexpr, HEADS: tl.constexpr, NH: tl.constexpr):
        """Part `pid 2` of dK, dV of the keys n0 .. n0 + BN - 1: the rows of HEADS heads from head
        (part % NH) * HEADS, over the queries that may see the keys and lie in the part's segment of
        SEG query rows (part // NH). Written once into (B, G, parts, S, D); the wrapper sums the parts."""
        bg = tl.program_id(1)
        b = bg // G
        n0 = tl.program_id(0) * BN
        part = tl.program_id(2)
        h0 = (part % NH) * HEADS
        seg0 = (part // NH) * SEG
        # the queries that may see keys n0 .. n0 + BN - 1 (cmp slots are in position order)
        if WIN:
            t_lo, t_hi = n0, n0 + BN + w - 1
        elif DOCS:
            t_lo, t_hi = tl.load(CSTART + b * s_cstart + n0) + l - 1, q0 + Tq
        else:
            t_lo, t_hi = n0 * d + l - 1, q0 + Tq
        r_lo = tl.maximum(tl.maximum(t_lo - q0, 0), seg0)
        r_hi = tl.minimum(tl.minimum(t_hi - q0, Tq), seg0 + SEG)
        mm = tl.arange(0, BM * HEADS)
        head = h0 + mm % HEADS
        k, v = _keys(K, V, bg, n0, S, BN, D)  # read once
        dk = tl.zeros([BN, D], tl.float32)
        dv = tl.zeros([BN, D], tl.float32)
        for m0 in range(r_lo, r_hi, BM):
            row = tl.where(m0 + mm // HEADS < r_hi, m0 + mm // HEADS, Tq)  # Tq: past the segment, not a row
            live, t, s, q_off, q = _queries(Q, QSTART, b, bg, row, head, Tq, q0, s_qstart, R, DOCS, D)
            do, lse, delta = _row_grads(DO, LSE, DELTA, bg, row, head, q_off, live, Tq, R)
            seen = _seen(CSTART, b, t, s, live, n0, S, s_cstart, d, l, w, WIN, DOCS, BN)
            p, ds = tile_grads(q, do, k, v, seen, lse, delta, scale, "ieee")
            dv += tl.dot(tl.trans(p.to(do.dtype)), do).to(tl.float32)
            dk += tl.dot(tl.trans(ds.to(q.dtype)), q).to(tl.float32)
        j = n0 + tl.arange(0, BN)
        out = ((bg * tl.num_programs(2) + part) * S + j[:, None]) * D + tl.arange(0, D)[None, :]
        tl.store(DK + out, dk.to(DK.dtype.element_ty), mask=j[:, None] < S)
        tl.store(DV + out, dv.to(DV.dtype.element_ty), mask=j[:, None] < S)

    @triton.jit
    def _choose(P, START, FIRST, IDX, VALID, rows, C, S, Ns, t0, s_doc, GC, STRIDE: tl.constexpr,
                BEFORE: tl.constexpr, L: tl.constexpr, DOCS: tl.constexpr, N: tl.constexpr, NSP: tl.constexpr,
                BR: tl.constexpr):
        """`common.choose_blocks` of BR rows (b, g, query t0 + c) of a chunk's group scores P (B, G, C, S):
        sel block j's score adds its cmp members, slots j STRIDE - BEFORE .. (j + 1) STRIDE - 1 (from the
        first slot of the query's document with DOCS), in that order; block 0 and the 2 local blocks are
        forced (+inf), blocks past the query no candidates (-inf); then N rounds of the largest score not
        yet taken, ties to the lower block: the first N of a stable descending sort."""
        row = tl.program_id(0) * BR + tl.arange(0, BR)
        live = row < rows
        c = row % C
        t = t0 + c  # the position blocks count from: in its document with DOCS
        first = tl.zeros([BR], tl.int64)
        if DOCS:
            at = (row // GC) * s_doc + t0 + c  # (b, t0 + c) of the documents' (B, T)
            t -= tl.load(START + at, mask=live, other=0)
            first = tl.load(FIRST + at, mask=live, other=0)
        jt = t // L  # the block holding the query
        j = tl.arange(0, NSP)[None, :]
        base = row.to(tl.int64)[:, None] * S
        score = tl.zeros([BR, NSP], tl.float32)
        for k in tl.static_range(STRIDE + BEFORE):
            member = j * STRIDE - BEFORE + k
            slot = first[:, None] + member
            score += tl.load(P + base + slot, mask=live[:, None] & (member >= 0) & (slot < S) & (j < Ns), other=0.0)
        forced = (j == 0) | (j >= jt[:, None] - 1)
        score = tl.where(j > jt[:, None], float("-inf"), tl.where(forced, float("inf"), score))
        taken = tl.broadcast_to(j >= Ns, [BR, NSP])
        for i in tl.static_range(N):
            best = tl.max(tl.where(taken, float("-inf"), score), 1)
            pick = tl.min(tl.where(~taken & (score == best[:, None]), j, NSP), 1)
            tl.store(IDX + row * N + i, pick.to(tl.int64), mask=live)
            tl.store(VALID + row * N + i, (pick <= jt).to(tl.int8), mask=live)
            taken = taken | (j == pick[:, None])


def _geometry(q: torch.Tensor, k: torch.Tensor, kind: str, spec: NSASpec, docs: Documents | None) -> dict:
    """The launch arguments every kernel shares."""
    r = q.shape[3]
    rp = triton.next_power_of_2(r)
    cstart, qstart = (k, q) if docs is None else (docs.cmp_start, docs.start)  # unread without documents
    return dict(CSTART=cstart, QSTART=qstart, scale=q.shape[-1] ** -0.5, Tq=q.shape[2], S=k.shape[2],
                s_cstart=cstart.stride(0), s_qstart=qstart.stride(0), G=q.shape[1], d=spec.d, l=spec.l, w=spec.w,
                WIN=kind == "win", DOCS=docs is not None, R=r, RP=rp, BM=max(1, ROWS // rp), BN=BLOCK_N,
                D=q.shape[-1])


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, kind: str,
            a: int, b: int, q0: int, spec: NSASpec, docs: Documents | None) -> torch.Tensor | None:
    """cmp or win attention of the rows a .. b - 1 of q (B, G, Tq, r, D), the queries at positions
    q0 + a .., against k, v (B, G, S, D). Writes those rows of out (q's shape and dtype) and of the
    fp32 logsumexp lse (B, G, Tq, r); returns, for cmp, the group's scores per compressed block
    (B, G, b - a, S) in fp32 (None for win). All contiguous; head dim a power of two >= 16."""
    B, G = q.shape[:2]
    geo = _geometry(q, k, kind, spec, docs)
    scores = None if kind == "win" else torch.zeros(B, G, b - a, k.shape[2], dtype=torch.float32, device=q.device)
    _fwd[(triton.cdiv(b - a, geo["BM"]), B * G)](q, k, v, O=out, LSE=lse, P=scores if scores is not None else lse,
                                                 a=a, C=b - a, q0=q0, **geo)
    return scores


def choose_blocks(group: torch.Tensor, spec: NSASpec, t0: int, T: int, docs: Documents | None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """`common.choose_blocks` of `forward`'s group scores (B, G, C, S) of the queries t0 .. t0 + C - 1 in one
    launch (`_choose`), where l and l' are multiples of d (else in PyTorch): the same blocks in the same order."""
    if not spec.strided_members():
        return common.choose_blocks(group, spec, t0, T, docs)
    B, G, C, S = group.shape
    Ns = spec.num_sel_blocks(T)
    n = min(spec.n, Ns)
    idx = torch.empty(B, G, C, n, dtype=torch.long, device=group.device)
    valid = torch.empty(B, G, C, n, dtype=torch.bool, device=group.device)
    start, first = (group, group) if docs is None else (docs.start, docs.first_slot)  # unread without documents
    nsp = triton.next_power_of_2(Ns)
    br = max(1, CHOOSE_SCORES // nsp)
    _choose[(triton.cdiv(B * G * C, br),)](group.contiguous(), start, first, idx, valid.view(torch.int8), B * G * C,
                                           C, S, Ns, t0, start.stride(0), G * C, STRIDE=spec.l_sel // spec.d,
                                           BEFORE=spec.l // spec.d - 1, L=spec.l_sel, DOCS=docs is not None, N=n,
                                           NSP=nsp, BR=br, num_warps=CHOOSE_WARPS)
    return idx, valid


def backward(d_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
             lse: torch.Tensor, kind: str, q0: int, spec: NSASpec, docs: Documents | None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients (dq, dk, dv) of `forward`'s out (all rows) with its logsumexp."""
    B, G = q.shape[:2]
    geo = _geometry(q, k, kind, spec, docs)
    delta = (d_out.float() * out.float()).sum(-1).contiguous()  # (B, G, Tq, r)
    dq = torch.empty_like(q)
    _bwd_dq[(triton.cdiv(q.shape[2], geo["BM"]), B * G)](q, k, v, DO=d_out, LSE=lse, DELTA=delta, DQ=dq, q0=q0, **geo)
    Tq, S, r, rp = q.shape[2], k.shape[2], q.shape[3], geo["RP"]
    if kind == "cmp":  # one head a program, the queries in segments: parts summed below
        heads, nh, geo["BM"] = 1, r, DKV_ROWS
        programs = max(1, triton.cdiv(S, BLOCK_N) * B * G * r)
        segments = min(triton.cdiv(DKV_PROGRAMS, programs), Tq // DKV_SEGMENT) if q.shape[-1] <= DKV_SEGMENT_MAX_D else 1
        seg = triton.cdiv(Tq, max(1, segments))
    else:  # win: a tile's queries are its C + w - 1, all r heads as rows of one program
        heads, nh, geo["BM"], seg = rp, 1, max(1, DKV_ROWS // rp), Tq
    seg = triton.cdiv(seg, geo["BM"]) * geo["BM"]
    n_parts = triton.cdiv(Tq, seg) * nh
    if n_parts == 1:
        dk, dv = torch.empty_like(k), torch.empty_like(v)
    else:
        dk, dv = torch.empty(2, B, G, n_parts, S, k.shape[-1], dtype=torch.float32, device=k.device)
    _bwd_dkv[(triton.cdiv(S, BLOCK_N), B * G, n_parts)](q, k, v, DO=d_out, LSE=lse, DELTA=delta, DK=dk, DV=dv, q0=q0,
                                                       SEG=seg, HEADS=heads, NH=nh, num_warps=DKV_WARPS, **geo)
    if n_parts > 1:
        dk, dv = dk.sum(2).to(k.dtype), dv.sum(2).to(v.dtype)
    return dq, dk, dv
