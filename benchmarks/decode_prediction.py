"""The Triton decode step's time per token on an H100, predicted on a CPU by the training kernels' step model.

    python benchmarks/decode_prediction.py [--contexts 8192 32768 65536 131072] [--batch 1 8]

`gpu_prediction.py`'s model, its constants fitted on the same H100 profile (fitted, and the pessimistic set):
a kernel's time is the larger of its steps spread over 132 SMs, its longest program's steps at the cost of a
step alone (lat), its HBM bytes at 3.0 TB/s and its launches. The decode kernel (`triton_decode._decode`, bf16,
4 warps, the M7C layer: 2 KV groups of 6 heads, head dim 64, the paper's l, d, l', n, w) is B x G x parts
programs, each: the append (part 0, a step), its CMP_PART compressed slots twice (the softmax, then their scores;
BLOCK a step) and its state (a step); the row's last part then runs the rest: the parts' states (COMBINE a step),
the slot probabilities (PROBS a step), the block scores (SCORES blocks a step), n top-n rounds (an argmax over the
Ns scores each, at the cost of the profile's insertion round), n sel blocks (a step each), the window (BLOCK a step)
and the mix (a step). Its bytes: every key and value it reads, the scratch states, scores and row both ways,
q and the output. On the step a block completes (one in d = 16) the compression's two launches, recorded as
`benchmarks/triton_work.py` records them: `_cmp_hidden`, 2 x (l x D / PART) x (256 / HIDDEN_BLOCK) x row tiles
programs of PART / INPUTS steps that read fc1's weights (2 MB) and the blocks' keys and write partial sums;
`_cmp_out`, a step a row and key or value (the partial sums, fc2's weights).
Dense is flash-decoding by the same model: its keys BLOCK a step, each row's cut into parts that fill the 132
SMs, then a combine launch (no H100 measurement of a decode step exists yet). The next design (not built): sel's
blocks and the window's keys in programs of their own, a second launch after the top-n, its last program the mix.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_prediction import SMS, Costs, Kernel, _cdiv, calibration, old_kernels, selection, table  # noqa: E402
from triton_work import decode_launches, decode_state  # noqa: E402

from nsa_titan.models.attention import NSASpec  # noqa: E402
from nsa_titan.models.attention.families.triton import triton_decode  # noqa: E402

SPEC = NSASpec(l=32, d=16, l_sel=64, n=16, w=512)
G, R, D, BYTES = 2, 6, 64, 2  # M7C's layer, bf16


def compression_launches() -> dict[str, int]:
    """What one layer's decode attention launches over d steps besides the kernel (recorded,
    `triton_work.decode_launches`): the compression's kernels on the step a block completes, and any ATen op."""
    counts, ops = decode_launches(*decode_state(8192, layers=1), SPEC.d)
    return {**{name: n for name, n in counts.items() if name != "_decode"}, "ATen ops": len(ops)}


def compression_ms(batch: int, x: Costs) -> float:
    """Predicted ms of one layer's compression on the step a block completes (`compress_step`'s two kernels)."""
    rows, hidden, inputs = batch * G, 4 * D, SPEC.l * D
    parts = _cdiv(inputs, triton_decode.PART)
    programs = 2 * parts * _cdiv(hidden, triton_decode.HIDDEN_BLOCK) * _cdiv(rows, triton_decode.ROWS)
    first = Kernel([torch.full((programs,), triton_decode.PART // triton_decode.INPUTS)], 4,
                   hbm=2 * (hidden * inputs * BYTES + parts * rows * (inputs * BYTES + hidden * 4)))
    second = Kernel([torch.ones(2 * rows)], 4, hbm=2 * (D * hidden * BYTES + rows * (parts * hidden * 4 + D * BYTES)))
    return 1e3 * (first.seconds(x) + second.seconds(x))


def chain(C: int, split_tail: bool = False) -> tuple[int, int, int]:
    """(a part's steps, the last part's steps after them, top-n rounds) of the decode kernel at C cached positions;
    with `split_tail`, the next design's: sel and the window in a launch of their own (a step each, then the mix)."""
    Nc, Ns, n = SPEC.num_cmp_blocks(C), SPEC.num_sel_blocks(C), min(SPEC.n, SPEC.num_sel_blocks(C))
    parts = _cdiv(max(Nc, 1), triton_decode.CMP_PART)
    part = 1 + 2 * _cdiv(min(Nc, triton_decode.CMP_PART), triton_decode.BLOCK) + 1
    tail = (_cdiv(parts, triton_decode.COMBINE) + _cdiv(Nc, triton_decode.PROBS) + _cdiv(Ns, triton_decode.SCORES))
    tail += 2 if split_tail else n + _cdiv(SPEC.w, triton_decode.BLOCK) + 1
    return part, tail, SPEC.n


def nsa_ms(C: int, batch: int, x: Costs, split_tail: bool = False) -> float:
    """Predicted ms of one layer's decode attention at C positions for `batch` rows (the compression amortised over
    d steps): the kernel as built, or the next design (`chain`)."""
    part, tail, rounds = chain(C, split_tail)
    Nc, Ns = SPEC.num_cmp_blocks(C), SPEC.num_sel_blocks(C)
    parts, rows = _cdiv(max(Nc, 1), triton_decode.CMP_PART), batch * G
    keys = Nc + min(SPEC.n, Ns) * SPEC.l_sel + SPEC.w
    scratch = parts * triton_decode.ROWS * (D + 2) + triton_decode.ROWS * Nc + Nc + Ns
    hbm = rows * (keys * 2 * D * BYTES + scratch * 4 * 2 + 2 * R * D * BYTES)
    steps = torch.full((rows, parts), part)
    steps[:, -1] += tail
    launches = [steps.flatten()]
    if split_tail:  # n sel blocks and the window's w / BLOCK parts, a step each
        launches.append(torch.ones(rows * (min(SPEC.n, Ns) + _cdiv(SPEC.w, triton_decode.BLOCK))))
    kernel = Kernel(launches, 4, hbm=hbm)
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
    part, tail, _ = chain(a.contexts[0])
    print(f"\nDecode step on an H100 (M7C layer, bf16): at C = {a.contexts[0]:,} a part's steps {part}, then the "
          f"last part's {tail} and {SPEC.n} top-n rounds; lat {fitted.lat * 1e6:.2f} us a lone step; a layer's "
          f"launches besides the kernel over {SPEC.d} steps: {compression_launches()} (the compression, "
          f"{1e3 * compression_ms(1, fitted):.1f} us at batch 1)")
    rows = []
    for batch in a.batch:
        for C in a.contexts:
            f = nsa_ms(C, batch, fitted)
            p = max(nsa_ms(C, batch, x) for x in worse)
            s = nsa_ms(C, batch, fitted, split_tail=True)
            d = dense_ms(C, batch, fitted)
            rows.append([batch, f"{C:,}", f"{1e3 * f:.1f} / {1e3 * p:.1f}", f"{1e3 * s:.1f}", f"{1e3 * d:.1f}",
                         f"{d / f:.2f}x / {d / p:.2f}x", f"{d / s:.2f}x"])
    print(table(rows, ["batch", "context", "NSA decode kernel, fitted / pessimistic (us a layer and token)",
                       "sel and win split off (not built), fitted (us)", "dense flash-decoding, fitted (us)",
                       "dense / NSA", "dense / next design"]))

if __name__ == "__main__":
    main()
