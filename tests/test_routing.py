"""The block scores' straight-through gradient (`models/attention/routing.py`, `[model] sel_score_grad`):
it is the gradient of a bias log s_j on the sel logits of each chosen block's keys (checked against
autograd through such a bias, with and without documents, whole and in context-parallel parts), the
layer's output is unchanged and its gradient is the same eager, under AC and compiled, and training
on it moves the choice to the block whose values the loss wants."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from nsa_titan.config import Model
from nsa_titan.models.attention import Documents, NSASpec, cmp_visibility, masked_attention, select_blocks
from nsa_titan.models.attention.routing import score_grad, with_score_grad
from nsa_titan.models.transformer import NSAAttention, rope_tables

from test_nsa_reference import random_inputs

SPEC = NSASpec(l=8, d=4, l_sel=8, n=5, w=16)  # 1 initial + 2 local + 2 chosen by score


def biased_sel_gradient(q, kc, ks, vs, g_sel, d_o, spec: NSASpec, docs: Documents | None) -> torch.Tensor:
    """Autograd's dL/dbias (B, G, T, n) through sel attention written with dense masks, the logits of
    chosen block j's keys plus bias[j] (0), for L = sum(d_o * g_sel * o_sel)."""
    B, T, H, D = q.shape
    G = ks.shape[2]
    mask = cmp_visibility(spec, T, q.device) if docs is None else docs.cmp_visible(spec, 0, T, kc.shape[1])[:, None, None]
    _, p_cmp = masked_attention(q, kc, kc, mask)
    idx, valid = select_blocks(p_cmp, spec, G, docs=docs)  # (B, G, T, n)
    bias = torch.zeros(idx.shape, dtype=q.dtype, requires_grad=True)
    t = torch.arange(T)
    start = torch.zeros(B, T, dtype=torch.long) if docs is None else docs.start
    key_block = (t[None, None, :] - start[:, :, None]) // spec.l_sel  # (B, T, S): key s's block, from t's document
    same = (t[None, None, :] >= start[:, :, None]) & (t[None, None, :] <= t[None, :, None])
    hit = (key_block[:, None, :, :, None] == idx[..., None, :]) & valid[..., None, :]  # (B, G, T, S, n)
    key_bias = (hit * bias[..., None, :]).sum(-1)  # (B, G, T, S)
    qg = q.view(B, T, G, H // G, D).transpose(1, 2)  # (B, G, T, r, D)
    logits = torch.einsum("bgtrd,bsgd->bgtrs", qg, ks) * D**-0.5 + key_bias[:, :, :, None]
    p = torch.softmax(logits.masked_fill(~(hit.any(-1) & same[:, None])[:, :, :, None], float("-inf")), -1)
    o_sel = torch.einsum("bgtrs,bsgd->bgtrd", p, vs).transpose(1, 2).reshape(B, T, H, D)
    (o_sel * g_sel[..., None] * d_o).sum().backward()
    return bias.grad


@pytest.mark.parametrize("with_docs", [False, True])
def test_the_scores_get_the_gradient_of_a_bias_on_their_blocks_logits(with_docs):
    T, B, H, G, D = 70, 2, 4, 2, 8
    q, kc, _, ks, vs, *_ = random_inputs(B, T, H, G, D, SPEC, seed=3)
    docs = Documents.of(torch.stack([torch.arange(T) // 45, torch.arange(T) // 30]), SPEC) if with_docs else None
    gen = torch.Generator().manual_seed(4)
    if docs is not None:  # the compressed keys of each document's own slots
        kc = torch.randn(B, docs.cmp_start.shape[1], G, D, dtype=torch.float64, generator=gen)
    g_sel, d_o = torch.rand(B, T, H, dtype=torch.float64, generator=gen), torch.randn(q.shape, dtype=torch.float64, generator=gen)
    want = biased_sel_gradient(q, kc, ks, vs, g_sel, d_o, SPEC, docs)
    mask = cmp_visibility(SPEC, T, q.device) if docs is None else docs.cmp_visible(SPEC, 0, T, kc.shape[1])[:, None, None]
    idx, valid = select_blocks(masked_attention(q, kc, kc, mask)[1], SPEC, G, docs=docs)
    got = score_grad(d_o, q.view(B, T, G, H // G, D).transpose(1, 2), ks, vs, g_sel, idx, valid, SPEC, docs, 0)
    assert float(want.abs().sum()) > 1.0
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def scores_gradient(q, kc, ks, vs, gates, d_o, spec: NSASpec, parts) -> torch.Tensor:
    """kc's gradient from the scores alone (the output's own gradient path cut), the queries in `parts`."""
    kc = kc.clone().requires_grad_()
    for a, b in parts:
        o = torch.zeros_like(q[:, a:b], requires_grad=True)  # the output's value does not matter
        with_score_grad(o, q[:, a:b], kc, ks, vs, gates[:, a:b], spec, 2.0, q0=a).backward(d_o[:, a:b])
    return kc.grad


def test_context_parallel_parts_give_the_whole_sequences_gradient():
    T = 96
    q, kc, _, ks, vs, _, _, gates = random_inputs(2, T, 4, 2, 8, SPEC, seed=5)
    d_o = torch.randn(q.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    whole = scores_gradient(q, kc, ks, vs, gates, d_o, SPEC, [(0, T)])
    parts = scores_gradient(q, kc, ks, vs, gates, d_o, SPEC, [(0, 24), (24, 72), (72, 96)])
    assert float(whole.abs().sum()) > 0
    torch.testing.assert_close(parts, whole, rtol=1e-12, atol=1e-14)


def test_training_the_scores_on_it_brings_the_block_whose_values_the_loss_wants():
    """The late queries' loss rewards the values of block 3 (its keys are no more attractive than any
    other's); the compressed keys start random, so block 3 is chosen for 7 of the 16 late queries.
    Trained on the scores' gradient alone, the choice moves to block 3 for all of them."""
    T, D = 64, 8
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, T, 2, D, dtype=torch.float64, generator=gen)
    ks = torch.randn(1, T, 1, D, dtype=torch.float64, generator=gen)
    vs = torch.randn(1, T, 1, D, dtype=torch.float64, generator=gen) * 0.1
    vs[:, 24:32, :, 0] = 1.0  # block 3's values: what the loss wants
    kc = torch.randn(1, SPEC.num_cmp_blocks(T), 1, D, dtype=torch.float64, generator=gen).requires_grad_()
    late = slice(48, 64)  # blocks 6-7: block 3 is a candidate and not forced
    gates = torch.zeros(1, T, 2, 3, dtype=torch.float64)
    gates[..., 1] = 1.0

    def chosen():
        _, p = masked_attention(q, kc, kc, cmp_visibility(SPEC, T, q.device))
        return select_blocks(p, SPEC, 1)[0]

    before = float((chosen()[..., late, :] == 3).any(-1).double().mean())
    optimizer = torch.optim.Adam([kc], lr=0.05)
    for _ in range(200):
        optimizer.zero_grad()
        o = torch.zeros(1, T, 2, D, dtype=torch.float64, requires_grad=True)
        d_o = torch.zeros_like(o)
        d_o[:, late, :, 0] = -1.0  # L = -sum of the late outputs' first channel
        with_score_grad(o, q, kc, ks, vs, gates, SPEC, 1.0).backward(d_o)
        optimizer.step()
    after = float((chosen()[..., late, :] == 3).any(-1).double().mean())
    assert before == 7 / 16 and after == 1.0


CFG = Model(dim=48, n_heads=4, n_kv_groups=2, head_dim=16, cmp_block_size=SPEC.l, cmp_stride=SPEC.d,
            sel_block_size=SPEC.l_sel, sel_top_n=SPEC.n, window_size=SPEC.w, attn_impl="fast")


@pytest.mark.parametrize("wrap", ["eager", "ac", "compile", "inductor"])
def test_the_layer_adds_the_scores_gradient_and_keeps_its_output(wrap):
    """With sel_score_grad w, a layer's output is unchanged and its parameters' gradients are the plain
    ones plus w x the scores' gradient carried back through the cmp probabilities, eager, under the
    AC wrapper and compiled fullgraph (dynamo's graph, and through inductor as `apply_compile` runs
    it); in eval mode nothing is added."""
    layer = NSAAttention(CFG).double()
    layer.init_weights(0.3, 0.3, torch.Generator().manual_seed(0))
    T, w = 72, 0.7
    x = torch.randn(2, T, 48, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    rope = rope_tables(16, T, 10000.0).double()
    params = list(layer.parameters())
    plain = layer(x, rope)
    plain_grads = torch.autograd.grad(plain.square().sum(), params)

    # What the scores add: with_score_grad's gradient, given the layer's own q, kc, sel keys, values, gates
    # and the gradient reaching its attention output.
    q, kv = layer.project(x, rope)
    kc, vc = layer.compress(kv["k_cmp"], kv["v_cmp"])
    gates = layer.gates(x)
    o = layer.attn_fn(q, kc, vc, kv["k_sel"], kv["v_sel"], kv["k_win"], kv["v_win"], gates, layer.spec)
    d_o = torch.autograd.grad(layer.wo(o.reshape(2, T, -1)).square().sum(), o)[0]
    added = torch.autograd.grad(with_score_grad(torch.zeros_like(o, requires_grad=True), q, kc, kv["k_sel"], kv["v_sel"],
                                                gates, layer.spec, w), params, d_o, allow_unused=True)
    layer.score_grad = w
    torch._dynamo.reset()
    fn = {"eager": layer, "ac": checkpoint_wrapper(layer),
          "compile": torch.compile(layer, backend="eager", fullgraph=True),
          "inductor": torch.compile(layer, fullgraph=True)}[wrap]
    out = fn(x, rope)
    got = torch.autograd.grad(out.square().sum(), params)
    exact = {"rtol": 1e-10, "atol": 1e-12} if wrap == "inductor" else {"rtol": 0, "atol": 0}  # inductor reorders sums
    torch.testing.assert_close(out, plain, **exact)
    for name, g, v, a in zip([n for n, _ in layer.named_parameters()], got, plain_grads, added):
        if name.split(".")[0] in ("wq", "wkv_cmp", "compress_k"):  # what the cmp probabilities depend on
            assert float(a.abs().sum()) > 0, name
            torch.testing.assert_close(g, v + a, rtol=1e-10, atol=1e-12)
        else:
            assert a is None or not a.any(), name
            torch.testing.assert_close(g, v, **exact)
    layer.eval()
    for g, v in zip(torch.autograd.grad(layer(x, rope).square().sum(), params), plain_grads):
        torch.testing.assert_close(g, v, rtol=0, atol=0)
