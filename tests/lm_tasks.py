"""lm-evaluation-harness tasks over local JSON files, for the tests that run the harness (on a Hugging Face
export, in `evaluate` and inside a run)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

from nsa_titan.data.sources import open_text_stream

from conftest import ROOT

CORPUS = ROOT / "data" / "python_docs"


def texts(n: int, split: str = "validation") -> list[str]:
    """The first `n` documents of the shipped corpus's `split`."""
    return [ex["text"] for ex in itertools.islice(open_text_stream(str(CORPUS), "", split, "text"), n)]


LM_EVAL_TASKS = {
    "nsa_titan_mc.yaml": {"output_type": "multiple_choice", "doc_to_text": "Question: {{question}}\nAnswer:",
                          "doc_to_choice": "{{choices}}", "doc_to_target": "answer", "metric_list": [{"metric": "acc"}]},
    "nsa_titan_ppl.yaml": {"output_type": "loglikelihood_rolling", "doc_to_text": "", "doc_to_target": "{{text}}",
                           "metric_list": [{"metric": m} for m in ("word_perplexity", "byte_perplexity", "bits_per_byte")]},
    "nsa_titan_gen.yaml": {"output_type": "generate_until", "doc_to_text": "{{prompt}}", "doc_to_target": "{{target}}",
                           "generation_kwargs": {"until": ["\n\n"], "max_gen_toks": 12, "do_sample": False},
                           "metric_list": [{"metric": "exact_match"}]},
}
GEN_PROMPTS = ["The with statement", "def", "Raised when an operation or function is applied", "A", "class C:",
               "import os", "The built-in function len() returns the number of items of", "x = [", "for i in",
               "Exceptions"]
"""Ten prompts of different lengths: one batch of 8 and one of 2 at lm-eval's batch size 8."""


def local_tasks(folder: Path) -> Path:
    """lm-eval tasks over local JSON files: 3 multiple-choice questions, and 4 validation documents of
    the shipped corpus to score (each longer than seq_len 64: several rolling windows)."""
    folder.mkdir()
    questions = [{"question": "In Python, the keyword that defines a function is", "choices": ["def", "class", "pass"],
                  "answer": 0},
                 {"question": "A list is written with", "choices": ["square brackets", "braces", "slashes"], "answer": 0},
                 {"question": "The statement that leaves a loop is", "choices": ["break", "import", "yield"], "answer": 0}]
    (folder / "mc.jsonl").write_text("".join(json.dumps(q) + "\n" for q in questions))
    (folder / "ppl.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts(4)))
    (folder / "gen.jsonl").write_text("".join(json.dumps({"prompt": p, "target": "x"}) + "\n" for p in GEN_PROMPTS))
    for name, task in LM_EVAL_TASKS.items():
        data = folder / f"{name.removeprefix('nsa_titan_').removesuffix('.yaml')}.jsonl"
        (folder / name).write_text(json.dumps({"task": name.removesuffix(".yaml"), "dataset_path": "json",
                                               "dataset_kwargs": {"data_files": {"test": str(data)}},
                                               "test_split": "test", **task}, indent=1))  # YAML reads JSON
    return folder


