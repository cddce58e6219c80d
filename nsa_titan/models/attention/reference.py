"""Reference NSA attention: the exact definition, written for clarity, not speed.

Each branch is a masked attention over a dense (T, S) mask, so memory is O(T^2): this is
the yardstick the fast implementation is checked against, not the training default at
long context. Softmax statistics are fp32; queries whose key set is empty get 0.
"""

from __future__ import annotations

import torch

from .common import cmp_visibility, masked_softmax, mix_branches, select_blocks
from .documents import Documents
from .spec import NSASpec


def masked_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """GQA attention of q over k/v restricted to `mask`, in fp32 (or fp64 for fp64 inputs).

    q: (B, T, H, D); k, v: (B, S, G, D); mask: bool, broadcastable to (B, G, H/G, T, S).
    Returns out (B, T, H, D) in q's dtype and probabilities (B, H, T, S) in that precision.
    Rows with no allowed key give out = 0 and probabilities 0 (never NaN).
    """
    B, T, H, D = q.shape
    G = k.shape[2]
    acc = torch.promote_types(q.dtype, torch.float32)  # fp32 statistics (fp64 stays fp64)
    qf = q.to(acc).transpose(1, 2).reshape(B, G, H // G, T, D)  # head h = g * (H/G) + r
    if k.shape[1] == 0:  # no key at all (cmp with T < l)
        return torch.zeros_like(q), q.new_zeros(B, H, T, 0, dtype=acc)
    kf, vf = k.to(acc).transpose(1, 2), v.to(acc).transpose(1, 2)  # (B, G, S, D)
    p = masked_softmax(torch.einsum("bgrtd,bgsd->bgrts", qf, kf) * D**-0.5, mask)
    out = torch.einsum("bgrts,bgsd->bgrtd", p, vf)
    return out.reshape(B, H, T, D).transpose(1, 2).to(q.dtype), p.reshape(B, H, T, -1)


def nsa_reference(q: torch.Tensor, k_cmp: torch.Tensor, v_cmp: torch.Tensor, k_sel: torch.Tensor,
                  v_sel: torch.Tensor, k_win: torch.Tensor, v_win: torch.Tensor, gates: torch.Tensor,
                  spec: NSASpec, docs: Documents | None = None,
                  branches: tuple[bool, bool, bool] = (True, True, True), return_selection: bool = False
                  ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """NSA output o_t = sum_c g_t^c * Attn(q_t, K~c_t, V~c_t) for c in (cmp, sel, win).

    q: (B, T, H, D); k_cmp, v_cmp: (B, Nc, G, D) compressed blocks (with `docs`: the slots of
    `docs.cmp_start`); k_sel, v_sel, k_win, v_win: (B, T, G, D); gates: (B, T, H, 3) in [0, 1],
    order (cmp, sel, win). With `docs` every rule applies per document. Returns (B, T, H, D).
    `branches`: those summed (at least one); one left out adds nothing (`nsa_fast` does not compute it).
    `return_selection`: (o, idx, valid), also the sel blocks each query's group read (`select_blocks`).
    """
    B, T, H, D = q.shape
    G = k_sel.shape[2]
    dev = q.device
    t = torch.arange(T, device=dev)
    causal = t[None, :] <= t[:, None]  # (T, S)
    if docs is None:
        cmp_mask, same, key_rel = cmp_visibility(spec, T, dev), causal[None], t[None, None, :]
    else:
        cmp_mask = docs.cmp_visible(spec, 0, T, k_cmp.shape[1])[:, None, None]  # (B, 1, 1, T, Nc)
        same = docs.same_past(0, T, 0, T)  # (B, T, S)
        key_rel = (t[None, None, :] - docs.start[:, :, None]).clamp(min=0)  # key position in t's document

    # cmp: attend to every complete compression block in the past.
    o_cmp, p_cmp = masked_attention(q, k_cmp, v_cmp, cmp_mask)

    # sel: top-n blocks from the cmp probabilities, shared by a group's heads.
    idx, valid = select_blocks(p_cmp, spec, G, docs=docs)  # (B, G, T, n')
    chosen = torch.zeros(B, G, T, spec.num_sel_blocks(T), dtype=torch.bool, device=dev)
    chosen.scatter_(-1, idx, valid)
    key_block = (key_rel // spec.l_sel).expand(B, T, T)[:, None].expand(B, G, T, T)
    sel_mask = chosen.gather(-1, key_block) & same[:, None]  # (B, G, T, S)
    o_sel, _ = masked_attention(q, k_sel, v_sel, sel_mask[:, :, None])

    # win: the last w keys.
    win_mask = same & (t[None, :] > t[:, None] - spec.w)
    o_win, _ = masked_attention(q, k_win, v_win, win_mask[:, None, None])

    out = mix_branches(gates.to(q.dtype), *(o if on else None for o, on in zip((o_cmp, o_sel, o_win), branches)))
    return (out, idx, valid) if return_selection else out
