"""Files' content hashes with xxHash (the `xxhash` package), read in pieces at memory speed: a checkpoint's
files (XXH3-128) and a prepared folder's token parts (XXH3-64, the manifest's `xxh3`) share this one reader."""

from __future__ import annotations

from pathlib import Path

import xxhash

PIECE = 8 << 20
"""Bytes read at a time (8 MiB)."""


def file_hash(path: Path, algorithm: str = "xxh3_128") -> str:
    """The hex digest of the file's content by `algorithm`, an xxhash constructor's name (`xxh3_128`,
    `xxh3_64`)."""
    h, buffer = getattr(xxhash, algorithm)(), bytearray(PIECE)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            h.update(view[:n])
    return h.hexdigest()
