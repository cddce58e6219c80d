"""The Triton decode step: a new token's whole NSA attention over the decoding caches in two launches a layer,
and on the step a row's compression block completes, its compressed key and value in two more (`compress_step`).

The group's r query heads are the rows of one tile (padded to 16), over the caches as `models/decode.py` keeps
them (the keys transposed (B G, D, P), the values (B G, P, D)); the products in the caches' dtype (fp32 exactly,
bf16 / fp16 on the tensor cores), softmax and sums in fp32. Work is cut into programs that fill the GPU; the last
program of a (batch x KV group) row to count itself in (an atomic add, acq_rel: its stores before, the last one's
loads after) finishes the row and sets the count back to 0 for the next step.
`_decode`, a program per part of CMP_PART compressed slots:
  append part 0 writes the new token's keys and values (sel's, the window's ring, the cmp raw keys' ring);
  cmp   online softmax over its slots (of the row's n_cmp, a function of t: (t + 1 - l) / d + 1 once t + 1 >= l),
        BLOCK at a time, into a scratch state, keeping the slots' scores (a head a row);
  sums  for each sel block with members among its slots (l/d + l'/d - 1 slots from j l'/d - l/d + 1), their
        exp(score - its max) summed per head, PART_BLOCKS blocks a step;
  last  the parts' states combined (COMBINE a step): cmp's output; each block's score, its parts' sums scaled by
        their max against the combined softmax and summed over the heads (SCORES blocks a step); then all Ns at
        once: block 0 and the two local blocks forced, blocks past the token none; n rounds of an argmax (ties to
        the lower block, as a stable descending sort).
`_decode_sel_win`, a program per chosen block and per BLOCK slots of the window's ring:
  sel   the block's l' keys up to the token; win: its slots up to min(t, ring - 1); each an online softmax;
  last  sel's states and win's combined, the gated sum with cmp's output, written in q's dtype.
The compression (`_cmp_hidden`, `_cmp_out`): the MLP phi of the block's l keys (the cmp ring's l - 1 before t and
the new one) with the rows (batch x group) as a tile's M, its hidden layer split over programs, then its output
into the slot (t - l + 1) / d of each row whose block completes (the mean phi: one launch).
No value comes back to the host and no shape depends on one: a step can be captured in a CUDA graph.
Checked under TRITON_INTERPRET=1 against the reference step (tests/test_inference.py).
"""

from __future__ import annotations

import torch

from ...spec import NSASpec
from .family import _keys, _pow2
from .triton_nsa import problem as family_problem

try:
    import triton
    import triton.language as tl
except ImportError:  # optional: CPU machines decode with the C++ kernels
    triton = None

