"""Every process of a job ends with it, bad input is not retried, a failure reaches the other ranks at once (issue:
orphaned ranks trained on beside a rerun; a null document was read as the end of the data and restarted twice).
As an operator meets them: `run_train.sh`, 2 ranks, loader workers, async saves, `MAX_RESTARTS`.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from nsa_titan.config import load_config
from nsa_titan.data import DataError
from nsa_titan.data.prepare import prepare
from nsa_titan.launch import child_pids

from jobs import STEPS, Job
from test_rank_failure import closing_lines, error_lines, step_folders

pytestmark = pytest.mark.multiprocess

ASYNC = ["--checkpoint.async_mode", "async", "--checkpoint.interval", "4"]
BAD_FILE, BAD_ROW = "train-00002-of-00004.parquet", 17


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, awaiting its reaping, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


PID_NAMESPACE = ["unshare", "--pid", "--fork", "--mount-proc"]
"""What `docker run IMAGE CMD` and a Kubernetes pod make of CMD: PID 1 of a PID namespace of its own."""
SUBREAPER = [sys.executable, "-c", """
import ctypes, os, subprocess, sys
ctypes.CDLL(None).prctl(36, 1)  # PR_SET_CHILD_SUBREAPER: what tini, `docker run --init` and systemd are
code = subprocess.Popen(sys.argv[1:]).wait()
while True:  # reap the orphans handed to this process, as an init does
    try:
        os.wait()
    except ChildProcessError:
        break
sys.exit(code)
"""]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m",
            "nsa_titan.train"]
"""torchrun called directly, without `run_train.sh` and its launcher."""


def namespaces_work() -> bool:
    return subprocess.run([*PID_NAMESPACE, "true"], capture_output=True).returncode == 0


needs_namespaces = pytest.mark.skipif(not namespaces_work(), reason="unshare --pid needs root (CI runs as root)")


@needs_namespaces
@pytest.mark.parametrize("launcher", [(), TORCHRUN], ids=["run_train.sh", "torchrun"])
def test_the_launcher_as_a_containers_pid_1_trains_its_steps(tmp_path, launcher):
    """Each rank's dead-launcher check read "my parent is PID 1" as its launcher gone, and exited 0 at once."""
    rc, out = Job(tmp_path / "out", "--training.steps", "5", "--data.num_workers", "2", nproc=2, launcher=launcher,
                  under=PID_NAMESPACE).finish()
    assert rc == 0, out[-4000:]
    assert "run summary: reached step 5 of 5" in out, out[-3000:]
    assert (tmp_path / "out" / "checkpoint" / "step-5").is_dir()


HOW = {"run_train.sh": ((), ()), "pid-1": ((), PID_NAMESPACE), "subreaper": ((), SUBREAPER),
       "torchrun": (TORCHRUN, ())}


@pytest.mark.parametrize("how", list(HOW))
def test_a_launcher_killed_with_sigkill_takes_its_ranks_and_loader_workers_along(tmp_path, how):
    """However the launcher is started; after the plain one's, a rerun trains alone and resumes."""
    launcher, under = HOW[how]
    if under is PID_NAMESPACE and not namespaces_work():
        pytest.skip("unshare --pid needs root (CI runs as root)")
    dump, args = tmp_path / "out", [*ASYNC, "--data.num_workers", "2"]
    job = Job(dump, *args, nproc=2, launcher=launcher, under=under)
    job.wait_for(rf"step +6/{STEPS} ")
    launcher_pid = child_pids(job.proc.pid)[0] if under else job.proc.pid  # run_train.sh execs the launcher
    ranks = child_pids(launcher_pid)
    processes = ranks + [w for r in ranks for w in child_pids(r)]
    assert len(ranks) == 2 and len(processes) == 6, processes  # 2 ranks, 2 loader workers each
    os.kill(launcher_pid, signal.SIGKILL)
    killed = time.monotonic()
    while any(alive(p) for p in processes) and time.monotonic() - killed < 5:
        time.sleep(0.05)
    assert not [p for p in processes if alive(p)], "alive 5 s after the launcher's SIGKILL"
    job.proc.wait(timeout=30)
    if how != "run_train.sh":
        return
    rc, out = Job(dump, *args, nproc=2).finish()
    assert rc == 0, out[-4000:]
    assert "taken over from" in out and "resumed from" in out, out[-3000:]
    assert f"run summary: reached step {STEPS} of {STEPS}" in out
    assert all(problem is None for problem in step_folders(dump).values())


