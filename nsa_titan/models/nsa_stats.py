"""What an NSA layer's forward can report about itself (`[metrics] nsa_stats`): the mean gate of
each branch, and how the selection picks its blocks."""

from __future__ import annotations

import torch

from .attention import BRANCHES, Documents, NSASpec
from .attention.common import forced_blocks, query_positions


def gate_stats(gates: torch.Tensor, tokens: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Mean gate of each branch, and the mean entropy (nats) of the normalised gate mix, of gates (B, T, H, 3);
    with `tokens` (B, T) bool, also each branch's mean gate over those tokens (`gate_sel_labelled`, ...)."""
    g = gates.detach().float().flatten(0, 2)  # (B*T*H, 3)
    p = g / g.sum(-1, keepdim=True).clamp_min(1e-12)
    entropy = -(p * p.clamp_min(1e-12).log()).sum(-1).mean()
    stats = {f"gate_{b}": g[:, i].mean() for i, b in enumerate(BRANCHES)}
    if tokens is not None:
        at = gates.detach().float()[tokens].flatten(0, 1)  # (tokens x H, 3)
        stats |= {f"gate_{b}_labelled": at[:, i].mean() for i, b in enumerate(BRANCHES)}
    return stats | {"gate_entropy": entropy}


def selection_stats(idx: torch.Tensor, valid: torch.Tensor, spec: NSASpec, docs: Documents | None = None
                    ) -> dict[str, torch.Tensor]:
    """Among the sel blocks idx (B, G, T, n') that each query's group read (`valid`): the share
    picked by score (not forced), and how far back (in blocks from the query's own) the scored
    ones lie. With `docs`, positions and blocks count from each query's document start."""
    t = query_positions(0, idx.shape[2], idx.device, docs)[:, None]  # (1 or B, 1, T)
    jt = (t // spec.l_sel)[..., None]  # (1 or B, 1, T, 1): the block holding t, in its document
    scored = valid & ~forced_blocks(idx, t, spec)
    distance = ((jt - idx) * scored).sum() / scored.sum().clamp_min(1)
    return {"sel_scored_fraction": scored.sum() / valid.sum().clamp_min(1), "sel_scored_distance": distance.float()}
