"""What an NSA layer's forward can report about itself (`[metrics] nsa_stats`): the mean gate of
each branch, and how the selection picks its blocks."""

from __future__ import annotations

import torch

from .attention import BRANCHES, Documents, NSASpec, cmp_visibility, masked_attention, select_blocks
from .attention.common import forced_blocks


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


def selected_blocks(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, spec: NSASpec, n_groups: int,
                    docs: Documents | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The sel blocks each query's KV group chose, idx (B, G, T, n') and valid, and the query
    positions t (T,) or (B, 1, T) they count from (within its document with `docs`)."""
    with torch.no_grad():
        T = q.shape[1]
        t = torch.arange(T, device=q.device)
        if docs is None:
            visible = cmp_visibility(spec, T, q.device)
        else:
            visible, t = docs.cmp_visible(spec, 0, T, kc.shape[1])[:, None, None], t - docs.start[:, None, :]
        _, p_cmp = masked_attention(q, kc, vc, visible)
        return *select_blocks(p_cmp, spec, n_groups, docs=docs), t


def selection_stats(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, spec: NSASpec, n_groups: int,
                    docs: Documents | None = None) -> dict[str, torch.Tensor]:
    """Among the chosen sel blocks: the share picked by score (not forced), and how far back
    (in blocks from the query's own) the scored ones lie."""
    idx, valid, t = selected_blocks(q, kc, vc, spec, n_groups, docs)  # (B, G, T, n')
    jt = (t // spec.l_sel)[..., None]  # (T, 1) or (B, 1, T, 1): the block holding t, in its document
    scored = valid & ~forced_blocks(idx, t, spec)
    distance = ((jt - idx) * scored).sum() / scored.sum().clamp_min(1)
    return {"sel_scored_fraction": scored.sum() / valid.sum().clamp_min(1), "sel_scored_distance": distance.float()}
