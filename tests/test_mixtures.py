"""Data for real runs: weighted mixtures of sources (streamed and prepared), prepared token shards, their exact
resume (also on another number of ranks), a prepare killed and rerun, and every refusal.

Loader-level tests use 2 data-parallel ranks and 2 loader workers (streamed text; prepared shards are read in
the training process), as the shipped configs run; the job tests run `run_train.sh` on the embedded corpus
split into three sources by document length.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from nsa_titan.config import ConfigError, Data, Source, Validation, load_config
from nsa_titan.data import DataError, HeldOutSets, SourceEnded, build_dataloader, build_tokenizer, shutdown_workers
from nsa_titan.data.sources import is_held_out
from nsa_titan.data.prepare import prepare
from nsa_titan.data.prepared import Mixture, part_hash
from nsa_titan.data.tokenizer import ByteTokenizer

from conftest import ROOT, Command, background_folder, finished, tb_run
from jobs import STEPS, Job, assert_bit_equal, job_command, run_job

NAMES, WEIGHTS = ("alpha", "beta", "gamma"), (5.0, 3.0, 2.0)
SEQ_LEN, BATCH, WORKERS = 33, 2, 2
THREE = """
[[data.sources]]
path = "data/python_docs"
label = "short"
max_tokens = 600
weight = 5
[[data.sources]]
path = "data/python_docs"
label = "long"
min_tokens = 1500
weight = 3
[[data.sources]]
path = "data/python_docs"
label = "all"
weight = 2
"""
"""The embedded corpus as three sources, by document length (each with its 8 shard files)."""


def doc_text(name: str, i: int) -> str:
    return f"{name}{i:04d}:".ljust(15, "x") + "\n"  # 16 bytes + <eos>: a window of 34 tokens holds 2 documents


@pytest.fixture(scope="module")
def corpora(tmp_path_factory) -> list[Path]:
    """Three sources, each 4 parquet shards of 16 documents that name their source."""
    roots = []
    for name in NAMES:
        root = tmp_path_factory.mktemp(name)
        for k in range(4):
            pq.write_table(pa.table({"text": [doc_text(name, i) for i in range(k, 64, 4)]}),
                           root / f"train-{k:05d}-of-00004.parquet")
        roots.append(root)
    return roots


def mixture(corpora, prepared: str = "", **kw) -> Data:
    sources = [Source(str(p), label=n, weight=w) for p, n, w in zip(corpora, NAMES, WEIGHTS)]
    return Data(path=str(corpora[0]), tokenizer="byte", shuffle_buffer=8, num_workers=WORKERS, seed=3,
                sources=sources, prepared=prepared, **kw)


OPEN: list = []
"""The loaders a test made: their workers ignore the stop signals, so they are shut down after each test."""


@pytest.fixture(autouse=True)
def shut_loaders():
    yield
    while OPEN:
        shutdown_workers(OPEN.pop())


def loader(data: Data, rank: int = 0, ranks: int = 1, batch: int = BATCH):
    OPEN.append(build_dataloader(data, ByteTokenizer(), SEQ_LEN, 320, batch, rank, ranks))
    return OPEN[-1]


def loaders(data: Data, ranks: int = 2, batch: int = BATCH) -> list:
    return [loader(data, r, ranks, batch) for r in range(ranks)]


def sources_of(batches) -> torch.Tensor:
    """Documents per source (their <eos> tokens, counted by the source ids the batches carry)."""
    return sum(torch.bincount(b.sources[b.inputs == ByteTokenizer.eos_id], minlength=3) for b in batches)


@pytest.fixture(scope="module")
def prepared(corpora, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("prepared") / "mix"
    cfg, _ = load_config(["--data.tokenizer", "byte"], world_size=1)
    cfg.data = mixture(corpora)
    prepare(cfg, out, processes=1, docs_per_part=8)
    return out


def test_streamed_mixture_shares_are_the_weights_by_tokens(corpora):
    """Over 2 ranks x 2 workers, each source's share of the tokens is its weight's to within one document a
    worker; every document names the source its ids say."""
    tokens = torch.zeros(3, dtype=torch.long)
    for dl in loaders(mixture(corpora)):
        batches = [b for b, _ in zip(dl, range(120))]
        tokens += sum(torch.bincount(b.sources.flatten(), minlength=3) for b in batches)
        for b in batches:
            for window, ids in zip(b.inputs, b.sources):
                text = ByteTokenizer().decode(window.tolist())
                assert all(text[16 * d:].startswith(NAMES[int(ids[17 * d])]) for d in range(2)), text
    n, p = int(tokens.sum()), torch.tensor(WEIGHTS) / sum(WEIGHTS)
    assert n == 2 * 120 * BATCH * SEQ_LEN
    assert (tokens - n * p).abs().max() <= 4 * 17, (tokens.tolist(), p.tolist())  # 4 workers, 17 tokens a document


@pytest.mark.parametrize("weights", [WEIGHTS, (1.0, 1e-4), (0.7, 0.2, 0.05, 0.05)], ids=["3", "tiny", "4"])
def test_prepared_mixture_shares_are_the_weights_in_every_prefix_and_run(weights):
    """Prepared windows: the first i global samples hold each source's share of i to within one, any run of samples
    its share to within two, each source's k-th sample in order; a weight of 1e-4 gets its 2 samples of 20,000
    (blocks of 4,096 with whole shares each gave it none)."""
    mix, n, share = Mixture(list(weights)), 20_000, np.array(weights) / sum(weights)
    located = [mix.locate(i) for i in range(n)]
    for s in range(len(weights)):  # each source's k-th sample appears once, in order of the global index
        assert [k for src, k in located if src == s] == list(range(sum(1 for src, _ in located if src == s)))
    seen = np.cumsum(np.eye(len(weights))[[s for s, _ in located]], axis=0)
    assert np.abs(seen - np.arange(1, n + 1)[:, None] * share).max() < 1
    for span in (7, 100, 1000):
        assert np.abs(seen[span:] - seen[:-span] - span * share).max() <= 2
    assert mix.taken(5000).tolist() == np.bincount([s for s, _ in located[:5000]], minlength=len(weights)).tolist()
    assert mix.taken(n).tolist() == np.round(n * share).astype(int).tolist()


def test_a_prepared_weight_too_small_for_one_sample_of_the_run_is_refused(tmp_path):
    """Weights 1 and 1e-5 over 2 steps of 8 samples: the second source would get none; the refusal names it, its
    share, the run's samples and the least weight that gets one. 1e-3 over 1,000 steps trains it."""
    args = ["--data.prepared", str(tmp_path), "--training.local_batch_size", "8", "--training.steps", "2"]
    sources = ("[[data.sources]]\npath = 'a'\nweight = 1.0\n[[data.sources]]\npath = 'b'\nlabel = 'rare'\n"
               "weight = {}\n")
    config = tmp_path / "mix.toml"
    config.write_text(sources.format(1e-5))
    with pytest.raises(ConfigError, match=r"\[\[data.sources\]\] 1 \('rare'\): weight = 1e-05 is 1e-05 of the "
                                          r"mixture: no sample of it among this run's 16 \(steps x global_batch_size\); "
                                          r"give it a weight of at least 0\.0323, or leave it out"):
        load_config(["--config", str(config), *args])
    config.write_text(sources.format(1e-3))
    load_config(["--config", str(config), *args[:-1], "1000"])


