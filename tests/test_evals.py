"""Evaluations inside a run (`[eval]`, `nsa_titan/observe/evals.py`): at 2 ranks under FSDP (run_train.sh, the shipped
settings) and with context parallelism 2, the loss by position, the recall probe and lm-eval's local tasks of
step N equal `python -m nsa_titan.evaluate` on step N's checkpoint, to printed precision, in the metrics
files; and a run with them trains exactly as one without."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

from nsa_titan.config import ConfigError, Model, load_config
from nsa_titan.observe.lm_harness import score
from nsa_titan.models.transformer import Transformer

from conftest import ROOT, TINY, Command, background, background_folder, finished, outputs, tb_losses
from jobs import job_command
from lm_tasks import local_tasks

STEPS = 10
EVAL = ["--eval.enable", "true", "--eval.freq", "5", "--eval.bucket", "32", "--eval.position_batches", "2",
        "--eval.recall_distances", "16,40", "--eval.recall_batches", "3", "--eval.lm_eval_tasks",
        "nsa_titan_mc,nsa_titan_ppl"]
# Each cp rank's sequence: seq_len 72, padded to 96 (the split's multiple), as test_context_parallel.py runs it.
CP = [*TINY[:TINY.index("--training.mixed_precision_param")], "--training.mixed_precision_param", "float32",
      "--model.vocab_size", "0", "--data.source", "datasets", "--data.tokenizer", "sentencepiece",
      "--data.num_workers", "2", "--training.seq_len", "72", "--training.local_batch_size", "2",
      "--checkpoint.enable", "true", "--checkpoint.interval", "5", "--checkpoint.async_mode", "async",
      "--training.steps", str(STEPS), "--parallelism.context_parallel_degree", "2"]


def scalars(folder: Path, prefix: str, step: int) -> dict[str, float]:
    """{tag without `prefix`: value at `step`} of the TensorBoard run in `folder`."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from conftest import tb_run

    events = EventAccumulator(tb_run(folder), size_guidance={"scalars": 0})
    events.Reload()
    return {tag.removeprefix(prefix): next(e.value for e in events.Scalars(tag) if e.step == step)
            for tag in events.Tags()["scalars"] if tag.startswith(prefix)}


def same(logged: float, printed: str, scale: float = 1.0) -> bool:
    """A TensorBoard value (float32) x `scale` equals a value printed to its last digit."""
    decimals = len(printed.partition(".")[2])
    return abs(logged * scale - float(printed)) <= 0.5 * 10 ** -decimals + 1e-7 * abs(float(printed))


def assert_equals_evaluate(name: str, cp: int) -> None:
    """Step 10's evaluations of the run `name` in TensorBoard against `evaluate` on checkpoint step-10 (the
    commands after the run), value by printed value; the lm-eval requests shared out among the 2 / cp data-parallel
    ranks (in the run's output), each scoring its half (the harness pads the shorter share to equal counts)."""
    out, recall, harness, by_position = outputs(name, BACKGROUND)
    got = scalars(RUNS[name] / "tb", "eval/", STEPS)
    rows = re.findall(r"^\| (\d+)-(\d+) \| (\S+) \| [\d,]+ \|$", by_position.replace(",", ""), re.M)
    assert len(rows) >= 2, by_position
    for first, end, loss in rows:
        assert same(got[f"loss_by_position/{first}-{end}"], loss), (first, end, got)
    for d, share, queries in re.findall(r"^\| (\d+) \| ([\d.]+)% \| (\d+) \|$", recall, re.M):
        assert same(got[f"recall/{d}"], share, 100) and int(queries) > 0, (d, recall)
    assert {f"recall/{d}" for d in (16, 40)} <= got.keys()
    printed = dict(re.findall(r"^(nsa_titan_\w+/\w+): (\S+)$", harness, re.M))
    assert set(printed) == {"nsa_titan_mc/acc", "nsa_titan_ppl/word_perplexity", "nsa_titan_ppl/byte_perplexity",
                            "nsa_titan_ppl/bits_per_byte"}
    for task, value in printed.items():
        assert same(got[f"lm_eval/{task}"], value), (task, value, got)
    total, ranks = int(re.search(r"^lm_eval requests: (\d+)$", harness, re.M).group(1)), 2 // cp
    shares = re.findall(rf"eval at step {STEPS}: .* \| lm_eval requests a rank ([\d /]+) \|", out)
    counts = [int(n) for n in shares[-1].split(" / ")] if shares else []
    # The harness shares out documents (a multiple-choice one is a request a choice), then pads to equal counts.
    assert len(counts) == ranks and len(set(counts)) == 1 and total <= sum(counts) and \
        (ranks == 1 or counts[0] <= 0.65 * total), (shares, total)
    assert 0 < got["share_of_run"] < 1 and got["seconds"] > 0


