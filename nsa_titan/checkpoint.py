"""Distributed checkpointing on torch.distributed.checkpoint (DCP): exact, atomic, reshardable.

Layout under `<dump_folder>/<checkpoint.folder>/`:

    step-N/                  a complete checkpoint: DCP files, config.toml, and `.complete`
    step-N.incomplete-TOKEN/ a save in progress, or one that was interrupted

A save writes into `step-N.incomplete-TOKEN`, renames it to `step-N` once every rank has
written, then writes `.complete` last: a JSON manifest of every file and its size. Only folders
with a manifest that matches the files on disk are resumed from; others are reported, and
removed only once a newer complete checkpoint exists.

What a checkpoint holds (top-level DCP keys): `model` and `optimizer` (sharded DTensors, keyed by
parameter name, so they load on any number of ranks), `lr_scheduler`, `train_state` (step,
tokens seen, data-parallel world size), and per rank `dataloader.dp_rank_R` and `rng.rank_R`.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import random
import re
import shutil
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.tensor import DTensor
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, get_model_state_dict, get_optimizer_state_dict, set_model_state_dict,
    set_optimizer_state_dict,
)

from .config import Checkpoint as CheckpointConfig

logger = logging.getLogger(__name__)

MANIFEST = ".complete"
STEP_DIR = re.compile(r"^step-(\d+)$")
PARTIAL_DIR = re.compile(r"^step-(\d+)\.incomplete-.+$")
EXPORT_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used, named, with the problem and the way out."""


@dataclass
class TrainState:
    step: int = 0
    tokens_seen: int = 0
    dp_world_size: int = 1

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step, "tokens_seen": self.tokens_seen, "dp_world_size": self.dp_world_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.tokens_seen = int(state["step"]), int(state["tokens_seen"])
        self.dp_world_size = int(state["dp_world_size"])


class ModelState:
    """The model's sharded state dict under clean parameter names (no AC / compile prefixes)."""

    def __init__(self, model: nn.Module):
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        return get_model_state_dict(self.model)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_model_state_dict(self.model, state)


class OptimizerState:
    """The optimizer's state keyed by parameter name: loads on any number of ranks."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        return get_optimizer_state_dict(self.model, self.optimizer)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_optimizer_state_dict(self.model, self.optimizer, state)


class Opaque:
    """A state kept as one pickled blob, not flattened key by key: its nested structure (the
    data loader's worker snapshots) differs between a fresh object and a saved one."""

    def __init__(self, inner: Any):
        self.inner = inner

    def state_dict(self) -> dict[str, bytes]:
        return {"pickle": pickle.dumps(self.inner.state_dict())}

    def load_state_dict(self, state: dict[str, bytes]) -> None:
        self.inner.load_state_dict(pickle.loads(state["pickle"]))


class RNGState:
    """Every generator a step may draw from: python, numpy, torch CPU and CUDA."""

    def state_dict(self) -> dict[str, Any]:
        import numpy as np

        # Generator states as bytes: a pickled tensor's bytes vary from save to save.
        state = {"python": random.getstate(), "numpy": np.random.get_state(),
                 "torch": torch.get_rng_state().numpy().tobytes()}
        if torch.cuda.is_available():
            state["cuda"] = [s.numpy().tobytes() for s in torch.cuda.get_rng_state_all()]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        import numpy as np

        random.setstate(state["python"])
        np.random.set_state(state["numpy"])
        as_tensor = lambda b: torch.frombuffer(bytearray(b), dtype=torch.uint8)  # noqa: E731
        torch.set_rng_state(as_tensor(state["torch"]))
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all([as_tensor(b) for b in state["cuda"]])


@dataclass
class Found:
    path: Path
    step: int
    problem: str | None  # None: complete and intact


def inspect_folder(path: Path) -> str | None:
    """None if `path` is a complete checkpoint whose files match its manifest, else the problem."""
    manifest = path / MANIFEST
    if not manifest.is_file():
        return "no .complete manifest: the save was interrupted"
    try:
        files = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError) as e:
        return f"unreadable manifest ({e})"
    for name, size in files.items():
        f = path / name
        if not f.is_file():
            return f"file {name} is missing"
        if f.stat().st_size != size:
            return f"file {name} is truncated or altered ({f.stat().st_size} bytes, manifest says {size})"
    return None


