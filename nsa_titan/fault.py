"""Fault detection: a step watchdog, a heartbeat and collective timeouts.

A rank whose step makes no progress past its limit writes the stack of every thread (to
stderr and to `<dump_folder>/fault/rank<R>_stacks.txt`), a final heartbeat record, and exits
non-zero, so torchrun stops the whole job instead of letting it hang. A rank that was blocked
inside a collective says so: it is waiting for another rank, whose own report shows where that
rank is stuck.
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

from .cli import note_failure
from .config import Fault

logger = logging.getLogger(__name__)

EXIT_HANG = 124
"""Exit code of a rank stopped by the watchdog (as timeout(1) uses)."""
REPORT_GRACE_S = 5.0
"""After its report a stuck rank waits this long before exiting: its peers' watchdogs fire at
about the same time, and torchrun stops them all as soon as one rank exits."""
COLLECTIVE_GRACE_S = 15.0
"""A rank blocked in a collective waits longer, so that the stuck rank it waits for exits first
(and torchrun names that rank as the first failure)."""
BACKSTOP_S = 30.0
"""If the watchdog thread itself cannot run (the GIL held in C code), faulthandler dumps the
stacks and exits this much later."""


class Heartbeat:
    """One JSON line per step in `<folder>/rank<R>.jsonl` (the run's heartbeat folder); flushed each time."""

    def __init__(self, folder: Path, rank: int):
        path = folder / f"rank{rank}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = path.open("a")
        self.lock = threading.Lock()

    def write(self, **record: Any) -> None:
        with self.lock:
            self.file.write(json.dumps({"time": round(time.time(), 3), **record}) + "\n")
            self.file.flush()

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

    def _arm_backstop(self) -> None:
        faulthandler.dump_traceback_later(self.limit + BACKSTOP_S, exit=self.cfg.action == "exit",
                                          file=self.backstop_file)

    def _run(self) -> None:
        while not self.stopped.wait(min(1.0, self.limit / 20)):
            waited = time.monotonic() - self.last
            if waited > self.limit and not self.fired:
                self.fired = True
                self._fire(waited)

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
            os._exit(EXIT_HANG)

    def stop(self) -> None:
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
