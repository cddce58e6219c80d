"""The sel branch of the fast path (`selected_forward`, `selected_backward`): each (query, KV group)
reads its own n blocks of l' keys.

In three dense parts per chunk of queries. The forced blocks need no gather: the block holding t
and the one before are one (l' * r) x 2l' product per query block, block 0 one product for all
queries past the second block. The blocks chosen by score are block-centric: the (query, group)
-> block choices are sorted by block and cut into tiles of R queries sharing one block, so a tile
is a dense (R * r) x D @ D x l' product over a block loaded once for all the group's heads (the
paper's group-centric sharing); what gets gathered is R query rows per block, not l' x D keys per
query. Tile counts have a static bound (`_tile_bound`: each query's own number of choices, or the
host bounds of its documents): no host sync, no data-dependent shapes.

On CPUs and CUDA devices each part (tiles, loc, ini) is one call of ATen's fused attention kernel
(`fused_attention.py`); the forward merges the parts by their logsumexps, the backward hands each
part the rows' whole output and logsumexp. Elsewhere the same steps run as separate ops, with the
row maxima of all parts first and one exp per score.
"""

from __future__ import annotations

import torch

from ...documents import ChunkBounds
from ...spec import N_FORCED_INITIAL, N_FORCED_LOCAL, NSASpec
from . import fused_attention

CHUNK_SEL = 4096
"""Most queries per sel chunk: bounds the gathered rows (C x n x heads x D per KV group)."""
SEL_CHUNKS = 4
"""A sequence's queries are cut into at least this many sel chunks while they keep CHUNK_SEL / 2
queries or more (short sequences keep one chunk); a part of the queries (context parallelism) is cut
into as many chunks as the whole sequence, so the chunks' working memory shrinks with a rank's share
of the sequence instead of staying at its largest."""
TILE = 32
"""R: queries per sel tile (one block each)."""


