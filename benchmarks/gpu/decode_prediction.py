"""The Triton decode step's time per token on an H100, predicted on a CPU by the training kernels' step model.

    python benchmarks/gpu/decode_prediction.py [--contexts 8192 32768 65536 131072] [--batch 1 8]

`gpu_prediction.py`'s model, its constants fitted on the same H100 profile (fitted, and the pessimistic set):
a kernel's time is the larger of its steps spread over 132 SMs, its longest program's steps at the cost of a
step alone (lat), its HBM bytes at 3.0 TB/s and its launches. The decode step (`triton_decode`, bf16, 4 warps,
the M7C layer: 2 KV groups of 6 heads, head dim 64, the paper's l, d, l', n, w) is two launches. `_decode`: B x G x
parts programs, each the append (part 0, a step), its CMP_PART compressed slots (BLOCK a step: the softmax, their
scores kept), its state (a step) and its blocks' member sums (PART_BLOCKS a step); the row's last part then
combines the parts (COMBINE a step), scores the blocks (SCORES a step) and runs n top-n rounds (an argmax over
the Ns scores each, at the cost of the profile's insertion round). `_decode_sel_win`: B x G x (n + w / BLOCK)
programs of a step (a chosen block, or BLOCK window keys), the row's last combining them (COMBINE a step) and
the mix (a step). Bytes: every key and value read, the scratch both ways, q and the output. On the step a block
completes (one in d = 16) the compression's two launches, recorded as
`benchmarks/gpu/triton_work.py` records them: `_cmp_hidden`, 2 x (l x D / PART) x (256 / HIDDEN_BLOCK) x row tiles
programs of PART / INPUTS steps that read fc1's weights (2 MB) and the blocks' keys and write partial sums;
`_cmp_out`, a step a row and key or value (the partial sums, fc2's weights).
Dense is flash-decoding by the same model: its keys BLOCK a step, each row's cut into parts that fill the 132
SMs, then a combine launch (no H100 measurement of a decode step exists yet). The design before (`BEFORE`): the
last part summed every slot's probability over the heads before the block scores.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.gpu.gpu_prediction import SMS, Costs, Kernel, _cdiv, calibration, old_kernels, selection, table  # noqa: E402
from benchmarks.gpu.triton_work import decode_launches, decode_state  # noqa: E402

from nsa_titan.models.attention import NSASpec  # noqa: E402
from nsa_titan.models.attention.families.triton import triton_decode  # noqa: E402

SPEC = NSASpec(l=32, d=16, l_sel=64, n=16, w=512)
G, R, D, BYTES = 2, 6, 64, 2  # M7C's layer, bf16


def compression_launches() -> dict[str, int]:
    """What one layer's decode attention launches over d steps besides the kernel (recorded,
    `triton_work.decode_launches`): the compression's kernels on the step a block completes, and any ATen op."""
    counts, ops = decode_launches(*decode_state(8192, layers=1), SPEC.d)
    return {**{name: n for name, n in counts.items() if not name.startswith("_decode")}, "ATen ops": len(ops)}


