"""A rank's failure in one line, in-process: the cause named from each kind of error (a data-loader worker
killed or raising, out of memory, a failed write), a consequence told apart from a cause, the launcher's order
(cause first), and a commit that can be interrupted at any point without an unverified folder under a step's
name."""

from __future__ import annotations

import errno
import os
import queue
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from nsa_titan.checkpoint.folders import commit, scan, verify
from nsa_titan.data import DataError
from nsa_titan.launch import failures
from nsa_titan.runtime.failure import (CONSEQUENT, EXIT_AFTER_PEER, EXIT_RETRY, after_peer_code, cause_of, explain,
                                       note, noted_cause, relayed, verdict)
from nsa_titan.runtime.failure_channel import Failure, FailureChannel


@pytest.mark.parametrize("message,dead,expected", [
    ("DataLoader worker (pid 4242) is killed by signal: Killed. ", [],
     "its data-loader worker (pid 4242) was killed by SIGKILL, perhaps for memory (the kernel's out-of-memory"),
    ("DataLoader worker (pid 4242) is killed by signal: Segmentation fault. ", [],
     "its data-loader worker (pid 4242) was killed by SIGSEGV"),
    ("DataLoader worker (pid(s) 4242, 4243) exited unexpectedly", [(4242, -9)],
     "its data-loader worker (pid 4242) was killed by SIGKILL, perhaps for memory"),
    ("DataLoader worker (pid(s) 4242) exited unexpectedly", [(4242, 3)], "its data-loader worker (pid 4242) exited "
     "with code 3"),
    ("DataLoader worker (pid(s) 4242) exited unexpectedly", [],
     "its data-loader worker (pid 4242) exited unexpectedly"),
    ("Caught ValueError in DataLoader worker process 1.\nOriginal Traceback (most recent call last):\n  File \"x.py\", "
     "line 3, in f\nValueError: bad document 17\n", [], "its data-loader worker 1 raised ValueError: bad document 17"),
], ids=["sigkill", "sigsegv", "exited-sigkill", "exited-code", "exited-unknown", "worker-raised"])
def test_a_loader_workers_death_or_exception_is_named_with_its_pid_and_signal(message, dead, expected):
    assert cause_of(RuntimeError(message), dead).startswith(expected)
    killed = "SIGKILL" in expected
    assert ("[data] num_workers" in cause_of(RuntimeError(message), dead)) == killed


def test_out_of_memory_and_a_failed_write_are_named_with_the_fix_or_the_path():
    oom = cause_of(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), [])
    assert oom.startswith("out of memory (CUDA out of memory. Tried to allocate 2.00 GiB)")
    assert "local_batch_size" in oom
    write = cause_of(OSError(errno.ENOSPC, "No space left on device", "/x/heartbeat/rank1.jsonl"), [])
    assert write == "OSError: [Errno 28] No space left on device: '/x/heartbeat/rank1.jsonl'"


def test_a_cause_names_rank_step_and_traceback_and_a_consequence_says_so(tmp_path):
    trace = tmp_path / "rank1_error.txt"
    cause = explain(ValueError("boom"), 1, 9, "the training step", [], trace, "", None)
    assert cause == f"nsa_titan: rank 1 failed in the training step of step 9: ValueError: boom. Its traceback: {trace}"
    assert not CONSEQUENT.match(cause)
    gloo = RuntimeError("[/w/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:5")
    lost = explain(gloo, 0, 9, "the training step", [], trace, "", None)
    assert lost == ("nsa_titan: rank 0 stopped in the training step of step 9 after another rank's failure (a "
                    "collective lost its peer: Connection closed by peer [127.0.0.1]:5)")
    stopping = explain(ValueError("x"), 0, 9, "the training step", [], trace, "SIGTERM", None)
    assert stopping.startswith("nsa_titan: rank 0 stopped in the training step of step 9 after another rank's "
                               "failure (stopping on SIGTERM")
    assert CONSEQUENT.match(lost) and CONSEQUENT.match(stopping)


