"""Fault detection: a step watchdog, a heartbeat and collective timeouts.

A rank whose step makes no progress past its limit writes the stack of every thread (to
stderr and to `<dump_folder>/fault/rank<R>_stacks.txt`), a final heartbeat record, and exits
non-zero, so torchrun stops the whole job instead of letting it hang. A rank that was blocked
inside a collective says so: it is waiting for another rank, whose own report shows where that
rank is stuck.

Until the loop ends, the watchdog also hears of another rank's failure (`failure_channel`; a failing rank
announces itself first thing) and of the loss of the job's store (its host is gone): a rank that has made no
progress for `PEER_GRACE_S` since (blocked in a collective the failed rank never joins, as NCCL waits) says so
and exits, seconds after the cause.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import sys
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ..config import Fault
from ..system.cli import EXIT_HANG, note_failure
from ..system.jsonl import cut_torn_tail
from .failure import LOST_STORE, after_peer_code, exit_now, note, peer_words
from .failure_channel import Failure, FailureChannel

logger = logging.getLogger(__name__)

REPORT_GRACE_S = 5.0
"""After its report a stuck rank waits this long before exiting: its peers' watchdogs fire at
about the same time, and torchrun stops them all as soon as one rank exits."""
COLLECTIVE_GRACE_S = 15.0
"""A rank blocked in a collective waits longer, so that the stuck rank it waits for exits first
(and torchrun names that rank as the first failure)."""
BACKSTOP_S = 30.0
"""If the watchdog thread itself cannot run (the GIL held in C code), faulthandler dumps the
stacks and exits this much later."""
PEER_GRACE_S = 2.0
"""A rank still in the loop this long after another rank's failure (or after losing the store) leaves."""
TICK_S = 0.5
"""How often the watchdog looks (at most; a twentieth of a short limit)."""


class Heartbeat:
    """One JSON line per step in `<folder>/rank<R>.jsonl` (the run's heartbeat folder); flushed each time. A write that
    fails (a full disk) is one warning, the first, not a stop: the records go on when the disk takes them."""

    def __init__(self, folder: Path, rank: int):
        path = folder / f"rank{rank}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        if cut := cut_torn_tail(path):  # the last run's torn write: the next record would join it
            logger.warning("%s: its incomplete last line (%d bytes, a write cut short) was dropped", path, cut)
        self.file = path.open("a")
        self.lock = threading.Lock()
        self.warned = False

    def write(self, **record: Any) -> None:
        with self.lock:
            try:
                self.file.write(json.dumps({"time": round(time.time(), 3), **record}) + "\n")
                self.file.flush()
            except OSError as e:
                if not self.warned:
                    self.warned = True
                    logger.warning("heartbeat %s could not be written (%s): training goes on, and so do its records "
                                   "when the disk takes them", self.file.name, e)

    def close(self) -> None:
        self.file.close()


def _in_collective(frame: Any) -> str | None:
    """The torch.distributed function the main thread is blocked in, if any."""
    for f, _ in traceback.walk_stack(frame):
        path = f.f_code.co_filename.replace(os.sep, "/")
        if "/torch/distributed/" in path:
            return f"{f.f_code.co_name} ({path.split('/torch/')[-1]}:{f.f_lineno})"
    return None


