"""A synthetic long-range recall task: key-value pairs hidden in filler, asked for far later.

A sequence of seq_len + 1 tokens is filler (random tokens of their own range) with `pairs` pairs
written into it: at position p the pair `KEY k_1..k_K v_1..v_V`, and at p + distance the query
`QUERY k_1..k_K v_1..v_V` (`asks` queries, each at a distance of its own). Keys and values are
random strings of the key-value alphabet, K and V tokens long (several tokens, so that a selection
block's score is not one token's). Only the queries' value tokens are labelled (every other label
is IGNORE): the loss and the accuracy are about recalling them, which needs the pair `distance`
tokens back.

Sample k is a pure function of (seed, k, distances), and ranks and loader workers take samples
as the synthetic source does (`IndexedSamples`), so a loader resumes exactly from its position.
"""

from __future__ import annotations

from dataclasses import dataclass
import torch

from ..config import Recall
from ..models.loss import IGNORE_INDEX
from .batch import Sample
from .synthetic import IndexedSamples

IGNORE = IGNORE_INDEX
"""The label of every position that is not a query's value token (cross-entropy skips it)."""
KEY, QUERY = 0, 1
"""The two marker tokens."""
LOG_STEPS = 256
"""Distances of the `log` scale."""
TRIES = 16
"""Start positions tried per pair before it is left out."""


@dataclass(frozen=True)
class RecallLayout:
    """Token ranges and sizes: markers 0 and 1, the key-value alphabet [2, 2 + A), filler [2 + A, vocab)."""

    seq_len: int
    vocab_size: int
    key_tokens: int = 4
    value_tokens: int = 4
    pairs: int = 4
    asks: int = 1
    drill: bool = False
    distinct: bool = False

    @property
    def alphabet(self) -> int:
        return (self.vocab_size - 2) // 2

    @property
    def span(self) -> int:
        """Tokens of one pair (or one query): the marker, the key, the value."""
        return 1 + self.key_tokens + self.value_tokens

    def check(self, max_distance: int) -> None:
        if self.vocab_size < 8:
            raise ValueError(f"the recall task needs a vocabulary of at least 8 tokens, got {self.vocab_size}")
        if self.drill and self.pairs > self.alphabet:
            raise ValueError(f"a recall drill of {self.pairs} pairs needs as many distinct keys, but the key-value "
                             f"alphabet of vocab_size {self.vocab_size} has {self.alphabet}: lower [recall] pairs")
        if max_distance + 2 * self.span > self.seq_len + 1:
            raise ValueError(f"a recall distance of {max_distance} does not fit in seq_len {self.seq_len} with pairs "
                             f"of {self.span} tokens: use distances <= {self.seq_len + 1 - 2 * self.span}")


def recall_layout(cfg: Recall, seq_len: int, vocab_size: int) -> tuple[RecallLayout, list[int]]:
    """The layout of `[recall]` and the distances training draws from, each equally often (`log`
    scale: LOG_STEPS distances in a geometric series, rounded; `mixed`: those and LOG_STEPS evenly
    spaced ones)."""
    layout = RecallLayout(seq_len, vocab_size, cfg.key_tokens, cfg.value_tokens, cfg.pairs, cfg.asks, cfg.drill,
                          cfg.distinct)
    lo, hi = cfg.min_distance, cfg.max_distance or seq_len + 1 - 2 * layout.span
    if cfg.distance_scale == "linear":
        return layout, list(range(lo, hi + 1))
    log = [round(lo * (hi / lo) ** (i / (LOG_STEPS - 1))) for i in range(LOG_STEPS)]
    even = [round(lo + (hi - lo) * i / (LOG_STEPS - 1)) for i in range(LOG_STEPS)]
    return layout, log if cfg.distance_scale == "log" else log + even


