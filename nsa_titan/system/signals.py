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
LAUNCHER = "NSA_TITAN_LAUNCHER"
"""The variable in which `nsa_titan.launch` gives its ranks its pid (`env.LAUNCHED_BY`)."""
STARTED_BY = os.getppid()
"""This process's parent when the package was first imported (`nsa_titan/__init__.py` imports this module before
torch): the launcher of a rank that torchrun, called directly, started."""


def ignore_stop_signals(worker_id: int = 0) -> None:
    """Ignore the stop signals in this process (a loader worker: its rank decides when it stops)."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def die_with_parent(parent: int) -> None:
    """Have Linux SIGKILL this process when its parent dies, and exit now, non-zero, if the parent, `parent`'s pid,
    is already gone (it died before the request took effect, and this process was handed to a reaper). Compared
    with the pid that started it, never with 1: a container's launcher is PID 1, and its ranks' parent is 1 while it
    lives; and never exit 0, which a launcher would count as a rank that did its work. Nothing elsewhere: no
    parent-death signal outside Linux."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (AttributeError, OSError):
        return
    if os.getppid() != parent:
        os.write(2, f"nsa_titan: process {os.getpid()}: its parent {parent} is gone; exiting\n".encode())
        os._exit(1)


def end_with_launcher() -> None:
    """A rank under torchrun dies with its launcher (`die_with_parent`): a launcher killed with SIGKILL, or a
    crashed agent, would otherwise leave its ranks training on, holding their devices, beside the rerun. The
    launcher is the pid `nsa_titan.launch` gave, else (torchrun called directly) the parent at start-up."""
    if "TORCHELASTIC_RESTART_COUNT" in os.environ:
        die_with_parent(int(os.environ.get(LAUNCHER) or STARTED_BY))
