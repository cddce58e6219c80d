"""NSA rules shared by every implementation: block geometry, selection scores, top-n choice.

Notation (paper, 0-indexed): query t sees keys 0..t.
  cmp block i covers keys [i*d, i*d + l) and is visible to t when i*d + l - 1 <= t.
  sel block j covers keys [j*l', (j+1)*l') and is a candidate for t when j*l' <= t.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .spec import N_FORCED_INITIAL, N_FORCED_LOCAL, NSASpec

if TYPE_CHECKING:
    from .documents import Documents

BRANCHES = ("cmp", "sel", "win")
"""The three branches, in the order of the gates and of `mix_branches`."""


def cmp_visibility(spec: NSASpec, T: int, device: torch.device) -> torch.Tensor:
    """(T, Nc) bool: query t may attend cmp block i iff the whole block is in its past."""
    t = torch.arange(T, device=device)
    i = torch.arange(spec.num_cmp_blocks(T), device=device)
    return (i * spec.d + spec.l - 1)[None, :] <= t[:, None]


def sel_members(spec: NSASpec, T: int, device: torch.device) -> torch.Tensor:
    """(Ns, K) long: the cmp blocks whose probabilities make up each sel block's score.

    The paper's Eq. 9 mapping, stated exactly: a selection block's importance is the sum of
    the cmp probabilities of every compression block sharing at least one key with it,
    i.e. i*d < (j+1)*l' and i*d + l > j*l'. For l=32, d=16, l'=64, sel block j collects
    cmp blocks 4j-1 .. 4j+3 (those that exist). With l = d = l' it is the identity.
    Those blocks are consecutive; rows are padded with Nc, an index past the last block.
    """
    Nc, Ns = spec.num_cmp_blocks(T), spec.num_sel_blocks(T)
    j = torch.arange(Ns, device=device)
    lo = torch.clamp(torch.div(j * spec.l_sel - spec.l, spec.d, rounding_mode="floor") + 1, min=0)
    hi = torch.clamp(-torch.div(-(j + 1) * spec.l_sel, spec.d, rounding_mode="floor") - 1, max=Nc - 1)
    K = max(1, -(-(spec.l + spec.l_sel) // spec.d))  # an upper bound on hi - lo + 1
    i = lo[:, None] + torch.arange(K, device=device)
    return torch.where(i <= hi[:, None], i, Nc)


def masked_softmax(s: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Softmax of scores `s` over the last dim where `mask` allows; a row with no allowed key
    gives all zeros (never NaN), and so does its gradient."""
    s = s.masked_fill(~mask, float("-inf"))
    m = s.amax(-1, keepdim=True).detach()
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(s - m)  # masked entries: exp(-inf) = 0
    denom = e.sum(-1, keepdim=True)
    return e / torch.where(denom > 0, denom, torch.ones_like(denom))


