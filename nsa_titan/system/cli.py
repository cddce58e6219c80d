"""What every command-line entry point shares: bad input ends in one line and exit code 2.

Bad input is a `BadInput` (`ConfigError`, `DataError`, `CheckpointError`, `MissingExtra`) or a wrong flag: the message names
the problem and the fix, and no traceback follows. Under `nsa_titan.launch` a rank does not print
it but writes it to torchrun's error file, and the launcher prints it once for the whole job.
"""

from __future__ import annotations

import argparse
import atexit
import ctypes
import faulthandler
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from .env import LAUNCHED_BY, quiet_libraries
from .errors import BadInput

EXIT_BAD_INPUT = 2
EXIT_HANG = 124
"""Exit code of a process stopped as hung: a rank by its watchdog, any entry point that does not end (as timeout(1)
uses)."""
LEAVE_LIMIT_S = 300.0
"""How long an entry point's end (threads joined, exit handlers) may take before it counts as hung."""


def bad_input_line(prog: str, e: BaseException, message: str | None = None, where: str = "") -> str:
    """`prog: <kind> error: <where><message>` on one line (`message`: `e`'s own, unless given)."""
    kind = e.kind if isinstance(e, BadInput) else "input"
    return f"{prog}: {kind} error: {where}" + " ".join((str(e) if message is None else message).split("\n"))


def note_failure(line: str) -> bool:
    """Leave `line` in torchrun's error file, where the launcher reads why a rank failed; False if none."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not error_file:
        return False
    Path(error_file).parent.mkdir(parents=True, exist_ok=True)
    Path(error_file).write_text(json.dumps({"message": line, "timestamp": int(time.time())}))
    return True


def report(line: str) -> None:
    """Print `line` to stderr, or, under the launcher, leave it to the launcher to print once."""
    if not (os.environ.get(LAUNCHED_BY) and note_failure(line)):
        print(line, file=sys.stderr, flush=True)


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but a wrong flag is one line (`prog: error: ... (see --help)`) and exit 2."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {message} (see --help)", file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)


def leave(code: int, limit_s: float = LEAVE_LIMIT_S) -> NoReturn:
    """End a finished entry point with `code` as any exit does (threads joined, exit handlers run, logs and
    output flushed), without the interpreter's teardown of every module: with torch loaded it takes a second or
    more, at each rank's and the launcher's end. An end that takes over `limit_s` (a thread that never returns)
    prints one line and every thread's stack, and exits with EXIT_HANG instead of sitting there."""
    threading.Thread(target=_end_hung, args=(limit_s,), name="leave-limit", daemon=True).start()
    # What the interpreter runs at exit (CPython), in its order: threading's exit calls (they stop idle thread pools,
    # such as the one torch.compile leaves after compiling: joined without them, its workers wait forever), every
    # non-daemon thread joined, then the exit handlers.
    threading._shutdown()
    atexit._run_exitfuncs()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    ctypes.CDLL(None).fflush(None)  # and C's stdio buffers (extensions' output): os._exit flushes nothing
    os._exit(code)


def _end_hung(limit_s: float) -> None:
    time.sleep(limit_s)
    print(f"nsa_titan: process {os.getpid()} did not end within {limit_s:.0f} s of its work's end (a thread or an "
          f"exit handler that does not return): every thread's stack follows; exit {EXIT_HANG}", file=sys.stderr,
          flush=True)
    faulthandler.dump_traceback(sys.stderr, all_threads=True)
    os._exit(EXIT_HANG)


def run_command(prog: str, command: Callable[[], int]) -> int:
    """Run an entry point's body, with the quiet library loggers (`env.quiet_libraries`); bad input
    becomes one line on stderr and exit code 2."""
    quiet_libraries()
    try:
        return command()
    except BadInput as e:
        report(bad_input_line(prog, e))
        return EXIT_BAD_INPUT


def setup_logging() -> None:
    """Log lines as `[rankR] time LEVEL message` on stdout: INFO on rank 0, warnings and errors on the others."""
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"[rank{rank}] %(asctime)s %(levelname)s %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stdout,
        force=True,
    )