@pytest.fixture
def shards(tmp_path) -> Path:
    """4 parquet shards of 50 documents; row 17 of the third is null."""
    folder = tmp_path / "shards"
    folder.mkdir()
    for s in range(4):
        texts = [f"def f{s}_{i}(x):\n    return x + {i}  # document {i} of shard {s}\n" * 8 for i in range(50)]
        texts[BAD_ROW] = None if s == 2 else texts[BAD_ROW]
        pq.write_table(pa.table({"text": texts}), folder / f"train-{s:05d}-of-00004.parquet")
    return folder


@pytest.mark.parametrize("choice", ["error", "skip"])
def test_a_null_document_is_bad_input_named_by_file_and_row_that_no_restart_retries(tmp_path, shards, choice):
    dump = tmp_path / "out"
    job = Job(dump, "--data.path", str(shards), "--data.bad_documents", choice, *ASYNC, nproc=2,
              env={"MAX_RESTARTS": "2"})
    named = rf"\[data\] path = '{shards}', file {shards / BAD_FILE}, row {BAD_ROW}: its 'text' is null, not text"
    if choice == "skip":
        rc, out = job.finish(timeout=300)
        assert rc == 0, out[-4000:]
        warnings = [x for x in out.splitlines() if "skipped a document" in x]
        assert len(warnings) == 1 and re.search(rf"WARNING data: skipped a document: {named}", warnings[0]), warnings
        assert f"run summary: reached step {STEPS} of {STEPS}" in out and "restart 1 of 2" not in out
        return
    job.wait_for(" ERROR ")
    first, read = job.lines[-1], job.times[-1]
    rc, out = job.finish(timeout=300)
    assert rc == 2, out[-4000:]
    assert job.ended - read < 30, f"{job.ended - read:.0f} s from the error line to the exit"
    assert "restart 1 of 2" not in out, out[-4000:]
    assert error_lines(out)[0] == first.rstrip("\n")
    assert re.search(rf"ERROR data error: rank [01] in the training step of step \d+: {named}\. Mend or drop that row, "
                     rf"or set \[data\] bad_documents = 'skip'", first), "\n".join(error_lines(out))
    last = out.strip().splitlines()[-1]
    assert last.startswith("nsa_titan: not restarted (2 of --max-restarts 2 left): bad input (exit code 2)"), last


def test_a_deterministic_fault_spends_the_restarts_then_ends_the_job_with_one_line_naming_both(tmp_path):
    dump = tmp_path / "out"
    job = Job(dump, *ASYNC, "--debug.fault_raise_rank", "0", "--debug.fault_raise_step", "9",
              "--debug.fault_raise_where", "forward", "--debug.fault_raise_attempts", "0", nproc=2,
              env={"MAX_RESTARTS": "2"})
    rc, out = job.finish(timeout=600)
    assert rc == 1, out[-4000:]
    assert out.count("fault injection: rank 0 runs out of memory in the forward of step 9") == 3, out[-4000:]
    assert "restart 1 of 2" in out and "restart 2 of 2" in out
    closing = closing_lines(out)
    assert re.fullmatch(r"nsa_titan: rank 0 failed in the training step of step 9: out of memory \(CUDA out of memory.*"
                        r" Its traceback: \S+ \(\d+ s after the start; the restarts are spent: 2 of --max-restarts 2\)",
                        closing[0]), closing


