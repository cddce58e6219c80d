"""What evaluations inside the run (`[eval]`) cost: their share of the default run, as shipped and with more.

    python benchmarks/training/eval_overhead.py [--steps 300]
    python benchmarks/training/eval_overhead.py --lm_eval_ranks 1 2 [--steps 20]

Runs the default config (`./run_train.sh`, 1 rank) three times in a row: without evaluations, with the
shipped `[eval]` (the loss by position, 2 batches a rank, every 100 steps and at the end), and with that
plus lm-eval tasks over local files (40 multiple-choice questions and 8 held-out documents of the embedded
corpus scored in rolling windows). Prints, per run, the wall time, the evaluations' seconds and their share
of the run (the trainer's own `eval/share_of_run`), and the wall time against the run without.
`--lm_eval_ranks`: the lm-eval tasks alone (no loss by position) at each number of ranks, the requests shared
out among them: the evaluations' seconds and the requests a rank.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from nsa_titan.data.sources import open_text_stream  # noqa: E402

CORPUS = ROOT / "data" / "python_docs"


def local_tasks(folder: Path) -> list[str]:
    """Two lm-eval tasks over local files: questions whose answer is a document's next word, and rolling
    perplexity of held-out documents. Returns the `[eval]` overrides that run them."""
    docs = [ex["text"] for ex in open_text_stream(str(CORPUS), "", "validation", "text")]
    questions = []
    for text in docs[:40]:
        words = text.split()
        cut = min(len(words) - 1, 30)
        questions.append({"question": " ".join(words[:cut]), "choices": [words[cut], "banana", "the"], "answer": 0})
    (folder / "mc.jsonl").write_text("".join(json.dumps(q) + "\n" for q in questions))
    (folder / "ppl.jsonl").write_text("".join(json.dumps({"text": t[:4000]}) + "\n" for t in docs[40:48]))
    tasks = {"bench_mc": {"output_type": "multiple_choice", "doc_to_text": "{{question}}", "doc_to_choice": "{{choices}}",
                          "doc_to_target": "answer", "metric_list": [{"metric": "acc"}]},
             "bench_ppl": {"output_type": "loglikelihood_rolling", "doc_to_text": "", "doc_to_target": "{{text}}",
                           "metric_list": [{"metric": "bits_per_byte"}]}}
    for name, task in tasks.items():
        data = folder / f"{name.removeprefix('bench_')}.jsonl"
        (folder / f"{name}.yaml").write_text(json.dumps({"task": name, "dataset_path": "json", "dataset_kwargs":
                                                         {"data_files": {"test": str(data)}}, "test_split": "test",
                                                         **task}))
    return ["--eval.lm_eval_tasks", ",".join(tasks), "--eval.lm_eval_include_path", str(folder)]


def run(steps: int, extra: list[str], ranks: int = 1) -> tuple[float, float, float, str]:
    """(wall seconds, evaluation seconds, the trainer's last eval/share_of_run, lm-eval's requests a rank) of one
    default run on `ranks` ranks."""
    with tempfile.TemporaryDirectory() as dump:
        start = time.monotonic()
        out = subprocess.run([str(ROOT / "run_train.sh"), "--training.steps", str(steps), "--job.dump_folder", dump,
                              *extra], capture_output=True, text=True, check=True, cwd=ROOT,
                             env={**os.environ, "NGPU": str(ranks)}).stdout
        wall = time.monotonic() - start
    evals = [(float(s), float(p)) for s, p in re.findall(r"eval at step \d+: .* \| ([\d.]+) s \(evaluations ([\d.]+)%",
                                                         out)]
    requests = re.findall(r"lm_eval requests a rank ([\d /]+) \|", out)
    return wall, sum(s for s, _ in evals), evals[-1][1] if evals else 0.0, requests[-1] if requests else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--lm_eval_ranks", type=int, nargs="*", default=[], help="lm-eval alone at these ranks")
    args = parser.parse_args()
    if args.lm_eval_ranks:
        with tempfile.TemporaryDirectory() as tasks:
            alone = ["--eval.position_batches", "0", "--eval.freq", str(args.steps), *local_tasks(Path(tasks))]
            results = {n: run(args.steps, alone, n) for n in args.lm_eval_ranks}
        first = args.lm_eval_ranks[0]
        print(f"| ranks | lm-eval s (one evaluation) | requests a rank | time vs {first} rank(s) |")
        print("|---|---|---|---|")
        for n, (_, seconds, _, requests) in results.items():
            print(f"| {n} | {seconds:.2f} | {requests} | {seconds / results[first][1]:.2f}x |")
        return
    with tempfile.TemporaryDirectory() as tasks:
        runs = {"no evaluations": ["--eval.enable", "false"], "shipped [eval]": [],
                "shipped + lm-eval tasks": local_tasks(Path(tasks))}
        results = {name: run(args.steps, extra) for name, extra in runs.items()}
    base = results["no evaluations"][0]
    print(f"| default run, {args.steps} steps | wall s | evaluations s | share of the run | wall vs none |")
    print("|---|---|---|---|---|")
    for name, (wall, seconds, share, _) in results.items():
        print(f"| {name} | {wall:.1f} | {seconds:.2f} | {share:.1f}% | {wall / base:.3f}x |")


if __name__ == "__main__":
    main()
