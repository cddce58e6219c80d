"""The cmp and win branches of the fast path: chunks of queries against the keys the whole chunk may read.

The keys are the Nv compressed keys visible to the chunk's last query (cmp), or the C + w - 1 keys
covering its C windows (win); with documents and host bounds, only the chunk's documents' keys.
The r query heads of a KV group are stacked, so a chunk is two matmuls per group. The cmp forward
computes each chunk's probabilities, since it picks the chunk's sel blocks from them. Flash-style:
the forward keeps its inputs, output and logsumexp, the backward recomputes each chunk's
probabilities once. On CPUs and CUDA devices the win forward and both backwards are ATen's fused
attention kernel per chunk (`fused_attention.py`: scores, softmax and products tile by tile in
cache, one pass), with the chunk's mask as a 0 / -inf bias (the cmp backward without documents:
only on the keys that not all of the chunk's queries see); elsewhere they are the same steps as
separate ops. On CUDA the chunks come in bf16 / fp16 (the cmp scores are computed in fp32). On CPUs
the branches can run in NSA's C++ kernels instead (`cpu_attention.py`).
"""

from __future__ import annotations

import torch

from ...common import choose_blocks
from ...documents import ChunkBounds, Documents
from ...spec import NSASpec
from ..cpp import cpu_attention
from . import fused_attention

CHUNK_CMP = 256
"""Queries per cmp chunk on CPUs (a chunk's scores stay near the caches)."""
CHUNK_WIN = 64
"""Queries per win chunk on CPUs: the chunk reads C + w - 1 keys for its C windows of w."""
GPU_CHUNK_CMP, GPU_CHUNK_WIN = 4096, 2048
"""The same on GPUs, where each chunk's ops are kernel launches: few chunks that fill the device
(M7C attention at 64k in bf16 on an H100: 0.47 s against 2.23 s with the CPU sizes)."""


def _chunks(kind: str, spec: NSASpec, q0: int, Tq: int, bounds: ChunkBounds | None, device: torch.device
            ) -> list[tuple[int, int, tuple[int, int] | None]]:
    """(t0, t1, cut) for each chunk of the queries q0 .. q0 + Tq - 1: cut, with host `bounds`, is the
    range of its documents' keys (cmp: slots [lo, hi); win: (first key, None)), else None."""
    cpu = device.type == "cpu"
    size = (CHUNK_CMP if cpu else GPU_CHUNK_CMP) if kind == "cmp" else (CHUNK_WIN if cpu else GPU_CHUNK_WIN)
    chunks = [(t0, min(q0 + Tq, t0 + size)) for t0 in range(q0, q0 + Tq, size)]
    if bounds is None:
        return [(t0, t1, None) for t0, t1 in chunks]
    cuts = bounds.cmp_slots(chunks) if kind == "cmp" else [(lo, None) for lo in bounds.window_starts(chunks, spec.w)]
    return [(t0, t1, cut) for (t0, t1), cut in zip(chunks, cuts)]


