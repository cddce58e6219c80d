"""Packed documents: the per-token geometry that makes every NSA rule apply per document.

A window (B, T) holds documents back to back; `document_ids` changes value where a new one
starts. Token t of a document starting at s and ending before e sees only keys in [s, t], at
document position t - s (RoPE restarts). Its compression blocks start at s + i*d and are kept
as *slots*: all complete blocks of all documents, in order, in a (B, T // d) array (a document of
length L has at most L // d of them, since d <= l, so T // d is a static bound). Its selection
blocks start at s + j*l'. Everything is computed from `document_ids` by cumulative scans: O(T),
no host sync, no T x T tensor.

When the ids are on the host (the data loader's), `ChunkBounds` also keeps, in a small host
tensor, what bounds a chunk of queries: its documents' first keys and slots, and how many sel blocks its
queries can choose by score. The fast path's chunks then read only their documents' keys, so a
window of short documents costs less than an unmasked one, still without a device sync.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .spec import N_FORCED_INITIAL, N_FORCED_LOCAL, NSASpec


@dataclass(frozen=True)
class ChunkBounds:
    """Host-side bounds, over the batch rows, for chunks of queries t0 .. t1 - 1 (see the methods),
    built by `Documents.of` from ids on the host. table (6, T + 1) long, on the host, one row each:
      0  the least first position of t's document,
      1  the least slot of block 0 of t's document,
      2  the most cmp slots wholly at or before t (slots are in order),
      3  prefix sums over t of min(n - 3, max(0, jt - 2)), summed over rows,
      4  prefix sums over t of max(0, jt - 2) where t ends its document, summed over rows,
      5  max(0, jt - 2) at t, summed over rows.
    A tensor, so that a compiled graph takes it as an input (no value guards, no recompiles)."""

    table: torch.Tensor

    @staticmethod
    def of(start: torch.Tensor, end: torch.Tensor, first_slot: torch.Tensor, visible: torch.Tensor, spec: NSASpec
           ) -> "ChunkBounds":
        """From the (B, T) geometry on the host; visible[b, t]: the slots whole at or before t."""
        t = torch.arange(start.shape[1])
        # jt - 2 with jt the sel block holding t in its document: the blocks 1 .. jt - 2 are the
        # only ones a query can choose by score (block 0, jt - 1 and jt are forced).
        blocks = ((t - start) // spec.l_sel - 2).clamp(min=0)
        scored = blocks.clamp(max=max(0, spec.n - N_FORCED_INITIAL - N_FORCED_LOCAL)).sum(0)
        ends = (blocks * (end == t + 1)).sum(0)
        pad = lambda x: torch.nn.functional.pad(x, (0, 1))  # noqa: E731
        prefix = lambda x: torch.nn.functional.pad(x.cumsum(0), (1, 0))  # noqa: E731
        return ChunkBounds(torch.stack([pad(start.min(0).values), pad(first_slot.min(0).values),
                                        pad(visible.max(0).values), prefix(scored), prefix(ends), pad(blocks.sum(0))]))

    def cmp_slots(self, chunks: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """For each chunk (t0, t1): the slots [lo, hi) holding every cmp block a query t0 .. t1 - 1
        sees (those of its document, wholly in its past)."""
        t0, t1 = torch.tensor(chunks).T
        return list(zip(self.table[1, t0].tolist(), self.table[2, t1 - 1].tolist()))

    def window_starts(self, chunks: list[tuple[int, int]], w: int) -> list[int]:
        """For each chunk (t0, t1): the first key a window of its queries reaches."""
        t0 = torch.tensor(chunks)[:, 0]
        return torch.maximum(t0 - w + 1, self.table[0, t0]).tolist()

    def scored_choices(self, t0: int, t1: int) -> tuple[int, int]:
        """Per KV group: the most (query, block) choices by score of the queries t0 .. t1 - 1, and
        the most distinct blocks those can name (blocks 1 .. jt - 2 of each document's last
        query in the chunk)."""
        (s0, _, s1), (b0, b1, _), (_, at, _) = self.table[3:, [t0, t1 - 1, t1]].tolist()
        return s1 - s0, b1 - b0 + at


@dataclass(frozen=True)
class Documents:
    """start, end (B, T) long: the first position of token t's document and the position after its
    last; cmp_start (B, Nc) long: the first key of each cmp slot (T, past every query, for an unused
    slot); first_slot (B, T) long: the slot of block 0 of token t's document; varlen: flash-attn's
    varlen layout (`varlen_boundaries`) for each range (lo, q0, hi) of keys and queries asked for,
    computed once for every layer: sizing it takes one device-to-host sync; block_masks: FlexAttention's
    block masks of the dense baseline's query parts (q0, q1), on the device."""

    start: torch.Tensor
    end: torch.Tensor
    cmp_start: torch.Tensor
    first_slot: torch.Tensor
    varlen: dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    bounds: ChunkBounds | None = None
    block_masks: dict[tuple[int, int], Any] = field(default_factory=dict)  # dense.with_block_masks

    @staticmethod
    def of(document_ids: torch.Tensor, spec: NSASpec | None = None, varlen: Sequence[tuple[int, int, int]] = ()
           ) -> "Documents":
        """The geometry of `document_ids` (B, T); cmp slots for `spec` (none without one); the
        varlen boundaries of the ranges (lo, q0, hi) in `varlen`; host bounds for ids on the CPU."""
        B, T = document_ids.shape
        dev = document_ids.device
        t = torch.arange(T, device=dev).expand(B, T)
        new = torch.ones(B, T, dtype=torch.bool, device=dev)
        new[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
        start = torch.where(new, t, 0).cummax(1).values
        last = torch.ones_like(new)
        last[:, :-1] = new[:, 1:]
        end = torch.where(last, t + 1, T).flip(1).cummin(1).values.flip(1)
        layouts = {r: varlen_boundaries(start, *r) for r in varlen}
        if spec is None:
            empty = torch.zeros(B, 0, dtype=torch.long, device=dev)
            return Documents(start, end, empty, torch.zeros_like(start), layouts)
        # Slot flags: a cmp block starts at p when p - s is a multiple of d and p + l <= e.
        begins = ((t - start) % spec.d == 0) & (t + spec.l <= end)
        slot = torch.cumsum(begins, 1) - 1  # the slot of the block starting at p (if it does)
        Nc = T // spec.d
        cmp_start = torch.full((B, Nc + 1), T, dtype=torch.long, device=dev)
        cmp_start.scatter_(1, torch.where(begins, slot, Nc), t)[:, :Nc]
        before = slot + 1 - begins.long()  # slots starting before p
        first_slot = before.gather(1, start)
        bounds = None
        if dev.type == "cpu":  # slot i is visible from t = start + l - 1 on
            visible = torch.nn.functional.pad(torch.cumsum(begins, 1), (spec.l - 1, 0))[:, :T]
            bounds = ChunkBounds.of(start, end, first_slot, visible, spec)
        return Documents(start, end, cmp_start[:, :Nc].contiguous(), first_slot, layouts, bounds)

    def to(self, device: torch.device) -> "Documents":
        """The same geometry with its tensors on `device` (the host bounds stay)."""
        move = lambda x: x.to(device, non_blocking=True)  # noqa: E731
        return Documents(move(self.start), move(self.end), move(self.cmp_start), move(self.first_slot),
                         {r: (move(a), move(b)) for r, (a, b) in self.varlen.items()}, self.bounds)

    @property
    def positions(self) -> torch.Tensor:
        """(B, T) long: each token's position inside its document (RoPE's position)."""
        return torch.arange(self.start.shape[1], device=self.start.device) - self.start

    def cmp_visible(self, spec: NSASpec, t0: int, t1: int, hi: int, lo: int = 0) -> torch.Tensor:
        """(B, t1 - t0, hi - lo) bool: query t may attend cmp slot lo <= i < hi iff the block is in
        t's document and wholly in its past."""
        t = torch.arange(t0, t1, device=self.start.device)[None, :, None]
        c = self.cmp_start[:, None, lo:hi]
        return (c >= self.start[:, t0:t1, None]) & (c + spec.l - 1 <= t)

    def same_past(self, t0: int, t1: int, lo: int, hi: int) -> torch.Tensor:
        """(B, t1 - t0, hi - lo) bool: key s in [lo, hi) is in query t's document and s <= t."""
        t = torch.arange(t0, t1, device=self.start.device)[None, :, None]
        s = torch.arange(lo, hi, device=self.start.device)[None, None, :]
        return (s >= self.start[:, t0:t1, None]) & (s <= t)


def varlen_boundaries(start: torch.Tensor, lo: int = 0, q0: int = 0, hi: int | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """flash-attn's varlen layout of the queries q0 .. hi - 1 against the keys lo .. hi - 1 (lo <= q0;
    default: the whole sequence) of documents starting at `start` (B, T): cu_seqlens_q and
    cu_seqlens_k (N + 1,) int32, where each of the N documents that have keys in the range starts
    in the flattened queries and keys, then their totals. A document with keys but no queries is an
    empty query sequence; every document's queries and keys end together, as the causal alignment
    at the bottom right needs. One device-to-host sync (N is data)."""
    B, T = start.shape
    hi = T if hi is None else hi
    pos = torch.arange(lo, hi, device=start.device)
    first = start[:, lo:hi] == pos
    first[:, 0] = True  # the range's first key begins a document's part
    b, p = torch.nonzero(first, as_tuple=True)
    cu_k = b * (hi - lo) + p
    cu_q = b * (hi - q0) + (p + lo - q0).clamp(min=0)
    return (torch.cat([cu_q, cu_q.new_full((1,), B * (hi - q0))]).to(torch.int32),
            torch.cat([cu_k, cu_k.new_full((1,), B * (hi - lo))]).to(torch.int32))
