"""One rank's failure: named in one line, told to the other ranks, ended without waiting on them.

An error raised on one rank only (its data-loader worker killed for memory, a corrupt document in its
shard, an out-of-memory forward, a failed local write) must not lead that rank into a collective the
other ranks never enter: they would wait on each other until the step watchdog fired. So a failing rank

- logs one line naming the rank, the step, the phase and the cause, first thing, and writes its traceback to
  `<dump_folder>/fault/rank<R>_error.txt` (`explain`, `report_failure`);
- tells the job through its store (`failure_channel`): each rank's listener wakes on it and its watchdog ends a
  rank still blocked a few seconds later, so that no rank waits for the step timeout;
- settles what is its own only (an async save in flight), then leaves at once (`exit_now`): interpreter
  teardown would join the checkpoint thread and the gloo threads, which may be blocked in a collective with the
  failed rank.

The ranks that stop because another one failed say so in a line of their own (`CONSEQUENT`), which the
launcher prints after the cause; their note to the launcher carries the cause (`note`), which the launcher
prints first even when the failing rank is still settling its save as the others exit. After bad input or a
halt (`NO_RESTART`) they exit with the cause's code, so that no node's launcher restarts the job.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import sys
import traceback
from pathlib import Path

import torch

from ..data import DataUnavailable
from ..system.cli import EXIT_BAD_INPUT, bad_input_line, note_failure, report
from ..system.env import LAUNCHED_BY
from ..system.errors import BadInput
from .failure_channel import Failure, FailureChannel

EXIT_CRASH, EXIT_HALTED, EXIT_SAVE_FAILED, EXIT_RETRY = 1, 3, 4, 75
"""Exit codes: a crash (this line's cause); halted by a non-finite step; the run's last save failed (its
summary names the last checkpoint it committed); stopped, after saving, by data unreadable through its
retries (EX_TEMPFAIL: resume it). Bad input is `cli.EXIT_BAD_INPUT`, a hang `cli.EXIT_HANG`."""
EXIT_AFTER_PEER = 1
"""Exit code of a rank stopped by another rank's failure (the job's code is the cause's)."""
NO_RESTART = {EXIT_BAD_INPUT: "bad input", EXIT_HALTED: "a halt (non-finite steps, loss spikes)"}
"""Exit codes of a failure that every restart would meet again, in words: the launcher restarts no job after one."""
LOST_STORE = Failure(-1, EXIT_AFTER_PEER, "")
"""The failure a rank reads into the store's loss: its host (rank 0, or the launcher) is gone."""
CAUSE = "cause: "
"""How a consequence's note to the launcher carries its cause, on its second line (`note`)."""
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
SIGNAL_NAMES = {signal.strsignal(s): s.name for s in signal.Signals if signal.strsignal(s)}
"""strsignal's words ('Killed', as the data loader reports a worker's death) -> the signal's name."""


class TrainingHalted(RuntimeError):
    """Training stopped on purpose (non-finite steps, a loss that rose for good), with the report in the message."""


def note(line: str, cause: Failure | None) -> str:
    """A rank's note to the launcher (torchrun's error file): its line, and for a consequence, the cause it was told."""
    return line + (f"\n{CAUSE}{cause.encode()}" if cause is not None and CONSEQUENT.match(line) else "")


def noted_cause(message: str) -> Failure | None:
    """The cause a consequence's note carries (`note`), if any."""
    second = message.split("\n", 2)[1:2]
    return Failure.decode(second[0].removeprefix(CAUSE)) if second and second[0].startswith(CAUSE) else None


def after_peer_code(cause: Failure | None) -> int:
    """The exit code of a rank stopped by `cause`: the cause's when no restart may follow it (`NO_RESTART`)."""
    return cause.code if cause is not None and cause.code in NO_RESTART else EXIT_AFTER_PEER


def first_failure(channel: FailureChannel | None, rank: int, ask: bool) -> Failure | None:
    """The job's first failure, if another rank announced one: as the listener heard it, or asked of the store
    (`ask`); a failure of rank -1 if the store is gone (its host, the launcher or rank 0, exited)."""
    if channel is None:
        return None
    try:
        first = channel.first() if ask else channel.told
    except Exception:  # noqa: BLE001 - the store's host is gone
        return LOST_STORE
    return first if first is not None and first.rank != rank else None


def peer_words(cause: Failure) -> str:
    """`cause` as a consequence's line names it."""
    return (f"the failure of rank {cause.rank}" if cause.rank >= 0 else
            "losing the job's store (the launcher or the rank hosting it has exited)")


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
            trace_path: Path, stopping: str, cause: Failure | None) -> str:
    """The rank's one line. A cause of its own: `rank R failed in PHASE of step N: CAUSE. Its traceback: PATH`.
    Another rank's failure first (`cause`, announced; a collective that lost its peer; a stop signal under way,
    `stopping`): `rank R stopped in PHASE of step N after ...` (`CONSEQUENT`)."""
    where = f"in {phase} of step {step}"
    if cause is not None:
        return f"nsa_titan: rank {rank} stopped {where} after {peer_words(cause)}"
    if lost_peer(error) or stopping:
        why = "a collective lost its peer" if lost_peer(error) else f"stopping on {stopping}"
        text = re.sub(r"\[[^\]]*\.(?:cc|cpp|h):\d+\] ", "", " ".join(str(error).split()))  # gloo's source path
        return f"nsa_titan: rank {rank} stopped {where} after another rank's failure ({why}: {text[:160]})"
    return f"nsa_titan: rank {rank} failed {where}: {cause_of(error, dead_workers)}. Its traceback: {trace_path}"


