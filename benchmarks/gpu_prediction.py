"""The Triton family's forward + backward time on an H100, predicted on a CPU before any GPU run.

    python benchmarks/gpu_prediction.py [--T 8192 32768 65536]

Each kernel's tensor-core work is counted from its structure (programs, steps, the products of each step)
on the sel blocks a real selection chooses: the inputs of `benchmarks/gpu_attention.py` (the M7C attention,
random, seeded), their blocks chosen by the C++ family. One rate, the effective FLOP/s of a tensor-core step
of these kernels, is fitted on the 2026-11-28 H100 profile of the branch-wise kernels this family replaced
(their work counted the same way, from their structure at d678f0f; `gpu_reports/2026-11-28-h100.md`), and
each of those kernels is then predicted back against its measured time. The sel choice there was bound by
bytes, not products: its rate is bytes per second. The new family's kernels are predicted with that rate,
and the prediction is put against cuDNN's measured dense time at each T.

What the model leaves out: occupancy (every new kernel holds one block of 8 warps per SM at ~250
registers, `benchmarks/triton_compile.py`), the atomic adds of the key gradients (counted apart, as bytes
at the sel choice's rate), L2 behaviour and the tail of the last wave. It says where the time would go and whether
the targets are within reach, not what a GPU will measure.
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
from nsa_titan.models.attention.families import FAMILIES  # noqa: E402

SPEC = NSASpec(l=32, d=16, l_sel=64, n=16, w=512)
G, R, D = 2, 6, 64
MEASURED_32K = {  # ms of GPU time per kernel name, forward + backward at T 32,768 (gpu_reports/2026-11-28-h100.md)
    "_sel_fwd": 2.659, "_sel_bwd_dq": 2.665, "_sel_bwd_dkv": 3.496, "_fwd (cmp + win)": 1.799,
    "_bwd_dq (cmp + win)": 1.090, "_bwd_dkv (cmp + win)": 2.411, "_choose": 0.621}
DENSE = {8192: 1.030, 32768: 13.309, 65536: 53.300}
"""cuDNN's causal attention fwd + bwd (ms) on that H100, the fastest dense kernel there."""
TARGETS = {8192: 1.0, 32768: 2.5, 65536: 4.0}


def mma(m: int, n: int, k: int) -> int:
    """FLOPs of one (m x k) @ (k x n) tensor-core product."""
    return 2 * m * n * k


