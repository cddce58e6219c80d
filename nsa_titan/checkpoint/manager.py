"""The checkpoint manager: saves a run (sync or async) and resumes it exactly.

A save writes into `step-N.incomplete-TOKEN`; once every rank has written, rank 0 adds the `.complete` manifest
and renames the folder to `step-N`, last (`folders.py`). Only folders with a manifest that matches the files on
disk are resumed from; others are reported, and removed only once a newer complete checkpoint exists.

What a checkpoint holds (top-level DCP keys): `model` and `optimizer` (sharded DTensors, keyed by parameter name,
so they load on any number of ranks), `lr_scheduler`, `train_state` (step, tokens seen, data-parallel world
size), and per rank `dataloader.dp_rank_R` (its position and the run's records: `RunPart`) and `rng.rank_R`.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import threading
import time
import tomllib
from pathlib import Path
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.tensor import DTensor

from ..config import Checkpoint as CheckpointConfig
from ..distributed.parallel import side_group
from ..models.rope import describe, rope_of
from .errors import CheckpointError, root_cause
from .check import FolderCheck
from .folders import commit, inspect_folder, scan, set_aside
from .hf_folder import check_initial_source, check_settings, is_hf_folder, read_hf_folder
from .integrity import HashingWriter
from .model_file import check_fit, read_model_file, saved_shapes, shapes
from .states import FixedState, ModelState, Opaque, OptimizerState, RNGState, RunPart, TrainState

logger = logging.getLogger(__name__)

def _tensors(state: Any) -> list[torch.Tensor]:
    """Every tensor in a nested state dict."""
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for v in state.values() for t in _tensors(v)]
    if isinstance(state, (list, tuple)):
        return [t for v in state for t in _tensors(v)]
    return []


def folder_check(cfg: CheckpointConfig, folder: Path) -> FolderCheck:
    """The checks of a run's checkpoint folder on every rank. Checkpoint traffic (async writes) runs on its own gloo
    group: the default group may be NCCL, and is busy with training collectives (none when nothing is saved or
    loaded)."""
    group = side_group() if cfg.enable or cfg.initial_load_path else None
    return FolderCheck(cfg, folder, dist.get_rank(), dist.get_world_size(), group)


class CheckpointManager:
    """Saves and restores everything a run needs to continue exactly."""

    def __init__(self, cfg: CheckpointConfig, *, folder: Path, config_toml: str, model: nn.Module,
                 optimizer: torch.optim.Optimizer, lr_scheduler: Any, dataloader: Any, train_state: TrainState,
                 dp_rank: int, dp_world_size: int | None = None, other_owner: Callable[[], str | None] | None = None,
                 records: dict[str, Any] | None = None, check: FolderCheck | None = None, kernels: str | None = None):
        """`folder`: where step folders go; `config_toml`: the run's config, saved in each of them;
        `dp_rank` of `dp_world_size` (default: the world size): the data-parallel rank, whose data
        loader position is saved (the context-parallel ranks of a group share one); `other_owner`: who
        holds the output folder if another run does (asked before each commit: nothing is committed then);
        `records`: the run's records saved with the data position (`RunPart`), restored on resume, not on rollback;
        `check`: the run's `folder_check` (asked for the resume target before the model was built), else made here;
        `kernels`: the NSA kernel family the run trains with, recorded in each manifest."""
        self.cfg, self.config_toml, self.model, self.optimizer = cfg, config_toml, model, optimizer
        self.kernels = kernels
        self.folder, self.other_owner = folder, other_owner
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.dp_world_size = dp_world_size or self.world_size
        self.train_state, self.dp_rank, self.dataloader, self.records = train_state, dp_rank, dataloader, records
        self.parts: dict[str, Any] = {
            "model": ModelState(model), "optimizer": OptimizerState(model, optimizer),
            "lr_scheduler": lr_scheduler, "train_state": train_state,
            f"dataloader.dp_rank_{dp_rank}": Opaque(RunPart(dataloader, records)),
            f"rng.rank_{self.rank}": Opaque(RNGState()),
        }
        self.check = check or folder_check(cfg, folder)
        self.pg = self.check.pg
        token = [f"{int(time.time())}-{os.getpid()}"]
        if cfg.enable:
            dist.broadcast_object_list(token, src=0, group=self.pg)
        self.token = token[0]
        self.pending: Any = None  # the future of an async save in flight: (future, step, tmp folder)
        self.committed = threading.Event()  # rank 0: its commit of that save has finished
        self.commit_error: str | None = None  # rank 0: why its commit of the save in flight failed
        self.last_saved: Path | None = None  # rank 0: the newest checkpoint committed by this run
        self.failure: tuple[int, str] | None = None  # the step and cause, if the latest save failed
        self.saved_step: int | None = None  # every rank: the step of the latest save this run committed
        self.resumed_from: Path | None = None

    # ---------------------------------------------------------------- loading

    def load(self) -> Path | None:
        """Resume from the latest (or `load_step`) complete checkpoint, else the initial load. Returns the
        checkpoint a run was resumed from (step > 0 restored), else None."""
        target = self.check.resume_target() if self.cfg.enable else None
        if target is not None:
            exclude = set(self.cfg.exclude_from_loading)
            start = time.perf_counter()
            self._load(target, exclude)
            logger.info("resumed from %s at step %d%s in %.2f s", target, self.train_state.step,
                        f" (not restored: {', '.join(sorted(exclude))})" if exclude else "", time.perf_counter() - start)
            self.resumed_from = target
        elif self.cfg.initial_load_path:
            self._initial_load(Path(self.cfg.initial_load_path))
        if self.cfg.enable:
            self._own_steps_after(self.train_state.step)
        return target

    def _own_steps_after(self, step: int) -> None:
        """The steps after `step` are this run's: step folders of an earlier run beyond it are set aside
        (renamed `step-N.superseded-TIME`, never read, kept or purged), so that none is skipped over,
        kept or resumed as this run's."""
        if self.rank == 0:
            newer = [f.path for f in scan(self.folder) if f.step > step and f.path.name == f"step-{f.step}"]
            if newer:
                moved = [set_aside(p) for p in newer]
                logger.warning("this run continues from step %d: %d later checkpoint(s) of an earlier run set aside, "
                               "not used or removed: %s", step, len(moved), ", ".join(str(p) for p in moved))
        dist.barrier(group=self.pg)

    def roll_back(self, before: int, records: dict[str, Any]) -> Path | None:
        """Reload the newest complete checkpoint of a step before `before` (model, optimizer, schedule, train state,
        RNG, and of the run's records those in `records`), not the data position, which goes on; the step folders
        after it are set aside. None if there is none."""
        self.wait()  # an async save in flight is the newest
        target = self.latest(before)
        if target is not None:
            self._load(target, {"dataloader"})
            self._dcp_load({"dataloader.dp_rank_0": Opaque(RunPart(None, records))}, target)  # any rank's: alike
            self._own_steps_after(self.train_state.step)
        return target

    def latest(self, before: int | None = None) -> Path | None:
        """The newest complete checkpoint in the folder (this run's or an earlier one's; before `before`), if any."""
        complete = [f for f in scan(self.folder) if f.problem is None and (before is None or f.step < before)] \
            if self.cfg.enable else []
        return complete[-1].path if complete else None

    def _load(self, path: Path, exclude: set[str], initial: bool = False) -> None:
        problem = inspect_folder(path)
        if problem:
            raise CheckpointError(f"checkpoint {path} cannot be used: {problem}")
        self.check.verify(path, initial)
        saved = TrainState()
        self._dcp_load({"train_state": saved}, path)
        parts = dict(self.parts)
        if saved.dp_world_size != self.dp_world_size and getattr(self.dataloader, "global_order", False):
            # Every rank's position holds the global sample its next batch starts from: any rank's will do.
            parts["dataloader.dp_rank_0"] = parts.pop(f"dataloader.dp_rank_{self.dp_rank}")
        elif saved.dp_world_size != self.dp_world_size and not exclude & {"dataloader"}:
            if not self.cfg.restart_data_on_reshard:
                raise CheckpointError(
                    f"checkpoint {path} was saved by {saved.dp_world_size} data-parallel ranks and this run has "
                    f"{self.dp_world_size}: the model and optimizer reshard, but the data loader position cannot. "
                    f"Resume with {saved.dp_world_size} data-parallel ranks, or pass "
                    f"--checkpoint.restart_data_on_reshard true to restart the data stream")
            logger.warning("checkpoint %s: %d -> %d data-parallel ranks; the data stream restarts from its "
                           "beginning (model, optimizer, schedule and step are restored)", path,
                           saved.dp_world_size, self.dp_world_size)
            exclude = exclude | {"dataloader", "rng"}
        saved_keys = FileSystemReader(str(path)).read_metadata().state_dict_metadata
        if not any(k.startswith(f"rng.rank_{self.rank}.") for k in saved_keys):  # stored as rng.rank_R.pickle
            # Saved by fewer ranks (another context-parallel degree): no RNG state for this rank to
            # restore. Training draws nothing from it (the data's randomness is in the loader state).
            logger.info("checkpoint %s has no RNG state for rank %d (saved by fewer ranks): not restored", path,
                        self.rank)
            exclude = exclude | {"rng"}
        parts = {k: v for k, v in parts.items() if k.split(".")[0] not in exclude}
        if "model" in parts:
            check_fit(f"checkpoint {path}", saved_shapes(path), shapes(get_model_state_dict(self.model)))
        self._dcp_load(parts, path)
        if "train_state" in exclude:
            self.train_state.step, self.train_state.tokens_seen = 0, 0
        self.train_state.dp_world_size = self.dp_world_size

    def _initial_load(self, path: Path) -> None:
        """Warm start from a DCP step folder, an exported single-file state dict or a Hugging Face export;
        its RoPE must be the run's, or an unscaled one the run's scaling stretches (an adaptation)."""
        if not path.exists():
            raise CheckpointError(f"[checkpoint] initial_load_path = '{path}': no such checkpoint folder or file")
        source = check_initial_source(path, self.model.cfg)
        if path.is_file() or is_hf_folder(path):
            if path.is_file():
                state = read_model_file(path)
            else:
                settings, state = read_hf_folder(path)
                check_settings(path, settings, self.model.cfg, scaling=False)
            check_fit(f"[checkpoint] initial_load_path = '{path}'", shapes(state), shapes(get_model_state_dict(self.model)))
            set_model_state_dict(self.model, state, options=StateDictOptions(full_state_dict=True))
            model_only = True
        else:
            model_only = self.cfg.initial_load_model_only
            self._load(path, {"optimizer", "lr_scheduler", "dataloader", "train_state", "rng"} if model_only
                       else set(self.cfg.exclude_from_loading), initial=True)
        if not model_only:
            logger.info("initial load from %s (full: model, optimizer, schedule, data position)", path)
            return
        trained = "" if source is None else f", trained at seq_len {source[1]:,} with RoPE {describe(rope_of(source[0]))}"
        seq_len = tomllib.loads(self.config_toml)["training"]["seq_len"]
        logger.info("initial model weights from %s%s; this run: seq_len %s, RoPE %s; fresh optimizer, lr schedule and "
                    "data position", path, trained, f"{seq_len:,}", describe(self.model.cfg))

    def _dcp_load(self, parts: dict[str, Any], path: Path) -> None:
        try:
            dcp.load(parts, checkpoint_id=str(path), process_group=self.pg)
        except (Exception, CheckpointException) as e:  # DCP wraps reader errors; name the folder and the problem
            if missing := re.search(r"Missing key in checkpoint state_dict: ([\w.]+?)\.?$", str(e), re.MULTILINE):
                key = missing.group(1)
                part = key.split(".")[0]
                raise CheckpointError(f"checkpoint {path} has no {key} (the {part} state this run expects): resume "
                                      f"from another checkpoint with --checkpoint.load_step, or without its {part} "
                                      f"with --checkpoint.exclude_from_loading {part}") from None
            raise CheckpointError(f"checkpoint {path} cannot be loaded: {type(e).__name__}: {e}".strip()) from None

    # ----------------------------------------------------------------- saving

    def maybe_save(self, step: int, force: bool = False) -> Path | None:
        """Save at every `interval`-th step, or now when `force` (last step, preemption).

        Returns the folder the checkpoint is committed to (an async one once written), or None when
        nothing is saved or the save failed. A save that fails (disk full, folder not writable, a commit
        that cannot rename) is one error line naming the step and the cause, on rank 0, and `failure`
        until a later save succeeds; the previous checkpoints are left as they were.
        """
        if not self.cfg.enable or not (force or step % self.cfg.interval == 0):
            return None
        self.wait()  # one async save in flight at a time
        final = self.folder / f"step-{step}"
        tmp = self.folder / f"step-{step}.incomplete-{self.token}"
        start = time.perf_counter()
        state = dict(self.parts)
        writer = self.storage_writer(tmp, step)  # each rank hashes its files; rank 0 gathers them
        self.commit_error = None
        try:
            if self.cfg.async_mode == "async":
                self.committed.clear()
                future = dcp.async_save(state, storage_writer=writer, process_group=self.pg)
                self.pending = (future, step, tmp)
                blocked = time.perf_counter() - start
                if self.rank == 0:  # rank 0's save finishes after every rank's write: commit then
                    future.add_done_callback(lambda fut: self._commit(fut, writer, tmp, final, step, start, blocked))
                return final
            dcp.save(state, storage_writer=writer, process_group=self.pg)
        except CheckpointException as e:  # a write that failed on some rank, which DCP tells every rank
            return self._settle(step, tmp, e)
        if self.rank == 0:
            self._commit(None, writer, tmp, final, step, start, time.perf_counter() - start)
        return self._settle(step, tmp, None)

    def save_now(self, step: int, loader_state: dict | None = None) -> Path | None:
        """Save `step` and wait until it is committed (a run about to stop), unless this run committed it
        already or nothing was trained; `loader_state`: the data position to record instead of the
        loader's own. Returns the checkpoint, or None."""
        self.wait()
        if step == 0 or not self.cfg.enable:
            return None
        if step != self.saved_step:
            key = f"dataloader.dp_rank_{self.dp_rank}"
            loader = self.parts[key]
            if loader_state is not None:
                self.parts[key] = Opaque(RunPart(FixedState(loader_state), self.records))
            try:
                self.maybe_save(step, force=True)
                self.wait()
            finally:
                self.parts[key] = loader
        return self.folder / f"step-{step}" if self.saved_step == step else None

    def storage_writer(self, path: Path, step: int) -> HashingWriter:
        """The DCP writer of the save of `step` into `path`."""
        return HashingWriter(str(path), hash_files=self.cfg.content_hashes)

    def _settle(self, step: int, tmp: Path, write_error: BaseException | None) -> Path | None:
        """After a save's write (`write_error`: this rank's failure, if any) and rank 0's commit: every
        rank learns whether the checkpoint of `step` was committed (a collective). Returns its folder, or
        None and records `failure`, with one error line."""
        local = self._save_failed(step, tmp, write_error) if write_error is not None else None
        if self.rank == 0 and local is None and self.commit_error is not None:
            local = f"the checkpoint of step {step} could not be committed in {self.folder}: {self.commit_error}"
        causes: list[str | None] = [None] * self.world_size
        dist.all_gather_object(causes, local, group=self.pg)
        cause = next((c for c in causes if c), None)
        if cause is None:
            self.failure, self.saved_step = None, step
            return self.folder / f"step-{step}"
        self.failure = (step, cause)
        if self.rank == 0:
            logger.error("save failed: %s", cause)
        return None

    def _save_failed(self, step: int, tmp: Path, error: BaseException) -> str:
        """Why a save could not be written. When the disk is at fault (full, not writable), rank 0 removes
        the partial folder to give the space back; after a crashed peer it stays, as an interrupted
        save that resumes ignore."""
        cause, disk_error = root_cause(error)
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
        return (f"the checkpoint of step {step} could not be written to {self.folder}: {cause}. It needs about "
                f"{needed / 1e6:,.1f} MB ({free}). Nothing was lost: {kept}. Free space there, or set "
                f"[checkpoint] folder or [job] dump_folder to another disk")

    def _bytes_needed(self) -> int:
        """About the size of one checkpoint: this rank's parameter and optimizer shards times the number
        of ranks (no collective: the other ranks may be gone)."""
        local = _tensors([*self.model.parameters(), *self.optimizer.state.values()])
        return sum((v.to_local() if isinstance(v, DTensor) else v).nbytes for v in local) * self.world_size

    def _commit(self, fut: Any, writer: HashingWriter, tmp: Path, final: Path, step: int, start: float,
                blocked: float) -> None:
        """Rank 0, after every rank has written and hashed its files: the manifest, then the rename, last.
        A folder already at `final` (an earlier run's) is set aside first. A failure is kept in
        `commit_error` for `_settle` (in the async saver's thread it would otherwise go unseen)."""
        try:
            if fut is None or fut.exception() is None:
                if self.other_owner is not None and (holder := self.other_owner()):
                    shutil.rmtree(tmp, ignore_errors=True)
                    raise CheckpointError(f"this run no longer owns its folder: it is held by {holder}, which took "
                                          f"it over; nothing was committed there")
                if final.exists():
                    logger.warning("%s exists: set aside as %s", final, set_aside(final))
                size = commit(tmp, final, step, self.world_size, self.config_toml, writer.hashes, self.kernels)
                self.last_saved = final
                logger.info("checkpoint %s: %.1f MB in %.2f s (training blocked %.2f s, %s)", final, size / 1e6,
                            time.perf_counter() - start, blocked, "async" if self.cfg.async_mode == "async" else "sync")
                self._purge()
        except Exception as e:  # noqa: BLE001 - every cause is reported, with its type
            self.commit_error = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
        finally:
            self.committed.set()

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
        """Block until an async save in flight is written and committed (`failure` says if it was not)."""
        if self.pending is None:
            return
        future, step, tmp = self.pending
        self.pending = None
        error = future.exception()
        if self.rank == 0:
            self.committed.wait()
        self._settle(step, tmp, error)

    def abandon(self, timeout: float) -> str | None:
        """After this rank's own failure, with no collective: an async save in flight gets `timeout` seconds
        to be written on every rank and committed by rank 0, the only way it gets its step name; otherwise it
        stays `step-N.incomplete-TOKEN`, which resumes ignore. Returns rank 0's line on which it became
        (None on other ranks, or when no save was in flight)."""
        if self.pending is None:
            return None
        future, step, tmp = self.pending
        self.pending = None
        deadline = time.monotonic() + timeout
        try:
            future.exception(timeout=timeout)
        except TimeoutError:
            pass
        if self.rank != 0:
            return None
        self.committed.wait(max(deadline - time.monotonic(), 0.0))
        final = self.folder / f"step-{step}"
        if self.committed.is_set() and self.commit_error is None and self.last_saved == final:
            return f"the async save of step {step}, in flight at the failure, was completed: {final}"
        return (f"the async save of step {step}, in flight at the failure, was not completed: {tmp.name} stays "
                f"aside, and a restart resumes from the last complete checkpoint")

    def close(self) -> None:
        """Finish an async save in flight (`failure` says if it failed) and release the checkpoint group."""
        try:
            self.wait()
        finally:
            if self.pg is not None:
                dist.destroy_process_group(self.pg)
                self.pg = None