def scan(folder: Path) -> list[Found]:
    """Every step folder, complete or not, oldest first."""
    found = []
    for p in folder.iterdir() if folder.is_dir() else []:
        m = STEP_DIR.match(p.name) or PARTIAL_DIR.match(p.name)
        if m and p.is_dir():
            problem = inspect_folder(p) if STEP_DIR.match(p.name) else "an interrupted save (never committed)"
            found.append(Found(p, int(m.group(1)), problem))
    return sorted(found, key=lambda f: (f.step, f.problem is None))


def check_shapes(path: Path, state: dict[str, Any], prefix: str) -> None:
    """Compare every tensor under `prefix` with the checkpoint's metadata; raise a clear error."""
    meta = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    saved = {k[len(prefix) + 1:]: v.size for k, v in meta.items()
             if k.startswith(prefix + ".") and isinstance(v, TensorStorageMetadata)}
    ours = {k: tuple(v.shape) for k, v in state.items() if isinstance(v, torch.Tensor)}
    missing, extra = sorted(set(ours) - set(saved)), sorted(set(saved) - set(ours))
    wrong = [f"{k}: {tuple(saved[k])} in the checkpoint, {ours[k]} here" for k in sorted(set(ours) & set(saved))
             if tuple(saved[k]) != ours[k]]
    if missing or extra or wrong:
        detail = "; ".join(filter(None, [
            f"shapes differ: {', '.join(wrong[:4])}" if wrong else "",
            f"missing from the checkpoint: {', '.join(missing[:4])}" if missing else "",
            f"not in this model: {', '.join(extra[:4])}" if extra else "",
        ]))
        raise CheckpointError(f"checkpoint {path} does not fit this {prefix} ({detail}); it was saved by a "
                              f"different model config: use that config, or another checkpoint folder")


class _KillAfterWrite(FileSystemWriter):
    """Fault injection for tests: SIGKILL this rank once its checkpoint files are written."""

    def write_data(self, plan, planner):
        super().write_data(plan, planner).wait()
        os.kill(os.getpid(), signal.SIGKILL)


def _root_cause(error: BaseException) -> tuple[str, bool]:
    """One line for why a save failed, and whether it is an OSError (disk full, permission): that one
    if DCP's wrapped per-rank failures hold one, else the first wrapped exception."""
    todo: list[Any] = [error]
    found: list[BaseException] = []
    while todo and len(found) < 100:
        e = todo.pop(0)
        if isinstance(e, tuple):  # DCP's wrapped exception: (exception, stack summary)
            todo += [x for x in e if isinstance(x, BaseException)]
        elif isinstance(e, BaseException) and e not in found:
            found.append(e)
            if isinstance(e, OSError):
                return str(e), True
            todo += [x for x in (e.__cause__, e.__context__, *getattr(e, "failures", {}).values()) if x is not None]
    cause = found[1] if len(found) > 1 else error  # found[0] is DCP's summary of every rank's traceback
    return f"{type(cause).__name__}: {' '.join(str(cause).split())[:300]}", False


def _tensors(state: Any) -> list[torch.Tensor]:
    """Every tensor in a nested state dict."""
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for v in state.values() for t in _tensors(v)]
    if isinstance(state, (list, tuple)):
        return [t for v in state for t in _tensors(v)]
    return []


