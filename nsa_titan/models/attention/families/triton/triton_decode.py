"""The Triton decode step: a new token's whole NSA attention over the decoding caches in one launch a layer.

One program a (batch x KV group) row, the group's r query heads as the rows of one tile (padded to 16), over
the caches as `models/decode.py` keeps them (the keys transposed (B G, D, P), the values (B G, P, D); fp32,
bf16 or fp16, computed in fp32):
  cmp   online softmax over the row's n_cmp compressed slots, BLOCK at a time; then one more pass writes
        each slot's probability summed over the heads to a scratch row (the block scores' input);
  top-n each sel block's score is the sum of its cmp members' (l/d + l'/d - 1 slots from j l'/d - l/d + 1),
        block 0 and the two local blocks forced, blocks past the token none; n rounds of an argmax (ties to
        the lower block, as a stable descending sort);
  sel   the chosen blocks' l' keys up to the token, one online softmax across them;
  win   the ring of the last w keys (every slot up to min(t, ring - 1));
  mix   the gated sum, written in q's dtype.
No value comes back to the host and no shape depends on one: a step can be captured in a CUDA graph.
Checked under TRITON_INTERPRET=1 against the reference step (tests/test_inference.py).
"""

from __future__ import annotations

import torch

from ...common import NSASpec
from .triton_nsa import problem as family_problem

try:
    import triton
    import triton.language as tl
except ImportError:  # optional: CPU machines decode with the C++ kernels
    triton = None

BLOCK = 64
"""cmp slots and win keys per step of a loop."""
ROWS = 16
"""A tile's rows: the group's query heads, padded (tl.dot's least M)."""
WARPS = 4


def problem(device: torch.device, dtype: torch.dtype, spec: NSASpec, heads_per_group: int, head_dim: int
            ) -> str | None:
    """Why the Triton decode step cannot run here, or None (the family's rules, and at most ROWS heads a group)."""
    if heads_per_group > ROWS:
        return f"the Triton decode step holds at most {ROWS} query heads of a group, and this model has {heads_per_group}"
    return family_problem(device, dtype, spec, heads_per_group, head_dim)


def decode_step(q: torch.Tensor, gates: torch.Tensor, caches: list[torch.Tensor], n_cmp: torch.Tensor,
                t: torch.Tensor, G: int, width: int, ring: int, spec: NSASpec, Ns: int, n: int) -> torch.Tensor:
    """q (B, 1, H, D), gates (B, 1, H, 3) fp32, caches kc, vc, k_sel, v_sel, k_win, v_win in the decoding layout,
    n_cmp and t (B,) -> the attention output (B, 1, H, D) in q's dtype: one launch."""
    B, _, H, D = q.shape
    kc, vc, ks, vs, kw, vw = caches
    q, gates = q.contiguous(), gates.contiguous()
    scratch = q.new_empty(B * G, width, dtype=torch.float32)  # each row's group probabilities of its cmp slots
    out = torch.empty_like(q)
    _decode[(B * G,)](q, gates, kc, vc, ks, vs, kw, vw, n_cmp, t, scratch, out, kc.shape[2], ks.shape[2], kw.shape[2],
                      width, ring, Ns, n, D ** -0.5, G, R=H // G, D=D, LSEL=spec.l_sel, STRIDE=spec.l_sel // spec.d,
                      BEFORE=spec.l // spec.d - 1, MEMBERS=_pow2(spec.l_sel // spec.d + spec.l // spec.d - 1),
                      NS=_pow2(Ns), N=spec.n, ROWS=ROWS, BLOCK=BLOCK, num_warps=WARPS)
    return out


def _pow2(x: int) -> int:
    """The least power of two >= x."""
    return 1 << (max(x, 1) - 1).bit_length()