TASKS = local_tasks(background_folder("evals-tasks"))
CANNOT_RUN = background_folder("evals-cannot-run") / "out"
SHORT_DOCUMENTS = background_folder("evals-short-documents")


def short_documents() -> Path:
    """A corpus of held-out documents of ~40 tokens (4 train and 4 validation shards), written at collection."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    (corpus := SHORT_DOCUMENTS / "short").mkdir(parents=True)
    for split in ("train", "validation"):
        for k in range(4):
            docs = [f"{split} {k}/{i}: " + "ab" * (15 + i % 5) for i in range(200)]
            pq.write_table(pa.table({"text": docs}), corpus / f"{split}-{k:05d}-of-00004.parquet")
    return corpus


RUNS = {name: background_folder(name) / "out" for name in ("evals-fsdp", "evals-plain", "evals-cp")}


def evaluations(run: Path, cp: int) -> tuple[Command, ...]:
    """`evaluate` on step-10 of `run`: the recall probe and lm-eval's local tasks (one process each), then the
    loss by position at 2 ranks splitting each sequence into `cp` parts."""
    ckpt = str(run / "checkpoint" / f"step-{STEPS}")
    evaluate = [sys.executable, "-m", "nsa_titan.evaluate", ckpt]
    return (Command([*evaluate, "--task", "recall", "--distances", "16", "40", "--batches", "3"]),
            Command([*evaluate, "--task", "lm_eval", "--tasks", "nsa_titan_mc", "nsa_titan_ppl", "--include_path",
                     str(TASKS)]),
            Command([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
                     *evaluate[1:], "--by_position", "--bucket", "32", "--batches", "2", "--context_parallel", str(cp)],
                    {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}, sessions=True))


BACKGROUND = {
    "evals-fsdp": (job_command(RUNS["evals-fsdp"], "--training.steps", str(STEPS), "--checkpoint.interval", "5",
                               *EVAL, "--eval.lm_eval_include_path", str(TASKS), nproc=2),
                   *evaluations(RUNS["evals-fsdp"], 1)),
    "evals-plain": job_command(RUNS["evals-plain"], "--training.steps", str(STEPS), "--checkpoint.interval", "5",
                               nproc=2),
    "evals-cannot-run": Command([str(ROOT / "run_train.sh"), "--config", "train_configs/m7c.toml", "--data.path",
                                 "data/python_docs", "--data.name=", "--data.tokenizer", "sentencepiece",
                                 "--data.tokenizer_path", "data/python_docs/tokenizer.model", "--training.seq_len",
                                 "8192", "--training.local_batch_size", "1", "--job.dump_folder", str(CANNOT_RUN)],
                                {"NGPU": "1"}, sessions=True),
    "evals-short-documents": job_command(SHORT_DOCUMENTS / "out", "--data.path", str(short_documents()),
                                         "--data.tokenizer", "byte", "--training.steps", "10", "--eval.enable", "true",
                                         "--eval.freq", "5", "--eval.bucket", "32", "--eval.position_batches", "2",
                                         nproc=2),
    "evals-cp": (Command([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone", "-m",
                          "nsa_titan.train", *CP, *EVAL, "--eval.lm_eval_include_path", str(TASKS), "--job.dump_folder",
                          str(RUNS["evals-cp"])], {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
                         sessions=True),
                 *evaluations(RUNS["evals-cp"], 2)),
}
"""The runs, as run_train.sh and torchrun start them: with evaluations at 2 FSDP ranks, the same without, and
with evaluations at context parallelism 2 (after each run with evaluations, `evaluate`'s on its step 10); M7C at
seq 8,192, which its held-out text cannot feed; 2 ranks on held-out documents shorter than the buckets."""


@pytest.mark.multiprocess
@pytest.mark.background
def test_at_two_fsdp_ranks_the_evaluations_equal_evaluate_and_leave_training_unchanged():
    """run_train.sh at 2 ranks (the default config's loader workers and async saves): evaluations at steps 5 and
    10, each line on the console; step 10's equal `evaluate`'s on step-10 (one process), each rank having scored
    about half the lm-eval requests; the training losses equal those of the same run without evaluations (the
    evaluations change no random state, model or data position)."""
    out, dump = outputs("evals-fsdp", BACKGROUND)[0], RUNS["evals-fsdp"]
    lines = re.findall(r"eval at step (\d+): loss_by_position/0-32 [\d.]+ .* \| recall/16 [\d.]+ .* \| "
                       r"lm_eval/nsa_titan_mc/acc [\d.]+ .* \| [\d.]+ s \(evaluations [\d.]+% of the run so far\)", out)
    assert lines == ["5", "10"], out[-3000:]
    finished("evals-plain", BACKGROUND)
    assert tb_losses(dump / "tb") == tb_losses(RUNS["evals-plain"] / "tb")
    assert_equals_evaluate("evals-fsdp", cp=1)


@pytest.mark.multiprocess
@pytest.mark.background
def test_with_context_parallelism_2_the_evaluations_equal_evaluate():
    """2 ranks splitting each sequence (cp = 2, loader workers, async saves): step 10's evaluations equal
    `evaluate`'s on step-10, the loss by position with the sequence split the same way."""
    assert_equals_evaluate("evals-cp", cp=2)


@pytest.mark.parametrize("args,message", [
    (["--eval.recall_distances", "16,500"], r"\[eval\] recall_distances = \[16, 500\]: \[500\] do not fit"),
    (["--eval.position_batches", "-1"], r"\[eval\] position_batches = -1, .* must be >= 0"),
    (["--eval.lm_eval_include_path", "/no/such/folder"], r"lm_eval_include_path = '/no/such/folder' is not a folder"),
    (["--eval.recall_distances", "8,x"], r"\[eval\] recall_distances = '8,x' is invalid: expected a list of integers"),
])
def test_bad_eval_settings_are_refused_before_any_rank_starts(args, message):
    with pytest.raises(ConfigError, match=message):
        load_config([*TINY, "--eval.enable", "true", "--training.seq_len", "128", *args], world_size=1)


@pytest.mark.parametrize("attention", ["nsa", "dense"])
@pytest.mark.slow
def test_rows_scored_in_batches_score_as_each_alone(attention):
    """lm-eval's rows batched (padded at their end, longest first) against each row alone, with documents."""
    model = Transformer(Model(attention=attention, dim=64, n_heads=4, n_kv_groups=2, head_dim=16, vocab_size=97,
                              cmp_block_size=8, cmp_stride=4, sel_block_size=8, sel_top_n=4, window_size=16), 128)
    model.init_weights(0)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for length in (128, 37, 90, 5, 64, 121, 17):
        ids = torch.randint(0, 97, (length,), generator=gen).tolist()
        rows.append((ids, ids[-min(length, 9):]))  # scored: the last tokens (their labels, shifted or not)
    alone = [score(model, [row], 96, torch.device("cpu"))[0] for row in rows]
    batched = score(model, rows, 96, torch.device("cpu"), batch_size=3)
    assert [g for _, g in batched] == [g for _, g in alone]
    torch.testing.assert_close(torch.tensor([lp for lp, _ in batched]), torch.tensor([lp for lp, _ in alone]),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_unknown_and_generation_tasks_are_refused_with_the_fix(tmp_path):
    from nsa_titan.observe.lm_harness import Harness

    tasks = local_tasks(tmp_path / "tasks")
    with pytest.raises(ConfigError, match=r"tasks \['no_such_task'\] are not known to lm-eval nor in .*: check"):
        Harness(["no_such_task"], str(tasks), 0)
    with pytest.raises(ConfigError, match=r"tasks \['nsa_titan_gen'\] generate text, .* Hugging Face export"):
        Harness(["nsa_titan_mc", "nsa_titan_gen"], str(tasks), 0)


@pytest.mark.multiprocess
@pytest.mark.background
def test_an_evaluation_that_cannot_run_stops_the_run_before_step_1():
    """`m7c.toml` at seq 8,192 on the embedded corpus (its validation and loss by position on): the held-out text
    gives no batch of 8,192 tokens, found before step 1: one line with the fix, exit 2, nothing trained or saved."""
    proc = background("evals-cannot-run", BACKGROUND)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    assert re.search(r"^nsa_titan: data error: \[data\] holdout = 0.001 of .* gave no batch of seq_len 8192 on some "
                     r"rank: hold out more", out, re.M), out[-3000:]
    assert "step 1/" not in out and not list(CANNOT_RUN.glob("checkpoint/step-*"))


@pytest.mark.multiprocess
@pytest.mark.background
def test_empty_position_buckets_are_not_logged_and_warned_once():
    """Held-out documents of ~40 tokens under document masking (2 ranks, loader workers, async saves): buckets
    past them hold no token. Their loss is neither logged nor shown (a 0 would read as perfect), every bucket's
    token count is logged, and one warning line names them."""
    from conftest import tb_run
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = finished("evals-short-documents", BACKGROUND)
    lines = re.findall(r"eval at step \d+: (.*)", out)
    assert len(lines) == 2 and all("0-32" in line and "32-64" in line and "64-96" not in line for line in lines), out
    assert len(re.findall(r"WARNING eval: the held-out text of the loss by position has no token at positions "
                          r"64-96, 96-128", out)) == 1, out[-3000:]
    events = EventAccumulator(tb_run(SHORT_DOCUMENTS / "out" / "tb"), size_guidance={"scalars": 0})
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"eval/loss_by_position/0-32", "eval/loss_by_position/32-64"} <= tags
    assert not {"eval/loss_by_position/64-96", "eval/loss_by_position/96-128"} & tags
    tokens = {b: events.Scalars(f"eval/tokens_by_position/{b}")[-1].value for b in ("0-32", "32-64", "64-96", "96-128")}
    assert tokens["0-32"] > tokens["32-64"] > 0 and tokens["64-96"] == tokens["96-128"] == 0, tokens


def test_the_adapt_config_measures_positions_on_its_long_documents():
    """m7c_32k_adapt.toml's loss by position reads each source's held-out documents, its long-document source's
    (8,192 tokens or more) among them: the text whose positions reach into the 32k buckets the measure is for."""
    from nsa_titan.data.tokenizer import ByteTokenizer
    from nsa_titan.observe.evals import InRunEvals

    cfg, _ = load_config(["--config", str(ROOT / "train_configs" / "m7c_32k_adapt.toml")], world_size=8)
    evals = InRunEvals(cfg, ByteTokenizer(), torch.device("cpu"), 0, 4)
    sets = {s.label: s for s in evals.positions.sets}
    assert set(sets) == {"fineweb-edu", "fineweb-edu-long"} and sets["fineweb-edu-long"].min_tokens == 8192
    assert cfg.data.holdout > 0 and evals.positions.steps == cfg.eval.position_batches and evals.bucket == 4096
