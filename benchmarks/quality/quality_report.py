"""NSA vs dense attention at equal parameter count, data and steps, over several seeds: validation-loss
curves (mean and spread) and a table.

    python benchmarks/quality/quality_report.py [--steps 300] [--every 25] [--seeds 0 1 2]
                                        [--out benchmarks/quality/quality_nsa_vs_dense.png]

Trains `train_configs/debug_model.toml` on the embedded corpus (one CPU rank per run, a few minutes
each), once with NSA attention and once with dense causal attention whose MLP is widened to the NSA
model's parameter count (`sizing.py`), for every seed (`--debug.seed`: the initialisation; the data
order is the same in every run). Reads the validation losses from each run's TensorBoard log, draws
the mean curves with their min-max band into a PNG, and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from nsa_titan.observe.plots import line_chart  # noqa: E402
from benchmarks.quality.sizing import dense_ffn_for, resolved  # noqa: E402

CONFIG = str(ROOT / "train_configs" / "debug_model.toml")


def train(overrides: list[str], steps: int, every: int, dump: Path) -> dict[int, float]:
    subprocess.run([str(ROOT / "run_train.sh"), "--config", CONFIG, *overrides, "--training.steps", str(steps),
                    "--validation.freq", str(every), "--validation.steps", "8", "--job.dump_folder", str(dump),
                    "--metrics.log_freq", "50", "--checkpoint.enable", "false"],
                   check=True, capture_output=True, text=True)
    return scalars(dump, "validation/loss")


def scalars(dump: Path, tag: str) -> dict[int, float]:
    """{step: value} of one TensorBoard tag of the run in `dump`."""
    events = EventAccumulator(str(next((dump / "tb").iterdir())))  # the run's own subfolder
    events.Reload()
    return {e.step: e.value for e in events.Scalars(tag)}


def plot(curves: dict[str, list[dict[int, float]]], out: Path, title: str) -> None:
    """Mean curve of each model and the band between its lowest and highest seed."""
    mean = {f"{name} attention": {s: statistics.mean(c[s] for c in runs) for s in runs[0]}
            for name, runs in curves.items()}
    bands = {f"{name} attention": ({s: min(c[s] for c in runs) for s in runs[0]},
                                   {s: max(c[s] for c in runs) for s in runs[0]}) for name, runs in curves.items()}
    line_chart(mean, out, title, "step", "validation loss (mean, min-max band)", bands=bands)


def mean_spread(values: list[float]) -> str:
    """'mean ± sample standard deviation' (just the value for one seed)."""
    return f"{statistics.mean(values):.4f}" + (f" ± {statistics.stdev(values):.4f}" if len(values) > 1 else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--every", type=int, default=25)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "quality" / "quality_nsa_vs_dense.png")
    args = parser.parse_args()
    cfg = resolved(["--config", CONFIG])
    hidden, n_dense, n_nsa = dense_ffn_for(cfg.model, cfg.training.seq_len)
    models = {"nsa": ["--model.attention", "nsa"],
              "dense": ["--model.attention", "dense", "--model.ffn_hidden_dim", str(hidden)]}
    print(f"parameters: NSA {n_nsa:,}, dense {n_dense:,} (MLP hidden {cfg.model.ffn_hidden_dim or 'default'} -> "
          f"{hidden}; {100 * (n_dense / n_nsa - 1):+.2f}%)")
    curves: dict[str, list[dict[int, float]]] = {name: [] for name in models}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            for name, overrides in models.items():
                dump = Path(tmp) / f"{name}-{seed}"
                curves[name].append(train([*overrides, "--debug.seed", str(seed)], args.steps, args.every, dump))
                print(f"seed {seed} {name}: final validation loss {curves[name][-1][max(curves[name][-1])]:.4f}")
    plot(curves, args.out, f"validation loss vs step, {len(args.seeds)} seeds (debug_model, equal parameters)")
    print(f"plot: {args.out}")
    print("| step | NSA validation loss | dense validation loss | NSA - dense |")
    print("|---|---|---|---|")
    for s in sorted(curves["nsa"][0]):
        n, dn = [c[s] for c in curves["nsa"]], [c[s] for c in curves["dense"]]
        print(f"| {s} | {mean_spread(n)} | {mean_spread(dn)} | {statistics.mean(n) - statistics.mean(dn):+.4f} |")


if __name__ == "__main__":
    main()
