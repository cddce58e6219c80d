"""One run owns its folder (`nsa_titan/runtime/ownership.py`), and a resumed run owns the steps after the one it
loaded: through `run_train.sh` with the shipped defaults (async saves, loader workers, 2 ranks), and the
owner record's rules in-process (live, dead and stale holders; takeovers one at a time)."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nsa_titan.checkpoint import inspect_folder
from nsa_titan.launch import child_pids
from nsa_titan.runtime.ownership import OWNER_FILE, FolderInUse, FolderOwner, OwnerRecord, _process_start

from conftest import ROOT, free_port, tree_digest
from jobs import SMALL, Job, run_job

DEFAULTS = ["--data.num_workers", "2", "--checkpoint.async_mode", "async"]


def write_record(folder: Path, **changes) -> OwnerRecord:
    record = OwnerRecord(job="process 1 on elsewhere", host=socket.gethostname(), pid=os.getpid(),
                         pid_start=_process_start(os.getpid()), started=time.time(), heartbeat=time.time())
    record.__dict__.update(changes)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / OWNER_FILE).write_text(json.dumps(record.__dict__))
    return record


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


# ------------------------------------------------------------------ the record's rules, in-process

def test_a_live_holder_on_this_host_or_a_fresh_heartbeat_elsewhere_is_refused_and_nothing_is_written(tmp_path):
    for folder, changes in [(tmp_path / "here", {}), (tmp_path / "there", {"host": "node-elsewhere", "pid": 1})]:
        write_record(folder, **changes)
        before = tree_digest(folder)
        with pytest.raises(FolderInUse, match=r"is in use by .* which still runs: it was not touched. Give this run "
                                              r"another --job.dump_folder, or stop the other run first"):
            FolderOwner.claim(folder, 30, 300, job="process 2 on here")
        assert tree_digest(folder) == before and sorted(p.name for p in folder.iterdir()) == [OWNER_FILE]


@pytest.mark.parametrize("gone", ["dead pid", "reused pid", "old heartbeat"])
def test_a_gone_holder_is_taken_over_with_one_warning_and_released_at_the_end(tmp_path, caplog, gone):
    changes = {"dead pid": {"pid": dead_pid()}, "reused pid": {"pid_start": "1"},
               "old heartbeat": {"host": "node-elsewhere", "heartbeat": time.time() - 301}}[gone]
    write_record(tmp_path, **changes)
    owner = FolderOwner.claim(tmp_path, 30, 300, job="process 2 on here")
    assert [r.levelname for r in caplog.records] == ["WARNING"]
    assert re.search(r"owner.json: taken over from .*which is gone: (its pid \d+ on this host has exited|its "
                     r"heartbeat is 30\d s old \(> owner_stale_seconds = 300\))", caplog.text), caplog.text
    assert json.loads((tmp_path / OWNER_FILE).read_text())["job"] == "process 2 on here"
    owner.release()
    assert not (tmp_path / OWNER_FILE).exists()


def test_the_same_job_joins_a_live_holder_and_takes_a_gone_ones_back_at_once(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="nsa_titan.runtime.ownership")
    write_record(tmp_path, job="slurm job 7 step batch", host="node-0", heartbeat=time.time())  # another node's
    joined = FolderOwner.claim(tmp_path, 30, 300, job="slurm job 7 step batch")
    assert not joined.holds and not caplog.records
    joined.release()  # a joiner leaves the holder's record alone
    assert (tmp_path / OWNER_FILE).exists()
    write_record(tmp_path, job="slurm job 7 step batch", pid=dead_pid())  # the requeued job's old launcher
    owner = FolderOwner.claim(tmp_path, 30, 300, job="slurm job 7 step batch")
    assert owner.holds and "taken back by this job" in caplog.text and "WARNING" not in caplog.text
    owner.release()


def test_the_holder_renews_its_heartbeat_and_notices_a_lost_record(tmp_path):
    owner = FolderOwner.claim(tmp_path, 0.05, 300, job="process 3 on here")
    first = json.loads((tmp_path / OWNER_FILE).read_text())["heartbeat"]
    time.sleep(0.3)
    assert json.loads((tmp_path / OWNER_FILE).read_text())["heartbeat"] > first
    write_record(tmp_path, job="process 4 on there")
    time.sleep(0.3)
    assert owner.lost and "now names" in owner.lost
    owner.release()
    assert json.loads((tmp_path / OWNER_FILE).read_text())["job"] == "process 4 on there"  # not removed: not ours


@pytest.mark.multiprocess
def test_two_takers_of_one_gone_record_one_wins(tmp_path):
    write_record(tmp_path, pid=dead_pid())
    code = ("import sys; from pathlib import Path; from nsa_titan.runtime.ownership import FolderOwner, FolderInUse\n"
            "try:\n    FolderOwner.claim(Path(sys.argv[1]), 30, 300); print('took')\n"
            "except FolderInUse as e:\n    print('refused')\nimport time; time.sleep(2)")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT)}) for _ in range(4)]
    outcomes = sorted(p.communicate(timeout=120)[0].strip() for p in procs)
    assert outcomes == ["refused", "refused", "refused", "took"], outcomes


# ------------------------------------------------------------------ through the launcher

def verify(checkpoint: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nsa_titan.checkpoint", "verify", str(checkpoint)], cwd=ROOT,
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})


@pytest.mark.multiprocess
def test_a_second_run_on_a_folder_in_use_exits_2_within_60_s_and_writes_nothing(tmp_path):
    dump = tmp_path / "out"
    first = Job(dump, *DEFAULTS, "--checkpoint.interval", "10", nproc=2)
    first.wait_for(r"step +2/40 ")
    holder = json.loads((dump / OWNER_FILE).read_text())
    start = time.monotonic()
    rc, out = Job(dump, *DEFAULTS, "--checkpoint.interval", "10", "--debug.seed", "5", nproc=2).finish()
    refused_in = time.monotonic() - start
    assert rc == 2 and refused_in < 60, (refused_in, out[-3000:])
    lines = [x for x in out.splitlines() if x.strip()]
    assert len(lines) == 1 and f"is in use by a run (pid {holder['pid']} on {socket.gethostname()}" in lines[0], out
    rc, out = first.finish()
    assert rc == 0 and "Traceback" not in out, out[-3000:]
    # Everything in the folder is the first run's: its config (seed 0), one TensorBoard run, its checkpoints.
    assert "seed = 0" in (dump / "config.toml").read_text()
    assert len([p for p in (dump / "tb").iterdir()]) == 1
    steps = sorted(p.name for p in (dump / "checkpoint").iterdir())
    assert steps == ["step-30", "step-40"], steps  # keep_latest_k = 2
    for step in steps:
        assert "seed = 0" in (dump / "checkpoint" / step / "config.toml").read_text()
        assert verify(dump / "checkpoint" / step).returncode == 0
    assert not (dump / OWNER_FILE).exists()  # released at the end


@pytest.mark.multiprocess
@pytest.mark.parametrize("gone", ["dead pid", "old heartbeat"])
def test_a_stale_owner_record_is_taken_over_with_the_warning(tmp_path, gone):
    dump = tmp_path / "out"
    changes = {"pid": dead_pid()} if gone == "dead pid" else {"host": "node-elsewhere", "heartbeat": time.time() - 3600}
    write_record(dump, job="slurm job 1 step batch", **changes)
    out = run_job(dump, *DEFAULTS, "--training.steps", "4")
    assert out.count("taken over from slurm job 1 step batch") == 1, out[-3000:]
    assert "run summary: reached step 4 of 4" in out
    assert not (dump / OWNER_FILE).exists()


@pytest.mark.multiprocess
def test_a_slurm_requeue_takes_its_folder_back_at_once_and_resumes(tmp_path):
    dump = tmp_path / "out"
    env = {"SLURM_JOB_ID": "4242"}
    job = Job(dump, *DEFAULTS, "--checkpoint.interval", "5", nproc=2, env=env)
    job.wait_for(r"checkpoint \S+/step-5: ")
    ranks = child_pids(job.proc.pid)
    for pid in [job.proc.pid, *ranks, *(w for r in ranks for w in child_pids(r))]:  # the node is lost: no cleanup
        os.kill(pid, signal.SIGKILL)
    job.finish()
    assert json.loads((dump / OWNER_FILE).read_text())["job"] == "slurm job 4242 step batch"
    out = run_job(dump, *DEFAULTS, nproc=2, env=env)
    assert "owner.json: taken back by this job" in out and "taken over" not in out, out[-3000:]
    assert re.search(r"resumed from \S+/step-\d+ at step \d+", out) and "run summary: reached step 40 of 40" in out


@pytest.mark.multiprocess
def test_a_rank_restarted_by_torchrun_takes_its_folder_back(tmp_path):
    """Without nsa_titan's launcher (plain torchrun), the ranks hold the folder; a restart takes it back."""
    dump = tmp_path / "out"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--max-restarts", "1",
           "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{free_port()}", "-m", "nsa_titan.train", *SMALL,
           *DEFAULTS, "--checkpoint.interval", "5", "--job.dump_folder", str(dump)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
                                 "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if re.search(r"checkpoint \S+/step-5: ", line):
            holder = json.loads((dump / OWNER_FILE).read_text())
            os.kill(holder["pid"], signal.SIGKILL)  # the rank that holds the record
            break
    out = "".join(lines) + proc.communicate(timeout=600)[0]
    assert proc.returncode == 0, out[-4000:]
    # The restarted ranks took the record back (whichever rank did logs it; rank 0's lines alone are shown):
    # a refusal would have been "in use" and exit 2, a stale takeover a warning.
    assert "restart 1 of 1" in out and "taken over" not in out and "in use" not in out, out[-4000:]
    assert "run summary: reached step 40 of 40" in out and not (dump / OWNER_FILE).exists()


