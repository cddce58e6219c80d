"""Fast NSA attention in PyTorch: the cost grows with the keys a query attends to, not with T^2.

Each branch is a flash-style autograd Function that keeps only its inputs (and, for sel, the
output and the logsumexp of each (query, head)) and recomputes its scores once in backward,
chunk by chunk: memory is linear in T and no T x T tensor exists.
  cmp, win (`_Shared`): chunks of queries against the keys the whole chunk may read, the Nv
      compressed keys visible to its last query, or the C + w - 1 keys covering its windows.
      The r query heads of a KV group are stacked, so a chunk is two matmuls per group; only
      the columns where the mask varies are masked. The cmp forward also picks each chunk's sel
      blocks from its probabilities.
  sel (`_Selected`, `_SelChunk`): in three dense parts per chunk. The forced blocks need no
      gather: the block holding t and the one before are one (l' * r) x 2l' product per query
      block, block 0 one product for all queries past the second block. The blocks chosen by
      score are block-centric: the (query, group) -> block choices are sorted by block and cut
      into tiles of R queries sharing one block, so a tile is a dense (R * r) x D @ D x l'
      product over a block loaded once for all the group's heads (the paper's group-centric
      sharing); what gets gathered is R query rows per block, not l' x D keys per query. Tile
      counts have a static bound: no host sync, no data-dependent shapes.
The loops are over chunks, never over tokens. `kernels.py` chooses where sel runs as Triton
kernels (`triton_sel.py`) and win through flash-attn instead.
"""

from __future__ import annotations

import torch

from . import kernels as kernel_choice
from . import triton_sel
from .common import N_FORCED_INITIAL, N_FORCED_LOCAL, NSASpec, choose_blocks, mix_branches
from .documents import Documents
from .kernels import Kernels

CHUNK_CMP = 256
"""Queries per cmp chunk."""
CHUNK_WIN = 64
"""Queries per win chunk: the chunk reads C + w - 1 keys for its C windows of w."""
CHUNK_SEL = 4096
"""Most queries per sel chunk: bounds the gathered rows (C x n x heads x D per KV group)."""
SEL_CHUNKS = 4
"""A sequence's queries are cut into at least this many sel chunks while they keep CHUNK_SEL / 2
queries or more (short sequences keep one chunk); a part of the queries (context parallelism) is cut
into as many chunks as the whole sequence, so the chunks' working memory shrinks with a rank's share
of the sequence instead of staying at its largest."""
TILE = 32
"""R: queries per sel tile (one block each)."""


