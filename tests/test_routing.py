"""The block scores' straight-through gradient (`models/attention/routing.py`, `[model] sel_score_grad`):
it is the gradient of a bias log s_j on the sel logits of each chosen block's keys (checked against
autograd through such a bias, with and without documents, whole and in context-parallel parts), the
layer's output is unchanged and its gradient is the same eager, under AC and compiled, and training
on it moves the choice to the block whose values the loss wants."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from nsa_titan.config import Model
from nsa_titan.models.attention import Documents, NSASpec, cmp_visibility, masked_attention, select_blocks
from nsa_titan.models.attention.common import block_scores, forced_blocks, masked_softmax
from nsa_titan.models.attention import routing
from nsa_titan.models.attention.families.cpp import cpu_attention
from nsa_titan.models.attention.routing import explore_blocks, score_grad, set_explore_step, with_score_grad
from nsa_titan.models.attention.families import base as family_base
from nsa_titan.models.rope import rope_tables
from nsa_titan.models.transformer import NSAAttention

from test_nsa_reference import random_inputs

SPEC = NSASpec(l=8, d=4, l_sel=8, n=5, w=16)  # 1 initial + 2 local + 2 chosen by score


def chosen_blocks(q, kc, spec: NSASpec, G: int, docs: Documents | None) -> tuple[torch.Tensor, torch.Tensor]:
    """idx, valid (B, G, T, n): the sel blocks the cmp probabilities choose."""
    T = q.shape[1]
    mask = cmp_visibility(spec, T, q.device) if docs is None else docs.cmp_visible(spec, 0, T, kc.shape[1])[:, None, None]
    return select_blocks(masked_attention(q, kc, kc, mask)[1], spec, G, docs=docs)


def weight_gradient(q, ks, vs, g_sel, d_o, idx, valid, read: torch.Tensor, spec: NSASpec, docs: Documents | None
                    ) -> torch.Tensor:
    """Autograd's dL/de (B, G, T, n) through sel attention written with dense masks, the keys of block
    idx[j] weighted by e_j in the softmax (exp(z) e_j), at e = `read` (n,) (1: read, 0: not); at e_j = 1
    it is the gradient of a bias log s_j on the block's logits. L = sum(d_o g_sel o_sel)."""
    B, T, H, D = q.shape
    G = ks.shape[2]
    e = read.to(q.dtype).expand(idx.shape).clone().requires_grad_()
    t = torch.arange(T)
    start = torch.zeros(B, T, dtype=torch.long) if docs is None else docs.start
    key_block = (t[None, None, :] - start[:, :, None]) // spec.l_sel  # (B, T, S): key s's block, from t's document
    same = (t[None, None, :] >= start[:, :, None]) & (t[None, None, :] <= t[None, :, None])
    hit = (key_block[:, None, :, :, None] == idx[..., None, :]) & valid[..., None, :] & same[:, None, :, :, None]
    key_weight = (hit * e[..., None, :]).sum(-1)  # (B, G, T, S)
    qg = q.view(B, T, G, H // G, D).transpose(1, 2)  # (B, G, T, r, D)
    z = torch.einsum("bgtrd,bsgd->bgtrs", qg, ks) * D**-0.5
    w = torch.exp(z - z.amax(-1, keepdim=True).detach()) * key_weight[:, :, :, None]
    p = w / w.sum(-1, keepdim=True)
    o_sel = torch.einsum("bgtrs,bsgd->bgtrd", p, vs).transpose(1, 2).reshape(B, T, H, D)
    (o_sel * g_sel[..., None] * d_o).sum().backward()
    return e.grad


def routing_inputs(with_docs: bool, T: int = 70, B: int = 2, H: int = 4, G: int = 2, D: int = 8):
    """q, kc, sel keys and values, sel gates, an output gradient and documents (or None)."""
    q, kc, _, ks, vs, *_ = random_inputs(B, T, H, G, D, SPEC, seed=3)
    docs = Documents.of(torch.stack([torch.arange(T) // 45, torch.arange(T) // 30]), SPEC) if with_docs else None
    gen = torch.Generator().manual_seed(4)
    if docs is not None:  # the compressed keys of each document's own slots
        kc = torch.randn(B, docs.cmp_start.shape[1], G, D, dtype=torch.float64, generator=gen)
    g_sel, d_o = torch.rand(B, T, H, dtype=torch.float64, generator=gen), torch.randn(q.shape, dtype=torch.float64, generator=gen)
    return q, kc, ks, vs, g_sel, d_o, docs


@pytest.mark.parametrize("chunk_logits", [routing.CHUNK_LOGITS, 1200])
@pytest.mark.parametrize("with_docs", [False, True])
def test_the_scores_get_the_gradient_of_a_bias_on_their_blocks_logits(with_docs, chunk_logits, monkeypatch):
    """Whole, and a few queries at a time (1,200 logits: 2 queries of 2 rows x 2 groups x 2 heads x 70 keys)."""
    monkeypatch.setattr(routing, "CHUNK_LOGITS", chunk_logits)
    q, kc, ks, vs, g_sel, d_o, docs = routing_inputs(with_docs)
    B, T, H, D = q.shape
    G = ks.shape[2]
    idx, valid = chosen_blocks(q, kc, SPEC, G, docs)
    want = weight_gradient(q, ks, vs, g_sel, d_o, idx, valid, torch.ones(idx.shape[-1]), SPEC, docs)
    got = score_grad(d_o, q.view(B, T, G, H // G, D).transpose(1, 2), ks, vs, g_sel, idx, valid, SPEC, docs, 0)
    assert float(want.abs().sum()) > 1.0
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("with_docs", [False, True])
def test_explored_blocks_get_the_gradient_of_their_weight_in_the_softmax_at_0(with_docs):
    """`sel_score_explore`: the explored blocks are unchosen, unforced candidates, distinct, spread over
    all of them, another draw for another step; their gradient is autograd's dL/de_j at e_j = 0 (through
    the dense sel softmax), the chosen blocks' unchanged."""
    T, m = 120, 3
    q, kc, ks, vs, g_sel, d_o, docs = routing_inputs(with_docs, T=T)
    B, _, H, D = q.shape
    G = ks.shape[2]
    idx, valid = chosen_blocks(q, kc, SPEC, G, docs)
    t = torch.arange(T)[None] if docs is None else torch.arange(T)[None] - docs.start
    extra, ok = explore_blocks(idx, t, SPEC.num_sel_blocks(T), SPEC, m)
    jt = (t // SPEC.l_sel)[:, None, :, None]
    assert ok.any() and not (ok & ((extra > jt) | forced_blocks(extra, t[:, None], SPEC))).any()
    assert not (ok[..., None] & (extra[..., None] == idx[..., None, :])).any()  # not chosen
    assert not (ok[..., :, None] & ok[..., None, :] & (extra[..., :, None] == extra[..., None, :])
                & ~torch.eye(m, dtype=torch.bool)).any()  # distinct
    free = (jt - 2).clamp(min=0)  # candidates neither forced nor chosen: blocks 1 .. jt - 2, less n - 3
    assert torch.equal(ok.sum(-1), (free - (SPEC.n - 3)).clamp(0, m)[..., 0].expand_as(ok[..., 0]))
    assert len(extra[ok].unique()) == int((jt - 2).max())  # every block 1 .. max(jt) - 2 is drawn somewhere
    other, same_ok = explore_blocks(idx, t, SPEC.num_sel_blocks(T), SPEC, m, seed=1)  # another step's draw
    assert torch.equal(same_ok, ok) and (with_docs or (other != extra)[ok].double().mean() > 0.5)  # docs: 1 candidate
    n = idx.shape[-1]
    all_idx, all_valid = torch.cat([idx, extra], -1), torch.cat([valid, ok], -1)
    got = score_grad(d_o, q.view(B, T, G, H // G, D).transpose(1, 2), ks, vs, g_sel, all_idx, all_valid, SPEC, docs, 0,
                     n_read=n)
    want = weight_gradient(q, ks, vs, g_sel, d_o, all_idx, all_valid, (torch.arange(n + m) < n).double(), SPEC, docs)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    assert float(got[..., n:].abs().sum()) > 1.0


@pytest.mark.parametrize("chunk_logits", [routing.CHUNK_LOGITS, 1200])
@pytest.mark.parametrize("with_docs", [False, True])
def test_the_scores_gradient_reaches_q_and_kc_as_autograds_through_the_cmp_softmax(with_docs, chunk_logits,
                                                                                   monkeypatch):
    """`with_score_grad`'s gradient of q and kc, computed by hand a chunk of queries at a time, is autograd's
    through log s_j (s_j: `block_scores` of the group-summed `masked_softmax` cmp probabilities) of the chosen
    and explored blocks, given dL/dlog s_j (`score_grad` x weight, 0 for the forced blocks)."""
    monkeypatch.setattr(routing, "CHUNK_LOGITS", chunk_logits)
    T, w, m = 120, 0.7, 2
    q, kc, ks, vs, g_sel, d_o, docs = routing_inputs(with_docs, T=T)
    B, _, H, D = q.shape
    G = kc.shape[2]
    gates = torch.stack([torch.zeros_like(g_sel), g_sel, torch.zeros_like(g_sel)], -1)
    q, kc = q.clone().requires_grad_(), kc.clone().requires_grad_()
    o = torch.zeros_like(q, requires_grad=True)  # its value does not matter
    got = torch.autograd.grad(with_score_grad(o, q, kc, ks, vs, gates, SPEC, w, docs, explore=m, seed=5), (q, kc), d_o)

    idx, valid = chosen_blocks(q.detach(), kc.detach(), SPEC, G, docs)
    t = torch.arange(T)[None] if docs is None else torch.arange(T)[None] - docs.start
    extra, ok = explore_blocks(idx, t, SPEC.num_sel_blocks(T), SPEC, m, seed=5)
    free = torch.cat([valid & ~forced_blocks(idx, t[:, None], SPEC), ok], -1)
    all_idx, all_valid = torch.cat([idx, extra], -1), torch.cat([valid, ok], -1)
    qg = q.view(B, T, G, H // G, D).transpose(1, 2)
    d_log_s = score_grad(d_o, qg.detach(), ks, vs, g_sel, all_idx, all_valid, SPEC, docs, 0, n_read=idx.shape[-1]) * free * w
    visible = (cmp_visibility(SPEC, T, q.device)[:, None, :] if docs is None
               else docs.cmp_visible(SPEC, 0, T, kc.shape[1])[:, None, :, None])
    p_group = masked_softmax(torch.einsum("bgtrd,bsgd->bgtrs", qg, kc) * D**-0.5, visible).sum(3)
    log_s = block_scores(p_group, SPEC, 0, T, docs)[0].gather(-1, all_idx).clamp_min(1e-30).log()
    want = torch.autograd.grad(log_s, (q, kc), d_log_s)
    assert float(d_log_s[..., idx.shape[-1]:].abs().sum()) > 0.1  # the explored blocks count
    for a, b in zip(got, want):
        assert float(b.abs().sum()) > 1.0
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("wrap", ["eager", "aot_eager"])
@pytest.mark.parametrize("with_docs", [False, True])
@pytest.mark.slow
def test_the_cpp_kernel_gives_the_pytorch_gradient(with_docs, wrap):
    """fp32 on CPUs takes dL/dlog s_j in NSA's C++ kernel (`kernel = None` chooses it): the same gradients as
    `score_grad`'s, eager and compiled (AOTAutograd traces the backward through the op's fake)."""
    if why := cpu_attention.problem(torch.device("cpu"), torch.float32, SPEC, 2, 16):
        pytest.skip(why)
    q, kc, ks, vs, g_sel, d_o, docs = (x if x is None or isinstance(x, Documents) else x.float()
                                       for x in routing_inputs(with_docs, T=120, D=16))
    gates = torch.stack([torch.zeros_like(g_sel), g_sel, torch.zeros_like(g_sel)], -1)

    def grads(kernel: str | None) -> tuple[torch.Tensor, ...]:
        leaves = (q.clone().requires_grad_(), kc.clone().requires_grad_())
        fn = lambda a, b: with_score_grad(a * 0.0, a, b, ks, vs, gates, SPEC, 0.7, docs, explore=2, seed=3,  # noqa: E731
                                          kernel=kernel)  # the output a x 0: its own gradient adds 0
        if wrap != "eager":
            torch._dynamo.reset()
            fn = torch.compile(fn, backend=wrap, fullgraph=True)
        return torch.autograd.grad(fn(*leaves), leaves, d_o)

    calls = []
    with pytest.MonkeyPatch.context() as patch:
        for name in ("sel_weight_grad", "cmp_scores_backward", "explore_blocks"):
            patch.setattr(cpu_attention, name, lambda *a, _f=getattr(cpu_attention, name), _n=name: calls.append(_n) or _f(*a))
        got = grads(None)
    # the kernel ran: dL/dlog s_j, the draw of explored blocks, and without documents the rest of the gradient
    assert set(calls) == {"sel_weight_grad", "explore_blocks"} | (set() if with_docs else {"cmp_scores_backward"})
    for a, b in zip(got, grads("torch")):
        assert float(b.abs().sum()) > 1.0
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def scores_gradient(q, kc, ks, vs, gates, d_o, spec: NSASpec, parts, explore: int = 0) -> torch.Tensor:
    """kc's gradient from the scores alone (the output's own gradient path cut), the queries in `parts`."""
    kc = kc.clone().requires_grad_()
    for a, b in parts:
        o = torch.zeros_like(q[:, a:b], requires_grad=True)  # the output's value does not matter
        with_score_grad(o, q[:, a:b], kc, ks, vs, gates[:, a:b], spec, 2.0, q0=a, explore=explore).backward(d_o[:, a:b])
    return kc.grad


@pytest.mark.parametrize("explore", [0, 2])
def test_context_parallel_parts_give_the_whole_sequences_gradient(explore):
    """Also with explored blocks: they are drawn by position, not by part."""
    T = 96
    q, kc, _, ks, vs, _, _, gates = random_inputs(2, T, 4, 2, 8, SPEC, seed=5)
    d_o = torch.randn(q.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    whole = scores_gradient(q, kc, ks, vs, gates, d_o, SPEC, [(0, T)], explore)
    parts = scores_gradient(q, kc, ks, vs, gates, d_o, SPEC, [(0, 24), (24, 72), (72, 96)], explore)
    assert float(whole.abs().sum()) > 0
    if explore:  # the explored blocks add to the chosen ones' gradient
        assert not torch.allclose(whole, scores_gradient(q, kc, ks, vs, gates, d_o, SPEC, [(0, T)]))
    torch.testing.assert_close(parts, whole, rtol=1e-12, atol=1e-14)


def train_the_scores(T: int, noise: float, explore: int, hide: bool = False, steps: int = 200
                     ) -> tuple[float, float, torch.Tensor]:
    """Queries T - 16 .. T - 1 (the late ones, in the last two blocks) are rewarded by the first channel
    of block 3's values (1; elsewhere `noise` x N(0, 1)); the compressed keys start random and are
    trained on the scores' gradient alone, exploring `explore` blocks, drawn anew each step (`hide`: block
    3's cmp members start facing away from the late queries' mean). Returns how
    often block 3 is chosen by the late queries before and after, and the compressed keys' change."""
    D = 8
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, T, 2, D, dtype=torch.float64, generator=gen)
    ks = torch.randn(1, T, 1, D, dtype=torch.float64, generator=gen)
    vs = torch.randn(1, T, 1, D, dtype=torch.float64, generator=gen) * noise
    vs[:, 24:32, :, 0] = 1.0  # block 3's values: what the loss wants
    kc0 = torch.randn(1, SPEC.num_cmp_blocks(T), 1, D, dtype=torch.float64, generator=gen)
    late = slice(T - 16, T)  # block 3 is a candidate and not forced
    if hide:
        kc0[:, 5:8] = -2 * q[:, late].mean((1, 2))[:, None, None]  # cmp blocks 5-7 hold block 3's keys 24-31
    kc = kc0.clone().requires_grad_()
    gates = torch.zeros(1, T, 2, 3, dtype=torch.float64)
    gates[..., 1] = 1.0

    def chosen():
        _, p = masked_attention(q, kc, kc, cmp_visibility(SPEC, T, q.device))
        return float((select_blocks(p, SPEC, 1)[0][..., late, :] == 3).any(-1).double().mean())

    before = chosen()
    optimizer = torch.optim.Adam([kc], lr=0.05)
    for step in range(steps):
        optimizer.zero_grad()
        o = torch.zeros(1, T, 2, D, dtype=torch.float64, requires_grad=True)
        d_o = torch.zeros_like(o)
        d_o[:, late, :, 0] = -1.0  # L = -sum of the late outputs' first channel
        with_score_grad(o, q, kc, ks, vs, gates, SPEC, 1.0, explore=explore, seed=step).backward(d_o)
        optimizer.step()
    return before, chosen(), (kc - kc0).detach()


def test_training_the_scores_on_it_brings_the_block_whose_values_the_loss_wants():
    """Block 3's keys are no more attractive than any other's: at the start it is chosen for 7 of the 16
    late queries. Trained on the scores' gradient alone, the choice moves to block 3 for all of them."""
    before, after, _ = train_the_scores(64, noise=0.1, explore=0)
    assert before == 7 / 16 and after == 1.0


def test_exploring_brings_a_block_that_is_never_chosen():
    """32 blocks; block 3 is chosen by none of the late queries, and no other block's values move the
    loss (0), so the chosen blocks get no gradient: without exploration nothing moves. Exploring one
    block per query a step (about 1 in 27 candidates), block 3 is found by most of them."""
    before, after, moved = train_the_scores(256, noise=0.0, explore=0, hide=True)
    assert before == after == 0.0 and not moved.any()
    before, after, moved = train_the_scores(256, noise=0.0, explore=1, hide=True)
    assert before == 0.0 and after > 0.5


CFG = Model(dim=48, n_heads=4, n_kv_groups=2, head_dim=16, cmp_block_size=SPEC.l, cmp_stride=SPEC.d,
            sel_block_size=SPEC.l_sel, sel_top_n=SPEC.n, window_size=SPEC.w, attn_impl="fast")


@pytest.mark.parametrize("wrap, explore", [("eager", 0), ("eager", 2), ("ac", 2), ("compile", 2), ("inductor", 2)])
def test_the_layer_adds_the_scores_gradient_and_keeps_its_output(wrap, explore):
    """With sel_score_grad w (and sel_score_explore), a layer's output is unchanged and its parameters'
    gradients are the plain ones plus w x the scores' gradient carried back through the cmp
    probabilities, eager, under the AC wrapper and compiled fullgraph (dynamo's graph, and through
    inductor as `apply_compile` runs it); in eval mode nothing is added."""
    layer = NSAAttention(CFG).double()
    layer.init_weights(0.3, 0.3, torch.Generator().manual_seed(0))
    T, w = 72, 0.7
    x = torch.randn(2, T, 48, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    rope = rope_tables(Model(head_dim=16), T).double()
    params = list(layer.parameters())
    plain = layer(x, rope)
    plain_grads = torch.autograd.grad(plain.square().sum(), params)

    # What the scores add: with_score_grad's gradient, given the layer's own q, kc, sel keys, values, gates
    # and the gradient reaching its attention output.
    q, kv = layer.project(x, rope)
    kc, vc = layer.compress(kv["k_cmp"], kv["v_cmp"])
    gates = layer.gates(x)
    o = layer.family(q, kc, vc, kv["k_sel"], kv["v_sel"], kv["k_win"], kv["v_win"], gates, layer.spec)
    d_o = torch.autograd.grad(layer.wo(o.reshape(2, T, -1)).square().sum(), o)[0]
    added = torch.autograd.grad(with_score_grad(torch.zeros_like(o, requires_grad=True), q, kc, kv["k_sel"], kv["v_sel"],
                                                gates, layer.spec, w, explore=explore, seed=7), params, d_o,
                                allow_unused=True)
    layer.score_grad, layer.explore = w, explore
    set_explore_step(layer, 7)  # what the trainer does each step: the draw of step 7
    torch._dynamo.reset()
    fn = {"eager": layer, "ac": checkpoint_wrapper(layer),
          "compile": torch.compile(layer, backend="eager", fullgraph=True),
          "inductor": torch.compile(layer, fullgraph=True)}[wrap]
    out = fn(x, rope)
    got = torch.autograd.grad(out.square().sum(), params)
    exact = {"rtol": 1e-9, "atol": 1e-10} if wrap == "inductor" else {"rtol": 0, "atol": 0}  # inductor reorders sums
    torch.testing.assert_close(out, plain, **exact)
    for name, g, v, a in zip([n for n, _ in layer.named_parameters()], got, plain_grads, added):
        if name.split(".")[0] in ("wq", "wkv_cmp", "compress_k"):  # what the cmp probabilities depend on
            assert float(a.abs().sum()) > 0, name
            torch.testing.assert_close(g, v + a, **(exact if wrap == "inductor" else {"rtol": 1e-10, "atol": 1e-12}))
        else:
            assert a is None or not a.any(), name
            torch.testing.assert_close(g, v, **exact)
    layer.eval()
    for g, v in zip(torch.autograd.grad(layer(x, rope).square().sum(), params), plain_grads):
        torch.testing.assert_close(g, v, rtol=0, atol=0)


@pytest.mark.parametrize("branch", ["all", "win"])
def test_a_layer_whose_sel_is_gated_off_skips_the_scores_gradient(branch, monkeypatch):
    """With `nsa_branch` cmp or win the sel gate is 0, so the scores' gradient is exactly 0: a
    window-only run (the recall report's baseline) does not pay for computing it."""
    calls = []
    monkeypatch.setattr(family_base, "with_score_grad", lambda o, *a, **k: calls.append(1) or o)
    layer = NSAAttention(dataclasses.replace(CFG, nsa_branch=branch, sel_score_grad=1.0, sel_score_explore=2))
    layer.init_weights(0.3, 0.3, torch.Generator().manual_seed(0))
    layer(torch.randn(1, 40, 48), rope_tables(Model(head_dim=16), 40)).sum().backward()
    assert len(calls) == (branch == "all")
