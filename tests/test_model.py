"""Model construction, initialisation, FLOP count, the dense baseline, and the LR schedule."""

from __future__ import annotations

import math

import pytest
import torch

from nsa_titan.config import LRScheduler, Model
from nsa_titan.models.attention import NSASpec, nsa_reference
from nsa_titan.models.nsa_stats import selection_stats
from nsa_titan.models.transformer import Compressor, Transformer
from nsa_titan.optim import lr_factor

TINY = dict(dim=32, n_layers=2, n_heads=4, n_kv_groups=2, head_dim=8, vocab_size=50, cmp_block_size=8,
            cmp_stride=4, sel_block_size=8, sel_top_n=3, window_size=16)


def build(cfg: Model, seq_len: int = 64, seed: int = 0) -> Transformer:
    with torch.device("meta"):
        model = Transformer(cfg, seq_len)
    model.to_empty(device="cpu")
    model.init_weights(seed)
    return model


def test_meta_build_then_init_is_deterministic_and_seed_dependent():
    a, b, c = build(Model(**TINY)), build(Model(**TINY)), build(Model(**TINY), seed=1)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.isfinite(pa).all(), name
        assert torch.equal(pa, pb), name
        if pa.std() > 0:  # norms are ones and biases zeros for every seed
            assert not torch.equal(pa, pc), name
    assert torch.equal(a.rope, b.rope) and a.rope.abs().sum() > 0


def test_init_scales():
    model = build(Model(**{**TINY, "n_layers": 8}))
    block = model.layers["0"]
    assert block.attention.wq.weight.std().item() == pytest.approx(0.02, rel=0.15)
    assert block.attention.wo.weight.std().item() == pytest.approx(0.02 / math.sqrt(16), rel=0.2)
    assert (block.attention.gate.bias == 0).all()  # each branch starts at sigmoid(0) = 0.5
    assert block.attention.compress_k.fc2.bias is None  # would shift all scores equally
    assert (model.norm.weight == 1).all()


def test_compressor_blocks_follow_l_and_d():
    comp = Compressor(l=8, d=4, head_dim=2, hidden=4, out_bias=True)
    comp.init_weights(0.5, torch.Generator().manual_seed(0))
    x = torch.randn(1, 23, 1, 2)
    out = comp(x)
    assert out.shape == (1, NSASpec(l=8, d=4).num_cmp_blocks(23), 1, 2) == (1, 4, 1, 2)
    # Block 2 covers positions 8..15: changing position 16 leaves it alone, position 15 not.
    x2 = x.clone()
    x2[0, 16] += 1
    assert torch.equal(comp(x2)[0, :3], out[0, :3]) and not torch.equal(comp(x2)[0, 3], out[0, 3])
    x2 = x.clone()
    x2[0, 15] += 1
    assert not torch.equal(comp(x2)[0, 2], out[0, 2])
    assert comp(torch.randn(2, 7, 3, 2)).shape == (2, 0, 3, 2)  # T < l: no block


def test_compressor_few_blocks_weight_major_equal_the_mlp():
    """A decoding step's few float32 blocks take fc1 weight-major: the same MLP, and gradients flow."""
    comp = Compressor(l=8, d=4, head_dim=4, hidden=16, out_bias=True)
    comp.init_weights(0.5, torch.Generator().manual_seed(0))
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 8, 3, 4, generator=gen).requires_grad_()  # 2 x 1 x 3 blocks: the weight-major path
    blocks = (x.unfold(1, 8, 4).transpose(-1, -2) + comp.pos).flatten(-2)
    # fp32 sums of 32 products in another order: a few ulps apart (1.8e-6 seen on inputs of another draw)
    torch.testing.assert_close(comp(x), comp.fc2(torch.nn.functional.silu(comp.fc1(blocks))), rtol=1e-5, atol=1e-5)
    comp(x).sum().backward()
    assert x.grad is not None and comp.fc1.weight.grad.abs().sum() > 0
    many = torch.randn(1, 8 + 4 * 20, 1, 4, generator=gen)  # 21 blocks: the row-major path, the same numbers as block by block
    torch.testing.assert_close(comp(many)[:, 5], comp(many[:, 20:28])[:, 0], rtol=1e-5, atol=1e-6)