def select_blocks(p_cmp: torch.Tensor, spec: NSASpec, n_groups: int, t0: int = 0, T: int | None = None,
                  docs: Documents | None = None, positions: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Choose the top-n sel blocks per (query, KV group) from the cmp probabilities.

    p_cmp: (B, H, C, Nc) softmax probabilities of the cmp branch (0 where not visible) for the
    queries t0 .. t0 + C - 1 of a sequence of T keys (default: C, from 0), or at `positions` (B, C)
    of each row's own (decoding rows of different lengths). Scores are summed over the query heads
    of a group (Eq. 10), then `choose_blocks`.
    """
    B, H, C, Nc = p_cmp.shape
    with torch.no_grad():
        p_group = p_cmp.view(B, n_groups, H // n_groups, C, Nc).sum(2)  # (B, G, C, Nc)
    return choose_blocks(p_group, spec, t0, C if T is None else T, docs, positions=positions)


def top_n(scores: torch.Tensor, n: int) -> torch.Tensor:
    """Indices of the n largest scores of each row (last dim), by descending score, ties to the lower
    index: the first n of a stable descending sort, without sorting the whole row (topk finds the
    n-th largest; only the n chosen are sorted)."""
    kth = torch.topk(scores, n, dim=-1, sorted=False).values.amin(-1, keepdim=True)
    above, tied = scores > kth, scores == kth
    take = above | (tied & (torch.cumsum(tied, -1) <= n - above.sum(-1, keepdim=True)))
    slot = torch.where(take, torch.cumsum(take, -1) - 1, n)  # the chosen in index order; n: a trash slot
    index = torch.arange(scores.shape[-1], device=scores.device).expand_as(scores)
    idx = torch.zeros(*scores.shape[:-1], n + 1, dtype=torch.long, device=scores.device)
    idx = idx.scatter_(-1, slot, index)[..., :n]
    order = torch.sort(scores.gather(-1, idx), dim=-1, descending=True, stable=True).indices
    return idx.gather(-1, order)


def _pooled(p_group: torch.Tensor, spec: NSASpec, Ns: int) -> torch.Tensor:
    """`sel_members`' sums when l and l' are multiples of d: sel block j collects the K = l'/d + l/d - 1
    consecutive cmp blocks from j l'/d - l/d + 1 on, so the scores (..., Ns) are K strided slices of
    p_group added in member order (no gather); blocks before 0 or past the visible ones add 0."""
    s, a = spec.l_sel // spec.d, spec.l // spec.d - 1  # stride, members before a block's first key
    span = (Ns - 1) * s + 1
    x = torch.nn.functional.pad(p_group, (a, max(0, span + s - 1 - p_group.shape[-1])))  # (..., a + Nv + right)
    scores = x[..., 0:span:s].clone()
    for o in range(1, s + a):
        scores += x[..., o:o + span:s]
    return scores


def query_positions(t0: int, C: int, device: torch.device, docs: Documents | None = None) -> torch.Tensor:
    """The positions that sel blocks count from of queries t0 .. t0 + C - 1: (1, C), or (B, C) inside
    each query's document with `docs`."""
    t = torch.arange(t0, t0 + C, device=device)[None, :]
    return t if docs is None else t - docs.start[:, t0:t0 + C]


def member_slots(j: torch.Tensor, spec: NSASpec, T: int, Nv: int, docs: Documents | None = None, t0: int = 0,
                 slot0: int = 0) -> torch.Tensor:
    """The cmp blocks making up the scores of sel blocks j (B or 1, G or 1, C, m) of queries t0 .. t0 + C - 1
    (`sel_members`): (..., C, m, K) indices into the first Nv cmp blocks, or with `docs` into the slots
    slot0 .. slot0 + Nv - 1 of each query's document; Nv where there is none."""
    if docs is None:
        return sel_members(spec, T, j.device).clamp(max=Nv)[j]
    Ns = spec.num_sel_blocks(T)
    members = sel_members(spec, Ns * spec.l_sel + spec.l, j.device)[:Ns][j]  # (..., K), unclipped by T
    absent = members == spec.num_cmp_blocks(Ns * spec.l_sel + spec.l)
    first = docs.first_slot[:, None, t0:t0 + j.shape[-2], None, None] - slot0  # (B, 1, C, 1, 1)
    return torch.where(absent, Nv, first + members).clamp(max=Nv)


def block_scores(p_group: torch.Tensor, spec: NSASpec, t0: int, T: int, docs: Documents | None = None,
                 slot0: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The sel blocks' importance scores (B, G, C, Ns) from group-summed cmp probabilities p_group
    (B, G, C, Nv) (Eq. 9: the sum of each block's cmp members), differentiable; and the positions t of
    queries t0 .. t0 + C - 1 that blocks count from (`query_positions`). See `choose_blocks` for the
    arguments."""
    B, G, C, Nv = p_group.shape
    Ns = spec.num_sel_blocks(T)
    t = query_positions(t0, C, p_group.device, docs)
    if docs is None and spec.strided_members():
        return _pooled(p_group, spec, Ns), t
    padded = torch.cat([p_group, p_group.new_zeros(B, G, C, 1)], -1)  # Nv: the zero column
    j = torch.arange(Ns, device=p_group.device).expand(1, 1, C, Ns)
    slots = member_slots(j, spec, T, Nv, docs, t0, slot0).expand(B, G, C, Ns, -1)
    members = padded.gather(-1, slots.flatten(-2)).view(slots.shape).unbind(-1)
    return sum(members[1:], members[0]), t  # added in member order, as `_pooled` and the kernels add them


def forced_blocks(j: torch.Tensor, t: torch.Tensor, spec: NSASpec) -> torch.Tensor:
    """Whether blocks j (broadcastable to (..., C, n)) are forced for queries at positions t (..., C):
    block 0 and the 2 local blocks."""
    jt = torch.div(t, spec.l_sel, rounding_mode="floor")[..., None]  # the block holding t
    return (j < N_FORCED_INITIAL) | ((j <= jt) & (j > jt - N_FORCED_LOCAL))


def choose_blocks(p_group: torch.Tensor, spec: NSASpec, t0: int, T: int, docs: Documents | None = None,
                  slot0: int = 0, positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-n sel blocks from group-summed cmp probabilities p_group (B, G, C, Nv), where the
    first Nv <= Nc cmp blocks (or, with `docs`, the slots slot0 .. slot0 + Nv - 1) are all that
    queries t0 .. t0 + C - 1 can see.

    Returns idx (B, G, C, n') long and valid (B, G, C, n') bool, n' = min(n, Ns): the chosen
    block indices (descending score) and whether each is a real candidate (j*l' <= t). With
    `docs`, t and j count from the query's document start and a block's cmp members are the
    slots of that document. Block 0 and the 2 local blocks are forced. Ties keep the lower
    block index (a stable sort), so every implementation picks the same set. No gradient
    flows through the choice. `positions` (B, C), without `docs`: each row's own query positions.
    """
    with torch.no_grad():
        scores, t = block_scores(p_group, spec, t0, T, docs, slot0)
        t = t if positions is None else positions
        Ns = scores.shape[-1]
        j = torch.arange(Ns, device=p_group.device)[None, None, :]
        candidate = (j <= torch.div(t, spec.l_sel, rounding_mode="floor")[:, :, None])[:, None]  # (B or 1, 1, C, Ns)
        forced = forced_blocks(j, t, spec)[:, None]
        scores = scores.masked_fill(forced, float("inf")).masked_fill(~candidate, float("-inf"))
        idx = top_n(scores, min(spec.n, Ns))
        valid = candidate.expand(scores.shape).gather(-1, idx)
    return idx, valid


def selected_keys(idx: torch.Tensor, valid: torch.Tensor, spec: NSASpec, t: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Key positions of the chosen blocks and which of them a query may read.

    idx, valid: (B, G, C, n') from `select_blocks`; t: (C,) query positions.
    Returns pos (B, G, C, n'*l') and ok (same shape): a real candidate block, key <= t.
    """
    pos = (idx[..., None] * spec.l_sel + torch.arange(spec.l_sel, device=idx.device)).flatten(-2)
    ok = valid.repeat_interleave(spec.l_sel, dim=-1) & (pos <= t[:, None])  # causal inside the current block
    return pos, ok


def mix_branches(g: torch.Tensor, o_cmp: torch.Tensor | None, o_sel: torch.Tensor | None, o_win: torch.Tensor | None
                 ) -> torch.Tensor:
    """The gated sum g_cmp * o_cmp + g_sel * o_sel + g_win * o_win; g (..., 3) in the branch order,
    each output (..., D), or None for a branch not computed (it adds nothing; at least one is given)."""
    terms = [g[..., i:i + 1] * o for i, o in enumerate((o_cmp, o_sel, o_win)) if o is not None]
    return sum(terms[1:], terms[0])


def block_readers(idx32: torch.Tensor, start32: torch.Tensor, L: int, Tk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The reverse index of the chosen blocks: for each (b * G + g, first key position p0) of a block,
    the query rows that chose it, READERS[OFFSETS[i] : OFFSETS[i + 1]] with i = bg * Tk + p0, in
    row order. A block starts at p0 = (its query's document start) + j * L. Tensor ops only (no
    host sync, no atomics): a stable sort of one key per chosen block, and the offsets by search."""
    B, G, Tq, N = idx32.shape
    p0 = start32[:, None, :, None].long() + idx32.long() * L  # (B, G, Tq, N)
    bg = torch.arange(B * G, device=idx32.device).view(B, G, 1, 1)
    key = torch.where(idx32 >= 0, bg * Tk + p0, B * G * Tk).flatten()  # not a candidate: past the end
    key, order = torch.sort(key, stable=True)
    offsets = torch.searchsorted(key, torch.arange(B * G * Tk + 1, device=key.device), out_int32=True)
    return offsets, (order // N % Tq).to(torch.int32)