def _key_range(kind: str, spec: NSASpec, t0: int, t1: int, S: int, device: torch.device, docs: Documents | None,
               cut: tuple[int, int | None] | None) -> tuple[int, int, torch.Tensor]:
    """Keys [lo, hi) that queries t0 .. t1 - 1 may read in branch `kind`, and the mask (C, 1, hi - lo),
    or with `docs` (B, 1, C, 1, hi - lo). With `docs` the cmp keys are slots: those visible to
    t1 - 1 are among the first t1 // d (see documents.py), which bounds the range without a host
    sync; a `cut` from the host bounds (`_chunks`) narrows the range to the chunk's documents."""
    t = torch.arange(t0, t1, device=device)[:, None]
    if kind == "cmp" and docs is not None:
        lo, hi = (0, min(S, t1 // spec.d)) if cut is None else cut
        return lo, hi, docs.cmp_visible(spec, t0, t1, hi, lo)[:, None, :, None]
    if kind == "cmp":  # block i is visible to t when i*d + l - 1 <= t
        hi = min(S, max(0, (t1 - spec.l) // spec.d + 1))
        i = torch.arange(hi, device=device)[None, :]
        return 0, hi, (i * spec.d + spec.l - 1 <= t)[:, None]
    lo, hi = max(0, t0 - spec.w + 1) if cut is None else cut[0], t1
    s = torch.arange(lo, hi, device=device)[None, :]
    in_window = (s <= t) & (s > t - spec.w)
    if docs is not None:
        return lo, hi, (in_window & docs.same_past(t0, t1, lo, hi))[:, None, :, None]
    return lo, hi, in_window[:, None]


def _probs(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax probabilities (B, G, C, r, S) of the queries q (B, G, C, r, D) over the keys
    k (B, G, S, D) where mask (broadcast to the same shape) allows, rounded as the reference
    rounds them: scores scaled after the product, `masked_softmax` (0 for no key); and the
    logsumexp of each row (B, G, C, r), 0 for a row without keys. The mask rides in the product
    (baddbmm onto a 0 / -inf bias, the same bits as masking afterwards)."""
    B, G, C, r, D = q.shape
    S = k.shape[2]
    s = fused_attention.bias_of(mask, q.dtype).expand(B, G, C, r, S).contiguous()
    s.view(B * G, C * r, S).baddbmm_(q.reshape(B * G, C * r, D), k.reshape(B * G, S, D).transpose(-1, -2))
    s.mul_(D**-0.5)
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = s.sub_(m).exp_()
    total = e.sum(-1, keepdim=True)
    lse = torch.where(total > 0, m + torch.log(total), torch.zeros_like(m)).squeeze(-1)
    return e.div_(torch.where(total > 0, total, torch.ones_like(total))), lse


def _rows(x: torch.Tensor) -> torch.Tensor:
    """Queries (B, G, C, r, D), or keys (B, G, S, D), as the fused kernels' (B * G, rows, D): the r
    heads of a query side by side, one key head per group."""
    return x.reshape(x.shape[0] * x.shape[1], -1, x.shape[-1])


def _bias(mask: torch.Tensor | None, B: int, G: int, r: int, dtype: torch.dtype) -> torch.Tensor | None:
    """A chunk's mask ((C, 1, S), or (B, 1, C, 1, S) with documents) as the fused kernels' bias over
    the rows of `_rows`: (C * r, S), or (B * G, 1, C * r, S); None (every key read): None."""
    if mask is None:
        return None
    if mask.dim() == 3:  # the same for every (batch, group): broadcast
        return fused_attention.bias_of(mask, dtype).expand(-1, r, -1).reshape(-1, mask.shape[-1])
    return fused_attention.bias_rows(mask, (B, G, mask.shape[2], r, mask.shape[-1]), dtype)


def _fused_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk through the fused kernel: out (B, G, C, r, D) and logsumexp (B, G, C, r)."""
    B, G, C, r, D = q.shape
    out, lse = fused_attention.attend(_rows(q), _rows(k), _rows(v), _bias(mask, B, G, r, q.dtype), D**-0.5)
    return out.view(q.shape), lse.view(B, G, C, r)


def _fused_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                    lse: torch.Tensor, mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients (dq, dk, dv) of one chunk's queries through the fused kernel, from their rows of
    the forward's output and logsumexp: over all of their keys, or a part of them (`_parts`); mask
    None: every query reads every key given."""
    B, G, C, r, D = q.shape
    dq, dk, dv = fused_attention.attend_backward(_rows(do), _rows(q), _rows(k), _rows(v), _rows(out),
                                                 lse.reshape(B * G, -1), _bias(mask, B, G, r, q.dtype), D**-0.5)
    return dq.view(q.shape), dk.view(k.shape), dv.view(v.shape)


def shared_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kind: str, spec: NSASpec, T: int, q0: int,
                   docs: Documents | None, bounds: ChunkBounds | None, kernel: str = "torch"
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """cmp or win attention (`kind`). q (B, G, Tq, r, D): the queries at positions q0 .. q0 + Tq - 1
    of a sequence of T tokens (all of them unless context parallelism splits it); k, v (B, G, S, D)
    of the whole sequence; docs: the `Documents` of the whole sequence, or None; bounds: their host
    bounds, or None; kernel: `cpp` runs the branch through `cpu_attention` (CPUs). Returns out
    (B, G, Tq, r, D), the logsumexp of each (query, head) (B, G, Tq, r), and, for cmp, the chosen
    sel blocks idx / valid (B, G, Tq, n') (see `choose_blocks`; None for win)."""
    B, G, Tq, r, D = q.shape
    acc = torch.promote_types(q.dtype, torch.float32)  # the cmp scores' dtype (q: bf16 / fp16 on CUDA)
    out, lse, idx, valid = torch.zeros_like(q), q.new_zeros(B, G, Tq, r, dtype=acc), [], []
    if kernel == "cpp" and kind == "win":  # on CPUs by NSA's C++ kernel
        out, lse = cpu_attention.window_forward(q, k, v, spec, None if docs is None else docs.start[:, q0:q0 + Tq], q0)
        return out, lse, None, None
    keys = cpu_attention.cmp_keys(k, v) if kernel == "cpp" else None
    for t0, t1, cut in _chunks(kind, spec, q0, Tq, bounds, q.device):
        a, b = t0 - q0, t1 - q0  # the chunk's rows of q
        if kernel == "cpp":  # the group's scores over every slot (B, G, C, S), no probabilities written
            scores = cpu_attention.cmp_forward(q, keys, out, lse, a, b, q0, spec, docs)
            chosen = cpu_attention.choose_blocks(scores, spec, t0, T, docs)
            idx.append(chosen[0])
            valid.append(chosen[1])
            continue
        lo, hi, mask = _key_range(kind, spec, t0, t1, k.shape[2], q.device, docs, cut)
        if hi == lo:  # no complete cmp block yet: no key, output 0
            scores = q.new_zeros(B, G, t1 - t0, 0, dtype=acc)
        elif kind == "win" and fused_attention.fused(q):
            out[:, :, a:b], lse[:, :, a:b] = _fused_forward(q[:, :, a:b], k[:, :, lo:hi], v[:, :, lo:hi], mask)
        else:
            p, lse[:, :, a:b] = _probs(q[:, :, a:b].to(acc), k[:, :, lo:hi].to(acc), mask)  # (B, G, C, r, hi - lo)
            out[:, :, a:b] = (p.view(B, G, -1, hi - lo) @ v[:, :, lo:hi].to(acc)).view(B, G, -1, r, D)
            scores = p.sum(3)
        if kind == "cmp":
            chosen = choose_blocks(scores, spec, t0, T, docs, slot0=lo)
            idx.append(chosen[0])
            valid.append(chosen[1])
    if kind != "cmp":
        return out, lse, None, None
    return out, lse, torch.cat(idx, 2), torch.cat(valid, 2)


def _parts(kind: str, spec: NSASpec, t0: int, lo: int, hi: int, mask: torch.Tensor, docs: Documents | None
           ) -> list[tuple[int, int, torch.Tensor | None]]:
    """A chunk's keys [lo, hi) (its first query at t0) as parts (k0, k1, mask of their columns, or None
    where every query of the chunk reads every key of the part). cmp without documents: the slots the
    first query sees are seen by all, only the last C / d need a mask (M7C at 64k: a median of 6.6 s
    against 7.4 s with a bias of C r x 4,096 built and read per chunk). A part's gradients are exact,
    since the fused backward takes each row's output and logsumexp over all of its keys."""
    if kind != "cmp" or docs is not None:
        return [(lo, hi, mask)]
    full = min(hi, max(lo, (t0 - spec.l) // spec.d + 1))  # slot i is visible to t0 when i d + l - 1 <= t0
    return [(k0, k1, part) for k0, k1, part in ((lo, full, None), (full, hi, mask[..., full - lo:])) if k1 > k0]


def shared_backward(d_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                    lse: torch.Tensor, kind: str, spec: NSASpec, q0: int, docs: Documents | None,
                    bounds: ChunkBounds | None, kernel: str = "torch") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients (dq, dk, dv) of `shared_forward`'s output `out` (with its logsumexp `lse`)."""
    if kernel == "cpp" and cpu_attention.own_backward(kind, k.shape[2], q.shape[3]):  # else the chunks below
        if kind == "cmp":
            return cpu_attention.cmp_backward(d_out, q, k, v, out, lse, spec, q0, docs)
        start = None if docs is None else docs.start[:, q0:q0 + q.shape[2]]
        return cpu_attention.window_backward(d_out, q, k, v, out, lse, spec, start, q0)
    B, G, Tq, r, D = q.shape
    acc = torch.promote_types(q.dtype, torch.float32)  # dk, dv sum over chunks: in fp32 for bf16 / fp16 inputs
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k, dtype=acc), torch.zeros_like(v, dtype=acc)
    for t0, t1, cut in _chunks(kind, spec, q0, Tq, bounds, q.device):
        lo, hi, mask = _key_range(kind, spec, t0, t1, k.shape[2], q.device, docs, cut)
        if hi == lo:
            continue
        a, b = t0 - q0, t1 - q0  # the chunk's rows of q
        if fused_attention.fused(q):
            for k0, k1, part in _parts(kind, spec, t0, lo, hi, mask, docs):
                dqc, dkc, dvc = _fused_backward(d_out[:, :, a:b], q[:, :, a:b], k[:, :, k0:k1], v[:, :, k0:k1],
                                                out[:, :, a:b], lse[:, :, a:b], part)
                dq[:, :, a:b] += dqc
                dk[:, :, k0:k1] += dkc
                dv[:, :, k0:k1] += dvc
            continue
        p, _ = _probs(q[:, :, a:b], k[:, :, lo:hi], mask)  # the forward's, recomputed
        do = d_out[:, :, a:b].reshape(B, G, -1, D)
        p2 = p.view(B, G, -1, hi - lo)
        dv[:, :, lo:hi] += p2.transpose(-1, -2) @ do
        dp = (do @ v[:, :, lo:hi].transpose(-1, -2)).view_as(p)
        # softmax backward with delta = sum(p * dp), not d_out . out: one row's keys are all
        # in this chunk, and this form keeps a one-key row's exact zero.
        ds = dp.sub_((p * dp).sum(-1, keepdim=True)).mul_(p).mul_(D**-0.5).view(B, G, -1, hi - lo)
        dq[:, :, a:b] = (ds @ k[:, :, lo:hi]).view(B, G, -1, r, D)
        dk[:, :, lo:hi] += ds.transpose(-1, -2) @ q[:, :, a:b].reshape(B, G, -1, D)
    return dq, dk.to(k.dtype), dv.to(v.dtype)
