"""Graceful stops: SIGTERM, SIGUSR1 and SIGINT make every rank finish its step, save, and exit 0.

Schedulers preempt with SIGTERM (Kubernetes, most batch systems) or a warning signal (Slurm's
`--signal=USR1@N`); a user presses Ctrl-C. Each reaches a rank from the launcher
(`nsa_titan/launch.py`) or directly, when the scheduler signals every process of the job. The
rank only records it; the training loop reads it between steps, after an agreement among all ranks
(`StopRequest.agreed`), so every rank stops after the same step and saves the same checkpoint.
A second SIGINT, a second or more after the first, aborts at once without saving.

Loader worker processes ignore these signals (`system/signals.py`): they keep serving batches
until the rank has saved, and are shut down by their rank.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import torch
import torch.distributed as dist

from ..system.signals import STOP_SIGNALS

EXIT_ABORTED = 130
"""Exit code after a second SIGINT (as a shell reports a process ended by Ctrl-C)."""
REPEAT_S = 1.0
"""A SIGINT this soon after the first is the same Ctrl-C reaching the rank twice (from the launcher
and from the scheduler), not a second one."""


class StopRequest:
    """Owns this process's handlers for the stop signals (restored by `close`) and the agreement."""

    def __init__(self) -> None:
        self.signal: int | None = None
        self.received_at = 0.0
        self.vote: tuple[Any, torch.Tensor] | None = None
        self.previous = {sig: signal.signal(sig, self._on_signal) for sig in STOP_SIGNALS}

    @property
    def name(self) -> str:
        return signal.Signals(self.signal).name if self.signal is not None else ""

    def _on_signal(self, signum: int, frame: Any) -> None:
        now = time.monotonic()
        if self.signal is None:
            self.signal, self.received_at = signum, now
        elif signum == signal.SIGINT and self.signal == signal.SIGINT and now - self.received_at > REPEAT_S:
            if int(os.environ.get("RANK", "0")) == 0:
                os.write(2, b"nsa_titan: second SIGINT: aborted at once, nothing more was saved\n")
            os._exit(EXIT_ABORTED)

    def agreed(self, device: torch.device) -> bool:
        """Whether any rank has received a stop signal, agreed by all ranks without stalling a step.

        Each call starts a non-blocking MAX-reduction of this rank's flag and reads the one started by
        the previous call: every rank stops after the same step, at most one step after the signal.
        """
        stop = False
        if self.vote is not None:
            work, flag = self.vote
            work.wait()
            stop = bool(flag.item())
        flag = torch.tensor([0 if self.signal is None else 1], device=device)
        self.vote = (dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True), flag)
        return stop

    def finish_vote(self) -> None:
        """Wait for the agreement in flight (every rank calls this after its last step)."""
        if self.vote is not None:
            self.vote[0].wait()
            self.vote = None

    def close(self) -> None:
        """Give the signals back to their previous handlers."""
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
