"""The process's signals: which ones ask a run to stop, a loader worker's deafness to them, and Linux's
parent-death signal, which ends a process with the one that started it (a rank with its launcher, a loader
worker with its rank)."""

from __future__ import annotations

import ctypes
import os
import signal

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
"""The signals that ask a run to stop gracefully (`runtime/stop.py`): a scheduler's, a user's Ctrl-C."""
PR_SET_PDEATHSIG = 1
"""prctl's option (linux/prctl.h): the signal this process gets when its parent dies."""


def ignore_stop_signals(worker_id: int = 0) -> None:
    """Ignore the stop signals in this process (a loader worker: its rank decides when it stops)."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def die_with_parent() -> None:
    """Have Linux SIGKILL this process when its parent dies, and exit now if the parent is already gone (it
    died before the request took effect). Nothing elsewhere: no parent-death signal outside Linux."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (AttributeError, OSError):
        return
    if os.getppid() == 1:
        os._exit(0)


def end_with_launcher() -> None:
    """A rank under torchrun dies with its launcher (`die_with_parent`): a launcher killed with SIGKILL, or a
    crashed agent, would otherwise leave its ranks training on, holding their devices, beside the rerun."""
    if "TORCHELASTIC_RESTART_COUNT" in os.environ:
        die_with_parent()
