"""NSA's hyper-parameters as the paper names them (l, d, l', n, w), the blocks every query must select,
and the counts that follow from them (blocks in a sequence, keys a query reads)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

N_FORCED_INITIAL = 1
"""Block 0 is always selected."""
N_FORCED_LOCAL = 2
"""The block holding t and the one before it are always selected."""


@dataclass(frozen=True)
class NSASpec:
    """NSA hyper-parameters, named as in the paper."""

    l: int = 32  # cmp block length
    d: int = 16  # cmp stride
    l_sel: int = 64  # l': sel block length
    n: int = 16  # selected blocks per query, forced ones included
    w: int = 512  # sliding window

    def num_cmp_blocks(self, T: int) -> int:
        """Nc: complete compression blocks in a sequence of T keys."""
        return 0 if T < self.l else (T - self.l) // self.d + 1

    def num_sel_blocks(self, T: int) -> int:
        """Ns: selection blocks (the last may be partial)."""
        return -(-T // self.l_sel)

    def keys_per_query(self, t: torch.Tensor) -> dict[str, torch.Tensor]:
        """Keys the query at position t (a tensor of positions) reads per KV group, by branch: the
        complete cmp blocks in its past, the selected keys (every chosen block in full but the
        current one, which is cut at t: the count the paper's cost argument rests on), the window."""
        jt = torch.div(t, self.l_sel, rounding_mode="floor")
        return {"cmp": torch.clamp(torch.div(t - self.l + 1, self.d, rounding_mode="floor") + 1, min=0),
                "sel": (torch.clamp(jt + 1, max=self.n) - 1) * self.l_sel + (t - jt * self.l_sel + 1),
                "win": torch.clamp(t + 1, max=self.w)}

    def strided_members(self) -> bool:
        """Whether l and l' are multiples of d: then sel block j's cmp members are the l'/d + l/d - 1
        consecutive blocks from j l'/d - l/d + 1 on, which `_pooled` and the kernels' choice add by stride."""
        return self.l % self.d == 0 and self.l_sel % self.d == 0

    def mean_keys_per_query(self, T: int) -> float:
        """Keys a query attends to, over all branches, averaged over t < T."""
        keys = self.keys_per_query(torch.arange(T, dtype=torch.float64, device="cpu"))
        return float(sum(keys.values()).mean())
