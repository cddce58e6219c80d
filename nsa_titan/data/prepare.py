"""Tokenize a config's sources once into prepared token shards (`prepared.py` has the format).

    python -m nsa_titan.data.prepare --config train_configs/m7c.toml --output data/prepared/m7c --processes 2
    ./run_train.sh --config train_configs/m7c.toml --data.prepared data/prepared/m7c

Every source of `[data]` (its `[[data.sources]]`, or `path`) is read in order, `[data] holdout`'s documents
set apart in parts of their own (validation reads them, training never) and each source's length bounds
applied, `--docs_per_part` documents a part, tokenized by `--processes` processes. A part is written to a
temporary name and renamed when whole, so a prepare that is killed (or loses a process) and is run again
continues after its last whole part and ends with the same files (and hashes) as an uninterrupted one. The
manifest is written last: a folder without one is not read by training. `--verify` checks every part against
the manifest's content hashes (a run checks every part's size and a sample's hashes at its start).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import multiprocessing
import os
import sys
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from ..config import ConfigError, Data, JobConfig, Source, data_sources, load_config, to_toml
from ..system.cli import ArgumentParser, report, run_command
from .errors import DataError
from .prepared import FORMAT, MANIFEST, PREPARED_AS, fingerprint, origin, part_hash, token_dtype, verify
from .sources import document_text, is_held_out, open_text_stream
from .tokenizer import Tokenizer, build_tokenizer, document_tokens

SETTINGS = "prepare.json"
"""Written first: what the folder is being prepared with; a rerun with other settings is refused."""

_tokenizer: Tokenizer | None = None  # each process's own


def _load_tokenizer(kind: str, path: str) -> None:
    global _tokenizer
    _tokenizer = build_tokenizer(kind, path)


def _part_files(folder: Path, p: int, kind: str = "part") -> tuple[Path, Path]:
    """Part `p`'s tokens and document ends; `kind` "part" (training) or "holdout" (`[data] holdout`'s)."""
    return folder / f"{kind}-{p:05d}.bin", folder / f"{kind}-{p:05d}.docs.npy"


def write_part(texts: list[str], bounds: tuple[int, int], files: tuple[Path, Path], dtype: str) -> None:
    """Tokenize `texts` (as the packer joins documents), keep those within `bounds` (tokens, 0: none), and write
    a part: its tokens, then (renamed last, the part's mark of being whole) its documents' end offsets."""
    tok, (low, high) = _tokenizer, bounds
    docs = [document_tokens(tok, t) for t in texts]
    docs = [d for d in docs if len(d) >= low and (not high or len(d) <= high)]
    tokens, docs_file = files
    np.fromiter(itertools.chain.from_iterable(docs), dtype=dtype).tofile(tmp := tokens.with_suffix(".tmp"))
    os.replace(tmp, tokens)
    with (tmp := docs_file.with_suffix(".tmp")).open("wb") as f:
        np.save(f, np.cumsum([len(d) for d in docs], dtype=np.int64))
    os.replace(tmp, docs_file)


def _chunks(data: Data, src: Source, n: int) -> Iterator[tuple[str, list[str]]]:
    """`src`'s documents in order, `n` a chunk: ("part", ...) for training, ("holdout", ...) for `[data] holdout`'s
    (each kind's last chunk may be shorter)."""
    stream = open_text_stream(src.path, src.name, src.split, src.text_column, data.read_retries,
                              data.retry_wait_seconds)
    chunks: dict[str, list[str]] = {"part": [], "holdout": []}
    for example in stream:
        if (text := document_text(example, src, stream, data.bad_documents)) is None:
            continue
        kind = "holdout" if data.holdout and is_held_out(text, data.holdout) else "part"
        chunks[kind].append(text)
        if len(chunks[kind]) == n:
            yield kind, chunks[kind]
            chunks[kind] = []
    yield from ((kind, texts) for kind, texts in chunks.items() if texts)


def _entries(folder: Path, kind: str, parts: int, dtype: str) -> list[dict[str, Any]]:
    """The manifest's entries of a kind's parts; a part whose documents all fell outside the bounds is left out."""
    entries = []
    for p in range(parts):
        tokens, docs = _part_files(folder, p, kind)
        if n := tokens.stat().st_size // np.dtype(dtype).itemsize:
            entries.append({"file": tokens.name, "tokens": n, "documents": len(np.load(docs)), "xxh3": part_hash(tokens)})
    return entries


class WorkerLost(RuntimeError):
    """A tokenizing process ended without its part (killed: by the kernel for memory, or by hand)."""


def lost_worker(processes: dict[int, Any], src: Source, part: Path) -> WorkerLost:
    """The error naming the pool's `processes` (pid: process) that died (exit code or signal), and the part."""
    for p in processes.values():
        p.join(1)  # its exit code, once the kernel has reaped it
    dead = [f"pid {p.pid} ({f'signal {-p.exitcode}' if p.exitcode < 0 else f'exit code {p.exitcode}'})"
            for p in processes.values() if p.exitcode not in (None, 0)]
    return WorkerLost(f"a tokenizing process ended without its part ({', '.join(dead) or 'pid unknown'}; signal 9 is "
                      f"most often the kernel's out-of-memory killer) while '{src.label}' was written, around {part}. "
                      f"The parts written whole are kept: run the same command again to continue (with fewer "
                      f"--processes or --docs_per_part if memory ran out)")


def prepare_source(pool: ProcessPoolExecutor | None, processes: int, data: Data, src: Source, folder: Path,
                   docs_per_part: int, dtype: str) -> dict[str, Any]:
    """Write `src`'s parts into `folder` (those already whole are kept), then describe them for the manifest.
    A tokenizing process that dies ends it within seconds (`WorkerLost`)."""
    folder.mkdir(parents=True, exist_ok=True)
    pending: deque = deque()
    parts = {"part": 0, "holdout": 0}
    files, started = (folder, folder), {}  # the pool's processes, seen as they start: it forgets a dead one
    try:
        with tqdm(desc=f"prepare {src.label}", unit=" docs", dynamic_ncols=True) as bar:
            for kind, texts in _chunks(data, src, docs_per_part):
                files = _part_files(folder, parts[kind], kind)
                parts[kind] += 1
                if not files[1].is_file():
                    args = (texts, (src.min_tokens, src.max_tokens), files, dtype)
                    pending.append(pool.submit(write_part, *args) if pool else write_part(*args))
                    started.update(getattr(pool, "_processes", None) or {})
                while pool and len(pending) > 2 * processes:  # bounded: the stream is read as parts are written
                    pending.popleft().result()
                bar.update(len(texts))
            for job in pending:
                if pool:
                    job.result()
    except BrokenProcessPool:
        raise lost_worker(started, src, files[0]) from None
    entries, held = (_entries(folder, kind, parts[kind], dtype) for kind in ("part", "holdout"))
    if not entries:
        raise DataError(f"[[data.sources]] '{src.label}': no document passes min_tokens = {src.min_tokens}, max_tokens "
                        f"= {src.max_tokens or 'any'}: widen the bounds")
    return {"source": {"origin": origin(src.path), **{k: getattr(src, k) for k in PREPARED_AS[1:]}},
            "parts": entries, "holdout": held,
            "tokens": sum(e["tokens"] for e in entries), "documents": sum(e["documents"] for e in entries),
            "holdout_tokens": sum(e["tokens"] for e in held)}


def prepare(cfg: JobConfig, output: Path, processes: int, docs_per_part: int) -> dict[str, Any]:
    """Prepare every source of `cfg` into `output`; returns the manifest (also written there, last)."""
    data = dataclasses.replace(cfg.data, sources=data_sources(cfg.data))
    tokenizer = build_tokenizer(data.tokenizer, data.tokenizer_path)
    settings = {"format": FORMAT, "tokenizer": fingerprint(tokenizer), "tokenizer_path": data.tokenizer_path,
                "dtype": token_dtype(tokenizer.vocab_size).name, "holdout": data.holdout,
                "docs_per_part": docs_per_part, "sources": {s.label: {k: getattr(s, k) for k in PREPARED_AS}
                                                            for s in data.sources}}
    output.mkdir(parents=True, exist_ok=True)
    if (output / SETTINGS).is_file() and json.loads((output / SETTINGS).read_text()) != settings:
        raise DataError(f"--output '{output}' holds a prepare of other settings (tokenizer, sources, holdout or "
                        f"--docs_per_part; {output / SETTINGS}): prepare into a new folder, or remove that one")
    (output / SETTINGS).write_text(json.dumps(settings, indent=1))
    (output / MANIFEST).unlink(missing_ok=True)
    pool = ProcessPoolExecutor(processes, multiprocessing.get_context("spawn"), _load_tokenizer,
                               (data.tokenizer, data.tokenizer_path)) if processes > 1 else None
    _load_tokenizer(data.tokenizer, data.tokenizer_path)
    try:
        sources = {s.label: prepare_source(pool, processes, data, s, output / s.label, docs_per_part, settings["dtype"])
                   for s in data.sources}
    finally:
        if pool:
            for process in list((getattr(pool, "_processes", None) or {}).values()):
                process.terminate()  # not waited on: a part half written is rewritten by the next run
            pool.shutdown(wait=False, cancel_futures=True)
    manifest = {**settings, "sources": sources, "config": to_toml(cfg)}
    (tmp := output / (MANIFEST + ".tmp")).write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, output / MANIFEST)
    return manifest


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="nsa_titan.data.prepare", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", default="", help="the prepared folder (default: the config's [data] prepared)")
    parser.add_argument("--processes", type=int, default=1, help="tokenizing processes")
    parser.add_argument("--docs_per_part", type=int, default=4096, help="documents a part (the unit of resuming)")
    parser.add_argument("--verify", action="store_true", help="check every part of the prepared folder against its "
                        "manifest's content hashes (a run checks sizes and a sample at its start), then exit")
    args, overrides = parser.parse_known_args(argv)
    if args.processes < 1 or args.docs_per_part < 1:
        parser.error("--processes and --docs_per_part must be >= 1")

    def body() -> int:
        cfg, _ = load_config(overrides)
        if not (output := args.output or cfg.data.prepared):
            raise ConfigError("no folder to prepare into: pass --output DIR (or set [data] prepared)")
        if args.verify:
            print(f"{output}: all {verify(Path(output)):,} parts match {MANIFEST}")
            return 0
        try:
            manifest = prepare(cfg, Path(output), args.processes, args.docs_per_part)
        except WorkerLost as e:
            report(f"nsa_titan.data.prepare: {e}")
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)  # at once: the teardown could abort in the source reader's threads, still open
        for label, s in manifest["sources"].items():
            held = f"; held out for validation: {s['holdout_tokens']:,} tokens" if s["holdout"] else ""
            print(f"{label}: {s['documents']:,} documents, {s['tokens']:,} tokens in {len(s['parts'])} "
                  f"part{'s' * (len(s['parts']) != 1)}{held}")
        print(f"wrote {output}; train on it with --data.prepared {output}")
        return 0

    return run_command("nsa_titan.data.prepare", body)


if __name__ == "__main__":
    raise SystemExit(main())
