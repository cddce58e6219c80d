"""The Triton decode step's time per token on an H100, predicted on a CPU by the training kernels' step model.

    python benchmarks/decode_prediction.py [--contexts 8192 32768 65536 131072] [--batch 1 8]

`gpu_prediction.py`'s model, its constants fitted on the same H100 profile (fitted, and the pessimistic set):
a kernel's time is the larger of its steps spread over 132 SMs, its longest program's steps at the cost of a
step alone (lat), its HBM bytes at 3.0 TB/s and its launches. The decode kernel (`triton_decode._decode`, bf16,
4 warps, the M7C layer: 2 KV groups of 6 heads, head dim 64, the paper's l, d, l', n, w) is B x G programs, each:
the append (a step), the cmp slots twice (BLOCK a step), the block scores (SCORES blocks a step), n top-n rounds
(an argmax over the Ns scores each, at the cost of the profile's insertion round), n sel blocks (a step each), the
window (BLOCK a step) and the mix (a step). Its bytes: every key and value it reads, the scratch row both ways,
q and the output. On the step a block completes (one in d = 16) the compression's two launches, recorded as
`benchmarks/triton_work.py` records them: `_cmp_hidden`, 2 x (l x D / PART) x (256 / HIDDEN_BLOCK) x row tiles
programs of PART / INPUTS steps that read fc1's weights (2 MB) and the blocks' keys and write partial sums;
`_cmp_out`, a step a row and key or value (the partial sums, fc2's weights).
Dense is flash-decoding by the same model: its keys BLOCK a step, each row's cut into parts that fill the 132
SMs, then a combine launch (no H100 measurement of a decode step exists yet). So is the split design (not built):
NSA's steps cut the same way, the top-n's rounds left in one program a row, to show what the parallelism is worth.
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


def program_steps(C: int) -> tuple[int, int]:
    """(steps, top-n rounds) of one (row, group) program of the decode kernel at C cached positions."""
    Nc, Ns = SPEC.num_cmp_blocks(C), SPEC.num_sel_blocks(C)
    steps = (1 + 2 * _cdiv(Nc, triton_decode.BLOCK) + _cdiv(Ns, triton_decode.SCORES) + min(SPEC.n, Ns)
             + _cdiv(SPEC.w, triton_decode.BLOCK) + 1)
    return steps, SPEC.n


def split(steps: int, rows: int, hbm: float) -> Kernel:
    """A row's `steps` cut into parts that fill the 132 SMs (flash-decoding's split of the keys), then a combine
    launch of a step a row."""
    parts = max(1, min(steps, _cdiv(SMS, rows)))
    return Kernel([torch.full((rows * parts,), _cdiv(steps, parts)), torch.ones(rows)], warps=4,
                  hbm=hbm + rows * parts * (R * D + 2 * R) * 4 * 2)


def nsa_ms(C: int, batch: int, x: Costs, split_keys: bool = False) -> float:
    """Predicted ms of one layer's decode attention at C positions for `batch` rows (the compression amortised over
    d steps):
    the kernel as built (a program a row and group), or with its keys split as `split` cuts them (the top-n's
    rounds still in one program a row)."""
    steps, rounds = program_steps(C)
    Nc, Ns = SPEC.num_cmp_blocks(C), SPEC.num_sel_blocks(C)
    keys = Nc + min(SPEC.n, Ns) * SPEC.l_sel + SPEC.w
    hbm = batch * G * (keys * 2 * D * BYTES + (Nc + Ns) * 4 * 2 + 2 * R * D * BYTES)
    kernel = split(steps, batch * G, hbm) if split_keys else Kernel([torch.full((batch * G,), steps)], 4, hbm=hbm)
    return 1e3 * (kernel.seconds(x) + rounds * x.round) + compression_ms(batch, x) / SPEC.d


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
    print(f"\nDecode step on an H100 (M7C layer, bf16): a program's steps at C = {a.contexts[0]:,}: "
          f"{program_steps(a.contexts[0])[0]} and {SPEC.n} top-n rounds; lat {fitted.lat * 1e6:.2f} us a lone step; "
          f"a layer's launches besides the kernel over {SPEC.d} steps: {compression_launches()} (the compression, "
          f"{1e3 * compression_ms(1, fitted):.1f} us at batch 1)")
    rows = []
    for batch in a.batch:
        for C in a.contexts:
            f = nsa_ms(C, batch, fitted)
            p = max(nsa_ms(C, batch, x) for x in worse)
            s = nsa_ms(C, batch, fitted, split_keys=True)
            d = dense_ms(C, batch, fitted)
            rows.append([batch, f"{C:,}", f"{1e3 * f:.1f} / {1e3 * p:.1f}", f"{1e3 * s:.1f}", f"{1e3 * d:.1f}",
                         f"{d / f:.2f}x / {d / p:.2f}x", f"{d / s:.2f}x"])
    print(table(rows, ["batch", "context", "NSA decode kernel, fitted / pessimistic (us a layer and token)",
                       "NSA split to fill the GPU (not built), fitted (us)", "dense flash-decoding, fitted (us)",
                       "dense / NSA", "dense / split design"]))


if __name__ == "__main__":
    main()
