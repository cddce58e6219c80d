"""The error of a checkpoint that cannot be used, and why a save could not be written."""

from __future__ import annotations

from typing import Any

from ..system.errors import BadInput


class CheckpointError(BadInput, RuntimeError):
    """A checkpoint that cannot be used, named, with the problem and the way out."""

    kind = "checkpoint"


def root_cause(error: BaseException) -> tuple[str, bool]:
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
