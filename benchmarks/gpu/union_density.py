"""How many key blocks the union of a query tile's chosen sel blocks holds, and what sel through FlexAttention would
cost from it, predicted beside sel through the Triton kernels (the flex family's sel).

    python benchmarks/gpu/union_density.py --work W [--T 8192 32768 65536] [--tiles 32 64 128]

Real selections: the recall model (`train_configs/recall.toml`: l' = 8, n = 16, seq 1,024) trained as
`benchmarks/quality/recall_report.py` trains NSA (the drill, then the recall run; into W once, reused after), its sel
blocks recorded (`record_selection`) on held-out rows with pairs 64 to 960 tokens back. M7C-shaped attention at each
T: the blocks the C++ family chooses on the H100 run's random inputs (`gpu_prediction.chosen`): random queries agree
on nothing but the forced blocks, so their unions are an upper bound.

Per tile of consecutive queries of one KV group: the distinct blocks their choices hold (the union), against n (one
query's) and against the blocks the tile can see. sel through Flex: a block mask of query tiles x l' keys whose
blocks are each tile's union, every one partial (a query reads its own n alone), each (tile, block, head) at
FlexAttention's fitted cost of a partial block (`gpu_prediction.flex_fit`, fwd + bwd) scaled by its area
(optimistic below 128 x 128), the mask's build each forward not counted (optimistic too). Beside it sel through the
Triton kernels, as the flex family runs it (`gpu_prediction.flex_kernels`: the reader lists, `_fwd_sel`, `_fwd_mix`,
`_bwd_sel_kv`, sel's dQ rows). Two unions for M7C: the random inputs' and the coherent estimate, the trained
model's union / n at the same tile applied to M7C's n (capped by the blocks a tile sees).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.gpu import gpu_prediction as gp  # noqa: E402
from benchmarks.quality.recall_report import CONFIG, DRILL, train  # noqa: E402

from nsa_titan.checkpoint.inference import load_model  # noqa: E402
from nsa_titan.models.transformer import NSAAttention  # noqa: E402
from nsa_titan.observe.evals import eval_layout, recall_batch  # noqa: E402

DRILL_STEPS = 450
DISTANCES = (64, 256, 512, 960)
SEL = ("_fwd_win (reader lists)", "_fwd_sel", "_fwd_mix", "_bwd_sel_kv", "_bwd_q: sel's dQ rows")
"""The flex family's sel kernels (`gpu_prediction.flex_kernels`)."""


def trained(work: Path) -> Path:
    """The recall model's final checkpoint in `work`, trained there first if it is not (about 14 minutes on 2
    cores)."""
    run, drill = work / "nsa", work / "nsa_drill"
    if not list((run / "checkpoint").glob("step-*")):
        train("nsa", [*DRILL, "--training.steps", str(DRILL_STEPS), "--checkpoint.interval", str(DRILL_STEPS)], drill)
        train("nsa", ["--checkpoint.initial_load_path", str(drill / "checkpoint" / f"step-{DRILL_STEPS}")], run)
    return max((run / "checkpoint").glob("step-*"), key=lambda p: int(p.name.split("-")[1]))


@torch.no_grad()
def real_selections(checkpoint: Path, batches: int = 2) -> tuple[gp.Work, int, int]:
    """The trained model's sel blocks on held-out recall rows, every layer's and row's group as a `Work` row; its
    l' and n."""
    model, _, cfg = load_model(str(checkpoint), CONFIG, [])
    attns = [m for m in model.modules() if isinstance(m, NSAAttention)]
    for m in attns:
        m.record_selection = True
    layout, idx, valid = eval_layout(cfg), [], []
    for d in DISTANCES:
        for b in range(batches):
            model(recall_batch(layout, cfg.data.seed + 1, cfg.training.local_batch_size, d, b)[0])
            for m in attns:
                i, v = m.selection  # (B, G, T, n')
                idx.append(i.flatten(0, 1))
                valid.append(v.flatten(0, 1))
    spec = attns[0].spec
    return gp.Work(cfg.training.seq_len, torch.cat(idx), torch.cat(valid)), spec.l_sel, spec.n


