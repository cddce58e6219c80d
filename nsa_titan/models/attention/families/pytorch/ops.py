"""The fast path's branches as custom ops: one node each for torch.compile, the same code eager.

Traced by dynamo, the chunk loops of `fast_shared.py` and `fast_sel.py` would be unrolled into the
graph: one copy of a chunk's work per chunk, so that compile time (and the graph) grow with T.
Registered as `torch.library.custom_op`s with their backward ops (`register_autograd`), each
branch is one opaque node whose fake implementation gives only the output shapes: the graph, and
the time to compile it, are the same at every T, and `fullgraph` blocks still compile. Documents
come in as tensors, their host bounds too (`ChunkBounds.table`, on the host), so one compiled graph
serves every layout and still reads only each chunk's documents' keys. Eager runs call the same
ops. Each forward keeps only its inputs, its output and the logsumexp of each (query, head); each
backward recomputes the scores chunk by chunk.
"""

from __future__ import annotations

import torch

from ...documents import ChunkBounds, Documents
from ...spec import NSASpec
from ..cpp import cpu_attention
from .fast_sel import selected_backward, selected_forward
from .fast_shared import shared_backward, shared_forward

Tensor = torch.Tensor
OptTensor = Tensor | None


def _contiguous(xs: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    """An op's outputs in the strides its fake implementation promises (dense, row-major)."""
    return tuple(x.contiguous() for x in xs)


def _docs(start: OptTensor, end: OptTensor, cmp_start: OptTensor, first_slot: OptTensor) -> Documents | None:
    return None if start is None else Documents(start, end, cmp_start, first_slot)


def _bounds(table: OptTensor) -> ChunkBounds | None:
    return None if table is None else ChunkBounds(table)


def _no_blocks(q: Tensor) -> tuple[Tensor, Tensor]:
    B, G, Tq = q.shape[:3]
    return q.new_empty(B, G, Tq, 0, dtype=torch.long), q.new_empty(B, G, Tq, 0, dtype=torch.bool)


@torch.library.custom_op("nsa_titan::shared", mutates_args=())
def _shared_op(q: Tensor, k: Tensor, v: Tensor, kind: str, spec: list[int], T: int, q0: int, start: OptTensor,
               end: OptTensor, cmp_start: OptTensor, first_slot: OptTensor, bounds: OptTensor, kernel: str
               ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    out, lse, idx, valid = shared_forward(q, k, v, kind, NSASpec(*spec), T, q0,
                                          _docs(start, end, cmp_start, first_slot), _bounds(bounds), kernel)
    if idx is None:  # win: no blocks chosen (an op returns tensors)
        idx, valid = _no_blocks(q)
    return _contiguous((out, lse, idx, valid))


@_shared_op.register_fake
def _(q, k, v, kind, spec, T, q0, start, end, cmp_start, first_slot, bounds, kernel):
    B, G, Tq = q.shape[:3]
    n = min(spec[3], NSASpec(*spec).num_sel_blocks(T)) if kind == "cmp" else 0
    return (torch.empty(q.shape, dtype=q.dtype, device=q.device),
            q.new_empty(q.shape[:4], dtype=torch.promote_types(q.dtype, torch.float32)),
            q.new_empty(B, G, Tq, n, dtype=torch.long), q.new_empty(B, G, Tq, n, dtype=torch.bool))


@torch.library.custom_op("nsa_titan::shared_backward", mutates_args=())
def _shared_backward_op(d_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, kind: str,
                        spec: list[int], q0: int, start: OptTensor, end: OptTensor, cmp_start: OptTensor,
                        first_slot: OptTensor, bounds: OptTensor, kernel: str) -> tuple[Tensor, Tensor, Tensor]:
    return _contiguous(shared_backward(d_out.contiguous(), q, k, v, out, lse, kind, NSASpec(*spec), q0,
                                       _docs(start, end, cmp_start, first_slot), _bounds(bounds), kernel))


@_shared_backward_op.register_fake
def _(d_out, q, k, v, out, lse, kind, spec, q0, start, end, cmp_start, first_slot, bounds, kernel):
    return _contiguous((torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)))


def _shared_setup(ctx, inputs, output) -> None:
    q, k, v, kind, spec, T, q0, *tensors, kernel = inputs
    ctx.save_for_backward(q, k, v, *output[:2], *tensors)
    ctx.kind, ctx.spec, ctx.q0, ctx.kernel = kind, spec, q0, kernel


def _shared_grad(ctx, d_out, _d_lse, _d_idx, _d_valid):
    q, k, v, out, lse, *tensors = ctx.saved_tensors
    return *_shared_backward_op(d_out, q, k, v, out, lse, ctx.kind, ctx.spec, ctx.q0, *tensors, ctx.kernel), *(None,) * 10


_shared_op.register_autograd(_shared_grad, setup_context=_shared_setup)


@torch.library.custom_op("nsa_titan::selected", mutates_args=())
def _selected_op(q: Tensor, ks: Tensor, vs: Tensor, idx: Tensor, valid: Tensor, spec: list[int], q0: int,
                 start: OptTensor, bounds: OptTensor) -> tuple[Tensor, Tensor]:
    return _contiguous(selected_forward(q, ks, vs, idx, valid, NSASpec(*spec), start, q0, _bounds(bounds)))


@_selected_op.register_fake
def _(q, ks, vs, idx, valid, spec, q0, start, bounds):
    return torch.empty(q.shape, dtype=q.dtype, device=q.device), q.new_empty(q.shape[:4])


@torch.library.custom_op("nsa_titan::selected_backward", mutates_args=())
def _selected_backward_op(d_out: Tensor, q: Tensor, ks: Tensor, vs: Tensor, idx: Tensor, valid: Tensor, out: Tensor,
                          lse: Tensor, spec: list[int], q0: int, start: OptTensor, bounds: OptTensor
                          ) -> tuple[Tensor, Tensor, Tensor]:
    return _contiguous(selected_backward(d_out.contiguous(), q, ks, vs, idx, valid, out, lse, NSASpec(*spec), start,
                                         q0, _bounds(bounds)))


@_selected_backward_op.register_fake
def _(d_out, q, ks, vs, idx, valid, out, lse, spec, q0, start, bounds):
    return _contiguous((torch.empty_like(q), torch.empty_like(ks), torch.empty_like(vs)))


def _selected_setup(ctx, inputs, output) -> None:
    q, ks, vs, idx, valid, spec, q0, start, bounds = inputs
    ctx.save_for_backward(q, ks, vs, idx, valid, *output, start, bounds)
    ctx.spec, ctx.q0 = spec, q0


def _selected_grad(ctx, d_out, _d_lse):
    q, ks, vs, idx, valid, out, lse, start, bounds = ctx.saved_tensors
    dq, dks, dvs = _selected_backward_op(d_out, q, ks, vs, idx, valid, out, lse, ctx.spec, ctx.q0, start, bounds)
    return dq, dks, dvs, None, None, None, None, None, None


_selected_op.register_autograd(_selected_grad, setup_context=_selected_setup)


@torch.library.custom_op("nsa_titan::selected_kernel", mutates_args=())
def _selected_kernel_op(q: Tensor, ks: Tensor, vs: Tensor, idx: Tensor, valid: Tensor, spec: list[int], q0: int,
                        start: OptTensor) -> tuple[Tensor, Tensor]:
    return _contiguous(cpu_attention.sel_forward(q, ks, vs, idx, valid, NSASpec(*spec), start, q0))


@_selected_kernel_op.register_fake
def _(q, ks, vs, idx, valid, spec, q0, start):
    return torch.empty(q.shape, dtype=q.dtype, device=q.device), q.new_empty(q.shape[:4], dtype=torch.float32)


@torch.library.custom_op("nsa_titan::selected_kernel_backward", mutates_args=())
def _selected_kernel_backward_op(d_out: Tensor, q: Tensor, ks: Tensor, vs: Tensor, idx: Tensor, valid: Tensor,
                                 out: Tensor, lse: Tensor, spec: list[int], q0: int, start: OptTensor
                                 ) -> tuple[Tensor, Tensor, Tensor]:
    return _contiguous(cpu_attention.sel_backward(d_out, q, ks, vs, idx, valid, out, lse, NSASpec(*spec), start, q0))


@_selected_kernel_backward_op.register_fake
def _(d_out, q, ks, vs, idx, valid, out, lse, spec, q0, start):
    return _contiguous((torch.empty_like(q), torch.empty_like(ks), torch.empty_like(vs)))


def _selected_kernel_setup(ctx, inputs, output) -> None:
    q, ks, vs, idx, valid, spec, q0, start = inputs
    ctx.save_for_backward(q, ks, vs, idx, valid, *output, start)
    ctx.spec, ctx.q0 = spec, q0


def _selected_kernel_grad(ctx, d_out, _d_lse):
    q, ks, vs, idx, valid, out, lse, start = ctx.saved_tensors
    dq, dks, dvs = _selected_kernel_backward_op(d_out, q, ks, vs, idx, valid, out, lse, ctx.spec, ctx.q0, start)
    return dq, dks, dvs, None, None, None, None, None


_selected_kernel_op.register_autograd(_selected_kernel_grad, setup_context=_selected_kernel_setup)


@torch.library.custom_op("nsa_titan::sel_weight_grad", mutates_args=())
def _sel_weight_grad_op(d_out: Tensor, q: Tensor, ks: Tensor, vs: Tensor, idx: Tensor, valid: Tensor, n_read: int,
                        spec: list[int], q0: int, start: OptTensor) -> Tensor:
    return cpu_attention.sel_weight_grad(d_out, q, ks, vs, idx, valid, n_read, NSASpec(*spec), start, q0).contiguous()


@_sel_weight_grad_op.register_fake
def _(d_out, q, ks, vs, idx, valid, n_read, spec, q0, start):
    return q.new_empty(idx.shape, dtype=torch.float32)


@torch.library.custom_op("nsa_titan::cmp_scores_backward", mutates_args=())
def _cmp_scores_backward_op(q: Tensor, kc: Tensor, idx: Tensor, d_log_s: Tensor, spec: list[int], q0: int
                            ) -> tuple[Tensor, Tensor]:
    return _contiguous(cpu_attention.cmp_scores_backward(q, kc, idx, d_log_s, NSASpec(*spec), q0))


@_cmp_scores_backward_op.register_fake
def _(q, kc, idx, d_log_s, spec, q0):
    return torch.empty(q.shape, dtype=q.dtype, device=q.device), torch.empty(kc.shape, dtype=kc.dtype, device=kc.device)


@torch.library.custom_op("nsa_titan::explore_blocks", mutates_args=())
def _explore_op(idx: Tensor, t: Tensor, Ns: int, spec: list[int], m: int, seed: Tensor) -> tuple[Tensor, Tensor]:
    return cpu_attention.explore_blocks(idx, t, Ns, NSASpec(*spec), m, seed)


@_explore_op.register_fake
def _(idx, t, Ns, spec, m, seed):
    shape = (*idx.shape[:3], min(m, Ns))
    return idx.new_empty(shape), idx.new_empty(shape, dtype=torch.bool)


@torch.library.custom_op("nsa_titan::mix", mutates_args=())
def _mix_op(gates: Tensor, outs: list[Tensor], which: list[int]) -> Tensor:
    return cpu_attention.mix(gates, outs, which)


@_mix_op.register_fake
def _(gates, outs, which):
    B, G, Tq, r, D = outs[0].shape
    return gates.new_empty(B, Tq, G * r, D)


@torch.library.custom_op("nsa_titan::mix_backward", mutates_args=())
def _mix_backward_op(d_out: Tensor, gates: Tensor, outs: list[Tensor], which: list[int]) -> list[Tensor]:
    return cpu_attention.mix_backward(d_out.contiguous(), gates, outs, which)


@_mix_backward_op.register_fake
def _(d_out, gates, outs, which):
    return [torch.empty_like(gates), *(torch.empty_like(o) for o in outs)]


def _mix_setup(ctx, inputs, output) -> None:
    gates, outs, which = inputs
    ctx.save_for_backward(gates, *outs)
    ctx.which = which


def _mix_grad(ctx, d_out):
    gates, *outs = ctx.saved_tensors
    d_gates, *d_outs = _mix_backward_op(d_out, gates, outs, ctx.which)
    return d_gates, d_outs, None


_mix_op.register_autograd(_mix_grad, setup_context=_mix_setup)


def _spec_list(spec: NSASpec) -> list[int]:
    return [spec.l, spec.d, spec.l_sel, spec.n, spec.w]


def _table(docs: Documents | None) -> OptTensor:
    return None if docs is None or docs.bounds is None else docs.bounds.table


def _query_starts(docs: Documents | None, q0: int, Tq: int) -> OptTensor:
    """The document start of each of the queries q0 .. q0 + Tq - 1 (B, Tq), or None."""
    return None if docs is None else docs.start[:, q0:q0 + Tq]


def shared(q: Tensor, k: Tensor, v: Tensor, kind: str, spec: NSASpec, T: int, q0: int, docs: Documents | None,
           kernel: str = "torch") -> tuple[Tensor, Tensor | None, Tensor | None]:
    """cmp or win attention (`fast_shared.shared_forward`), with the documents' host bounds when
    they have them; `kernel` (torch, cpp) runs the branch. idx and valid are None for win."""
    fields = (None,) * 4 if docs is None else (docs.start, docs.end, docs.cmp_start, docs.first_slot)
    out, _, idx, valid = _shared_op(q, k, v, kind, _spec_list(spec), T, q0, *fields, _table(docs), kernel)
    return (out, idx, valid) if kind == "cmp" else (out, None, None)


def selected(q: Tensor, ks: Tensor, vs: Tensor, idx: Tensor, valid: Tensor, spec: NSASpec, q0: int,
             docs: Documents | None) -> Tensor:
    """sel attention (`fast_sel.selected_forward`) of the queries at q0 .. q0 + Tq - 1, with the
    documents' host bounds when they have them."""
    start = _query_starts(docs, q0, q.shape[2])
    return _selected_op(q, ks, vs, idx, valid, _spec_list(spec), q0, start, _table(docs))[0]


def selected_kernel(q: Tensor, ks: Tensor, vs: Tensor, idx: Tensor, valid: Tensor, spec: NSASpec, q0: int,
                    docs: Documents | None) -> Tensor:
    """sel attention by NSA's C++ kernel (`cpu_attention`, CPUs), as one custom op."""
    start = _query_starts(docs, q0, q.shape[2])
    return _selected_kernel_op(q, ks, vs, idx, valid, _spec_list(spec), q0, start)[0]


def sel_weight_grad(d_out: Tensor, q: Tensor, ks: Tensor, vs: Tensor, idx: Tensor, valid: Tensor, n_read: int,
                    spec: NSASpec, q0: int, docs: Documents | None) -> Tensor:
    """The block scores' straight-through gradient by NSA's C++ kernel (`cpu_attention.sel_weight_grad`), as one
    op: d_out, q (B, G, Tq, r, D), ks, vs (B, G, T, D) fp32, the blocks idx, valid (B, G, Tq, n)."""
    return _sel_weight_grad_op(d_out, q, ks, vs, idx, valid, n_read, _spec_list(spec), q0, _query_starts(docs, q0, q.shape[2]))


def explore_blocks(idx: Tensor, t: Tensor, Ns: int, spec: NSASpec, m: int, seed: Tensor | int = 0) -> tuple[Tensor, Tensor]:
    """`routing.explore_blocks` by NSA's C++ kernel (`cpu_attention.explore_blocks`), as one op."""
    return _explore_op(idx, t, Ns, _spec_list(spec), m, torch.as_tensor(seed, device=idx.device))


def cmp_scores_backward(q: Tensor, kc: Tensor, idx: Tensor, d_log_s: Tensor, spec: NSASpec, q0: int) -> tuple[Tensor, Tensor]:
    """The block scores' gradient through the cmp probabilities by NSA's C++ kernel
    (`cpu_attention.cmp_scores_backward`, no documents), as one op: q (B, G, Tq, r, D), kc (B, G, S, D) fp32."""
    return _cmp_scores_backward_op(q, kc, idx, d_log_s, _spec_list(spec), q0)


def mix(gates: Tensor, outs: list[Tensor], which: list[int]) -> Tensor:
    """The gated sum of the branch outputs by NSA's C++ kernel (`cpu_attention.mix`), as one op: gates (B, Tq, G r, 3),
    the outputs (B, G, Tq, r, D) of the branches `which` (0 cmp, 1 sel, 2 win), fp32 -> (B, Tq, G r, D)."""
    return _mix_op(gates.contiguous(), [o.contiguous() for o in outs], which)
