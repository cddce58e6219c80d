"""The Triton decode step: a new token's whole NSA attention over the decoding caches in one launch a layer.

One program a (batch x KV group) row, the group's r query heads as the rows of one tile (padded to 16), over
the caches as `models/decode.py` keeps them (the keys transposed (B G, D, P), the values (B G, P, D)); the
products in the caches' dtype (fp32 exactly, bf16 / fp16 on the tensor cores), softmax and sums in fp32:
  append the new token's keys and values (sel's, the window's ring, the cmp raw keys' ring);
  cmp   online softmax over the row's n_cmp compressed slots, BLOCK at a time; then one more pass writes
        each slot's probability summed over the heads to a scratch row (the block scores' input);
  top-n each sel block's score is the sum of its cmp members' (l/d + l'/d - 1 slots from j l'/d - l/d + 1),
        SCORES blocks at a time, into the scratch row after the slots; then all Ns of them at once: block 0
        and the two local blocks forced, blocks past the token none; n rounds of an argmax (ties to the lower
        block, as a stable descending sort);
  sel   the chosen blocks' l' keys up to the token, one online softmax across them;
  win   the ring of the last w keys (every slot up to min(t, ring - 1));
  mix   the gated sum, written in q's dtype.
No value comes back to the host and no shape depends on one: a step can be captured in a CUDA graph.
Checked under TRITON_INTERPRET=1 against the reference step (tests/test_inference.py).
"""

from __future__ import annotations

import torch

from ...common import NSASpec
from .family import _keys, _pow2
from .triton_nsa import problem as family_problem

try:
    import triton
    import triton.language as tl
except ImportError:  # optional: CPU machines decode with the C++ kernels
    triton = None

BLOCK = 64
"""cmp slots and win keys per step of a loop."""
SCORES = 128
"""sel blocks scored per step of a loop (their members' slots, a (SCORES, 8) tile at the paper's sizes)."""
ROWS = 16
"""A tile's rows: the group's query heads, padded (tl.dot's least M)."""
WARPS = 4
"""Warps a program; twice as many for fp32 caches (their exact products spilled registers on sm_90 with 4)."""


def problem(device: torch.device, dtype: torch.dtype, spec: NSASpec, heads_per_group: int, head_dim: int
            ) -> str | None:
    """Why the Triton decode step cannot run here, or None (the family's rules, and at most ROWS heads a group)."""
    if heads_per_group > ROWS:
        return (f"the Triton decode step holds at most {ROWS} query heads of a group, and this model has "
                f"{heads_per_group}")
    return family_problem(device, dtype, spec, heads_per_group, head_dim)


def decode_step(q: torch.Tensor, gates: torch.Tensor, caches: list[torch.Tensor], new: list[torch.Tensor],
                n_cmp: torch.Tensor, t: torch.Tensor, G: int, width: int, ring: int, ring_cmp: int, spec: NSASpec,
                Ns: int, n: int) -> torch.Tensor:
    """q (B, 1, H, D), gates (B, 1, H, 3) fp32; caches kc, vc, k_sel, v_sel, k_win, v_win, k_cmp, v_cmp in the
    decoding layout (`models/decode.py`); the new token's k_sel, v_sel, k_win, v_win, k_cmp, v_cmp (B, 1, G, D),
    appended first at t (B,) (the rings at t % ring, t % ring_cmp); n_cmp (B,) -> the attention output
    (B, 1, H, D) in q's dtype: one launch."""
    B, _, H, D = q.shape
    kc, vc, ks, vs, kw, vw, kr, vr = caches
    q, gates = q.contiguous(), gates.contiguous()
    new = [_keys(x) for x in new]  # (b, g) rows of D
    scratch = q.new_empty(B * G, width + Ns, dtype=torch.float32)  # a row's slot probabilities, then block scores
    out = torch.empty_like(q)
    _decode[(B * G,)](q, gates, kc, vc, ks, vs, kw, vw, kr, vr, *new, *(x.stride(0) for x in new), n_cmp, t, scratch,
                      out, kc.shape[2], ks.shape[2], kw.shape[2], kr.shape[1], width, ring, ring_cmp, Ns, n,
                      D ** -0.5, G, width + Ns, R=H // G, D=D, LSEL=spec.l_sel, STRIDE=spec.l_sel // spec.d,
                      BEFORE=spec.l // spec.d - 1, MEMBERS=_pow2(spec.l_sel // spec.d + spec.l // spec.d - 1),
                      NS=_pow2(Ns), N=spec.n, ROWS=ROWS, BLOCK=BLOCK, SCORES=SCORES,
                      num_warps=2 * WARPS if kc.dtype == torch.float32 else WARPS)
    return out


