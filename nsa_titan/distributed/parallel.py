"""Parallelism: process group, device mesh and the wrappers, in this order:

    apply_cp (context parallelism) -> apply_ac (activation checkpointing) -> apply_compile
    (torch.compile) -> apply_fsdp (fully_shard)

Each is a small function over a plain model with a `layers` ModuleDict; none knows NSA.
"""

from __future__ import annotations

import logging
import os
import warnings
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from ..config import DTYPES, Compile, Parallelism, Training
from ..system.env import set_rank_env
from .context_parallel import ContextSplit

logger = logging.getLogger(__name__)


def device_for_rank() -> torch.device:
    """The rank's device: its local GPU when CUDA is present, else the CPU."""
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def init_distributed(device: torch.device, timeout_s: float = 600.0, trace_folder: Path | None = None) -> bool:
    """Join the torchrun job (world size 1 without torchrun): NCCL on GPUs, gloo on CPU.

    On GPUs the NCCL flight recorder keeps the last collectives of each rank and dumps them to
    `trace_folder/nccl_trace_rank_<R>` when a collective times out (`env.set_rank_env`).
    Returns True when this call created the process group (and so owns its teardown).
    """
    if dist.is_initialized():
        return False
    set_rank_env(device, trace_folder)
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s),
                            device_id=device if device.type == "cuda" else None)
    return True


def side_group() -> dist.ProcessGroup:
    """A gloo group of every rank for side traffic (checkpoints), whose worker threads each run
    their tensor copies on one intra-op thread.

    A thread's first parallel op fixes its OpenMP team to the process's intra-op thread count, and
    libgomp keeps that team for the thread's life. Once more team threads are parked than there are
    cores, libgomp stops spinning at every team's barriers, so each of the main thread's short
    parallel ops sleeps and wakes through the kernel: a 1-rank CPU job trained ~35% slower after its
    first save, when the group's two worker threads had copied the save's gathered plans
    (`benchmarks/operations/save_slowdown.py`). Here each worker runs a copy large enough to go through
    OpenMP while the count is 1, so it never makes a team."""
    group = dist.new_group(backend="gloo")
    threads, world = torch.get_num_threads(), dist.get_world_size()
    if threads == 1:  # nothing to fix: torchrun's default with several ranks per node
        return group
    torch.set_num_threads(1)
    try:  # more copies in flight than the group has worker threads (2), so that each one runs one;
        # each gathers 4 MB in all, a copy that outlasts the other worker's wake-up
        x = torch.zeros(max(1, (1 << 20) // world))
        works = [dist.all_gather(list(torch.empty(world, *x.shape).unbind()), x, group=group, async_op=True)
                 for _ in range(8)]
        for work in works:
            work.wait()
    finally:
        torch.set_num_threads(threads)
    return group


def build_mesh(p: Parallelism, device: torch.device) -> DeviceMesh:
    """("dp_shard",) for FSDP, ("dp_replicate", "dp_shard") for HSDP, and a last dimension "cp"
    under context parallelism (its ranks neighbours: they talk every layer)."""
    dims = [("dp_replicate", p.data_parallel_replicate_degree)] if p.data_parallel_replicate_degree > 1 else []
    dims.append(("dp_shard", p.data_parallel_shard_degree))
    if p.context_parallel_degree > 1:
        dims.append(("cp", p.context_parallel_degree))
    return init_device_mesh(device.type, tuple(n for _, n in dims), mesh_dim_names=tuple(name for name, _ in dims))


def data_parallel_rank(mesh: DeviceMesh) -> tuple[int, int]:
    """(rank, size) of this rank among the data-parallel ranks: the cp ranks of a group share one."""
    names = mesh.mesh_dim_names
    rank, size = 0, 1
    for name in ("dp_replicate", "dp_shard"):
        if name in names:
            rank, size = rank * mesh[name].size() + mesh[name].get_local_rank(), size * mesh[name].size()
    return rank, size


def fsdp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh FSDP shards over: dp_shard x cp flattened into one dimension (the cp ranks hold
    different tokens, so they reduce gradients like data-parallel ranks), beside dp_replicate."""
    if "cp" not in mesh.mesh_dim_names:
        return mesh
    flat = mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
    if "dp_replicate" not in mesh.mesh_dim_names:
        return flat
    with warnings.catch_warnings():  # "slicing a flattened dim from root mesh will be deprecated"
        warnings.simplefilter("ignore", UserWarning)
        return mesh["dp_replicate", "dp_shard_cp"]


def apply_cp(model: nn.Module, mesh: DeviceMesh, multiple: int) -> None:
    """Split each sequence across the mesh's "cp" ranks (`context_parallel.py`): the model and its
    attention modules get the split. No-op without a "cp" dimension."""
    if "cp" not in mesh.mesh_dim_names:
        return
    cp = mesh["cp"]
    split = ContextSplit(cp.get_group(), cp.get_local_rank(), cp.size(), multiple)
    for module in model.modules():
        if hasattr(module, "cp"):
            module.cp = split


def apply_ac(model: nn.Module, layers: list[int]) -> None:
    """Wrap the blocks `layers` (`config.ac_layers`) in non-reentrant activation checkpointing."""
    for i, (name, block) in enumerate(model.layers.named_children()):
        if i in layers:
            model.layers.register_module(name, checkpoint_wrapper(block, preserve_rng_state=False))


def apply_compile(model: nn.Module, c: Compile) -> None:
    """torch.compile each block: the blocks repeat, so one compiled graph serves all."""
    if not c.enable:
        return
    for name, block in model.layers.named_children():
        model.layers.register_module(name, torch.compile(block, backend=c.backend, fullgraph=c.fullgraph))


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, t: Training, p: Parallelism) -> None:
    """fully_shard each block, then the root (embeddings, final norm, head).

    Parameters become DTensors sharded on dim 0 (replicated across `dp_replicate` for HSDP);
    compute runs in `mixed_precision_param`, gradients are reduced in `mixed_precision_reduce`.
    """
    mp = MixedPrecisionPolicy(param_dtype=DTYPES[t.mixed_precision_param],
                              reduce_dtype=DTYPES[t.mixed_precision_reduce])
    reshard = {"default": True, "always": True, "never": False}[p.fsdp_reshard_after_forward]
    for block in model.layers.values():
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
    # The root's parameters are used first in backward, so resharding them only costs time.
    fully_shard(model, mesh=mesh, mp_policy=mp,
                reshard_after_forward=p.fsdp_reshard_after_forward == "always")


def parallelize(model: nn.Module, mesh: DeviceMesh, ac_layers: list[int], c: Compile, t: Training,
                p: Parallelism, cp_multiple: int = 1) -> None:
    """CP, then AC, then compile, then FSDP: the order in which the wrappers compose."""
    apply_cp(model, mesh, cp_multiple)
    apply_ac(model, ac_layers)
    apply_compile(model, c)
    apply_fsdp(model, fsdp_mesh(mesh), t, p)
    logger.info("parallelized: AC on blocks %s, compile %s, FSDP mesh %s, params %s / reduce %s",
                _ranges(ac_layers) or "none", c.backend if c.enable else "off",
                dict(zip(mesh.mesh_dim_names, mesh.shape)), t.mixed_precision_param, t.mixed_precision_reduce)


def _ranges(layers: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    runs: list[list[int]] = []
    for i in layers:
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)
