"""Fault injection for tests, installed from `[debug]` and nowhere else: the trainer and the
checkpoint manager know nothing of it. Each hook uses a public seam of the object it changes
(module and optimizer hooks, the checkpoint manager's storage writer).

  fault_hang_rank / fault_hang_step / fault_hang_where  a rank sleeps forever in the forward pass
                                                        or the optimizer step (the watchdog's test)
  fault_nan_step                                        rank 0's logits, and so its loss, become NaN
  fault_spike_step                                      every rank's logits are scaled by 30 (a loss spike),
                                                        the first time the run reaches that step; with
                                                        fault_spike_lasting at it and every step after
  fault_kill_in_save_step                               the last rank SIGKILLs itself once its files
                                                        of that step's checkpoint are written
  fault_fail_commit_step                                that step's save folder vanishes once written
                                                        (rank 0), so that its commit fails
  fault_save_delay_seconds                              every rank's checkpoint writes start that much later
  fault_raise_rank / fault_raise_step / fault_raise_where / fault_raise_attempts
                                                        a rank raises at that step, in the first
                                                        fault_raise_attempts of torchrun's (1: the first only;
                                                        0: all): a loader worker on the step's batch
                                                        (`data`), the forward runs out of memory
                                                        (`forward`), the heartbeat's write finds the disk
                                                        full (`write`)

  fault_kernel                                          a wrong kernel for the startup check (`kernel_fault`):
                                                        a family's branch or gradient, or a decoding step,
                                                        scaled by 1.5; or a slow family or decoding step
                                                        for `auto`'s measurement (`kernel_timing`): each
                                                        call 0.25 s late

A loader worker killed as the out-of-memory killer does needs no hook: `kill -9` its pid.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from torch.utils.data import get_worker_info
from torchdata.stateful_dataloader import StatefulDataLoader

from ..checkpoint import CheckpointManager
from ..checkpoint.integrity import HashingWriter
from ..config import Debug
from ..models.attention import BRANCHES, Documents, Family, NSASpec
from ..models.decode import Decoder
from .kernel_check import INPUTS, DecoderWrap, Wrap
from .watchdog import Heartbeat

KERNEL_FAULT_SCALE = 1.5
"""What `[debug] fault_kernel` multiplies: a branch's output, a gradient, a decoding step's output."""
KERNEL_FAULT_DELAY_S = 0.25
"""How late `[debug] fault_kernel = 'FAMILY:slow'` makes each of the family's calls."""


def _hang_forever(where: str, rank: int, step: int) -> None:
    """Never return (the watchdog must find this frame)."""
    _say(f"rank {rank} hangs in the {where} of step {step}")
    while True:
        time.sleep(3600)


def _say(line: str) -> None:
    print(f"fault injection: {line}", file=sys.stderr, flush=True)


class _CorruptBatch:
    """The loader's collate_fn, raising in the worker that makes batch `index` of the run (the workers take
    the batches in turn, counted from the run's first)."""

    def __init__(self, collate: Callable, index: int, rank: int, step: int):
        self.collate, self.index, self.rank, self.step, self.made = collate, index, rank, step, 0

    def __call__(self, samples: list) -> object:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        index, self.made = self.made * workers + worker, self.made + 1
        if index == self.index:
            _say(f"rank {self.rank}'s loader worker {worker} raises on the batch of step {self.step}")
            raise ValueError(f"a corrupt document in the batch of step {self.step} (fault injection)")
        return self.collate(samples)


def _raise_out_of_memory(rank: int, step: int) -> None:
    _say(f"rank {rank} runs out of memory in the forward of step {step}")
    raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate 2.00 GiB (fault injection at step {step})")


class _FullDisk:
    """A heartbeat's file on which the record of `step` finds the disk full."""

    def __init__(self, file: Any, rank: int, step: int):
        self.plain, self.name, self.rank, self.step = file, file.name, rank, step

    def write(self, text: str) -> int:
        if json.loads(text).get("step") == self.step:
            _say(f"rank {self.rank}'s heartbeat write of step {self.step} fails")
            raise OSError(errno.ENOSPC, "No space left on device (fault injection)", self.name)
        return self.plain.write(text)

    def flush(self) -> None:
        self.plain.flush()

    def close(self) -> None:
        self.plain.close()


