"""torch.compile over the fast path: each branch is one custom op, so the graph does not grow with T.

The chunk loops run inside the ops (`models/attention/families/pytorch/ops.py`); dynamo sees one node per branch and
its fake implementation. Checked here: the captured graph has the same nodes at every T (with many
chunks), compiled outputs and gradients equal eager ones (with and without documents, whose host
bounds a compiled graph takes as an input tensor: it reads as few keys as eager), and
`torch.library.opcheck` passes for every op (schema, fake implementation, autograd registration).
"""

from __future__ import annotations

import pytest
import torch

from nsa_titan.config import Model
from nsa_titan.models.attention import Documents, NSASpec
from nsa_titan.models.attention.families.pytorch import ops
from nsa_titan.models.rope import rope_tables
from nsa_titan.models.transformer import NSAAttention

from test_nsa_reference import random_inputs

SPEC = NSASpec(l=8, d=4, l_sel=16, n=5, w=24)
CFG = Model(dim=48, n_heads=4, n_kv_groups=2, head_dim=16, cmp_block_size=SPEC.l, cmp_stride=SPEC.d,
            sel_block_size=SPEC.l_sel, sel_top_n=SPEC.n, window_size=SPEC.w, attn_impl="fast")


def layer() -> NSAAttention:
    module = NSAAttention(CFG).double()
    module.init_weights(0.3, 0.3, torch.Generator().manual_seed(0))
    return module


def compiled_and_eager(module: NSAAttention, T: int, docs: Documents | None) -> tuple[list[int], list, list]:
    """Graph node counts dynamo captured, and (output, input gradient) compiled and eager."""
    nodes: list[int] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        # every graph's nodes, the subgraphs' included (dynamo traces an autograd.Function into
        # subgraphs: with unrolled chunk loops, 4,336 nodes at T = 96 and 11,533 at T = 400)
        nodes.append(sum(len(m.graph.nodes) for m in gm.modules() if isinstance(m, torch.fx.GraphModule)))
        return gm.forward

    torch._dynamo.reset()
    x = torch.randn(2, T, 48, dtype=torch.float64, generator=torch.Generator().manual_seed(T), requires_grad=True)
    rope = rope_tables(Model(head_dim=16), T).double()
    rope = rope if docs is None else rope[docs.positions]
    results = []
    for fn in (torch.compile(module, backend=backend, fullgraph=True), module):
        out = fn(x, rope, docs=docs)
        results.append((out.detach(), torch.autograd.grad(out.square().sum(), x)[0]))
    return nodes, *results


