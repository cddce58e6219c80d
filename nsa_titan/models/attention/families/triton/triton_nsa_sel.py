"""The sel branch of the Triton family's NSA op over the inverse index (key block -> the queries that chose it),
forward and backward: a program takes an equal span of the index (all blocks' readers end to end, `_fwd_win`
writes them), loads the keys of each block it reaches once and gathers the block's readers there, BT queries x
all r heads of the group as the rows of one tensor-core tile. Equal spans: the first block, which every query
reads, is shared among Tq / span programs instead of walked by one.
  `_fwd_sel`: each reader's output and logsumexp over the block, per entry of the index (`_fwd_mix` combines
      a query's n entries);
  `_bwd_sel_kv`: dK, dV of each block (added once a program into the fp32 gradient buffer) and each entry's
      dQ rows (written once, no atomics: `_bwd_q` sums a query's n of them).
"""

from __future__ import annotations

from .triton_nsa import triton

if triton is not None:
    import triton.language as tl

    from .triton_nsa import _kv
    from .triton_nsa_backward import _add, _grads, _key_tile

    @triton.jit
    def _block_at(OFFSETS, e, e_end, blocks, T, G, L: tl.constexpr, STEPS: tl.constexpr):
        """The block whose readers hold entry e of the inverse index, found by a binary search for the last x
        ((b G + g) T + the block's first key) with OFFSETS[x] <= e (the `blocks` offsets, then the total): the
        end of its entries in the span (<= e_end), b, g and its key positions (L)."""
        lo = e * 0
        hi = lo + blocks
        for _ in tl.static_range(STEPS):
            mid = (lo + hi) // 2
            go = tl.load(OFFSETS + mid) <= e
            lo = tl.where(go, mid, lo)
            hi = tl.where(go, hi, mid)
        return tl.minimum(tl.load(OFFSETS + lo + 1), e_end), lo // T // G, lo // T % G, lo % T + tl.arange(0, L)

    @triton.jit
    def _span(OFFSETS, blocks, SPAN):
        """The entries [e0, e_end) of this program's span."""
        e0 = tl.program_id(0) * SPAN
        return e0, tl.minimum(e0 + SPAN, tl.load(OFFSETS + blocks))

    @triton.jit
    def _readers(Q, READERS, e1, last, b, g, pos, q0, sqb, sqt, R: tl.constexpr, BT: tl.constexpr,
                 M: tl.constexpr, D: tl.constexpr):
        """The rows of entries e1 .. e1 + BT - 1 (< last: live), all r heads of each: row index mm, entry e, query
        row i, head hq, live, q (M, D), and which keys of the block at `pos` each row reads (causal)."""
        mm = tl.arange(0, M)
        e = e1 + mm // R
        live = (mm < BT * R) & (e < last)
        i = tl.load(READERS + e, mask=live, other=0)
        hq = g * R + mm % R
        q = tl.load(Q + (b * sqb + i * sqt + hq * D)[:, None] + tl.arange(0, D)[None, :], mask=live[:, None],
                    other=0.0)
        return mm, e, i, hq, live, q, live[:, None] & (pos[None, :] <= q0 + i[:, None])

    @triton.jit
    def _fwd_sel(Q, KS, VS, OFFSETS, READERS, PART, PLSE, sqb, sqt, sksb, skst, svsb, svst, T, q0, G, scale, blocks,
                 SPAN, R: tl.constexpr, BT: tl.constexpr, M: tl.constexpr, D: tl.constexpr, L: tl.constexpr,
                 STEPS: tl.constexpr):
        """sel attention of the span's entries: each reader's rows against its block's keys, the block's output
        and logsumexp per entry (PART (entries, r, D) fp32, PLSE (entries, r))."""
        e0, e_end = _span(OFFSETS, blocks, SPAN)
        dd = tl.arange(0, D)
        while e0 < e_end:
            last, b, g, pos = _block_at(OFFSETS, e0, e_end, blocks, T, G, L, STEPS)
            k, v = _kv(KS, VS, b, g, pos, pos < T, sksb, skst, svsb, svst, D)
            for e1 in range(e0, last, BT):
                mm, e, i, hq, live, q, reads = _readers(Q, READERS, e1, last, b, g, pos, q0, sqb, sqt, R, BT, M, D)
                sc = tl.where(reads, tl.dot(q, tl.trans(k)).to(tl.float32) * scale, float("-inf"))
                m = tl.where(live, tl.max(sc, 1), 0.0)  # a live row reads the block's first key at least
                p = tl.exp(sc - m[:, None])
                total = tl.where(live, tl.sum(p, 1), 1.0)
                at = e * R + mm % R
                tl.store(PART + at[:, None] * D + dd[None, :],
                         tl.dot(p.to(v.dtype), v).to(tl.float32) / total[:, None], mask=live[:, None])
                tl.store(PLSE + at, m + tl.log(total), mask=live)
            e0 = last

    @triton.jit
    def _bwd_sel_kv(Q, KS, VS, GATE, DO, OB, LSE, GK, DQE, OFFSETS, READERS, sqb, sqt, sksb, skst, svsb, svst, sgb,
                    sgt, sdob, sdot, Tq, T, q0, G, H, scale, ob_c, st_c, gk_ks, gk_vs, blocks, SPAN, R: tl.constexpr,
                    BT: tl.constexpr, M: tl.constexpr, D: tl.constexpr, L: tl.constexpr, STEPS: tl.constexpr):
        """sel's dK, dV and dQ of the span's entries: for each block, its readers there BT at a time, the block's
        keys loaded once; each entry's dQ rows written to DQE (entries, r, D) fp32, the block's dK, dV sums added
        once. A row's delta (gate * dO . o_sel) is taken here, from sel's merged output."""
        e0, e_end = _span(OFFSETS, blocks, SPAN)
        dd = tl.arange(0, D)
        while e0 < e_end:
            last, b, g, pos = _block_at(OFFSETS, e0, e_end, blocks, T, G, L, STEPS)
            ok = pos < T
            k, v, dk, dv = _key_tile(KS, VS, b, g, pos, ok, sksb, skst, svsb, svst, D, L)
            for e1 in range(e0, last, BT):
                mm, e, i, hq, live, q, reads = _readers(Q, READERS, e1, last, b, g, pos, q0, sqb, sqt, R, BT, M, D)
                do = tl.load(DO + (b * sdob + i * sdot + hq * D)[:, None] + dd[None, :], mask=live[:, None],
                             other=0.0)
                st_off = b * Tq * H + i * H + hq
                gate = tl.load(GATE + b * sgb + i * sgt + hq * 3 + 1, mask=live, other=0.0)
                lse = tl.load(LSE + st_c + st_off, mask=live, other=0.0)
                o = tl.load(OB + ob_c + st_off[:, None] * D + dd[None, :], mask=live[:, None], other=0.0)
                delta = gate * tl.sum(do.to(tl.float32) * o.to(tl.float32), 1)
                p, ds = _grads(q, do, k, v, reads, lse, gate, delta, scale, None)
                dv += tl.dot(tl.trans((p * gate[:, None]).to(do.dtype)), do).to(tl.float32)
                dk += tl.dot(tl.trans(ds.to(q.dtype)), q).to(tl.float32)
                tl.store(DQE + (e * R + mm % R)[:, None] * D + dd[None, :], tl.dot(ds.to(k.dtype), k).to(tl.float32),
                         mask=live[:, None])
            at = (b * T + pos)[:, None] * (G * D) + g * D + dd[None, :]
            _add(GK + gk_ks, at, dk, ok)
            _add(GK + gk_vs, at, dv, ok)
            e0 = last
