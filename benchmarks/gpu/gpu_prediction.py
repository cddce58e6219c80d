"""The Triton family's forward + backward time on an H100, predicted on a CPU before any GPU run, twice: with
constants fitted on the H100 profile of 2026-11-28 and with a pessimistic set.

    python benchmarks/gpu/gpu_prediction.py [--T 8192 32768 65536] [--changes]

A step model. Every kernel of the family is a grid of programs, each a loop of steps over tiles (a 64-row tile
of queries x heads against a tile of keys: load, two to four products, the online softmax); the H100 profile
(`gpu_reports/2026-11-28-h100.md`) shows such kernels bound by their steps, not by their products. A kernel's time:

    max(sum over its launches of max(steps x c_w / 132 SMs, longest program's steps x lat),
        its bytes to and from HBM / bw,  launches x launch)  +  atomic bytes / atomic_rate  +  rounds x round / 132

- c_w, the cost of a step while the GPU is full, is fitted per kernel class: 4 warps (2 or more blocks an SM) and
  8 warps (one block an SM; every kernel of the family is one). lat: a step of a program alone (the tail).
  Fitted together (least squares of the log ratios) on the six tile kernels of that profile, their steps counted
  from their code at d678f0f; each is predicted back in sample and leave one out.
- Bytes: every gather (the rows a sel kernel collects through the inverse index) and both directions of every
  buffer a kernel writes for another (sel's per-block partials, the reader lists), at 3.0 TB/s, and the tensors
  each kernel must read or write once; key tiles a program reuses are taken to stay in L2.
- Atomic adds at an explicit rate (fp32 adds into L2); rounds: the top-n's insertion rounds (a round: a few row
  reductions over a tile of queries x blocks), counted on the blocks the inputs really choose, each at the cost
  of a round of the profile's `_choose` kernel (it ran 16 such rounds a program).
- Every launch: the fills, the cumulative sum and the casts at their bytes, and at least `launch` each.

The inputs are those of `benchmarks/gpu/gpu_attention.py` (the M7C attention, random, seeded), their blocks chosen
by the C++ family; the prediction is put against cuDNN's measured dense time. `--changes` prints the predicted
effect of each kernel change the model was asked to weigh (`CHANGES`), one at a time and all together. The
model says where the time would go and whether the targets are within reach, not what a GPU will measure.
"""

from __future__ import annotations

import argparse
import functools
import math
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.kernels.attention_speed import build_core  # noqa: E402  (the H100 run's inputs)

from nsa_titan.models.attention import NSASpec  # noqa: E402
from nsa_titan.models.attention.families.triton import triton_nsa  # noqa: E402
from nsa_titan.models.attention.families.choose import FAMILIES  # noqa: E402

SPEC = NSASpec(l=32, d=16, l_sel=64, n=16, w=512)
G, R, D, SMS = 2, 6, 64, 132
MEASURED_32K = {  # ms of GPU time per kernel, forward + backward at T 32,768 (gpu_reports/2026-11-28-h100.md)
    "_sel_fwd": 2.659, "_sel_bwd_dq": 2.665, "_sel_bwd_dkv": 3.496, "_fwd (cmp + win)": 1.799,
    "_bwd_dq (cmp + win)": 1.090, "_bwd_dkv (cmp + win)": 2.411}
CHOOSE_32K = 0.621
"""ms of the profile's `_choose` (the top-n of the branch-wise kernels): the cost of an insertion round."""
DENSE = {8192: 1.030, 32768: 13.309, 65536: 53.300}
"""cuDNN's causal attention fwd + bwd (ms) on that H100, the fastest dense kernel there."""
TARGETS = {8192: (1.0, 0.8), 32768: (2.5, 2.0), 65536: (4.0, 3.2)}
"""dense / NSA wanted, with the fitted and with the pessimistic constants."""
TRAIN_TARGETS = {8192: 1.0, 32768: 1.5}
"""M7C training tokens/s, NSA / dense on FlexAttention with documents."""
TRAINED_8K = 52_350, 6.475, 1.828
"""The profile's M7C training run (bf16, compile, AC full, documents; seq 8k, batch 2, the branch-wise kernels):
NSA's tokens/s, and its attention's fwd + bwd and fwd ms (a layer, a sequence, documents of mean length 1,024):
what the step spends outside the attention follows."""
FLEX = {8192: {1024: (0.245, 0.585), 4096: (0.646, 1.734)}, 32768: {1024: (1.228, 2.634), 4096: (2.174, 5.689)},
        65536: {1024: (2.326, 5.428), 4096: (3.948, 9.950)}}
"""Dense attention on FlexAttention's document mask (12 heads, head dim 64, bf16, the documents of
`document_masking.document_ids`), measured on that H100: {T: {mean document: (fwd, fwd + bwd) ms}}."""
FLEX_TILE = 128
"""Queries and keys of a FlexAttention block (its BlockMask's default)."""
MIXING_BYTES = 26
"""HBM bytes per element of the output (T x H x D) that the flex family's gated sum of its branches moves,
forward and backward, fused under torch.compile (m7c.toml compiles): o_cmp, o_win, sel's gated output and the
gates read and the sum written (bf16), then dO and both outputs read and their gradients and the gates' written."""


