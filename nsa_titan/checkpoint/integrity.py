"""Content hashes of a checkpoint's files: written by the ranks that wrote them, checked before a load.

Each rank hashes the DCP files it wrote (`HashingWriter.write_data`, in the thread that writes them:
an async save hashes in the background) and hands the hashes to the coordinator inside DCP's own
gather of write results; rank 0 records them, and those of `.metadata` and `config.toml`, in the
`.complete` manifest at the commit. Before anything of a checkpoint is read, its files are hashed
again, split across the ranks (`verify_files`): a flipped byte is a `CheckpointError`, not a NaN
two steps later. xxHash's XXH3-128 (the `xxhash` package) runs at memory speed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from ..system.hashing import file_hash

HASH = "xxh3_128"
"""The hash's name (xxhash's constructor): the manifest's key for the hashes, and the prefix of each one printed."""
_HASHES = "__nsa_titan_file_hashes__"
"""The fqn of the write result that carries a rank's file hashes to the coordinator (never saved)."""


class HashingWriter(FileSystemWriter):
    """DCP's file writer that hashes, on each rank, the files that rank wrote; on the coordinator,
    `hashes` (file name -> hex digest) holds every rank's after the save (None: `hash_files` off)."""

    def __init__(self, path: str, hash_files: bool = True):
        super().__init__(path)
        self.hash_files = hash_files
        self.hashes: dict[str, str] | None = None

    def write_data(self, plan: Any, planner: Any) -> Future:
        if not self.hash_files:
            return super().write_data(plan, planner)
        results = super().write_data(plan, planner).wait()
        files = sorted({r.storage_data.relative_path for r in results})
        mine = WriteResult(MetadataIndex(_HASHES), 0, {f: file_hash(Path(self.path) / f, HASH) for f in files})
        done: Future = Future()
        done.set_result([*results, mine])
        return done

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        if not self.hash_files:
            return super().finish(metadata, results)
        self.hashes = {f: h for rank in results for r in rank if r.index.fqn == _HASHES for f, h in r.storage_data.items()}
        super().finish(metadata, [[r for r in rank if r.index.fqn != _HASHES] for rank in results])


def mismatch(folder: Path, name: str, expected: str) -> str | None:
    """None if `folder/name` hashes to `expected`, else the problem, naming both hashes."""
    found = file_hash(folder / name, HASH)
    if found == expected:
        return None
    return (f"file {name} does not match its recorded content ({HASH} {found}, the manifest recorded {expected}): "
            f"it was altered or corrupted after it was written")


def verify_files(folder: Path, hashes: dict[str, str], rank: int = 0, world_size: int = 1) -> str | None:
    """Hash this rank's share of the files in `hashes` (largest first, dealt in turn to the ranks: each
    file hashed by one rank) -> None if they match, else the first problem."""
    names = sorted(hashes, key=lambda n: -(folder / n).stat().st_size)
    for name in names[rank::world_size]:
        if problem := mismatch(folder, name, hashes[name]):
            return problem
    return None
