"""NSA vs dense attention at equal size, data, steps and seed: validation-loss curves and a table.

    python benchmarks/quality_report.py [--steps 300] [--every 25] [--out benchmarks/quality_nsa_vs_dense.png]

Trains `train_configs/debug_model.toml` twice on the embedded corpus (one CPU rank each, a few
minutes per run): once with NSA attention, once with dense causal attention, everything else
identical. Reads the validation losses from each run's TensorBoard log, draws both curves into a
PNG, and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
from pathlib import Path

from PIL import Image, ImageDraw
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

ROOT = Path(__file__).resolve().parent.parent
COLORS = {"nsa": (200, 40, 40), "dense": (40, 80, 200)}


def train(attention: str, steps: int, every: int, dump: Path) -> dict[int, float]:
    subprocess.run([str(ROOT / "run_train.sh"), "--model.attention", attention, "--training.steps", str(steps),
                    "--validation.freq", str(every), "--validation.steps", "8", "--job.dump_folder", str(dump),
                    "--metrics.log_freq", "50"], check=True, capture_output=True, text=True)
    events = EventAccumulator(str(next((dump / "tb").iterdir())))  # the run's own subfolder
    events.Reload()
    return {e.step: e.value for e in events.Scalars("validation/loss")}


def plot(curves: dict[str, dict[int, float]], out: Path) -> None:
    w, h, pad = 800, 500, 60
    img = Image.new("RGB", (w, h), "white")
    d = ImageDraw.Draw(img)
    steps = sorted({s for c in curves.values() for s in c})
    values = [v for c in curves.values() for v in c.values()]
    lo, hi = min(values), max(values)
    x = lambda s: pad + (s - steps[0]) / max(1, steps[-1] - steps[0]) * (w - 2 * pad)  # noqa: E731
    y = lambda v: h - pad - (v - lo) / max(1e-9, hi - lo) * (h - 2 * pad)  # noqa: E731
    d.line([(pad, pad), (pad, h - pad), (w - pad, h - pad)], fill="black", width=2)
    for k in range(5):
        v = lo + (hi - lo) * k / 4
        d.text((5, y(v) - 6), f"{v:.2f}", fill="black")
        d.line([(pad - 4, y(v)), (w - pad, y(v))], fill=(225, 225, 225))
    for s in steps:
        d.text((x(s) - 10, h - pad + 8), str(s), fill="black")
    for i, (name, curve) in enumerate(curves.items()):
        pts = [(x(s), y(curve[s])) for s in sorted(curve)]
        d.line(pts, fill=COLORS[name], width=3)
        for p in pts:
            d.ellipse([p[0] - 3, p[1] - 3, p[0] + 3, p[1] + 3], fill=COLORS[name])
        d.text((w - pad - 150, pad + 20 * i), f"{name} attention", fill=COLORS[name])
    d.text((w // 2 - 120, 15), "validation loss vs step (debug_model, embedded corpus)", fill="black")
    d.text((w // 2 - 20, h - 25), "step", fill="black")
    img.save(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--every", type=int, default=25)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "quality_nsa_vs_dense.png")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        curves = {a: train(a, args.steps, args.every, Path(tmp) / a) for a in ("nsa", "dense")}
    plot(curves, args.out)
    print(f"plot: {args.out}")
    print("| step | NSA validation loss | dense validation loss | NSA - dense |")
    print("|---|---|---|---|")
    for s in sorted(curves["nsa"]):
        n, dn = curves["nsa"][s], curves["dense"][s]
        print(f"| {s} | {n:.4f} | {dn:.4f} | {n - dn:+.4f} |")


if __name__ == "__main__":
    main()
