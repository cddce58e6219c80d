"""A prepared folder at FineWeb-Edu 10BT's part count: a run's start-up check and the files held open while
reading, before (every part hashed at every start; every part mapped, each map holding a file) and now
(sizes and a sample of hashes; at most `OPEN_MAPS` parts mapped a source), side by side in one run.

    python benchmarks/training/prepared_scale.py [--parts 2400] [--part_tokens 262144] [--windows 4000]

The folder is written here: `--parts` parts of `--part_tokens` random uint16 tokens (FineWeb-Edu 10BT at 4,096
documents a part: ~2,400 parts of ~4M tokens; the hashing time scales with the bytes, given below per GB).
Each start is measured with the files in the page cache (the best case for hashing every part).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from nsa_titan.data import prepared  # noqa: E402
from nsa_titan.data.prepared import CHECKED_PARTS, PreparedSource, check_parts, part_hash  # noqa: E402


def write_folder(folder: Path, parts: int, tokens: int) -> list[dict]:
    """One source `s` of `parts` parts of `tokens` random tokens: the manifest's entries."""
    (folder / "s").mkdir(parents=True)
    rng, entries = np.random.default_rng(0), []
    for p in range(parts):
        file = folder / "s" / f"part-{p:05d}.bin"
        rng.integers(0, 2**16, tokens, dtype=np.uint16).tofile(file)
        entries.append({"file": file.name, "tokens": tokens, "documents": 1, "xxh3": part_hash(file)})
    return entries


def start_check_s(folder: Path, entries: list[dict], hashed: int, rounds: int = 3) -> float:
    """The best of `rounds` start-up checks of the folder's parts (`hashed` parts' hashes; 0: all)."""
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        check_parts(folder, "s", entries, np.dtype(np.uint16), hashed)
        best = min(best, time.perf_counter() - t)
    return best


def read_windows(folder: Path, entries: list[dict], windows: int, open_maps: int) -> tuple[int, float]:
    """(file descriptors open after reading `windows` random windows of 2,049 tokens, windows/s) with at most
    `open_maps` parts mapped."""
    prepared.OPEN_MAPS = open_maps
    source, rng = PreparedSource(folder, "s", entries, np.dtype(np.uint16)), np.random.default_rng(1)
    before = len(os.listdir("/proc/self/fd"))
    t = time.perf_counter()
    for start in rng.integers(0, source.tokens - 2049, windows):
        source.read(int(start), 2049)
    seconds = time.perf_counter() - t
    opened = len(os.listdir("/proc/self/fd")) - before
    del source
    return opened, windows / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", type=int, default=2400)
    parser.add_argument("--part_tokens", type=int, default=262144)
    parser.add_argument("--windows", type=int, default=4000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        entries = write_folder(folder, args.parts, args.part_tokens)
        gb = args.parts * args.part_tokens * 2 / 1e9
        every, sample = start_check_s(folder, entries, 0), start_check_s(folder, entries, CHECKED_PARTS)
        bound = prepared.OPEN_MAPS
        fds_all, speed_all = read_windows(folder, entries, args.windows, 10**9)
        fds_bound, speed_bound = read_windows(folder, entries, args.windows, bound)
    print(json.dumps({"parts": args.parts, "GB": round(gb, 2),
                      "start check s: every hash": round(every, 3), f"start check s: sizes + {CHECKED_PARTS} hashes": round(sample, 4),
                      "start check ratio": round(every / sample, 1), "every hash s per GB": round(every / gb, 3),
                      "open files after reading: every part mapped": fds_all, f"open files: at most {bound} mapped": fds_bound,
                      "windows/s: every part mapped": round(speed_all), f"windows/s: at most {bound} mapped": round(speed_bound)},
                     indent=1))


if __name__ == "__main__":
    main()
