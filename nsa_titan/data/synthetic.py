"""A seeded synthetic token stream with learnable structure, for debugging without files.

Sequences are runs of "words" (fixed random token strings of length 2..8) drawn from a
Zipf distribution over a word bank: inside a word the next token is certain, at a word
boundary it follows the Zipf law, so a model's loss visibly falls from ln(vocab).
Each window is cut into documents (a new one starts at a token with probability 4 / seq_len,
so about 4 per window), which document masking uses; the tokens do not depend on the cut.
Sample k is a pure function of (seed, k), and rank r of R ranks takes, for batch b, the
samples b*R*L + r*L .. b*R*L + (r+1)*L - 1 (L = local batch): the union over ranks is
exactly the batch a single process with local batch R*L would see.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch
from torch.utils.data import IterableDataset, get_worker_info

from .batch import Sample

WORDS = 512
"""Size of the word bank."""


class IndexedSamples(IterableDataset):
    """A stream of samples that are pure functions of their global index (`sample(k)`), shared out
    among data-parallel ranks and loader workers; its state is the position, so it resumes exactly."""

    def __init__(self, dp_rank: int, dp_size: int, local_batch: int):
        self.dp_rank, self.dp_size, self.local_batch = dp_rank, dp_size, local_batch
        self.position = 0  # samples this rank (or loader worker) has yielded

    def sample(self, k: int) -> Sample:
        raise NotImplementedError

    def global_index(self, position: int, worker: int = 0, num_workers: int = 1) -> int:
        """Global sample index of a worker's `position`-th sample.

        Loader workers take whole batches in turn (worker w: batches w, w+W, ...), which is
        the order in which the DataLoader collects them.
        """
        batch, i = divmod(position, self.local_batch)
        batch = batch * num_workers + worker
        return batch * self.dp_size * self.local_batch + self.dp_rank * self.local_batch + i

    def __iter__(self) -> Iterator[Sample]:
        info = get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info else (0, 1)
        while True:
            sample = self.sample(self.global_index(self.position, worker, num_workers))
            self.position += 1
            yield sample

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = state["position"]


class SyntheticTokens(IndexedSamples):
    """Yields `Sample`s of seq_len tokens for one data-parallel rank; resumable."""

    def __init__(self, seed: int, seq_len: int, vocab_size: int, dp_rank: int, dp_size: int, local_batch: int):
        super().__init__(dp_rank, dp_size, local_batch)
        self.seed, self.seq_len, self.vocab_size = seed, seq_len, vocab_size
        gen = torch.Generator().manual_seed(seed)
        lengths = torch.randint(2, 9, (WORDS,), generator=gen)
        self.word_tokens = [torch.randint(0, vocab_size, (int(n),), generator=gen) for n in lengths]
        ranks = torch.arange(1, WORDS + 1, dtype=torch.float64)
        self.word_probs = ranks.pow(-1.1) / ranks.pow(-1.1).sum()

    def sample(self, k: int) -> Sample:
        """Global sample k: seq_len + 1 tokens as inputs and labels, and the inputs' documents."""
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + k)
        words = torch.multinomial(self.word_probs, self.seq_len // 2 + 1, replacement=True, generator=gen)
        tokens = torch.cat([self.word_tokens[w] for w in words.tolist()])[: self.seq_len + 1]
        starts = torch.rand(self.seq_len, generator=gen) < 4 / self.seq_len
        return Sample(tokens[:-1], tokens[1:], torch.cumsum(starts.long(), 0), torch.zeros_like(tokens[1:]))
