"""Prepared token shards: the format `prepare.py` writes, and training's random-access reader of it.

A prepared folder holds, per source, `<label>/part-NNNNN.bin` (the tokens of its documents end to end, each
document as the packer joins it: <bos> where the tokenizer has one, its tokens, <eos>; uint16 where the
vocabulary fits, else uint32) and `part-NNNNN.docs.npy` (each document's end offset in the part), its
`[data] holdout` documents as `holdout-NNNNN.bin` and `.docs.npy` (validation reads them), and one
`manifest.json` (tokenizer fingerprint, the sources as prepared, counts, each part's content hash), written
last. Windows of seq_len + 1 tokens are cut end to end from a source's tokens; the window of global sample i
is a function of the seed, the source's epoch and i alone (`Mixture`, `PreparedWindows`), so a run resumed on
another number of data-parallel ranks or loader workers continues the same sample sequence.
"""

from __future__ import annotations

import json
import logging
import random
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xxhash
from torchdata.stateful_dataloader import StatefulDataLoader

from ..config import URL, Data, Source, data_sources
from ..system.hashing import file_hash
from .batch import Sample, eos_documents
from .errors import DataError, SourceEnded, source_ended
from .synthetic import IndexedSamples
from .tokenizer import Tokenizer

logger = logging.getLogger(__name__)

FORMAT = 2
"""2: each source's `[data] holdout` documents in parts of their own (`holdout-NNNNN.bin`), read by validation."""
MANIFEST = "manifest.json"
PREPARED_AS = ("path", "name", "split", "text_column", "min_tokens", "max_tokens")
"""A source's settings that decide its prepared tokens: a run's must equal the manifest's, but for `path` (the
folder may move, and train without its raw text), which the manifest holds as `origin`."""
OPEN_MAPS = 16
"""Parts of a source memory-mapped at once (`PreparedSource`): open files stay bounded however many parts."""
CHECKED_PARTS = 4
"""Parts of each source whose content hash a run checks at its start (first, last and a random two), beside
every part's size; `python -m nsa_titan.data.prepare --verify` checks them all."""


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 where every token id fits, else uint32."""
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


def fingerprint(tokenizer: Tokenizer) -> str:
    """A hash of what decides the token ids: the tokenizer's kind, its file's bytes, vocabulary, eos and bos."""
    h = xxhash.xxh3_64(f"{type(tokenizer).__name__}/{tokenizer.vocab_size}/{tokenizer.eos_id}/{tokenizer.bos_id}".encode())
    file = getattr(tokenizer, "file", None) or getattr(tokenizer, "path", None)
    if file:
        h.update(Path(file).read_bytes())
    return h.hexdigest()


def part_hash(path: Path) -> str:
    """A token part's content hash as the manifest records it (`xxh3`: XXH3-64, prepared format 2)."""
    return file_hash(path, "xxh3_64")


def read_manifest(folder: Path) -> dict[str, Any]:
    """The manifest of a prepared folder; a DataError if it is missing (a prepare that did not finish)."""
    path = folder / MANIFEST
    if not path.is_file():
        what = "does not exist" if not folder.exists() else f"has no {MANIFEST}: its prepare did not finish"
        raise DataError(f"[data] prepared = '{folder}' {what}; run (or rerun, which continues) "
                        f"`python -m nsa_titan.data.prepare --config <your config> --output {folder}`")
    manifest = json.loads(path.read_text())
    if manifest.get("format") != FORMAT:
        raise DataError(f"[data] prepared = '{folder}': format {manifest.get('format')}, this version reads {FORMAT}: "
                        f"prepare it again")
    return manifest