LENGTHS = {"short": 256, "long": 2048}
"""Two sources of documents of these mean lengths (byte tokens: uniform over half to 1.5 times the mean)."""


def write_short_long(folder: Path) -> list[Path]:
    """The two sources, each 4 parquet shards, in `folder`."""
    rng, roots = np.random.default_rng(0), []
    for name, mean in LENGTHS.items():
        (root := folder / name).mkdir(parents=True)
        for k in range(4):
            docs = [name[0] * int(n) for n in rng.integers(mean // 2, 3 * mean // 2 - 1, 300 if name == "short" else 40)]
            pq.write_table(pa.table({"text": docs}), root / f"train-{k:05d}-of-00004.parquet")
        roots.append(root)
    return roots


def write_config(path: Path, sources: str) -> Path:
    """The shipped default config with 2 loader workers and the `[[data.sources]]` tables `sources`."""
    text = (ROOT / "train_configs" / "debug_model.toml").read_text().replace("num_workers = 1", "num_workers = 2")
    path.write_text(text + sources)
    return path


SHARED = background_folder("mixtures")
SHARED.mkdir(parents=True)
SHORT_LONG = write_short_long(SHARED)
"""Written when the module is collected, for the runs in the background (BACKGROUND, below)."""


@pytest.fixture(scope="module")
def short_long() -> list[Path]:
    return SHORT_LONG


@pytest.mark.parametrize("kind", ["streamed", "prepared"])
@pytest.mark.slow
def test_token_shares_hold_over_any_1000_windows(short_long, tmp_path, kind):
    """Documents of mean length 256 and 2,048 at weights 0.5 / 0.5 (2 loader workers): each source's share of
    the tokens of any 1,000 consecutive windows lies within 1% of 0.5 (a share of documents would give the long
    source 8 / 9 of them)."""
    data = Data(path=str(short_long[0]), tokenizer="byte", num_workers=WORKERS, shuffle_buffer=64, seed=3,
                sources=[Source(str(p), label=n, weight=0.5) for p, n in zip(short_long, LENGTHS)])
    if kind == "prepared":
        cfg, _ = load_config(["--data.tokenizer", "byte"], world_size=1)
        cfg.data = data
        prepare(cfg, tmp_path / "p", processes=1, docs_per_part=64)
        data = dataclasses.replace(data, prepared=str(tmp_path / "p"))
    OPEN.append(build_dataloader(data, ByteTokenizer(), 512, 320, 1, 0, 1))
    per_window = torch.stack([torch.bincount(b.sources.flatten(), minlength=2) for b, _ in zip(OPEN[-1], range(1400))])
    seen = torch.cumsum(per_window, 0).double()
    span = seen[1000:] - seen[:-1000]
    assert (span[:, 1] / span.sum(1) - 0.5).abs().max() < 0.01


def held_docs(batches) -> list[str]:
    """The documents of validation batches of 34-token windows (each window two whole documents)."""
    return [ByteTokenizer().decode(w.tolist())[16 * d:16 * d + 16] for b in batches for w in b.inputs for d in range(2)]


def test_validation_reads_each_source_s_held_out_documents(corpora, tmp_path):
    """`[data] holdout` with a mixture: one validation set per source, holding exactly that source's held-out
    documents (2 ranks, streamed), read once and kept; prepared, the same windows as streamed (1 rank), and
    its training parts hold none of them."""
    data = mixture(corpora, holdout=0.25)
    v = Validation(enable=True, steps=1000)
    per_rank = [HeldOutSets(data, v, ByteTokenizer(), SEQ_LEN, 1, r, 2) for r in (0, 1)]
    assert [s.label for s in per_rank[0].sets] == list(NAMES)
    for i, name in enumerate(NAMES):
        read = sorted(d for sets in per_rank for d in held_docs(sets.batches()[i]))
        held = sorted(t for t in map(lambda k: doc_text(name, k), range(64)) if is_held_out(t, 0.25))
        # One pass over them and no other document; a rank's last document may not fill a window.
        assert len(set(read)) == len(read) and set(read) <= set(held) and len(held) - 2 <= len(read), (read, held)
    assert per_rank[0].batches() is per_rank[0].batches()  # kept: later validations read nothing
    cfg, _ = load_config(["--data.tokenizer", "byte"], world_size=1)
    cfg.data = data
    prepare(cfg, tmp_path / "held", processes=1, docs_per_part=8)
    streamed = HeldOutSets(data, v, ByteTokenizer(), SEQ_LEN, BATCH, 0, 1).batches()
    prepared = HeldOutSets(dataclasses.replace(data, prepared=str(tmp_path / "held")), v, ByteTokenizer(), SEQ_LEN,
                           BATCH, 0, 1).batches()
    for a, b in zip(streamed, prepared, strict=True):
        assert len(a) == len(b) > 0 and all(torch.equal(x.inputs, y.inputs) for x, y in zip(a, b, strict=True))
    trained = "".join(ByteTokenizer().decode(np.fromfile(p, np.uint16).tolist())
                      for p in (tmp_path / "held").glob("*/part-*.bin"))
    assert trained and not any(d in trained for d in held_docs(b for s in prepared for b in s))


@pytest.mark.parametrize("kind", ["streamed", "prepared"])
def test_a_restored_mixture_gives_the_same_next_batches(corpora, prepared, kind):
    """Every source's position, the buffer and the RNG (streamed) or the global position (prepared) are saved:
    a loader restored from a state taken mid-run yields exactly the batches the first one yields next."""
    data = mixture(corpora, str(prepared) if kind == "prepared" else "")
    first, again = loaders(data), loaders(data)
    for a, b in zip(first, again):
        it = iter(a)
        [next(it) for _ in range(37)]  # past each source's first epoch
        b.load_state_dict(a.state_dict())
        expected, got = [next(it) for _ in range(12)], [x for x, _ in zip(b, range(12))]
        for x, y in zip(expected, got):
            assert all(torch.equal(u, v) for u, v in zip(x, y))


def test_prepared_windows_continue_on_another_number_of_ranks(corpora, prepared):
    """Saved at 2 ranks and resumed at 1 (and at 2 again from a 1-rank save): the new layout reads exactly the
    token ids the old one would have read next, in the order of the global sample index."""
    data = mixture(corpora, str(prepared))
    dls = loaders(data)
    two = [iter(dl) for dl in dls]
    for _ in range(5):
        [next(it) for it in two]
    state = dls[0].state_dict()  # what every rank's checkpoint holds; rank 0's is what a 1-rank run loads
    assert state["next"] == dls[1].state_dict()["next"] == 5 * 2 * BATCH
    would = [torch.cat([next(it).inputs for it in two]) for _ in range(3)]  # ranks 0, 1 of each global batch
    one, = loaders(data, ranks=1)
    one.load_state_dict(state)
    got = [b.inputs for _, b in zip(range(6), one)]
    assert torch.equal(torch.cat(got), torch.cat(would))
    back = loaders(data)  # and from the 1-rank position (sample 32) to 2 ranks again
    for dl in back:
        dl.load_state_dict(one.state_dict())
    fresh = [b.inputs for b, _ in zip(loaders(data, ranks=1)[0], range(18))]
    assert torch.equal(torch.cat([next(iter(dl)).inputs for dl in back]), torch.cat(fresh[16:18]))


def test_new_weights_at_a_resume_continue_each_prepared_source_where_it_was(corpora, prepared):
    """Prepared windows resumed with other weights (accepted): from the global sample reached, each source's next
    window is the one after the last its old weights had read: none read again, none skipped."""
    dl, = loaders(mixture(corpora, str(prepared)), ranks=1)
    it = iter(dl)
    [next(it) for _ in range(50)]  # global samples 0-99
    state = dl.state_dict()
    other = mixture(corpora, str(prepared))
    other.sources = [dataclasses.replace(s, weight=1.0) for s in other.sources]
    again, = loaders(other, ranks=1)
    again.load_state_dict(state)
    ds, first = again.dataset, {}
    for i in range(100, 400):
        s, j = ds.mixture.locate(i - ds.origin)
        first.setdefault(s, j + ds.before[s])
    assert ds.origin == 100 and [first[s] for s in range(3)] == Mixture(list(WEIGHTS)).taken(100).tolist()
    assert len(next(iter(again)).inputs) == BATCH


@pytest.mark.multiprocess
def test_a_killed_prepare_continues_and_ends_identical(tmp_path):
    """SIGKILL mid-way (2 processes), then the same command again: the same files and content hashes as a
    prepare that was never interrupted, the held-out documents' parts too. One tokenizing process SIGKILLed:
    prepare exits 1 within 30 s with a line naming its pid and signal; run again, it ends the same."""
    cmd = [sys.executable, "-m", "nsa_titan.data.prepare", "--processes", "2", "--docs_per_part", "32",
           "--data.holdout", "0.05"]
    whole = tmp_path / "whole"
    subprocess.run([*cmd, "--output", str(whole)], check=True, cwd=ROOT, capture_output=True)
    killed = tmp_path / "killed"
    proc = subprocess.Popen([*cmd, "--output", str(killed)], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 120
    while len(list(killed.glob("*/*.docs.npy"))) < 10:
        assert proc.poll() is None and time.monotonic() < deadline, "prepare ended before it could be killed"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (killed / "manifest.json").exists()
    out = subprocess.run([*cmd, "--output", str(killed)], check=True, cwd=ROOT, capture_output=True, text=True)
    assert "wrote" in out.stdout
    a, b = (json.loads((f / "manifest.json").read_text()) for f in (whole, killed))
    docs = a["sources"]["python_docs"]
    assert a["sources"] == b["sources"] and len(docs["parts"]) > 40 and len(docs["holdout"]) > 2
    for part in docs["parts"] + docs["holdout"]:
        assert part_hash(killed / "python_docs" / part["file"]) == part["xxh3"]
    # One tokenizing process killed (as the kernel kills one for memory): prepare ends naming it, not waiting.
    lost = tmp_path / "lost"
    proc = subprocess.Popen([*cmd, "--output", str(lost)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    while len(list(lost.glob("*/*.docs.npy"))) < 10:
        assert proc.poll() is None and time.monotonic() < deadline + 120, "prepare ended before it could be killed"
        time.sleep(0.05)
    worker = int(subprocess.run(["pgrep", "-P", str(proc.pid), "-f", "spawn_main"], capture_output=True,
                                text=True).stdout.split()[0])
    os.kill(worker, signal.SIGKILL)
    killed_at = time.monotonic()
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1 and time.monotonic() - killed_at < 30, err[-2000:]
    assert f"pid {worker} (signal 9" in err and "run the same command again to continue" in err, err[-2000:]
    subprocess.run([*cmd, "--output", str(lost)], check=True, cwd=ROOT, capture_output=True)
    assert json.loads((lost / "manifest.json").read_text())["sources"] == a["sources"]


def test_streamed_length_bounds_keep_only_documents_within_them(corpora):
    """min_tokens / max_tokens per source: a bound no document passes stops with a DataError naming it."""
    data = mixture(corpora)
    data.sources = [Source(str(corpora[0]), label="alpha", min_tokens=100)]
    with pytest.raises(DataError, match=r"'alpha': no document has between min_tokens = 100"):
        next(iter(loader(data)))


def test_a_source_that_does_not_repeat_stops_the_run_at_its_end(corpora, prepared):
    """repeat = false: the first read past the source's last document is SourceEnded (streamed and prepared)."""
    for prep in ("", str(prepared)):
        data = mixture(corpora, prep)
        data.sources, data.num_workers = [Source(str(corpora[0]), label="alpha", repeat=False)], 0
        it = iter(loader(data))
        with pytest.raises(SourceEnded, match="'alpha' is read to its end and repeat = false"):
            [next(it) for _ in range(100)]


# ---------------------------------------------------------------- jobs


THREE_TOML = write_config(SHARED / "three.toml", THREE)
"""The shipped default config with the three-source mixture of the embedded corpus and 2 loader workers."""
TWO_TOML = write_config(SHARED / "two.toml", "".join(f'\n[[data.sources]]\npath = "{p}"\nlabel = "{n}"\nweight = 0.5\n'
                                                    for p, n in zip(SHORT_LONG, LENGTHS)))
"""The shipped default config with 2 loader workers and the two sources of mean length 256 and 2,048."""
TWO = ["--data.tokenizer", "byte", "--training.seq_len", "512", "--training.local_batch_size", "8",
       "--checkpoint.interval", "20", "--metrics.log_freq", "10"]
"""40 steps of 2 ranks x 8 windows of 512 tokens: 327,680 tokens."""
PREPARED = {"three": SHARED / "three-prepared", "two": SHARED / "two-prepared"}
WHOLE = {f"{config}-{kind}": SHARED / f"{config}-{kind}" / "whole" for config in ("three", "two")
         for kind in ("streamed", "prepared")}


def run_args(config: str, kind: str) -> list[str]:
    """The arguments of the runs of `config` ('three', 'two') streamed or prepared."""
    args = ["--config", str(THREE_TOML)] if config == "three" else ["--config", str(TWO_TOML), *TWO]
    return [*args, *(["--data.prepared", str(PREPARED[config])] if kind == "prepared" else [])]


def prepare_command(config: str, output: Path | None = None, *args: str) -> Command:
    """`prepare` of `config` ('three', 'two') with `args` added, into `output` (default: its shared folder)."""
    extra = ["--processes", "2", "--docs_per_part", "256"] if config == "three" else ["--docs_per_part", "64"]
    return Command([sys.executable, "-m", "nsa_titan.data.prepare", *run_args(config, "streamed"), *args, "--output",
                    str(output or PREPARED[config]), *extra])


HOLDOUT = ["--data.holdout", "0.05"]
HELD_OUT = ["--config", str(THREE_TOML), *HOLDOUT]
VALIDATED = {kind: SHARED / f"validated-{kind}" for kind in ("streamed", "prepared")}
BY_POSITION = SHARED / "by-position"


def validated_commands(kind: str) -> tuple[Command, ...]:
    """2 ranks, validation at steps 5 and 10 of the three-source mixture with `[data] holdout` (the prepared kind
    after its own `prepare` with the held-out parts)."""
    args = [*HELD_OUT, "--validation.enable", "true", "--validation.freq", "5", "--validation.steps", "1000",
            "--training.steps", "10"]
    if kind == "streamed":
        return (job_command(VALIDATED[kind] / "out", *args, nproc=2),)
    prepared = VALIDATED[kind] / "p"
    return (prepare_command("three", prepared, *HOLDOUT),
            job_command(VALIDATED[kind] / "out", *args, "--data.prepared", str(prepared), nproc=2))


BACKGROUND = {
    **{f"mixtures-{name}": ((prepare_command(name.split("-")[0]),) if name.endswith("prepared") else ()) +
       (job_command(WHOLE[name], *run_args(*name.split("-")), nproc=2),) for name in WHOLE},
    "mixtures-earlier": job_command(SHARED / "earlier" / "out", "--config", str(THREE_TOML), "--training.steps", "4",
                                    "--checkpoint.interval", "2"),
    **{f"mixtures-validated-{kind}": validated_commands(kind) for kind in VALIDATED},
    "mixtures-by-position": (
        job_command(BY_POSITION / "out", *HELD_OUT, "--data.path", str(BY_POSITION / "nowhere"), "--eval.enable",
                    "true", "--eval.freq", "4", "--eval.bucket", "32", "--eval.position_batches", "2",
                    "--training.steps", "4", "--checkpoint.interval", "4"),
        Command([sys.executable, "-m", "nsa_titan.evaluate", str(BY_POSITION / "out" / "checkpoint" / "step-4"),
                 "--by_position", "--bucket", "32", "--batches", "2", "--data.path", str(BY_POSITION / "nowhere")])),
}
"""The uninterrupted 2-rank runs of each mixture (the prepared ones after their `prepare`); an earlier run of
the three-source mixture (checkpoints of steps 2 and 4, its config, TensorBoard); the validated runs; a run with
the loss by position and then `evaluate --by_position` on its checkpoint."""


def whole(config: str, kind: str) -> tuple[Path, str]:
    """The uninterrupted run of `config` `kind`: its folder and output."""
    return WHOLE[f"{config}-{kind}"], finished(f"mixtures-{config}-{kind}", BACKGROUND)


@pytest.fixture(scope="module")
def three() -> Path:
    return THREE_TOML


@pytest.fixture(scope="module")
def three_prepared() -> Path:
    """The three-source mixture prepared (`--processes 2`, 256 documents a part)."""
    whole("three", "prepared")
    return PREPARED["three"]


@pytest.mark.background
@pytest.mark.multiprocess
@pytest.mark.parametrize("kind", ["streamed", "prepared"])
def test_sigkill_and_resume_with_a_mixture_is_bit_equal(tmp_path, kind):
    """2 ranks, 2 loader workers: a rank SIGKILLed after a save, the job restarted by MAX_RESTARTS, ends with
    the model and optimizer of an uninterrupted run, bit for bit, and no process of it left behind; the summary
    gives the run's realized shares, the same as the uninterrupted run's."""
    args = run_args("three", kind)
    uninterrupted, out = whole("three", kind)
    shares = re.search(r"shares of the run \(tokens / documents, weight\): short [\d.]+% / [\d.]+% \(0.5\), long "
                       r"[\d.]+% / [\d.]+% \(0.3\), all [\d.]+% / [\d.]+% \(0.2\)", out)
    assert shares, out[-3000:]
    dump = tmp_path / "out"
    job = Job(dump, *args, "--checkpoint.interval", "5", nproc=2, env={"MAX_RESTARTS": "1"})
    job.wait_for(r"checkpoint \S+/step-10: ")
    os.kill(job.rank_pid(1), signal.SIGKILL)
    rc, out = job.finish()
    assert rc == 0 and f"run summary: reached step {STEPS} of {STEPS}" in out, out[-4000:]
    assert "restart 1 of 1" in out and shares.group(0) in out
    assert not running(str(dump)), "a killed rank's loader workers outlived it"  # they die with their rank
    assert_bit_equal(dump, uninterrupted)


@pytest.mark.background
@pytest.mark.multiprocess
@pytest.mark.parametrize("kind", ["streamed", "prepared"])
def test_validation_loss_per_source_in_the_console_and_tensorboard(kind):
    """2 ranks, 2 loader workers, `[data] holdout`: each validation reads every held-out window (the ranks hold
    different numbers; each scores the fewest any holds, or the forwards' collectives would hang) and reports
    each source's loss beside the mixture's, which is their mean weighted 5 : 3 : 2; also in TensorBoard."""
    out = finished(f"mixtures-validated-{kind}", BACKGROUND)
    lines = re.findall(r"validation at step (\d+): loss ([\d.]+) \| perplexity [\d.]+ \| (\d+) batches \| "
                       r"short ([\d.]+) \| long ([\d.]+) \| all ([\d.]+)", out)
    assert [int(line[0]) for line in lines] == [5, 10], out[-3000:]
    for _, loss, batches, *by_source in lines:
        assert abs(float(loss) - sum(w * float(x) for w, x in zip(WEIGHTS, by_source)) / 10) < 2e-4
        assert int(batches) > 3
    events = EventAccumulator(tb_run(VALIDATED[kind] / "out" / "tb"))
    events.Reload()
    for label, x in zip(("short", "long", "all"), lines[-1][3:]):
        last = events.Scalars(f"validation/loss/{label}")[-1]
        assert last.step == 10 and abs(last.value - float(x)) < 1e-4


@pytest.mark.background
@pytest.mark.multiprocess
def test_a_prepared_run_saved_at_two_ranks_resumes_at_one(tmp_path, three, three_prepared):
    """The checkpoint of a 2-rank run loads at 1 rank without restarting the data: it continues at the global
    sample the 2-rank run would have read next (the loader test above compares the token ids)."""
    dump = tmp_path / "out"
    args = ["--config", str(three), "--data.prepared", str(three_prepared), "--checkpoint.interval", "10"]
    run_job(dump, *args, "--training.steps", "10", nproc=2)
    out = run_job(dump, *args, "--training.steps", "14", nproc=1)
    assert "the prepared samples continue at global sample 80" in out, out[-3000:]  # 10 steps x 2 ranks x 4
    assert "run summary: reached step 14 of 14" in out


def run_shares(out: str) -> tuple[float, float]:
    """The summary's realized token shares (%) of the two sources."""
    m = re.search(r"shares of the run \(tokens / documents, weight\): short ([\d.]+)% / [\d.]+% \(0.5\), long "
                  r"([\d.]+)% / [\d.]+% \(0.5\)", out)
    assert m, out[-3000:]
    return float(m.group(1)), float(m.group(2))


def resumable_copy(whole: Path, to: Path) -> Path:
    """A copy of a finished run's folder without its last checkpoint: a rerun resumes from step 20."""
    subprocess.run(["cp", "-a", str(whole), str(to)], check=True)
    subprocess.run(["rm", "-r", str(to / "checkpoint" / f"step-{STEPS}")], check=True)
    return to


@pytest.mark.background
@pytest.mark.multiprocess
@pytest.mark.parametrize("kind", ["streamed", "prepared"])
def test_token_shares_of_a_run_are_summed_over_ranks_and_kept_across_a_resume(tmp_path, kind):
    """2 ranks x 2 loader workers, async saves, documents of mean length 256 and 2,048 at weights 0.5 / 0.5:
    the run's token shares (both ranks' tokens) lie within 1% of 0.5 in the summary and TensorBoard; resumed
    from its step-20 save, the run ends with the very same shares (also after a SIGKILL: the bit-equal test
    above); other weights at the resume are refused with the fix, and taken (logged) with
    `--data.new_weights_on_resume true`."""
    args = run_args("two", kind)
    done, out = whole("two", kind)
    short, long = run_shares(out)
    assert abs(long - 50) < 1 and abs(short + long - 100) < 0.2, (short, long)
    events = EventAccumulator(tb_run(done / "tb"))
    events.Reload()
    last = events.Scalars("data/share_tokens/long")[-1]
    assert last.step == STEPS and abs(100 * last.value - long) < 0.05
    if kind == "streamed":  # the shares' record is the same for both kinds; the data positions differ
        out = run_job(resumable_copy(done, tmp_path / "resumed"), *args, nproc=2)
        assert "at step 20" in out and run_shares(out) == (short, long), out[-3000:]
    (tmp_path / "other.toml").write_text(TWO_TOML.read_text().replace("weight = 0.5", "weight = 0.25", 1))
    other = ["--config", str(tmp_path / "other.toml"), *args[2:]]
    rc, out = Job(resumable_copy(done, tmp_path / "other"), *other, nproc=2).finish()
    assert rc == 2 and "weights short 0.25, long 0.5 differ from the checkpoint's (short 0.5, long 0.5)" in out, \
        out[-3000:]
    assert "--data.new_weights_on_resume true" in out
    out = run_job(tmp_path / "other", *other, "--data.new_weights_on_resume", "true", "--training.steps", "24", nproc=2)
    assert "data: new weights short 0.25, long 0.5" in out and "run summary: reached step 24" in out, out[-3000:]


@pytest.mark.multiprocess
def test_a_source_read_to_its_end_with_repeat_false_saves_and_exits_0(tmp_path):
    """repeat = false, 2 ranks x 2 loader workers: where a worker's shard ends, every rank stops; the step before is
    saved, the line names the source, exit 0 and no restart (MAX_RESTARTS=1); a rerun says the source is done."""
    (source := tmp_path / "once").mkdir()
    for k in range(4):  # 30 documents of 200 tokens a shard: a worker's 46 windows of 129 tokens, 11 batches
        pq.write_table(pa.table({"text": [f"{k}/{i}:".ljust(199, "z") for i in range(30)]}),
                       source / f"train-{k:05d}-of-00004.parquet")
    config = tmp_path / "once.toml"
    config.write_text((ROOT / "train_configs" / "debug_model.toml").read_text().replace("num_workers = 1", "num_workers = 2")
                      + f'[[data.sources]]\npath = "{source}"\nlabel = "once"\nrepeat = false\n')
    args = ["--config", str(config), "--data.tokenizer", "byte"]
    rc, out = Job(tmp_path / "out", *args, nproc=2, env={"MAX_RESTARTS": "1"}).finish()
    ended = re.search(r"data: \[\[data.sources\]\] 'once' is read to its end and repeat = false: training ends here "
                      r".*\. Stopped after step (\d+) with checkpoint \S+/step-(\d+)", out)
    assert rc == 0 and ended and ended.group(1) == ended.group(2), out[-3000:]
    step = int(ended.group(1))
    assert 15 < step < STEPS and "restart 1 of 1" not in out
    assert f"run summary: reached step {step} of {STEPS}" in out
    assert sorted(p.name for p in (tmp_path / "out" / "checkpoint").glob("step-*")) == [f"step-{step}"]
    rc, out = Job(tmp_path / "out", *args, nproc=2).finish()
    assert rc == 0 and f"Nothing more to train after step {step}: the source is done" in out, out[-3000:]


@pytest.mark.multiprocess
def test_a_prepared_folder_of_2000_parts_moved_without_its_raw_text_trains_and_evaluates(tmp_path):
    """The embedded corpus prepared a document a part (2,600+ parts) from a copy that is then removed, the folder
    moved elsewhere: 2 ranks under `ulimit -n 256` train, validate and evaluate the loss by position on its
    held-out parts (nothing else read), as each map of a part holds a file open only while among the recent."""
    raw = tmp_path / "raw"
    subprocess.run(["cp", "-r", str(ROOT / "data" / "python_docs"), str(raw)], check=True)
    held = ["--data.holdout", "0.05"]
    subprocess.run([sys.executable, "-m", "nsa_titan.data.prepare", "--data.path", str(raw), *held, "--output",
                    str(tmp_path / "here"), "--docs_per_part", "1", "--processes", "2"], check=True, cwd=ROOT,
                   capture_output=True)
    manifest = json.loads((tmp_path / "here" / "manifest.json").read_text())
    assert len(manifest["sources"]["raw"]["parts"]) > 2000 and str(tmp_path) not in json.dumps(manifest["sources"])
    subprocess.run(["rm", "-r", str(raw)], check=True)
    (tmp_path / "here").rename(moved := tmp_path / "moved")

    def few_files() -> None:
        import resource
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))

    rc, out = Job(tmp_path / "out", "--data.path", str(raw), *held, "--data.prepared", str(moved), "--training.steps",
                  "10", "--training.local_batch_size", "32", "--validation.enable", "true", "--validation.freq", "10",
                  "--eval.enable", "true", "--eval.freq", "10", nproc=2, preexec=few_files).finish()
    assert rc == 0 and "run summary: reached step 10 of 10" in out, out[-3000:]  # 320 windows a rank, ~300 parts
    assert re.search(r"validation at step 10: loss [\d.]+", out) and re.search(r"eval at step 10: loss_by_position", out)
    out = subprocess.run([sys.executable, "-m", "nsa_titan.data.prepare", "--verify", "--output", str(moved)],
                         cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0 and f"all {len(manifest['sources']['raw']['parts']) + len(manifest['sources']['raw']['holdout']):,} parts match" in out.stdout


@pytest.mark.background
@pytest.mark.multiprocess
def test_a_mixture_s_loss_by_position_is_on_its_held_out_text():
    """The in-run loss by position of a mixture reads each source's held-out documents, not `[data] path`
    (here a folder that does not exist), and equals `evaluate --by_position` on the same step's checkpoint."""
    out = finished("mixtures-by-position", BACKGROUND)
    events = EventAccumulator(tb_run(BY_POSITION / "out" / "tb"))
    events.Reload()
    logged = {tag.rsplit("/", 1)[1]: events.Scalars(tag)[-1].value for tag in events.Tags()["scalars"]
              if tag.startswith("eval/loss_by_position/")}
    rows = re.findall(r"^\| (\d+)-(\d+) \| (\S+) \| [\d,]+ \|$", out.replace(",", ""), re.M)
    assert len(rows) == len(logged) >= 4, out
    for first, end, loss in rows:
        assert abs(logged[f"{first}-{end}"] - float(loss)) < 1e-4, (first, end, loss, logged)


def running(marker: str) -> list[str]:
    """The pids of the processes whose command line holds `marker`."""
    pids = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if marker.encode() in (proc / "cmdline").read_bytes():
                pids.append(proc.name)
        except OSError:  # gone meanwhile
            pass
    return pids


@pytest.fixture(scope="module")
def earlier() -> Path:
    """The folder of an earlier run of the mixture: checkpoints of steps 2 and 4, its config, TensorBoard."""
    finished("mixtures-earlier", BACKGROUND)
    dump = SHARED / "earlier" / "out"
    assert len(list(dump.glob("checkpoint/step-*"))) == 2
    return dump


def folder_state(folder: Path) -> dict[str, tuple[int, str]]:
    """Every file under `folder`: its size and content hash."""
    return {str(p.relative_to(folder)): (p.stat().st_size, part_hash(p)) for p in folder.rglob("*") if p.is_file()}


def bad(tmp_path, three, three_prepared, case: str) -> list[str]:
    """The arguments of a run that must be refused; damages a copy of the prepared folder where asked."""
    args = ["--config", str(three)]
    if case in ("truncated", "altered", "tokenizer", "unprepared"):
        copy = tmp_path / "prepared"
        subprocess.run(["cp", "-r", str(three_prepared), str(copy)], check=True)
        part = copy / "short" / "part-00000.bin"
        if case == "truncated":
            part.write_bytes(part.read_bytes()[:-2])
        elif case == "altered":
            b = bytearray(part.read_bytes())
            b[10] ^= 1
            part.write_bytes(bytes(b))
        elif case == "unprepared":
            (copy / "manifest.json").unlink()
        args += ["--data.prepared", str(copy)]
        if case == "tokenizer":
            args += ["--data.tokenizer", "byte"]
    return args


REFUSALS = [
    ("weight", ["--config", "{weight}"], r"weight = 0: weights must be positive"),
    ("unreadable", ["--config", "{unreadable}"], r"path = '\S*nowhere': no such file or folder"),
    ("truncated", [], r"short/part-00000.bin is truncated or altered"),
    ("altered", [], r"short/part-00000.bin is truncated or altered"),
    ("tokenizer", [], r"was prepared with another tokenizer"),
    ("unprepared", [], r"has no manifest.json: its prepare did not finish"),
]


@pytest.mark.background
@pytest.mark.multiprocess
@pytest.mark.parametrize("case,args,message", REFUSALS, ids=[r[0] for r in REFUSALS])
def test_bad_mixture_input_is_one_line_and_exit_2(tmp_path, three, three_prepared, earlier, case, args, message):
    """Each refusal: one line naming the key or file, exit 2, and the run's folder (an earlier run's checkpoints,
    config and metrics) as it was: nothing written, nothing lost."""
    (tmp_path / "weight.toml").write_text(three.read_text().replace("weight = 3", "weight = 0"))
    (tmp_path / "unreadable.toml").write_text(three.read_text().replace('path = "data/python_docs"\nlabel = "long"',
                                                                        'path = "nowhere"\nlabel = "long"'))
    argv = [a.format(weight=tmp_path / "weight.toml", unreadable=tmp_path / "unreadable.toml") for a in args] or \
        bad(tmp_path, three, three_prepared, case)
    subprocess.run(["cp", "-a", str(earlier), str(tmp_path / "out")], check=True)
    before = folder_state(tmp_path / "out")
    rc, out = Job(tmp_path / "out", *argv, nproc=1).finish()
    assert rc == 2, out[-3000:]
    lines = [line for line in out.splitlines() if re.search(message, line)]
    assert len(lines) == 1 and lines[0].startswith("nsa_titan: "), out[-3000:]
    assert folder_state(tmp_path / "out") == before


@pytest.mark.multiprocess
def test_prepare_refuses_bounds_no_document_passes_and_other_settings(tmp_path, three):
    cmd = [sys.executable, "-m", "nsa_titan.data.prepare", "--config", str(three), "--output", str(tmp_path / "p")]
    (tmp_path / "none.toml").write_text(three.read_text().replace("min_tokens = 1500", "min_tokens = 10000000"))
    out = subprocess.run([*cmd[:4], str(tmp_path / "none.toml"), *cmd[5:]], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 2 and "'long': no document passes min_tokens = 10000000" in out.stderr, out.stderr[-2000:]
    out = subprocess.run([*cmd, "--docs_per_part", "7"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 2 and "holds a prepare of other settings" in out.stderr, out.stderr[-2000:]


@pytest.mark.slow
def test_the_adapt_config_mixes_long_documents_at_their_share(tmp_path):
    """m7c_32k_adapt.toml's two sources (offline: the embedded corpus for FineWeb-Edu, its long documents those
    of 1,500 tokens or more): the long source's share of the tokens within 1% of its weight, and each of its
    documents that a window holds whole at least min_tokens long."""
    text = (ROOT / "train_configs" / "m7c_32k_adapt.toml").read_text()
    assert 'label = "fineweb-edu-long"\nweight = 0.3\nmin_tokens = 8192' in text
    offline = tmp_path / "adapt.toml"
    offline.write_text(text.replace('"HuggingFaceFW/fineweb-edu"', '"data/python_docs"').replace('name = "sample-10BT"',
                       'name = ""').replace("min_tokens = 8192", "min_tokens = 1500"))
    cfg, _ = load_config(["--config", str(offline), "--data.tokenizer", "sentencepiece", "--data.tokenizer_path",
                          "data/python_docs/tokenizer.model", "--data.num_workers", "0", "--data.shuffle_buffer", "0"],
                         world_size=2)
    tok = build_tokenizer(cfg.data.tokenizer, cfg.data.tokenizer_path)
    OPEN.append(build_dataloader(cfg.data, tok, 2048, 4096, 4, 0, 1))
    tokens, long_lengths = torch.zeros(2, dtype=torch.long), []
    for _, b in zip(range(60), OPEN[-1]):
        tokens += torch.bincount(b.sources.flatten(), minlength=2)
        for ids, src in zip(b.document_ids, b.sources):
            long_lengths += [int((ids == d).sum()) for d in ids.unique()[1:-1] if src[ids == d][0] == 1]  # whole
    assert abs(int(tokens[1]) / int(tokens.sum()) - 0.3) < 0.01, tokens.tolist()
    assert long_lengths and min(long_lengths) >= 1500


def test_config_refuses_a_mixture_on_the_command_line_and_duplicate_labels(tmp_path):
    with pytest.raises(ConfigError, match="array of tables: set it in the TOML file"):
        load_config(["--data.sources", "x"], world_size=1)
    (tmp_path / "dup.toml").write_text('[[data.sources]]\npath = "data/python_docs"\n[[data.sources]]\n'
                                       'path = "data/python_docs"\n')
    with pytest.raises(ConfigError, match="each label names one source"):
        load_config(["--config", str(tmp_path / "dup.toml")], world_size=1)
