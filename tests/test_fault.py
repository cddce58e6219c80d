"""Fault detection on 2 gloo ranks: hangs, slow first steps, NaNs (hangs and NaNs through run_train.sh, with the exit
code and the cause's line users see), branch isolation, heartbeat."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import torch.nn as nn
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from nsa_titan.config import ActivationCheckpoint, Model, ac_layers
from nsa_titan.distributed.parallel import apply_ac
from nsa_titan.runtime.watchdog import Heartbeat

from conftest import ROOT, TINY, launch_ranks, tb_run, torchrun

STEP_TIMEOUT = 6
FAST = [*TINY, "--fault.step_timeout_seconds", str(STEP_TIMEOUT), "--fault.collective_timeout_seconds", "120"]


def train(dump: Path, *args: str, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    return torchrun(["-m", "nsa_titan.train", *FAST, "--job.dump_folder", str(dump), *args], timeout=timeout, env=env)


def launched(dump: Path, *args: str) -> subprocess.CompletedProcess:
    """The job as users start it, `NGPU=2 run_train.sh` (torchrun under nsa_titan.launch): its exit code and
    closing lines are the user's."""
    env = {**os.environ, "NGPU": "2", "OMP_NUM_THREADS": "1"}
    return subprocess.run([str(ROOT / "run_train.sh"), *FAST, "--job.dump_folder", str(dump), *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)


def assert_the_cause_comes_first(out: str, line: str) -> None:
    """The launcher's line for the cause once, before the other rank's consequence (its gloo error), and not
    torchrun's own report."""
    assert out.count(line) == 1, out[-3000:]
    assert "ChildFailedError" not in out and "Root Cause" not in out
    failed = [x for x in out.splitlines() if re.match(r"nsa_titan: (rank \d+ failed|halted)", x)]
    assert failed[0].startswith(line), failed
    assert all(x.endswith("(after the failure above)") for x in failed[1:]), failed


@pytest.mark.parametrize("where,frame", [("forward", "torch/nn/modules/module.py"),
                                         ("optimizer", "torch/optim/optimizer.py")])
@pytest.mark.multiprocess
def test_hang_is_reported_with_every_ranks_stack_and_the_job_exits(tmp_path, where, frame):
    proc = launched(tmp_path, "--training.steps", "50", "--debug.fault_hang_rank", "0", "--debug.fault_hang_step",
                    "5", "--debug.fault_hang_where", where)
    assert proc.returncode == 124, proc.stderr[-3000:]
    assert_the_cause_comes_first(proc.stdout + proc.stderr, "nsa_titan: rank 0 failed with exit code 124")
    # The watchdog fired at the step limit (as it measured it: a busy machine delays the job's
    # teardown, not the watchdog's clock), and the rank then exited with the hang's code.
    hung = (tmp_path / "fault" / "rank0_stacks.txt").read_text()
    waited = int(re.match(r"nsa_titan watchdog: rank 0 made no progress for (\d+) s", hung).group(1))
    assert STEP_TIMEOUT <= waited <= STEP_TIMEOUT + 5, waited
    assert "of step 5" in hung and "this rank itself is stuck" in hung
    assert "in _hang_forever" in hung and frame in hung, hung[-3000:]
    peer = (tmp_path / "fault" / "rank1_stacks.txt").read_text()
    assert "nsa_titan watchdog: rank 1 made no progress" in peer
    assert "It was blocked in a collective" in peer and "waiting for another rank" in peer
    assert "_hang_forever" not in peer
    last = json.loads((tmp_path / "heartbeat" / "rank0.jsonl").read_text().splitlines()[-1])
    assert last["event"] == "hang" and last["step"] == 5 and last["in_collective"] is None


@pytest.mark.multiprocess
def test_slow_compiled_first_step_is_not_a_hang(tmp_path):
    # Compiling takes longer than the 2 s step limit; the first step has its own limit. The aot_eager backend
    # traces as inductor does (dynamo, then AOT autograd: about 4 s here, and no cache across processes) without
    # inductor's code generation, which took 45 s more with its caches off.
    proc = train(tmp_path, "--training.steps", "4", "--compile.enable", "true", "--compile.backend", "aot_eager",
                 "--fault.step_timeout_seconds", "2", "--fault.first_step_timeout_seconds", "300")
    assert proc.returncode == 0, proc.stderr[-3000:]
    first = json.loads((tmp_path / "heartbeat" / "rank0.jsonl").read_text().splitlines()[0])
    assert first["step_time_s"] > 2  # it really was slower than the step limit
    assert "watchdog" not in proc.stdout + proc.stderr
    assert not (tmp_path / "fault" / "rank0_stacks.txt").exists()


@pytest.mark.multiprocess
def test_nan_halts_at_its_step_without_saving(tmp_path):
    proc = launched(tmp_path, "--training.steps", "8", "--debug.fault_nan_step", "3", "--checkpoint.enable", "true",
                    "--checkpoint.interval", "1")
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert_the_cause_comes_first(proc.stdout + proc.stderr, "nsa_titan: halted: step 3: non-finite gradient norm nan")
    assert "first parameter with a non-finite gradient: tok_embeddings.weight" in proc.stderr
    assert sorted(p.name for p in (tmp_path / "checkpoint").iterdir()) == ["step-1", "step-2"]


@pytest.mark.multiprocess
def test_nan_skip_continues_and_counts(tmp_path):
    out = train(tmp_path, "--training.steps", "6", "--debug.fault_nan_step", "3", "--fault.nonfinite", "skip")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "step 3: non-finite gradient norm nan" in out.stdout and "update skipped (1 in a row, 1 in total)" in out.stdout
    assert "1 non-finite step(s) were skipped in this run" in out.stdout
    records = [json.loads(x) for x in (tmp_path / "heartbeat" / "rank0.jsonl").read_text().splitlines()]
    assert [r["skipped"] for r in records] == [False, False, True, False, False, False]
    halted = train(tmp_path / "k", "--training.steps", "6", "--debug.fault_nan_step", "3", "--fault.nonfinite", "skip",
                   "--fault.max_consecutive_skips", "1")
    assert halted.returncode != 0 and "1 non-finite steps in a row (max_consecutive_skips = 1)" in halted.stderr


BRANCH_PARAMS = {"cmp": ("wkv_cmp", "compress_k", "compress_v"), "sel": ("wkv_sel",), "win": ("wkv_win",)}


@pytest.mark.multiprocess
def test_forced_branches_train_and_missing_params_report_names_the_cut_off_ones(tmp_path):
    specs = [{"name": b, "args": [*TINY, "--training.steps", "3", "--model.nsa_branch", b], "grad_check": True}
             for b in ("all", "cmp", "sel", "win")]
    runs = launch_ranks(specs, tmp_path)
    assert runs["all"]["missing_report"] == []
    for kept in ("cmp", "sel", "win"):
        run = runs[kept]
        assert run["steps"][-1] == 3 and all(x == x for x in run["losses"])
        cut = {p for b, ps in BRANCH_PARAMS.items() if b != kept for p in ps}
        if kept == "sel":  # selection reads the cmp scores, but no gradient flows through the choice
            cut |= {"compress_k", "compress_v", "wkv_cmp"}
        expected = sorted(n for n in run["placements"] if cut & set(n.split(".")))  # every parameter's name
        assert sorted(run["missing_report"]) == expected and expected, kept


@pytest.mark.multiprocess
def test_heartbeat_nsa_stats_and_profiler(tmp_path):
    """Rank 1's heartbeat write of step 4 finds the disk full: one warning naming the file, and training and the
    records go on (it stopped the job)."""
    proc = train(tmp_path, "--training.steps", "6", "--metrics.log_freq", "3", "--metrics.enable_tensorboard", "true",
                 "--metrics.nsa_stats", "true", "--debug.profile_step", "2", "--debug.fault_raise_where", "write",
                 "--debug.fault_raise_rank", "1", "--debug.fault_raise_step", "4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    [warning] = [x for x in (proc.stdout + proc.stderr).splitlines() if "could not be written" in x]
    assert f"heartbeat {tmp_path / 'heartbeat' / 'rank1.jsonl'} could not be written ([Errno 28] No space left " \
           "on device (fault injection)" in warning, warning
    for rank in (0, 1):
        records = [json.loads(x) for x in (tmp_path / "heartbeat" / f"rank{rank}.jsonl").read_text().splitlines()]
        assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6] if rank == 0 else [1, 2, 3, 5, 6]
        for r in records:
            assert {"time", "loss", "grad_norm", "step_time_s", "tokens_per_s", "memory_gib", "data_wait_s"} <= set(r)
            assert r["loss"] > 0 and r["step_time_s"] > 0
    events = EventAccumulator(tb_run(tmp_path / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    for layer in (0, 1):
        assert f"nsa/layer{layer}/gate_sel_labelled" not in tags  # text: every token is labelled
        for key in ("gate_cmp", "gate_sel", "gate_win", "gate_entropy", "sel_scored_fraction", "sel_scored_distance"):
            assert f"nsa/layer{layer}/{key}" in tags
    assert [e.step for e in events.Scalars("nsa/layer0/gate_entropy")] == [1, 3, 6]
    gate = events.Scalars("nsa/layer0/gate_cmp")[0].value
    assert 0.4 < gate < 0.6  # gates start at sigmoid(0)
    assert 0 < events.Scalars("nsa/layer1/sel_scored_fraction")[0].value < 1
    assert (tmp_path / "profile" / "rank0_step2.trace.json").stat().st_size > 1000


def test_activation_checkpointing_on_a_range_of_blocks():
    class Plain(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleDict({str(i): nn.Linear(2, 2) for i in range(6)})

    def wrapped(**kw) -> list[int]:
        model = Plain()
        apply_ac(model, ac_layers(Model(n_layers=6), ActivationCheckpoint(**kw)))
        return [i for i, b in enumerate(model.layers.values()) if type(b).__name__ == "CheckpointWrapper"]

    assert wrapped(mode="full") == [0, 1, 2, 3, 4, 5]
    assert wrapped(mode="full", first_layer=2, last_layer=3) == [2, 3]
    assert wrapped(mode="selective", every_n_layers=2) == [1, 3, 5]
    assert wrapped(mode="selective", every_n_layers=2, first_layer=2, last_layer=5) == [3, 5]


def test_a_heartbeat_file_with_a_torn_last_line_is_cut_back_before_the_next_record(tmp_path, caplog):
    """A rank killed mid-write leaves half a record: the next run's first record would join it (a line no reader
    parses). The torn tail is cut, with one warning naming the file."""
    path = tmp_path / "rank0.jsonl"
    path.write_text('{"time": 1.0, "step": 1}\n{"time": 2.0, "st')
    heartbeat = Heartbeat(tmp_path, 0)
    heartbeat.write(step=2)
    heartbeat.close()
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2]
    assert f"{path}: its incomplete last line (17 bytes" in caplog.text
