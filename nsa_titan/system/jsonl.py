"""JSON-lines files a run appends to (the W&B history, the heartbeat). A process killed or a disk filled mid-write
leaves a torn last line; here it is found and cut off, so that neither a read nor the next append trips on it."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def read_records(path: Path) -> tuple[list[dict[str, Any]], int]:
    """The records of `path` (none where it does not exist) and how many lines were dropped: lines that are not a
    whole JSON object (a torn write; an append after one joins the next record to it)."""
    if not path.is_file():
        return [], 0
    records, dropped = [], 0
    for line in path.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if isinstance(record, dict):
            records.append(record)
        else:
            dropped += 1
    return records, dropped


def write_records(path: Path, records: list[dict[str, Any]]) -> None:
    """`path` holding `records` alone, replaced at once (a kill meanwhile leaves the old file)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
    os.replace(tmp, path)


def append_record(path: Path, record: dict[str, Any]) -> None:
    """One line more in `path` (created if missing); raises OSError as the disk does."""
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")


def cut_torn_tail(path: Path) -> int:
    """Cut `path` back to its last whole line; the bytes cut (0: none, or no such file)."""
    try:
        with path.open("rb+") as f:
            size = f.seek(0, os.SEEK_END)
            if size == 0:
                return 0
            f.seek(max(size - 65536, 0))
            tail = f.read()
            if tail.endswith(b"\n"):
                return 0
            keep = size - len(tail) + tail.rfind(b"\n") + 1 if b"\n" in tail else 0
            f.truncate(keep)
            return size - keep
    except FileNotFoundError:
        return 0