BLOCK = 64
"""cmp slots and win keys per step of a loop."""
CMP_PART = 128
"""Compressed slots a program of the decode step (a part) attends to."""
COMBINE = 8
"""Parts' states combined a step."""
PART_BLOCKS = 64
"""sel blocks a part sums the member probabilities of a step."""
SCORES = 128
"""sel blocks scored per step of a loop (their members' slots, a (SCORES, 8) tile at the paper's sizes)."""
ROWS = 16
"""A tile's rows: the group's query heads, padded (tl.dot's least M)."""
HIDDEN_BLOCK, INPUTS, PART = 32, 64, 256
"""The compression's first layer: hidden units a program, inputs (of l x D) a step and a program's part of them
(its partial sums added by the second kernel: many short programs, not a few long ones)."""
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
                t: torch.Tensor, arrivals: torch.Tensor, G: int, width: int, ring: int, ring_cmp: int, spec: NSASpec,
                Ns: int, n: int) -> torch.Tensor:
    """q (B, 1, H, D), gates (B, 1, H, 3) fp32; caches kc, vc, k_sel, v_sel, k_win, v_win, k_cmp, v_cmp in the
    decoding layout (`models/decode.py`); the new token's k_sel, v_sel, k_win, v_win, k_cmp, v_cmp (B, 1, G, D),
    appended first at t (B,) (the rings at t % ring, t % ring_cmp); `arrivals` (B G, 2) int32, zeros (left zeros)
    -> the attention output (B, 1, H, D) in q's dtype: two launches."""
    B, _, H, D = q.shape
    kc, vc, ks, vs, kw, vw, kr, vr = caches
    q, gates = q.contiguous(), gates.contiguous()
    new = [_keys(x) for x in new]  # (b, g) rows of D
    parts, tail = triton.cdiv(max(width, 1), CMP_PART), spec.n + triton.cdiv(ring, BLOCK)  # programs a row
    states = q.new_empty(B * G, max(parts, tail), ROWS, D + 2, dtype=torch.float32)  # a program's acc, m, l
    stride = spec.l_sel // spec.d
    assert CMP_PART % stride == 0, "a part's first slot starts a sel block's stride"
    scores = q.new_empty(B * G, ROWS, width, dtype=torch.float32)  # each head's slot scores
    sums = q.new_empty(B * G, parts, ROWS, CMP_PART // stride + 1, dtype=torch.float32)  # a part's blocks' sums
    scratch = q.new_empty(B * G, Ns, dtype=torch.float32)  # a row's block scores
    chosen = q.new_empty(B * G, spec.n, dtype=torch.int32)  # the top-n's blocks (-1: none)
    o_cmp = q.new_empty(B * G, ROWS, D, dtype=torch.float32)
    out = torch.empty_like(q)
    warps = 2 * WARPS if kc.dtype == torch.float32 else WARPS
    _decode[(B * G, parts)](
        q, kc, vc, ks, vs, kw, vw, kr, vr, *new, *(x.stride(0) for x in new), t, states, scores, sums, arrivals,
        scratch, chosen, o_cmp, kc.shape[2], ks.shape[2], kw.shape[2], kr.shape[1], width, ring, ring_cmp, Ns, n,
        D ** -0.5, G, max(parts, tail), R=H // G, D=D, L=spec.l, DD=spec.d, LSEL=spec.l_sel, STRIDE=stride,
        BEFORE=spec.l // spec.d - 1, MEMBERS=_pow2(stride + spec.l // spec.d - 1), NS=_pow2(Ns), N=spec.n, ROWS=ROWS,
        BLOCK=BLOCK, CP=CMP_PART, PB=CMP_PART // stride + 1, PC=COMBINE, BB=PART_BLOCKS, SCORES=SCORES,
        num_warps=warps)
    _decode_sel_win[(B * G, tail)](
        q, gates, ks, vs, kw, vw, t, chosen, o_cmp, states, arrivals, out, ks.shape[2], kw.shape[2], ring, D ** -0.5, G,
        max(parts, tail), R=H // G, D=D, LSEL=spec.l_sel, N=spec.n, ROWS=ROWS, BLOCK=BLOCK, PC=COMBINE,
        num_warps=warps)
    return out


def compress_step(phi_k: torch.nn.Module, phi_v: torch.nn.Module, rings: tuple[torch.Tensor, torch.Tensor],
                  new: tuple[torch.Tensor, torch.Tensor], t: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, G: int
                  ) -> None:
    """The compressed key and value (by the Compressors `phi_k`, `phi_v`) of each row whose block (t - l + 1) / d
    completes at t (B,), into that slot of kc (B G, D, Pc) and vc (B G, Pc, D); the block's keys: the cmp rings'
    (B G, ring, D) l - 1 before t, then the new k_cmp, v_cmp (B, 1, G, D). Other rows are left as they are. Two
    launches (the mean phi: one)."""
    L, Dd, D = phi_k.l, phi_k.d, kc.shape[1]
    BG, ring = kc.shape[0], rings[0].shape[1]
    nk, nv = (_keys(x) for x in new)
    hidden, parts = (phi_k.fc1.weight.shape[0], triton.cdiv(L * D, PART)) if phi_k.mlp else (1, 1)
    H = kc.new_empty(2, parts, BG, hidden, dtype=torch.float32)  # fc1's partial sums
    if phi_k.mlp:
        _cmp_hidden[(2 * parts, triton.cdiv(hidden, HIDDEN_BLOCK), triton.cdiv(BG, ROWS))](
            *rings, nk, nv, nk.stride(0), nv.stride(0), phi_k.pos, phi_v.pos, phi_k.fc1.weight, phi_v.fc1.weight, t,
            H, BG, G, ring, hidden, L=L, DD=Dd, D=D, HB=HIDDEN_BLOCK, KB=INPUTS, PART=PART, RT=ROWS,
            EXACT=kc.dtype == torch.float32)
    # fc1's biases, fc2's weights and the value's fc2 bias (the key's has none: `NSAAttention`); the mean: none
    weights = (phi_k.fc1.bias, phi_v.fc1.bias, phi_k.fc2.weight, phi_v.fc2.weight) if phi_k.mlp else (H,) * 4
    b2v = phi_v.fc2.bias if phi_k.mlp else None
    _cmp_out[(2, BG)](H, *weights, H if b2v is None else b2v, *rings, nk, nv, nk.stride(0), nv.stride(0), kc, vc, t,
                      BG, G, ring, kc.shape[2], hidden, parts, L=L, LP=_pow2(L), DD=Dd, D=D, HP=_pow2(hidden),
                      MLP=phi_k.mlp, V_BIAS=b2v is not None)


if triton is not None:

    @triton.jit
    def _dot(a, b, EXACT: tl.constexpr):
        """a @ b accumulated in fp32: fp32 operands exactly (not tf32), bf16 / fp16 ones on the tensor cores."""
        if EXACT:
            return tl.dot(a, b, input_precision="ieee")
        return tl.dot(a, b)

    @triton.jit
    def _run(q, KT, V, P, p0, L, last, acc, m, l, S, sp, D: tl.constexpr, BLOCK: tl.constexpr, EXACT: tl.constexpr,
             KEEP: tl.constexpr):
        """The online softmax of q (ROWS, D; pre-scaled, in the caches' dtype) over keys p0 .. p0 + L - 1 (those up
        to `last`) of KT (D, P), V (P, D); with KEEP, each key's scores also into S (a head's row every sp)."""
        dims, cols = tl.arange(0, D), tl.arange(0, BLOCK)
        for j in range(0, L, BLOCK):
            pos = p0 + j + cols
            ok = (j + cols < L) & (pos <= last)
            k = tl.load(KT + dims[:, None] * P + pos[None, :], mask=ok[None, :], other=0.0)
            s = _dot(q, k, EXACT)
            if KEEP:
                tl.store(S + tl.arange(0, q.shape[0])[:, None] * sp + pos[None, :], s, mask=ok[None, :])
            s = tl.where(ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))  # m starts finite: a row with no key yet keeps p = 0
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new[:, None])
            v = tl.load(V + pos[:, None] * D + dims[None, :], mask=ok[:, None], other=0.0)
            acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, EXACT)
            l = l * alpha + tl.sum(p, 1)
            m = m_new
        return acc, m, l

    @triton.jit
    def _query(Q, bg, scale, R: tl.constexpr, D: tl.constexpr, ROWS: tl.constexpr, DTYPE: tl.constexpr):
        """The row's r query heads (ROWS, D), scaled, in the caches' dtype (the products' operands)."""
        rows, dims = tl.arange(0, ROWS), tl.arange(0, D)
        q = tl.load(Q + (bg * R + rows[:, None]) * D + dims[None, :], mask=(rows < R)[:, None], other=0.0)
        return (q.to(tl.float32) * scale).to(DTYPE)

    @triton.jit
    def _save(ST, bg, j, SW, acc, m, l, D: tl.constexpr, ROWS: tl.constexpr):
        """Program j's online-softmax state (acc (ROWS, D), m, l) into the row's slot j of the scratch states."""
        rows, dims = tl.arange(0, ROWS), tl.arange(0, D)
        state = ST + (bg * SW + j) * ROWS * (D + 2)
        tl.store(state + rows[:, None] * D + dims[None, :], acc)
        tl.store(state + ROWS * D + rows, m)
        tl.store(state + ROWS * D + ROWS + rows, l)

    @triton.jit
    def _combine(ST, bg, SW, lo, hi, D: tl.constexpr, ROWS: tl.constexpr, PC: tl.constexpr):
        """The states lo .. hi - 1 of the row's scratch combined, PC a step: (acc, m, l) of one softmax over all."""
        rows, dims = tl.arange(0, ROWS), tl.arange(0, D)
        acc, m, l = (tl.zeros([ROWS, D], dtype=tl.float32), tl.full([ROWS], -1e30, dtype=tl.float32),
                     tl.zeros([ROWS], dtype=tl.float32))
        for p0 in range(lo, hi, PC):
            ps = p0 + tl.arange(0, PC)
            state = ST + (bg * SW + ps[:, None]) * ROWS * (D + 2)  # (PC, 1)
            live = (ps < hi)[:, None]
            m_p = tl.load(state + ROWS * D + rows[None, :], mask=live, other=-1e30)  # (PC, ROWS)
            l_p = tl.load(state + ROWS * D + ROWS + rows[None, :], mask=live, other=0.0)
            a_p = tl.load(state[:, :, None] + rows[None, :, None] * D + dims[None, None, :], mask=live[:, :, None],
                          other=0.0)  # (PC, ROWS, D)
            m_new = tl.maximum(m, tl.max(m_p, 0))
            alpha, w = tl.exp(m - m_new), tl.exp(m_p - m_new[None, :])
            l = l * alpha + tl.sum(l_p * w, 0)
            acc = acc * alpha[:, None] + tl.sum(a_p * w[:, :, None], 0)
            m = m_new
        return acc, m, l

    @triton.jit
    def _arrive(ARRIVALS, programs):
        """Count this program in (acq_rel, gpu scope: its stores before, the last one's loads after); True for the
        row's last, which sets the count back to 0 for the next step."""
        tl.debug_barrier()  # every thread's stores made before the count
        last = tl.atomic_add(ARRIVALS, 1) == programs - 1
        if last:
            tl.store(ARRIVALS, 0)
        return last

    @triton.jit
    def _decode(Q, KC, VC, KS, VS, KW, VW, KR, VR, NKS, NVS, NKW, NVW, NKR, NVR, snks, snvs, snkw, snvw, snkr, snvr,
                TPOS, ST, LG, SUMS, ARRIVALS, SCR, CHOSEN, OCMP, Pc, Ps, Pw, Pr, width, ring, ring_cmp, Ns, n, scale,
                G, STATES, R: tl.constexpr, D: tl.constexpr, L: tl.constexpr, DD: tl.constexpr, LSEL: tl.constexpr,
                STRIDE: tl.constexpr, BEFORE: tl.constexpr, MEMBERS: tl.constexpr, NS: tl.constexpr, N: tl.constexpr,
                ROWS: tl.constexpr, BLOCK: tl.constexpr, CP: tl.constexpr, PB: tl.constexpr, PC: tl.constexpr,
                BB: tl.constexpr, SCORES: tl.constexpr):
        """Launch 1: the append, cmp by parts; the row's last part: the combined cmp output and the top-n."""
        bg, part, parts = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.num_programs(1)
        b = bg // G
        t = tl.load(TPOS + b)
        n_cmp = tl.where(t + 1 >= L, (t + 1 - L) // DD + 1, 0)
        rows, dims = tl.arange(0, ROWS), tl.arange(0, D)
        if part == 0:  # append the new token's keys and values: sel's at t, the window's and the cmp raw keys' rings
            g = bg % G
            tw, tr = t % ring, t % ring_cmp
            tl.store(KS + bg * D * Ps + dims * Ps + t, tl.load(NKS + b * snks + g * D + dims))
            tl.store(VS + (bg * Ps + t) * D + dims, tl.load(NVS + b * snvs + g * D + dims))
            tl.store(KW + bg * D * Pw + dims * Pw + tw, tl.load(NKW + b * snkw + g * D + dims))
            tl.store(VW + (bg * Pw + tw) * D + dims, tl.load(NVW + b * snvw + g * D + dims))
            tl.store(KR + (bg * Pr + tr) * D + dims, tl.load(NKR + b * snkr + g * D + dims))
            tl.store(VR + (bg * Pr + tr) * D + dims, tl.load(NVR + b * snvr + g * D + dims))
        EXACT: tl.constexpr = KC.dtype.element_ty == tl.float32
        q = _query(Q, bg, scale, R, D, ROWS, KC.dtype.element_ty)
        # cmp over this part's slots: its state, and its slots' scores (a head's row every `width`)
        acc, m, l = _run(q, KC + bg * D * Pc, VC + bg * Pc * D, Pc, part * CP, CP, n_cmp - 1, tl.zeros([ROWS, D], dtype=tl.float32),
                         tl.full([ROWS], -1e30, dtype=tl.float32), tl.zeros([ROWS], dtype=tl.float32),
                         LG + bg * ROWS * width, width, D, BLOCK, EXACT, True)
        _save(ST, bg, part, STATES, acc, m, l, D, ROWS)
        tl.debug_barrier()  # the part's scores, written by some threads, read by others
        # its blocks' member sums per head: block part * CP / STRIDE + i, i < PB (a block's first members may lie in
        # the part before, its last in the one after)
        members = tl.arange(0, MEMBERS)
        for i0 in range(0, PB, BB):
            i = i0 + tl.arange(0, BB)
            slot = (part * (CP // STRIDE) + i)[:, None] * STRIDE - BEFORE + members[None, :]  # (BB, MEMBERS)
            inside = ((i < PB)[:, None] & (members < STRIDE + BEFORE)[None, :] & (slot >= part * CP)
                      & (slot < part * CP + CP) & (slot < n_cmp))
            s = tl.load(LG + (bg * ROWS + rows[:, None, None]) * width + slot[None, :, :],
                        mask=(rows < R)[:, None, None] & inside[None, :, :], other=float("-inf"))
            tl.store(SUMS + ((bg * parts + part) * ROWS + rows[:, None]) * PB + i[None, :],
                     tl.sum(tl.exp(s - m[:, None, None]), 2), mask=(i < PB)[None, :])
        if _arrive(ARRIVALS + bg * 2, parts):  # the row's last part: the rest of launch 1
            acc_c, m_c, l_c = _combine(ST, bg, STATES, 0, parts, D, ROWS, PC)
            inv = 1.0 / tl.where(l_c > 0, l_c, 1.0)
            tl.store(OCMP + (bg * ROWS + rows[:, None]) * D + dims[None, :], acc_c * inv[:, None])
            _top_n(ST, SUMS, SCR, CHOSEN, Ns, n, bg, t, parts, STATES, m_c, inv, R, D, LSEL, STRIDE, BEFORE, NS, N,
                   ROWS, CP, PB, SCORES)

    @triton.jit
    def _top_n(ST, SUMS, SCR, CHOSEN, Ns, n, bg, t, parts, STATES, m_c, inv, R: tl.constexpr, D: tl.constexpr,
               LSEL: tl.constexpr, STRIDE: tl.constexpr, BEFORE: tl.constexpr, NS: tl.constexpr, N: tl.constexpr,
               ROWS: tl.constexpr, CP: tl.constexpr, PB: tl.constexpr, SCORES: tl.constexpr):
        """Each block's score (the sums of the parts its members lie in, each scaled by exp(its max - m_c) and
        1 / sum inv, summed over the heads) into SCR, then the row's top-n blocks into CHOSEN (N a row; -1: none)."""
        rows = tl.arange(0, ROWS)
        heads = (rows < R)[None, :]
        for j0 in range(0, Ns, SCORES):
            blocks = j0 + tl.arange(0, SCORES)
            first = tl.maximum(blocks * STRIDE - BEFORE, 0) // CP  # the parts of its first and last members
            score = tl.zeros([SCORES], dtype=tl.float32)
            for side in tl.static_range(2):
                p = first if side == 0 else (blocks * STRIDE + STRIDE - 1) // CP
                use = ((blocks < Ns) & (p < parts) & ((side == 0) | (p != first)))[:, None] & heads
                m_p = tl.load(ST + (bg * STATES + p[:, None]) * ROWS * (D + 2) + ROWS * D + rows[None, :], mask=use,
                              other=-1e30)  # (SCORES, ROWS)
                part_sum = tl.load(SUMS + ((bg * parts + p[:, None]) * ROWS + rows[None, :]) * PB
                                   + (blocks - p * (CP // STRIDE))[:, None], mask=use, other=0.0)
                score += tl.sum(part_sum * tl.exp(m_p - m_c[None, :]) * inv[None, :], 1)
            tl.store(SCR + bg * Ns + blocks, score, mask=blocks < Ns)
        tl.debug_barrier()  # the scores, written by some threads, read by all
        jt = t // LSEL
        last = tl.minimum(jt - 2, Ns - 1)
        blocks = tl.arange(0, NS)
        score = tl.load(SCR + bg * Ns + blocks, mask=blocks < Ns, other=0.0)
        score = tl.where((blocks > 0) & (blocks <= last), score, float("inf"))  # block 0 and the local ones
        score = tl.where((blocks > jt) | (blocks >= Ns), float("-inf"), score)
        for c in range(N):  # n rounds of an argmax, ties to the lower block
            best = tl.max(score, 0)
            j = tl.argmax(score, 0, tie_break_left=True)
            score = tl.where(blocks == j, float("-inf"), score)
            tl.store(CHOSEN + bg * N + c, tl.where((c < n) & (best > float("-inf")), j, -1))

    @triton.jit
    def _decode_sel_win(Q, GATE, KS, VS, KW, VW, TPOS, CHOSEN, OCMP, ST, ARRIVALS, OUT, Ps, Pw, ring, scale, G,
                        STATES, R: tl.constexpr, D: tl.constexpr, LSEL: tl.constexpr, N: tl.constexpr,
                        ROWS: tl.constexpr, BLOCK: tl.constexpr, PC: tl.constexpr):
        """Launch 2: program j < N attends to the row's j-th chosen block (its l' keys up to the token), the others
        to BLOCK slots each of the window's ring (up to min(t, ring - 1)); the row's last: sel's and win's states
        combined, the gated sum with cmp's output, in q's dtype."""
        bg, j, programs = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.num_programs(1)
        t = tl.load(TPOS + bg // G)
        EXACT: tl.constexpr = KS.dtype.element_ty == tl.float32
        q = _query(Q, bg, scale, R, D, ROWS, KS.dtype.element_ty)
        zero, start = tl.zeros([ROWS, D], dtype=tl.float32), tl.full([ROWS], -1e30, dtype=tl.float32)
        if j < N:
            block = tl.load(CHOSEN + bg * N + j)
            acc, m, l = _run(q, KS + bg * D * Ps, VS + bg * Ps * D, Ps, block * LSEL, tl.where(block >= 0, LSEL, 0), t,
                             zero, start, tl.zeros([ROWS], dtype=tl.float32), OUT, 0, D, LSEL, EXACT, False)
        else:
            acc, m, l = _run(q, KW + bg * D * Pw, VW + bg * Pw * D, Pw, (j - N) * BLOCK, BLOCK, tl.minimum(t, ring - 1),
                             zero, start, tl.zeros([ROWS], dtype=tl.float32), OUT, 0, D, BLOCK, EXACT, False)
        _save(ST, bg, j, STATES, acc, m, l, D, ROWS)
        if _arrive(ARRIVALS + bg * 2 + 1, programs):
            rows, dims = tl.arange(0, ROWS), tl.arange(0, D)
            heads = rows < R
            acc_s, _, l_s = _combine(ST, bg, STATES, 0, N, D, ROWS, PC)
            acc_w, _, l_w = _combine(ST, bg, STATES, N, programs, D, ROWS, PC)
            gate = GATE + (bg * R + rows) * 3  # a branch with no key gives 0
            out = tl.load(gate, mask=heads, other=0.0)[:, None] * tl.load(OCMP + (bg * ROWS + rows[:, None]) * D
                                                                          + dims[None, :])
            out += tl.load(gate + 1, mask=heads, other=0.0)[:, None] * acc_s / tl.where(l_s > 0, l_s, 1.0)[:, None]
            out += tl.load(gate + 2, mask=heads, other=0.0)[:, None] * acc_w / tl.where(l_w > 0, l_w, 1.0)[:, None]
            tl.store(OUT + (bg * R + rows[:, None]) * D + dims[None, :], out.to(OUT.dtype.element_ty),
                     mask=heads[:, None])

    @triton.jit
    def _block_keys(RING, NEW, sn, rows, b, g, first, ring, j, dd, live, L: tl.constexpr, D: tl.constexpr):
        """Key j (< L) of each row's block from `first`, dimension dd: the ring's for j < L - 1, else the new one."""
        old = tl.load(RING + (rows * ring + (first + j) % ring) * D + dd, mask=live & (j < L - 1), other=0.0)
        return old + tl.load(NEW + b * sn + g * D + dd, mask=live & (j == L - 1), other=0.0)

    @triton.jit
    def _cmp_hidden(KR, VR, NK, NV, snk, snv, POSK, POSV, W1K, W1V, TPOS, H, BG, G, ring, hidden, L: tl.constexpr,
                    DD: tl.constexpr, D: tl.constexpr, HB: tl.constexpr, KB: tl.constexpr, PART: tl.constexpr,
                    RT: tl.constexpr, EXACT: tl.constexpr):
        """fc1(block + pos) of RT rows' blocks (keys: even programs, values: odd) for HB hidden units over one PART
        of the inputs, into H (the rows whose block completes; the others read nothing)."""
        kv, part, h0 = tl.program_id(0) % 2, tl.program_id(0) // 2, tl.program_id(1) * HB
        rows = tl.program_id(2) * RT + tl.arange(0, RT)
        b, g = rows // G, rows % G
        first = tl.load(TPOS + b, mask=rows < BG, other=0) - L + 1
        live = (rows < BG) & (first >= 0) & (first % DD == 0)
        hid = h0 + tl.arange(0, HB)
        acc = tl.zeros([RT, HB], dtype=tl.float32)
        for f0 in range(part * PART, part * PART + PART, KB):
            f = f0 + tl.arange(0, KB)
            j, dd = f // D, f % D
            ok = live[:, None] & (f[None, :] < L * D)
            w_ok = (hid[None, :] < hidden) & (f[:, None] < L * D)
            if kv == 0:  # branches, not a pointer chosen at run time (with one, fp32 spilled 3 KB on sm_90)
                x = _block_keys(KR, NK, snk, rows[:, None], b[:, None], g[:, None], first[:, None], ring, j[None, :],
                                dd[None, :], ok, L, D) + tl.load(POSK + f, mask=f < L * D, other=0.0)[None, :]
                w = tl.load(W1K + hid[None, :] * (L * D) + f[:, None], mask=w_ok, other=0.0)  # fc1's weight, (KB, HB)
            else:
                x = _block_keys(VR, NV, snv, rows[:, None], b[:, None], g[:, None], first[:, None], ring, j[None, :],
                                dd[None, :], ok, L, D) + tl.load(POSV + f, mask=f < L * D, other=0.0)[None, :]
                w = tl.load(W1V + hid[None, :] * (L * D) + f[:, None], mask=w_ok, other=0.0)
            acc += _dot(x.to(w.dtype), w, EXACT)
        parts = tl.num_programs(0) // 2
        tl.store(H + ((kv * parts + part) * BG + rows[:, None]) * hidden + hid[None, :], acc,
                 mask=live[:, None] & (hid[None, :] < hidden))

    @triton.jit
    def _cmp_out(H, B1K, B1V, W2K, W2V, B2V, KR, VR, NK, NV, snk, snv, KC, VC, TPOS, BG, G, ring, Pc, hidden, parts,
                 L: tl.constexpr, LP: tl.constexpr, DD: tl.constexpr, D: tl.constexpr, HP: tl.constexpr,
                 MLP: tl.constexpr, V_BIAS: tl.constexpr):
        """A row's compressed key (program 0) or value (1) where its block completes: fc2(silu(fc1)) (fc1's parts
        added, + its bias; + the value's fc2 bias), each layer's output in the weights' dtype, or the mean of its
        keys; the keys into KC transposed, the values into VC."""
        kv, row = tl.program_id(0), tl.program_id(1).to(tl.int64)
        b, g = row // G, row % G
        first = tl.load(TPOS + b) - L + 1
        if (first >= 0) & (first % DD == 0):
            dims = tl.arange(0, D)
            if MLP:
                hid = tl.arange(0, HP)
                z = tl.load((B1K if kv == 0 else B1V) + hid, mask=hid < hidden, other=0.0).to(tl.float32)
                for part in range(parts):
                    z += tl.load(H + ((kv * parts + part) * BG + row) * hidden + hid, mask=hid < hidden, other=0.0)
                W2 = W2K if kv == 0 else W2V
                z = z.to(W2.dtype.element_ty).to(tl.float32)
                h = (z / (1 + tl.exp(-z))).to(W2.dtype.element_ty).to(tl.float32)  # silu
                w = tl.load(W2 + dims[:, None] * hidden + hid[None, :], mask=hid[None, :] < hidden, other=0.0)
                y = tl.sum(w.to(tl.float32) * h[None, :], 1)
                if V_BIAS & (kv == 1):
                    y += tl.load(B2V + dims).to(tl.float32)
            else:
                j = tl.arange(0, LP)[:, None]
                RING, NEW, sn = KR if kv == 0 else VR, NK if kv == 0 else NV, snk if kv == 0 else snv
                x = _block_keys(RING, NEW, sn, row, b, g, first, ring, j, dims[None, :], j < L, L, D)
                y = tl.sum(x.to(tl.float32), 0) / L
            if kv == 0:
                tl.store(KC + (row * D + dims) * Pc + first // DD, y.to(KC.dtype.element_ty))  # keys transposed
            else:
                tl.store(VC + (row * Pc + first // DD) * D + dims, y.to(VC.dtype.element_ty))
