"""Fault injection for tests, installed from `[debug]` and nowhere else: the trainer and the
checkpoint manager know nothing of it. Each hook uses a public seam of the object it changes
(module and optimizer hooks, the checkpoint manager's storage writer).

  fault_hang_rank / fault_hang_step / fault_hang_where  a rank sleeps forever in the forward pass
                                                        or the optimizer step (the watchdog's test)
  fault_nan_step                                        rank 0's logits, and so its loss, become NaN
  fault_kill_in_save_step                               the last rank SIGKILLs itself once its files
                                                        of that step's checkpoint are written
  fault_fail_commit_step                                that step's save folder vanishes once written
                                                        (rank 0), so that its commit fails
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn as nn
from .checkpoint import CheckpointManager
from .checkpoint.integrity import HashingWriter
from .config import Debug


def _hang_forever(where: str, rank: int, step: int) -> None:
    """Never return (the watchdog must find this frame)."""
    print(f"fault injection: rank {rank} hangs in the {where} of step {step}", file=sys.stderr, flush=True)
    while True:
        time.sleep(3600)


class _KillAfterWrite(HashingWriter):
    """SIGKILL this rank once its checkpoint files are written."""

    def write_data(self, plan, planner):
        super().write_data(plan, planner).wait()
        os.kill(os.getpid(), signal.SIGKILL)


class _VanishBeforeCommit(HashingWriter):
    """Remove the save's folder once every rank has written it (rank 0, DCP's coordinator): its commit fails."""

    def finish(self, metadata, results):
        super().finish(metadata, results)
        shutil.rmtree(self.path)


def install_debug_hooks(d: Debug, *, model: nn.Module, optimizer: torch.optim.Optimizer,
                        checkpointer: CheckpointManager, rank: int, world_size: int,
                        current_step: Callable[[], int]) -> None:
    """Install the hooks the `[debug] fault_*` keys ask for (none by default)."""
    if rank == d.fault_hang_rank and d.fault_hang_step > 0:
        if d.fault_hang_where == "forward":
            next(iter(model.layers.values())).register_forward_pre_hook(
                lambda module, args: _hang_forever("forward", rank, current_step())
                if current_step() == d.fault_hang_step and torch.is_grad_enabled() else None)
        else:
            optimizer.register_step_pre_hook(
                lambda opt, args, kwargs: _hang_forever("optimizer step", rank, current_step())
                if current_step() == d.fault_hang_step else None)
    if rank == 0 and d.fault_nan_step > 0:
        model.register_forward_hook(
            lambda module, args, out: out * float("nan")
            if current_step() == d.fault_nan_step and torch.is_grad_enabled() else None)
    if rank == world_size - 1 and d.fault_kill_in_save_step > 0:
        plain = checkpointer.storage_writer

        def writer(path: Path, step: int) -> HashingWriter:
            return _KillAfterWrite(str(path)) if step == d.fault_kill_in_save_step else plain(path, step)

        checkpointer.storage_writer = writer
    if rank == 0 and d.fault_fail_commit_step > 0:
        plain_writer = checkpointer.storage_writer

        def vanishing(path: Path, step: int) -> HashingWriter:
            return _VanishBeforeCommit(str(path)) if step == d.fault_fail_commit_step else plain_writer(path, step)

        checkpointer.storage_writer = vanishing
