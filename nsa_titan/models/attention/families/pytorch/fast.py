"""Fast NSA attention in PyTorch: the cost grows with the keys a query attends to, not with T^2.

Each branch is a flash-style custom op with its backward (`ops.py`) that keeps only its inputs,
its output and the logsumexp of each (query, head), and recomputes its scores once in backward,
chunk by chunk: memory is linear in T and no T x T tensor exists.
  cmp, win (`fast_shared.py`): chunks of queries against the keys the whole chunk may read (with
      documents and host bounds, only the chunk's documents' keys); the cmp forward also picks
      each chunk's sel blocks.
  sel (`fast_sel.py`): the forced blocks as dense products, the blocks chosen by score as
      block-centric tiles.
The loops are over chunks, never over tokens, and inside the ops: under torch.compile each branch
is one node, so the graph does not grow with T. `kernels` (`kernels.py`, fixed per run by the kernel
family, `families/`) says where the branches run in NSA's C++ kernels instead (CPUs), and win through
flash-attn (CUDA); where a branch runs in the C++ kernel, the gated sum of the branches does too
(`cpp/cpu_attention.mix`). The Triton family is one op of its own (`families/triton/`).
"""

from __future__ import annotations

import torch

from ...common import mix_branches
from ...documents import Documents
from ...spec import N_FORCED_INITIAL, N_FORCED_LOCAL, NSASpec
from . import ops
from .kernels import Kernels, window_flash


def nsa_fast(q: torch.Tensor, k_cmp: torch.Tensor, v_cmp: torch.Tensor, k_sel: torch.Tensor, v_sel: torch.Tensor,
             k_win: torch.Tensor, v_win: torch.Tensor, gates: torch.Tensor, spec: NSASpec,
             kernels: Kernels = Kernels(), docs: Documents | None = None, q0: int = 0,
             branches: tuple[bool, bool, bool] = (True, True, True), return_selection: bool = False
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same contract as `nsa_reference` (see there), computed branch by branch in chunks, each branch
    by its kernel in `kernels` (default: PyTorch for all three; the families pick theirs, `families/`).

    Context parallelism passes a part of the queries: q (B, Tq, H, D) and gates are those of positions
    q0 .. q0 + Tq - 1 (q0 a multiple of l'), the keys, values and `docs` those of the whole sequence."""
    B, Tq, H, D = q.shape
    T, G = k_sel.shape[1], k_sel.shape[2]
    acc = torch.promote_types(q.dtype, torch.float32)
    if spec.n < N_FORCED_INITIAL + N_FORCED_LOCAL:
        raise ValueError(f"nsa_fast needs n >= {N_FORCED_INITIAL + N_FORCED_LOCAL} (the forced blocks), got n = {spec.n}")

    def grouped(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Keys / values (B, S, G, D) -> (B, G, S, D)."""
        return x.to(dtype).transpose(1, 2).contiguous()

    def heads(dtype: torch.dtype) -> torch.Tensor:
        """The queries as (B, G, Tq, r, D): the r = H/G query heads of a group side by side."""
        return q.to(dtype).view(B, Tq, G, H // G, D).transpose(1, 2).contiguous()

    # cmp and win: fp32 on CPUs, as the reference rounds; on CUDA the fused kernel takes bf16 / fp16
    # as they are (tensor cores), and the cmp scores that pick the sel blocks are still fp32.
    low = q.dtype if q.device.type == "cuda" else acc
    qs = heads(low)
    o_cmp = o_sel = o_win = idx = valid = None
    if branches[0] or branches[1]:  # sel reads the cmp scores
        o_cmp, idx, valid = ops.shared(qs, grouped(k_cmp, low), grouped(v_cmp, low), "cmp", spec, T, q0, docs,
                                       kernels.cmp)
    if branches[1] and kernels.sel == "cpp":
        o_sel = ops.selected_kernel(qs if low == acc else heads(acc), grouped(k_sel, acc), grouped(v_sel, acc), idx,
                                    valid, spec, q0, docs)
    elif branches[1]:
        o_sel = ops.selected(qs if low == acc else heads(acc), grouped(k_sel, acc), grouped(v_sel, acc), idx, valid,
                             spec, q0, docs)
    if branches[2] and kernels.win == "flash":
        o_win = window_flash(q, k_win, v_win, spec, docs, q0)
    elif branches[2]:
        o_win, _, _ = ops.shared(qs, grouped(k_win, low), grouped(v_win, low), "win", spec, T, q0, docs, kernels.win)
    outs = [o.to(acc) if on else None for o, on in zip((o_cmp, o_sel, o_win), branches)]  # cmp's scores only: None
    if "cpp" in (kernels.cmp, kernels.sel, kernels.win):  # one pass in the C++ kernel, into the heads' layout
        which = [i for i, o in enumerate(outs) if o is not None]
        out = ops.mix(gates.to(acc), [outs[i] for i in which], which).to(q.dtype)
    else:
        g = gates.to(acc).view(B, Tq, G, H // G, 3).transpose(1, 2)
        out = mix_branches(g, *outs).transpose(1, 2).reshape(B, Tq, H, D).to(q.dtype)  # (B, G, Tq, r, D) -> (B, Tq, H, D)
    return (out, idx, valid) if return_selection else out
