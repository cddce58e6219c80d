"""Training on `https://` data files through a flaky network (`data/retry.py`): a local server that resets
connections and answers 503 on part of the requests gives the same data order as a clean one; a server
down for longer than the retry budget makes the run save and exit 75, and the resume ends bit-equal.
Through `run_train.sh` with 2 ranks, 2 loader workers and async saves."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from nsa_titan.checkpoint import inspect_folder, load_tensors
from nsa_titan.data.errors import DataError, DataUnavailable
from nsa_titan.data.retry import Retrier, transient
from nsa_titan.data.sources import open_text_stream

from conftest import ROOT
from flaky_server import FlakyServer
from jobs import STEPS, Job, run_job

FILES = 96
# Small files and a small shuffle buffer, so that every loader worker keeps opening files during the run.
ARGS = ["--data.num_workers", "2", "--checkpoint.async_mode", "async", "--data.shuffle_buffer", "8",
        "--data.retry_wait_seconds", "0.05", "--data.read_retries", "8", "--data.tokenizer", "sentencepiece",
        "--data.tokenizer_path", str(ROOT / "data" / "python_docs" / "tokenizer.model")]


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    """Part of the embedded corpus as FILES jsonl files of 3 documents, named as on the hub
    (train-00000-of-00096.jsonl): each loader worker opens several of them during a run."""
    folder = tmp_path_factory.mktemp("served")
    rows = [r for f in sorted((ROOT / "data" / "python_docs").glob("train-*.parquet"))
            for r in pq.read_table(f, columns=["text"]).to_pylist()]
    for i in range(FILES):
        with open(folder / f"train-{i:05d}-of-{FILES:05d}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows[i::FILES][:3])
    return folder


@pytest.fixture(scope="module")
def clean_run(shards, tmp_path_factory) -> Path:
    with FlakyServer(shards) as server:
        dump = tmp_path_factory.mktemp("clean") / "out"
        run_job(dump, *ARGS, "--data.path", server.url, nproc=2)
    return dump


def final_state(dump: Path) -> dict[str, torch.Tensor]:
    path = dump / "checkpoint" / f"step-{STEPS}"
    assert inspect_folder(path) is None, inspect_folder(path)
    return {**load_tensors(path, "model"), **load_tensors(path, "optimizer")}


def assert_same_training(a: Path, b: Path) -> None:
    ta, tb = final_state(a), final_state(b)
    assert ta.keys() == tb.keys() and len(ta) > 10
    for k in ta:
        assert torch.equal(ta[k], tb[k]), f"{k} differs: the data read differs from the clean run's"


def test_transient_errors_are_told_from_lasting_ones():
    class Status(Exception):
        def __init__(self, status: int):
            super().__init__(f"HTTP {status}")
            self.status = status

    assert transient(ConnectionResetError(104, "Connection reset by peer"))
    assert transient(TimeoutError("read timed out"))
    assert transient(Status(503)) and transient(Status(429))
    wrapped = ConnectionError("Server Disconnected")
    wrapped.__cause__ = Status(502)
    assert transient(wrapped)
    assert not transient(Status(404)) and not transient(FileNotFoundError("gone")) and not transient(ValueError("x"))
    retrier = Retrier("[data] path = 'u'", 2, 0.001)
    retrier.failed(ConnectionResetError(104, "reset"))
    retrier.failed(ConnectionResetError(104, "reset"))
    with pytest.raises(DataUnavailable, match=r"could not be read after 2 retries .* \(last: ConnectionResetError"):
        retrier.failed(ConnectionResetError(104, "reset"))
    with pytest.raises(ValueError):
        Retrier("x", 5, 0.001).failed(ValueError("not a network error"))


@pytest.mark.parametrize("url,package", [("s3://bucket/corpus/*.parquet", "s3fs"), ("gs://bucket/x.jsonl", "gcsfs")])
def test_a_url_whose_filesystem_is_not_installed_names_the_package(url, package):
    with pytest.raises(DataError, match=rf"\[data\] path = '{re.escape(url)}' cannot be read here .*: pip install "
                                        rf"{package}$"):
        open_text_stream(url, "", "train", "text")


@pytest.mark.multiprocess
def test_a_flaky_server_gives_the_same_training_as_a_clean_one(shards, clean_run, tmp_path):
    with FlakyServer(shards, reset=0.08, unavailable=0.08, seed=3) as server:
        out = run_job(tmp_path / "out", *ARGS, "--data.path", server.url, nproc=2)
    assert server.counts["reset"] + server.counts["503"] >= 5, server.counts  # the network really failed
    assert re.search(r"a transient read error \((ClientOSError|ConnectionError|ClientResponseError|Server|"
                     r"NonHttpUrlClientError)", out), out[-3000:]
    assert "Traceback" not in out
    assert_same_training(tmp_path / "out", clean_run)


@pytest.mark.multiprocess
def test_a_server_down_past_the_retry_budget_saves_exits_75_and_the_resume_is_bit_equal(shards, clean_run, tmp_path):
    dump = tmp_path / "out"
    args = [*ARGS, "--data.read_retries", "3", "--data.retry_wait_seconds", "0.2"]
    server = FlakyServer(shards).start()
    try:
        job = Job(dump, *args, "--data.path", server.url, nproc=2)
        job.wait_for(r"step +3/40 ")
        server.stop()  # down for good: the run must give up, save and ask to be retried
        rc, out = job.finish()
        assert rc == 75, out[-4000:]
        m = re.search(r"nsa_titan: data unavailable: \[data\] path = '\S+' could not be read after 3 retries .*"
                      r"Stopped after step (\d+) with checkpoint (\S+); the same command resumes exactly", out)
        assert m and "Traceback" not in out, out[-4000:]
        step = int(m.group(1))
        assert 3 <= step < STEPS and m.group(2) == str(dump / "checkpoint" / f"step-{step}")
        assert inspect_folder(Path(m.group(2))) is None
        server.start()  # back, on the same address
        resumed = run_job(dump, *args, "--data.path", server.url, nproc=2)
    finally:
        server.stop()
    assert f"resumed from {dump / 'checkpoint' / f'step-{step}'} at step {step}" in resumed
    assert_same_training(dump, clean_run)
