"""Count the Python processes each test starts: ranks, launchers, `python -m nsa_titan...` commands, spawned
workers, interpreted Triton cases (forked loader workers start no interpreter and are not counted).

    python scripts/suite_processes.py tests/test_spikes.py -k skip   # pytest's arguments (default: tests)

For the run, a `.pth` file in site-packages has every Python interpreter that starts append a line (its test, as
pytest's PYTEST_CURRENT_TEST names it, and its command line) to a log; the file is removed at the end. Prints the
tests by processes started, most first, and the total. tests/README.md ("Measuring the suite") has the figures.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOG = "NSA_TITAN_PROCESS_LOG"
HOOK = ("import os; p = os.environ.get('" + LOG + "'); p and open(p, 'a').write(__import__('json').dumps("
        "[os.environ.get('PYTEST_CURRENT_TEST', ''), open('/proc/self/cmdline', 'rb').read().replace(b'\\0', b' ')"
        ".decode(errors='replace')[:200]]) + '\\n')\n")
"""One line of a `.pth` file: run at every interpreter's start (site), a no-op without the log's variable."""


def counted(pytest_args: list[str]) -> tuple[int, collections.Counter, list[list[str]]]:
    """pytest's exit code, the processes started by each test, and every logged line."""
    pth = Path(sysconfig.get_paths()["purelib"]) / "nsa_titan_process_log.pth"
    with tempfile.TemporaryDirectory(prefix="suite_processes_") as tmp:
        log = Path(tmp) / "processes.jsonl"
        log.touch()
        pth.write_text(HOOK)
        try:
            rc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *pytest_args],
                                cwd=ROOT, env={**os.environ, LOG: str(log)}).returncode
        finally:
            pth.unlink()
        lines = [json.loads(x) for x in log.read_text().splitlines() if x.strip()]
    by_test = collections.Counter(test.rsplit(" (", 1)[0] for test, _ in lines if test)
    return rc, by_test, lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--most", type=int, default=40, help="how many tests to list (default 40)")
    args, pytest_args = parser.parse_known_args()  # the rest is pytest's (default: tests)
    rc, by_test, lines = counted(pytest_args or ["tests"])
    for test, n in by_test.most_common(args.most):
        print(f"{n:5d}  {test}")
    outside = sum(1 for test, _ in lines if not test)
    print(f"{sum(by_test.values())} processes started by {len(by_test)} tests ({outside} outside any test: pytest "
          f"itself, collection, the commands started in the background); pytest exit {rc}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