def test_mean_compressor_is_the_block_mean_and_has_no_parameters():
    comp = Compressor(l=8, d=4, head_dim=2, hidden=4, out_bias=True, mlp=False)
    assert list(comp.parameters()) == []
    x = torch.randn(2, 23, 3, 2)
    out = comp(x)
    assert out.shape == (2, 4, 3, 2)
    for i in range(4):
        torch.testing.assert_close(out[:, i], x[:, 4 * i:4 * i + 8].mean(1))
    starts = torch.tensor([[0, 5, 9], [3, 4, 30]])  # document slots; past T - l: clamped, unused
    slots = comp(x, starts)
    torch.testing.assert_close(slots[:, :2], torch.stack([x[b, s:s + 8].mean(0) for b in range(2)
                                                          for s in starts[b, :2].tolist()]).view(2, 2, 3, 2))
    model = build(Model(**{**TINY, "cmp_phi": "mean"}))
    assert model.parameter_parts()["cmp compression MLPs"] == 0
    assert build(Model(**TINY)).parameter_parts()["cmp compression MLPs"] > 0
    tokens = torch.randint(0, 50, (2, 64))
    model(tokens).logsumexp(-1).mean().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_dense_baseline_and_tied_embeddings():
    dense = build(Model(**{**TINY, "attention": "dense"}))
    tokens = torch.randint(0, 50, (2, 40))
    assert dense(tokens).shape == (2, 40, 50)
    assert not any("compress" in n for n, _ in dense.named_parameters())
    tied = build(Model(**{**TINY, "tie_embeddings": True}))
    assert tied.output.weight is tied.tok_embeddings.weight
    untied = build(Model(**TINY))
    n = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert n(untied) - n(tied) == 50 * 32


def test_flops_per_token_counts_attended_keys():
    spec = NSASpec()
    # Hand count at T = 64 with the paper's sizes: n covers every block, so sel is causal:
    # t+1 keys; cmp blocks complete at t = 31, 47, 63; window covers everything (t+1).
    t = torch.arange(64.0)
    n_cmp = ((t >= 31).double() + (t >= 47).double() + (t >= 63).double())
    assert spec.mean_keys_per_query(64) == pytest.approx(float((n_cmp + 2 * (t + 1)).mean()))
    # Long context: about (T-l)/d + n*l' + w keys at the last query, far below T.
    assert spec.mean_keys_per_query(65536) < 65536 / 10
    nsa = Model(**{**TINY, "attention": "nsa"})
    dense = Model(**{**TINY, "attention": "dense"})
    with torch.device("meta"):
        f_nsa = Transformer(nsa, 4096).flops_per_token(4096)
        dense_model = Transformer(dense, 4096)
        f_dense = dense_model.flops_per_token(4096)
    params = sum(p.numel() for n, p in dense_model.named_parameters() if "tok_embeddings" not in n)
    assert f_dense == pytest.approx(6 * params + 3 * 2 * 4 * 4 * 8 * (4096 + 1) / 2)
    assert f_nsa < f_dense  # at 4k, 8-key blocks and a 16-key window attend far less than T/2


@pytest.mark.parametrize("attention,tie", [("nsa", False), ("dense", False), ("nsa", True)])
def test_accounting_is_by_structure_not_by_name(attention, tie):
    """Every parameter is in exactly one part, and wrapping the blocks (AC, compile: new parameter
    names) changes neither the parts nor the FLOPs."""
    from nsa_titan.config import Compile
    from nsa_titan.distributed.parallel import apply_ac, apply_compile

    cfg = Model(**{**TINY, "attention": attention, "tie_embeddings": tie})
    with torch.device("meta"):
        model = Transformer(cfg, 256)
    parts, flops = model.parameter_parts(), model.flops_per_token(256)
    assert sum(parts.values()) == sum(p.numel() for p in model.parameters())
    assert ("cmp K/V" in parts) == (attention == "nsa") and "MLP" in parts and "embedding" in parts
    apply_ac(model, [0, 1])
    apply_compile(model, Compile(enable=True))
    assert any("_checkpoint_wrapped_module" in n for n, _ in model.named_parameters())
    assert model.parameter_parts() == parts and model.flops_per_token(256) == flops


def test_forward_beyond_max_seq_len_is_a_clear_error():
    model = build(Model(**TINY), seq_len=16)
    with pytest.raises(ValueError, match="17 positions exceed the model's max_seq_len = 16"):
        model(torch.zeros(1, 17, dtype=torch.long))