def union_stats(work: gp.Work, bt: int, l_sel: int, n: int) -> tuple[torch.Tensor, dict[str, float]]:
    """Each tile's union (rows x tiles) and its mean, 90th percentile, union / n and union / the blocks it sees."""
    u = gp.unions(work, bt).float()
    tiles = u.numel() // work.idx.shape[0]
    last = torch.clamp(torch.arange(tiles) * bt + bt, max=work.T) - 1
    seen = (last // l_sel + 1).float().repeat(work.idx.shape[0])
    return u, {"mean": float(u.mean()), "p90": float(u.quantile(0.9)), "of n": float(u.mean()) / n,
               "of seen": float((u / seen).mean())}


def flex_sel_ms(unions: torch.Tensor, bt: int, flex: gp.FlexCosts) -> float:
    """sel through Flex: every (tile, block of its union) partial, for each of a group's R heads, at the fitted
    partial block's cost scaled by the area bt x l' of FLEX_TILE x FLEX_TILE."""
    return gp.R * float(unions.sum()) * flex.partial * bt * gp.SPEC.l_sel / gp.FLEX_TILE ** 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, required=True, help="where the recall model is trained (reused)")
    parser.add_argument("--T", type=int, nargs="+", default=[8192, 32768, 65536])
    parser.add_argument("--tiles", type=int, nargs="+", default=[32, 64, 128])
    a = parser.parse_args()
    real, l_sel, n = real_selections(trained(a.work))
    works = {T: gp.chosen(T)[0] for T in a.T}
    rows, coherence = [], {}
    for bt in a.tiles:
        _, st = union_stats(real, bt, l_sel, n)
        coherence[bt] = st["of n"]
        rows.append([f"recall model (trained), l' {l_sel}", f"{real.T:,}", bt, f"{st['mean']:.1f}", f"{st['p90']:.0f}",
                     f"{st['of n']:.2f}", f"{st['of seen']:.2f}"])
    for T, w in works.items():
        for bt in a.tiles:
            _, st = union_stats(w, bt, gp.SPEC.l_sel, gp.SPEC.n)
            rows.append([f"M7C, random inputs, l' {gp.SPEC.l_sel}", f"{T:,}", bt, f"{st['mean']:.1f}",
                         f"{st['p90']:.0f}", f"{st['of n']:.2f}", f"{st['of seen']:.2f}"])
    print(gp.table(rows, ["selections", "T", "tile (queries)", "union (blocks), mean", "p90", "union / n",
                          "union / blocks seen"]))
    flex = gp.flex_fit(verbose=False)
    calibration = gp.old_kernels(works.get(32768) or gp.chosen(32768)[0])
    fitted = gp.fit(calibration)
    rows = []
    for T, w in works.items():
        kernels = gp.flex_kernels(w, gp.Design())
        triton = sum(1e3 * kernels[k].seconds(fitted) for k in SEL)
        for bt in a.tiles:
            u, _ = union_stats(w, bt, gp.SPEC.l_sel, gp.SPEC.n)
            tiles = u.numel() // w.idx.shape[0]
            seen = (torch.clamp(torch.arange(tiles) * bt + bt, max=T) - 1) // gp.SPEC.l_sel + 1
            coherent = torch.minimum(seen.float(), torch.tensor(coherence[bt] * gp.SPEC.n)).repeat(w.idx.shape[0])
            random_ms, coherent_ms = flex_sel_ms(u, bt, flex), flex_sel_ms(coherent, bt, flex)
            rows.append([f"{T:,}", bt, f"{random_ms:.2f}", f"{coherent_ms:.2f}", f"{triton:.2f}",
                         "yes" if min(random_ms, coherent_ms) < triton else "no"])
    print()
    print(gp.table(rows, ["T", "tile (queries)", "sel through Flex, random unions (ms)", "coherent unions (ms)",
                          "sel through the Triton kernels (ms)", "Flex ahead"]))


if __name__ == "__main__":
    main()
