"""The Triton family's forward + backward time on an H100, predicted on a CPU before any GPU run.

    python benchmarks/gpu_prediction.py [--T 8192 32768 65536]

A step model. Every kernel of the family is a grid of programs, each a loop of steps over tiles (a 64-row tile
of queries x heads against a tile of keys: load, two to four products, the online softmax); the H100 profile of
2026-11-28 (`gpu_reports/2026-11-28-h100.md`) shows such kernels bound by their steps, not by their products:
the branch-wise sel forward and dQ ran the same steps with two and three products in the same 2.66 ms, and
steps of 32 rows cost what steps of 64 did. So a kernel's time is

    max(all its programs' steps x c / 132 SMs,  its longest program's steps x lat)

with c the cost of a step while the GPU is full, and lat the latency of a step of a program that runs alone
(the tail: the branch-wise sel dK, dV walked the first block, which every query reads, in one program of
Tq / 32 steps). Both are fitted (least squares of the log ratios) on the six tile kernels of that profile, their
programs and steps counted from their code at d678f0f; each is then predicted back. Steps are counted on the sel
blocks a real selection chooses: the inputs of `benchmarks/gpu_attention.py` (the M7C attention, random,
seeded), their blocks chosen by the C++ family. The prediction is put against cuDNN's measured dense time.

Two costs of the new kernels had no counterpart in that profile: sel's per-block outputs, written by
`_fwd_sel` and read by `_fwd_mix` (a kernel takes at least their bytes at HBM_RATE), and the atomic adds
(sel's dQ rows every step, each program's key gradients once; their bytes added at ATOMIC_RATE, an
assumption). Left out: occupancy differences (the new kernels hold one block of 8 warps per SM,
`triton_compile.py`), L2 behaviour, and the profile's `_choose` (0.62 ms: not a tile kernel, and not bound
by its bytes, 0.16 ms at HBM_RATE; the new op has no such kernel, its top-n is steps of `_fwd_cmp`). It
says where the time would go and whether the targets are within reach, not what a GPU will measure.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from attention_speed import build_core  # noqa: E402  (the H100 run's inputs)

from nsa_titan.models.attention import NSASpec  # noqa: E402
from nsa_titan.models.attention import triton_nsa  # noqa: E402
from nsa_titan.models.attention.families import FAMILIES  # noqa: E402

SPEC = NSASpec(l=32, d=16, l_sel=64, n=16, w=512)
G, R, SMS = 2, 6, 132
MEASURED_32K = {  # ms of GPU time per kernel name, forward + backward at T 32,768 (gpu_reports/2026-11-28-h100.md)
    "_sel_fwd": 2.659, "_sel_bwd_dq": 2.665, "_sel_bwd_dkv": 3.496, "_fwd (cmp + win)": 1.799,
    "_bwd_dq (cmp + win)": 1.090, "_bwd_dkv (cmp + win)": 2.411}
DENSE = {8192: 1.030, 32768: 13.309, 65536: 53.300}
"""cuDNN's causal attention fwd + bwd (ms) on that H100, the fastest dense kernel there."""
TARGETS = {8192: 1.0, 32768: 2.5, 65536: 4.0}
HBM_RATE = 3.35e12
"""Bytes a second an H100 SXM's HBM3 moves (its data sheet)."""
ATOMIC_RATE = 1.0e12
"""Bytes a second of fp32 atomic adds in L2, assumed (not measured): about a third of an H100's HBM bandwidth."""
Steps = list[torch.Tensor]
"""A kernel's launches, each the steps of its programs."""


