"""One rank's failure: named in one line, told to the other ranks, ended without waiting on them.

An error raised on one rank only (its data-loader worker killed for memory, a corrupt document in its
shard, an out-of-memory forward, a failed local write) must not lead that rank into a collective the
other ranks never enter: they would wait on each other until the step watchdog fired. So a failing rank

- writes its traceback to `<dump_folder>/fault/rank<R>_error.txt` and logs one line naming the rank, the
  step, the phase and the cause (`explain`, `report_failure`);
- tells the job through its rendezvous store (`announce`): each rank's watchdog reads it (`announced`) and
  ends a rank still blocked a few seconds later, so that no rank waits for the step timeout;
- cleans up what is its own only, then leaves at once (`exit_now`): interpreter teardown would join the
  checkpoint thread and the gloo threads, which may be blocked in a collective with the failed rank.

The ranks that stop because another one failed say so in a line of their own (`CONSEQUENT`), which the
launcher prints after the cause.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from ..data import DataUnavailable
from ..system.cli import EXIT_BAD_INPUT, bad_input_line, note_failure, report
from ..system.errors import BadInput

EXIT_CRASH, EXIT_HALTED, EXIT_SAVE_FAILED, EXIT_RETRY = 1, 3, 4, 75
"""Exit codes: a crash (this line's cause); halted by a non-finite step; the run's last save failed (its
summary names the last checkpoint it committed); stopped, after saving, by data unreadable through its
retries (EX_TEMPFAIL: resume it). Bad input is `cli.EXIT_BAD_INPUT`, a hang `watchdog.EXIT_HANG`."""
CONSEQUENT = re.compile(r"^nsa_titan: rank \d+ stopped .*after")
"""The line of a rank that stopped because another rank failed (the launcher prints it after the cause)."""
RELAYED = re.compile(r"^nsa_titan: data unavailable: another rank's")
"""The line of a rank whose own source read fine while another rank's did not (`relayed`): the launcher prints
the reading rank's line instead."""
WORKER_KILLED = re.compile(r"DataLoader worker \(pid\(?s?\)? ?([\d, ]+)\) (?:is killed by signal: ([^.]+)|exited)")
WORKER_RAISED = re.compile(r"^Caught (\w+) in DataLoader worker process (\d+)\.")
PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "communicator was aborted",
             "Connection refused")
"""What a collective raises when another rank's process is gone (gloo, NCCL): this rank's error is a consequence."""
ANNOUNCE_S = 1.5
"""A failing rank stays this long after announcing its failure (more than the watchdogs' poll interval)."""
SIGNAL_NAMES = {signal.strsignal(s): s.name for s in signal.Signals if signal.strsignal(s)}
"""strsignal's words ('Killed', as the data loader reports a worker's death) -> the signal's name."""


class TrainingHalted(RuntimeError):
    """Training stopped on purpose (a non-finite step), with the report in the message."""


def _key() -> str:
    """The store key of this attempt's first failure (torchrun restarts count as new attempts)."""
    return f"nsa_titan/failure/attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def announce(rank: int, line: str) -> None:
    """Record `line` as the job's first failure, unless it is a consequence (`CONSEQUENT`) or another rank's
    came first, then wait ANNOUNCE_S: every rank's watchdog reads it while the store still answers (rank 0
    hosts it under the launcher), and this rank exits before they do, so that torchrun reports it as the
    cause. Best effort: the host may be gone."""
    if dist.is_initialized() and dist.get_world_size() > 1 and not CONSEQUENT.match(line):
        try:
            dist.distributed_c10d._get_default_store().compare_set(_key(), "", f"{rank} {line}")
        except Exception:  # noqa: BLE001 - telling the others is a courtesy; the exit tells torchrun
            return
        time.sleep(ANNOUNCE_S)


