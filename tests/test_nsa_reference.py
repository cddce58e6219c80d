"""The reference NSA attention against hand-worked cases, a per-query loop and full attention."""

from __future__ import annotations

import math

import pytest
import torch

from nsa_titan.config import Model
from nsa_titan.models.attention import (
    NSASpec, cmp_visibility, dense_causal, nsa_reference, sel_members, select_blocks, top_n,
)
from nsa_titan.models.rope import rope_tables
from nsa_titan.models.transformer import NSAAttention, Transformer

SMALL = NSASpec(l=8, d=4, l_sel=8, n=4, w=16)


def mean_pool(x: torch.Tensor, spec: NSASpec) -> torch.Tensor:
    """A causal stand-in for phi: the mean of each cmp block, (B, T, G, D) -> (B, Nc, G, D)."""
    if x.shape[1] < spec.l:
        return x.new_zeros(x.shape[0], 0, *x.shape[2:])
    return x.unfold(1, spec.l, spec.d).mean(-1)


def random_inputs(B: int, T: int, H: int, G: int, D: int, spec: NSASpec, dtype=torch.float64, seed: int = 0):
    """q, compressed k/v, sel k/v, win k/v and gates, as nsa_reference takes them."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, D, generator=gen, dtype=dtype)
    raw = [torch.randn(B, T, G, D, generator=gen, dtype=dtype) for _ in range(6)]
    gates = torch.rand(B, T, H, 3, generator=gen, dtype=dtype)
    return q, mean_pool(raw[0], spec), mean_pool(raw[1], spec), *raw[2:], gates


def only(branch: int, B: int, T: int, H: int, dtype=torch.float64) -> torch.Tensor:
    g = torch.zeros(B, T, H, 3, dtype=dtype)
    g[..., branch] = 1
    return g


def naive_nsa(q, kc, vc, ks, vs, kw, vw, gates, spec: NSASpec) -> torch.Tensor:
    """NSA written from the rules query by query, with Python loops (slow, obviously right)."""
    B, T, H, D = q.shape
    G = ks.shape[2]
    r = H // G
    out = torch.zeros_like(q)

    def attend(qv, keys, values):
        if keys.shape[0] == 0:
            return torch.zeros_like(qv), torch.zeros(0, dtype=qv.dtype)
        p = torch.softmax(keys @ qv / math.sqrt(D), dim=0)
        return p @ values, p

    for b in range(B):
        for t in range(T):
            cmp_vis = [i for i in range(kc.shape[1]) if i * spec.d + spec.l - 1 <= t]
            jt = t // spec.l_sel
            candidates = [j for j in range(jt + 1)]
            for g in range(G):
                heads = range(g * r, (g + 1) * r)
                o_cmp, score = {}, {j: 0.0 for j in candidates}
                for h in heads:
                    o_cmp[h], p = attend(q[b, t, h], kc[b, cmp_vis, g], vc[b, cmp_vis, g])
                    for pi, i in zip(p.tolist(), cmp_vis):
                        for j in candidates:  # cmp block i overlaps sel block j
                            if i * spec.d < (j + 1) * spec.l_sel and i * spec.d + spec.l > j * spec.l_sel:
                                score[j] += pi
                forced = {j for j in candidates if j == 0 or j >= jt - 1}
                rest = sorted((j for j in candidates if j not in forced), key=lambda j: (-score[j], j))
                chosen = forced | set(rest[: max(0, spec.n - len(forced))])
                sel_keys = [s for s in range(t + 1) if s // spec.l_sel in chosen]
                win_keys = list(range(max(0, t - spec.w + 1), t + 1))
                for h in heads:
                    o_sel, _ = attend(q[b, t, h], ks[b, sel_keys, g], vs[b, sel_keys, g])
                    o_win, _ = attend(q[b, t, h], kw[b, win_keys, g], vw[b, win_keys, g])
                    gt = gates[b, t, h]
                    out[b, t, h] = gt[0] * o_cmp[h] + gt[1] * o_sel + gt[2] * o_win
    return out


def members_of(spec: NSASpec, T: int) -> list[set[int]]:
    m = sel_members(spec, T, torch.device("cpu"))
    return [set(i for i in row.tolist() if i < spec.num_cmp_blocks(T)) for row in m]


def test_sel_members_hand_worked():
    # Paper sizes l=32, d=16, l'=64 at T=256: 15 cmp blocks, 4 sel blocks.
    spec = NSASpec(l=32, d=16, l_sel=64, n=16, w=512)
    cols = members_of(spec, 256)
    assert len(cols) == 4
    # sel block 0 = keys [0, 64): cmp blocks 0 [0,32), 1 [16,48), 2 [32,64), 3 [48,80).
    assert cols[0] == {0, 1, 2, 3}
    # sel block 1 = keys [64, 128): cmp blocks 3 [48,80) .. 7 [112,144).
    assert cols[1] == {3, 4, 5, 6, 7}
    assert cols[3] == {11, 12, 13, 14}  # [176,208) .. [224,256); block 15 would be incomplete
    # With l = d = l' the mapping is the identity: p_sel = p_cmp.
    assert members_of(NSASpec(l=16, d=16, l_sel=16, n=4, w=64), 64) == [{0}, {1}, {2}, {3}]


@pytest.mark.parametrize("l,d,l_sel,T", [(32, 16, 64, 300), (8, 4, 16, 101), (12, 5, 16, 97), (16, 16, 32, 70), (8, 8, 8, 5)])
def test_sel_members_are_the_overlapping_cmp_blocks(l, d, l_sel, T):
    spec = NSASpec(l=l, d=d, l_sel=l_sel, n=4, w=16)
    want = [{i for i in range(spec.num_cmp_blocks(T)) if i * d < (j + 1) * l_sel and i * d + l > j * l_sel}
            for j in range(spec.num_sel_blocks(T))]
    assert members_of(spec, T) == want


def test_cmp_visibility_hand_worked():
    vis = cmp_visibility(NSASpec(l=8, d=4, l_sel=8, n=4, w=16), 20, torch.device("cpu"))
    assert vis.shape == (20, 4)  # blocks start at 0, 4, 8, 12
    assert not vis[6].any()  # t < l - 1: nothing complete
    assert vis[7].tolist() == [True, False, False, False]  # block 0 ends at 7
    assert vis[14].tolist() == [True, True, False, False]  # block 1 ends at 11, block 2 at 15
    assert vis[19].all()


def test_select_blocks_hand_worked_group_sum_and_forced_blocks():
    spec = NSASpec(l=4, d=4, l_sel=4, n=4, w=8)  # identity mapping, 6 blocks at T=24
    T, H = 24, 2
    p = torch.zeros(1, H, T, 6)
    # Query t=23 (current block 5): forced {0, 4, 5}; one more from {1, 2, 3} by group sum.
    p[0, 0, 23, 1:4] = torch.tensor([0.30, 0.10, 0.20])  # head 0 alone would pick block 1
    p[0, 1, 23, 1:4] = torch.tensor([0.00, 0.35, 0.10])  # sums: 0.30, 0.45, 0.30 -> block 2
    idx, valid = select_blocks(p, spec, n_groups=1)
    assert idx.shape == (1, 1, T, 4)
    assert set(idx[0, 0, 23].tolist()) == {0, 2, 4, 5} and valid[0, 0, 23].all()
    # With one group per head each head chooses alone: head 0 now takes block 1.
    idx_h, _ = select_blocks(p, spec, n_groups=2)
    assert set(idx_h[0, 0, 23].tolist()) == {0, 1, 4, 5}
    assert set(idx_h[0, 1, 23].tolist()) == {0, 2, 4, 5}
    # Query t=5 (block 1): only blocks 0 and 1 are candidates, both chosen, the rest invalid.
    assert set(idx[0, 0, 5][valid[0, 0, 5]].tolist()) == {0, 1}
    assert valid[0, 0, 5].sum() == 2
    # A tie keeps the lower index: t=23 with equal scores picks block 1 of {1, 2, 3}.
    p[0, :, 23, 1:4] = 0.1
    idx, _ = select_blocks(p, spec, n_groups=1)
    assert set(idx[0, 0, 23].tolist()) == {0, 1, 4, 5}


@pytest.mark.parametrize("Ns", [3, 16, 130, 1024])
def test_top_n_is_the_first_n_of_a_stable_descending_sort(Ns):
    """Ties (equal scores, +inf forced blocks, -inf non-candidates) go to the lower index, as a
    stable sort orders them, at every row length; also with fewer finite scores than n."""
    g = torch.Generator().manual_seed(Ns)
    scores = torch.randint(0, 5, (3, 40, Ns), generator=g).double()  # many exact ties
    scores[0] = torch.rand(40, Ns, generator=g, dtype=torch.float64)
    scores[:, :, :2] = float("inf")
    scores[:, :10, Ns // 2:] = float("-inf")
    scores[2, :, 1:] = float("-inf")  # one real score, the rest -inf
    n = min(16, Ns)
    want = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :n]
    assert torch.equal(top_n(scores, n), want)
    assert torch.equal(top_n(scores.float(), n), torch.sort(scores.float(), dim=-1, descending=True, stable=True).indices[..., :n])


@pytest.mark.parametrize("T", [5, 8, 23, 45])
@pytest.mark.parametrize("H,G", [(4, 4), (4, 2), (4, 1), (6, 1)])
def test_reference_equals_per_query_loop(T, H, G):
    args = random_inputs(2, T, H, G, 8, SMALL, seed=T + H + G)
    torch.testing.assert_close(nsa_reference(*args, SMALL), naive_nsa(*args, SMALL), rtol=1e-10, atol=1e-12)


def test_reference_equals_per_query_loop_paper_ratios():
    # l/d = 2 and l'/d = 4 as in the paper, scaled down; n=5 leaves 2 scored blocks.
    spec = NSASpec(l=8, d=4, l_sel=16, n=5, w=24)
    args = random_inputs(1, 101, 4, 2, 8, spec, seed=7)
    torch.testing.assert_close(nsa_reference(*args, spec), naive_nsa(*args, spec), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("T", [7, 16, 50])
@pytest.mark.parametrize("H,G", [(4, 4), (4, 2), (4, 1)])
def test_window_branch_equals_full_causal_attention_when_w_covers_T(T, H, G):
    spec = NSASpec(l=8, d=4, l_sel=8, n=4, w=T)
    q, kc, vc, ks, vs, kw, vw, _ = random_inputs(2, T, H, G, 8, spec)
    out = nsa_reference(q, kc, vc, ks, vs, kw, vw, only(2, 2, T, H), spec)
    torch.testing.assert_close(out, dense_causal(q, kw, vw), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("T", [7, 16, 50])
@pytest.mark.parametrize("H,G", [(4, 4), (4, 2), (4, 1)])
def test_selection_branch_equals_full_causal_attention_when_n_covers_all_blocks(T, H, G):
    spec = NSASpec(l=8, d=4, l_sel=8, n=-(-T // 8), w=4)
    q, kc, vc, ks, vs, kw, vw, _ = random_inputs(2, T, H, G, 8, spec)
    out = nsa_reference(q, kc, vc, ks, vs, kw, vw, only(1, 2, T, H), spec)
    torch.testing.assert_close(out, dense_causal(q, ks, vs), rtol=1e-10, atol=1e-12)


def test_selection_with_fewer_blocks_than_n_is_causal_attention_even_when_gated_with_others():
    # T < n*l' -> all visible blocks are selected: sel == full causal attention.
    spec = NSASpec(l=8, d=4, l_sel=8, n=16, w=4)
    q, kc, vc, ks, vs, kw, vw, _ = random_inputs(1, 40, 4, 2, 8, spec)
    out = nsa_reference(q, kc, vc, ks, vs, kw, vw, only(1, 1, 40, 4), spec)
    torch.testing.assert_close(out, dense_causal(q, ks, vs), rtol=1e-10, atol=1e-12)


def test_empty_cmp_rows_give_zero_not_nan():
    for T in (5, 12):  # T < l: no block at all; T >= l: rows t < l - 1 are empty
        q, kc, vc, ks, vs, kw, vw, _ = random_inputs(1, T, 4, 2, 8, SMALL)
        for x in (q, kc, vc):
            x.requires_grad_(True)
        out = nsa_reference(q, kc, vc, ks, vs, kw, vw, only(0, 1, T, 4), SMALL)
        assert torch.isfinite(out).all()
        assert (out[:, : SMALL.l - 1] == 0).all()
        if T >= SMALL.l:
            assert (out[:, SMALL.l - 1 :].abs().sum(-1) > 0).all()
        out.sum().backward()
        assert all(torch.isfinite(x.grad).all() for x in (q, kc, vc) if x.grad is not None)


def attention_module(H: int = 4, G: int = 2, D: int = 16, spec: NSASpec = SMALL, seed: int = 0) -> NSAAttention:
    cfg = Model(dim=32, n_heads=H, n_kv_groups=G, head_dim=D, cmp_block_size=spec.l, cmp_stride=spec.d,
                sel_block_size=spec.l_sel, sel_top_n=spec.n, window_size=spec.w)
    attn = NSAAttention(cfg).double()
    attn.init_weights(0.3, 0.3, torch.Generator().manual_seed(seed))
    return attn


@pytest.mark.parametrize("T", [37, 64])
@pytest.mark.parametrize("H,G", [(4, 4), (4, 2), (4, 1)])
def test_nsa_module_is_causal(T, H, G):
    """Changing the input at position s changes no output before s (compression included)."""
    attn = attention_module(H, G)
    rope = rope_tables(Model(head_dim=16), T).double()
    x = torch.randn(2, T, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    y = attn(x, rope)
    for s in (0, 7, 8, 15, 16, T - 1):  # block edges of l=8, d=4, l'=8
        x2 = x.clone()
        x2[:, s] += torch.randn(32, dtype=torch.float64)
        y2 = attn(x2, rope)
        assert torch.equal(y2[:, :s], y[:, :s]), f"output before {s} changed"
        assert not torch.equal(y2[:, s], y[:, s])


def test_model_is_causal_end_to_end():
    cfg = Model(dim=32, n_layers=2, n_heads=4, n_kv_groups=2, head_dim=8, vocab_size=50, cmp_block_size=8,
                cmp_stride=4, sel_block_size=8, sel_top_n=3, window_size=16)
    model = Transformer(cfg, 64).double()
    model.init_weights(0)
    tokens = torch.randint(0, 50, (2, 61), generator=torch.Generator().manual_seed(0))
    logits = model(tokens)
    for s in (3, 20, 33, 60):
        t2 = tokens.clone()
        t2[:, s] = (t2[:, s] + 1) % 50
        assert torch.equal(model(t2)[:, :s], logits[:, :s])


def test_batch_items_are_independent():
    args = random_inputs(3, 30, 4, 2, 8, SMALL, seed=5)
    out = nsa_reference(*args, SMALL)
    for b in range(3):
        single = nsa_reference(*(a[b : b + 1] for a in args), SMALL)
        torch.testing.assert_close(out[b : b + 1], single, rtol=1e-12, atol=1e-12)


def test_bf16_inputs_stay_finite_and_close_to_fp32():
    args = random_inputs(2, 45, 4, 2, 16, SMALL, dtype=torch.float32, seed=3)
    ref = nsa_reference(*args, SMALL)
    out = nsa_reference(*(a.bfloat16() for a in args), SMALL)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), ref, rtol=0.05, atol=0.05)


def test_selection_gets_no_gradient_and_cmp_gets_it_only_through_its_output():
    """With the cmp gate at 0, compressed keys receive no gradient: top-n is not differentiable."""
    q, kc, vc, ks, vs, kw, vw, _ = random_inputs(1, 40, 4, 2, 8, SMALL)
    kc.requires_grad_(True)
    gates = only(1, 1, 40, 4)
    nsa_reference(q, kc, vc, ks, vs, kw, vw, gates, SMALL).sum().backward()
    assert kc.grad is None or (kc.grad == 0).all()
    gates[..., 0] = 0.5
    kc.grad = None
    nsa_reference(q, kc, vc, ks, vs, kw, vw, gates, SMALL).sum().backward()
    assert kc.grad.abs().sum() > 0


@pytest.mark.parametrize("l,d,l_sel,T", [(32, 16, 64, 1000), (8, 4, 16, 203), (16, 16, 16, 64), (16, 8, 16, 130), (8, 4, 8, 37)])
def test_strided_pooling_equals_the_members_sums(l, d, l_sel, T):
    """choose_blocks pools cmp scores into sel-block scores by strided slices when l and l' are
    multiples of d: the same sums as gathering `sel_members`, with any number of visible blocks."""
    from nsa_titan.models.attention.common import _pooled

    spec = NSASpec(l=l, d=d, l_sel=l_sel, n=4, w=16)
    Nc, Ns = spec.num_cmp_blocks(T), spec.num_sel_blocks(T)
    for Nv in (Nc, Nc // 2, 0):
        p = torch.rand(2, 3, 5, Nv, dtype=torch.float64)
        padded = torch.cat([p, p.new_zeros(2, 3, 5, 1)], -1)
        expected = padded[..., sel_members(spec, T, p.device).clamp(max=Nv)].sum(-1)
        torch.testing.assert_close(_pooled(p, spec, Ns), expected, rtol=1e-15, atol=1e-15)
