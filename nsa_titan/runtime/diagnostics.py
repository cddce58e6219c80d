"""Diagnostics switched on from config: missing gradients, non-finite steps, dtypes, NSA
gate/selection statistics, and profiler traces or memory snapshots of chosen steps."""

from __future__ import annotations

import logging
from collections import defaultdict
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

logger = logging.getLogger(__name__)

WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def clean_name(name: str) -> str:
    """A parameter's name without the AC / compile wrapper prefixes."""
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def missing_grads(model: nn.Module) -> list[str]:
    """Parameters with no gradient, or an all-zero one, over all shards (one collective)."""
    named = [(clean_name(n), p) for n, p in model.named_parameters()]
    device = named[0][1].device
    mass = torch.stack([_local(p.grad).abs().sum().float() if p.grad is not None else torch.zeros((), device=device)
                        for _, p in named])
    dist.all_reduce(mass)
    return [n for (n, _), m in zip(named, mass.tolist()) if m == 0]


def first_nonfinite_grad(model: nn.Module) -> str | None:
    """The first parameter (model order) whose gradient holds a NaN or inf on any rank."""
    named = [(clean_name(n), p) for n, p in model.named_parameters()]
    device = named[0][1].device
    bad = torch.stack([(~torch.isfinite(_local(p.grad))).any() if p.grad is not None
                       else torch.zeros((), dtype=torch.bool, device=device) for _, p in named]).int()
    dist.all_reduce(bad)
    hits = [n for (n, _), b in zip(named, bad.tolist()) if b]
    return hits[0] if hits else None


def dtype_report(model: nn.Module, optimizer: torch.optim.Optimizer, compute_dtype: str, reduce_dtype: str) -> str:
    """Which dtypes parameters, compute, gradients and optimizer state use, with counts."""
    params: dict[str, int] = defaultdict(int)
    grads: dict[str, int] = defaultdict(int)
    states: dict[str, int] = defaultdict(int)
    for p in model.parameters():
        params[str(p.dtype)] += p.numel()
        if p.grad is not None:
            grads[str(p.grad.dtype)] += p.numel()
    for st in optimizer.state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor) and v.numel() > 1:
                states[f"{v.dtype}"] += v.numel()
    fmt = lambda d: ", ".join(f"{k}: {v / 1e6:.2f}M" for k, v in sorted(d.items())) or "none"  # noqa: E731
    return (f"dtypes: parameters (sharded, kept) {fmt(params)} | compute {compute_dtype} | gradients {fmt(grads)} "
            f"(reduced in {reduce_dtype}) | optimizer state {fmt(states)}")


def nsa_stats(model: nn.Module, inputs: torch.Tensor, document_ids: torch.Tensor | None = None,
              tokens: torch.Tensor | None = None) -> dict[str, float]:
    """Per-layer gate and selection statistics from one no-grad forward over `inputs` (documents masked
    as in training); with `tokens` (B, T) bool, also the mean gates over those tokens alone (`*_labelled`)."""
    attns = [(i, m) for i, m in enumerate(m for m in model.modules() if hasattr(m, "record_stats"))]
    if not attns:
        return {}
    for _, m in attns:
        m.record_stats, m.stats_tokens = True, tokens
    try:
        with torch.no_grad():
            model(inputs, document_ids)
    finally:
        for _, m in attns:
            m.record_stats, m.stats_tokens = False, None
    keys = sorted(attns[0][1].stats)
    values = torch.stack([m.stats[k].float() for _, m in attns for k in keys])
    dist.all_reduce(values)
    values = (values / dist.get_world_size()).tolist()
    return {f"nsa/layer{i}/{k}": values[j * len(keys) + n] for j, (i, _) in enumerate(attns) for n, k in enumerate(keys)}


def step_profiler(step: int, profile_step: int, memory_step: int, folder: Path, rank: int,
                  device: torch.device) -> AbstractContextManager:
    """A context around one step: a profiler trace and/or a CUDA memory snapshot (into `folder`) when asked."""
    if step not in (profile_step, memory_step):
        return nullcontext()
    return _Profile(step, step == profile_step, step == memory_step, folder, rank, device)


class _Profile(AbstractContextManager):
    def __init__(self, step: int, trace: bool, memory: bool, folder: Path, rank: int, device: torch.device):
        self.step, self.folder, self.rank, self.device = step, folder, rank, device
        self.trace, self.memory = trace, memory and device.type == "cuda"
        if memory and device.type != "cuda":
            logger.warning("[debug] memory_snapshot_step: memory snapshots need a CUDA device; skipped on %s", device)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.prof = None

    def __enter__(self) -> "_Profile":
        if self.memory:
            torch.cuda.memory._record_memory_history(max_entries=100_000)
        if self.trace:
            acts = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                acts.append(torch.profiler.ProfilerActivity.CUDA)
            self.prof = torch.profiler.profile(activities=acts, record_shapes=True, profile_memory=True)
            self.prof.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.prof is not None:
            self.prof.__exit__(*exc)
            path = self.folder / f"rank{self.rank}_step{self.step}.trace.json"
            self.prof.export_chrome_trace(str(path))
            logger.info("profiler trace of step %d: %s", self.step, path)
        if self.memory:
            path = self.folder / f"rank{self.rank}_step{self.step}.memory.pickle"
            torch.cuda.memory._dump_snapshot(str(path))
            torch.cuda.memory._record_memory_history(enabled=None)
            logger.info("memory snapshot after step %d: %s", self.step, path)


def report_missing_grads(model: nn.Module) -> None:
    """The missing-params report after the first backward ([debug] report_missing_grads)."""
    names = missing_grads(model)
    if names:
        logger.warning("missing-params report: %d parameters got no gradient in the first backward: %s",
                       len(names), ", ".join(names))
    else:
        logger.info("missing-params report: none; every parameter got a gradient in the first backward")
