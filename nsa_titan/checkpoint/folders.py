"""The checkpoint folder: step folders, their manifests, and which of them are complete.

    step-N/                  a complete checkpoint: DCP files, config.toml, and `.complete`
    step-N.incomplete-TOKEN/ a save in progress, or one that was interrupted
    step-N.superseded-TIME/  an earlier run's step beyond the one a later run resumed from: set aside,
                             never read, kept or removed (remove it by hand once it is not wanted)
    step-N.damaged-TIME/     a newest checkpoint that failed its check at a resume (a file missing,
                             truncated or altered), set aside so the run resumes from an older one

`.complete` is a JSON manifest of every file, its size and its content hash (`integrity.py`), and of
the NSA kernel family the run trained with (a resume takes it again: `recorded_kernels`), written
into the save's folder before its rename to `step-N`, which comes last. Only folders with a manifest
that matches the files' sizes on disk are resumed from, and their content is checked before they
are read (`verify`).
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

from ..system.hashing import file_hash
from .integrity import HASH, verify_files

MANIFEST = ".complete"
STEP_DIR = re.compile(r"^step-(\d+)$")
PARTIAL_DIR = re.compile(r"^step-(\d+)\.incomplete-.+$")
NO_HASHES = "has no content hashes (saved before nsa_titan recorded them): its files are checked by size only"


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


def recorded_hashes(path: Path) -> dict[str, str] | None:
    """The content hashes in the manifest of a complete checkpoint; None for one written before nsa_titan
    recorded them (sizes only)."""
    return _manifest(path).get(HASH)


def recorded_kernels(path: Path | None) -> str | None:
    """The NSA kernel family the run that saved the complete checkpoint `path` trained with (`[model] kernels`, as
    chosen); None for no checkpoint, a dense model's, or one saved before nsa_titan recorded it."""
    return _manifest(path).get("kernels") if path is not None else None


def _manifest(path: Path) -> dict:
    """The manifest of the complete checkpoint `path`."""
    return json.loads((path / MANIFEST).read_text())


def verify(path: Path) -> str | None:
    """In one process: None if `path` is a complete checkpoint whose files match its manifest, sizes
    and content (the content only where hashes were recorded), else the problem."""
    problem = inspect_folder(path)
    hashes = None if problem else recorded_hashes(path)
    return problem or (verify_files(path, hashes) if hashes else None)


def newest_verified(path: Path) -> Found | None:
    """The newest checkpoint beside `path` (a step folder), older than it, that verifies: the way out of a
    broken one. None if there is none, or `path` is not a step folder."""
    m = STEP_DIR.match(path.name)
    for f in reversed(scan(path.parent) if m else []):
        if f.step < int(m.group(1)) and f.problem is None and f.path.name == f"step-{f.step}" and verify(f.path) is None:
            return f
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


def commit(tmp: Path, final: Path, step: int, world_size: int, config_toml: str, hashes: dict[str, str] | None,
           kernels: str | None = None) -> int:
    """Make the written save `tmp` the complete checkpoint `final`: its config, the manifest (fsynced)
    with the ranks' `hashes` of their files and those of the files they did not hash (`.metadata`,
    `config.toml`; None: no hashes) and the run's kernel family (`kernels`, if any), then the rename last,
    so that a process killed at any point leaves a complete folder under the step's name or none.
    Returns the bytes of the checkpoint."""
    (tmp / "config.toml").write_text(config_toml)
    files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file()}
    manifest_data = {"step": step, "world_size": world_size, "files": files}
    if kernels:
        manifest_data["kernels"] = kernels
    if hashes is not None:
        manifest_data[HASH] = {name: hashes.get(name) or file_hash(tmp / name, HASH) for name in files}
    manifest = tmp / MANIFEST
    manifest.write_text(json.dumps(manifest_data, indent=1))
    for path in (manifest, tmp):  # the manifest's bytes, then its name in the folder, on disk before the rename
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    os.replace(tmp, final)
    return sum(files.values())


def set_aside(path: Path, why: str = "superseded") -> Path:
    """Rename the step folder `path` to `step-N.WHY-TIME` (a free name: `superseded`, `damaged`); returns the new
    path."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for i in range(1000):
        target = path.with_name(f"{path.name}.{why}-{stamp}" + (f"-{i}" if i else ""))
        if not target.exists():
            os.replace(path, target)
            return target
    raise FileExistsError(f"no free name to set {path} aside")
