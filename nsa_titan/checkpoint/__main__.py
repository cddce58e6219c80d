"""Check checkpoints without training:

    python -m nsa_titan.checkpoint verify PATH

PATH is one step folder (`step-N`) or the checkpoint folder that holds them. One line per step: `ok`
when its files match the sizes and content hashes of its `.complete` manifest, else what is wrong.
Interrupted saves are listed and skipped, as a resume skips them. Exit code 0 when every step
verifies, 1 when one does not, 2 when PATH holds no checkpoint. One process, no training config.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..system.cli import ArgumentParser, leave, run_command
from .errors import CheckpointError
from .folders import MANIFEST, NO_HASHES, PARTIAL_DIR, STEP_DIR, Found, inspect_folder, recorded_hashes, scan, verify
from .integrity import HASH


def steps(path: Path) -> list[Found]:
    """The step folders at `path`: itself if it is one, else those inside it, oldest first."""
    if (path / MANIFEST).is_file() or STEP_DIR.match(path.name):
        return [Found(path, int(m.group(1)) if (m := STEP_DIR.match(path.name)) else -1, inspect_folder(path))]
    found = scan(path)
    if not found:
        raise CheckpointError(f"{path} holds no checkpoint: give a step-N folder or the checkpoint folder that "
                              f"holds them")
    return found


def line(f: Found) -> tuple[str, bool]:
    """One step's line and whether it verifies (an interrupted save: skipped, as a resume skips it)."""
    if PARTIAL_DIR.match(f.path.name):
        return f"{f.path}: skipped, {f.problem}", True
    problem = f.problem or verify(f.path)
    if problem:
        return f"{f.path}: FAILED, {problem}", False
    files = [p for p in f.path.iterdir() if p.is_file() and p.name != MANIFEST]
    size = sum(p.stat().st_size for p in files) / 1e6
    how = f"{HASH} content and sizes match" if recorded_hashes(f.path) is not None else f"sizes match; it {NO_HASHES}"
    return f"{f.path}: ok ({len(files)} files, {size:,.1f} MB, {how})", True


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="nsa_titan.checkpoint", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    check = commands.add_parser("verify", help="check one step folder, or every step in a checkpoint folder")
    check.add_argument("path", type=Path)
    args = parser.parse_args(argv)

    def run() -> int:
        results = [line(f) for f in steps(args.path)]
        for text, _ in results:
            print(text, flush=True)
        return 0 if all(good for _, good in results) else 1

    return run_command("nsa_titan.checkpoint", run)


if __name__ == "__main__":
    leave(main())