class PreparedSource:
    """One source's parts (its training or its held-out documents), memory-mapped as they are read: at most
    OPEN_MAPS at once (each map holds a file descriptor), the least recently read closed first."""

    def __init__(self, folder: Path, label: str, parts: list[dict[str, Any]], dtype: np.dtype):
        self.label, self.dtype = label, dtype
        self.files = [folder / label / p["file"] for p in parts]
        self.ends = np.cumsum([p["tokens"] for p in parts])  # each part's end in the source's tokens
        self.tokens = int(self.ends[-1]) if len(self.ends) else 0
        self.maps: OrderedDict[int, np.memmap] = OrderedDict()

    def part(self, p: int) -> np.memmap:
        """Part p, mapped (kept among the OPEN_MAPS most recently read)."""
        if p in self.maps:
            self.maps.move_to_end(p)
        else:
            if len(self.maps) >= OPEN_MAPS:
                self.maps.popitem(last=False)  # unmapped, and its file closed, as its last reference goes
            self.maps[p] = np.memmap(self.files[p], dtype=self.dtype, mode="r")
        return self.maps[p]

    def read(self, start: int, n: int) -> np.ndarray:
        """Tokens [start, start + n) of the source, across parts (a copy: no map is referenced after)."""
        out, at = [], start
        while at < start + n:
            p = int(np.searchsorted(self.ends, at, side="right"))
            begin = at - (int(self.ends[p - 1]) if p else 0)
            piece = self.part(p)[begin:begin + start + n - at]
            out.append(piece)
            at += len(piece)
        return np.concatenate(out)


def open_prepared(data: Data, tokenizer: Tokenizer, held_out: bool = False) -> list[PreparedSource]:
    """The prepared sources of `[data] prepared` (their training parts, or with `held_out` their `[data] holdout`
    documents), in the order of `[data]`'s sources (`config.data_sources`), checked against the run's tokenizer and sources and against
    the manifest's sizes and content hashes: a DataError names what differs."""
    folder = Path(data.prepared)
    manifest = read_manifest(folder)
    if manifest["tokenizer"] != (ours := fingerprint(tokenizer)):
        raise DataError(f"[data] prepared = '{folder}' was prepared with another tokenizer (fingerprint "
                        f"{manifest['tokenizer']}, {manifest.get('tokenizer_path', '?')}); this run's [data] tokenizer "
                        f"is {ours} ({data.tokenizer_path}): prepare again with this tokenizer, or use that one")
    if manifest["holdout"] != data.holdout:
        raise DataError(f"[data] holdout = {data.holdout:g}, but '{folder}' was prepared with holdout = "
                        f"{manifest['holdout']:g} (prepare sets its documents apart for validation): prepare again, or match it")
    out = []
    for src in data_sources(data):
        entry = manifest["sources"].get(src.label)
        if entry is None:
            raise DataError(f"[[data.sources]] '{src.label}' is not in [data] prepared = '{folder}' (it holds "
                            f"{sorted(manifest['sources'])}): prepare it (rerun prepare with this config)")
        differ = [k for k in PREPARED_AS[1:] if entry["source"][k] != getattr(src, k)]
        if differ:
            raise DataError(f"[[data.sources]] '{src.label}': {', '.join(f'{k} = {getattr(src, k)!r}' for k in differ)}"
                            f", but '{folder}' prepared it with {', '.join(repr(entry['source'][k]) for k in differ)}: "
                            f"prepare again, into a new folder")
        if (was := entry["source"].get("origin")) and was != origin(src.path) and not held_out:
            logger.info("data: '%s' was prepared from '%s' (this config names '%s'): its prepared tokens are read",
                        src.label, was, src.path)
        parts = entry["holdout" if held_out else "parts"]
        check_parts(folder, src.label, parts, np.dtype(manifest["dtype"]), CHECKED_PARTS)
        out.append(PreparedSource(folder, src.label, parts, np.dtype(manifest["dtype"])))
    return out


def origin(path: str) -> str:
    """A source's path as a manifest names it: a local file or folder by its last part (the prepared folder may
    move to another machine), a URL or hub id as it is."""
    return path if URL.match(path) or not Path(path).is_absolute() else Path(path).name


