"""Weights & Biases as users run it, without network: offline runs whose files hold the logged scalars and the
config (read back here), `disabled` writing nothing, and a W&B that cannot start costing one warning and nothing
else. One W&B run id across a SIGKILL and restart is shown by test_operations.py's restart, a rolled-back run's
history by test_spikes.py's rollback: the same runs, logging to W&B."""

from __future__ import annotations

import json
import subprocess
import threading

import pytest

from nsa_titan.observe.wandb_run import HISTORY_FILE, WandbRun
from nsa_titan.system.jsonl import read_records

from conftest import free_port, tb_losses
from jobs import Job, run_job
from wandb_files import OFFLINE, assert_one_history_as_printed, history, records, runs


@pytest.mark.multiprocess
def test_an_offline_run_holds_the_scalars_and_the_config(tmp_path):
    """20 steps, 2 ranks: one offline run (rank 0's), named by the id kept in the dump folder, with the
    project and group asked for, the whole config, and every step's scalars equal to TensorBoard's."""
    dump = tmp_path / "out"
    run_job(dump, "--training.steps", "20", *OFFLINE, "--metrics.wandb_project", "proj", "--metrics.wandb_group",
            "sweep-1", nproc=2)
    [run] = runs(dump)
    run_id = (dump / "wandb_run_id").read_text()
    assert run.name.endswith(run_id)
    [meta] = [r.run for r in records(run) if r.WhichOneof("record_type") == "run"]
    assert (meta.run_id, meta.project, meta.run_group) == (run_id, "proj", "sweep-1")
    config = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in meta.config.update}
    assert config["model"]["dim"] == 64 and config["training"]["steps"] == 20
    logged, tb = history(run), tb_losses(dump / "tb")
    assert sorted(logged) == list(range(1, 21)) == sorted(tb)
    for step, loss in tb.items():
        assert logged[step]["train/loss"] == pytest.approx(loss, rel=1e-6)
        assert {"train/grad_norm", "train/lr", "train/tokens_per_s", "train/data_wait"} <= set(logged[step])


@pytest.mark.multiprocess
def test_disabled_logs_nothing(tmp_path):
    dump = tmp_path / "out"
    run_job(dump, "--training.steps", "3", "--metrics.enable_wandb", "true", "--metrics.wandb_mode", "disabled")
    assert not (dump / "wandb").exists() and not (dump / "wandb_run_id").exists()


@pytest.mark.multiprocess
def test_a_wandb_that_cannot_start_is_one_warning_and_the_run_goes_on(tmp_path):
    """Online without credentials (no API key, an empty netrc, no W&B settings): one warning line, the run ends
    as it would. (HOME stays: a new one would rebuild the C++ kernel and refill the caches.)"""
    (tmp_path / "netrc").write_text("")
    (tmp_path / "wandb-config").mkdir()
    env = {"WANDB_API_KEY": "", "NETRC": str(tmp_path / "netrc"), "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config")}
    out = run_job(tmp_path / "out", "--training.steps", "5", "--metrics.enable_wandb", "true", "--metrics.wandb_mode",
                  "online", env=env)
    warnings = [line for line in out.splitlines() if "W&B" in line]
    assert len(warnings) == 1 and "W&B did not start (UsageError: No API key configured" in warnings[0], out[-3000:]
    assert "run summary: reached step 5 of 5" in out


@pytest.mark.multiprocess
def test_an_unreachable_wandb_server_does_not_hold_training(tmp_path):
    """Online, with credentials, to a server that does not answer: training runs while W&B tries to start (in
    its own thread), then one warning, and the run ends as it would."""
    env = {"WANDB_API_KEY": "k" * 40, "WANDB_BASE_URL": f"http://127.0.0.1:{free_port()}"}
    job = Job(tmp_path / "out", "--training.steps", "8", "--metrics.enable_wandb", "true", "--metrics.wandb_mode",
              "online", "--metrics.wandb_start_timeout_seconds", "20", env=env)
    job.wait_for(r"step +1/8")
    first = job.times[-1]
    job.wait_for(r"step +8/8")
    assert job.times[-1] - first < 15  # the steps did not wait for W&B's 20 s
    rc, out = job.finish()
    assert rc == 0 and "run summary: reached step 8 of 8" in out, out[-3000:]
    warnings = [line for line in out.splitlines() if "W&B" in line]
    assert len(warnings) == 1 and "W&B did not start" in warnings[0], out[-3000:]