def test_a_fault_during_an_async_save_stops_the_other_rank_within_5_s(tmp_path):
    """Rank 0 fails while its save of step 8 takes 20 s to write: it announces the failure first and then waits for
    the save (up to [fault] failure_save_wait_seconds, 15 s); rank 1 learns of it at once and exits."""
    dump = tmp_path / "out"
    job = Job(dump, *ASYNC, "--debug.fault_save_delay_seconds", "20", "--debug.fault_raise_rank", "0",
              "--debug.fault_raise_step", "9", "--debug.fault_raise_where", "forward", nproc=2)
    job.wait_for(rf"step +5/{STEPS} ")
    peer = job.rank_pid(1)
    job.wait_for("fault injection: rank 0 runs out of memory")
    fault = job.times[-1]
    while alive(peer) and time.monotonic() - fault < 10:
        time.sleep(0.05)
    assert time.monotonic() - fault < 5, f"rank 1 still running {time.monotonic() - fault:.1f} s after the fault"
    rc, out = job.finish(timeout=300)
    assert rc == 1, out[-4000:]
    assert "ERROR rank 1 stopped in the training step of step 9 after the failure of rank 0" in out, out[-3000:]
    closing = closing_lines(out)  # the cause first, though torchrun saw only rank 1 exit while rank 0 waited
    assert closing[0].startswith("nsa_titan: rank 0 failed in the training step of step 9: out of memory"), closing
    assert re.search(r"the async save of step 8, in flight at the failure, was not completed: step-8\.incomplete-\S+ "
                     r"stays aside", out), out[-3000:]
    assert all(problem is None for problem in step_folders(dump).values())


@pytest.mark.parametrize("choice", ["error", "skip"])
def test_prepare_names_a_null_document_by_file_and_row_or_skips_it(tmp_path, shards, choice, caplog):
    cfg, _ = load_config(["--data.tokenizer", "byte", "--data.path", str(shards), "--data.holdout", "0.1",
                          "--data.bad_documents", choice], world_size=1)
    named = f"[data] path = '{shards}', file {shards / BAD_FILE}, row {BAD_ROW}: its 'text' is null, not text"
    if choice == "error":
        with pytest.raises(DataError, match=re.escape(named)):
            prepare(cfg, tmp_path / "prepared", processes=1, docs_per_part=16)
        return
    with caplog.at_level(logging.WARNING):
        manifest = prepare(cfg, tmp_path / "prepared", processes=1, docs_per_part=16)
    assert [r.getMessage() for r in caplog.records if "skipped a document" in r.getMessage()] == [
        f"data: skipped a document: {named} ([data] bad_documents = 'skip')"]
    (source,) = manifest["sources"].values()
    assert source["documents"] + sum(p["documents"] for p in source["holdout"]) == 4 * 50 - 1  # all but the null


def test_an_entry_point_s_end_runs_the_exit_handlers_flushes_everything_and_keeps_its_code():
    """`leave`, which ends every entry point without Python's module teardown: the exit handlers run, a thread
    still working is waited for, a thread pool left open (as torch.compile leaves the one it compiled in: joined
    as a plain thread, its idle workers waited forever) ends, Python's and C's buffered output (a pipe: fully
    buffered) reach the reader, and the exit code is the entry point's."""
    script = """if True:
        import atexit, ctypes, threading, time
        from concurrent.futures import ThreadPoolExecutor
        from nsa_titan.system.cli import leave
        atexit.register(lambda: print("exit handler ran"))
        threading.Thread(target=lambda: (time.sleep(0.5), print("thread finished"))).start()
        pool = ThreadPoolExecutor(2)  # kept, as torch.compile keeps its own
        pool.submit(print, "pool task ran").result()
        ctypes.CDLL(None).printf(b"from C, no newline")
        print("from Python", end="")
        leave(3)
    """
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # which leaves C's stdio unbuffered
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                          env={**env, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)})
    assert proc.returncode == 3, proc.stderr
    for part in ("pool task ran", "thread finished", "exit handler ran", "from Python", "from C, no newline"):
        assert part in proc.stdout, proc.stdout


def test_an_entry_point_whose_end_does_not_return_prints_the_stacks_and_exits_124():
    """A thread that never returns (or an exit handler): past `leave`'s limit, one line and every thread's stack on
    stderr, and exit 124, as a hung rank's, instead of a process that outlives its work."""
    script = """if True:
        import threading
        from nsa_titan.system.cli import leave
        def never_returns():
            threading.Event().wait()
        threading.Thread(target=never_returns).start()
        leave(0, limit_s=2)
    """
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)})
    assert proc.returncode == 124 and time.monotonic() - started < 30, proc.stderr
    assert re.search(r"^nsa_titan: process \d+ did not end within 2 s of its work's end .*: every thread's stack "
                     r"follows; exit 124$", proc.stderr, re.M), proc.stderr
    assert "in never_returns" in proc.stderr, proc.stderr