def compression_ms(batch: int, x: Costs) -> float:
    """Predicted ms of one layer's compression on the step a block completes (`compress_step`'s two kernels)."""
    rows, hidden, inputs = batch * G, 4 * D, SPEC.l * D
    parts = _cdiv(inputs, triton_decode.PART)
    programs = 2 * parts * _cdiv(hidden, triton_decode.HIDDEN_BLOCK) * _cdiv(rows, triton_decode.ROWS)
    first = Kernel([torch.full((programs,), triton_decode.PART // triton_decode.INPUTS)], 4,
                   hbm=2 * (hidden * inputs * BYTES + parts * rows * (inputs * BYTES + hidden * 4)))
    second = Kernel([torch.ones(2 * rows)], 4, hbm=2 * (D * hidden * BYTES + rows * (parts * hidden * 4 + D * BYTES)))
    return 1e3 * (first.seconds(x) + second.seconds(x))


BEFORE = {"CMP_PART": 256, "COMBINE": 4, "PROBS": 256}
"""The design of 409d9cd (2026-11-30): its constants, and the last part's pass over the slot probabilities."""


def chain(C: int, before: bool = False) -> tuple[int, int, int, int]:
    """(a part's steps, the last part's steps after them, top-n rounds, launch 2's last program's steps) of the decode
    step at C cached positions; with `before`, the design of 409d9cd (`BEFORE`)."""
    Nc, Ns = SPEC.num_cmp_blocks(C), SPEC.num_sel_blocks(C)
    cp, combine = (BEFORE["CMP_PART"], BEFORE["COMBINE"]) if before else (triton_decode.CMP_PART,
                                                                          triton_decode.COMBINE)
    parts = _cdiv(max(Nc, 1), cp)
    part = 1 + _cdiv(min(Nc, cp), triton_decode.BLOCK) + 1
    tail = _cdiv(parts, combine) + _cdiv(Ns, triton_decode.SCORES)
    if before:
        tail += _cdiv(Nc, BEFORE["PROBS"])
    else:
        part += _cdiv(cp // (SPEC.l_sel // SPEC.d) + 1, triton_decode.PART_BLOCKS)
    window = _cdiv(SPEC.w, triton_decode.BLOCK)
    last = 1 + _cdiv(SPEC.n, combine) + _cdiv(window, combine) + 1
    return part, tail, SPEC.n, last


def nsa_ms(C: int, batch: int, x: Costs, before: bool = False) -> float:
    """Predicted ms of one layer's decode attention at C positions for `batch` rows (the compression amortised over
    d steps): the step as built, or the design before (`chain`)."""
    part, tail, rounds, last = chain(C, before)
    Nc, Ns = SPEC.num_cmp_blocks(C), SPEC.num_sel_blocks(C)
    cp = BEFORE["CMP_PART"] if before else triton_decode.CMP_PART
    parts, rows, n = _cdiv(max(Nc, 1), cp), batch * G, min(SPEC.n, Ns)
    keys = Nc + n * SPEC.l_sel + SPEC.w
    scratch = (parts + SPEC.n + SPEC.w // triton_decode.BLOCK) * triton_decode.ROWS * (D + 2) + (
        triton_decode.ROWS * Nc + Nc + Ns + triton_decode.ROWS * D)
    hbm = rows * (keys * 2 * D * BYTES + scratch * 4 * 2 + 2 * R * D * BYTES)
    steps = torch.full((rows, parts), part)
    steps[:, -1] += tail
    programs = SPEC.n + _cdiv(SPEC.w, triton_decode.BLOCK)
    second = torch.ones(rows, programs)
    second[:, -1] = last
    kernel = Kernel([steps.flatten(), second.flatten()], 4, hbm=hbm)
    return 1e3 * (kernel.seconds(x) + rounds * x.round) + compression_ms(batch, x) / SPEC.d


def split(steps: int, rows: int, hbm: float) -> Kernel:
    """A row's `steps` cut into parts that fill the 132 SMs (flash-decoding's split of the keys), then a combine
    launch of a step a row."""
    parts = max(1, min(steps, _cdiv(SMS, rows)))
    return Kernel([torch.full((rows * parts,), _cdiv(steps, parts)), torch.ones(rows)], warps=4,
                  hbm=hbm + rows * parts * (R * D + 2 * R) * 4 * 2)


def dense_ms(C: int, batch: int, x: Costs) -> float:
    """Dense decode as flash-decoding runs it, by the same model: all C keys, BLOCK a step, split to fill the GPU."""
    return 1e3 * split(_cdiv(C, triton_decode.BLOCK), batch * G, batch * G * C * 2 * D * BYTES).seconds(x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768, 65536, 131072])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    a = parser.parse_args()
    fitted, other = calibration(old_kernels(selection(32768)))
    worse = [fitted.worse(), other.worse()]
    part, tail, _, last = chain(a.contexts[0])
    print(f"\nDecode step on an H100 (M7C layer, bf16): at C = {a.contexts[0]:,} a part's steps {part}, then the "
          f"last part's {tail} and {SPEC.n} top-n rounds, then launch 2's last program's {last}; lat "
          f"{fitted.lat * 1e6:.2f} us a lone step; a layer's launches besides the step over {SPEC.d} steps: "
          f"{compression_launches()} (the compression, {1e3 * compression_ms(1, fitted):.1f} us at batch 1)")
    rows = []
    for batch in a.batch:
        for C in a.contexts:
            f = nsa_ms(C, batch, fitted)
            p = max(nsa_ms(C, batch, x) for x in worse)
            s = nsa_ms(C, batch, fitted, before=True)
            d = dense_ms(C, batch, fitted)
            rows.append([batch, f"{C:,}", f"{1e3 * f:.1f} / {1e3 * p:.1f}", f"{1e3 * s:.1f}", f"{1e3 * d:.1f}",
                         f"{d / f:.2f}x / {d / p:.2f}x", f"{d / s:.2f}x"])
    print(table(rows, ["batch", "context", "NSA decode step, fitted / pessimistic (us a layer and token)",
                       "the design before, fitted (us)", "dense flash-decoding, fitted (us)", "dense / NSA",
                       "dense / the design before"]))

if __name__ == "__main__":
    main()
