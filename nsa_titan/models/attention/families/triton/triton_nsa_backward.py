"""The tile backward kernels of the Triton family's NSA op (the forward ones and the helpers they share:
`triton_nsa.py`; sel's dK, dV, dQ over the inverse index: `triton_nsa_sel.py`, which runs first): gate gradients
and the whole dQ per tile of queries (cmp's and win's, and the sum of sel's per-entry rows), cmp's and the
window's dK, dV per tile of keys. Each key gradient is added once a program into one fp32 buffer (atomic adds:
blocks of two documents, and the cmp branch's segments of queries, may share keys)."""

from __future__ import annotations

from .triton_nsa import triton

if triton is not None:
    import triton.language as tl

    from .triton_nsa import _cmp_seen, _kv, _rows, _tile

    @triton.jit
    def _key_tile(K, V, b, g, j, ok, skb, skt, svb, svt, D: tl.constexpr, N: tl.constexpr):
        """The N keys and values at rows j (0 where not ok), and fp32 accumulators for their gradients."""
        k, v = _kv(K, V, b, g, j, ok, skb, skt, svb, svt, D)
        return k, v, tl.zeros([N, D], tl.float32), tl.zeros([N, D], tl.float32)

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
        """x (keys, D) added into the fp32 gradient buffer at `at` (keys, D): relaxed, no ordering is needed (each
        add is read only after the kernel ends)."""
        tl.atomic_add(GK + at, x, mask=ok[:, None], sem="relaxed")

    @triton.jit
    def _bwd_q(Q, KC, VC, KW, VW, GATE, CSTART, START, FIRST, DO, OB, LSE, DQ, DG, DELTA, ENTRY, DQE,
               sqb, sqt, skcb, skct, svcb, svct, skwb, skwt, svwb, svwt, sgb, sgt, sdb, scb,
               sdob, sdot, Tq, T, Nc, q0, G, H, scale, d, l, w, ob_c, st_c,
               R: tl.constexpr, BT: tl.constexpr, M: tl.constexpr, D: tl.constexpr, BN: tl.constexpr,
               N: tl.constexpr, DOCS: tl.constexpr, CMP: tl.constexpr, SEL: tl.constexpr, WIN: tl.constexpr):
        """A tile's gate gradients and its whole dQ: cmp's and win's, and sel's as the sum of its queries' n entries'
        rows (`_bwd_sel_kv`, through ENTRY: each choice's place, -1 for none); the rows' delta (gate * dO . o) of
        cmp and win for `_bwd_kv`."""
        tile, bg, b, g, mm, i, live, hq, t, s, fs, q, dd, o_off, st_off, t_first, t_last = _tile(
            Q, START, FIRST, Tq, q0, G, H, sqb, sqt, sdb, R, BT, M, D, DOCS)
        do = tl.load(DO + (b * sdob + i * sdot + hq * D)[:, None] + dd[None, :], mask=live[:, None], other=0.0)
        g_off = b * sgb + i * sgt + hq * 3
        dq = tl.zeros([M, D], tl.float32)
        dof = do.to(tl.float32)  # the gate gradients dO . o of the branches summed, 0 for the others
        zero = tl.zeros([M], tl.float32)
        dg_c = tl.sum(dof * tl.load(OB + o_off, mask=live[:, None], other=0.0).to(tl.float32), 1) if CMP else zero
        dg_s = tl.sum(dof * tl.load(OB + ob_c + o_off, mask=live[:, None], other=0.0).to(tl.float32), 1) if SEL \
            else zero
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
        if SEL:  # its dQ: the rows `_bwd_sel_kv` wrote for each of the query's entries
            for n in range(N):
                e = tl.load(ENTRY + (bg * Tq + i) * N + n, mask=live, other=-1)
                dq += tl.load(DQE + (e * R + mm % R)[:, None] * D + dd[None, :], mask=(live & (e >= 0))[:, None],
                              other=0.0)
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
        k, v, dk, dv = _key_tile(K, V, b, g, j, ok, skb, skt, svb, svt, D, BN)
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