class StepWatchdog:
    """A thread that fires when no `beat()` came for longer than the current limit."""

    def __init__(self, cfg: Fault, folder: Path, rank: int, heartbeat: Heartbeat | None):
        """`folder`: where the stack dumps go (the run's fault folder)."""
        self.cfg, self.rank, self.heartbeat = cfg, rank, heartbeat
        folder.mkdir(parents=True, exist_ok=True)
        self.stack_path = folder / f"rank{rank}_stacks.txt"
        self.backstop_file = (folder / f"rank{rank}_stacks_backstop.txt").open("w")
        self.main_thread = threading.main_thread().ident
        self.step, self.what, self.limit = 0, "start-up", cfg.first_step_timeout_seconds
        self.last = time.monotonic()
        self.fired = False
        self.watching_peers = True  # from start-up to the loop's end: another rank's failure ends this rank
        self.channel: FailureChannel | None = None
        self.peer_failure: Failure | None = None  # another rank's failure, or LOST_STORE, as heard
        self.peer_seen = 0.0  # when it was heard
        self.stopped = threading.Event()
        self._arm_backstop()
        self.thread = threading.Thread(target=self._run, name="nsa_titan-watchdog", daemon=True)
        self.thread.start()

    def beat(self, step: int, what: str, first_step_done: bool) -> None:
        """Progress: now working on `what` of `step`, under the limit for its phase."""
        self.step, self.what, self.last = step, what, time.monotonic()
        self.limit = self.cfg.step_timeout_seconds if first_step_done else self.cfg.first_step_timeout_seconds
        self.fired = False
        self._arm_backstop()

    def watch_peers(self, on: bool) -> None:
        """Whether another rank's failure ends this rank: from start-up (once the process group is up) to the
        loop's end or this rank's own failure; not while it closes (a rank done first may have left)."""
        self.watching_peers = on

    def listen(self, channel: FailureChannel | None) -> None:
        """Hear of the job's failures through `channel` (None: alone in the job)."""
        self.channel = channel
        if channel is not None:
            channel.listen(self._heard)

    def _heard(self, failure: Failure | None) -> None:
        if failure is None or failure.rank != self.rank:
            self.peer_failure, self.peer_seen = failure or LOST_STORE, time.monotonic()

    def _arm_backstop(self) -> None:
        faulthandler.dump_traceback_later(self.limit + BACKSTOP_S, exit=self.cfg.action == "exit",
                                          file=self.backstop_file)

    def _run(self) -> None:
        while not self.stopped.wait(min(TICK_S, self.limit / 20)):
            waited = time.monotonic() - self.last
            if waited > self.limit and not self.fired:
                self.fired = True
                self._fire(waited)
            if self.watching_peers and self.peer_failure is not None:
                self._check_peers(self.peer_failure)

    def _check_peers(self, cause: Failure) -> None:
        """Leave, with the cause's exit code where no restart may follow it, once this rank has made no progress
        for PEER_GRACE_S since it heard of `cause`."""
        if time.monotonic() - max(self.peer_seen, self.last) < PEER_GRACE_S:
            return
        line = f"nsa_titan: rank {self.rank} stopped in {self.what} of step {self.step} after {peer_words(cause)}"
        logging.getLogger("nsa_titan").error("%s", line.removeprefix("nsa_titan: "))
        note_failure(note(line, cause if cause.rank >= 0 else None))
        exit_now(after_peer_code(cause))

    def _fire(self, waited: float) -> None:
        frame = sys._current_frames().get(self.main_thread)
        collective = _in_collective(frame) if frame is not None else None
        note = (f"It was blocked in a collective, {collective}: it is waiting for another rank, whose own "
                f"report shows where that rank is stuck." if collective else
                "It was not inside a collective: this rank itself is stuck (see the main thread's stack).")
        message = (f"nsa_titan watchdog: rank {self.rank} made no progress for {waited:.0f} s in {self.what} of "
                   f"step {self.step} (limit {self.limit:.0f} s). {note} Stacks of all threads: {self.stack_path}")
        with self.stack_path.open("w") as f:
            f.write(message + "\n\n")
            f.flush()
            faulthandler.dump_traceback(f, all_threads=True)
        print(message, file=sys.stderr, flush=True)
        faulthandler.dump_traceback(sys.stderr, all_threads=True)
        note_failure(message)
        if self.heartbeat is not None:
            self.heartbeat.write(event="hang", step=self.step, phase=self.what, waited_s=round(waited, 1),
                                 in_collective=collective, stacks=str(self.stack_path))
        if self.cfg.action == "exit":
            time.sleep(COLLECTIVE_GRACE_S if collective else REPORT_GRACE_S)
            if not collective and self.channel is not None:  # this rank is the stuck one: the others need not
                self.channel.announce(Failure(self.rank, EXIT_HANG, message))  # wait for their own limits
            os._exit(EXIT_HANG)

    def stop(self) -> None:
        """End the watchdog and its listener (before the interpreter's teardown)."""
        if self.channel is not None:
            self.channel.close()
        self.stopped.set()
        faulthandler.cancel_dump_traceback_later()
        self.backstop_file.close()


def set_collective_timeout(seconds: float) -> None:
    """The timeout of every process group this rank belongs to (as torchtitan does after step 1)."""
    from torch.distributed.distributed_c10d import _set_pg_timeout

    for group in [dist.group.WORLD, *dist.distributed_c10d._world.pg_map]:
        try:
            _set_pg_timeout(timedelta(seconds=seconds), group)
        except (RuntimeError, ValueError) as e:  # a backend that cannot change it
            logger.debug("could not set the timeout of %s: %s", group, e)
