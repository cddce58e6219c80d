"""Long context the paper's way, on the CPU: pretrain short, evaluate past the training length, adapt
long with YaRN (and, as a control, without a scaling), evaluate again.

    python benchmarks/quality/long_context.py [--models nsa dense] [--steps N] [--adapt_steps 150] [--scalings yarn plain]
        [--work DIR]
        [--distances 256 512 960 1536 2048 3072 4000] [--batches 4] [--text_steps 300] [--text_adapt_steps 40]

Recall (`train_configs/recall.toml`, trained as `recall_report.py` trains it: the drill, then the recall
run at seq 1,024; dense with its MLP widened to NSA's parameter count), per model:
  pretrained  evaluated at seq 4,096 as it is (`--model.max_seq_len 4096`: past its declared length on purpose);
  yarn        adapted at seq 4,096 with `rope_scaling = "yarn"`, factor 4 from 1,024, for --adapt_steps steps
              (batch 2: the pretraining's tokens per step), from the pretrained weights (fresh optimizer);
  plain       the same adaptation without a scaling.
Each is evaluated on the same held-out recall rows of 4,096 tokens (--batches x 8) at every distance
(exact recall of all value tokens), then NSA's routing (`recall_routing`: how often each layer's
selection held the pair).
Text (`debug_model.toml` on the embedded corpus, without document masking so that rows are 4,096-token
streams): the same three stages at --text_steps / --text_adapt_steps (batch 1, lr 3e-4: a tenth of the
pretraining's), and the loss by position
(`evaluate --by_position`, buckets of 512) at 4,096.

Stages whose checkpoint is already in --work are not trained again (a run can be resumed).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from nsa_titan.evaluate import evaluate, evaluate_recall, load_at, position_table, recall_routing, routing_table  # noqa: E402
from benchmarks.quality.recall_report import CONFIG, DRILL, train  # noqa: E402
from benchmarks.quality.sizing import dense_ffn_for, resolved  # noqa: E402

TEXT = str(ROOT / "train_configs" / "debug_model.toml")
LONG, SHORT = 4096, 1024
YARN = ["--model.rope_scaling", "yarn", "--model.rope_factor", str(LONG // SHORT), "--model.rope_original_seq_len",
        str(SHORT)]
PAST = ["--model.max_seq_len", str(LONG)]
"""Evaluation overrides of a model pretrained at SHORT: declared for LONG, to measure it there."""
ROWS = ["--training.local_batch_size", "8", "--training.global_batch_size", "-1"]
"""Recall evaluation batches of 8 rows for every stage (the adaptations train with 2): the same held-out rows."""


def last_step(dump: Path) -> Path | None:
    steps = sorted((dump / "checkpoint").glob("step-*"), key=lambda p: int(p.name.split("-")[1]))
    return steps[-1] if steps else None


def trained(name: str, config: str, overrides: list[str], dump: Path) -> Path:
    """`dump`'s last checkpoint, trained now unless it is there."""
    if last_step(dump) is None:
        seconds = train(name, overrides, dump, config)
        print(f"  {name}: trained in {seconds / 60:.1f} min", flush=True)
    return last_step(dump)


def recall_stages(model: str, overrides: list[str], args: argparse.Namespace, work: Path) -> dict[str, dict]:
    """{stage: {distance: exact recall}} and NSA's routing after the YaRN adaptation."""
    drill = trained(f"{model} drill", CONFIG, [*DRILL, "--training.steps", str(args.drill_steps),
                                               "--checkpoint.interval", str(args.drill_steps), *overrides],
                    work / f"recall-{model}-drill")
    steps = ["--training.steps", str(args.steps), "--checkpoint.interval", str(args.steps)] if args.steps else []
    pre = trained(f"{model} pretraining", CONFIG, [*overrides, *steps, "--checkpoint.initial_load_path", str(drill)],
                  work / f"recall-{model}")
    adapt = [*overrides, "--training.seq_len", str(LONG), "--training.local_batch_size", "2", "--training.steps",
             str(args.adapt_steps), "--checkpoint.interval", str(args.adapt_steps), "--lr_scheduler.warmup_steps", "10",
             "--checkpoint.initial_load_path", str(pre)]
    stages = {"pretrained": (pre, PAST)}
    for scaling in args.scalings:  # the adaptations, each in a folder of its own
        stages[scaling] = (trained(f"{model} {scaling}", CONFIG, [*adapt, *(YARN if scaling == "yarn" else [])],
                                   work / f"recall-{model}-{scaling}-{args.adapt_steps}"), [])
    results: dict[str, dict] = {}
    for stage, (ckpt, extra) in stages.items():
        net, _, cfg = load_at(str(ckpt), None, [*extra, *ROWS], LONG)
        start = time.perf_counter()
        acc = evaluate_recall(net, cfg, args.distances, args.batches)
        results[stage] = {d: c / max(n, 1) for d, (c, n) in acc.items()}
        print(f"  {model} {stage}: " + ", ".join(f"{d}: {c}/{n}" for d, (c, n) in acc.items()) +
              f" ({time.perf_counter() - start:.0f} s)", flush=True)
        if model == "nsa" and stage == "yarn":
            print(f"\n{model} {stage}: value tokens right, and how often each layer's selection held the pair:\n"
                  + routing_table(recall_routing(net, cfg, args.distances, args.batches)) + "\n", flush=True)
    return results