def _failing_write(heartbeat: Heartbeat, rank: int, step: int) -> None:
    """The heartbeat's record of `step` finds the disk full."""
    heartbeat.file = _FullDisk(heartbeat.file, rank, step)


def _install_raise(d: Debug, model: nn.Module, dataloader: StatefulDataLoader, heartbeat: Heartbeat | None,
                   rank: int, current_step: Callable[[], int], batches_per_step: int) -> None:
    """The `fault_raise_*` fault, in the first `fault_raise_attempts` of torchrun's attempts (0: all)."""
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if rank != d.fault_raise_rank or d.fault_raise_step <= 0 or 0 < d.fault_raise_attempts <= attempt:
        return
    step = d.fault_raise_step
    if d.fault_raise_where == "data":
        dataloader.collate_fn = _CorruptBatch(dataloader.collate_fn, (step - 1) * batches_per_step, rank, step)
    elif d.fault_raise_where == "forward":
        next(iter(model.layers.values())).register_forward_pre_hook(
            lambda module, args: _raise_out_of_memory(rank, step)
            if current_step() == step and torch.is_grad_enabled() else None)
    elif heartbeat is not None:
        _failing_write(heartbeat, rank, step)


class _KillAfterWrite(HashingWriter):
    """SIGKILL this rank once its checkpoint files are written."""

    def write_data(self, plan, planner):
        super().write_data(plan, planner).wait()
        os.kill(os.getpid(), signal.SIGKILL)


class _SlowWriter(HashingWriter):
    """Start writing this rank's checkpoint files `delay` seconds late (a slow filesystem)."""

    def __init__(self, path: str, delay: float, hash_files: bool):
        super().__init__(path, hash_files=hash_files)
        self.delay = delay

    def write_data(self, plan, planner):
        time.sleep(self.delay)
        return super().write_data(plan, planner)


class _VanishBeforeCommit(HashingWriter):
    """Remove the save's folder once every rank has written it (rank 0, DCP's coordinator): its commit fails."""

    def finish(self, metadata, results):
        super().finish(metadata, results)
        shutil.rmtree(self.path)


