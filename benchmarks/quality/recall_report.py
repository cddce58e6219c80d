"""Long-range recall at equal parameters: NSA, NSA with its window alone, and dense attention.

    python benchmarks/quality/recall_report.py [--drill_steps N] [--steps N] [--distances 32 96 256 512 960]
                                       [--models nsa win dense] [--seed N] [--out benchmarks/quality/recall_accuracy.png]

Trains `train_configs/recall.toml` (the recall task of `nsa_titan/data/recall.py`) three times on one
CPU rank, with the same data, steps, seed and optimizer, each in two runs: `--drill_steps` of the
drill (`[recall] drill`: seq 256, batch 32, 16 single-token pairs, `sel_score_grad` and `sel_score_explore` 0, a constant
lr; it forms the lookup), then the recall task from the drill's final checkpoint (`checkpoint.initial_load_path`, the model only):
  nsa    NSA as configured;
  win    the same model with cmp and sel switched off (`--model.nsa_branch win`: their parameters are there,
         the branches are not computed, nor the scores' gradient);
  dense  dense causal attention, its MLP widened to NSA's parameter count (`sizing.py`), no block
         scores to train (`sel_score_grad`, `sel_score_explore` 0).
(`--models` trains a subset: a change to NSA alone cannot move win or dense; `--seed N` draws another run of
the same recipe: N as the initialisation's seed and the data's, the held-out rows included.)
Then evaluates each final checkpoint by distance on held-out samples (`evaluate_recall`: a query
counts when all its value tokens are right). Draws accuracy against distance (w and layers x w
marked) and, beside it (*_gates.png), the sel branch's share of the gates by step, over all tokens and over
the answers alone (`gate_sel_labelled`), logged during NSA's drill and recall run (`[metrics] nsa_stats`;
the recall steps follow the drill's). Prints the
Markdown tables, with NSA's accuracy when each branch of each layer is switched off in turn (which
branch does the recall), and per model the value tokens predicted right and how often each layer's
selection chose the block holding the pair (`recall_routing`; in `win` it is computed, gated off and
never trained to route: a baseline).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from nsa_titan.evaluate import evaluate_recall, recall_ablations, recall_routing, recall_table, routing_table  # noqa: E402
from nsa_titan.checkpoint.inference import load_model  # noqa: E402
from nsa_titan.observe.plots import line_chart  # noqa: E402
from benchmarks.quality.quality_report import scalars  # noqa: E402
from benchmarks.quality.sizing import dense_ffn_for, param_count, resolved  # noqa: E402

CONFIG = str(ROOT / "train_configs" / "recall.toml")


DRILL = ["--recall.drill", "true", "--recall.pairs", "16", "--training.seq_len", "256",
         "--training.local_batch_size", "32", "--model.sel_score_grad", "0", "--model.sel_score_explore", "0",
         "--lr_scheduler.decay_type", "constant", "--eval.enable", "false"]
"""The drill run's overrides of recall.toml (its evaluation asks recall.toml's distances, beyond the drill's rows)."""
MODELS = ("nsa", "win", "dense")


def train(name: str, overrides: list[str], dump: Path, config: str = CONFIG) -> float:
    """Train one model of `config` into `dump`; returns the wall-clock seconds."""
    start = time.perf_counter()
    run = subprocess.run([str(ROOT / "run_train.sh"), "--config", config, *overrides, "--job.dump_folder", str(dump)],
                         capture_output=True, text=True)
    if run.returncode:
        raise SystemExit(f"training {name} failed (exit {run.returncode}):\n{run.stdout[-3000:]}{run.stderr[-3000:]}")
    return time.perf_counter() - start


TOKENS = {"": "all tokens", "_labelled": "answers"}
"""The gate statistics' tokens: every token's gates, or the answers' alone (`gate_sel_labelled`)."""


