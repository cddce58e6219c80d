"""Packed documents: the per-token geometry that makes every NSA rule apply per document.

A window (B, T) holds documents back to back; `document_ids` changes value where a new one
starts. Token t of a document starting at s and ending before e sees only keys in [s, t], at
document position t - s (RoPE restarts). Its compression blocks start at s + i*d and are kept
as *slots*: all complete blocks of all documents, in order, in a (B, T // d) array (a document of
length L has at most L // d of them, since d <= l, so T // d is a static bound). Its selection
blocks start at s + j*l'. Everything is computed from `document_ids` by cumulative scans: O(T),
no host sync, no T x T tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .common import NSASpec


@dataclass(frozen=True)
class Documents:
    """start, end (B, T) long: the first position of token t's document and the position after its
    last; cmp_start (B, Nc) long: the first key of each cmp slot (T, past every query, for an unused
    slot); first_slot (B, T) long: the slot of block 0 of token t's document; cu_seqlens (N + 1,)
    int32: where each of the N documents of the flattened batch starts (flash-attn's varlen
    layout), only when asked for: sizing it takes one device-to-host sync."""

    start: torch.Tensor
    end: torch.Tensor
    cmp_start: torch.Tensor
    first_slot: torch.Tensor
    cu_seqlens: torch.Tensor | None = None

    @staticmethod
    def of(document_ids: torch.Tensor, spec: NSASpec | None = None, varlen: bool = False) -> "Documents":
        """The geometry of `document_ids` (B, T); cmp slots for `spec` (none without one); the
        varlen boundaries when `varlen`."""
        B, T = document_ids.shape
        dev = document_ids.device
        t = torch.arange(T, device=dev).expand(B, T)
        new = torch.ones(B, T, dtype=torch.bool, device=dev)
        new[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
        start = torch.where(new, t, 0).cummax(1).values
        last = torch.ones_like(new)
        last[:, :-1] = new[:, 1:]
        end = torch.where(last, t + 1, T).flip(1).cummin(1).values.flip(1)
        cu_seqlens = varlen_boundaries(start) if varlen else None
        if spec is None:
            empty = torch.zeros(B, 0, dtype=torch.long, device=dev)
            return Documents(start, end, empty, torch.zeros_like(start), cu_seqlens)
        # Slot flags: a cmp block starts at p when p - s is a multiple of d and p + l <= e.
        begins = ((t - start) % spec.d == 0) & (t + spec.l <= end)
        slot = torch.cumsum(begins, 1) - 1  # the slot of the block starting at p (if it does)
        Nc = T // spec.d
        cmp_start = torch.full((B, Nc + 1), T, dtype=torch.long, device=dev)
        cmp_start.scatter_(1, torch.where(begins, slot, Nc), t)[:, :Nc]
        before = slot + 1 - begins.long()  # slots starting before p
        return Documents(start, end, cmp_start[:, :Nc].contiguous(), before.gather(1, start), cu_seqlens)

    @property
    def positions(self) -> torch.Tensor:
        """(B, T) long: each token's position inside its document (RoPE's position)."""
        return torch.arange(self.start.shape[1], device=self.start.device) - self.start

    def cmp_visible(self, spec: NSASpec, t0: int, t1: int, hi: int) -> torch.Tensor:
        """(B, t1 - t0, hi) bool: query t may attend cmp slot i < hi iff the block is in t's
        document and wholly in its past."""
        t = torch.arange(t0, t1, device=self.start.device)[None, :, None]
        c = self.cmp_start[:, None, :hi]
        return (c >= self.start[:, t0:t1, None]) & (c + spec.l - 1 <= t)

    def same_past(self, t0: int, t1: int, lo: int, hi: int) -> torch.Tensor:
        """(B, t1 - t0, hi - lo) bool: key s in [lo, hi) is in query t's document and s <= t."""
        t = torch.arange(t0, t1, device=self.start.device)[None, :, None]
        s = torch.arange(lo, hi, device=self.start.device)[None, None, :]
        return (s >= self.start[:, t0:t1, None]) & (s <= t)


def varlen_boundaries(start: torch.Tensor) -> torch.Tensor:
    """cu_seqlens (N + 1,) int32 of documents starting at `start` (B, T): the first token of each of
    the N documents in the flattened batch, then B * T. One device-to-host sync (N is data)."""
    B, T = start.shape
    firsts = torch.nonzero((start == torch.arange(T, device=start.device)).flatten()).flatten()
    return torch.cat([firsts, firsts.new_full((1,), B * T)]).to(torch.int32)
