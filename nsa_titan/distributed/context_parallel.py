"""Context parallelism: each sequence split across the cp ranks of a data-parallel group.

Every cp rank holds its group's whole (B, T) batch (the loader gives them the same sequences) and
computes the tokens of two of its 2 x cp chunks, a zigzag: rank c takes chunks c and 2cp - 1 - c,
so under causal attention every rank has as many cheap early queries as costly late ones. The
sequence is first padded at its end to a multiple of 2 x cp x l' (`cp_multiple`: each chunk starts
on a sel block, where the fast path can start a part of the queries); attention never reads forward,
so the padding changes no real token. Only attention mixes tokens: it all-gathers its keys and
values (one collective per layer; autograd reduce-scatters their gradients back) and computes its
own queries against the whole sequence, so the cmp blocks, the selection and the window are exactly
those of the unsplit sequence.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol



@dataclass(frozen=True)
class ContextSplit:
    """The zigzag split of this rank (`rank` of `size` in `group`); `multiple`: see `cp_multiple`."""

    group: dist.ProcessGroup
    rank: int
    size: int
    multiple: int

    def padded(self, T: int) -> int:
        """The padded sequence length."""
        return -(-T // self.multiple) * self.multiple

    def chunks(self, T: int) -> list[tuple[int, int]]:
        """(start, end) in the padded sequence of this rank's two chunks, in order."""
        c = self.padded(T) // (2 * self.size)
        return [(i * c, (i + 1) * c) for i in (self.rank, 2 * self.size - 1 - self.rank)]

    def positions(self, T: int, device: torch.device) -> torch.Tensor:
        """The padded sequence's positions this rank computes (Tl,), its two chunks concatenated."""
        return torch.cat([torch.arange(a, b, device=device) for a, b in self.chunks(T)])

    def pad(self, x: torch.Tensor, value: int) -> torch.Tensor:
        """(B, T, ...) -> (B, padded(T), ...), filled with `value` at the end."""
        extra = self.padded(x.shape[1]) - x.shape[1]
        return torch.cat([x, x.new_full((x.shape[0], extra, *x.shape[2:]), value)], 1) if extra else x

    def shard(self, x: torch.Tensor, value: int) -> torch.Tensor:
        """This rank's tokens of x (B, T, ...), padded with `value`: (B, Tl, ...)."""
        return self.pad(x, value)[:, self.positions(x.shape[1], x.device)]

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's x (B, Tl, ...) -> the padded sequence's (B, 2 x cp x Tl / 2, ...) in position order;
        differentiable (the gradient of each rank's part returns to it, summed over ranks)."""
        B, Tl = x.shape[:2]
        every = funcol.all_gather_single_autograd(x.contiguous(), 1, self.group)  # rank order: r's chunks 2r, 2r+1
        # Chunk c of the sequence is rank c's first (c < cp) or rank 2cp - 1 - c's second chunk.
        order = [2 * c if c < self.size else 2 * (2 * self.size - 1 - c) + 1 for c in range(2 * self.size)]
        return every.view(B, 2 * self.size, Tl // 2, *x.shape[2:])[:, order].reshape(B, self.size * Tl, *x.shape[2:])


def gather_keys(split: ContextSplit | None, kv: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This rank's keys and values (B, Tl, G, D) -> the whole padded sequence's, in one all-gather
    (without context parallelism they are the whole sequence's already)."""
    if split is None:
        return kv
    return dict(zip(kv, split.gather(torch.stack(list(kv.values()), 2)).unbind(2)))


def attend_in_parts(split: ContextSplit | None, T: int, attend: Callable[..., torch.Tensor]) -> torch.Tensor:
    """`attend(rows)` for every query without context parallelism; with it `attend(rows, q0=a)` for
    each of this rank's chunks (rows: its rows of the rank's tokens, a: its first position among
    the T keys of the padded sequence), concatenated in the rank's token order."""
    if split is None:
        return attend(slice(None))
    chunks = split.chunks(T)
    c = chunks[0][1] - chunks[0][0]
    return torch.cat([attend(slice(i * c, (i + 1) * c), q0=a) for i, (a, _) in enumerate(chunks)], 1)