def selection(T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The sel blocks (idx, valid (G, T, n)) the H100 run's inputs choose (C++ family, fp32)."""
    inputs, _ = build_core("fast", T, torch.device("cpu"))
    with torch.no_grad():
        _, idx, valid = FAMILIES["cpp"]()(*[p.detach() for p in inputs], SPEC, return_selection=True)
    return idx[0], valid[0]


def unions(idx: torch.Tensor, valid: torch.Tensor, bt: int) -> int:
    """Distinct blocks chosen by each tile of bt consecutive queries, summed over tiles and groups."""
    Gn, T, n = idx.shape
    blocks = torch.where(valid, idx, -1)
    pad = -T % bt
    tiles = torch.nn.functional.pad(blocks, (0, 0, 0, pad), value=-1).view(Gn, -1, bt * n)
    ordered = tiles.sort(-1).values
    distinct = (ordered[..., 1:] != ordered[..., :-1]) & (ordered[..., 1:] >= 0)
    return int(distinct.sum() + (ordered[..., 0] >= 0).sum())


def reader_steps(idx: torch.Tensor, valid: torch.Tensor, rows: int) -> int:
    """Steps of `rows` readers over each chosen block's readers, summed over blocks and groups."""
    Ns = SPEC.num_sel_blocks(idx.shape[1])
    counts = torch.zeros(idx.shape[0], Ns, dtype=torch.long)
    counts.scatter_add_(1, torch.where(valid, idx, 0).flatten(1), valid.flatten(1).long())
    return int((-(-counts // rows)).sum())


def cmp_steps(T: int, bt: int, bn: int) -> int:
    """Slot tiles of bn the tiles of bt queries walk in the cmp branch, summed over tiles (one group)."""
    Nc = SPEC.num_cmp_blocks(T)
    return sum(-(-min(Nc, (min(T, a + bt)) // SPEC.d) // bn) for a in range(0, T, bt))


def old_kernels(T: int, idx: torch.Tensor, valid: torch.Tensor) -> dict[str, float]:
    """FLOPs of the branch-wise kernels (d678f0f) at T, by the names the profile gives; `_choose` in bytes."""
    u10 = unions(idx, valid, 10)  # the sel tiles: 10 queries x 6 heads in 64 rows
    tile = mma(64, 64, 64)
    cmp8 = cmp_steps(T, 8, 64) * G  # cmp / win tiles: 8 queries x 8 (padded) heads
    win8 = -(-T // 8) * -(-(8 + SPEC.w - 1) // 64) * G
    Nc = SPEC.num_cmp_blocks(T)
    cmp_dkv = sum(-(-(T - (j * SPEC.d + SPEC.l - 1)) // 32) for j in range(0, Nc, 64)) * R * G  # a head a program
    win_dkv = -(-T // 64) * -(-(64 + SPEC.w - 1) // 4) * G  # 4 queries x 8 rows a step
    return {"_sel_fwd": u10 * 2 * tile, "_sel_bwd_dq": u10 * 3 * tile,
            "_sel_bwd_dkv": reader_steps(idx, valid, 32) * R * 4 * mma(32, 64, 64),
            "_fwd (cmp + win)": cmp8 * 3 * tile + win8 * 2 * tile, "_bwd_dq (cmp + win)": (cmp8 + win8) * 3 * tile,
            "_bwd_dkv (cmp + win)": (cmp_dkv + win_dkv) * 4 * mma(32, 64, 64),
            "_choose": T * SPEC.num_sel_blocks(T) * 5 * 4 * G}


def new_kernels(T: int, idx: torch.Tensor, valid: torch.Tensor) -> dict[str, tuple[float, float]]:
    """(FLOPs, atomic bytes) of the Triton family's kernels at T."""
    bt, tile = 64 // R, mma(64, 64, 64)
    u = unions(idx, valid, bt)
    cmp = cmp_steps(T, bt, 64) * G
    win = -(-T // bt) * -(-(bt + SPEC.w - 1) // 64) * G
    chunks = sum(-(-((a + bt) // SPEC.l_sel + 1) // 16) for a in range(0, T, bt)) * G  # top-n: 16 blocks a step
    topn = chunks * 5 * (mma(64, 16, 64) + mma(16, 16, 64))
    Nc = SPEC.num_cmp_blocks(T)
    segs = -(-T // 512)
    cmp_kv = sum(-(-max(0, min(T, (s + 1) * 512) - max(j * SPEC.d + SPEC.l - 1, s * 512)) // bt)
                 for j in range(0, Nc, 32) for s in range(segs)) * G
    win_kv = -(-T // 32) * -(-(32 + SPEC.w - 1) // bt) * G
    key_tile = mma(64, 32, 64)
    Ns = SPEC.num_sel_blocks(T)
    blocks = int(torch.zeros(G, Ns).scatter_(1, torch.where(valid, idx, 0).flatten(1), valid.flatten(1).float()
                                             ).count_nonzero())  # blocks with readers: a program's one add each
    return {"_fwd_cmp": (cmp * 2 * tile + topn, 0), "_fwd_sel_win": ((u + win) * 2 * tile, 0),
            "_bwd_q": ((cmp + win + u) * 3 * tile, 0),
            "_bwd_sel_kv": (reader_steps(idx, valid, bt) * 4 * tile, blocks * 2 * SPEC.l_sel * D * 4),
            "_bwd_kv (cmp)": (cmp_kv * 4 * key_tile, -(-Nc // 32) * segs * G * 2 * 32 * D * 4),
            "_bwd_kv (win)": (win_kv * 4 * key_tile, -(-T // 32) * G * 2 * 32 * D * 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--T", type=int, nargs="+", default=[8192, 32768, 65536])
    a = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    old = old_kernels(32768, *selection(32768))
    products = [k for k in old if k != "_choose"]
    rate = math.exp(sum(math.log(old[k] / (MEASURED_32K[k] * 1e-3)) for k in products) / len(products))
    bandwidth = old["_choose"] / (MEASURED_32K["_choose"] * 1e-3)
    print(f"Calibration on the H100 profile at T 32,768: {rate / 1e12:.1f} TFLOP/s a tensor-core step "
          f"(geometric mean of {len(products)} kernels), the sel choice at {bandwidth / 1e9:.0f} GB/s")
    print("| branch-wise kernel | work | measured (ms) | predicted (ms) | predicted / measured | within 30% |")
    print("|---|---|---|---|---|---|")
    for k, work in old.items():
        predicted = 1e3 * work / (bandwidth if k == "_choose" else rate)
        ratio = predicted / MEASURED_32K[k]
        print(f"| {k} | {work / (1e6 if k == '_choose' else 1e9):,.1f} {'MB' if k == '_choose' else 'GFLOP'} | "
              f"{MEASURED_32K[k]:.3f} | {predicted:.3f} | {ratio:.2f} | {'yes' if abs(ratio - 1) <= 0.3 else 'no'} |")
    print("\n| T | kernel | GFLOP | atomic adds (MB) | predicted (ms) |")
    print("|---|---|---|---|---|")
    summary = []
    for T in a.T:
        new = new_kernels(T, *selection(T))
        total = 0.0
        for k, (flops, atomic) in new.items():
            ms = 1e3 * (flops / rate + atomic / bandwidth)
            total += ms
            print(f"| {T:,} | {k} | {flops / 1e9:,.1f} | {atomic / 1e6:,.1f} | {ms:.3f} |", flush=True)
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