if triton is not None:

    @triton.jit
    def _dot(a, b, EXACT: tl.constexpr):
        """a @ b accumulated in fp32: fp32 operands exactly (not tf32), bf16 / fp16 ones on the tensor cores."""
        if EXACT:
            return tl.dot(a, b, input_precision="ieee")
        return tl.dot(a, b)

    @triton.jit
    def _run(q, KT, V, P, p0, L, last, acc, m, l, D: tl.constexpr, BLOCK: tl.constexpr, EXACT: tl.constexpr):
        """The online softmax of q (ROWS, D; pre-scaled, in the caches' dtype) over keys p0 .. p0 + L - 1 (those up
        to `last`) of KT (D, P), V (P, D)."""
        dims, cols = tl.arange(0, D), tl.arange(0, BLOCK)
        for j in range(0, L, BLOCK):
            pos = p0 + j + cols
            ok = (j + cols < L) & (pos <= last)
            k = tl.load(KT + dims[:, None] * P + pos[None, :], mask=ok[None, :], other=0.0)
            s = tl.where(ok[None, :], _dot(q, k, EXACT), float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))  # m starts finite: a row with no key yet keeps p = 0
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new[:, None])
            v = tl.load(V + pos[:, None] * D + dims[None, :], mask=ok[:, None], other=0.0)
            acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, EXACT)
            l = l * alpha + tl.sum(p, 1)
            m = m_new
        return acc, m, l

    @triton.jit
    def _decode(Q, GATE, KC, VC, KS, VS, KW, VW, KR, VR, NKS, NVS, NKW, NVW, NKR, NVR, snks, snvs, snkw, snvw, snkr,
                snvr, NCMP, TPOS, SCR, OUT, Pc, Ps, Pw, Pr, width, ring, ring_cmp, Ns, n, scale, G, SW,
                R: tl.constexpr, D: tl.constexpr, LSEL: tl.constexpr, STRIDE: tl.constexpr, BEFORE: tl.constexpr,
                MEMBERS: tl.constexpr, NS: tl.constexpr, N: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr,
                SCORES: tl.constexpr):
        bg = tl.program_id(0).to(tl.int64)
        b = bg // G
        t = tl.load(TPOS + b)
        n_cmp = tl.load(NCMP + b)
        rows, dims, cols = tl.arange(0, ROWS), tl.arange(0, D), tl.arange(0, BLOCK)
        heads = rows < R
        # append the new token's keys and values: sel's at t, the window's and the cmp raw keys' rings
        g = bg % G
        tw, tr = t % ring, t % ring_cmp
        tl.store(KS + bg * D * Ps + dims * Ps + t, tl.load(NKS + b * snks + g * D + dims))
        tl.store(VS + (bg * Ps + t) * D + dims, tl.load(NVS + b * snvs + g * D + dims))
        tl.store(KW + bg * D * Pw + dims * Pw + tw, tl.load(NKW + b * snkw + g * D + dims))
        tl.store(VW + (bg * Pw + tw) * D + dims, tl.load(NVW + b * snvw + g * D + dims))
        tl.store(KR + (bg * Pr + tr) * D + dims, tl.load(NKR + b * snkr + g * D + dims))
        tl.store(VR + (bg * Pr + tr) * D + dims, tl.load(NVR + b * snvr + g * D + dims))
        tl.debug_barrier()  # written by some threads, read by all
        q = tl.load(Q + (bg * R + rows[:, None]) * D + dims[None, :], mask=heads[:, None], other=0.0)
        q = (q.to(tl.float32) * scale).to(KC.dtype.element_ty)  # the products in the caches' dtype
        EXACT: tl.constexpr = KC.dtype.element_ty == tl.float32
        zero, start = tl.zeros([ROWS, D], dtype=tl.float32), tl.full([ROWS], -1e30, dtype=tl.float32)
        # cmp, then each slot's probability summed over the heads
        KT, V = KC + bg * D * Pc, VC + bg * Pc * D
        acc_c, m_c, l_c = _run(q, KT, V, Pc, 0, width, n_cmp - 1, zero, start, tl.zeros([ROWS], dtype=tl.float32),
                               D, BLOCK, EXACT)
        for j in range(0, width, BLOCK):
            pos = j + cols
            ok = pos < n_cmp
            k = tl.load(KT + dims[:, None] * Pc + pos[None, :], mask=ok[None, :], other=0.0)
            s = tl.where(ok[None, :] & heads[:, None], _dot(q, k, EXACT), float("-inf"))
            p = tl.exp(s - m_c[:, None]) / tl.where(l_c > 0, l_c, 1.0)[:, None]
            tl.store(SCR + bg * SW + pos, tl.sum(p, 0), mask=pos < width)
        tl.debug_barrier()  # the scratch row, written by every thread, read by every thread
        # the block scores, SCORES blocks at a time into the scratch row after the slots, then the top-n
        jt = t // LSEL
        last = tl.minimum(jt - 2, Ns - 1)
        members = tl.arange(0, MEMBERS)
        for j0 in range(0, Ns, SCORES):
            blocks = j0 + tl.arange(0, SCORES)
            slot = blocks[:, None] * STRIDE - BEFORE + members[None, :]
            inside = (members[None, :] < STRIDE + BEFORE) & (slot >= 0) & (slot < width)
            score = tl.sum(tl.load(SCR + bg * SW + slot, mask=inside, other=0.0), 1)
            tl.store(SCR + bg * SW + width + blocks, score, mask=blocks < Ns)
        tl.debug_barrier()
        blocks = tl.arange(0, NS)
        score = tl.load(SCR + bg * SW + width + blocks, mask=blocks < Ns, other=0.0)
        score = tl.where((blocks > 0) & (blocks <= last), score, float("inf"))  # block 0 and the local ones
        score = tl.where((blocks > jt) | (blocks >= Ns), float("-inf"), score)
        acc_s, m_s, l_s = zero, start, tl.zeros([ROWS], dtype=tl.float32)
        for c in range(N):
            best = tl.max(score, 0)
            j = tl.argmax(score, 0, tie_break_left=True)
            score = tl.where(blocks == j, float("-inf"), score)
            if (c < n) & (best > float("-inf")):
                acc_s, m_s, l_s = _run(q, KS + bg * D * Ps, VS + bg * Ps * D, Ps, j * LSEL, LSEL, t, acc_s, m_s, l_s,
                                       D, LSEL, EXACT)
        # win over the ring
        acc_w, m_w, l_w = _run(q, KW + bg * D * Pw, VW + bg * Pw * D, Pw, 0, ring, tl.minimum(t, ring - 1), zero,
                               start, tl.zeros([ROWS], dtype=tl.float32), D, BLOCK, EXACT)
        # the gated sum: a branch with no key gives 0
        gate = GATE + (bg * R + rows) * 3
        out = tl.load(gate, mask=heads, other=0.0)[:, None] * acc_c / tl.where(l_c > 0, l_c, 1.0)[:, None]
        out += tl.load(gate + 1, mask=heads, other=0.0)[:, None] * acc_s / tl.where(l_s > 0, l_s, 1.0)[:, None]
        out += tl.load(gate + 2, mask=heads, other=0.0)[:, None] * acc_w / tl.where(l_w > 0, l_w, 1.0)[:, None]
        tl.store(OUT + (bg * R + rows[:, None]) * D + dims[None, :], out.to(OUT.dtype.element_ty), mask=heads[:, None])
