"""The Triton family: the whole NSA attention as one custom op of Triton kernels (`triton_nsa.py`,
`triton_nsa_sel.py`, `triton_nsa_backward.py`), on CUDA, or on the CPU under TRITON_INTERPRET=1 (checks): forward
a zero fill, four kernels and a cumulative sum (the inverse index of the chosen blocks); backward a zero fill,
four kernels and a cast: 12 launches at any T, no atomic add of a query's gradient. With cmp's log-sum-exp given
(`selected`: the flex family's, from Flex), sel alone by the same kernels, the cmp pass of the first left out. This
module is the host side: the launch geometry, the custom op (one node under torch.compile) and its registered
backward."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ...documents import Documents
from ...spec import NSASpec
from ..base import Family
from . import triton_nsa as kernels
from . import triton_nsa_backward as backward_kernels
from . import triton_nsa_sel as sel_kernels

Tensor = torch.Tensor
OptTensor = Tensor | None


OFFSETS = 2**31
"""The kernels' offsets are 32-bit: the largest buffer a call indexes (3 branch outputs of q's size, sel's n block
outputs a query, the fp32 key gradients) must stay below."""


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2(x: int) -> int:
    """The least power of two >= x."""
    return 1 << (x - 1).bit_length()


class Triton(Family):
    name, label = "triton", "Triton kernels, one op"

    @staticmethod
    def problem(device: torch.device, dtype: torch.dtype, spec: NSASpec, heads_per_group: int, head_dim: int
                ) -> str | None:
        return kernels.problem(device, dtype, spec, heads_per_group, head_dim)

    def attend(self, q: Tensor, k_cmp: Tensor, v_cmp: Tensor, k_sel: Tensor, v_sel: Tensor, k_win: Tensor,
               v_win: Tensor, gates: Tensor, spec: NSASpec, docs: Documents | None, q0: int,
               branches: tuple[bool, bool, bool]) -> tuple[Tensor, Tensor, Tensor]:
        fields = (None,) * 3 if docs is None else (docs.start, docs.cmp_start, docs.first_slot)
        out, _, _, idx, valid, _, _, _ = _op(q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates,
                                          [spec.l, spec.d, spec.l_sel, spec.n, spec.w], q0, list(branches), *fields)
        return out, idx, valid


def selected(q: Tensor, k_cmp: Tensor, v_cmp: Tensor, k_sel: Tensor, v_sel: Tensor, gates: Tensor, cmp_lse: Tensor,
             spec: NSASpec, docs: Documents | None, q0: int) -> tuple[Tensor, Tensor, Tensor]:
    """The gated sel branch alone, gates[..., 1] * o_sel (B, Tq, H, D), and its blocks idx, valid (B, G, Tq, n'),
    chosen from cmp's log-sum-exp `cmp_lse` (B, H, Tq) computed elsewhere; forward and backward by the Triton
    kernels (cmp's and win's outputs not computed, no gradient through the choice)."""
    fields = (None,) * 3 if docs is None else (docs.start, docs.cmp_start, docs.first_slot)
    out, _, _, idx, valid, *_ = _op(q, k_cmp, v_cmp, k_sel, v_sel, k_sel, v_sel, gates,  # win's place: unread
                                    [spec.l, spec.d, spec.l_sel, spec.n, spec.w], q0, [False, True, False], *fields,
                                    cmp_lse)
    return out, idx, valid


def _keys(x: torch.Tensor) -> torch.Tensor:
    """x (B, S, G, D) as the kernels read it: D and G packed (a view from the projections is)."""
    return x if x.stride(3) == 1 and x.stride(2) == x.shape[3] else x.contiguous()


def _geometry(q: torch.Tensor, keys: list[torch.Tensor], gates: torch.Tensor, spec: NSASpec,
              docs: Documents | None, q0: int) -> tuple[dict, dict]:
    """The pointers and the arguments every kernel shares: strides, sizes, block geometry."""
    B, Tq, H, D = q.shape
    kc, vc, ks, vs, kw, vw = keys
    T, G = ks.shape[1], ks.shape[2]
    largest = max(3 * q.numel(), spec.n * q.numel(), (2 * kc.shape[1] + 4 * T) * B * G * D,
                  *(x.stride(0) * B for x in (q, *keys)))
    if largest >= OFFSETS:
        raise ValueError(f"the Triton kernels index with 32-bit offsets, and this call needs {largest:,} (at most "
                         f"{OFFSETS - 1:,}): run fewer sequences per call (a smaller local_batch_size)")
    r = H // G
    bt = max(1, kernels.ROWS // r)
    docs_args = (dict(CSTART=docs.cmp_start, START=docs.start, FIRST=docs.first_slot) if docs is not None
                 else dict(CSTART=q, START=q, FIRST=q))  # unread without documents
    ptrs = dict(Q=q, KC=kc, VC=vc, KS=ks, VS=vs, KW=kw, VW=vw, GATE=gates, **docs_args)
    args = dict(sqb=q.stride(0), sqt=q.stride(1), skcb=kc.stride(0), skct=kc.stride(1), svcb=vc.stride(0),
                svct=vc.stride(1), sksb=ks.stride(0), skst=ks.stride(1), svsb=vs.stride(0), svst=vs.stride(1),
                skwb=kw.stride(0), skwt=kw.stride(1), svwb=vw.stride(0), svwt=vw.stride(1), sgb=gates.stride(0),
                sgt=gates.stride(1), sdb=T if docs is not None else 0,
                scb=docs.cmp_start.stride(0) if docs is not None else 0, Tq=Tq, T=T, Nc=kc.shape[1], q0=q0, G=G,
                H=H, scale=D**-0.5, d=spec.d, l=spec.l, w=spec.w, ob_c=B * Tq * H * D, st_c=B * Tq * H,
                R=r, BT=bt, M=_pow2(bt * r), D=D, DOCS=docs is not None)
    return ptrs, args


def _spans(offsets: torch.Tensor, entries: int, bt: int) -> tuple[tuple[int], dict]:
    """The grid and the arguments of a kernel over equal spans of the inverse index (`triton_nsa_sel`)."""
    span, blocks = kernels.READER_STEPS * bt, offsets.numel() - 1
    return (_cdiv(entries, span),), dict(OFFSETS=offsets, blocks=blocks, SPAN=span, STEPS=blocks.bit_length())


def forward(q: torch.Tensor, keys: list[torch.Tensor], gates: torch.Tensor, spec: NSASpec, docs: Documents | None,
            q0: int, branches: tuple[bool, bool, bool], cmp_lse: Tensor | None = None
            ) -> tuple[torch.Tensor, ...]:
    """out (B, Tq, H, D), the branch outputs (3, B, Tq, H, D) and logsumexps (3, B, Tq, H) fp32, the chosen
    blocks idx (B, G, Tq, n') long, valid bool, and their inverse index (offsets (B G T + 1), readers (B G Tq n'),
    int32: `triton_nsa_sel`) with each choice's place in it (entry (B, G, Tq, n') int32, -1 for none): a zero
    fill, four kernels and a cumulative sum. With cmp's log-sum-exp `cmp_lse` (B, H, Tq) fp32 given, cmp is not
    computed (`_fwd_cmp`'s top-n pass alone)."""
    if cmp_lse is not None and branches[0]:
        raise ValueError("with cmp's log-sum-exp given the op computes no cmp branch: pass branches[0] = False")
    B, Tq, H, D = q.shape
    keys = [_keys(x) for x in keys]
    T, G = keys[2].shape[1], keys[2].shape[2]
    ptrs, args = _geometry(q, keys, gates, spec, docs, q0)
    Ns = spec.num_sel_blocks(T)
    n = min(spec.n, Ns)
    out = torch.empty(B, Tq, H, D, dtype=q.dtype, device=q.device)
    fill = torch.empty if all(branches) else torch.zeros  # a branch left out: its part of ob and lse, zero
    ob = fill(3, B, Tq, H, D, dtype=q.dtype, device=q.device)
    lse = fill(3, B, Tq, H, dtype=torch.float32, device=q.device)
    idx = torch.empty(B, G, Tq, n, dtype=torch.long, device=q.device)
    valid = torch.empty(B, G, Tq, n, dtype=torch.bool, device=q.device)
    entries = B * G * Tq * n
    # one fill: the reader lists (zero past the last reader), 0, the readers of each block, those entered so far
    index = torch.zeros(entries + 2 * B * G * T + 1, dtype=torch.int32, device=q.device)
    readers, counts = index[:entries], index[entries:]
    entry = torch.empty(B, G, Tq, n, dtype=torch.int32, device=q.device)  # written whole by `_fwd_win`
    bt, grid, flags = args["BT"], (_cdiv(Tq, args["BT"]), B * G), dict(num_warps=kernels.WARPS)
    tile = {k: args[k] for k in ("sqb", "sqt", "sdb", "Tq", "T", "q0", "G", "H", "scale", "R", "BT", "M", "D", "DOCS")}
    docs_ptrs = dict(Q=q, START=ptrs["START"], FIRST=ptrs["FIRST"])
    blocks = dict(IDX=idx, VALID=valid.view(torch.int8), L=spec.l_sel, N=n, NP=_pow2(n))
    given = cmp_lse if cmp_lse is not None else lse  # unread without
    kernels._fwd_cmp[grid](
        **tile, **docs_ptrs, **blocks, KC=keys[0], VC=keys[1], CSTART=ptrs["CSTART"],
        **{k: args[k] for k in ("skcb", "skct", "svcb", "svct", "scb", "Nc", "d", "l")}, OB=ob, LSE=lse,
        CMP_LSE=given, slb=given.stride(0), slh=given.stride(1), slt=given.stride(2), COUNT=counts[1:], Ns=Ns,
        BTP=max(16, _pow2(bt)), NB=kernels.topn_blocks(spec, n), BN=kernels.BLOCK_N, STRIDE=spec.l_sel // spec.d,
        BEFORE=spec.l // spec.d - 1, GIVEN=cmp_lse is not None, **flags)
    offsets = torch.cumsum(counts[:B * G * T + 1], 0, dtype=torch.int32)
    kernels._fwd_win[grid](
        **tile, **docs_ptrs, **blocks, KW=keys[4], VW=keys[5], **{k: args[k] for k in ("skwb", "skwt", "svwb", "svwt",
                                                                                         "w", "ob_c", "st_c")},
        OB=ob, LSE=lse, OFFSETS=offsets, FILL=counts[B * G * T + 1:], READERS=readers, ENTRY=entry,
        BN=kernels.BLOCK_N, SEL=branches[1], WIN=branches[2], **flags)
    part = plse = lse  # unread without sel
    if branches[1]:  # each entry's output and logsumexp over its block
        part = torch.empty(entries * args["R"] * D, dtype=torch.float32, device=q.device)
        plse = torch.empty(entries * args["R"], dtype=torch.float32, device=q.device)
        span_grid, span_args = _spans(offsets, entries, bt)
        sel_kernels._fwd_sel[span_grid](
            Q=q, KS=keys[2], VS=keys[3], READERS=readers, PART=part, PLSE=plse, **span_args,
            **{k: args[k] for k in ("sqb", "sqt", "sksb", "skst", "svsb", "svst", "T", "q0", "G", "scale", "R", "BT",
                                    "M", "D")}, L=spec.l_sel, **flags)
    kernels._fwd_mix[grid](
        GATE=gates, O=out, OB=ob, LSE=lse, VALID=blocks["VALID"], ENTRY=entry, PART=part, PLSE=plse,
        **{k: args[k] for k in ("sgb", "sgt", "Tq", "G", "H", "ob_c", "st_c", "R", "BT", "M", "D")}, N=n,
        CMP=branches[0], SEL=branches[1], WIN=branches[2], **flags)
    return out, ob, lse, idx, valid, offsets, readers, entry


def backward(d_out: torch.Tensor, q: torch.Tensor, keys: list[torch.Tensor], gates: torch.Tensor, ob: torch.Tensor,
             lse: torch.Tensor, offsets: torch.Tensor, readers: torch.Tensor, entry: torch.Tensor, spec: NSASpec,
             docs: Documents | None, q0: int, branches: tuple[bool, bool, bool]) -> list[torch.Tensor]:
    """dq and the six key and value gradients in one flat buffer (`grads`), and d_gates, of `forward`'s output:
    a zero fill, four kernels (sel's dK, dV and per-entry dQ first) and one conversion to q's dtype."""
    B, Tq, H, D = q.shape
    keys = [_keys(x) for x in keys]
    T, G, Nc = keys[2].shape[1], keys[2].shape[2], keys[0].shape[1]
    ptrs, args = _geometry(q, keys, gates, spec, docs, q0)
    sizes = _grad_sizes(q, keys[0], keys[2], branches)
    at = [sum(sizes[:i]) for i in range(7)]
    gk = torch.zeros(sum(sizes), dtype=torch.float32, device=q.device)
    dg = torch.empty(B, Tq, H, 3, dtype=torch.float32, device=q.device)
    delta = torch.empty(2, B, Tq, H, dtype=torch.float32, device=q.device)  # cmp, win
    bt, flags = args["BT"], dict(num_warps=kernels.WARPS)
    grads = dict(DO=d_out, sdob=d_out.stride(0), sdot=d_out.stride(1), LSE=lse, DELTA=delta, GK=gk)
    dqe = gk  # unread without sel
    if branches[1]:  # sel's dK, dV and each entry's dQ rows: equal spans of the readers of all chosen blocks
        dqe = torch.empty(readers.numel() * args["R"] * D, dtype=torch.float32, device=q.device)
        bt_kv = max(1, kernels.SEL_KV_ROWS // args["R"])
        span_grid, span_args = _spans(offsets, readers.numel(), bt_kv)
        sel_kernels._bwd_sel_kv[span_grid](
            Q=q, KS=keys[2], VS=keys[3], GATE=gates, **{k: grads[k] for k in ("DO", "sdob", "sdot", "LSE", "GK")},
            OB=ob, DQE=dqe, READERS=readers, **span_args, BT=bt_kv, M=_pow2(bt_kv * args["R"]),
            **{k: args[k] for k in ("sqb", "sqt", "sksb", "skst", "svsb", "svst", "sgb", "sgt", "Tq", "T", "q0", "G",
                                    "H", "scale", "ob_c", "st_c", "R", "D")},
            gk_ks=at[3], gk_vs=at[4], L=spec.l_sel, **flags)
    sel_keys = ("KS", "VS", "sksb", "skst", "svsb", "svst")
    backward_kernels._bwd_q[(_cdiv(Tq, bt), B * G)](
        **{k: x for k, x in {**ptrs, **args}.items() if k not in sel_keys}, **{k: x for k, x in grads.items() if k !=
                                                                               "GK"},
        OB=ob, DQ=gk[:at[1]], DG=dg, ENTRY=entry, DQE=dqe, N=entry.shape[-1], BN=kernels.BLOCK_N, CMP=branches[0],
        SEL=branches[1], WIN=branches[2], **flags)
    key_args = ("sqb", "sqt", "sgb", "sgt", "sdb", "scb", "Tq", "T", "q0", "G", "H", "scale", "d", "l", "w", "R", "BT",
                "M", "D", "DOCS")
    common = dict(**{k: args[k] for k in key_args}, **grads, Q=q, GATE=gates, CSTART=ptrs["CSTART"],
                  START=ptrs["START"], FIRST=ptrs["FIRST"], BN=kernels.KV_BLOCK, **flags)
    for on, (k, v), S, lse_at, delta_at, gk_at, segs, win in (
            (branches[0], keys[:2], Nc, 0, 0, at[1:3], _cdiv(Tq, kernels.KV_SEGMENT), False),  # cmp: x query segments
            (branches[2], keys[4:], T, 2 * B * Tq * H, B * Tq * H, at[5:], 1, True)):  # lse: win's is the third
        if on:
            backward_kernels._bwd_kv[(_cdiv(S, kernels.KV_BLOCK) * segs, B * G)](
                **common, K=k, V=v, skb=k.stride(0), skt=k.stride(1), svb=v.stride(0), svt=v.stride(1), S=S,
                lse_at=lse_at, delta_at=delta_at, gk_k=gk_at[0], gk_v=gk_at[1], SEGS=segs,
                SEG=Tq if win else kernels.KV_SEGMENT, WIN=win)
    return [gk if q.dtype == torch.float32 else gk.to(q.dtype), dg.to(gates.dtype)]


def _computed(branches: Sequence[bool]) -> list[bool]:
    """Which of dq and the six key and value gradients a call computes (a branch left out: none of its keys)."""
    return [True, *(on for on in branches for _ in range(2))]


def _grad_sizes(q: torch.Tensor, kc: torch.Tensor, ks: torch.Tensor, branches: Sequence[bool]) -> list[int]:
    """Elements of dq, then of the six key and value gradients, in `backward`'s one buffer (0 for those not
    computed)."""
    sizes = [q.numel()] + [kc.numel()] * 2 + [ks.numel()] * 4
    return [size * on for size, on in zip(sizes, _computed(branches))]


def grads(flat: torch.Tensor, q: torch.Tensor, kc: torch.Tensor, ks: torch.Tensor, branches: Sequence[bool]
          ) -> list[torch.Tensor | None]:
    """`backward`'s buffer as views: dq (B, Tq, H, D), the key and value gradients (B, Nc, G, D) x 2, (B, T, G, D)
    x 4; None for a branch not computed."""
    sizes, shapes = _grad_sizes(q, kc, ks, branches), [q.shape] + [kc.shape] * 2 + [ks.shape] * 4
    at = [sum(sizes[:i]) for i in range(7)]
    return [flat[a:a + size].view(shape) if on else None
            for a, size, shape, on in zip(at, sizes, shapes, _computed(branches))]



def _docs(start: OptTensor, cmp_start: OptTensor, first_slot: OptTensor) -> Documents | None:
    """The geometry the kernels read (the end of each document is not: the rules need only starts)."""
    return None if start is None else Documents(start, start, cmp_start, first_slot)


def _spec(spec: list[int]) -> NSASpec:
    return NSASpec(*spec)


@torch.library.custom_op("nsa_titan::nsa_triton", mutates_args=())
def _op(q: Tensor, kc: Tensor, vc: Tensor, ks: Tensor, vs: Tensor, kw: Tensor, vw: Tensor, gates: Tensor,
        spec: list[int], q0: int, branches: list[bool], start: OptTensor, cmp_start: OptTensor, first_slot: OptTensor,
        cmp_lse: OptTensor = None) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    return forward(q, [kc, vc, ks, vs, kw, vw], gates, _spec(spec), _docs(start, cmp_start, first_slot), q0,
                   tuple(branches), cmp_lse)


@_op.register_fake
def _(q, kc, vc, ks, vs, kw, vw, gates, spec, q0, branches, start, cmp_start, first_slot, cmp_lse=None):
    B, Tq, H, D = q.shape
    T, G = ks.shape[1], ks.shape[2]
    n = min(spec[3], _spec(spec).num_sel_blocks(T))
    return (q.new_empty(B, Tq, H, D), q.new_empty(3, B, Tq, H, D), q.new_empty(3, B, Tq, H, dtype=torch.float32),
            q.new_empty(B, G, Tq, n, dtype=torch.long), q.new_empty(B, G, Tq, n, dtype=torch.bool),
            q.new_empty(B * G * T + 1, dtype=torch.int32), q.new_empty(B * G * Tq * n, dtype=torch.int32),
            q.new_empty(B, G, Tq, n, dtype=torch.int32))


@torch.library.custom_op("nsa_titan::nsa_triton_backward", mutates_args=())
def _backward_op(d_out: Tensor, q: Tensor, kc: Tensor, vc: Tensor, ks: Tensor, vs: Tensor, kw: Tensor, vw: Tensor,
                 gates: Tensor, ob: Tensor, lse: Tensor, offsets: Tensor, readers: Tensor, entry: Tensor,
                 spec: list[int], q0: int, branches: list[bool], start: OptTensor, cmp_start: OptTensor,
                 first_slot: OptTensor) -> list[Tensor]:
    return backward(d_out, q, [kc, vc, ks, vs, kw, vw], gates, ob, lse, offsets, readers, entry, _spec(spec),
                    _docs(start, cmp_start, first_slot), q0, tuple(branches))


@_backward_op.register_fake
def _(d_out, q, kc, vc, ks, vs, kw, vw, gates, ob, lse, offsets, readers, entry, spec, q0, branches, start, cmp_start,
      first_slot):
    return [q.new_empty(sum(_grad_sizes(q, kc, ks, branches))),
            torch.empty_like(gates, memory_format=torch.contiguous_format)]


def _setup(ctx, inputs, output) -> None:
    q, kc, vc, ks, vs, kw, vw, gates, spec, q0, branches, start, cmp_start, first_slot, *_ = inputs
    _, ob, lse, idx, valid, offsets, readers, entry = output
    ctx.save_for_backward(q, kc, vc, ks, vs, kw, vw, gates, ob, lse, offsets, readers, entry, start, cmp_start,
                          first_slot)
    ctx.spec, ctx.q0, ctx.branches = spec, q0, branches
    ctx.mark_non_differentiable(ob, lse, idx, valid, offsets, readers, entry)
    ctx.set_materialize_grads(False)  # no zero-filled gradients of the saved outputs


def _grad(ctx, d_out, *_saved_outputs):
    q, kc, vc, ks, vs, kw, vw, gates, ob, lse, offsets, readers, entry, start, cmp_start, first_slot = ctx.saved_tensors
    flat, dg = _backward_op(d_out.contiguous(), q, kc, vc, ks, vs, kw, vw, gates, ob, lse, offsets, readers, entry,
                            ctx.spec, ctx.q0, ctx.branches, start, cmp_start, first_slot)
    return *grads(flat, q, kc, ks, ctx.branches), dg, *(None,) * 7


_op.register_autograd(_grad, setup_context=_setup)