def _cdiv(a, b):
    return -(-a // b)


def selection(T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The sel blocks (idx, valid (G, T, n)) the H100 run's inputs choose (C++ family, fp32)."""
    inputs, _ = build_core("fast", T, torch.device("cpu"))
    with torch.no_grad():
        _, idx, valid = FAMILIES["cpp"]()(*[p.detach() for p in inputs], SPEC, return_selection=True)
    return idx[0], valid[0]


def unions(idx: torch.Tensor, valid: torch.Tensor, bt: int) -> torch.Tensor:
    """Distinct blocks chosen by each tile of bt consecutive queries (G x tiles)."""
    Gn, T, n = idx.shape
    blocks = torch.where(valid, idx, -1)
    tiles = torch.nn.functional.pad(blocks, (0, 0, 0, -T % bt), value=-1).view(Gn, -1, bt * n)
    ordered = tiles.sort(-1).values
    distinct = (ordered[..., 1:] != ordered[..., :-1]) & (ordered[..., 1:] >= 0)
    return (distinct.sum(-1) + (ordered[..., 0] >= 0)).flatten()


def readers(idx: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """The queries that chose each sel block (G x blocks)."""
    counts = torch.zeros(idx.shape[0], SPEC.num_sel_blocks(idx.shape[1]), dtype=torch.long)
    return counts.scatter_add_(1, torch.where(valid, idx, 0).flatten(1), valid.flatten(1).long()).flatten()


def query_tiles(T: int, bt: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per tile of bt queries (both groups): steps over the cmp slots it sees, over its window, and the top-n's
    steps of 16 sel blocks."""
    first = torch.arange(0, T, bt)
    last = torch.clamp(first + bt, max=T) - 1
    cmp = _cdiv(torch.clamp((last + 1) // SPEC.d, max=SPEC.num_cmp_blocks(T)), 64)
    win = _cdiv(last + 1 - torch.clamp(first - SPEC.w + 1, min=0), 64)
    topn = _cdiv((last + 1) // SPEC.l_sel + 1, triton_nsa.CHUNK)
    return cmp.repeat(G), win.repeat(G), topn.repeat(G)


def key_tiles(T: int, rows: int, key_block: int, segment: int, heads: int) -> torch.Tensor:
    """Steps of `rows` queries of each program of the cmp dK, dV: a tile of key_block slots x a segment of
    queries (x heads programs of one head each, or one of all)."""
    steps = []
    for j in range(0, SPEC.num_cmp_blocks(T), key_block):
        seen_from = j * SPEC.d + SPEC.l - 1
        steps += [max(0, _cdiv(min(T, s + segment) - max(seen_from, s), rows)) for s in range(0, T, segment)]
    return torch.tensor(steps).repeat(heads * G)


def old_kernels(T: int, idx: torch.Tensor, valid: torch.Tensor) -> dict[str, Steps]:
    """The branch-wise kernels (d678f0f) by the profile's names: sel tiles of 10 queries x 6 heads, its dK, dV
    one program per block and head over 32 readers a step; cmp / win tiles of 8 queries x 8 (padded) heads, the
    cmp forward twice over its slots (the second pass for the group's scores); the cmp dK, dV one head a program
    over 32 queries a step in 3 segments (1,024 programs wanted), the win dK, dV 4 queries x 8 heads a step."""
    u = unions(idx, valid, 10)
    cmp, win, _ = query_tiles(T, 8)
    segment = _cdiv(_cdiv(T, 3), 32) * 32
    win_kv = torch.full((_cdiv(T, 64) * G,), _cdiv(64 + SPEC.w - 1, 4))
    return {"_sel_fwd": [u], "_sel_bwd_dq": [u], "_sel_bwd_dkv": [_cdiv(readers(idx, valid), 32).repeat(R)],
            "_fwd (cmp + win)": [2 * cmp, win], "_bwd_dq (cmp + win)": [cmp, win],
            "_bwd_dkv (cmp + win)": [key_tiles(T, 32, 64, segment, R), win_kv]}


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


def new_kernels(T: int, idx: torch.Tensor, valid: torch.Tensor) -> dict[str, tuple[Steps, int, int]]:
    """The Triton family's kernels (steps, bytes to or from HBM that bound it, bytes of atomic adds): tiles of
    bt = 10 queries x 6 heads; sel forward over spans of readers (an fp32 output and logsumexp per entry and head,
    merged by `_fwd_mix`, n steps a tile), its dK, dV and dQ over spans of SEL_KV_ROWS // 6 readers a step; the cmp
    dK, dV 32 slots x 512 queries a program, the win dK, dV 32 keys a program, bt queries a step."""
    bt, bt_kv, D, kv = triton_nsa.ROWS // R, triton_nsa.SEL_KV_ROWS // R, 64, triton_nsa.KV_BLOCK
    cmp, win, topn = query_tiles(T, bt)
    counts = readers(idx, valid)
    entries = int(counts.sum())
    partial = entries * R * (D + 1) * 4  # sel's per-block outputs and logsumexps
    sel_kv = spans(counts, bt_kv)
    cmp_kv = key_tiles(T, bt, kv, triton_nsa.KV_SEGMENT, 1)
    visits = int(sel_kv.sum()) - int(_cdiv(counts, bt_kv).sum())  # (block, program) pairs: a key-gradient add each
    win_kv = torch.full((_cdiv(T, kv) * G,), _cdiv(kv + SPEC.w - 1, bt))
    return {"_fwd_cmp": ([cmp + topn], 0, 0), "_fwd_win": ([win], 0, 0), "_fwd_sel": ([spans(counts, bt)], partial, 0),
            "_fwd_mix": ([torch.full_like(win, min(SPEC.n, SPEC.num_sel_blocks(T)))], partial, 0),
            "_bwd_q": ([cmp + win], 0, 0),
            "_bwd_sel_kv": ([sel_kv], 0, entries * R * D * 4 + visits * 2 * SPEC.l_sel * D * 4),
            "_bwd_kv (cmp)": ([cmp_kv], 0, len(cmp_kv) * 2 * kv * D * 4),
            "_bwd_kv (win)": ([win_kv], 0, len(win_kv) * 2 * kv * D * 4)}


def predict(launches: Steps, c: float, lat: float) -> float:
    """Seconds: each launch the larger of its steps shared by the SMs and its longest program's."""
    return sum(max(float(s.sum()) * c / SMS, float(s.max()) * lat) for s in launches)


def fit(kernels: dict[str, Steps]) -> tuple[float, float]:
    """(c, lat) minimising the squared log ratios of predicted to measured times (a grid, then finer)."""
    def loss(c: float, lat: float) -> float:
        return sum(math.log(predict(kernels[k], c, lat) * 1e3 / ms) ** 2 for k, ms in MEASURED_32K.items())
    best, width = (math.log(1e-6), math.log(1e-6)), 4.0
    for _ in range(6):
        grid = [(best[0] + width * i / 10, best[1] + width * j / 10) for i in range(-10, 11) for j in range(-10, 11)]
        best = min(grid, key=lambda x: loss(math.exp(x[0]), math.exp(x[1])))
        width /= 5
    return math.exp(best[0]), math.exp(best[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--T", type=int, nargs="+", default=[8192, 32768, 65536])
    a = parser.parse_args()
    old = old_kernels(32768, *selection(32768))
    c, lat = fit(old)
    print(f"Calibration on the H100 profile at T 32,768: a step costs {c * 1e6:.3f} us of one SM while the GPU is "
          f"full, {lat * 1e6:.2f} us alone (least squares over {len(old)} kernels)")
    print("| branch-wise kernel | steps | longest program (steps) | measured (ms) | predicted (ms) | "
          "predicted / measured | within 30% |")
    print("|---|---|---|---|---|---|---|")
    for k, launches in old.items():
        ms = 1e3 * predict(launches, c, lat)
        ratio = ms / MEASURED_32K[k]
        print(f"| {k} | {sum(int(s.sum()) for s in launches):,} | {max(int(s.max()) for s in launches):,} | "
              f"{MEASURED_32K[k]:.3f} | {ms:.3f} | {ratio:.2f} | {'yes' if abs(ratio - 1) <= 0.3 else 'no'} |")
    print("\n| T | kernel | programs | steps | longest program (steps) | HBM (MB) | atomic adds (MB) | predicted (ms) |")
    print("|---|---|---|---|---|---|---|---|")
    summary = []
    for T in a.T:
        total = 0.0
        for k, (launches, hbm, atomic) in new_kernels(T, *selection(T)).items():
            ms = 1e3 * (max(predict(launches, c, lat), hbm / HBM_RATE) + atomic / ATOMIC_RATE)
            total += ms
            print(f"| {T:,} | {k} | {sum(len(s) for s in launches):,} | {sum(int(s.sum()) for s in launches):,} | "
                  f"{max(int(s.max()) for s in launches):,} | {hbm / 1e6:,.1f} | {atomic / 1e6:,.1f} | {ms:.3f} |",
                  flush=True)
        summary.append((T, total))
    print("\n| T | predicted NSA fwd+bwd (ms) | dense cuDNN measured (ms) | dense / NSA | target | met by the prediction |")
    print("|---|---|---|---|---|---|")
    for T, total in summary:
        ratio = DENSE[T] / total if T in DENSE else float("nan")
        target = TARGETS.get(T)
        print(f"| {T:,} | {total:.2f} | {DENSE.get(T, float('nan')):.2f} | {ratio:.2f}x | "
              f"{f'{target}x' if target else '-'} | {'yes' if target and ratio >= target else 'no'} |")


if __name__ == "__main__":
    main()
