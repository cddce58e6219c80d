"""The flex family (`families/flex/`): cmp and win through FlexAttention, sel through the torch family's op. On a CPU
its forward (eager Flex; the backward is GPU-only in torch 2.13, checked on the user's GPU by the startup check)
equals the reference; its block masks are built once a batch, for every layer, without a host sync."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from nsa_titan.config import ConfigError, Model
from nsa_titan.models.attention import FAMILIES, Documents, choose_family
from nsa_titan.models.attention.families.flex import family as flex
from nsa_titan.models.transformer import Transformer, nsa_spec
from nsa_titan.runtime import kernel_check
from test_host_syncs import host_syncs, report

CPU = torch.device("cpu")
DEBUG = Model(dim=128, n_heads=4, n_kv_groups=2, head_dim=32, cmp_block_size=16, cmp_stride=8, sel_block_size=16,
              sel_top_n=4, window_size=64)
M7C = Model(dim=768, n_heads=12, n_kv_groups=2, head_dim=64)


@pytest.mark.parametrize("documents,parts", [(False, False), (True, True)], ids=["causal", "documents-2-parts"])
@pytest.mark.parametrize("m", [DEBUG, M7C], ids=["debug", "m7c"])
def test_the_flex_forward_equals_the_reference(m, documents, parts):
    """fp32, the kernel check's problem (`kernel_check.family_inputs`: at M7C's group of 6 and head dim 64, T = 1,152,
    9 of Flex's query tiles of 128 and 18 sel blocks, n = 16 chosen), with documents and in two context-parallel
    parts: the output and the chosen blocks."""
    spec = nsa_spec(m)
    args, docs = kernel_check.family_inputs(m, documents)
    T = args[0].shape[1]
    assert T > 3 * 128 or m is DEBUG
    ref, ref_idx, ref_valid = FAMILIES["reference"]()(*args, spec, docs=docs, return_selection=True)
    family = FAMILIES["flex"]()
    edges = [0, T // 2 // spec.l_sel * spec.l_sel, T] if parts else [0, T]
    found = [family(args[0][:, a:b], *args[1:7], args[7][:, a:b], spec, docs=docs, q0=a, return_selection=True)
             for a, b in zip(edges, edges[1:])]
    out = torch.cat([f[0] for f in found], 1)
    assert float((out - ref).norm() / ref.norm()) < 1e-5
    assert torch.equal(torch.cat([f[1] for f in found], 2), ref_idx)
    assert torch.equal(torch.cat([f[2] for f in found], 2), ref_valid)


def test_the_masks_are_built_once_a_batch_without_a_host_sync(monkeypatch):
    """Two layers of the debug model by the flex family, a batch with documents: the cmp and win masks of the
    batch are built once (not a layer), with no device read; the next batch builds its own. Without documents, a
    shape's masks are built once and kept."""
    built, plain = [], flex.block_mask
    monkeypatch.setattr(flex, "block_mask", lambda kind, *args: built.append(kind) or plain(kind, *args))
    m = dataclasses.replace(DEBUG, n_layers=2, vocab_size=64)
    model = Transformer(m, 256, FAMILIES["flex"]())
    model.init_weights(0)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 64, (2, 256), generator=gen)
    for batch in range(2):  # 2 layers, 1 query part: the batch's cmp and win masks, once
        ids = torch.cumsum(torch.rand(2, 256, generator=gen) < 3 / 256, 1)
        with torch.no_grad():
            model(tokens, ids)
        assert sorted(built) == sorted(["cmp", "win"] * (batch + 1))
    docs = Documents.of(ids, nsa_spec(m))
    with host_syncs() as seen:
        docs = FAMILIES["flex"]().prepare(docs, nsa_spec(m), [(0, 128), (128, 256)])
    assert not seen, report(seen)
    assert sorted(docs.block_masks) == [(k, a, b) for k in ("cmp", "win") for a, b in ((0, 128), (128, 256))]
    built.clear()
    with torch.no_grad():
        model(tokens), model(tokens)
    assert sorted(built) == ["cmp", "win"]  # without documents: once a shape


def test_the_flex_family_is_refused_on_a_cpu_with_the_reason():
    spec = nsa_spec(DEBUG)
    with pytest.raises(ConfigError, match=r"kernels = 'flex' cannot run: FlexAttention's backward runs on CUDA "
                                          r"devices only"):
        choose_family("flex", CPU, torch.float32, spec, 2, 32)
    assert FAMILIES["flex"].problem(torch.device("cuda"), torch.bfloat16, spec, 6, 64) is None
