"""torchrun, with the operator's contract on top: clean stops, one-line errors, the trainer's exit code.

    python -m nsa_titan.launch [torchrun options] -m nsa_titan.train [trainer options]

`run_train.sh` execs this. It runs torchrun's own launcher in this process (rendezvous, worker
processes, `--max-restarts`) and adds four things:

- **Stop signals.** SIGTERM, SIGUSR1 and SIGINT are passed on to every local rank, which finishes
  its step, saves a checkpoint and exits 0 (`nsa_titan/runtime/stop.py`); torchrun keeps SIGHUP and
  SIGQUIT (hard stop). A second SIGINT kills the ranks at once. Ranks that have not exited
  `SHUTDOWN_TIMEOUT` seconds after the signal are killed.
- **Exit codes.** The exit code is the first failed rank's: 2 bad input, 3 halted on a non-finite
  step, 4 the last save failed, 75 data unreadable through its retries (saved), 124 a detected hang,
  128 + N a rank killed by signal N; 0 when every rank exited 0.
- **Restarts for what may pass.** `--max-restarts` restarts the job after a crash, a hang or a killed rank,
  not after bad input or a halt (`failure.NO_RESTART`), which every restart would meet again: the last line
  says so. When the restarts are spent, the cause's line says that too.
- **One run per folder.** The job takes `[job] dump_folder` before any rank starts, and holds it
  across torchrun's restarts (`nsa_titan/runtime/ownership.py`); a folder held by another live run is
  refused with exit code 2, nothing written.
- **Errors.** A config or folder problem is found here, before any rank starts. A rank that stops
  on bad input writes its one-line message to torchrun's error file; this prints that line once,
  without torchrun's failure report.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch.distributed.launcher.api as launcher_api
from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import parse_args, run

from .checkpoint.hf_folder import check_initial_source
from .config import load_config, resolve_path
from .config import parse_args as parse_config
from .config.paths import RunPaths, make_folder
from .runtime.failure import CONSEQUENT, EXIT_HALTED, EXIT_RETRY, EXIT_SAVE_FAILED, NO_RESTART, RELAYED, noted_cause
from .runtime.ownership import FolderOwner, job_key
from .runtime.stop import EXIT_ABORTED
from .system.cli import EXIT_BAD_INPUT, EXIT_HANG, leave, run_command
from .system.env import set_launcher_env
from .system.signals import STOP_SIGNALS

VERDICTS = (EXIT_BAD_INPUT, EXIT_HALTED, EXIT_SAVE_FAILED, EXIT_RETRY)
"""Exit codes of a rank that stopped on a verdict of its own, explained by its one line."""
TORCHRUN_SIGNALS = "SIGHUP,SIGQUIT"
"""The signals left to torchrun (it forwards them and raises); the stop signals are ours."""


@dataclass
class Restarts:
    """What torchrun's agent did with its `--max-restarts`: restarts spent, and the exit code that held them back."""

    allowed: int
    spent: int = 0
    held: int | None = None


@contextmanager
def restarts_for_what_may_pass(record: Restarts) -> Iterator[None]:
    """Within: torchrun's agent restarts no job that a rank stopped with a `NO_RESTART` code, as it restarts none
    whose worker hangs in the kernel (it sets its remaining restarts to 0 itself then), and keeps `record`."""
    class Agent(LocalElasticAgent):
        def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
            result = super()._monitor_workers(worker_group)
            if result.is_failed():
                record.spent = worker_group.spec.max_restarts - self._remaining_restarts
                held = sorted({f.exitcode for f in result.failures.values()} & set(NO_RESTART))
                if held and self._remaining_restarts > 0:
                    record.held, self._remaining_restarts = held[0], 0
            return result

    plain, launcher_api.LocalElasticAgent = launcher_api.LocalElasticAgent, Agent
    try:
        yield
    finally:
        launcher_api.LocalElasticAgent = plain


def child_pids(parent: int | None = None) -> list[int]:
    """The direct children of `parent` (default: this process, whose children are torchrun's ranks)."""
    me, pids = os.getpid() if parent is None else parent, []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # exited meanwhile
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == me:  # field 4, after the command name
            pids.append(int(entry.name))
    return pids


