"""The fast path's branches as custom ops, so that torch.compile sees each as one node.

Traced by dynamo, the chunk loops of `fast_shared.py` and `fast_sel.py` would be unrolled into the
graph: one copy of a chunk's work per chunk, so that compile time (and the graph) grow with T.
Registered as `torch.library.custom_op`s with their backward ops (`register_autograd`), each
branch is one opaque node whose fake implementation gives only the output shapes: the graph, and
the time to compile it, are the same at every T, and `fullgraph` blocks still compile. The ops
run the same functions as the eager autograd Functions, with the static chunk ranges (the host
bounds of documents are eager-only: a compiled graph serves every layout).
"""

from __future__ import annotations

import torch

from .common import NSASpec
from .documents import ChunkBounds, Documents
from .fast_sel import Selected, selected_backward, selected_forward
from .fast_shared import Shared, shared_backward, shared_forward

Tensor = torch.Tensor
OptTensor = Tensor | None


def _contiguous(xs: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    """An op's outputs in the strides its fake implementation promises (dense, row-major)."""
    return tuple(x.contiguous() for x in xs)


def _docs(start: OptTensor, end: OptTensor, cmp_start: OptTensor, first_slot: OptTensor) -> Documents | None:
    return None if start is None else Documents(start, end, cmp_start, first_slot)


@torch.library.custom_op("nsa_titan::shared", mutates_args=())
def _shared_op(q: Tensor, k: Tensor, v: Tensor, kind: str, spec: list[int], T: int, q0: int, start: OptTensor,
               end: OptTensor, cmp_start: OptTensor, first_slot: OptTensor) -> tuple[Tensor, Tensor, Tensor]:
    out, idx, valid = shared_forward(q, k, v, kind, NSASpec(*spec), T, q0, _docs(start, end, cmp_start, first_slot),
                                     None)
    if idx is None:  # win: no blocks chosen (an op returns tensors)
        idx, valid = _no_blocks(q)
    return _contiguous((out, idx, valid))


def _no_blocks(q: Tensor) -> tuple[Tensor, Tensor]:
    B, G, Tq = q.shape[:3]
    return q.new_empty(B, G, Tq, 0, dtype=torch.long), q.new_empty(B, G, Tq, 0, dtype=torch.bool)


@_shared_op.register_fake
def _(q, k, v, kind, spec, T, q0, start, end, cmp_start, first_slot):
    B, G, Tq = q.shape[:3]
    n = min(spec[3], NSASpec(*spec).num_sel_blocks(T)) if kind == "cmp" else 0
    return (torch.empty(q.shape, dtype=q.dtype, device=q.device), q.new_empty(B, G, Tq, n, dtype=torch.long),
            q.new_empty(B, G, Tq, n, dtype=torch.bool))


@torch.library.custom_op("nsa_titan::shared_backward", mutates_args=())
def _shared_backward_op(d_out: Tensor, q: Tensor, k: Tensor, v: Tensor, kind: str, spec: list[int], q0: int,
                        start: OptTensor, end: OptTensor, cmp_start: OptTensor, first_slot: OptTensor
                        ) -> tuple[Tensor, Tensor, Tensor]:
    grads = shared_backward(d_out.contiguous(), q, k, v, kind, NSASpec(*spec), q0,
                            _docs(start, end, cmp_start, first_slot), None)
    return _contiguous(grads)


@_shared_backward_op.register_fake
def _(d_out, q, k, v, kind, spec, q0, start, end, cmp_start, first_slot):
    return _contiguous((torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)))


def _shared_setup(ctx, inputs, output) -> None:
    q, k, v, kind, spec, T, q0, *doc_fields = inputs
    ctx.save_for_backward(q, k, v, *doc_fields)
    ctx.kind, ctx.spec, ctx.q0 = kind, spec, q0


