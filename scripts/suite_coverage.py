"""Line coverage of nsa_titan/ over the whole suite, spawned processes included, one test file at a time: each
file's run keeps its data in a folder of its own, so a measurement that takes longer than a sitting (about four
hours on 2 cores: coverage slows the interpreted Triton cases most) goes on where it stopped.

    python scripts/suite_coverage.py OUT                  # every test file not done yet, then the report
    python scripts/suite_coverage.py OUT tests/test_hf.py # these files again (their old data replaced)
    python scripts/suite_coverage.py OUT --report         # the report of what is done

OUT/<file>/ holds a file's data and its pytest output; OUT/done lists the files finished. The report combines
every file's data (coverage.py's `combine --keep`, so a file measured again replaces only its own part).
tests/README.md ("Measuring the suite") has the figures.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def measure(test_file: Path, out: Path) -> int:
    """One test file's run under coverage, its data in `out` (emptied first); pytest's exit code."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    env = {**os.environ, "COVERAGE_FILE": str(out / ".coverage")}  # the file's processes write beside it
    with open(out / "pytest.log", "w") as log:
        return subprocess.run([sys.executable, "-m", "coverage", "run", "-m", "pytest", "-q", "-p", "no:cacheprovider",
                               str(test_file.relative_to(ROOT))], cwd=ROOT, env=env, stdout=log,
                              stderr=subprocess.STDOUT).returncode


def report(out: Path) -> int:
    """Combine every finished file's data into OUT/.coverage and print coverage.py's report."""
    done = (out / "done").read_text().split() if (out / "done").exists() else []
    data = [str(out / Path(name).stem) for name in done]
    (out / ".coverage").unlink(missing_ok=True)
    env = {**os.environ, "COVERAGE_FILE": str(out / ".coverage")}
    subprocess.run([sys.executable, "-m", "coverage", "combine", "--keep", "-q", *data], cwd=ROOT, env=env, check=True)
    print(f"{len(done)} of {len(test_files())} test files measured")
    return subprocess.run([sys.executable, "-m", "coverage", "report"], cwd=ROOT, env=env).returncode


def test_files() -> list[Path]:
    return sorted((ROOT / "tests").glob("test_*.py"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="the folder of the measurement (made if missing)")
    parser.add_argument("files", nargs="*", type=Path, help="test files to measure again (default: those not done)")
    parser.add_argument("--report", action="store_true", help="only combine and report what is done")
    args = parser.parse_args()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    if not args.report:
        done = set((out / "done").read_text().split()) if (out / "done").exists() else set()
        again = {f.resolve() for f in args.files}
        for test_file in [f for f in test_files() if f in again or (not again and f.name not in done)]:
            started = time.monotonic()
            code = measure(test_file, out / test_file.stem)
            print(f"{test_file.name}: pytest exit {code}, {time.monotonic() - started:.0f} s", flush=True)
            if test_file.name not in done:
                with open(out / "done", "a") as f:
                    f.write(test_file.name + "\n")
                done.add(test_file.name)
    return report(out)


if __name__ == "__main__":
    sys.exit(main())
