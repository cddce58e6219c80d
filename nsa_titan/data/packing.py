"""Documents of one or more sources -> each source's own shuffle buffer -> the next document from the source
furthest below its weight's share of the tokens -> tokenized -> joined with <eos> (each begun with <bos> where
the tokenizer has one) -> seq_len + 1 windows, resumably.

A weight is a share of tokens, as in a prepared run (`prepared.Mixture`): the next document comes from the
source whose tokens so far with half of that document's, divided by its weight, are the fewest, so each
source's tokens stay within one document of its share at every window, above it as often as below. The state (each source's epoch, position in its stream and tokens, the
shuffle buffer's documents, the RNG and the tokens carried into the next window) is complete: restoring it
yields exactly the windows an uninterrupted run would have yielded next. One instance runs per data-loader
worker; the `datasets` stream hands each worker its own shard files.
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
from .errors import DataError, SourceEnded, source_ended
from .retry import Retrier
from .sources import document_text
from .tokenizer import Tokenizer, document_tokens

logger = logging.getLogger(__name__)

EPOCH_END = "\0end of a source's epoch"
"""What a source's documents hold between its epochs (compared by identity)."""


class PackedTextDataset(IterableDataset):
    """Yields `Sample`s of seq_len tokens: inputs, labels, the document of each input (an <eos> ends a
    document) and its source.

    streams: one `datasets` stream per source of `sources` (weights: shares of tokens, length bounds, repeat).
    shuffle_buffer: documents held back, shared out among the sources, and emitted in random order (0: stream
    order).
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
        self.tokens = [0] * len(sources)  # the tokens of its documents emitted (the mixer's measure)
        self.buffer: list[tuple[int, str]] = []  # (source, text)
        self.carry: list[int] = []
        self.carry_sources: list[int] = []
        self.rng: random.Random | None = None
        self.draining = [False] * len(sources)  # its epoch read: its buffered documents go out before the next's
        self.next: list[str | None] = [None] * len(sources)  # its next document, drawn from the buffer
        self._tokenized: list[tuple[str, list[int]] | None] = [None] * len(sources)  # (next document, its tokens)
        self.docs_seen = 0

    def _windows(self, source: int, tokens: list[int]) -> Iterator[Sample]:
        self.docs_seen += 1
        self.tokens[source] += len(tokens)
        self.carry.extend(tokens)
        self.carry_sources.extend([source] * len(tokens))
        n = self.seq_len + 1
        while len(self.carry) >= n:
            window, self.carry = torch.tensor(self.carry[:n]), self.carry[n:]
            sources, self.carry_sources = torch.tensor(self.carry_sources[:n - 1]), self.carry_sources[n:]
            yield Sample(window[:-1], window[1:], eos_documents(window[:-1], self.tokenizer.eos_id), sources)

    def _tokens(self, i: int) -> list[int]:
        """The tokens of source i's next document (`next`), tokenized once."""
        if self._tokenized[i] is None or self._tokenized[i][0] is not self.next[i]:
            self._tokenized[i] = (self.next[i], document_tokens(self.tokenizer, self.next[i]))
        return self._tokenized[i][1]

    def __iter__(self) -> Iterator[Sample]:
        worker = get_worker_info().id if get_worker_info() else 0
        if self.rng is None:
            self.rng = random.Random(f"{self.seed}/{self.rank}/{worker}")
        # `datasets` keeps the epoch in shared memory so that the main process can set it for
        # all workers; here each worker runs its own epochs, so it needs private copies.
        self.streams = [copy.deepcopy(s) for s in self.streams]
        documents = [self._documents(i, worker) for i in range(len(self.sources))]
        ended: set[int] = set()  # read to the end: validation's one epoch, or a worker that holds no shard of it
        while True:
            for s in range(len(self.sources)):
                if self.next[s] is None and s not in ended:
                    self.next[s] = self._next_document(s, documents[s])
                    if self.next[s] is None:
                        ended.add(s)
            live = [s for s in range(len(self.sources)) if self.next[s] is not None]
            if not live:
                return
            # The source whose tokens, with half its next document's, are furthest below its weight's share.
            i = min(live, key=lambda s: (self.tokens[s] + len(self._tokens(s)) / 2) / self.weights[s])
            tokens, self.next[i] = self._tokens(i), None
            yield from self._windows(i, tokens)

    def _next_document(self, i: int, documents: Iterator[str]) -> str | None:
        """Source i's next document: a random one of its share of the shuffle buffer, topped up first (its
        next epoch's documents wait until the buffer holds none of this epoch's). None: it has no more."""
        per_source = max(1, self.shuffle_buffer // len(self.sources))
        while True:
            held = [k for k, (s, _) in enumerate(self.buffer) if s == i]
            while not self.draining[i] and len(held) < per_source:
                text = next(documents, None)
                if text is None:
                    break
                if text is EPOCH_END:
                    self.draining[i] = True
                    break
                if self.shuffle_buffer <= 0:
                    return text
                held.append(len(self.buffer))
                self.buffer.append((i, text))
            if held:
                k = held[self.rng.randrange(len(held))]
                self.buffer[k], self.buffer[-1] = self.buffer[-1], self.buffer[k]
                return self.buffer.pop()[1]
            if not self.draining[i]:
                return None
            self.draining[i] = False

    def _documents(self, i: int, worker: int) -> Iterator[str]:
        """Source i's documents within its length bounds, epoch after epoch from the position reached, each
        epoch followed by EPOCH_END; ends when `epochs` are read, or at once where this worker holds none of
        its shards."""
        src, stream = self.sources[i], self.streams[i]
        while self.epochs is None or self.epoch[i] < self.epochs:
            if self.epoch[i] and self.epochs is None and not src.repeat:  # also where a restored state is past it
                raise SourceEnded(source_ended(src.label))
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
            if self.epochs is None and src.repeat:
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
            "tokens": list(self.tokens), "weights": list(self.weights),
            "buffer": list(self.buffer), "carry": list(self.carry), "carry_sources": list(self.carry_sources),
            "rng": self.rng.getstate() if self.rng else None, "docs_seen": self.docs_seen,
            "draining": list(self.draining), "next": list(self.next),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if len(state["epoch"]) != len(self.sources):
            raise DataError(f"the saved data position is of {len(state['epoch'])} sources and [data] now has "
                            f"{len(self.sources)}: resume with the same [[data.sources]], or leave the position out "
                            f"(--checkpoint.exclude_from_loading dataloader)")
        if "tokens" not in state:
            raise DataError("the saved data position is of a version that mixed sources by documents, not tokens: "
                            "leave it out (--checkpoint.exclude_from_loading dataloader) to restart the data stream")
        self.epoch, self.stream_state, self.kept = list(state["epoch"]), list(state["stream"]), list(state["kept"])
        self.buffer, self.carry = list(state["buffer"]), list(state["carry"])
        self.carry_sources, self.docs_seen, self.draining = list(state["carry_sources"]), state["docs_seen"], \
            list(state["draining"])
        self.next = list(state["next"])
        # New weights (accepted at the resume, `SourceShares`): the mixer measures the tokens from here.
        self.tokens = list(state["tokens"]) if state["weights"] == self.weights else [0] * len(self.sources)
        self.rng = None
        if state["rng"] is not None:
            self.rng = random.Random()
            self.rng.setstate(state["rng"])