class CheckpointManager:
    """Saves and restores everything a run needs to continue exactly."""

    def __init__(self, cfg: CheckpointConfig, dump_folder: str, config_toml: str, model: nn.Module,
                 optimizer: torch.optim.Optimizer, lr_scheduler: Any, dataloader: Any, train_state: TrainState,
                 dp_rank: int, kill_in_save_step: int = 0):
        self.cfg, self.config_toml, self.model, self.optimizer = cfg, config_toml, model, optimizer
        self.folder = Path(dump_folder) / cfg.folder
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.train_state, self.dp_rank, self.kill_in_save_step = train_state, dp_rank, kill_in_save_step
        self.parts: dict[str, Any] = {
            "model": ModelState(model), "optimizer": OptimizerState(model, optimizer),
            "lr_scheduler": lr_scheduler, "train_state": train_state,
            f"dataloader.dp_rank_{dp_rank}": Opaque(dataloader), f"rng.rank_{self.rank}": Opaque(RNGState()),
        }
        # Checkpoint traffic (async writes) runs on its own gloo group: the default group may be
        # NCCL, and is busy with training collectives. None when nothing is saved or loaded.
        self.pg = dist.new_group(backend="gloo") if cfg.enable or cfg.initial_load_path else None
        token = [f"{int(time.time())}-{os.getpid()}"]
        if cfg.enable:
            dist.broadcast_object_list(token, src=0, group=self.pg)
        self.token = token[0]
        self.pending: Any = None  # the future of an async save in flight: (future, step, tmp folder)
        self.committed = threading.Event()  # rank 0: its commit of that save has finished
        self.last_saved: Path | None = None  # rank 0: the newest checkpoint committed by this run

    # ---------------------------------------------------------------- loading

    def load(self) -> Path | None:
        """Resume from the latest (or `load_step`) complete checkpoint, else the initial load.

        Returns the checkpoint a run was resumed from (step > 0 restored), else None.
        """
        target = self._resume_target() if self.cfg.enable else None
        if target is not None:
            exclude = set(self.cfg.exclude_from_loading)
            self._load(target, exclude)
            logger.info("resumed from %s at step %d%s", target, self.train_state.step,
                        f" (not restored: {', '.join(sorted(exclude))})" if exclude else "")
            return target
        if self.cfg.initial_load_path:
            self._initial_load(Path(self.cfg.initial_load_path))
        return None

    def latest(self) -> Path | None:
        """The newest complete checkpoint in the folder (this run's or an earlier one's), if any."""
        complete = [f for f in scan(self.folder) if f.problem is None] if self.cfg.enable else []
        return complete[-1].path if complete else None

    def _resume_target(self) -> Path | None:
        found = scan(self.folder)
        for f in found:
            if f.problem:
                logger.warning("checkpoint %s is not usable and is ignored: %s", f.path, f.problem)
        complete = [f for f in found if f.problem is None]
        if self.cfg.load_step >= 0:
            match = [f for f in found if f.step == self.cfg.load_step and f.path.name == f"step-{f.step}"]
            if not match:
                steps = ", ".join(str(f.step) for f in complete) or "none"
                raise CheckpointError(f"[checkpoint] load_step = {self.cfg.load_step}: there is no {self.folder}/"
                                      f"step-{self.cfg.load_step} (complete checkpoints: {steps})")
            if match[0].problem:
                raise CheckpointError(f"checkpoint {match[0].path} cannot be used: {match[0].problem}; pick another "
                                      f"with --checkpoint.load_step")
            return match[0].path
        if not complete:
            return None
        latest = complete[-1]
        newer_broken = [f for f in found if f.step > latest.step and f.path.name == f"step-{f.step}"]
        if newer_broken:  # committed but damaged since: never fall back silently
            bad = newer_broken[-1]
            raise CheckpointError(f"checkpoint {bad.path} cannot be used: {bad.problem}. Nothing was loaded or "
                                  f"overwritten; remove or repair it, or resume from step {latest.step} with "
                                  f"--checkpoint.load_step {latest.step}")
        return latest.path

    def _load(self, path: Path, exclude: set[str]) -> None:
        problem = inspect_folder(path)
        if problem:
            raise CheckpointError(f"checkpoint {path} cannot be used: {problem}")
        saved = TrainState()
        self._dcp_load({"train_state": saved}, path)
        if saved.dp_world_size != self.world_size and not exclude & {"dataloader"}:
            if not self.cfg.restart_data_on_reshard:
                raise CheckpointError(
                    f"checkpoint {path} was saved by {saved.dp_world_size} data-parallel ranks and this run has "
                    f"{self.world_size}: the model and optimizer reshard, but the data loader position cannot. "
                    f"Resume with {saved.dp_world_size} ranks, or pass --checkpoint.restart_data_on_reshard true "
                    f"to restart the data stream")
            logger.warning("checkpoint %s: %d -> %d data-parallel ranks; the data stream restarts from its "
                           "beginning (model, optimizer, schedule and step are restored)", path,
                           saved.dp_world_size, self.world_size)
            exclude = exclude | {"dataloader", "rng"}
        parts = {k: v for k, v in self.parts.items() if k.split(".")[0] not in exclude}
        if "model" in parts:
            check_shapes(path, get_model_state_dict(self.model), "model")
        self._dcp_load(parts, path)
        if "train_state" in exclude:
            self.train_state.step, self.train_state.tokens_seen = 0, 0
        self.train_state.dp_world_size = self.world_size

    def _initial_load(self, path: Path) -> None:
        """Warm start from a DCP step folder or an exported single-file state dict."""
        if path.is_file():
            try:
                state = torch.load(path, map_location="cpu", weights_only=True)
            except Exception as e:
                raise CheckpointError(f"[checkpoint] initial_load_path = '{path}' cannot be read as a "
                                      f"torch.save state dict: {e}") from None
            ours = {k: v for k, v in get_model_state_dict(self.model).items()}
            problems = [k for k in ours if k not in state or tuple(state[k].shape) != tuple(ours[k].shape)]
            if problems or set(state) - set(ours):
                raise CheckpointError(f"[checkpoint] initial_load_path = '{path}' does not fit this model "
                                      f"(first mismatches: {', '.join((problems or sorted(set(state) - set(ours)))[:4])})")
            set_model_state_dict(self.model, state, options=StateDictOptions(full_state_dict=True))
            logger.info("initial model weights from %s", path)
            return
        if not path.is_dir():
            raise CheckpointError(f"[checkpoint] initial_load_path = '{path}': no such checkpoint folder or file")
        exclude = {"optimizer", "lr_scheduler", "dataloader", "train_state", "rng"} if self.cfg.initial_load_model_only \
            else set(self.cfg.exclude_from_loading)
        self._load(path, exclude)
        logger.info("initial load from %s (%s)", path, "model only" if self.cfg.initial_load_model_only else "full")

    def _dcp_load(self, parts: dict[str, Any], path: Path) -> None:
        try:
            dcp.load(parts, checkpoint_id=str(path), process_group=self.pg)
        except Exception as e:  # DCP wraps reader errors; name the folder and the problem
            raise CheckpointError(f"checkpoint {path} cannot be loaded: {type(e).__name__}: {e}".strip()) from None

    # ----------------------------------------------------------------- saving

    def maybe_save(self, step: int, force: bool = False) -> Path | None:
        """Save at every `interval`-th step, or now when `force` (last step, preemption).

        Returns the folder the checkpoint is committed to (an async one once written), or None.
        A save that cannot be written (disk full, folder not writable) raises a CheckpointError
        naming the folder and the bytes needed; the previous checkpoints are left as they were.
        """
        if not self.cfg.enable or not (force or step % self.cfg.interval == 0):
            return None
        final = self.folder / f"step-{step}"
        if final.exists():  # e.g. the last step is also an interval step
            return final
        self.wait()  # one async save in flight at a time
        tmp = self.folder / f"step-{step}.incomplete-{self.token}"
        start = time.perf_counter()
        state = dict(self.parts)
        writer = (_KillAfterWrite(str(tmp)) if step == self.kill_in_save_step and self.rank == self.world_size - 1
                  else FileSystemWriter(str(tmp)))
        if self.cfg.async_mode == "async":
            self.committed.clear()
            future = self._guarded(step, tmp, lambda: dcp.async_save(state, storage_writer=writer,
                                                                     process_group=self.pg))
            self.pending = (future, step, tmp)
            blocked = time.perf_counter() - start
            if self.rank == 0:  # rank 0's save finishes after every rank's write: commit then
                future.add_done_callback(lambda fut: self._commit(fut, tmp, final, step, start, blocked))
        else:
            self._guarded(step, tmp, lambda: dcp.save(state, storage_writer=writer, process_group=self.pg))
            if self.rank == 0:
                self._commit(None, tmp, final, step, start, time.perf_counter() - start)
        return final

    def _guarded(self, step: int, tmp: Path, save: Any) -> Any:
        try:
            return save()
        except (Exception, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
            raise self._save_failed(step, tmp, e) from None

    def _save_failed(self, step: int, tmp: Path, error: BaseException) -> CheckpointError:
        """The error for a save that could not be written. When the disk is at fault (full, not writable),
        rank 0 removes the partial folder to give the space back; after a crashed peer it stays, as
        an interrupted save that resumes ignore."""
        cause, disk_error = _root_cause(error)
        needed = self._bytes_needed()
        try:
            free_bytes = shutil.disk_usage(self.folder).free
            if free_bytes < needed and not disk_error:  # torch.save's zip writer hides ENOSPC
                cause, disk_error = f"the disk is full ({cause})", True
            free = f"{free_bytes / 1e6:,.1f} MB free there now"
        except OSError:
            free = "free space unknown"
        if disk_error and self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        previous = [f for f in scan(self.folder) if f.problem is None]
        kept = (f"the last complete checkpoint, {previous[-1].path}, is intact and a rerun resumes from it"
                if previous else "there is no earlier checkpoint")
        return CheckpointError(f"the checkpoint of step {step} could not be written to {self.folder}: {cause}. "
                               f"It needs about {needed / 1e6:,.1f} MB ({free}). Nothing was lost: {kept}. Free "
                               f"space there, or set [checkpoint] folder or [job] dump_folder to another disk")

    def _bytes_needed(self) -> int:
        """About the size of one checkpoint: this rank's parameter and optimizer shards times the number
        of ranks (no collective: the other ranks may be gone)."""
        local = _tensors([*self.model.parameters(), *self.optimizer.state.values()])
        return sum((v.to_local() if isinstance(v, DTensor) else v).nbytes for v in local) * self.world_size

    def _commit(self, fut: Any, tmp: Path, final: Path, step: int, start: float, blocked: float) -> None:
        """Rank 0, after every rank has written: rename, then write the manifest last."""
        try:
            if fut is None or fut.exception() is None:
                self._rename_and_mark(tmp, final, step, start, blocked)
        finally:
            self.committed.set()

    def _rename_and_mark(self, tmp: Path, final: Path, step: int, start: float, blocked: float) -> None:
        (tmp / "config.toml").write_text(self.config_toml)
        files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file()}
        os.replace(tmp, final)
        manifest = final / f"{MANIFEST}.tmp"
        manifest.write_text(json.dumps({"step": step, "world_size": self.world_size, "files": files}, indent=1))
        with open(manifest) as f:
            os.fsync(f.fileno())
        os.replace(manifest, final / MANIFEST)
        self.last_saved = final
        size = sum(files.values())
        logger.info("checkpoint %s: %.1f MB in %.2f s (training blocked %.2f s, %s)", final, size / 1e6,
                    time.perf_counter() - start, blocked, "async" if self.cfg.async_mode == "async" else "sync")
        self._purge()

    def _purge(self) -> None:
        """Keep the newest `keep_latest_k` complete checkpoints; drop broken ones older than the newest."""
        found = scan(self.folder)
        complete = [f for f in found if f.problem is None]
        if not complete:
            return
        drop = complete[:-self.cfg.keep_latest_k] if self.cfg.keep_latest_k else []
        drop += [f for f in found if f.problem and f.step < complete[-1].step]
        for f in drop:
            shutil.rmtree(f.path, ignore_errors=True)
            logger.info("removed checkpoint %s%s", f.path, f" ({f.problem})" if f.problem else "")

    def wait(self) -> None:
        """Block until an async save in flight is written and committed; raise if it failed."""
        if self.pending is None:
            return
        future, step, tmp = self.pending
        self.pending = None
        error = future.exception()
        if self.rank == 0:
            self.committed.wait()
        if error is not None:
            raise self._save_failed(step, tmp, error)
        dist.barrier(group=self.pg)

    # ----------------------------------------------------------------- export

    def export(self, step: int) -> Path | None:
        """Gather the full model on rank 0 and write `model-step-N.pt` in `export_dtype`."""
        state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.rank != 0:
            return None
        dtype = EXPORT_DTYPES[self.cfg.export_dtype]
        path = self.folder / f"model-step-{step}.pt"
        self.folder.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".pt.tmp")
        torch.save({k: v.to(dtype) for k, v in state.items()}, tmp)
        os.replace(tmp, path)
        logger.info("exported the model (%s) to %s: %.1f MB", self.cfg.export_dtype, path, path.stat().st_size / 1e6)
        return path

    def close(self) -> None:
        """Finish an async save in flight (raises if it failed) and release the checkpoint group."""
        try:
            self.wait()
        finally:
            if self.pg is not None:
                dist.destroy_process_group(self.pg)
                self.pg = None