def recall_sample(layout: RecallLayout, seed: int, k: int, distances: list[int]) -> tuple[Sample, list[int]]:
    """Sample k, each pair at a distance drawn from `distances`; also the distance of each query
    placed (pairs that do not fit without overlapping another are left out). The bookkeeping is plain
    Python (a few hundred draws a sample): one-element tensor ops would cost ten times as much."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + k)
    L, A, S = layout.seq_len + 1, layout.alphabet, layout.span
    draw = lambda n: int(torch.randint(n, (1,), generator=gen))  # noqa: E731
    tokens = torch.randint(2 + A, layout.vocab_size, (L,), generator=gen)
    labels = torch.full((L,), IGNORE, dtype=torch.long)
    used = bytearray(L)  # 1 where a pair or query already sits
    placed = []
    KV = layout.key_tokens + layout.value_tokens
    pool = torch.randperm(A, generator=gen)[:layout.pairs * KV].view(layout.pairs, KV) + 2 if layout.distinct else None
    for i in range(layout.pairs):
        for _ in range(TRIES):  # distances and a start at which no two spans overlap
            ds = [distances[draw(len(distances))] for _ in range(layout.asks)]
            p = draw(L - S - max(ds) + 1)
            starts = sorted({p, *(p + d for d in ds)})
            if len(starts) > len(ds) and all(b - a >= S for a, b in zip(starts, starts[1:])) and \
                    not any(any(used[x:x + S]) for x in starts):
                break
        else:
            continue  # no room found: leave this pair out
        kv = pool[i] if pool is not None else torch.randint(2, 2 + A, (KV,), generator=gen)
        tokens[p] = KEY
        tokens[p + 1:p + S] = kv
        for q in (p + d for d in ds):
            tokens[q] = QUERY
            tokens[q + 1:q + S] = kv
            labels[q + 1 + layout.key_tokens:q + S] = kv[layout.key_tokens:]
        for x in starts:
            used[x:x + S] = b"\x01" * S
        placed += ds
    return Sample(tokens[:-1], labels[1:], *torch.zeros(2, L - 1, dtype=torch.long)), placed


def drill_sample(layout: RecallLayout, seed: int, k: int) -> Sample:
    """Sample k of the drill (`[recall] drill`): `pairs` single-token pairs (distinct keys) drawn
    from the key-value alphabet, the row `k v k v ...` of them in random order; a value is labelled
    when its key came earlier in the row."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + k)
    L, A, P = layout.seq_len + 1, layout.alphabet, layout.pairs
    keys = torch.randperm(A, generator=gen)[:P] + 2
    values = torch.randint(2, 2 + A, (P,), generator=gen)
    pick = torch.randint(P, ((L + 1) // 2,), generator=gen)  # the pair at each key position
    tokens = torch.stack([keys[pick], values[pick]], 1).flatten()[:L]
    order = torch.arange(len(pick))
    first = torch.full((P,), len(pick)).scatter_reduce(0, pick, order, "amin")  # each pair's first row slot
    labels = torch.stack([torch.full_like(pick, IGNORE), torch.where(order > first[pick], values[pick], IGNORE)],
                         1).flatten()[:L]
    return Sample(tokens[:-1], labels[1:], *torch.zeros(2, L - 1, dtype=torch.long))


class RecallTokens(IndexedSamples):
    """Yields recall `Sample`s for one data-parallel rank, distances drawn from `distances`; resumable."""

    def __init__(self, layout: RecallLayout, seed: int, distances: list[int], dp_rank: int, dp_size: int,
                 local_batch: int):
        super().__init__(dp_rank, dp_size, local_batch)
        layout.check(max(distances))
        self.layout, self.seed, self.distances = layout, seed, distances

    def sample(self, k: int) -> Sample:
        if self.layout.drill:
            return drill_sample(self.layout, self.seed, k)
        return recall_sample(self.layout, self.seed, k, self.distances)[0]


def oracle_logits(inputs: torch.Tensor, layout: RecallLayout) -> torch.Tensor:
    """(B, T, vocab) logits of a predictor that knows the task: after a query's key, the value that
    followed the same key after a KEY marker earlier (one-hot); elsewhere all zeros."""
    B, T = inputs.shape
    logits = torch.zeros(B, T, layout.vocab_size)
    K, V = layout.key_tokens, layout.value_tokens
    for b in range(B):
        row = inputs[b].tolist()
        pairs = {tuple(row[p + 1:p + 1 + K]): row[p + 1 + K:p + 1 + K + V]
                 for p in range(T - K - V) if row[p] == KEY}
        for q in range(T - K):
            if row[q] == QUERY and tuple(row[q + 1:q + 1 + K]) in pairs:
                value = pairs[tuple(row[q + 1:q + 1 + K])]
                for i, v in enumerate(value):  # position q + K + i predicts value token i
                    if q + K + i < T:
                        logits[b, q + K + i, v] = 1.0
    return logits


def recall_accuracy(predicted: torch.Tensor, labels: torch.Tensor, layout: RecallLayout) -> tuple[int, int]:
    """(queries recalled exactly, queries) of a batch: a query counts when the prediction (B, T), the logits'
    argmax, at every one of its value tokens' positions is the value token."""
    hit = (predicted == labels) | (labels == IGNORE)  # (B, T)
    asked = labels != IGNORE
    # The value tokens of one query are V consecutive labelled positions; queries never touch.
    starts = asked & ~torch.cat([torch.zeros_like(asked[:, :1]), asked[:, :-1]], 1)
    runs = torch.cumsum(starts.long(), 1) * asked  # query number (1-based) at its labelled positions
    correct = 0
    for b in range(labels.shape[0]):
        n = int(runs[b].max())
        if n:
            wrong = torch.zeros(n + 1, dtype=torch.long).index_add_(0, runs[b], (~hit[b]).long())
            correct += int((wrong[1:] == 0).sum())
    return correct, int(starts.sum())