def relayed(what: str) -> str:
    """The DataUnavailable reason of a rank told by the others that their `what` source stayed unreadable."""
    return f"another rank's {what} source stayed unreadable (its line says why)"


def own_message(error: BaseException) -> str:
    """`error`'s message, without the traceback a loader worker's error comes wrapped in."""
    text = str(error)
    if WORKER_RAISED.match(text):
        if m := re.search(rf"^[\w.]*{type(error).__name__}: (.*)\Z", text, re.M | re.S):
            return m.group(1).strip()
    return text


def verdict(error: BaseException, rank: int, step: int, phase: str, dead_workers: list[tuple[int, int]],
            trace_path: Path, stopping: str, cause: Failure | None) -> tuple[int, str]:
    """The exit code and the one line of a rank whose training ended with `error`: a verdict's (data
    unavailable, halted, bad input: rank, phase and step named), else a failure's (`explain`)."""
    if isinstance(error, DataUnavailable):
        return EXIT_RETRY, f"nsa_titan: data unavailable: {error.reason}"
    if isinstance(error, TrainingHalted):
        return EXIT_HALTED, f"nsa_titan: halted: {error}"
    if isinstance(error, BadInput):
        where = f"rank {rank} in {phase} of step {step}: "
        return EXIT_BAD_INPUT, bad_input_line("nsa_titan", error, own_message(error), where)
    line = explain(error, rank, step, phase, dead_workers, trace_path, stopping, cause)
    return (after_peer_code(cause) if CONSEQUENT.match(line) else EXIT_CRASH), line


def report_failure(error: BaseException, rank: int, step: int, phase: str, dead_workers: list[tuple[int, int]],
                   trace_path: Path, stopping: str, channel: FailureChannel | None) -> tuple[int, str]:
    """`verdict`'s exit code and line, told at once: logged where it happened (so that the log's first error line
    is the cause's), announced to the job unless it is a consequence, noted for the launcher (which prints it
    once more among its closing lines), with the traceback in `trace_path` (the rank's fault file)."""
    cause = None if isinstance(error, (BadInput, DataUnavailable, TrainingHalted)) else \
        first_failure(channel, rank, ask=not (lost_peer(error) or stopping))  # the store's host may be gone
    code, line = verdict(error, rank, step, phase, dead_workers, trace_path, stopping, cause)
    failed = code == EXIT_CRASH or bool(CONSEQUENT.match(line))  # not a verdict
    if failed or os.environ.get(LAUNCHED_BY):
        logging.getLogger("nsa_titan").error("%s", line.removeprefix("nsa_titan: "))
    if channel is not None and not CONSEQUENT.match(line):
        channel.announce(Failure(rank, code, line))
    if failed:
        note_failure(note(line, cause))
    else:
        report(line)
    try:
        trace_path.parent.mkdir(parents=True, exist_ok=True)
        trace_path.write_text(line + "\n\n" + "".join(traceback.format_exception(error)))
    except OSError:  # the disk that failed may be this one: the line still goes out
        pass
    return code, line


def restart_line(resumed: Path | None, step: int) -> str | None:
    """The line of a torchrun restart, None in its first attempt: which of how many, and where it resumed."""
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if not restart:
        return None
    return (f"restart {restart} of {os.environ.get('TORCHELASTIC_MAX_RESTARTS', '?')} (torchrun --max-restarts): "
            + (f"resumed from {resumed} at step {step}" if resumed else "no complete checkpoint yet: starting from step 0"))


def exit_now(code: int) -> None:
    """Flush the logs and leave the process with `code`, skipping interpreter teardown (it joins the
    checkpoint writer's and gloo's threads, which may wait on a rank that is gone)."""
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