def _tiles(kpos: torch.Tensor, use: torch.Tensor, t0: int, NT: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tiles of the (query, group) -> block choices of queries t0 .. t0 + C - 1, each block named
    by its first key `kpos` (B, G, C, n'), where `use` (same shape) is True; a used block lies
    wholly before t0 + C. NT: a bound on the tiles (`_tile_bound`).

    Returns rows (NT, R): each lane's chunk-local query row (b*G + g)*C + c, or the dummy row
    B*G*C for an empty lane; bg, kpos (NT,): the (batch, group) and the first key of the block
    shared by the tile.
    """
    B, G, C, n = kpos.shape
    R, dev = TILE, kpos.device
    t1 = t0 + C
    K, P = B * G * t1, B * G * C * n
    bg = torch.arange(B * G, device=dev).view(B, G, 1, 1)
    key = torch.where(use, bg * t1 + kpos, K).flatten()  # (P,): the block, K when not used
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
    return rows, block // t1, block % t1


def _scored_before(t: int, L: int, m: int) -> int:
    """The choices by score of the queries 0 .. t - 1 of one document: sum of min(m, max(0, jt - 2))."""
    jb, rem = divmod(t, L)
    a = max(0, jb - 3)  # the whole blocks jt = 3 .. jb - 1 give 1 .. a choices each (capped at m)
    whole = a * (a + 1) // 2 if a <= m else m * (m + 1) // 2 + (a - m) * m
    return whole * L + rem * min(m, max(0, jb - 2))


def _tile_bound(t0: int, t1: int, B: int, G: int, per_query: int, spec: NSASpec, docs: bool,
                bounds: ChunkBounds | None) -> int:
    """NT, a static bound on the tiles of the queries t0 .. t1 - 1: ceil(choices / R) + blocks, where
    each block used leaves at most one tile part-filled. A query chooses by score at most
    min(per_query, jt - 2) blocks, of blocks 1 .. jt - 2 (jt: the block holding t, in its document):
    counted exactly without documents or with host `bounds`; with documents but no bounds, at most
    per_query per query, of all the blocks before t1."""
    if bounds is not None:
        choices, blocks = (G * x for x in bounds.scored_choices(t0, t1))
    elif docs:
        choices, blocks = B * G * (t1 - t0) * per_query, B * G * ((t1 - 1) // spec.l_sel + 1)
    else:
        L = spec.l_sel
        choices = B * G * (_scored_before(t1, L, per_query) - _scored_before(t0, L, per_query))
        blocks = B * G * max(0, (t1 - 1) // L - 2)
    return -(-choices // TILE) + min(choices, blocks)


def _with_dummy(x: torch.Tensor) -> torch.Tensor:
    """(BG, C, r, ...) -> (BG*C + 1, r, ...) with a trailing zero row for empty lanes."""
    x = x.reshape(-1, *x.shape[2:])
    return torch.cat([x, x.new_zeros(1, *x.shape[1:])])


def _pad_blocks(x: torch.Tensor, nb: int, L: int) -> torch.Tensor:
    """(BG, C, ...) -> (BG, nb * L, ...), zero rows after C."""
    pad = x.new_zeros(x.shape[0], nb * L - x.shape[1], *x.shape[2:])
    return torch.cat([x, pad], 1)


PAD_BLOCKS = 2
"""Zero blocks before block 0 in the key-block layout: the local window reaches back to block -2."""


class _SelChunk:
    """The selected keys of queries t0 .. t1 - 1 (t0 a multiple of l'), in three dense parts:
      tiles: the blocks chosen by score (0 < j <= jt - 2: wholly in the past, no mask);
      loc:   the block holding t and the one before (jt - 1, jt), causal: per query block of l'
             one (l' * r) x nloc*l' product over the nloc blocks of keys that can hold them (2;
             3 with documents, whose blocks need not align with the query blocks), no gather;
      ini:   block 0 of the document for queries with jt >= 2 (before that it is one of the
             local blocks): per query block one (l' * r) x l' product, since all queries of a
             query block with jt >= 2 lie in the document its first query is in.
    Scores are of queries scaled by D^-1/2; masked entries are -inf."""

    def __init__(self, qs: torch.Tensor, kbp: torch.Tensor, idx: torch.Tensor, valid: torch.Tensor,
                 t0: int, spec: NSASpec, start: torch.Tensor | None, bounds: ChunkBounds | None):
        BG, C, r, D = qs.shape  # qs (BG, C, r, D); kbp (BG, 2 + Ns, L, D): block j at 2 + j
        L, B = spec.l_sel, idx.shape[0]
        self.B, self.BG, self.C, self.r, self.D, self.L = B, BG, C, r, D, L
        self.j0, self.nb = t0 // L, -(-C // L)
        self.nloc = 2 if start is None else 3
        dev = qs.device
        t = torch.arange(t0, t0 + self.nb * L, device=dev)[None, :]  # padded to whole query blocks
        s = torch.zeros_like(t) if start is None else torch.cat([start, t[:, C:].expand(B, -1)], 1)
        jt = (t - s) // L  # (B or 1, nb * L): the block holding t, counted in its document
        # tiles
        jq = jt[:, None, :C, None]
        scored = valid & (idx > 0) & (idx < jq - 1)  # (B, G, C, n')
        per_query = max(0, idx.shape[-1] - N_FORCED_LOCAL - N_FORCED_INITIAL)
        NT = _tile_bound(t0, t0 + C, B, idx.shape[1], per_query, spec, start is not None, bounds)
        self.rows, bg, kpos = _tiles(s[:, None, :C, None] + idx * L, scored, t0, NT)
        first = (bg * kbp.shape[1] + PAD_BLOCKS) * L + kpos  # (NT,): row of the block's first key
        self.key_rows = (first[:, None] + torch.arange(L, device=dev)).flatten()  # (NT * L,)
        self.qt = self.tile_rows(qs)  # (NT, R * r, D)
        self.kt = self.tile_keys(kbp)  # (NT, L, D)
        # loc: query block b against the keys of blocks j0 + b - nloc + 1 .. j0 + b, those from the
        # first key of block jt - 1 (of t's document, not before it) to t.
        self.q_loc = _pad_blocks(qs, self.nb, L).view(BG * self.nb, L * r, D)
        self.k_loc = self.local_keys(kbp)
        key = (torch.arange(self.nb, device=dev)[:, None, None] + self.j0 - self.nloc + 1) * L \
            + torch.arange(self.nloc * L, device=dev)  # (nb, 1, nloc * L)
        lo = (s + (jt - 1).clamp(min=0) * L).view(-1, self.nb, L, 1)
        self.ok = (key >= lo) & (key <= t.view(1, self.nb, L, 1))  # (B or 1, nb, L, nloc * L)
        # ini: block 0 of the document of each query block's first query, for its rows with jt >= 2.
        self.ini_rows = None  # without documents block 0 is the same for every query block
        if start is not None:
            first = s.view(-1, self.nb, L)[:, :, 0]  # (B, nb)
            bgs = torch.arange(BG, device=dev).view(B, -1, 1)  # (B, G, 1)
            rows = (bgs * kbp.shape[1] + PAD_BLOCKS) * L + first[:, None, :]  # (B, G, nb)
            self.ini_rows = (rows[..., None] + torch.arange(L, device=dev)).flatten()  # (BG * nb * L,)
        self.k_ini = self.initial_keys(kbp)
        self.late = (jt >= 2).view(-1, 1, self.nb, L, 1, 1)

    def scores(self) -> None:
        """The scores of the three parts: s_t (NT, R, r, L), s_loc (BG, nb, L, r, nloc * L) and
        s_ini (BG, nb, L, r, L)."""
        B, BG, nb, L, r = self.B, self.BG, self.nb, self.L, self.r
        self.s_t = (self.qt @ self.kt.transpose(1, 2)).view(*self.rows.shape, r, L)
        s_loc = (self.q_loc @ self.k_loc.transpose(1, 2)).view(B, -1, nb, L, r, self.nloc * L)
        self.s_loc = s_loc.masked_fill_(~self.ok[:, None, :, :, None], float("-inf")).view(BG, nb, L, r, -1)
        s_ini = (self.q_loc @ self.k_ini.transpose(1, 2)).view(B, -1, nb, L, r, L)
        self.s_ini = s_ini.masked_fill_(~self.late, float("-inf")).view(BG, nb, L, r, L)

    def biases(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The masks of the loc and ini parts as the fused kernels' biases, (BG * nb, 1, L * r, nloc * L)
        and (BG * nb, 1, L * r, L)."""
        rows = (self.B, self.BG // self.B, self.nb, self.L, self.r)
        return (fused_attention.bias_rows(self.ok[:, None, :, :, None], (*rows, self.nloc * self.L), dtype),
                fused_attention.bias_rows(self.late, (*rows, self.L), dtype))

    def local_keys(self, xbp: torch.Tensor) -> torch.Tensor:
        """(BG * nb, nloc * L, D): for query block b, blocks j0 + b - nloc + 1 .. j0 + b of xbp."""
        base = self.j0 + PAD_BLOCKS - self.nloc + 1
        return torch.cat([xbp[:, base + i:base + i + self.nb] for i in range(self.nloc)], 2).flatten(0, 1)

    def initial_keys(self, xbp: torch.Tensor) -> torch.Tensor:
        """(BG * nb, L, D): for query block b, block 0 of its first query's document."""
        if self.ini_rows is None:
            return xbp[:, PAD_BLOCKS, None].expand(-1, self.nb, -1, -1).reshape(-1, self.L, xbp.shape[-1])
        return xbp.view(-1, xbp.shape[-1]).index_select(0, self.ini_rows).view(-1, self.L, xbp.shape[-1])

    def scatter_initial(self, dxbp: torch.Tensor, d_ini: torch.Tensor) -> None:
        """Adds a (BG * nb, L, D) gradient of `initial_keys` into dxbp (BG, 2 + Ns, L, D)."""
        if self.ini_rows is None:
            dxbp[:, PAD_BLOCKS] += d_ini.view(self.BG, self.nb, self.L, -1).sum(1)
        else:
            dxbp.view(-1, dxbp.shape[-1]).index_add_(0, self.ini_rows, d_ini.view(-1, dxbp.shape[-1]))

    def tile_rows(self, x: torch.Tensor) -> torch.Tensor:
        """(BG, C, r, ...) -> (NT, R * r, ...): the rows of each tile's lanes (dummy lanes: zeros)."""
        NT, R = self.rows.shape
        return _with_dummy(x).index_select(0, self.rows.flatten()).view(NT, R * x.shape[2], *x.shape[3:])

    def tile_keys(self, xbp: torch.Tensor) -> torch.Tensor:
        """(NT, L, D): the block of each tile, from the key-block layout xbp (BG, 2 + Ns, L, D)."""
        D = xbp.shape[-1]
        return xbp.view(-1, D).index_select(0, self.key_rows).view(self.rows.shape[0], self.L, D)

    def per_lane(self, x: torch.Tensor) -> torch.Tensor:
        """Row statistics (BG, C, r) -> (NT, R, r, 1) for the tiles' lanes (dummy lanes: 0)."""
        NT, R = self.rows.shape
        return self.tile_rows(x).view(NT, R, self.r, 1)

    def per_loc(self, x: torch.Tensor) -> torch.Tensor:
        """(BG, C, r, ...) -> (BG, nb, L, r, ...) zero-padded, the loc layout."""
        return _pad_blocks(x, self.nb, self.L).view(self.BG, self.nb, self.L, *x.shape[2:])

    def scatter_local(self, dxbp: torch.Tensor, d_loc: torch.Tensor) -> None:
        """Adds a (BG * nb, nloc * L, D) local-key gradient into dxbp (BG, 2 + Ns, L, D)."""
        base, nb, L = self.j0 + PAD_BLOCKS - self.nloc + 1, self.nb, self.L
        d_loc = d_loc.view(self.BG, nb, self.nloc * L, -1)
        for i in range(self.nloc):
            dxbp[:, base + i:base + i + nb] += d_loc[:, :, i * L:(i + 1) * L]


def _key_blocks(x: torch.Tensor, L: int) -> torch.Tensor:
    """(B, G, T, D) -> (B*G, 2 + Ns, L, D): two zero blocks, then the key blocks (zero-padded past T)."""
    B, G, T, D = x.shape
    Ns = -(-T // L)
    x = torch.nn.functional.pad(x.reshape(B * G, T, D), (0, 0, PAD_BLOCKS * L, Ns * L - T))
    return x.view(B * G, PAD_BLOCKS + Ns, L, D)


def _sel_chunks(Tq: int, T: int, L: int) -> range:
    """Chunk starts for Tq of the T queries: the whole sequence's chunk (T / SEL_CHUNKS queries,
    within CHUNK_SEL / 2 .. CHUNK_SEL) scaled by Tq / T, rounded to whole blocks of l'."""
    C = min(CHUNK_SEL, max(CHUNK_SEL // 2, T // SEL_CHUNKS)) * Tq // T
    return range(0, Tq, max(L, C // L * L))


def _each_chunk(qs: torch.Tensor, kbp: torch.Tensor, idx: torch.Tensor, valid: torch.Tensor, spec: NSASpec,
                start: torch.Tensor | None, q0: int, bounds: ChunkBounds | None, T: int):
    """(t0, t1, `_SelChunk`) for each sel chunk of the queries qs (BG, Tq, r, D) of a sequence of T."""
    chunks = _sel_chunks(qs.shape[1], T, spec.l_sel)
    for t0 in chunks:
        t1 = min(qs.shape[1], t0 + chunks.step)
        yield t0, t1, _SelChunk(qs[:, t0:t1], kbp, idx[:, :, t0:t1], valid[:, :, t0:t1], q0 + t0, spec,
                                None if start is None else start[:, t0:t1], bounds)


def _forward_fused(ch: _SelChunk, vbp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk through the fused kernels (CPUs), a part at a time, merged by their logsumexps:
    out (BG, C, r, D) and logsumexp (BG, C, r)."""
    BG, C, r, D = ch.BG, ch.C, ch.r, ch.D
    NT, lanes = ch.rows.shape[0], ch.rows.flatten()
    bias_loc, bias_ini = ch.biases(vbp.dtype)
    o_loc, m_loc = fused_attention.attend(ch.q_loc, ch.k_loc, ch.local_keys(vbp), bias_loc, 1.0)
    o_ini, m_ini = fused_attention.attend(ch.q_loc, ch.k_ini, ch.initial_keys(vbp), bias_ini, 1.0)
    m_ini = m_ini.masked_fill(~ch.late.expand(ch.B, BG // ch.B, -1, -1, r, -1).reshape(m_ini.shape), float("-inf"))
    m_loc, m_ini = (x.view(BG, -1, r)[:, :C] for x in (m_loc, m_ini))  # no keys: logsumexp -inf
    m = torch.maximum(m_loc, m_ini)  # finite: key t is always read
    if NT:
        o_t, m_t = fused_attention.attend(ch.qt, ch.kt, ch.tile_keys(vbp), None, 1.0)  # (NT, R*r, D), (NT, R*r)
        m_t = m_t.view(-1, r)
        big = m_t.new_full((BG * C + 1, r), float("-inf")).scatter_reduce_(0, lanes[:, None].expand(-1, r), m_t, "amax")
        m = torch.maximum(m, big[:-1].view(BG, C, r))
    w_loc, w_ini = (x.sub(m).exp_() for x in (m_loc, m_ini))
    total = w_loc + w_ini
    o = o_loc.view(BG, -1, r, D)[:, :C] * w_loc[..., None] + o_ini.view(BG, -1, r, D)[:, :C] * w_ini[..., None]
    if NT:
        w_t = m_t.sub_(ch.tile_rows(m).view(-1, r)).exp_()  # (NT * R, r)
        total += total.new_zeros(BG * C + 1, r).index_add_(0, lanes, w_t)[:-1].view(BG, C, r)
        o_t = o_t.view(-1, r, D).mul_(w_t[..., None])
        o += o.new_zeros(BG * C + 1, r, D).index_add_(0, lanes, o_t)[:-1].view(BG, C, r, D)
    return o.div_(total[..., None]), m + torch.log(total)


def _forward_ops(ch: _SelChunk, vbp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`_forward_fused` as separate ops (other devices): row maxima over all three parts, then one
    exp per score."""
    BG, C, r, D, L, nb = ch.BG, ch.C, ch.r, ch.D, ch.L, ch.nb
    NT, lanes = ch.rows.shape[0], ch.rows.flatten()
    ch.scores()
    m = ch.s_t.new_full((BG * C + 1, r), float("-inf"))
    m = m.scatter_reduce_(0, lanes[:, None].expand(-1, r), ch.s_t.amax(-1).view(-1, r), "amax")
    m = torch.maximum(m[:-1].view(BG, C, r), ch.s_loc.amax(-1).view(BG, -1, r)[:, :C])
    m = torch.maximum(m, ch.s_ini.amax(-1).view(BG, -1, r)[:, :C])  # finite: key t is always read
    e_t = ch.s_t.sub_(ch.per_lane(m)).exp_()
    e_loc = ch.s_loc.sub_(ch.per_loc(m)[..., None]).exp_()
    e_ini = ch.s_ini.sub_(ch.per_loc(m)[..., None]).exp_()
    total = torch.zeros(BG * C + 1, r, dtype=m.dtype, device=m.device).index_add_(0, lanes, e_t.sum(-1).view(-1, r))
    total = total[:-1].view(BG, C, r) + e_loc.sum(-1).view(BG, -1, r)[:, :C]
    total += e_ini.sum(-1).view(BG, -1, r)[:, :C]
    vt = ch.tile_keys(vbp)
    o = (e_t.view(NT, TILE * r, L) @ vt).view(-1, r, D)
    o = vbp.new_zeros(BG * C + 1, r, D).index_add_(0, lanes, o)[:-1].view(BG, C, r, D)
    o += (e_loc.view(BG * nb, -1, ch.nloc * L) @ ch.local_keys(vbp)).view(BG, -1, r, D)[:, :C]
    o += (e_ini.view(BG * nb, -1, L) @ ch.initial_keys(vbp)).view(BG, -1, r, D)[:, :C]
    return o / total[..., None], m + torch.log(total)


def selected_forward(q: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor, idx: torch.Tensor, valid: torch.Tensor,
                     spec: NSASpec, start: torch.Tensor | None, q0: int, bounds: ChunkBounds | None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """sel attention: each (query, group) reads its own n blocks of l' keys (see the module doc).
    q (B, G, Tq, r, D): the queries at q0 .. q0 + Tq - 1 (q0 a multiple of l'); ks, vs (B, G, T, D) of
    the whole sequence; idx, valid (B, G, Tq, n'); start (B, Tq): each query's document start (None:
    one document), bounds: the documents' host bounds (or None) -> out (B, G, Tq, r, D) and the
    logsumexp of each (query, head) (B, G, Tq, r), what the backward needs."""
    B, G, Tq, r, D = q.shape
    kbp, vbp = _key_blocks(ks, spec.l_sel), _key_blocks(vs, spec.l_sel)
    qs = q.reshape(B * G, Tq, r, D) * D**-0.5
    out, lse = torch.empty_like(q), q.new_empty(B, G, Tq, r)
    forward = _forward_fused if fused_attention.fused(q) else _forward_ops
    for t0, t1, ch in _each_chunk(qs, kbp, idx, valid, spec, start, q0, bounds, ks.shape[2]):
        o, ls = forward(ch, vbp)
        out[:, :, t0:t1] = o.view(B, G, -1, r, D)
        lse[:, :, t0:t1] = ls.view(B, G, -1, r)
    return out, lse


def _backward_fused(ch: _SelChunk, do: torch.Tensor, out: torch.Tensor, ls: torch.Tensor, vbp: torch.Tensor,
                    dkbp: torch.Tensor, dvbp: torch.Tensor) -> torch.Tensor:
    """One chunk's gradients through the fused kernels (CPUs), a part at a time from the rows' whole
    output `out` (BG, C, r, D) and logsumexp `ls` (BG, C, r): dk, dv added into dkbp, dvbp; returns
    the gradient (BG, C, r, D) of the scaled queries."""
    BG, C, r, D, nb = ch.BG, ch.C, ch.r, ch.D, ch.nb
    NT, lanes = ch.rows.shape[0], ch.rows.flatten()
    dqc = do.new_zeros(BG * C + 1, r, D)
    if NT:  # tiles: each one block's keys for R queries (dummy lanes: zero rows, zero d_out)
        lse_t = ch.per_lane(ls).view(NT, TILE * r)
        dq, dk, dv = fused_attention.attend_backward(ch.tile_rows(do), ch.qt, ch.kt, ch.tile_keys(vbp),
                                                     ch.tile_rows(out), lse_t, None, 1.0)
        dkbp.view(-1, D).index_add_(0, ch.key_rows, dk.view(-1, D))
        dvbp.view(-1, D).index_add_(0, ch.key_rows, dv.view(-1, D))
        dqc.index_add_(0, lanes, dq.reshape(-1, r, D))
    dqc = dqc[:-1].view(BG, C, r, D)
    # loc and ini: per query block of l', its local blocks and its block 0
    bias_loc, bias_ini = ch.biases(do.dtype)
    do_b, out_b = (ch.per_loc(x).reshape(BG * nb, -1, D) for x in (do, out))
    ls_b = ch.per_loc(ls).reshape(BG * nb, -1)
    dq, dk, dv = fused_attention.attend_backward(do_b, ch.q_loc, ch.k_loc, ch.local_keys(vbp), out_b, ls_b,
                                                 bias_loc, 1.0)
    ch.scatter_local(dkbp, dk)
    ch.scatter_local(dvbp, dv)
    dqc += dq.view(BG, -1, r, D)[:, :C]
    dq, dk, dv = fused_attention.attend_backward(do_b, ch.q_loc, ch.k_ini, ch.initial_keys(vbp), out_b, ls_b,
                                                 bias_ini, 1.0)
    ch.scatter_initial(dkbp, dk)
    ch.scatter_initial(dvbp, dv)
    return dqc + dq.view(BG, -1, r, D)[:, :C]


def _backward_ops(ch: _SelChunk, do: torch.Tensor, ls: torch.Tensor, dl: torch.Tensor, vbp: torch.Tensor,
                  dkbp: torch.Tensor, dvbp: torch.Tensor) -> torch.Tensor:
    """`_backward_fused` as separate ops (other devices), with the rows' sum of p * dp `dl` (BG, C, r)."""
    BG, C, r, D, L, nb = ch.BG, ch.C, ch.r, ch.D, ch.L, ch.nb
    NT, lanes = ch.rows.shape[0], ch.rows.flatten()
    ch.scores()
    # tiles
    p = ch.s_t.sub_(ch.per_lane(ls)).exp_()  # (NT, R, r, L)
    dot, vt = ch.tile_rows(do), ch.tile_keys(vbp)
    dvbp.view(-1, D).index_add_(0, ch.key_rows, (p.view(NT, TILE * r, L).transpose(1, 2) @ dot).view(-1, D))
    ds = (dot @ vt.transpose(1, 2)).view_as(p).sub_(ch.per_lane(dl)).mul_(p).view(NT, TILE * r, L)
    dkbp.view(-1, D).index_add_(0, ch.key_rows, (ds.transpose(1, 2) @ ch.qt).view(-1, D))
    dqc = do.new_zeros(BG * C + 1, r, D).index_add_(0, lanes, (ds @ ch.kt).view(-1, r, D))[:-1].view(BG, C, r, D)
    # loc
    p = ch.s_loc.sub_(ch.per_loc(ls)[..., None]).exp_().view(BG * nb, -1, ch.nloc * L)
    do_loc = ch.per_loc(do).reshape(BG * nb, -1, D)
    v_loc = ch.local_keys(vbp)
    ch.scatter_local(dvbp, p.transpose(1, 2) @ do_loc)
    ds = (do_loc @ v_loc.transpose(1, 2)).view(BG, nb, L, r, -1).sub_(ch.per_loc(dl)[..., None])
    ds = ds.view_as(p).mul_(p)
    ch.scatter_local(dkbp, ds.transpose(1, 2) @ ch.q_loc)
    dqc += (ds @ ch.k_loc).view(BG, -1, r, D)[:, :C]
    # ini
    p = ch.s_ini.sub_(ch.per_loc(ls)[..., None]).exp_().view(BG * nb, -1, L)
    v_ini = ch.initial_keys(vbp)
    ch.scatter_initial(dvbp, p.transpose(1, 2) @ do_loc)
    ds = (do_loc @ v_ini.transpose(1, 2)).view(BG, nb, L, r, L).sub_(ch.per_loc(dl)[..., None])
    ds = ds.view_as(p).mul_(p)
    ch.scatter_initial(dkbp, ds.transpose(1, 2) @ ch.q_loc)
    return dqc + (ds @ ch.k_ini).view(BG, -1, r, D)[:, :C]


def selected_backward(d_out: torch.Tensor, q: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor, idx: torch.Tensor,
                      valid: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, spec: NSASpec,
                      start: torch.Tensor | None, q0: int, bounds: ChunkBounds | None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients (dq, dks, dvs) of `selected_forward`'s output, the scores recomputed chunk by chunk."""
    B, G, Tq, r, D = q.shape
    T = ks.shape[2]
    kbp, vbp = _key_blocks(ks, spec.l_sel), _key_blocks(vs, spec.l_sel)
    dkbp, dvbp = torch.zeros_like(kbp), torch.zeros_like(vbp)
    qs = q.reshape(B * G, Tq, r, D) * D**-0.5
    d_out, out = d_out.reshape(B * G, Tq, r, D), out.reshape(B * G, Tq, r, D)
    lse = lse.reshape(B * G, Tq, r)
    fused = fused_attention.fused(q)
    delta = None if fused else (d_out * out).sum(-1)  # (BG, Tq, r): sum over keys of p * dp
    dq = torch.empty_like(qs)
    for t0, t1, ch in _each_chunk(qs, kbp, idx, valid, spec, start, q0, bounds, ks.shape[2]):
        do, ls = d_out[:, t0:t1], lse[:, t0:t1]
        if fused:
            dqc = _backward_fused(ch, do, out[:, t0:t1], ls, vbp, dkbp, dvbp)
        else:
            dqc = _backward_ops(ch, do, ls, delta[:, t0:t1], vbp, dkbp, dvbp)
        dq[:, t0:t1] = dqc * D**-0.5
    dks, dvs = (x[:, PAD_BLOCKS:].reshape(B, G, -1, D)[:, :, :T] for x in (dkbp, dvbp))
    return dq.view(B, G, Tq, r, D), dks, dvs