if triton is not None:

    @triton.jit
    def _run(q, KT, V, P, p0, L, last, acc, m, l, D: tl.constexpr, BLOCK: tl.constexpr):
        """The online softmax of q (ROWS, D) over keys p0 .. p0 + L - 1 (those up to `last`) of KT (D, P), V (P, D)."""
        dims, cols = tl.arange(0, D), tl.arange(0, BLOCK)
        for j in range(0, L, BLOCK):
            pos = p0 + j + cols
            ok = (j + cols < L) & (pos <= last)
            k = tl.load(KT + dims[:, None] * P + pos[None, :], mask=ok[None, :], other=0.0).to(tl.float32)
            s = tl.where(ok[None, :], tl.dot(q, k, input_precision="ieee"), float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))  # m starts finite: a row with no key yet keeps p = 0
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new[:, None])
            v = tl.load(V + pos[:, None] * D + dims[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            l = l * alpha + tl.sum(p, 1)
            m = m_new
        return acc, m, l

    @triton.jit
    def _decode(Q, GATE, KC, VC, KS, VS, KW, VW, NCMP, TPOS, SCR, OUT, Pc, Ps, Pw, width, ring, Ns, n, scale, G,
                R: tl.constexpr, D: tl.constexpr, LSEL: tl.constexpr, STRIDE: tl.constexpr, BEFORE: tl.constexpr,
                MEMBERS: tl.constexpr, NS: tl.constexpr, N: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
        bg = tl.program_id(0).to(tl.int64)
        b = bg // G
        t = tl.load(TPOS + b)
        n_cmp = tl.load(NCMP + b)
        rows, dims, cols = tl.arange(0, ROWS), tl.arange(0, D), tl.arange(0, BLOCK)
        heads = rows < R
        q = tl.load(Q + (bg * R + rows[:, None]) * D + dims[None, :], mask=heads[:, None], other=0.0)
        q = q.to(tl.float32) * scale
        zero, start = tl.zeros([ROWS, D], dtype=tl.float32), tl.full([ROWS], -1e30, dtype=tl.float32)
        # cmp, then each slot's probability summed over the heads
        KT, V = KC + bg * D * Pc, VC + bg * Pc * D
        acc_c, m_c, l_c = _run(q, KT, V, Pc, 0, width, n_cmp - 1, zero, start, tl.zeros([ROWS], dtype=tl.float32),
                               D, BLOCK)
        for j in range(0, width, BLOCK):
            pos = j + cols
            ok = pos < n_cmp
            k = tl.load(KT + dims[:, None] * Pc + pos[None, :], mask=ok[None, :], other=0.0).to(tl.float32)
            s = tl.where(ok[None, :] & heads[:, None], tl.dot(q, k, input_precision="ieee"), float("-inf"))
            p = tl.exp(s - m_c[:, None]) / tl.where(l_c > 0, l_c, 1.0)[:, None]
            tl.store(SCR + bg * width + pos, tl.sum(p, 0), mask=pos < width)
        tl.debug_barrier()  # the scratch row, written by every thread, read by every thread
        # the block scores and the top-n
        jt = t // LSEL
        last = tl.minimum(jt - 2, Ns - 1)
        blocks, members = tl.arange(0, NS), tl.arange(0, MEMBERS)
        slot = blocks[:, None] * STRIDE - BEFORE + members[None, :]
        inside = (members[None, :] < STRIDE + BEFORE) & (slot >= 0) & (slot < width)
        score = tl.sum(tl.load(SCR + bg * width + slot, mask=inside, other=0.0), 1)
        score = tl.where((blocks > 0) & (blocks <= last), score, float("inf"))  # block 0 and the local ones
        score = tl.where((blocks > jt) | (blocks >= Ns), float("-inf"), score)
        acc_s, m_s, l_s = zero, start, tl.zeros([ROWS], dtype=tl.float32)
        for c in range(N):
            best = tl.max(score, 0)
            j = tl.argmax(score, 0, tie_break_left=True)
            score = tl.where(blocks == j, float("-inf"), score)
            if (c < n) & (best > float("-inf")):
                acc_s, m_s, l_s = _run(q, KS + bg * D * Ps, VS + bg * Ps * D, Ps, j * LSEL, LSEL, t, acc_s, m_s, l_s,
                                       D, LSEL)
        # win over the ring
        acc_w, m_w, l_w = _run(q, KW + bg * D * Pw, VW + bg * Pw * D, Pw, 0, ring, tl.minimum(t, ring - 1), zero,
                               start, tl.zeros([ROWS], dtype=tl.float32), D, BLOCK)
        # the gated sum: a branch with no key gives 0
        gate = GATE + (bg * R + rows) * 3
        out = tl.load(gate, mask=heads, other=0.0)[:, None] * acc_c / tl.where(l_c > 0, l_c, 1.0)[:, None]
        out += tl.load(gate + 1, mask=heads, other=0.0)[:, None] * acc_s / tl.where(l_s > 0, l_s, 1.0)[:, None]
        out += tl.load(gate + 2, mask=heads, other=0.0)[:, None] * acc_w / tl.where(l_w > 0, l_w, 1.0)[:, None]
        tl.store(OUT + (bg * R + rows[:, None]) * D + dims[None, :], out.to(OUT.dtype.element_ty), mask=heads[:, None])
