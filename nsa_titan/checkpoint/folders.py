"""The checkpoint folder: step folders, their manifests, and which of them are complete.

    step-N/                  a complete checkpoint: DCP files, config.toml, and `.complete`
    step-N.incomplete-TOKEN/ a save in progress, or one that was interrupted

`.complete` is written last: a JSON manifest of every file and its size. Only folders with a
manifest that matches the files on disk are resumed from.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

MANIFEST = ".complete"
STEP_DIR = re.compile(r"^step-(\d+)$")
PARTIAL_DIR = re.compile(r"^step-(\d+)\.incomplete-.+$")


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


def commit(tmp: Path, final: Path, step: int, world_size: int, config_toml: str) -> int:
    """Make the written save `tmp` the complete checkpoint `final`: its config, the rename, then the
    manifest last (fsynced). Returns the bytes of the checkpoint."""
    (tmp / "config.toml").write_text(config_toml)
    files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file()}
    os.replace(tmp, final)
    manifest = final / f"{MANIFEST}.tmp"
    manifest.write_text(json.dumps({"step": step, "world_size": world_size, "files": files}, indent=1))
    with open(manifest) as f:
        os.fsync(f.fileno())
    os.replace(manifest, final / MANIFEST)
    return sum(files.values())