@dataclass(frozen=True)
class Costs:
    """The constants of the model (seconds, bytes a second). `gather`: a step over rows gathered through an
    index, if it costs more than a step over a contiguous tile (None: the same)."""
    c4: float
    c8: float
    lat: float
    round: float
    gather: float | None = None
    bw: float = 3.0e12
    atomic: float = 1.0e12
    launch: float = 3e-6

    def worse(self) -> Costs:
        """This explanation with the pessimistic rates: at least 0.91 us a step of 8 warps (the old 8-warp
        `_bwd_dkv`'s own cost), 3.0 TB/s, atomics at 0.5 TB/s, 5 us a launch."""
        return replace(self, c8=max(self.c8, 0.91e-6), c4=max(self.c4, 0.91e-6 * self.c4 / self.c8), bw=3.0e12,
                       atomic=0.5e12, launch=5e-6)


@dataclass
class Kernel:
    """A kernel's work: its launches' steps per program, its warps, whether its steps gather their rows, bytes to
    or from HBM, atomic bytes, insertion rounds."""
    launches: list[torch.Tensor]
    warps: int = 8
    gathered: bool = False
    hbm: float = 0.0
    atomic: float = 0.0
    rounds: float = 0.0

    @functools.cached_property
    def totals(self) -> list[tuple[float, float]]:
        """Each launch's steps summed and its longest program's, once (the fit calls `seconds` about 100,000 times)."""
        return [(float(s.sum()), float(s.max())) for s in self.launches if len(s)]

    def seconds(self, x: Costs) -> float:
        c = x.c8 if self.warps == 8 else x.c4
        c = x.gather if self.gathered and x.gather else c
        steps = sum(max(total * c / SMS, longest * max(x.lat, c)) for total, longest in self.totals)
        return (max(steps + self.rounds * x.round / SMS, self.hbm / x.bw, len(self.launches) * x.launch)
                + self.atomic / x.atomic)


@dataclass(frozen=True)
class Design:
    """The family's kernels as built (the constants of `triton_nsa`), or with one of `CHANGES` applied."""
    sel_kv_rows: int = triton_nsa.SEL_KV_ROWS  # rows a step of the sel dK, dV, dQ kernel
    kv_block: int = triton_nsa.KV_BLOCK  # keys a program of the cmp / win dK, dV kernel
    topn: str = "fused merge"  # block scores from one pass over the slots (a step a chunk of NB blocks), a merge
    # (a bitonic top-k, taken as 2 steps) where one enters; the design before: "insertion", 5 member products and
    # 16 insertion rounds a chunk, or with "early stop" until no row's candidate enters
    partial_bytes: int = 4  # bytes of an element of sel's per-block outputs (fp32; bf16: 2)
    dq_atomic: bool = False  # sel's dQ rows written per entry, summed by `_bwd_q` (its delta from sel's output); True:
    # added atomically (before 2026-11-29)
    forced_in_win: bool = False  # the forced blocks (first, local) read contiguously by `_fwd_win`, not by `_fwd_sel`
    kv_segment: int = triton_nsa.KV_SEGMENT  # queries a program of the cmp dK, dV kernel
    win_segments: int = 1  # parts a window key tile's queries are cut into (each a program)


BEFORE = {
    "sel dQ added atomically (before 2026-11-29)": dict(dq_atomic=True),
    "the top-n by insertion, 16 rounds a chunk (before 2026-11-29)": dict(topn="insertion"),
    "the top-n by insertion, stopping when no candidate enters": dict(topn="early stop"),
}
"""Designs the kernels had, or could have had, for comparison."""
CHANGES = {
    "64-row steps in the sel key-gradient kernel": dict(sel_kv_rows=64),
    "64 keys a program in the cmp / win key-gradient kernel": dict(kv_block=64),
    "sel partials in bf16": dict(partial_bytes=2),
    "forced blocks read by the window kernel": dict(forced_in_win=True),
    "shorter key-gradient programs (cmp 256 queries, window 2 parts)": dict(kv_segment=256, win_segments=2),
}
"""The kernel changes the issue asks the model to weigh, as `Design` fields."""


