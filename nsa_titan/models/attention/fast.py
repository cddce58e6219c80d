"""Fast NSA attention in PyTorch: the cost grows with the keys a query attends to, not with T^2.

Queries are processed in chunks of C. For a chunk, each branch touches only its own keys:
  cmp: the Nc = (T - l)/d + 1 compressed keys (visible ones), C x Nc scores;
  sel: the n chosen blocks of l' keys per (query, KV group), gathered once per group and shared
       by its H/G query heads (the paper's group-centric loading), C x n*l' scores;
  win: the C + w - 1 keys that cover the chunk's windows, C x (C + w - 1) scores.
No T x T tensor exists. Each chunk runs under non-reentrant activation checkpointing, so the
backward pass recomputes its scores instead of storing them: peak memory is one chunk's working
set plus O(T) inputs and outputs. Shapes depend only on T, so there is no host sync and no
data-dependent Python control flow; the loop is over chunks, not tokens.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from .common import NSASpec, cmp_to_sel_map, masked_softmax, select_blocks, selected_keys

CHUNK = 64
"""Queries per chunk: bounds the working set (C x n x l' gathered keys per KV group)."""


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q (B, G, r, C, D); k, v (B, G, [C,] S, D) shared by a group's r heads; mask broadcastable to
    (B, G, r, C, S). fp32 softmax; rows with no key give 0. Returns (out (B, G, r, C, D), probs)."""
    if k.shape[-2] == 0:  # no key at all (cmp before the first complete block)
        return torch.zeros_like(q), q.new_zeros(*q.shape[:-1], 0)
    per_query = k.dim() == 5  # keys gathered for each query (sel) rather than shared by the chunk
    eq = "bgrcd,bgcsd->bgrcs" if per_query else "bgrcd,bgsd->bgrcs"
    p = masked_softmax(torch.einsum(eq, q, k) * q.shape[-1] ** -0.5, mask)
    eq = "bgrcs,bgcsd->bgrcd" if per_query else "bgrcs,bgsd->bgrcd"
    return torch.einsum(eq, p, v), p


def _chunk(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor,
           kw: torch.Tensor, vw: torch.Tensor, gates: torch.Tensor, sel_map: torch.Tensor, t0: int,
           spec: NSASpec) -> torch.Tensor:
    """NSA for queries t0 .. t0 + C - 1 of one chunk.

    q (B, G, r, C, D) in fp32; kc, vc (B, G, Nc, D); ks, vs (B, G, Ns * l', D) padded to whole
    blocks; kw, vw (B, G, T, D); gates (B, G, r, C, 3).
    Returns (B, G, r, C, D).
    """
    B, G, r, C, D = q.shape
    T, Nc = kw.shape[2], kc.shape[2]
    dev = q.device
    t = torch.arange(t0, t0 + C, device=dev)  # (C,) absolute query positions

    # cmp: every complete compressed block in the past; only the first Nv can be visible here.
    Nv = min(Nc, max(0, (t0 + C - spec.l) // spec.d + 1))
    i = torch.arange(Nv, device=dev)
    o_cmp, p_cmp = _attend(q, kc[:, :, :Nv], vc[:, :, :Nv], (i * spec.d + spec.l - 1)[None, :] <= t[:, None])

    # sel: top-n blocks per (query, group) from the group-summed cmp probabilities.
    idx, valid = select_blocks(p_cmp.reshape(B, G * r, C, Nv), spec, G, t0=t0, T=T, sel_map=sel_map)  # (B, G, C, n')
    _, ok = selected_keys(idx, valid, spec, t)  # (B, G, C, n'*l')
    # Whole blocks are copied (index_select of l' x D rows), not single keys.
    Ns = ks.shape[2] // spec.l_sel
    flat = (torch.arange(B * G, device=dev).view(B, G, 1, 1) * Ns + idx).flatten()  # (B*G*C*n',)
    gather = lambda x: x.reshape(B * G * Ns, spec.l_sel, D).index_select(0, flat).view(B, G, C, -1, D)  # noqa: E731
    o_sel, _ = _attend(q, gather(ks), gather(vs), ok[:, :, None])

    # win: the keys covering this chunk's windows, [t0 - w + 1, t0 + C - 1].
    lo = max(0, t0 - spec.w + 1)
    hi = min(T, t0 + C)
    s = torch.arange(lo, hi, device=dev)
    win = (s[None, :] <= t[:, None]) & (s[None, :] > t[:, None] - spec.w)
    o_win, _ = _attend(q, kw[:, :, lo:hi], vw[:, :, lo:hi], win)

    return gates[..., 0:1] * o_cmp + gates[..., 1:2] * o_sel + gates[..., 2:3] * o_win


def nsa_fast(
    q: torch.Tensor,
    k_cmp: torch.Tensor,
    v_cmp: torch.Tensor,
    k_sel: torch.Tensor,
    v_sel: torch.Tensor,
    k_win: torch.Tensor,
    v_win: torch.Tensor,
    gates: torch.Tensor,
    spec: NSASpec,
) -> torch.Tensor:
    """Same contract as `nsa_reference` (see there), computed chunk by chunk."""
    B, T, H, D = q.shape
    G = k_sel.shape[2]
    acc = torch.promote_types(q.dtype, torch.float32)
    # (B, G, r, T, D) queries and gates; (B, G, S, D) keys and values, all in the accumulation dtype.
    qg = q.to(acc).transpose(1, 2).reshape(B, G, H // G, T, D)
    gg = gates.to(acc).transpose(1, 2).reshape(B, G, H // G, T, 3)
    kv = [x.to(acc).transpose(1, 2) for x in (k_cmp, v_cmp, k_sel, v_sel, k_win, v_win)]
    # sel keys as whole blocks: (B, G, Ns * l', D), zero-padded past T (those keys are masked).
    pad = spec.num_sel_blocks(T) * spec.l_sel - T
    kv[2:4] = [torch.nn.functional.pad(x, (0, 0, 0, pad)).contiguous() for x in kv[2:4]]
    sel_map = cmp_to_sel_map(spec, T, q.device)
    outs = []
    for t0 in range(0, T, CHUNK):
        t1 = min(T, t0 + CHUNK)
        args = (qg[:, :, :, t0:t1], *kv, gg[:, :, :, t0:t1], sel_map)
        if torch.is_grad_enabled():
            outs.append(checkpoint(_chunk, *args, t0, spec, use_reentrant=False))
        else:
            outs.append(_chunk(*args, t0, spec))
    out = torch.cat(outs, dim=3)  # (B, G, r, T, D)
    return out.reshape(B, H, T, D).transpose(1, 2).to(q.dtype)