def _signal_all(sig: int, group: bool = False) -> None:
    for pid in child_pids():
        try:
            os.killpg(pid, sig) if group else os.kill(pid, sig)  # group: the rank and its loader workers
        except ProcessLookupError:
            pass


class Aborted(Exception):
    """A second SIGINT: the ranks were killed without saving."""


class StopForwarder:
    """Passes the first stop signal on to the ranks; a second SIGINT, or the shutdown timeout, kills them."""

    def __init__(self, shutdown_timeout: float):
        self.shutdown_timeout = shutdown_timeout
        self.first: int | None = None
        self.timer: threading.Timer | None = None
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame: object) -> None:
        name = signal.Signals(signum).name
        if self.first is None:
            self.first = signum
            _say(f"{name} received: every rank finishes its step, saves a checkpoint and exits"
                 f"{' (Ctrl-C again to abort without saving)' if signum == signal.SIGINT else ''}")
            self.timer = threading.Timer(self.shutdown_timeout, self._timed_out)
            self.timer.daemon = True
            self.timer.start()
            _signal_all(signum)
        elif signum == signal.SIGINT:
            _signal_all(signal.SIGKILL, group=True)
            raise Aborted("second SIGINT: stopped at once, nothing more was saved (the last complete "
                          "checkpoint is still the one a rerun resumes from)")
        else:  # the same stop again (a scheduler and a user, or torchrun's group): already under way
            _signal_all(signum)

    def _timed_out(self) -> None:
        _say(f"the ranks did not exit within SHUTDOWN_TIMEOUT = {self.shutdown_timeout:.0f} s of the stop "
             f"signal: killing them (a checkpoint in progress is left incomplete and ignored on resume)")
        _signal_all(signal.SIGKILL, group=True)

    def close(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_DFL)


def _say(line: str) -> None:
    print(f"nsa_titan: {line}", file=sys.stderr, flush=True)


def preflight(trainer_args: list[str], world_size: int | None, job: str) -> FolderOwner:
    """Config and output folders, checked before any rank starts (raises a bad-input error); the output
    folder taken for `job` (refused, with nothing written, if another run holds it)."""
    cfg = load_config(trainer_args, world_size)[0] if world_size else parse_config(trainer_args)[0]
    source = Path(resolve_path(cfg.checkpoint.initial_load_path)) if cfg.checkpoint.initial_load_path else None
    if source is not None and source.exists():  # an adaptation's RoPE, before anything is written
        check_initial_source(source, cfg.model)
    paths = RunPaths.of(cfg)
    owner = FolderOwner.claim(paths.root, cfg.job.owner_heartbeat_seconds, cfg.job.owner_stale_seconds, job)
    try:
        make_folder(paths.root, "[job] dump_folder")
        if cfg.checkpoint.enable:
            make_folder(paths.checkpoints, "[checkpoint] folder")
    except BaseException:
        owner.release()
        raise
    return owner


def _world_size(nnodes: str, nproc: str) -> int | None:
    """nnodes x nproc_per_node when both are fixed numbers (not an elastic range, not 'gpu')."""
    return int(nnodes) * int(nproc) if nnodes.isdigit() and nproc.isdigit() else None