def sel_share(dump: Path, n_layers: int, tokens: str) -> dict[int, list[float]]:
    """{step: [sel gate / sum of gates, per layer]} over `tokens` (a key of TOKENS), from the NSA run's
    TensorBoard log."""
    gates = {b: [scalars(dump, f"nsa/layer{i}/gate_{b}{tokens}") for i in range(n_layers)] for b in ("cmp", "sel", "win")}
    steps = sorted(gates["sel"][0])
    return {s: [gates["sel"][i][s] / sum(gates[b][i][s] for b in gates) for i in range(n_layers)] for s in steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drill_steps", type=int, default=450, help="steps of the drill run")
    parser.add_argument("--steps", type=int, default=0, help="steps of the recall run (0: the config's)")
    parser.add_argument("--distances", type=int, nargs="+", default=[32, 96, 256, 512, 960])
    parser.add_argument("--batches", type=int, default=8, help="held-out batches per distance")
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS),
                        help="which models to train (a change to NSA alone cannot move win or dense)")
    parser.add_argument("--seed", type=int, help="the seed of the initialisation and of the data, training and "
                        "held-out (default: the config's, --debug.seed 0 and --data.seed 1234)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "quality" / "recall_accuracy.png",
                        help="the accuracy chart; the gate-share chart goes beside it (*_gates.png)")
    args = parser.parse_args()
    seeds = [] if args.seed is None else ["--debug.seed", str(args.seed), "--data.seed", str(args.seed)]
    steps = seeds + (["--training.steps", str(args.steps)] if args.steps else [])  # the held-out rows: data.seed + 1
    cfg = resolved(["--config", CONFIG, *steps])
    m, seq_len = cfg.model, cfg.training.seq_len
    hidden, n_dense, n_nsa = dense_ffn_for(m, seq_len)
    models = {"nsa": [], "win": ["--model.nsa_branch", "win"],
              "dense": ["--model.attention", "dense", "--model.ffn_hidden_dim", str(hidden), "--model.sel_score_grad", "0",
                        "--model.sel_score_explore", "0"]}
    models = {name: models[name] for name in args.models}
    print(f"parameters: NSA and win {n_nsa:,} (win: cmp and sel present, not computed), dense {n_dense:,} (MLP hidden "
          f"{m.ffn_hidden_dim or 'default'} -> {hidden}; {100 * (n_dense / n_nsa - 1):+.2f}%); "
          f"w = {m.window_size}, layers x w = {m.n_layers * m.window_size}")
    assert param_count(m, seq_len) == n_nsa
    acc: dict[str, dict[int, float]] = {}
    routing: dict[str, dict[int, dict[str, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, overrides in models.items():
            dump, drill = Path(tmp) / name, Path(tmp) / f"{name}_drill"
            seconds = train(name, [*DRILL, *seeds, "--training.steps", str(args.drill_steps), "--checkpoint.interval",
                                   str(args.drill_steps), *overrides], drill)
            seconds += train(name, steps + overrides + ["--checkpoint.initial_load_path",
                                                        str(drill / "checkpoint" / f"step-{args.drill_steps}")], dump)
            model, _, run_cfg = load_model(str(max((dump / "checkpoint").glob("step-*"),
                                                   key=lambda p: int(p.name.split("-")[1]))))
            if name == "nsa":  # which branch of which layer does the recall: each switched off in turn
                ablations = recall_ablations(model, run_cfg, args.distances, args.batches)
                results = ablations["all on"]
            else:
                results = evaluate_recall(model, run_cfg, args.distances, args.batches)
            acc[name] = {dist: c / max(n, 1) for dist, (c, n) in results.items()}
            routing[name] = recall_routing(model, run_cfg, args.distances, args.batches)
            print(f"{name}: trained in {seconds / 60:.1f} min; " +
                  ", ".join(f"{dist}: {c}/{n}" for dist, (c, n) in results.items()))
            if name == "nsa":  # the drill's steps, then the recall run's after them
                share = {kind: sel_share(drill, m.n_layers, kind) | {args.drill_steps + s: v for s, v in
                                                                     sel_share(dump, m.n_layers, kind).items()}
                         for kind in TOKENS}
    marks = {"w": m.window_size, "layers x w": m.n_layers * m.window_size}
    line_chart(acc, args.out, f"exact recall by distance, equal parameters ({args.drill_steps} drill + "
               f"{cfg.training.steps} recall steps)",
               "distance (tokens)", "exact recall", (0.0, 1.0), marks)
    print(f"plot: {args.out}\n")
    print("| distance | " + " | ".join(acc) + " |\n|---|" + "---|" * len(acc))
    for dist in args.distances:
        print(f"| {dist:,} | " + " | ".join(f"{acc[name][dist]:.1%}" for name in acc) + " |")
    if "nsa" in acc:
        gates = args.out.with_name(args.out.stem + "_gates.png")
        columns = [(kind, i) for kind in TOKENS for i in range(m.n_layers)]
        line_chart({f"layer {i}, {TOKENS[kind]}": {s: v[i] for s, v in share[kind].items()} for kind, i in columns},
                   gates, "NSA during the drill and the recall run: sel gate / (cmp + sel + win)", "step",
                   "sel share", (0.0, 1.0), {"recall run": args.drill_steps})
        print(f"\nplot: {gates}\n\n| step | " + " | ".join(f"sel share, layer {i}, {TOKENS[kind]}" for kind, i in columns)
              + " |\n|---|" + "---|" * len(columns))
        steps_logged = sorted(share[""])
        for s in sorted({*steps_logged[::max(1, len(steps_logged) // 10)], steps_logged[-1]}):
            print(f"| {s} | " + " | ".join(f"{share[kind][s][i]:.3f}" for kind, i in columns) + " |")
        print("\nNSA's exact recall by distance with one branch of one layer switched off:\n" + recall_table(ablations))
    for name, by in routing.items():  # win's selection is computed though gated off: it shows chance picking
        print(f"\n{name}: value tokens predicted right, and how often each layer's selection held the pair's copy:\n"
              + routing_table(by))


if __name__ == "__main__":
    main()