@pytest.mark.parametrize("with_docs", [False, True])
@pytest.mark.slow
def test_compiled_graph_does_not_grow_with_T_and_equals_eager(small_chunks, monkeypatch, with_docs):
    from nsa_titan.models.attention.families.pytorch import fast_shared

    keys_read, probs = [], fast_shared._probs
    monkeypatch.setattr(fast_shared, "_probs", lambda q, k, mask: keys_read.append(k.shape[2]) or probs(q, k, mask))
    module, counts = layer(), {}
    for T in (96, 400):  # 4 and 17 cmp chunks, 6 and 25 win chunks, 3 and 13 sel chunks
        ids = torch.stack([torch.arange(T) // 37, torch.arange(T) // 90])
        docs = Documents.of(ids, SPEC) if with_docs else None
        keys_read.clear()
        nodes, (out_c, grad_c), (out_e, grad_e) = compiled_and_eager(module, T, docs)
        half = len(keys_read) // 2
        assert keys_read[:half] == keys_read[half:], "compiled and eager chunks read the same keys"
        counts[T] = nodes
        for got, want in ((out_c, out_e), (grad_c, grad_e)):
            assert float((got - want).norm() / want.norm()) < 1e-12
    assert len(counts[96]) == 1, "one graph: fullgraph, no break"
    assert counts[96] == counts[400], counts


@pytest.mark.parametrize("with_docs", [False, True])
@pytest.mark.slow
def test_the_ops_pass_opcheck(with_docs):
    """Schema, fake implementation (the shapes dynamo plans with), and the registered backward
    against the ops' own outputs, for cmp, win and sel; a part of the queries (q0 > 0) included."""
    T = 70
    args = list(random_inputs(2, T, 4, 2, 16, SPEC, dtype=torch.float64, seed=1))
    q = args[0].view(2, T, 2, 2, 16).transpose(1, 2).contiguous()  # (B, G, T, r, D)
    k, v = (x.transpose(1, 2).contiguous() for x in args[3:5])  # (B, G, T, D)
    fields: tuple = (None,) * 5
    kc, vc = (x.transpose(1, 2).contiguous() for x in args[1:3])
    if with_docs:
        docs = Documents.of(torch.stack([torch.arange(T) // 30, torch.arange(T) // 50]), SPEC)
        fields = (docs.start, docs.end, docs.cmp_start, docs.first_slot, docs.bounds.table)
        kc, vc = (torch.randn(2, 2, T // SPEC.d, 16, dtype=torch.float64) for _ in range(2))
    spec = [SPEC.l, SPEC.d, SPEC.l_sel, SPEC.n, SPEC.w]
    for x in (q, k, v, kc, vc):
        x.requires_grad_(True)
    for q0 in (0, 32):
        part = q[:, :, q0:].detach().requires_grad_(True)
        torch.library.opcheck(ops._shared_op, (part, kc, vc, "cmp", spec, T, q0, *fields, "torch"))
        torch.library.opcheck(ops._shared_op, (part, k, v, "win", spec, T, q0, *fields, "torch"))
        _, _, idx, valid = ops._shared_op(part, kc, vc, "cmp", spec, T, q0, *fields, "torch")
        start = None if fields[0] is None else fields[0][:, q0:]
        torch.library.opcheck(ops._selected_op, (part, k, v, idx, valid, spec, q0, start, fields[4]))


@pytest.mark.slow
def test_the_shared_op_passes_opcheck_with_bf16_chunks():
    """cmp and win as CUDA runs them, on bf16 chunks: the fake implementation's logsumexp is fp32
    (the real one's) there too."""
    T = 70
    args = random_inputs(2, T, 4, 2, 16, SPEC, dtype=torch.bfloat16, seed=2)
    q = args[0].view(2, T, 2, 2, 16).transpose(1, 2).contiguous().requires_grad_(True)  # (B, G, T, r, D)
    kc, vc, k, v = (x.transpose(1, 2).contiguous().requires_grad_(True) for x in args[1:5])
    spec = [SPEC.l, SPEC.d, SPEC.l_sel, SPEC.n, SPEC.w]
    for keys in ((kc, vc, "cmp"), (k, v, "win")):
        torch.library.opcheck(ops._shared_op, (q, *keys, spec, T, 0, *(None,) * 5, "torch"))


@pytest.mark.slow
def test_inductor_compiled_block_equals_eager():
    """The ops through inductor, as `apply_compile` runs them (its generated code checks each op's
    output sizes and strides against the fake implementation), at a T that is not a multiple of
    l' (so a key gradient is cut from a padded block layout), with documents."""
    module, T = layer(), 70
    docs = Documents.of(torch.stack([torch.arange(T) // 30, torch.arange(T) // 50]), SPEC)
    x = torch.randn(2, T, 48, dtype=torch.float64, generator=torch.Generator().manual_seed(0), requires_grad=True)
    rope = rope_tables(Model(head_dim=16), T).double()[docs.positions]
    torch._dynamo.reset()
    results = []
    for fn in (torch.compile(module, fullgraph=True), module):
        out = fn(x, rope, docs=docs)
        results.append((out.detach(), *torch.autograd.grad(out.square().sum(), [x, *module.parameters()])))
    for got, want in zip(*results):
        assert float((got - want).norm() / want.norm()) < 1e-10


@pytest.mark.slow
def test_a_float32_block_choosing_its_kernels_per_call_compiles_fullgraph():
    """`kernels = None` chooses them inside the graph: on CPUs in fp32 that asks whether the C++ kernels
    built, which dynamo takes as a constant (it could not trace the build) instead of breaking the graph."""
    module = layer().float()
    x = torch.randn(1, 96, 48, generator=torch.Generator().manual_seed(0), requires_grad=True)
    rope = rope_tables(Model(head_dim=16), 96)
    torch._dynamo.reset()
    compiled = torch.compile(module, backend="eager", fullgraph=True)
    got, want = compiled(x, rope), module(x, rope)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