def failures(e: ChildFailedError) -> list[tuple[int, str]]:
    """Each failed rank's exit code and line, the failure that explains the others first.

    A rank that stopped on bad input, a non-finite step or a hang comes first; then one that failed
    with a line of its own (rank, step, cause); then ranks killed by a signal; last, ranks that
    stopped because another one failed (`failure.CONSEQUENT`). Within each, the earliest, and a rank whose source
    stayed unreadable before the ranks it told (`failure.RELAYED`). A cause that its rank was still settling (an
    async save) as the others exited comes from their notes (`failure.note`). After the first, ranks that halted
    or stopped on bad input themselves are left out: their line repeats the first's.
    """
    def code(f: Any) -> int:
        return f.exitcode if f.exitcode >= 0 else 128 - f.exitcode

    def message(f: Any) -> str:
        return f.message.split("\n")[0] if isinstance(f.message, str) and f.message.startswith("nsa_titan") else ""

    def priority(item: tuple[int, Any]) -> tuple[int, int, int]:
        f = item[1]
        rank = 3 if CONSEQUENT.match(message(f)) else 0 if code(f) in (*VERDICTS, EXIT_HANG) else 1 if message(f) else 2
        return rank, bool(RELAYED.match(message(f))), f.timestamp  # a rank's own unreadable source before the relay

    def line(rank: int, failure: Any) -> str:
        if message(failure).startswith((f"nsa_titan: rank {rank} ", "nsa_titan: data", "nsa_titan: halted")) or (
                code(failure) in VERDICTS and message(failure)):
            return message(failure)  # the rank's own one-line explanation
        detail = message(failure) or (failure.message if failure.exitcode < 0 else "")  # "Signal 9 (SIGKILL) ..."
        return f"nsa_titan: rank {rank} failed with exit code {code(failure)}" + (f": {detail}" if detail else "")

    found = dict(e.failures)
    for f in e.failures.values():
        cause = noted_cause(f.message) if isinstance(f.message, str) else None
        if cause is not None and cause.rank not in found:
            found[cause.rank] = SimpleNamespace(exitcode=cause.code, message=cause.line, timestamp=f.timestamp)
    (cause_rank, cause), *rest = sorted(found.items(), key=priority)
    # After the cause, the ranks that failed with or because of it; not those that reached a verdict of their
    # own (a halt, bad input), which would only repeat the cause's line.
    rest = [(r, f) for r, f in rest if not re.match(r"nsa_titan: (halted|\w+ error|data unavailable):", message(f))]
    return [(code(f), line(r, f)) for r, f in [(cause_rank, cause), *rest]]


def parse_launcher_args(argv: list[str] | None) -> Any:
    """torchrun's options. `--shutdown-timeout` (default 120 s) is read here and set on them: torchrun
    has that option only from torch 2.12 on, and then takes it from there."""
    own = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    own.add_argument("--shutdown-timeout", "--shutdown_timeout", type=int, default=120)
    mine, rest = own.parse_known_args(sys.argv[1:] if argv is None else argv)
    args = parse_args(rest)
    args.shutdown_timeout = mine.shutdown_timeout
    return args


def _show_owner_lines() -> None:
    """The folder owner's lines (taken over, taken back, lost) on the launcher's stderr, as its own."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("nsa_titan: %(message)s"))
    log = logging.getLogger("nsa_titan.runtime.ownership")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False


def main(argv: list[str] | None = None) -> int:
    _show_owner_lines()
    args = parse_launcher_args(argv)
    args.signals_to_handle = TORCHRUN_SIGNALS
    return run_command("nsa_titan", lambda: _launch(args))


def _launch(args: Any) -> int:
    owner = None
    if args.module and args.training_script == "nsa_titan.train":
        # The job as its ranks, their restarts and the other nodes' launchers know it (not this process
        # alone when several nodes or a Slurm requeue share the folder).
        job = job_key(None if args.standalone else f"{args.rdzv_id}@{args.rdzv_endpoint}")
        owner = preflight(list(args.training_script_args), _world_size(str(args.nnodes), str(args.nproc_per_node)),
                          job)
    set_launcher_env(owner.record.job if owner else None)
    forwarder = StopForwarder(float(args.shutdown_timeout))
    started, restarts = time.monotonic(), Restarts(int(args.max_restarts))
    try:
        with restarts_for_what_may_pass(restarts):
            run(args)
    except Aborted as e:
        _say(str(e))
        return EXIT_ABORTED
    except ChildFailedError as e:
        (code, line), *after = failures(e)
        notes = [] if code in VERDICTS else [f"{time.monotonic() - started:.0f} s after the start"]
        if restarts.allowed and restarts.held is None:
            notes.append(f"the restarts are spent: {restarts.spent} of --max-restarts {restarts.allowed}")
        print(line + (f" ({'; '.join(notes)})" if notes else ""), file=sys.stderr, flush=True)
        for _, consequence in after:  # the ranks stopped by that failure, or failing in a collective with it
            print(f"{consequence} (after the failure above)", file=sys.stderr, flush=True)
        if restarts.held is not None:
            _say(f"not restarted ({restarts.allowed - restarts.spent} of --max-restarts {restarts.allowed} left): "
                 f"{NO_RESTART[restarts.held]} (exit code {restarts.held}) would stop every restart alike; fix what "
                 f"the line above names, then the same command resumes from the last checkpoint")
        return code
    finally:
        forwarder.close()
        if owner is not None:
            owner.release()
    return 0


if __name__ == "__main__":
    leave(main())
