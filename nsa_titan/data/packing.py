"""Documents of one or more sources -> (a seeded choice of source per document, by weight) -> shuffled ->
tokenized -> joined with <eos> (each begun with <bos> where the tokenizer has one) -> seq_len + 1 windows,
resumably.

The state (each source's epoch and position in its stream, the shuffle buffer's documents, the RNG and the
tokens carried into the next window) is complete: restoring it yields exactly the windows an uninterrupted
run would have yielded next. One instance runs per data-loader worker; the `datasets` stream hands each
worker its own shard files.
"""

from __future__ import annotations

import copy
import logging
import random
from collections.abc import Iterator
from typing import Any

import torch
from datasets import IterableDataset as HFIterableDataset
from torch.utils.data import IterableDataset, get_worker_info

from ..config import Source
from .batch import Sample, eos_documents
from .errors import DataError
from .retry import Retrier
from .sources import document_text
from .tokenizer import Tokenizer, document_tokens

logger = logging.getLogger(__name__)

EPOCH_END = "\0end of a source's epoch"
"""What a source's documents hold between its epochs (compared by identity)."""


class PackedTextDataset(IterableDataset):
    """Yields `Sample`s of seq_len tokens: inputs, labels, the document of each input (an <eos> ends a
    document) and its source.

    streams: one `datasets` stream per source of `sources` (weights, length bounds, repeat).
    shuffle_buffer: documents held back and emitted in random order (0: stream order).
    retry: (read_retries, first wait in seconds) of a remote source (`Retrier`).
    bad_documents: what a document that holds no text is, as `[data] bad_documents` says (`document_text`).
    epochs: None reads each source forever (a new epoch reshuffles); 1 for validation.
    """

    def __init__(self, streams: list[HFIterableDataset], sources: list[Source], tokenizer: Tokenizer, seq_len: int,
                 shuffle_buffer: int, seed: int, rank: int, retry: tuple[int, float] = (0, 1.0),
                 bad_documents: str = "error", epochs: int | None = None):
        self.streams, self.sources, self.tokenizer, self.seq_len = streams, sources, tokenizer, seq_len
        self.bad_documents = bad_documents
        self.retry, self.shuffle_buffer, self.epochs = retry, shuffle_buffer, epochs
        self.seed, self.rank = seed, rank
        self.weights = [s.weight for s in sources]
        self.epoch = [0] * len(sources)  # each source's epoch
        self.stream_state: list[dict | None] = [None] * len(sources)  # position in its current epoch's stream
        self.kept = [0] * len(sources)  # documents within its length bounds in its current epoch
        self.buffer: list[tuple[int, str]] = []  # (source, text)
        self.carry: list[int] = []
        self.carry_sources: list[int] = []
        self.rng: random.Random | None = None
        self.draining: int | None = None  # the source whose documents the buffer is being emptied of
        self.docs_seen = 0

    def _windows(self, source: int, text: str) -> Iterator[Sample]:
        self.docs_seen += 1
        tokens = document_tokens(self.tokenizer, text)
        self.carry.extend(tokens)
        self.carry_sources.extend([source] * len(tokens))
        n = self.seq_len + 1
        while len(self.carry) >= n:
            window, self.carry = torch.tensor(self.carry[:n]), self.carry[n:]
            sources, self.carry_sources = torch.tensor(self.carry_sources[:n - 1]), self.carry_sources[n:]
            yield Sample(window[:-1], window[1:], eos_documents(window[:-1], self.tokenizer.eos_id), sources)

    def _drain(self, source: int | None) -> Iterator[Sample]:
        """Empty the buffer of `source`'s documents (None: all), in random order: a source's epoch ends with its
        every document read. Recorded in the state, so that a restore mid-way finishes it."""
        self.draining = source
        while at := [k for k, (s, _) in enumerate(self.buffer) if source is None or s == source]:
            yield from self._emit(at[self.rng.randrange(len(at))])
        self.draining = None

    def _emit(self, k: int) -> Iterator[Sample]:
        """The windows of the buffer's document k, which leaves the buffer."""
        self.buffer[k], self.buffer[-1] = self.buffer[-1], self.buffer[k]
        yield from self._windows(*self.buffer.pop())

    def __iter__(self) -> Iterator[Sample]:
        worker = get_worker_info().id if get_worker_info() else 0
        if self.rng is None:
            self.rng = random.Random(f"{self.seed}/{self.rank}/{worker}")
        # `datasets` keeps the epoch in shared memory so that the main process can set it for
        # all workers; here each worker runs its own epochs, so it needs private copies.
        self.streams = [copy.deepcopy(s) for s in self.streams]
        documents = [self._documents(i, worker) for i in range(len(self.sources))]
        if self.draining is not None:  # restored mid-way through a drain
            yield from self._drain(self.draining)
        while True:
            i = 0 if len(self.sources) == 1 else self.rng.choices(range(len(self.sources)), self.weights)[0]
            text = next(documents[i], None)
            if text is None:  # read to the end: validation's one epoch, or a worker that holds no shard of it
                break
            if text is EPOCH_END or self.shuffle_buffer <= 0:
                yield from self._drain(i) if text is EPOCH_END else self._windows(i, text)
                continue
            self.buffer.append((i, text))
            if len(self.buffer) >= self.shuffle_buffer:
                yield from self._emit(self.rng.randrange(len(self.buffer)))
        yield from self._drain(None)

    def _documents(self, i: int, worker: int) -> Iterator[str]:
        """Source i's documents within its length bounds, epoch after epoch from the position reached, each
        epoch followed by EPOCH_END; ends when `epochs` are read, or at once where this worker holds none of
        its shards."""
        src, stream = self.sources[i], self.streams[i]
        while self.epochs is None or self.epoch[i] < self.epochs:
            stream.set_epoch(self.epoch[i])
            had_data = self.stream_state[i] is not None  # resumed mid-epoch
            for example in self._examples(i):
                had_data = True
                text = document_text(example, src, stream, self.bad_documents)
                if text is None:
                    continue
                if src.min_tokens or src.max_tokens:
                    n = len(document_tokens(self.tokenizer, text))
                    if n < src.min_tokens or (src.max_tokens and n > src.max_tokens):
                        continue
                self.kept[i] += 1
                yield text
            if not had_data:
                if len(self.sources) > 1:
                    raise DataError(f"[[data.sources]] '{src.label}': loader worker {worker} of rank {self.rank} "
                                    f"holds none of its files: a mixture's every source needs at least ranks x "
                                    f"[data] num_workers files (or prepare it: python -m nsa_titan.data.prepare)")
                return  # let the other workers serve
            if not self.kept[i]:
                raise DataError(f"[[data.sources]] '{src.label}': no document has between min_tokens = "
                                f"{src.min_tokens} and max_tokens = {src.max_tokens or 'any'} tokens (in the files of "
                                f"rank {self.rank}, loader worker {worker}): widen the bounds")
            self.epoch[i] += 1
            self.stream_state[i], self.kept[i] = None, 0
            yield EPOCH_END
            if self.epochs is None:
                if not src.repeat:
                    raise DataError(f"[[data.sources]] '{src.label}' is read to its end and repeat = false: the run "
                                    f"stops here (set repeat = true to read it again, reshuffled)")
                logger.info("data: source '%s' starts its epoch %d (rank %d, loader worker %d)", src.label,
                            self.epoch[i] + 1, self.rank, worker)

    def _examples(self, i: int) -> Iterator[dict]:
        """Source i's documents from the position reached in this epoch; after a transient read error, read
        again from that position (none skipped or repeated), within the retry budget (`retry.Retrier`)."""
        retrier, stream = Retrier(f"[data] path = '{self.sources[i].path}'", *self.retry), self.streams[i]
        while True:
            if self.stream_state[i] is not None:
                stream.load_state_dict(self.stream_state[i])
            try:
                for example in stream:
                    self.stream_state[i] = stream.state_dict()
                    retrier.ok()
                    yield example
                return
            except Exception as e:  # noqa: BLE001 - the retrier re-raises what is not transient
                retrier.failed(e)

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": list(self.epoch), "stream": list(self.stream_state), "kept": list(self.kept),
            "buffer": list(self.buffer), "carry": list(self.carry), "carry_sources": list(self.carry_sources),
            "rng": self.rng.getstate() if self.rng else None, "docs_seen": self.docs_seen, "draining": self.draining,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if len(state["epoch"]) != len(self.sources):
            raise DataError(f"the saved data position is of {len(state['epoch'])} sources and [data] now has "
                            f"{len(self.sources)}: resume with the same [[data.sources]], or leave the position out "
                            f"(--checkpoint.exclude_from_loading dataloader)")
        self.epoch, self.stream_state, self.kept = list(state["epoch"]), list(state["stream"]), list(state["kept"])
        self.buffer, self.carry = list(state["buffer"]), list(state["carry"])
        self.carry_sources, self.docs_seen, self.draining = list(state["carry_sources"]), state["docs_seen"], \
            state["draining"]
        self.rng = None
        if state["rng"] is not None:
            self.rng = random.Random()
            self.rng.setstate(state["rng"])
