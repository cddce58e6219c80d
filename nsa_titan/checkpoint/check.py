"""Which checkpoint a run reads, checked on every rank before anything of it is read: its files' sizes, then their
content against the manifest's hashes, dealt across the ranks (each folder once). A resume takes the newest that
verifies; newer ones that fail are set aside as `step-N.damaged-TIME` (`[checkpoint] on_damaged = "set_aside"`) or
stop the run (`"stop"`)."""

from __future__ import annotations

import logging
from pathlib import Path

import torch.distributed as dist

from ..config import Checkpoint as CheckpointConfig
from .errors import CheckpointError
from .folders import NO_HASHES, Found, newest_verified, recorded_hashes, scan, set_aside
from .integrity import verify_files

logger = logging.getLogger(__name__)


class FolderCheck:
    """The checks of the checkpoints in `folder`, made alike on every rank (`rank` of `world_size`, on `group`)."""

    def __init__(self, cfg: CheckpointConfig, folder: Path, rank: int, world_size: int, group: dist.ProcessGroup | None):
        self.cfg, self.folder, self.rank, self.world_size, self.pg = cfg, folder, rank, world_size, group
        self.verified: set[Path] = set()  # the folders whose content verified (checked once)
        self.target: Path | None = None  # the resume target, once `searched`
        self.searched = False

    def resume_target(self) -> Path | None:
        """The checkpoint a resume reads (`load_step`'s, else the newest that verifies), or None; found once (the
        run's kernel choice asks first, the load after: `recorded_kernels`)."""
        if not self.searched:
            self.target, self.searched = self._find_target(), True
        return self.target

    def _find_target(self) -> Path | None:
        found = scan(self.folder)
        for f in found:
            if f.problem and f.path.name != f"step-{f.step}":  # an interrupted save; committed ones: below
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
        return self._newest_verified(found)

    def _newest_verified(self, found: list[Found]) -> Path | None:
        """The newest committed checkpoint that verifies (sizes, then content on every rank). The newer ones that
        fail are set aside as `step-N.damaged-TIME` (`on_damaged = "set_aside"`), else stop the run; so does a
        folder where none verifies (nothing is set aside then)."""
        damaged: list[tuple[Path, str]] = []
        good: Found | None = None
        for f in reversed([f for f in found if f.path.name == f"step-{f.step}"]):
            problem = f.problem or self.content_problem(f.path)
            if problem is None:
                good = f
                break
            damaged.append((f.path, problem))
        if not damaged:
            return None if good is None else good.path
        bad, problem = damaged[0]
        if good is None or self.cfg.on_damaged == "stop":
            way = ("no older checkpoint verifies: repair it, or move the checkpoint folder aside to start afresh"
                   if good is None else
                   f"resume from step {good.step}, the newest that verifies, with --checkpoint.load_step {good.step}, "
                   f"or let damaged checkpoints be set aside by the run with --checkpoint.on_damaged set_aside")
            raise CheckpointError(f"checkpoint {bad} cannot be used: {problem}. Nothing was loaded or overwritten; "
                                  f"{way}")
        if self.rank == 0:
            for path, problem in damaged:
                logger.warning("checkpoint %s cannot be used: %s. Set aside as %s (kept, never read); resuming from "
                               "%s", path, problem, set_aside(path, "damaged"), good.path)
        dist.barrier(group=self.pg)
        return good.path

    def verify(self, path: Path, initial: bool) -> None:
        """Before anything of `path` is read: its content checked (`_content_problem`). A mismatch is a
        CheckpointError on every rank, naming the file, both hashes and the newest checkpoint beside it that
        verifies."""
        problem = self.content_problem(path)
        if problem is None:
            return
        good = newest_verified(path)
        way = ("no earlier checkpoint beside it verifies" if good is None else
               f"pass --checkpoint.initial_load_path {good.path}, the newest beside it that verifies" if initial else
               f"resume from step {good.step}, the newest that verifies, with --checkpoint.load_step {good.step}")
        raise CheckpointError(f"checkpoint {path} cannot be used: {problem}. Nothing was loaded or overwritten; {way}")

    def content_problem(self, path: Path) -> str | None:
        """On every rank, the same: None if the files of `path` (complete by their sizes) match the manifest's
        content hashes, the files dealt across the ranks (unchecked: `[checkpoint] content_hashes = false`, or a
        checkpoint without hashes), else the first problem. Checked once per folder."""
        if not self.cfg.content_hashes or path in self.verified:
            return None
        hashes, problem = recorded_hashes(path), None
        if hashes is None:
            if self.rank == 0:
                logger.warning("checkpoint %s %s", path, NO_HASHES)
        else:
            problems: list[str | None] = [None] * self.world_size
            dist.all_gather_object(problems, verify_files(path, hashes, self.rank, self.world_size), group=self.pg)
            problem = next((p for p in problems if p), None)
        if problem is None:
            self.verified.add(path)
        return problem
