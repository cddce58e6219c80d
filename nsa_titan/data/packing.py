"""Documents -> shuffled -> tokenized -> joined with <eos> (each begun with <bos> where the tokenizer
has one) -> seq_len + 1 windows, resumably.

The state (epoch, position in the stream, the shuffle buffer's documents, its RNG and the
tokens carried into the next window) is complete: restoring it yields exactly the windows an
uninterrupted run would have yielded next. One instance runs per data-loader worker; the
`datasets` stream hands each worker its own shard files.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Iterator
from typing import Any

import torch
from datasets import IterableDataset as HFIterableDataset
from torch.utils.data import IterableDataset, get_worker_info

from .batch import Sample, eos_documents
from .retry import Retrier
from .tokenizer import Tokenizer


class PackedTextDataset(IterableDataset):
    """Yields `Sample`s of seq_len tokens: inputs, labels, and the document of each input (an
    <eos> ends a document).

    shuffle_buffer: documents held back and emitted in random order (0: stream order).
    epochs: None loops forever (a new epoch reshuffles); 1 for validation.
    """

    def __init__(self, stream: HFIterableDataset, tokenizer: Tokenizer, seq_len: int, text_column: str,
                 shuffle_buffer: int, seed: int, rank: int, epochs: int | None = None,
                 retry: tuple[str, int, float] = ("the data source", 0, 1.0)):
        self.stream, self.tokenizer, self.seq_len = stream, tokenizer, seq_len
        self.retry = retry  # (what, retries, first wait): `Retrier`
        self.text_column, self.shuffle_buffer, self.epochs = text_column, shuffle_buffer, epochs
        self.seed, self.rank = seed, rank
        self.epoch = 0
        self.stream_state: dict | None = None  # position in the current epoch's stream
        self.buffer: list[str] = []
        self.carry: list[int] = []
        self.rng: random.Random | None = None
        self.docs_seen = 0

    def _windows(self, text: str) -> Iterator[Sample]:
        self.docs_seen += 1
        if self.tokenizer.bos_id is not None:
            self.carry.append(self.tokenizer.bos_id)
        self.carry.extend(self.tokenizer.encode(text))
        self.carry.append(self.tokenizer.eos_id)
        n = self.seq_len + 1
        while len(self.carry) >= n:
            window, self.carry = torch.tensor(self.carry[:n]), self.carry[n:]
            yield Sample(window[:-1], window[1:], eos_documents(window[:-1], self.tokenizer.eos_id))

    def _pop(self) -> str:
        i = self.rng.randrange(len(self.buffer))
        self.buffer[i], self.buffer[-1] = self.buffer[-1], self.buffer[i]
        return self.buffer.pop()

    def __iter__(self) -> Iterator[Sample]:
        if self.rng is None:
            worker = get_worker_info().id if get_worker_info() else 0
            self.rng = random.Random(f"{self.seed}/{self.rank}/{worker}")
        # `datasets` keeps the epoch in shared memory so that the main process can set it for
        # all workers; here each worker runs its own epochs, so it needs a private copy.
        self.stream = copy.deepcopy(self.stream)
        while self.epochs is None or self.epoch < self.epochs:
            self.stream.set_epoch(self.epoch)
            had_data = self.stream_state is not None or bool(self.buffer)  # resumed mid-epoch
            for example in self._examples():
                had_data = True
                if self.shuffle_buffer <= 0:
                    yield from self._windows(example[self.text_column])
                    continue
                self.buffer.append(example[self.text_column])
                if len(self.buffer) >= self.shuffle_buffer:
                    yield from self._windows(self._pop())
            while self.buffer:  # end of the stream: drain the buffer
                yield from self._windows(self._pop())
            if not had_data:
                return  # this worker holds no shard: let the others serve
            self.epoch += 1
            self.stream_state = None

    def _examples(self) -> Iterator[dict]:
        """This epoch's documents from the position reached; after a transient read error, read again from
        that position (none skipped or repeated), within the retry budget (`retry.Retrier`)."""
        retrier = Retrier(*self.retry)
        while True:
            if self.stream_state is not None:
                self.stream.load_state_dict(self.stream_state)
            try:
                for example in self.stream:
                    self.stream_state = self.stream.state_dict()
                    retrier.ok()
                    yield example
                return
            except Exception as e:  # noqa: BLE001 - the retrier re-raises what is not transient
                retrier.failed(e)

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch, "stream": self.stream_state, "buffer": list(self.buffer),
            "carry": list(self.carry), "rng": self.rng.getstate() if self.rng else None,
            "docs_seen": self.docs_seen,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.stream_state = state["epoch"], state["stream"]
        self.buffer, self.carry = list(state["buffer"]), list(state["carry"])
        self.docs_seen = state["docs_seen"]
        self.rng = None
        if state["rng"] is not None:
            self.rng = random.Random()
            self.rng.setstate(state["rng"])