@pytest.mark.multiprocess
def test_a_torn_last_line_of_the_kept_history_is_dropped_and_the_resume_trains_to_the_end(tmp_path):
    """A SIGKILL or a full disk mid-write leaves half a line: every resume failed on it (JSONDecodeError, exit 1).
    Now one warning names the file and the step, and the history holds every step once, as the console printed."""
    dump = tmp_path / "out"
    first = run_job(dump, *OFFLINE, "--training.steps", "10", "--checkpoint.interval", "5")
    with (dump / "wandb_history.jsonl").open("a") as f:
        f.write('{"step": 11, "scalars": {"train/lo')
    rc, out = Job(dump, *OFFLINE, "--training.steps", "15", "--checkpoint.interval", "5").finish()
    assert rc == 0 and "resumed from" in out, out[-3000:]
    [warning] = [line for line in out.splitlines() if "incomplete line" in line]
    assert f"{dump / 'wandb_history.jsonl'}: 1 incomplete line(s) dropped" in warning
    assert "W&B's history resumes from step 10" in warning
    assert_one_history_as_printed(dump, first + out, 15)


@pytest.mark.multiprocess
def test_a_kept_history_that_cannot_be_written_is_one_warning_and_the_run_ends_normally(tmp_path):
    """The history file on a read-only filesystem (a read-only tmpfs: needs the right to mount, as in CI)."""
    readonly = tmp_path / "ro"
    readonly.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(readonly)]).returncode != 0:
        pytest.skip("mounting a read-only tmpfs needs root (CI runs as root)")
    try:
        dump = tmp_path / "out"
        dump.mkdir()
        (dump / "wandb_history.jsonl").symlink_to(readonly / "history.jsonl")
        out = run_job(dump, *OFFLINE, "--training.steps", "4")
    finally:
        subprocess.run(["umount", "-l", str(readonly)], check=False)
    assert "run summary: reached step 4 of 4" in out
    [warning] = [line for line in out.splitlines() if " WARNING " in line and "W&B" in line]
    assert "could not be read or written (OSError: [Errno 30] Read-only file system" in warning, warning
    assert sorted(history(runs(dump)[0])) == [1, 2, 3, 4]  # W&B itself logged every step


def test_a_rollback_while_wandb_is_still_starting_keeps_one_timeline(tmp_path):
    """Steps 1-8 logged while W&B's start is under way, a rollback to step 5, steps 6-8 again: the kept history and
    what waits for W&B hold steps 1-8 once, the second pass's 6-8 (both timelines were kept)."""
    w = WandbRun.__new__(WandbRun)
    started = threading.Event()
    w.history, w.timeout, w.lock, w.run, w.pending, w.history_warned = (tmp_path / HISTORY_FILE, 0.05,
                                                                          threading.Lock(), None, [], False)
    w.thread = threading.Thread(target=started.wait, daemon=True)
    w.thread.start()
    for step in range(1, 9):
        w.log({"train/loss": float(step)}, step)
    w.rewind(5)
    for step in range(6, 9):
        w.log({"train/loss": 10.0 + step}, step)
    started.set()
    kept = {r["step"]: r["scalars"]["train/loss"] for r in read_records(w.history)[0]}
    assert len(read_records(w.history)[0]) == 8 and kept == {**{s: float(s) for s in range(1, 6)},
                                                               **{s: 10.0 + s for s in range(6, 9)}}
    assert [(at, scalars["train/loss"]) for scalars, at in w.pending] == sorted(kept.items())