def install_faults(d: Debug, *, model: nn.Module, optimizer: torch.optim.Optimizer,
                   checkpointer: CheckpointManager, dataloader: StatefulDataLoader, heartbeat: Heartbeat | None,
                   rank: int, world_size: int, current_step: Callable[[], int], batches_per_step: int) -> None:
    """Install the hooks the `[debug] fault_*` keys ask for (none by default), before the loader's workers start."""
    _install_raise(d, model, dataloader, heartbeat, rank, current_step, batches_per_step)
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
    if d.fault_spike_step > 0:
        fired: list[int] = []  # once: a rolled-back run reaches that step again, on other batches

        def spike(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor | None:
            once = current_step() != d.fault_spike_step or len(fired) >= batches_per_step
            if not torch.is_grad_enabled() or (current_step() < d.fault_spike_step if d.fault_spike_lasting else once):
                return None
            fired.append(1)
            return out * 30.0

        model.register_forward_hook(spike)
    if rank == world_size - 1 and d.fault_kill_in_save_step > 0:
        plain = checkpointer.storage_writer

        def writer(path: Path, step: int) -> HashingWriter:
            return _KillAfterWrite(str(path)) if step == d.fault_kill_in_save_step else plain(path, step)

        checkpointer.storage_writer = writer
    if d.fault_save_delay_seconds > 0:
        checkpointer.storage_writer = lambda path, step: _SlowWriter(str(path), d.fault_save_delay_seconds,
                                                                     checkpointer.cfg.content_hashes)
    if rank == 0 and d.fault_fail_commit_step > 0:
        plain_writer = checkpointer.storage_writer

        def vanishing(path: Path, step: int) -> HashingWriter:
            return _VanishBeforeCommit(str(path)) if step == d.fault_fail_commit_step else plain_writer(path, step)

        checkpointer.storage_writer = vanishing


class _ScaledGrad(torch.autograd.Function):
    """The identity, whose gradient is scaled by KERNEL_FAULT_SCALE."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad * KERNEL_FAULT_SCALE


class _FaultyFamily(Family):
    """`inner` with one branch's output (`part`: cmp, sel, win) or one gradient (d + an input's name) scaled, or (`part`
    slow) each call late."""

    def __init__(self, inner: Family, part: str):
        self.inner, self.part = inner, part
        self.name, self.label = inner.name, f"{inner.label}, with [debug] fault_kernel = '{inner.name}:{part}'"
        self.score_kernel, self.win_flash = inner.score_kernel, inner.win_flash

    def attend(self, q: torch.Tensor, k_cmp: torch.Tensor, v_cmp: torch.Tensor, k_sel: torch.Tensor,
               v_sel: torch.Tensor, k_win: torch.Tensor, v_win: torch.Tensor, gates: torch.Tensor, spec: NSASpec,
               docs: Documents | None, q0: int, branches: tuple[bool, bool, bool]
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        inputs = [q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates]
        if self.part == "slow":
            time.sleep(KERNEL_FAULT_DELAY_S)
            return self.inner.attend(*inputs, spec, docs, q0, branches)
        if self.part in BRANCHES:
            o, idx, valid = self.inner.attend(*inputs, spec, docs, q0, branches)
            alone = tuple(b == self.part for b in BRANCHES)
            extra, _, _ = self.inner.attend(*inputs, spec, docs, q0, alone)
            return o + (KERNEL_FAULT_SCALE - 1) * extra, idx, valid
        i = INPUTS.index(self.part.removeprefix("d"))
        inputs[i] = _ScaledGrad.apply(inputs[i])
        return self.inner.attend(*inputs, spec, docs, q0, branches)


class _FamilyFault:
    """`[debug] fault_kernel = FAMILY:PART`: wraps that family (others as they are); `label` keys its verdict."""

    def __init__(self, label: str):
        self.label = label
        self.family, self.part = label.split(":")

    def __call__(self, family: Family) -> Family:
        if family.name != self.family:
            return family
        _say(f"the {self.family} family's calls are {KERNEL_FAULT_DELAY_S} s late" if self.part == "slow" else
             f"the {self.family} family's {self.part} is scaled by {KERNEL_FAULT_SCALE}")
        return _FaultyFamily(family, self.part)


class _DecodeFault:
    """`[debug] fault_kernel = decode:KERNEL[:slow]`: that decoding step's output scaled (or each step late), in the
    decoder given, when it runs that kernel."""

    def __init__(self, label: str):
        self.label, self.kernel = label, label.split(":")[1]
        self.slow = label.endswith(":slow")

    def __call__(self, decoder: Decoder) -> None:
        if decoder.kernel == self.kernel:
            real = decoder.steps[self.kernel]
            if self.slow:
                _say(f"the {self.kernel} decoding step is {KERNEL_FAULT_DELAY_S} s late")
                decoder.steps = {**decoder.steps, self.kernel: lambda *args: time.sleep(KERNEL_FAULT_DELAY_S) or
                                 real(*args)}
                return
            _say(f"the {self.kernel} decoding step's output is scaled by {KERNEL_FAULT_SCALE}")
            decoder.steps = {**decoder.steps, self.kernel: lambda *args: real(*args) * KERNEL_FAULT_SCALE}


def kernel_fault(d: Debug) -> tuple[Wrap | None, DecoderWrap | None]:
    """The wrappers of `[debug] fault_kernel` for the kernel checks (`kernel_check`), of a family and of a decoder;
    None for what it leaves alone."""
    if not d.fault_kernel:
        return None, None
    if d.fault_kernel.startswith("decode:"):
        return None, _DecodeFault(d.fault_kernel)
    return _FamilyFault(d.fault_kernel), None