def _key_range(kind: str, spec: NSASpec, t0: int, t1: int, S: int, device: torch.device, docs: Documents | None
               ) -> tuple[int, int, torch.Tensor]:
    """Keys [lo, hi) that queries t0 .. t1 - 1 may read in branch `kind`, and the mask (C, 1, hi - lo),
    or with `docs` (B, 1, C, 1, hi - lo). With `docs` the cmp keys are slots: those visible to
    t1 - 1 are among the first t1 // d (see documents.py), which bounds the range without a host sync."""
    t = torch.arange(t0, t1, device=device)[:, None]
    if kind == "cmp" and docs is not None:
        hi = min(S, t1 // spec.d)
        return 0, hi, docs.cmp_visible(spec, t0, t1, hi)[:, None, :, None]
    if kind == "cmp":  # block i is visible to t when i*d + l - 1 <= t
        hi = min(S, max(0, (t1 - spec.l) // spec.d + 1))
        i = torch.arange(hi, device=device)[None, :]
        return 0, hi, (i * spec.d + spec.l - 1 <= t)[:, None]
    lo, hi = max(0, t0 - spec.w + 1), t1
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
    def forward(ctx, q, k, v, kind: str, spec: NSASpec, T: int, q0: int, *doc_fields):
        """q (B, G, Tq, r, D): the queries at positions q0 .. q0 + Tq - 1 of a sequence of T tokens
        (all of them unless context parallelism splits it); k, v (B, G, S, D) of the whole sequence;
        doc_fields: the fields of a `Documents` of the whole sequence, or none. Returns out
        (B, G, Tq, r, D) and, for cmp, the chosen sel blocks idx / valid (B, G, Tq, n') (see
        `choose_blocks`)."""
        B, G, Tq, r, D = q.shape
        docs = Documents(*doc_fields) if doc_fields else None
        chunk = CHUNK_CMP if kind == "cmp" else CHUNK_WIN
        out, idx, valid = torch.zeros_like(q), [], []
        for t0 in range(q0, q0 + Tq, chunk):
            t1 = min(q0 + Tq, t0 + chunk)
            lo, hi, mask = _key_range(kind, spec, t0, t1, k.shape[2], q.device, docs)
            if hi == lo:  # no complete cmp block yet: no key, output 0
                p = q.new_zeros(B, G, t1 - t0, r, 0)
            else:
                p = _probs(q[:, :, t0 - q0:t1 - q0], k[:, :, lo:hi], mask)  # (B, G, C, r, hi - lo)
                out[:, :, t0 - q0:t1 - q0] = (p.view(B, G, -1, hi - lo) @ v[:, :, lo:hi]).view(B, G, -1, r, D)
            if kind == "cmp":
                chosen = choose_blocks(p.sum(3), spec, t0, T, docs)
                idx.append(chosen[0])
                valid.append(chosen[1])
        ctx.save_for_backward(q, k, v, *doc_fields)
        ctx.kind, ctx.spec, ctx.q0 = kind, spec, q0
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
            lo, hi, mask = _key_range(ctx.kind, ctx.spec, t0, t1, k.shape[2], q.device, docs)
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
        return dq, dk, dv, None, None, None, None, *(None for _ in doc_fields)


def _tiles(kpos: torch.Tensor, use: torch.Tensor, per_query: int, t0: int, spec: NSASpec
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tiles of the (query, group) -> block choices of queries t0 .. t0 + C - 1, each block named
    by its first key `kpos` (B, G, C, n'), where `use` (same shape) is True, at most `per_query`
    of them per (query, group); a used block lies wholly before t0 + C.

    Returns rows (NT, R): each lane's chunk-local query row (b*G + g)*C + c, or the dummy row
    B*G*C for an empty lane; bg, kpos (NT,): the (batch, group) and the first key of the block
    shared by the tile. NT = ceil(B*G*C*per_query / R) + B*G*Ns_c is a static bound (Ns_c: the
    blocks of l' keys before t0 + C; each block used leaves at most one tile part-filled, and
    the used blocks of (b, g), counted per document, are fewer than that).
    """
    B, G, C, n = kpos.shape
    R, dev = TILE, kpos.device
    t1 = t0 + C
    Ns_c = (t1 - 1) // spec.l_sel + 1
    K, P = B * G * t1, B * G * C * n
    NT = -(-B * G * C * per_query // R) + B * G * Ns_c
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
                 t0: int, spec: NSASpec, start: torch.Tensor | None):
        BG, C, r, D = qs.shape  # qs (BG, C, r, D); kbp (BG, 2 + Ns, L, D): block j at 2 + j
        L, B = spec.l_sel, idx.shape[0]
        self.BG, self.C, self.r, self.D, self.L = BG, C, r, D, L
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
        self.rows, bg, kpos = _tiles(s[:, None, :C, None] + idx * L, scored, per_query, t0, spec)
        NT, R = self.rows.shape
        first = (bg * kbp.shape[1] + PAD_BLOCKS) * L + kpos  # (NT,): row of the block's first key
        self.key_rows = (first[:, None] + torch.arange(L, device=dev)).flatten()  # (NT * L,)
        self.qt = _with_dummy(qs).index_select(0, self.rows.flatten()).view(NT, R * r, D)
        self.kt = kbp.view(-1, D).index_select(0, self.key_rows).view(NT, L, D)
        self.s_t = (self.qt @ self.kt.transpose(1, 2)).view(NT, R, r, L)
        # loc: query block b against the keys of blocks j0 + b - nloc + 1 .. j0 + b, those from the
        # first key of block jt - 1 (of t's document, not before it) to t.
        self.q_loc = _pad_blocks(qs, self.nb, L).view(BG * self.nb, L * r, D)
        self.k_loc = self.local_keys(kbp)
        key = (torch.arange(self.nb, device=dev)[:, None, None] + self.j0 - self.nloc + 1) * L \
            + torch.arange(self.nloc * L, device=dev)  # (nb, 1, nloc * L)
        lo = (s + (jt - 1).clamp(min=0) * L).view(-1, self.nb, L, 1)
        ok = (key >= lo) & (key <= t.view(1, self.nb, L, 1))  # (B or 1, nb, L, nloc * L)
        s_loc = (self.q_loc @ self.k_loc.transpose(1, 2)).view(B, -1, self.nb, L, r, self.nloc * L)
        self.s_loc = s_loc.masked_fill_(~ok[:, None, :, :, None], float("-inf")).view(BG, self.nb, L, r, -1)
        # ini: block 0 of the document of each query block's first query, for its rows with jt >= 2.
        self.ini_rows = None  # without documents block 0 is the same for every query block
        if start is not None:
            first = s.view(-1, self.nb, L)[:, :, 0]  # (B, nb)
            bgs = torch.arange(BG, device=dev).view(B, -1, 1)  # (B, G, 1)
            rows = (bgs * kbp.shape[1] + PAD_BLOCKS) * L + first[:, None, :]  # (B, G, nb)
            self.ini_rows = (rows[..., None] + torch.arange(L, device=dev)).flatten()  # (BG * nb * L,)
        self.k_ini = self.initial_keys(kbp)
        s_ini = (self.q_loc @ self.k_ini.transpose(1, 2)).view(B, -1, self.nb, L, r, L)
        late = (jt >= 2).view(-1, 1, self.nb, L, 1, 1)
        self.s_ini = s_ini.masked_fill_(~late, float("-inf")).view(BG, self.nb, L, r, L)

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

    def per_lane(self, x: torch.Tensor) -> torch.Tensor:
        """Row statistics (BG, C, r) -> (NT, R, r, 1) for the tiles' lanes (dummy lanes: 0)."""
        NT, R = self.rows.shape
        return _with_dummy(x).index_select(0, self.rows.flatten()).view(NT, R, self.r, 1)

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


class _Selected(torch.autograd.Function):
    """sel attention: each (query, group) reads its own n blocks of l' keys (see the module doc)."""

    @staticmethod
    def forward(ctx, q, ks, vs, idx, valid, spec: NSASpec, start: torch.Tensor | None, q0: int):
        """q (B, G, Tq, r, D): the queries at q0 .. q0 + Tq - 1 (q0 a multiple of l'); ks, vs
        (B, G, T, D) of the whole sequence; idx, valid (B, G, Tq, n'); start (B, Tq): each query's
        document start (None: one document) -> (B, G, Tq, r, D)."""
        B, G, Tq, r, D = q.shape
        kbp, vbp = _key_blocks(ks, spec.l_sel), _key_blocks(vs, spec.l_sel)
        qs = q.reshape(B * G, Tq, r, D) * D**-0.5
        out, lse = torch.empty_like(q), q.new_empty(B, G, Tq, r)
        chunks = _sel_chunks(Tq, ks.shape[2], spec.l_sel)
        for t0 in chunks:
            t1 = min(Tq, t0 + chunks.step)
            ch = _SelChunk(qs[:, t0:t1], kbp, idx[:, :, t0:t1], valid[:, :, t0:t1], q0 + t0, spec,
                           None if start is None else start[:, t0:t1])
            BG, C, L, nb = ch.BG, ch.C, ch.L, ch.nb
            lanes = ch.rows.flatten()
            NT = ch.qt.shape[0]
            # Row maxima over all three parts, then one exp per score.
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
            vt = vbp.view(-1, D).index_select(0, ch.key_rows).view(NT, L, D)
            o = (e_t.view(NT, -1, L) @ vt).view(-1, r, D)
            o = q.new_zeros(BG * C + 1, r, D).index_add_(0, lanes, o)[:-1].view(BG, C, r, D)
            o += (e_loc.view(BG * nb, -1, ch.nloc * L) @ ch.local_keys(vbp)).view(BG, -1, r, D)[:, :C]
            o += (e_ini.view(BG * nb, -1, L) @ ch.initial_keys(vbp)).view(BG, -1, r, D)[:, :C]
            out[:, :, t0:t1] = (o / total[..., None]).view(B, G, C, r, D)
            lse[:, :, t0:t1] = (m + torch.log(total)).view(B, G, C, r)
        ctx.save_for_backward(q, ks, vs, idx, valid, out, lse, start)
        ctx.spec, ctx.q0 = spec, q0
        return out

    @staticmethod
    def backward(ctx, d_out):
        q, ks, vs, idx, valid, out, lse, start = ctx.saved_tensors
        spec = ctx.spec
        B, G, Tq, r, D = q.shape
        T = ks.shape[2]
        kbp, vbp = _key_blocks(ks, spec.l_sel), _key_blocks(vs, spec.l_sel)
        dkbp, dvbp = torch.zeros_like(kbp), torch.zeros_like(vbp)
        qs = q.reshape(B * G, Tq, r, D) * D**-0.5
        d_out = d_out.reshape(B * G, Tq, r, D)
        lse = lse.reshape(B * G, Tq, r)
        delta = (d_out * out.reshape(B * G, Tq, r, D)).sum(-1)  # (BG, Tq, r): sum over keys of p * dp
        dq = torch.empty_like(qs)
        chunks = _sel_chunks(Tq, ks.shape[2], spec.l_sel)
        for t0 in chunks:
            t1 = min(Tq, t0 + chunks.step)
            ch = _SelChunk(qs[:, t0:t1], kbp, idx[:, :, t0:t1], valid[:, :, t0:t1], ctx.q0 + t0, spec,
                           None if start is None else start[:, t0:t1])
            BG, C, L, nb = ch.BG, ch.C, ch.L, ch.nb
            lanes = ch.rows.flatten()
            NT = ch.qt.shape[0]
            do, ls, dl = d_out[:, t0:t1], lse[:, t0:t1], delta[:, t0:t1]
            # tiles
            p = ch.s_t.sub_(ch.per_lane(ls)).exp_()  # (NT, R, r, L)
            dot = _with_dummy(do).index_select(0, lanes).view(NT, -1, D)
            vt = vbp.view(-1, D).index_select(0, ch.key_rows).view(NT, L, D)
            dvbp.view(-1, D).index_add_(0, ch.key_rows, (p.view(NT, -1, L).transpose(1, 2) @ dot).view(-1, D))
            ds = (dot @ vt.transpose(1, 2)).view_as(p).sub_(ch.per_lane(dl)).mul_(p).view(NT, -1, L)
            dkbp.view(-1, D).index_add_(0, ch.key_rows, (ds.transpose(1, 2) @ ch.qt).view(-1, D))
            dqc = q.new_zeros(BG * C + 1, r, D).index_add_(0, lanes, (ds @ ch.kt).view(-1, r, D))[:-1].view(BG, C, r, D)
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
            dqc += (ds @ ch.k_ini).view(BG, -1, r, D)[:, :C]
            dq[:, t0:t1] = dqc * D**-0.5
        dks, dvs = (x[:, PAD_BLOCKS:].reshape(B, G, -1, D)[:, :, :T] for x in (dkbp, dvbp))
        return dq.view(B, G, Tq, r, D), dks, dvs, None, None, None, None, None


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

    def grouped(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Keys / values (B, S, G, D) -> (B, G, S, D)."""
        return x.to(dtype).transpose(1, 2).contiguous()

    # (B, G, T, r, D): the r = H/G query heads of a group side by side.
    qg = q.to(acc).view(B, Tq, G, H // G, D).transpose(1, 2).contiguous()
    o_cmp, idx, valid = _Shared.apply(qg, grouped(k_cmp, acc), grouped(v_cmp, acc), "cmp", spec, T, q0, *fields)
    if kernels.sel == "triton":  # the Triton kernels take bf16 / fp16 as they are
        o_sel = triton_sel.SelectedTriton.apply(qg.to(q.dtype), grouped(k_sel, q.dtype), grouped(v_sel, q.dtype),
                                                idx, valid, spec, start, q0).to(acc)
    else:
        o_sel = _Selected.apply(qg, grouped(k_sel, acc), grouped(v_sel, acc), idx, valid, spec, start, q0)
    if kernels.win == "flash":
        o_win = kernel_choice.window_flash(q, k_win, v_win, spec, docs, q0).to(acc)
    else:
        o_win, _, _ = _Shared.apply(qg, grouped(k_win, acc), grouped(v_win, acc), "win", spec, T, q0, *fields)
    g = gates.to(acc).view(B, Tq, G, H // G, 3).transpose(1, 2)
    out = mix_branches(g, o_cmp, o_sel, o_win)  # (B, G, Tq, r, D)
    return out.transpose(1, 2).reshape(B, Tq, H, D).to(q.dtype)