def test_the_launcher_prints_the_cause_first_then_signals_then_consequences():
    def failure(code: int, message: str, timestamp: int) -> SimpleNamespace:
        return SimpleNamespace(exitcode=code, message=message, timestamp=timestamp)

    consequence = "nsa_titan: rank 0 stopped in the training step of step 9 after the failure of rank 2"
    cause = "nsa_titan: rank 2 failed in the training step of step 9: ValueError: boom. Its traceback: /t"
    e = SimpleNamespace(failures={0: failure(1, consequence, 100), 1: failure(-9, "Signal 9 (SIGKILL)", 100),
                                  2: failure(1, cause, 101)})
    lines = failures(e)
    assert [code for code, _ in lines] == [1, 137, 1]
    assert lines[0][1] == cause and lines[2][1] == consequence
    assert lines[1][1] == "nsa_titan: rank 1 failed with exit code 137: Signal 9 (SIGKILL)"


def test_the_launcher_prints_the_rank_whose_source_failed_not_the_rank_it_told():
    told = f"nsa_titan: data unavailable: {relayed('data')}. Stopped after step 7 with checkpoint /c/step-7; ..."
    own = ("nsa_titan: data unavailable: [data] path = 'http://h/' could not be read after 3 retries over 1.4 s "
           "(last: ClientOSError). Stopped after step 7 with checkpoint /c/step-7; ...")
    for told_first in (True, False):  # the same second, either rank first: the reading rank's line wins
        e = SimpleNamespace(failures={0: SimpleNamespace(exitcode=EXIT_RETRY, message=told, timestamp=100),
                                      1: SimpleNamespace(exitcode=EXIT_RETRY, message=own, timestamp=100 + told_first)})
        assert failures(e) == [(EXIT_RETRY, own)]  # the told rank's line repeats nothing: left out


def test_a_cause_still_settling_its_save_is_printed_first_from_the_note_of_the_rank_it_stopped():
    """Rank 0 announced its bad input and is still settling an async save when rank 1, told, exits: torchrun reports
    rank 1 alone. Its note carries the cause, which the launcher prints first, with the cause's exit code; rank 1
    itself exits with that code, so that its node's launcher does not restart the job either."""
    cause = Failure(0, 2, "nsa_titan: data error: rank 0 in the training step of step 14: [data] path = 'd', file f, "
                          "row 17: its 'text' is null, not text. Mend ...")
    consequence = "nsa_titan: rank 1 stopped in the training step of step 14 after the failure of rank 0"
    assert noted_cause(note(consequence, cause)) == cause and noted_cause(consequence) is None
    assert note(cause.line, cause) == cause.line  # a cause's own note carries nothing more
    assert after_peer_code(cause) == 2 and after_peer_code(Failure(0, 1, "x")) == EXIT_AFTER_PEER
    e = SimpleNamespace(failures={1: SimpleNamespace(exitcode=2, message=note(consequence, cause), timestamp=100)})
    assert failures(e) == [(2, cause.line), (2, consequence)]
    crash = Failure(0, 1, "nsa_titan: rank 0 failed in the training step of step 9: ValueError: boom. Its traceback: /t")
    e = SimpleNamespace(failures={1: SimpleNamespace(exitcode=1, message=note(consequence, crash), timestamp=100),
                                  0: SimpleNamespace(exitcode=1, message=crash.line, timestamp=101)})
    assert failures(e) == [(1, crash.line), (1, consequence)]  # the cause's own report, when there is one