def _shared_grad(ctx, d_out, _d_idx, _d_valid):
    q, k, v, *doc_fields = ctx.saved_tensors
    dq, dk, dv = _shared_backward_op(d_out, q, k, v, ctx.kind, ctx.spec, ctx.q0, *doc_fields)
    return dq, dk, dv, None, None, None, None, None, None, None, None


_shared_op.register_autograd(_shared_grad, setup_context=_shared_setup)


@torch.library.custom_op("nsa_titan::selected", mutates_args=())
def _selected_op(q: Tensor, ks: Tensor, vs: Tensor, idx: Tensor, valid: Tensor, spec: list[int], q0: int,
                 start: OptTensor) -> tuple[Tensor, Tensor]:
    return _contiguous(selected_forward(q, ks, vs, idx, valid, NSASpec(*spec), start, q0, None))


@_selected_op.register_fake
def _(q, ks, vs, idx, valid, spec, q0, start):
    return torch.empty(q.shape, dtype=q.dtype, device=q.device), q.new_empty(q.shape[:4])


@torch.library.custom_op("nsa_titan::selected_backward", mutates_args=())
def _selected_backward_op(d_out: Tensor, q: Tensor, ks: Tensor, vs: Tensor, idx: Tensor, valid: Tensor, out: Tensor,
                          lse: Tensor, spec: list[int], q0: int, start: OptTensor) -> tuple[Tensor, Tensor, Tensor]:
    return _contiguous(selected_backward(d_out.contiguous(), q, ks, vs, idx, valid, out, lse, NSASpec(*spec), start,
                                         q0, None))


@_selected_backward_op.register_fake
def _(d_out, q, ks, vs, idx, valid, out, lse, spec, q0, start):
    return _contiguous((torch.empty_like(q), torch.empty_like(ks), torch.empty_like(vs)))


def _selected_setup(ctx, inputs, output) -> None:
    q, ks, vs, idx, valid, spec, q0, start = inputs
    ctx.save_for_backward(q, ks, vs, idx, valid, *output, start)
    ctx.spec, ctx.q0 = spec, q0


def _selected_grad(ctx, d_out, _d_lse):
    q, ks, vs, idx, valid, out, lse, start = ctx.saved_tensors
    dq, dks, dvs = _selected_backward_op(d_out, q, ks, vs, idx, valid, out, lse, ctx.spec, ctx.q0, start)
    return dq, dks, dvs, None, None, None, None, None


_selected_op.register_autograd(_selected_grad, setup_context=_selected_setup)


def _spec_list(spec: NSASpec) -> list[int]:
    return [spec.l, spec.d, spec.l_sel, spec.n, spec.w]


def shared(q: Tensor, k: Tensor, v: Tensor, kind: str, spec: NSASpec, T: int, q0: int, docs: Documents | None
           ) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """cmp or win attention (see `fast_shared.shared_forward`): the custom op under torch.compile,
    else the autograd Function with the documents' host bounds."""
    fields = () if docs is None else (docs.start, docs.end, docs.cmp_start, docs.first_slot)
    if torch.compiler.is_compiling():
        out, idx, valid = _shared_op(q, k, v, kind, _spec_list(spec), T, q0, *(fields or (None,) * 4))
        return (out, idx, valid) if kind == "cmp" else (out, None, None)
    return Shared.apply(q, k, v, kind, spec, T, q0, None if docs is None else docs.bounds, *fields)


def selected(q: Tensor, ks: Tensor, vs: Tensor, idx: Tensor, valid: Tensor, spec: NSASpec, start: OptTensor, q0: int,
             bounds: ChunkBounds | None) -> Tensor:
    """sel attention (see `fast_sel.selected_forward`): the custom op under torch.compile, else the
    autograd Function with the documents' host `bounds`."""
    if torch.compiler.is_compiling():
        return _selected_op(q, ks, vs, idx, valid, _spec_list(spec), q0, start)[0]
    return Selected.apply(q, ks, vs, idx, valid, spec, start, q0, bounds)