def text_stages(model: str, overrides: list[str], args: argparse.Namespace, work: Path) -> dict[str, dict]:
    """{stage: {(first, end): loss}} at LONG tokens on the embedded corpus's validation split."""
    base = [*overrides, "--training.document_masking", "false", "--validation.enable", "false", "--eval.enable", "false",
            "--checkpoint.enable", "true"]
    pre = trained(f"{model} text pretraining", TEXT, [*base, "--training.seq_len", str(SHORT), "--training.local_batch_size",
                                                      "2", "--training.steps", str(args.text_steps),
                                                      "--checkpoint.interval", str(args.text_steps)],
                  work / f"text-{model}")
    adapt = [*base, "--training.seq_len", str(LONG), "--training.local_batch_size", "1", "--training.steps",
             str(args.text_adapt_steps), "--checkpoint.interval", str(args.text_adapt_steps),
             "--lr_scheduler.warmup_steps", "5", "--optimizer.lr", "3e-4", "--checkpoint.initial_load_path", str(pre)]
    stages = {"pretrained": (pre, PAST),
              "yarn": (trained(f"{model} text yarn", TEXT, [*adapt, *YARN], work / f"text-{model}-yarn"), []),
              "plain": (trained(f"{model} text plain", TEXT, adapt, work / f"text-{model}-plain"), [])}
    results = {}
    for stage, (ckpt, extra) in stages.items():
        r = evaluate(str(ckpt), batches=args.text_batches, overrides=extra, seq_len=LONG, by_position=True,
                     bucket=512)
        results[stage] = {k: v for k, (v, _) in r["by_position"].items()}
        print(f"  {model} text {stage}: loss {r['loss']:.4f}\n{position_table(r['by_position'])}", flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=("nsa", "dense"), default=["nsa", "dense"])
    parser.add_argument("--drill_steps", type=int, default=450)
    parser.add_argument("--steps", type=int, default=0, help="recall pretraining steps (0: recall.toml's)")
    parser.add_argument("--adapt_steps", type=int, default=150, help="recall adaptation steps")
    parser.add_argument("--scalings", nargs="+", choices=("yarn", "plain"), default=["yarn", "plain"],
                        help="the recall adaptations: with YaRN, without a scaling")
    parser.add_argument("--distances", type=int, nargs="+", default=[256, 512, 960, 1536, 2048, 3072, 4000])
    parser.add_argument("--batches", type=int, default=4, help="held-out recall batches (of 8 rows) per distance")
    parser.add_argument("--text_steps", type=int, default=300, help="text pretraining steps (0: no text part)")
    parser.add_argument("--text_adapt_steps", type=int, default=40)
    parser.add_argument("--text_batches", type=int, default=8)
    parser.add_argument("--work", type=Path, help="where the runs go (default: a temporary folder)")
    args = parser.parse_args()
    cfg = resolved(["--config", CONFIG])
    hidden, _, _ = dense_ffn_for(cfg.model, cfg.training.seq_len)
    overrides = {"nsa": [], "dense": ["--model.attention", "dense", "--model.ffn_hidden_dim", str(hidden),
                                      "--model.sel_score_grad", "0", "--model.sel_score_explore", "0"]}
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        recall = {m: recall_stages(m, overrides[m], args, work) for m in args.models}
        print("\n## Exact recall at seq 4,096 (pretrained at 1,024)\n\n| model, stage | " +
              " | ".join(f"{d:,}" for d in args.distances) + " | within 1,024 | beyond |\n|---|" +
              "---|" * (len(args.distances) + 2))
        for m, stages in recall.items():
            for stage, acc in stages.items():
                inside = [v for d, v in acc.items() if d <= SHORT]
                beyond = [v for d, v in acc.items() if d > SHORT]
                print(f"| {m}, {stage} | " + " | ".join(f"{v:.1%}" for v in acc.values()) +
                      f" | {sum(inside) / len(inside):.1%} | {sum(beyond) / len(beyond):.1%} |")
        if args.text_steps:
            text = {m: text_stages(m, overrides[m], args, work) for m in args.models}
            buckets = list(next(iter(next(iter(text.values())).values())))
            print("\n## Text loss by position at seq 4,096 (pretrained at 1,024)\n\n| model, stage | " +
                  " | ".join(f"{a:,}-{b:,}" for a, b in buckets) + " |\n|---|" + "---|" * len(buckets))
            for m, stages in text.items():
                for stage, losses in stages.items():
                    print(f"| {m}, {stage} | " + " | ".join(f"{v:.3f}" for v in losses.values()) + " |")


if __name__ == "__main__":
    main()