@pytest.mark.parametrize("decay,expected", [
    ("constant", [0.25, 0.5, 0.75, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]),
    ("wsd", [0.25, 0.5, 0.75, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.7, 0.4, 0.1]),
])
def test_lr_schedule_hand_worked(decay, expected):
    s = LRScheduler(warmup_steps=4, decay_type=decay, decay_ratio=0.25, min_lr_factor=0.1)
    assert [round(lr_factor(k, 12, s), 6) for k in range(1, 13)] == pytest.approx(expected)


def test_lr_schedule_cosine():
    s = LRScheduler(warmup_steps=10, decay_type="cosine", min_lr_factor=0.1)
    assert lr_factor(5, 110, s) == pytest.approx(0.5)
    assert lr_factor(10, 110, s) == pytest.approx(1.0)
    assert lr_factor(60, 110, s) == pytest.approx(0.55)  # half way: (1 + 0.1) / 2
    assert lr_factor(110, 110, s) == pytest.approx(0.1)


def test_branch_off_silences_one_branch_of_one_layer_and_restores_it():
    model, dense = build(Model(**TINY)), build(Model(**TINY, attention="dense"))
    tokens = torch.randint(0, 50, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base = model(tokens)
        for layer in range(2):
            for branch in ("cmp", "sel", "win"):
                with model.branch_off(layer, branch):
                    assert not torch.allclose(model(tokens), base, atol=1e-6), (layer, branch)
        with model.branch_off(0, "cmp"), model.branch_off(0, "sel"), model.branch_off(0, "win"):
            silenced = model(tokens)  # layer 0's attention adds nothing: as if its output projection were 0
        assert torch.equal(model(tokens), base)
        model.layers["0"].attention.wo.weight.zero_()
        torch.testing.assert_close(silenced, model(tokens), rtol=0, atol=1e-6)
        win_only = build(Model(**TINY, nsa_branch="win"))
        alone = win_only(tokens)
        for branch, changes in (("cmp", False), ("sel", False), ("win", True)):
            with win_only.branch_off(1, branch):
                assert torch.equal(win_only(tokens), alone) != changes, branch
    with pytest.raises(ValueError, match="needs an NSA layer"):
        with dense.branch_off(0, "sel"):
            pass


@pytest.mark.parametrize("branch", ["all", "win"])
@pytest.mark.parametrize("with_docs", [False, True])
def test_recording_keeps_the_blocks_the_forward_read_and_leaves_its_output_alone(branch, with_docs):
    """`record_selection` (the evaluation's routing) and `record_stats` (`[metrics] nsa_stats`) keep the
    sel blocks the layer's own attention chose: those the reference chooses from the same queries and
    compressed keys, also in a window-only model (chosen from cmp's scores, gated off). The output
    is the forward's without them."""
    model = build(Model(**(TINY | dict(sel_top_n=4)), nsa_branch=branch), seq_len=96)
    tokens = torch.randint(0, 50, (2, 96), generator=torch.Generator().manual_seed(1))
    document_ids = (torch.arange(96) >= torch.tensor([[37], [70]])).long() if with_docs else None
    layer = model.layers["1"].attention
    seen = {}
    layer.register_forward_pre_hook(lambda _, args: seen.update(args=args))
    with torch.no_grad():
        plain = model(tokens, document_ids)
        layer.record_stats = layer.record_selection = True
        recorded = model(tokens, document_ids)
        x, rope, _, docs = seen["args"]
        q, kv = layer.project(x, rope)
        kc, vc = layer.compress(kv["k_cmp"], kv["v_cmp"], docs)
        _, idx, valid = nsa_reference(q, kc, vc, kv["k_sel"], kv["v_sel"], kv["k_win"], kv["v_win"], layer.gates(x),
                                      layer.spec, docs=docs, return_selection=True)
    assert torch.equal(recorded, plain)
    got_idx, got_valid = layer.selection
    assert torch.equal(got_valid, valid) and valid.any() and not valid.all()
    assert torch.equal(got_idx[got_valid], idx[valid])
    expected = selection_stats(idx, valid, layer.spec, docs)
    assert 0 < float(expected["sel_scored_fraction"]) < 1
    for key, value in expected.items():
        torch.testing.assert_close(layer.stats[key], value)