@pytest.mark.multiprocess
def test_the_channel_wakes_its_listeners_at_the_announcement_and_at_the_loss_of_the_store(monkeypatch):
    """The first failure of an attempt reaches a listener blocked in its wait within a second, and only the first is
    kept; a listener whose store's host dies is told so (None) at once."""
    server = subprocess.Popen([sys.executable, "-c", "import time, torch.distributed as d; s = d.TCPStore('127.0.0.1', "
                               "0, is_master=True, wait_for_workers=False); print(s.port, flush=True); time.sleep(600)"],
                              stdout=subprocess.PIPE, text=True)
    try:
        port, heard = int(server.stdout.readline()), queue.Queue()
        teller, listener = FailureChannel("127.0.0.1", port, 0, 2), FailureChannel("127.0.0.1", port, 1, 2)
        listener.listen(heard.put)
        time.sleep(0.5)
        assert heard.empty()
        failure, at = Failure(0, 2, "nsa_titan: data error: rank 0 ..."), time.monotonic()
        assert teller.announce(failure) and not teller.announce(Failure(1, 1, "nsa_titan: rank 1 failed later"))
        assert heard.get(timeout=5) == failure and time.monotonic() - at < 1.0
        assert listener.first() == failure and teller.first() == failure
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # the next attempt's keys: nothing announced yet
        closed, lost = FailureChannel("127.0.0.1", port, 0, 2), FailureChannel("127.0.0.1", port, 1, 2)
        closed.listen(heard.put)
        lost.listen(heard.put)
        time.sleep(0.5)
        thread = closed.listener
        closed.close()  # a rank that ends: its listener returns, and hears nothing
        assert not thread.is_alive() and heard.empty()
        server.kill()
        assert heard.get(timeout=5) is None and heard.empty()
    finally:
        server.kill()
        server.wait()


def test_a_store_connection_that_times_out_is_made_again_not_read_as_the_store_gone(monkeypatch):
    """A store busy with many ranks at start-up answers after CONNECT_S: every exception of the listener's
    connection was read as the store's host gone, which ended a healthy rank. Two connections time out here (as
    torch raises it), the host still accepting; the third is made, and the announcement is heard."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    made, timeouts = FailureChannel._connect, []

    def slow(channel):
        if channel.rank == 1 and len(timeouts) < 2:
            timeouts.append(time.monotonic())
            raise dist.DistNetworkError("The client socket has timed out after 5000ms while trying to connect")
        return made(channel)

    monkeypatch.setattr(FailureChannel, "_connect", slow)
    heard = queue.Queue()
    listener = FailureChannel("127.0.0.1", store.port, 1, 2)
    listener.listen(heard.put)
    time.sleep(3)
    assert len(timeouts) == 2 and heard.empty() and listener.listener.is_alive()
    failure = Failure(0, 1, "nsa_titan: rank 0 failed ...")
    assert FailureChannel("127.0.0.1", store.port, 0, 2).announce(failure)
    assert heard.get(timeout=10) == failure


def test_a_loader_workers_bad_input_is_one_line_naming_rank_phase_and_step_without_the_traceback(tmp_path):
    wrapped = DataError("Caught DataError in DataLoader worker process 0.\nOriginal Traceback (most recent call last):\n"
                        "  File \"/x/packing.py\", line 3, in _documents\n    raise DataError(f\"...\")\n"
                        "nsa_titan.data.errors.DataError: [data] path = 'd', file f, row 17: its 'text' is null, not text")
    code, line = verdict(wrapped, 1, 14, "the training step", [], tmp_path / "t", "", None)
    assert code == 2
    assert line == ("nsa_titan: data error: rank 1 in the training step of step 14: [data] path = 'd', file f, row 17: "
                    "its 'text' is null, not text")


def test_a_commit_interrupted_at_any_point_leaves_no_step_folder_and_a_finished_one_verifies(tmp_path, monkeypatch):
    def written(name: str) -> Path:
        tmp = tmp_path / f"step-{name}.incomplete-t"
        tmp.mkdir()
        (tmp / "__0_0.distcp").write_bytes(os.urandom(1000))
        (tmp / ".metadata").write_bytes(b"meta")
        return tmp

    real = os.replace
    monkeypatch.setattr(os, "replace", lambda a, b: (_ for _ in ()).throw(OSError(errno.EIO, "killed here")))
    with pytest.raises(OSError):
        commit(written("4"), tmp_path / "step-4", 4, 2, "[job]\n", None)
    monkeypatch.setattr(os, "replace", real)
    assert not (tmp_path / "step-4").exists()  # the interrupted commit: no folder under the step's name
    assert [(f.step, f.problem) for f in scan(tmp_path)] == [(4, "an interrupted save (never committed)")]
    commit(written("8"), tmp_path / "step-8", 8, 2, "[job]\n", None)
    assert verify(tmp_path / "step-8") is None and (tmp_path / "step-8" / ".complete").is_file()
    assert not list(tmp_path.glob("step-8.incomplete-*"))