def check_parts(folder: Path, label: str, parts: list[dict[str, Any]], dtype: np.dtype, hashed: int = 0) -> None:
    """Every part's size against the manifest, and the content hash of `hashed` of them (first, last and random
    others; 0: all): a DataError names a part missing, truncated or altered."""
    chosen = range(len(parts))
    if hashed and len(parts) > hashed:
        chosen = {0, len(parts) - 1, *random.sample(range(1, len(parts) - 1), min(hashed - 2, len(parts) - 2))}
    for k, part in enumerate(parts):
        file = folder / label / part["file"]
        size = file.stat().st_size if file.is_file() else None
        if size != part["tokens"] * dtype.itemsize or (k in chosen and part_hash(file) != part["xxh3"]):
            raise DataError(f"[data] prepared: {file} is {'missing' if size is None else 'truncated or altered'} "
                            f"(its size or content hash differs from {folder / MANIFEST}): prepare again")


def verify(folder: Path) -> int:
    """Check every part of a prepared folder, its held-out ones too, against the manifest's sizes and content
    hashes; the number of parts checked."""
    manifest = read_manifest(folder)
    for label, entry in manifest["sources"].items():
        check_parts(folder, label, entry["parts"] + entry["holdout"], np.dtype(manifest["dtype"]))
    return sum(len(e["parts"]) + len(e["holdout"]) for e in manifest["sources"].values())


class Mixture:
    """Global sample i -> (source, its k-th sample), in one order over the whole run: source s's k-th sample is due
    at time (k + 1/2) / f_s, f_s its share of the weights, and the samples are dealt in order of their times (ties
    to the lower source): Webster's apportionment, one seat at a time. Every window is seq_len + 1 tokens of one
    source, so a weight is a share of tokens; the first i samples hold each source's i f_s to within 1 + S/2 f_s
    (S sources), whatever the weight: a share below one sample in 4,096 gets its samples where they fall due,
    not none (blocks of 4,096 with whole shares each rounded it away). Any i is found without reading what came
    before: only the samples due within S of i are looked at."""

    def __init__(self, weights: list[float]):
        self.shares = [w / sum(weights) for w in weights]

    def _due(self, s: int, k: int) -> float:
        return (k + 0.5) / self.shares[s]

    def _count(self, s: int, time: float) -> int:
        """Source s's samples due at or before `time`."""
        k = max(0, int(time * self.shares[s] + 0.5))
        while k > 0 and self._due(s, k - 1) > time:
            k -= 1
        while self._due(s, k) <= time:
            k += 1
        return k

    def _around(self, i: int) -> tuple[list[int], list[tuple[float, int, int]]]:
        """Each source's samples due up to a time before sample i, and the samples due after it up to a time past
        i, in the order they are dealt: (time, source, k)."""
        before, after = i - len(self.shares), i + len(self.shares) + 1
        counts = [self._count(s, before) for s in range(len(self.shares))]
        near = [(self._due(s, k), s, k) for s, n in enumerate(counts)
                for k in range(n, self._count(s, after))]
        return counts, sorted(near)

    def locate(self, i: int) -> tuple[int, int]:
        counts, near = self._around(i)
        _, s, k = near[i - sum(counts)]
        return s, k

    def taken(self, i: int) -> np.ndarray:
        """Each source's samples among global samples [0, i)."""
        counts, near = self._around(i)
        for _, s, _ in near[:i - sum(counts)]:
            counts[s] += 1
        return np.asarray(counts, dtype=np.int64)