# ------------------------------------------------------------------ a resumed run owns what follows its step

@pytest.mark.multiprocess
def test_a_run_resumed_from_an_earlier_step_sets_the_later_ones_aside_and_continues_its_own_line(tmp_path):
    dump = tmp_path / "out"
    ck = dump / "checkpoint"
    run_job(dump, *DEFAULTS, "--training.steps", "20", "--checkpoint.interval", "5", "--checkpoint.keep_latest_k", "0",
            nproc=2)
    assert sorted(p.name for p in ck.iterdir()) == ["step-10", "step-15", "step-20", "step-5"]
    # Back to step 10 with another learning rate; keep 2, which must not count the set-aside folders.
    changed = [*DEFAULTS, "--training.steps", "20", "--checkpoint.interval", "5", "--optimizer.lr", "5e-3",
               "--checkpoint.keep_latest_k", "2"]
    out = run_job(dump, *changed, "--checkpoint.load_step", "10", nproc=2)
    m = re.search(r"this run continues from step 10: 2 later checkpoint\(s\) of an earlier run set aside, not used or "
                  r"removed: (\S+), (\S+)$", out, re.M)
    assert m, out[-3000:]
    assert [Path(p).name.split(".superseded-")[0] for p in m.groups()] == ["step-15", "step-20"]
    names = sorted(p.name for p in ck.iterdir())
    assert [n for n in names if ".superseded-" not in n] == ["step-15", "step-20"], names  # step-5, 10 purged
    assert len([n for n in names if ".superseded-" in n]) == 2
    for step in ("step-15", "step-20"):
        assert "lr = 0.005" in (ck / step / "config.toml").read_text() and inspect_folder(ck / step) is None
    assert f"last checkpoint {ck / 'step-20'}" in out
    # A further resume continues this run's line: its step-20.
    out = run_job(dump, *changed, "--training.steps", "25", nproc=2)
    assert f"resumed from {ck / 'step-20'} at step 20" in out and "set aside" not in out, out[-3000:]
    assert "lr = 0.005" in (ck / "step-25" / "config.toml").read_text()


@pytest.mark.multiprocess
def test_a_run_whose_folder_was_taken_over_commits_nothing_more_and_exits_4(tmp_path):
    """Another job took the record over (as after a heartbeat stuck beyond owner_stale_seconds): every later
    save of the first run is refused before its commit, and its last one fails the run."""
    dump = tmp_path / "out"
    job = Job(dump, *DEFAULTS, "--checkpoint.interval", "5", "--checkpoint.keep_latest_k", "0", nproc=2)
    job.wait_for(r"checkpoint \S+/step-5: ")
    other = write_record(dump, job="slurm job 999 step batch", host="node-elsewhere", pid=1)
    rc, out = job.finish()
    assert rc == 4, out[-3000:]
    refused = [x for x in out.splitlines() if "this run no longer owns its folder: it is held by slurm job 999" in x]
    assert refused and all("save failed: the checkpoint of step" in x for x in refused), out[-3000:]
    left = sorted(p.name for p in (dump / "checkpoint").iterdir())
    assert left[0] == "step-5" and len(left) <= 2 and all(".incomplete" not in n for n in left), left  # 10 may race
    assert json.loads((dump / OWNER_FILE).read_text())["job"] == other.job  # the other job's record stays
