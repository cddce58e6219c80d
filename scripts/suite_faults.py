"""Show that the test suite catches four one-line faults: each is planted in a copy of the working tree and the
suite's relevant subset is run there, which must fail (pytest's exit code 1: tests failed, not an error).

    python scripts/suite_faults.py            # all four (about 10 minutes on 2 cores)
    python scripts/suite_faults.py hang       # one of: resume, loader, gradient, hang

Exit 1 if a fault went unnoticed. tests/README.md ("What the suite catches") has the last results.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent


class Fault(NamedTuple):
    file: str
    line: str
    """The line as it is (one occurrence in `file`, leading spaces included)."""
    planted: str
    """What replaces it."""
    subset: list[str]
    """pytest's arguments: the tests that must catch it."""


FAULTS = {
    "resume": Fault("nsa_titan/checkpoint/states.py", "        set_optimizer_state_dict(self.model, self.optimizer, state)",
                    "        pass  # planted: a resume keeps the fresh optimizer's state",
                    ["tests/test_checkpoint.py", "-k", "resume_is_bit_exact"]),
    "loader": Fault("nsa_titan/data/packing.py", '        self.buffer, self.carry = list(state["buffer"]), list(state["carry"])',
                    '        self.buffer, self.carry = [], list(state["carry"])  # planted: the shuffle buffer is lost',
                    ["tests/test_data.py", "-k", "resume or restore"]),
    "gradient": Fault("nsa_titan/models/attention/families/pytorch/fast_shared.py", "                dv[:, :, k0:k1] += dvc",
                      "                dv[:, :, k0:k1] = dvc  # planted: each part's dv overwrites the last",
                      ["tests/test_nsa_fast.py", "-k", "grad"]),
    "hang": Fault("nsa_titan/runtime/watchdog.py", "            if waited > self.limit and not self.fired:",
                  "            if waited > 1e9 * self.limit and not self.fired:  # planted: the watchdog never fires",
                  ["tests/test_fault.py", "-k", "hang_is_reported"]),
}


def plant(copy: Path, fault: Fault) -> None:
    """Replace `fault.line` by `fault.planted` in the copy (the line must occur once)."""
    path = copy / fault.file
    text = path.read_text()
    assert text.count(fault.line + "\n") == 1, f"{fault.file}: the line to replace is not there once: {fault.line!r}"
    path.write_text(text.replace(fault.line + "\n", fault.planted + "\n"))


def working_tree_copy(to: Path) -> None:
    """The files git tracks or would add, as they are in the working tree now."""
    names = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.splitlines()
    for name in names:
        if (ROOT / name).is_file():
            (to / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, to / name)


def run(name: str, fault: Fault) -> bool:
    """Plant the fault, run its subset; True if the subset failed (the fault was caught)."""
    with tempfile.TemporaryDirectory(prefix=f"suite_fault_{name}_") as tmp:
        copy = Path(tmp)
        working_tree_copy(copy)
        plant(copy, fault)
        start = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *fault.subset],
                              cwd=copy, env={**os.environ, "PYTHONPATH": str(copy)}, capture_output=True, text=True)
        failed = re.findall(r"^FAILED (\S+)", proc.stdout, re.M)
        caught = proc.returncode == 1 and bool(failed)
        print(f"{name:9s} {fault.file}: {'caught by ' + failed[0] if caught else f'NOT CAUGHT (pytest exit {proc.returncode})'}"
              f" ({time.monotonic() - start:.0f} s: pytest -q -x {' '.join(fault.subset)})", flush=True)
        if not caught:
            print(proc.stdout[-3000:], proc.stderr[-2000:], sep="\n")
        return caught


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", metavar="NAME", help=f"the faults to plant: {', '.join(FAULTS)} (default: all)")
    names = parser.parse_args().names or list(FAULTS)
    if unknown := sorted(set(names) - set(FAULTS)):
        parser.error(f"no fault named {', '.join(unknown)}: the faults are {', '.join(FAULTS)}")
    return 0 if all([run(name, FAULTS[name]) for name in names]) else 1


if __name__ == "__main__":
    sys.exit(main())