class PreparedWindows(IndexedSamples):
    """Windows of prepared sources by global sample index (from `start`, the position a run resumed at): the
    mixture picks the source, the source's epoch a seeded permutation of its windows."""

    def __init__(self, sources: list[PreparedSource], config: list[Source], seq_len: int, eos_id: int, seed: int,
                 dp_rank: int, dp_size: int, local_batch: int):
        super().__init__(dp_rank, dp_size, local_batch)
        self.sources, self.config, self.seq_len, self.eos_id, self.seed = sources, config, seq_len, eos_id, seed
        self.windows = [s.tokens // (seq_len + 1) for s in sources]
        for src, n in zip(config, self.windows):
            if n == 0:
                raise DataError(f"[[data.sources]] '{src.label}': its prepared tokens do not fill one window of "
                                f"seq_len + 1 = {seq_len + 1} tokens")
        self.weights = [s.weight for s in config]
        self.mixture = Mixture(self.weights)
        self.start = 0
        # Weights changed at a resume (`reweight`): the mixture starts at global sample `origin`, after each
        # source's `before` samples.
        self.origin, self.before = 0, [0] * len(config)
        self.orders: dict[tuple[int, int], np.ndarray] = {}  # (source, epoch) -> its window order

    def order(self, s: int, epoch: int) -> np.ndarray:
        if (s, epoch) not in self.orders:
            if epoch and not self.config[s].repeat:
                raise SourceEnded(source_ended(self.config[s].label))
            if epoch:
                logger.info("data: source '%s' starts its epoch %d", self.config[s].label, epoch + 1)
            self.orders = {k: v for k, v in self.orders.items() if k[0] != s}  # one epoch a source held
            self.orders[s, epoch] = np.random.default_rng([self.seed, s, epoch]).permutation(self.windows[s])
        return self.orders[s, epoch]

    def sample(self, k: int) -> Sample:
        s, j = self.mixture.locate(self.start + k - self.origin)
        j += self.before[s]
        epoch, at = divmod(j, self.windows[s])
        n = self.seq_len + 1
        window = torch.from_numpy(self.sources[s].read(int(self.order(s, epoch)[at]) * n, n).astype(np.int64))
        return Sample(window[:-1], window[1:], eos_documents(window[:-1], self.eos_id), torch.full((n - 1,), s))

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "start": self.start, "weights": self.weights, "origin": self.origin,
                "before": list(self.before)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.start = state["start"]
        self.origin, self.before = state.get("origin", 0), list(state.get("before", self.before))

    def reweight(self, saved: dict[str, Any], at: int) -> None:
        """Go on at global sample `at` with this run's weights, after the samples of each source that the saved
        state's weights had taken by then."""
        taken = Mixture(saved["weights"]).taken(at - saved.get("origin", 0))
        self.before = [int(b + t) for b, t in zip(saved.get("before", [0] * len(taken)), taken)]
        self.start = self.origin = at


class PreparedLoader(StatefulDataLoader):
    """The loader of prepared windows, in the training process. Its state also holds the global sample the next
    batch of every rank starts from, so a run resumed on another number of data-parallel ranks or another local
    batch continues the sample sequence there."""

    global_order = True

    def layout(self) -> list[int]:
        return [self.dataset.dp_size, self.dataset.local_batch]

    def next_sample(self) -> int:
        yielded = getattr(self._iterator, "_num_yielded", 0) if self._iterator is not None else 0
        return self.dataset.start + yielded * self.dataset.dp_size * self.dataset.local_batch

    def state_dict(self) -> dict[str, Any]:
        loader = super().state_dict()
        return {"loader": loader, "start": self.dataset.start, "next": self.next_sample(), "layout": self.layout()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state["loader"].get("dataset_state") or {}
        if saved.get("weights", self.dataset.weights) != self.dataset.weights:  # accepted by `SourceShares`
            logger.info("data: new weights %s (were %s): the prepared samples continue at global sample %d",
                        self.dataset.weights, saved["weights"], state["next"])
            self.dataset.reweight(saved, state["next"])
            super().load_state_dict({})
            return
        self.dataset.origin, self.dataset.before = saved.get("origin", 0), list(saved.get("before", self.dataset.before))
        if state["layout"] == self.layout():
            self.dataset.start = state["start"]
            super().load_state_dict(state["loader"])
            return
        logger.info("data: %s ranks x local batch -> %s: the prepared samples continue at global sample %d",
                    state["layout"], self.layout(), state["next"])
        self.dataset.start = state["next"]
        super().load_state_dict({})