def _cdiv(a, b):
    return -(-a // b)


# ------------------------------------------------------------------------------------------- the inputs' work


@dataclass
class Work:
    """What the inputs at one T make the kernels do: the chosen blocks, and the top-n's streaming."""
    T: int
    idx: torch.Tensor  # (G, T, n) chosen blocks
    valid: torch.Tensor
    chunks: int = 0  # (tile, chunk of NB blocks) pairs the top-n walks
    early_rounds: int = 0  # insertion rounds if each chunk stops once no row's candidate enters
    merges: int = 0  # chunks where some row's candidate enters its top n
    extra: dict = field(default_factory=dict)


def chosen(T: int) -> tuple[Work, list[torch.Tensor]]:
    """The H100 run's inputs at T and the blocks the C++ family chooses on them (fp32)."""
    inputs, _ = build_core("fast", T, torch.device("cpu"))
    params = [p.detach() for p in inputs]
    with torch.no_grad():
        _, idx, valid = FAMILIES["cpp"]()(*params, SPEC, return_selection=True)
    return Work(T, idx[0], valid[0]), params


def selection(T: int) -> Work:
    """`chosen`, and the top-n's streaming over its blocks, tile by tile (`_streaming`)."""
    work, params = chosen(T)
    _streaming(work, params[0][0], params[1][0])
    return work


def _block_scores(q: torch.Tensor, kc: torch.Tensor, t: torch.Tensor, g: int) -> torch.Tensor:
    """Group g's sel block scores of the queries at positions t: exp(q . k_cmp - lse) summed over the group's
    heads and each block's cmp members (`common.choose_blocks`, without the forced blocks), (len(t), Ns)."""
    Nc, Ns = kc.shape[0], SPEC.num_sel_blocks(int(t[-1]) + 1)
    s = torch.einsum("thd,nd->thn", q[t, g * R:(g + 1) * R].float(), kc[:, g].float()).mul_(D**-0.5)
    seen = (torch.arange(Nc) * SPEC.d + SPEC.l - 1)[None, :] <= t[:, None]
    s.masked_fill_(~seen[:, None, :], float("-inf"))
    p = s.sub_(torch.logsumexp(s, -1, keepdim=True)).exp_().nan_to_num_(0.0).sum(1)  # (t, Nc), in place: 100 MB a span
    stride, before = SPEC.l_sel // SPEC.d, SPEC.l // SPEC.d - 1
    padded = torch.nn.functional.pad(p, (before, stride * Ns + stride - Nc - before))
    return sum(padded[:, k:k + stride * Ns:stride] for k in range(stride + before))


def _streaming(work: Work, q: torch.Tensor, kc: torch.Tensor, span: int = 2040) -> None:
    """Walk each tile's blocks as `_fwd_cmp` does (NB at a time, its queries' running top n): the chunks, the
    rounds an insertion that stops once no row's candidate enters would take, and the chunks with an entry."""
    T, n, chunk = work.T, SPEC.n, triton_nsa.topn_blocks(SPEC, SPEC.n)
    bt = triton_nsa.ROWS // R
    for g in range(G):
        for a in range(0, T, span):
            t = torch.arange(a, min(T, a + span))
            score = _block_scores(q, kc, t, g)
            jt = t // SPEC.l_sel
            j = torch.arange(score.shape[1])[None, :]
            score = torch.where(j > jt[:, None], float("-inf"),
                                torch.where((j == 0) | (j >= jt[:, None] - 1), float("inf"), score))
            top = torch.full((len(t), n), float("-inf"))
            tiles = (t - a) // bt
            for c0 in range(0, int(jt.max()) + 1, chunk):
                cand = score[:, c0:c0 + chunk]
                live = (jt >= c0)  # the tile walks this chunk for its queries that reach it
                merged = torch.cat([top, cand], 1)
                new = merged.topk(n, 1).values
                entered = ((cand[:, :, None] >= new[:, None, -1:]) & (cand[:, :, None] > float("-inf"))).any(-1)
                entering = torch.where(live, entered.sum(1).clamp(max=n), 0)
                top = torch.where(live[:, None], new, top)
                per_tile = torch.zeros(int(tiles.max()) + 1, dtype=torch.long).scatter_reduce(
                    0, tiles, entering, "amax")
                walked = torch.zeros_like(per_tile).scatter_reduce(0, tiles, live.long(), "amax")
                work.chunks += int(walked.sum())
                work.early_rounds += int(torch.where(per_tile < chunk, per_tile + 1, per_tile)[walked > 0].sum())
                work.merges += int((per_tile > 0).sum())


def readers(work: Work, forced: bool = True) -> torch.Tensor:
    """The queries that chose each sel block (G x blocks); without the forced ones (first, local) if not forced."""
    idx, valid = work.idx, work.valid
    if not forced:
        jt = torch.arange(work.T)[None, :, None] // SPEC.l_sel
        valid = valid & (idx != 0) & (idx < jt - 1)
    counts = torch.zeros(idx.shape[0], SPEC.num_sel_blocks(idx.shape[1]), dtype=torch.long)
    return counts.scatter_add_(1, torch.where(valid, idx, 0).flatten(1), valid.flatten(1).long()).flatten()


def unions(work: Work, bt: int) -> torch.Tensor:
    """Distinct blocks chosen by each tile of bt consecutive queries (G x tiles)."""
    Gn, T, n = work.idx.shape
    blocks = torch.where(work.valid, work.idx, -1)
    tiles = torch.nn.functional.pad(blocks, (0, 0, 0, -T % bt), value=-1).view(Gn, -1, bt * n)
    ordered = tiles.sort(-1).values
    distinct = (ordered[..., 1:] != ordered[..., :-1]) & (ordered[..., 1:] >= 0)
    return (distinct.sum(-1) + (ordered[..., 0] >= 0)).flatten()


def query_tiles(T: int, bt: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per tile of bt queries (both groups): steps over the cmp slots it sees, over its window, and the top-n's
    chunks of NB sel blocks."""
    first = torch.arange(0, T, bt)
    last = torch.clamp(first + bt, max=T) - 1
    cmp = _cdiv(torch.clamp((last + 1) // SPEC.d, max=SPEC.num_cmp_blocks(T)), 64)
    win = _cdiv(last + 1 - torch.clamp(first - SPEC.w + 1, min=0), 64)
    topn = _cdiv((last + 1) // SPEC.l_sel + 1, triton_nsa.topn_blocks(SPEC, SPEC.n))
    return cmp.repeat(G), win.repeat(G), topn.repeat(G)


def key_tiles(T: int, rows: int, key_block: int, segment: int, heads: int) -> torch.Tensor:
    """Steps of `rows` queries of each program of the cmp dK, dV: a tile of key_block slots x a segment of
    queries (x heads programs of one head each, or one of all)."""
    steps = []
    for j in range(0, SPEC.num_cmp_blocks(T), key_block):
        seen_from = j * SPEC.d + SPEC.l - 1
        steps += [max(0, _cdiv(min(T, s + segment) - max(seen_from, s), rows)) for s in range(0, T, segment)]
    return torch.tensor(steps).repeat(heads * G)


def spans(counts: torch.Tensor, bt: int) -> torch.Tensor:
    """Steps of each program over the inverse index (`triton_nsa_sel`): READER_STEPS * bt entries of the blocks'
    readers end to end, bt a step, and a step for each block it reaches (its keys loaded, for dK, dV its sums added)."""
    span = triton_nsa.READER_STEPS * bt
    ends = counts.cumsum(0)
    steps = torch.zeros(_cdiv(int(ends[-1]), span), dtype=torch.long)
    for first, last in zip((ends - counts).tolist(), ends.tolist()):
        for p in range(first // span, _cdiv(last, span)):
            steps[p] += _cdiv(min(last, (p + 1) * span) - max(first, p * span), bt) + 1
    return steps


# ------------------------------------------------------------------------------------------------ the kernels


def old_kernels(work: Work) -> dict[str, Kernel]:
    """The branch-wise kernels (d678f0f) by the profile's names: sel tiles of 10 queries x 6 heads (4 warps), its
    dK, dV one program per block and head over 32 gathered readers a step (8 warps); cmp / win tiles of 8 queries x
    8 (padded) heads (4 warps), the cmp forward twice over its slots (the second pass writing the group's scores);
    the cmp dK, dV one head a program over 32 queries a step in 3 segments, the win dK, dV 4 queries x 8 heads a
    step (8 warps)."""
    T = work.T
    u = unions(work, 10)
    cmp, win, _ = query_tiles(T, 8)
    segment = _cdiv(_cdiv(T, 3), 32) * 32
    win_kv = torch.full((_cdiv(T, 64) * G,), _cdiv(64 + SPEC.w - 1, 4))
    entries = int(work.valid.sum())
    scores = G * T * SPEC.num_cmp_blocks(T) * 4  # the group scores the cmp forward wrote, `_choose` read
    return {"_sel_fwd": Kernel([u], 4), "_sel_bwd_dq": Kernel([u], 4),
            "_sel_bwd_dkv": Kernel([_cdiv(readers(work), 32).repeat(R)], 8, True, hbm=entries * R * (2 * D * 2 + 8)),
            "_fwd (cmp + win)": Kernel([2 * cmp, win], 4, hbm=scores), "_bwd_dq (cmp + win)": Kernel([cmp, win], 4),
            "_bwd_dkv (cmp + win)": Kernel([key_tiles(T, 32, 64, segment, R), win_kv], 8)}


def choose_rounds(T: int) -> tuple[int, float]:
    """The profile's `_choose`: 16 rounds a program of 4,096 // Ns' scores rows, all B G T rows; its bytes read."""
    nsp = 1 << (SPEC.num_sel_blocks(T) - 1).bit_length()
    return _cdiv(G * T, max(1, 4096 // nsp)) * SPEC.n, G * T * SPEC.num_cmp_blocks(T) * 4


def new_kernels(work: Work, x: Design) -> dict[str, Kernel]:
    """The Triton family's kernels under design x: tiles of bt = 10 queries x 6 heads, 8 warps each. Bytes: q, dO
    and each output once (bf16), the gathers and buffers of the sel kernels both ways, the fills and casts."""
    T = work.T
    bt = triton_nsa.ROWS // R
    bt_kv = max(1, x.sel_kv_rows // R)
    cmp, win, topn = query_tiles(T, bt)
    counts = readers(work, forced=not x.forced_in_win)
    entries = int(counts.sum())
    q_bytes = T * G * R * D * 2  # q, dO or an output, bf16
    part = entries * R * (D * x.partial_bytes + 4)  # sel's per-entry outputs and logsumexps
    lists = entries * 4 * 3  # the reader lists and each entry's place: written, then read
    if x.topn == "fused merge":  # the slots again, 64 a step (one a chunk), and a merge (2 steps) where one enters
        cmp_steps, rounds = cmp + topn + 2 * work.merges / len(cmp), 0
    else:  # a chunk: its 5 member products (a step each) and the insertion rounds
        cmp_steps, rounds = cmp + 5 * topn, 16 * work.chunks if x.topn == "insertion" else work.early_rounds
    n_sel = min(SPEC.n, SPEC.num_sel_blocks(T))
    forced = 3 if x.forced_in_win else 0  # first + 2 local blocks: 4 steps of sel keys in the window kernel
    kernels = {
        "_fwd_cmp": Kernel([cmp_steps], rounds=rounds, hbm=2 * q_bytes + G * T * n_sel * 9),
        "_fwd_win": Kernel([win + (4 if forced else 0)], hbm=2 * q_bytes + lists, atomic=entries * 4),
        "_fwd_sel": Kernel([spans(counts, bt)], gathered=True, hbm=entries * R * D * 2 + part + entries * 4),
        "_fwd_mix": Kernel([torch.full_like(win, n_sel - forced)], gathered=True, hbm=part + 4 * q_bytes + entries * 8),
        "_bwd_q": Kernel([cmp + win + (4 if forced else 0)], hbm=6 * q_bytes),
    }
    sel_kv = spans(counts, bt_kv)
    visits = int(sel_kv.sum()) - int(_cdiv(counts, bt_kv).sum())  # (block, program) pairs: a key-gradient add each
    gathered = entries * R * (2 * D * 2 + 12) + entries * 4  # q, dO, gate / lse / delta, the reader
    dq = entries * R * D * 4
    if x.dq_atomic:
        kernels["_bwd_sel_kv"] = Kernel([sel_kv], gathered=True, hbm=gathered, atomic=visits * 2 * SPEC.l_sel * D * 4 + dq)
    else:  # each entry's rows written, with sel's output gathered for delta; `_bwd_q` sums a query's n (gathered)
        kernels["_bwd_sel_kv"] = Kernel([sel_kv], gathered=True, hbm=gathered + entries * R * D * 2 + dq,
                                        atomic=visits * 2 * SPEC.l_sel * D * 4)
        kernels["_bwd_q: sel's dQ rows"] = Kernel([torch.full_like(win, n_sel - forced)], gathered=True, hbm=dq)
    kv = x.kv_block
    cmp_kv = key_tiles(T, bt, kv, x.kv_segment, 1)
    win_kv = torch.full((_cdiv(T, kv) * G * x.win_segments,), _cdiv(_cdiv(kv + SPEC.w - 1, x.win_segments), bt))
    if forced:  # the local blocks' dK, dV with the window's; the first block's over segments of queries
        win_kv = win_kv + _cdiv(kv + 2 * SPEC.l_sel, bt)
        kernels["_bwd_first"] = Kernel([torch.full((_cdiv(T, triton_nsa.KV_SEGMENT) * G,),
                                                   _cdiv(triton_nsa.KV_SEGMENT, bt))],
                                       atomic=_cdiv(T, triton_nsa.KV_SEGMENT) * G * 2 * SPEC.l_sel * D * 4)
    kernels["_bwd_kv (cmp)"] = Kernel([cmp_kv], hbm=3 * q_bytes, atomic=len(cmp_kv) * 2 * kv * D * 4)
    kernels["_bwd_kv (win)"] = Kernel([win_kv], hbm=3 * q_bytes, atomic=len(win_kv) * 2 * kv * D * 4)
    grads = (T * G * R * D + 2 * SPEC.num_cmp_blocks(T) * G * D + 4 * T * G * D) * 4  # the fp32 gradient buffer
    index = (2 * entries + 2 * G * T) * 4
    kernels["fills, cumsum, casts"] = Kernel(  # index fill, cumsum (read + write), gradient fill, cast (4 + 2 bytes)
        [torch.zeros(1)] * 5, hbm=index + 2 * G * T * 4 * 2 + grads + grads * 6 // 4 + T * 12 * 3 * 4 * 3)
    return kernels


# ------------------------------------------------------------------------------------- the flex family's kernels


def flex_pairs(T: int, kind: str, ids: torch.Tensor | None = None) -> tuple[int, int]:
    """(full, partial) FlexAttention blocks (FLEX_TILE queries x FLEX_TILE keys) of one head under a mask: `docs`
    (causal within the documents `ids` (T,)), `cmp` (query t sees compressed slot i once its block ends, i d + l - 1
    <= t; Nc slots) or `win` (keys t - w < s <= t). A full block runs without the mask; a partial one evaluates it;
    a block past the keys' end is partial."""
    nq = _cdiv(T, FLEX_TILE)
    S = SPEC.num_cmp_blocks(T) if kind == "cmp" else T
    a = torch.arange(nq)[:, None] * FLEX_TILE  # a query block's first row, its last a + 127
    c = torch.arange(_cdiv(S, FLEX_TILE))[None, :] * FLEX_TILE  # a key block's first key
    inside = c + FLEX_TILE <= S
    if kind == "docs":
        pad = torch.nn.functional.pad(ids, (0, nq * FLEX_TILE - T), value=-1).view(nq, FLEX_TILE)
        lo, hi = pad.masked_fill(pad < 0, 1 << 30).min(1).values, pad.max(1).values
        same = (lo == hi)[:, None] & (lo == hi)[None, :] & (lo[:, None] == lo[None, :])
        before = c < a
        full = before & same & inside
        any_seen = (c == a) | (before & (lo[None, :] <= hi[:, None]) & (hi[None, :] >= lo[:, None]))
    elif kind == "cmp":
        full = ((c + FLEX_TILE - 1) * SPEC.d + SPEC.l - 1 <= a) & inside
        any_seen = c * SPEC.d + SPEC.l - 1 <= a + FLEX_TILE - 1
    else:
        full = (c + FLEX_TILE - 1 <= a) & (c > a + FLEX_TILE - 1 - SPEC.w) & inside
        any_seen = (c <= a + FLEX_TILE - 1) & (c + FLEX_TILE - 1 > a - SPEC.w)
    return int(full.sum()), int((any_seen & ~full).sum())


@dataclass(frozen=True)
class FlexCosts:
    """ms of FlexAttention's forward + backward for a full and for a partial block of one head (fitted on FLEX),
    and the worst in-sample ratio of measured to fitted (the pessimistic factor)."""
    full: float
    partial: float
    worst: float

    def ms(self, pairs: tuple[int, int], heads: int = G * R, worse: bool = False) -> float:
        return heads * (pairs[0] * self.full + pairs[1] * self.partial) * (self.worst if worse else 1.0)


def flex_fit(verbose: bool = True) -> FlexCosts:
    """A full and a partial block's cost from the six FLEX measurements (fwd + bwd), least squares of the
    relative errors; printed with each measurement predicted back."""
    from benchmarks.kernels.document_masking import document_ids

    rows = [(T, doc, flex_pairs(T, "docs", document_ids(T, doc)[0]), both) for T, docs in FLEX.items()
            for doc, (_, both) in docs.items()]
    a = torch.tensor([[f / y, p / y] for _, _, (f, p), y in rows], dtype=torch.float64) * G * R
    full, partial = torch.linalg.lstsq(a, torch.ones(len(rows), 1, dtype=torch.float64)).solution.flatten().tolist()
    fitted = FlexCosts(full, partial, 1.0)
    ratios = [y / fitted.ms(pairs) for _, _, pairs, y in rows]
    if verbose:
        print(f"FlexAttention on the H100 (2026-11-28, dense with documents, fwd + bwd): {full * 1e6:.1f} ns a full "
              f"block of {FLEX_TILE} x {FLEX_TILE} and one head, {partial * 1e6:.1f} ns a partial one (fitted on 6)")
        print(table([[f"{T:,}", f"{doc:,}", f"{f:,}", f"{p:,}", f"{y:.3f}", f"{fitted.ms((f, p)):.3f}", f"{r:.2f}"]
                     for (T, doc, (f, p), y), r in zip(rows, ratios)],
                    ["T", "mean document", "full blocks", "partial blocks", "measured (ms)", "fitted (ms)",
                     "measured / fitted"]))
    return replace(fitted, worst=max(ratios))


TOPN_PASS = "_fwd_cmp (top-n from Flex's log-sum-exp)"


def flex_kernels(work: Work, x: Design) -> dict[str, Kernel]:
    """The flex family's work besides FlexAttention: sel by the Triton kernels over the blocks their top-n pass
    chooses from Flex's cmp log-sum-exp (`_fwd_cmp` without its cmp pass, `_fwd_win` listing the readers alone,
    `_bwd_q` the gate gradients and sel's dQ rows alone), and the branches' gated sum (compiled, MIXING_BYTES)."""
    T = work.T
    triton_kernels = new_kernels(work, x)
    cmp, win, topn = query_tiles(T, triton_nsa.ROWS // R)
    n_sel = min(SPEC.n, SPEC.num_sel_blocks(T))
    q_bytes = T * G * R * D * 2
    entries = int(readers(work, forced=True).sum())
    one = torch.ones_like(win)
    kept = ("_fwd_sel", "_fwd_mix", "_bwd_sel_kv", "_bwd_q: sel's dQ rows", "fills, cumsum, casts")
    return {TOPN_PASS: Kernel([topn + 2 * work.merges / len(cmp)],
                                                              hbm=2 * q_bytes + G * T * n_sel * 9 + T * G * R * 4),
            "_fwd_win (reader lists)": Kernel([one], hbm=entries * 4 * 3, atomic=entries * 4),
            **{k: triton_kernels[k] for k in kept},
            "_bwd_q (gates)": Kernel([one], hbm=6 * q_bytes),
            "gated sum (compiled)": Kernel([torch.zeros(1)] * 2, hbm=MIXING_BYTES * T * G * R * D)}


def predict_flex(works: list[Work], flex: FlexCosts, fitted: tuple[Costs, Costs], triton: dict
                 ) -> dict[int, tuple[float, float]]:
    """The flex family at each T, fitted and pessimistic, beside the Triton family's (`predict`): Flex's cmp and
    win from their blocks, the rest from `flex_kernels`; printed, and returned as {T: (fitted, pessimistic) ms}."""
    rows, totals = [], {}
    for w in works:
        T = w.T
        cmp_pairs, win_pairs = flex_pairs(T, "cmp"), flex_pairs(T, "win")
        rest = flex_kernels(w, Design())
        rest_fit = sum(1e3 * k.seconds(fitted[0]) for k in rest.values())
        rest_pes = sum(1e3 * max(k.seconds(c.worse()) for c in fitted) for k in rest.values())
        sel = ("_fwd_win (reader lists)", "_fwd_sel", "_fwd_mix", "_bwd_sel_kv", "_bwd_q: sel's dQ rows")
        sel_fit = sum(1e3 * rest[k].seconds(fitted[0]) for k in sel)
        fit = flex.ms(cmp_pairs) + flex.ms(win_pairs) + rest_fit
        pes = flex.ms(cmp_pairs, worse=True) + flex.ms(win_pairs, worse=True) + rest_pes
        totals[T] = (fit, pes)
        dense = DENSE.get(T, float("nan"))
        rows.append([f"{T:,}", f"{flex.ms(cmp_pairs):.2f}", f"{flex.ms(win_pairs):.2f}",
                     f"{1e3 * rest[TOPN_PASS].seconds(fitted[0]):.2f}",
                     f"{sel_fit:.2f}", f"{1e3 * rest['gated sum (compiled)'].seconds(fitted[0]):.2f}",
                     f"{fit:.2f} / {pes:.2f}", f"{triton[T][0]:.2f} / {triton[T][1]:.2f}",
                     f"{dense / fit:.2f}x / {dense / pes:.2f}x",
                     f"{dense / triton[T][0]:.2f}x / {dense / triton[T][1]:.2f}x"])
    print(table(rows, ["T", "Flex cmp", "Flex win", "top-n pass", "sel (Triton)", "gated sum",
                       "flex family, fitted / pessimistic (ms)", "Triton family (ms)", "dense / flex",
                       "dense / Triton"]))
    return totals


# -------------------------------------------------------------------------------------------- the calibration


GATHERED = "_sel_bwd_dkv"
"""The one profiled kernel that gathered its rows; it was also the one with a long program (the first block's
readers, Tq / 32 steps): its time is explained by either, and the profile cannot tell which."""


def fit(old: dict[str, Kernel], leave_out: str | None = None, gathers: bool = False) -> Costs:
    """The constants minimising the squared log ratios of predicted to measured times over the profile's tile
    kernels (but `leave_out`), by a grid that narrows; the round's cost from `_choose` alone. Two explanations of
    GATHERED: its long program (`gathers` False: c4, c8 and lat fitted on all six, a gathered step costs a step)
    or its gathers (True: c4 and c8 on the other five, no tail beyond a step, a gathered step its own cost)."""
    names = [k for k in MEASURED_32K if k != leave_out and not (gathers and k == GATHERED)]
    rounds, read = choose_rounds(32768)
    round_s = max(CHOOSE_32K * 1e-3 - read / 3.0e12, 0.0) * SMS / rounds

    def costs(p: tuple[float, ...]) -> Costs:
        return Costs(math.exp(p[0]), math.exp(p[1]), 0.0 if gathers else math.exp(p[2]), round=round_s)

    def loss(p: tuple[float, ...]) -> float:
        return sum(math.log(old[k].seconds(costs(p)) * 1e3 / MEASURED_32K[k]) ** 2 for k in names)

    best, width, dims = (math.log(6e-7),) * 3, 3.0, 2 if gathers else 3
    for _ in range(7):
        axis = [width * i / 6 for i in range(-6, 7)]
        grid = [(best[0] + a, best[1] + b, best[2] + (c if dims == 3 else 0.0)) for a in axis for b in axis
                for c in (axis if dims == 3 else [0.0])]
        best = min(grid, key=loss)
        width /= 4
    x = costs(best)
    if gathers:  # the gathered kernel's time, all of it its steps'
        k = old[GATHERED]
        x = replace(x, gather=MEASURED_32K[GATHERED] * 1e-3 * SMS / sum(float(s.sum()) for s in k.launches))
    return x


def table(rows: list[list], head: list[str]) -> str:
    return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
                     + ["| " + " | ".join(str(c) for c in r) + " |" for r in rows])


def calibration(old: dict[str, Kernel]) -> tuple[Costs, Costs]:
    """Print the fit: each tile kernel predicted back in sample and with itself left out; returns the fitted
    constants and those of the other explanation of GATHERED (`fit`)."""
    x, y = fit(old), fit(old, gathers=True)
    print(f"Calibration on the H100 profile at T 32,768: a step costs {x.c4 * 1e6:.3f} us of an SM with 4 warps, "
          f"{x.c8 * 1e6:.3f} us with 8, {x.lat * 1e6:.2f} us alone; an insertion round {x.round * 1e6:.3f} us "
          f"(from `_choose`, which alone measures it: it cannot be left out). If {GATHERED} was slow for its "
          f"gathers, not its long program: {y.c4 * 1e6:.3f} / {y.c8 * 1e6:.3f} us a step, {y.gather * 1e6:.2f} us a "
          f"gathered one (the pessimistic prediction takes the worse of the two for each kernel)")
    rows = []
    for k, kernel in old.items():
        ms, loo = 1e3 * kernel.seconds(x), 1e3 * kernel.seconds(fit(old, leave_out=k))
        r, rl = ms / MEASURED_32K[k], loo / MEASURED_32K[k]
        rows.append([k, kernel.warps, f"{sum(int(s.sum()) for s in kernel.launches):,}", f"{MEASURED_32K[k]:.3f}",
                     f"{ms:.3f}", f"{r:.2f}", f"{loo:.3f}", f"{rl:.2f}",
                     "yes" if abs(r - 1) <= 0.3 and abs(rl - 1) <= 0.3 else "no"])
    print(table(rows, ["branch-wise kernel", "warps", "steps", "measured (ms)", "fitted (ms)", "fitted / measured",
                       "left out (ms)", "left out / measured", "both within 30%"]))
    print(f"Left out, two cannot be fitted: {GATHERED} is the only kernel bound by its longest program (it alone "
          f"measures lat), and the two 8-warp kernels measure the 8-warp step alone (with one left out, the other "
          f"cannot fix it: {GATHERED} is bound by its tail).")
    return x, y


def predict(works: list[Work], design: Design, fitted: tuple[Costs, Costs], verbose: bool
            ) -> dict[int, tuple[float, float, float, float]]:
    """Each kernel's time at each T, fitted and pessimistic (the worse of both explanations, pessimistic rates);
    returns {T: (fitted ms, pessimistic ms, their forward parts)}."""
    totals, rows = {}, []
    for w in works:
        kernels = new_kernels(w, design)
        fit_ms = {k: 1e3 * v.seconds(fitted[0]) for k, v in kernels.items()}
        pes_ms = {k: 1e3 * max(v.seconds(x.worse()) for x in fitted) for k, v in kernels.items()}
        totals[w.T] = (sum(fit_ms.values()), sum(pes_ms.values()),
                       sum(v for k, v in fit_ms.items() if k.startswith("_fwd")),
                       sum(v for k, v in pes_ms.items() if k.startswith("_fwd")))
        for k, v in kernels.items():
            rows.append([f"{w.T:,}", k, f"{sum(len(s) for s in v.launches):,}",
                         f"{sum(int(s.sum()) for s in v.launches):,}", f"{max(int(s.max()) for s in v.launches):,}",
                         f"{int(v.rounds):,}", f"{v.hbm / 1e6:,.1f}", f"{v.atomic / 1e6:,.1f}", f"{fit_ms[k]:.3f}",
                         f"{pes_ms[k]:.3f}"])
    if verbose:
        print(table(rows, ["T", "kernel", "programs", "steps", "longest program (steps)", "top-n rounds", "HBM (MB)",
                           "atomic adds (MB)", "fitted (ms)", "pessimistic (ms)"]))
    return totals


def verdicts(totals: dict[int, tuple[float, float, float, float]]) -> None:
    rows = []
    for T, (f, p, _, _) in totals.items():
        target = TARGETS.get(T, (float("nan"),) * 2)
        rf, rp = DENSE.get(T, float("nan")) / f, DENSE.get(T, float("nan")) / p
        rows.append([f"{T:,}", f"{f:.2f}", f"{p:.2f}", f"{DENSE.get(T, float('nan')):.2f}", f"{rf:.2f}x",
                     f"{rp:.2f}x", f"{target[0]}x / {target[1]}x",
                     f"{'yes' if rf >= target[0] else 'no'} / {'yes' if rp >= target[1] else 'no'}"])
    print(table(rows, ["T", "fitted NSA fwd+bwd (ms)", "pessimistic (ms)", "dense cuDNN measured (ms)",
                       "dense / NSA, fitted", "pessimistic", "target (fitted / pessimistic)", "met"]))


def outside_attention(attention: str, T: int) -> float:
    """M7C's training FLOPs per token outside the attention (weights, compression), from the model itself."""
    import warnings

    from nsa_titan.config import load_config
    from nsa_titan.models.transformer import Transformer

    cfg, _ = load_config(["--config", str(ROOT / "train_configs" / "m7c.toml"), "--model.vocab_size", "49152",
                          "--model.attention", attention])
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = Transformer(cfg.model, T)
    m = cfg.model
    keys = SPEC.mean_keys_per_query(T) if attention == "nsa" else (T + 1) / 2
    return model.flops_per_token(T) - 3 * m.n_layers * 4 * m.n_heads * m.head_dim * keys


def training(totals: dict[int, tuple[float, float, float, float]], layers: int = 12) -> None:
    """M7C training tokens/s, NSA against dense on FlexAttention with documents: the time outside the attention
    from the profile's NSA run (its attention taken out; dense's scaled by its FLOPs there), each layer's
    attention fwd + bwd and, for the full activation checkpointing m7c.toml runs, its forward once more."""
    tok_s, both, fwd = TRAINED_8K
    outside_nsa = 1 / tok_s - layers * (both + fwd) * 1e-3 / 8192  # seconds a token
    rows = []
    for T in [t for t in totals if t in TRAIN_TARGETS]:
        f, p, ff, pf = totals[T]
        outside_dense = outside_nsa * outside_attention("dense", T) / outside_attention("nsa", T)
        nsa = [1 / (outside_nsa + layers * (a + b) * 1e-3 / T) for a, b in ((f, ff), (p, pf))]
        free = 1 / outside_nsa
        for doc, (dfwd, dboth) in FLEX[T].items():
            dense = 1 / (outside_dense + layers * (dboth + dfwd) * 1e-3 / T)
            rows.append([f"{T:,}", f"{doc:,}", f"{dense:,.0f}", f"{nsa[0]:,.0f} / {nsa[1]:,.0f}",
                         f"{nsa[0] / dense:.2f}x / {nsa[1] / dense:.2f}x", f"{TRAIN_TARGETS[T]}x",
                         f"{free / dense:.2f}x"])
    print(table(rows, ["T", "mean document", "dense Flex (tokens/s)", "NSA, fitted / pessimistic",
                       "NSA / dense", "target", "NSA / dense if NSA's attention cost nothing"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--T", type=int, nargs="+", default=[8192, 32768, 65536])
    parser.add_argument("--changes", action="store_true", help="the predicted effect of each change in CHANGES")
    a = parser.parse_args()
    fitted = calibration(old_kernels(selection(32768)))
    works = [selection(T) for T in a.T]
    print()
    totals = predict(works, Design(), fitted, verbose=True)
    verdicts(totals)
    print("\nThe flex family (FlexAttention's cmp and win, sel by the Triton kernels), ms fwd + bwd, beside the Triton "
          "family; dense is cuDNN as measured:")
    predict_flex(works, flex_fit(), fitted, totals)
    print("\nM7C training (one H100, bf16, AC full; NSA's attention predicted without documents):")
    training(totals)
    if a.changes:
        print("\nEach change alone, then all together; designs before, for comparison (total ms, fitted / pessimistic, "
              "at each T, and the speed-up over the kernels as they are):")
        base = predict(works, Design(), fitted, verbose=False)
        rows = []
        alone = {name: predict(works, replace(Design(), **fields), fitted, verbose=False)
                 for name, fields in CHANGES.items()}
        paying = {k: v for name, f in CHANGES.items() if all(alone[name][T][0] < base[T][0] for T in a.T)
                  for k, v in f.items()}
        for name, got in [*alone.items(),
                          ("all that pay at every T", predict(works, replace(Design(), **paying), fitted, False)),
                          *((n, predict(works, replace(Design(), **f), fitted, False)) for n, f in BEFORE.items())]:
            rows.append([name] + [f"{got[T][0]:.2f} / {got[T][1]:.2f} ({base[T][0] / got[T][0]:.2f}x)" for T in a.T])
        print(table(rows, ["change"] + [f"T {T:,}" for T in a.T]))


if __name__ == "__main__":
    main()