def announced() -> tuple[int, str] | None:
    """The job's first failure, (rank, line), if a rank announced one (None alone in the job); raises if the
    store cannot be reached."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    store = dist.distributed_c10d._get_default_store()
    if not store.check([_key()]):
        return None
    rank, line = store.get(_key()).decode().split(" ", 1)
    return int(rank), line


def _worker_cause(match: re.Match, dead_workers: list[tuple[int, int]]) -> str:
    """A data-loader worker that died: its pid, how (the signal, or its exit code), and for SIGKILL, memory."""
    pids = [int(p) for p in re.findall(r"\d+", match.group(1))]
    codes = dict(dead_workers)
    how = SIGNAL_NAMES.get(match.group(2) or "", match.group(2))
    if how is None and pids[0] in codes:
        code = codes[pids[0]]
        how = signal.Signals(-code).name if code < 0 else None
        if how is None:
            return f"its data-loader worker (pid {pids[0]}) exited with code {code}"
    if how is None:
        return f"its data-loader worker (pid {', '.join(map(str, pids))}) exited unexpectedly"
    cause = f"its data-loader worker (pid {pids[0]}) was killed by {how}"
    if how == "SIGKILL":
        cause += (", perhaps for memory (the kernel's out-of-memory killer sends SIGKILL; the node's kernel log, "
                  "`dmesg`, says): fewer [data] num_workers or a smaller [data] shuffle_buffer need less memory")
    return cause


def cause_of(error: BaseException, dead_workers: list[tuple[int, int]]) -> str:
    """`error` in words, for the one line: a data-loader worker's death or exception, an out-of-memory
    error, an OSError (errno, path), else the exception's type and message. `dead_workers`: (pid, exit
    code) of the loader's workers that have exited."""
    text = str(error)
    if killed := WORKER_KILLED.search(text):
        return _worker_cause(killed, dead_workers)
    if raised := WORKER_RAISED.match(text):
        last = [x for x in text.splitlines() if x.strip()][-1].strip()
        return f"its data-loader worker {raised.group(2)} raised {last}"
    first = " ".join(text.split())[:300]
    if isinstance(error, torch.OutOfMemoryError):
        return (f"out of memory ({first}): a smaller [training] local_batch_size, or [activation_checkpoint] "
                f"mode = 'full', needs less")
    return f"{type(error).__name__}: {first}"


def lost_peer(error: BaseException) -> bool:
    """Whether `error` is a collective's report that another rank's process is gone."""
    return any(p in str(error) for p in PEER_LOST)


def explain(error: BaseException, rank: int, step: int, phase: str, dead_workers: list[tuple[int, int]],
            trace_path: Path, stopping: str) -> str:
    """The rank's one line. A cause of its own: `rank R failed in PHASE of step N: CAUSE. Its traceback: PATH`.
    Another rank's failure first (announced, or a collective that lost its peer, or a stop signal under way,
    `stopping`): `rank R stopped in PHASE of step N after ...` (`CONSEQUENT`)."""
    where = f"in {phase} of step {step}"
    if lost_peer(error) or stopping:  # the store is not asked: its host may be the rank that is gone
        why = "a collective lost its peer" if lost_peer(error) else f"stopping on {stopping}"
        text = re.sub(r"\[[^\]]*\.(?:cc|cpp|h):\d+\] ", "", " ".join(str(error).split()))  # gloo's source path
        return f"nsa_titan: rank {rank} stopped {where} after another rank's failure ({why}: {text[:160]})"
    try:
        first = announced()
    except Exception:  # noqa: BLE001 - the store's host is gone: that rank failed first
        first = (-1, "")
    if first is not None and first[0] != rank:
        who = f"rank {first[0]}" if first[0] >= 0 else "the rank hosting the job's store"
        return f"nsa_titan: rank {rank} stopped {where} after the failure of {who}"
    return f"nsa_titan: rank {rank} failed {where}: {cause_of(error, dead_workers)}. Its traceback: {trace_path}"


def relayed(what: str) -> str:
    """The DataUnavailable reason of a rank told by the others that their `what` source stayed unreadable."""
    return f"another rank's {what} source stayed unreadable (its line says why)"


def verdict(error: BaseException, rank: int, step: int, phase: str, dead_workers: list[tuple[int, int]],
            trace_path: Path, stopping: str) -> tuple[int, str]:
    """The exit code and the one line of a rank whose training ended with `error`: a verdict's (data
    unavailable, halted, bad input), else a failure's (`explain`)."""
    if isinstance(error, DataUnavailable):
        return EXIT_RETRY, f"nsa_titan: data unavailable: {error.reason}"
    if isinstance(error, TrainingHalted):
        return EXIT_HALTED, f"nsa_titan: halted: {error}"
    if isinstance(error, BadInput):
        return EXIT_BAD_INPUT, bad_input_line("nsa_titan", error)
    return EXIT_CRASH, explain(error, rank, step, phase, dead_workers, trace_path, stopping)


def report_failure(error: BaseException, rank: int, step: int, phase: str, dead_workers: list[tuple[int, int]],
                   trace_path: Path, stopping: str) -> tuple[int, str]:
    """`verdict`'s exit code and line, with the traceback in `trace_path` (the rank's fault file). A verdict's
    line is left to the launcher to print once (`cli.report`); a failure's is logged now, where it happened,
    and left to the launcher too."""
    code, line = verdict(error, rank, step, phase, dead_workers, trace_path, stopping)
    try:
        trace_path.parent.mkdir(parents=True, exist_ok=True)
        trace_path.write_text(line + "\n\n" + "".join(traceback.format_exception(error)))
    except OSError:  # the disk that failed may be this one: the line still goes out
        pass
    if code == EXIT_CRASH:
        logging.getLogger("nsa_titan").error("%s", line.removeprefix("nsa_titan: "))
        note_failure(line)
    else:
        report(line)
    return code, line


def exit_now(code: int) -> None:
    """Flush the logs and leave the process with `code`, skipping interpreter teardown (it joins the
    checkpoint writer's and gloo's threads, which may wait on a rank that is gone)."""
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
