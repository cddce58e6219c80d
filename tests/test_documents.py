"""Document masking: a packed window gives, for every token, what its document alone would give.

Logits and every parameter gradient of a packed run equal those of the documents run one by one
(positions from 0), for the reference, the fast path (also with many small chunks and tiles) and
the dense baseline, in fp64 and fp32, with batch rows of different layouts. The Triton family is
checked the same way in tests/test_families.py.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from nsa_titan.config import Model
from nsa_titan.models.attention import FAMILIES, Documents, Family, NSASpec
from nsa_titan.models.attention.families.pytorch import kernels as kernels_module
from nsa_titan.models.transformer import Transformer

SPEC = NSASpec(l=8, d=4, l_sel=16, n=5, w=24)  # l/d = 2, l'/d = 4 as in the paper, scaled down
CFG = dict(dim=48, n_layers=2, n_heads=6, n_kv_groups=2, head_dim=16, vocab_size=61, cmp_block_size=SPEC.l,
           cmp_stride=SPEC.d, sel_block_size=SPEC.l_sel, sel_top_n=SPEC.n, window_size=SPEC.w)


def build(dtype: torch.dtype, family: Family | None = None, **overrides) -> Transformer:
    model = Transformer(Model(**{**CFG, **overrides}), 4096, family)
    model.init_weights(0)  # with smear: a random (not identity) smear matrix
    return model.to(dtype)


def layout(T: int, rng: random.Random) -> list[int]:
    """Lengths of 1 to 6 documents filling T, drawn to include the edge cases: shorter than l, than
    l', than w, a length that ends on a sel block boundary, and long ones."""
    special = [rng.randint(1, SPEC.l - 1), rng.randint(SPEC.l, SPEC.l_sel - 1), rng.randint(SPEC.l_sel, SPEC.w - 1),
               SPEC.l_sel * rng.randint(1, 4)]
    lengths: list[int] = []
    n_docs = rng.randint(1, 6)
    while sum(lengths) < T and len(lengths) < n_docs - 1:
        lengths.append(rng.choice(special) if rng.random() < 0.6 else rng.randint(1, T))
    lengths = [n for n in lengths if n > 0]
    while sum(lengths) >= T:
        lengths.pop()
    return lengths + [T - sum(lengths)]


def ids_of(lengths: list[int]) -> torch.Tensor:
    return torch.cat([torch.full((n,), k) for k, n in enumerate(lengths)])


def packed_and_separate(model: Transformer, tokens: torch.Tensor, layouts: list[list[int]], grad_out: torch.Tensor
                        ) -> tuple[torch.Tensor, dict, torch.Tensor, dict]:
    """(logits, parameter gradients) of the packed run and of the documents run one by one, for the
    loss sum(logits * grad_out)."""
    doc_ids = torch.stack([ids_of(lengths) for lengths in layouts])
    model.zero_grad()
    packed = model(tokens, doc_ids)
    (packed * grad_out).sum().backward()
    grads_packed = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    rows = []
    for b, lengths in enumerate(layouts):
        start, outs = 0, []
        for n in lengths:
            out = model(tokens[b:b + 1, start:start + n])
            (out * grad_out[b:b + 1, start:start + n]).sum().backward()
            outs.append(out.detach())
            start += n
        rows.append(torch.cat(outs, 1))
    grads_separate = {n: p.grad.clone() for n, p in model.named_parameters()}
    return packed.detach(), grads_packed, torch.cat(rows), grads_separate


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).detach().norm() / b.detach().norm().clamp_min(1e-30))


def assert_grads_close(got: dict, want: dict, tol: float, context: object) -> None:
    """The whole gradient within `tol`, and each parameter's: in fp64 within `tol` too; in fp32
    within 10 x tol, since a gradient that is a sum with heavy cancellation (the compressor's
    position table: norm ~1e-8 against ~1e-2 elsewhere) carries more relative rounding."""
    flat = lambda g: torch.cat([x.flatten() for x in g.values()])  # noqa: E731
    assert rel(flat(got), flat(want)) < tol, context
    per_param = tol if next(iter(want.values())).dtype == torch.float64 else 10 * tol
    for name, g in want.items():
        assert rel(got[name], g) < per_param, (name, context)


IMPLS = {"reference": dict(attn_impl="reference"), "fast": dict(attn_impl="fast"), "dense": dict(attention="dense"),
         "fast+smear": dict(attn_impl="fast", smear=True)}


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
def test_packed_equals_separate_documents(impl, dtype, tol, seed):
    rng = random.Random(seed)
    B, T = 3, 150
    layouts = [layout(T, rng) for _ in range(B)]
    model = build(dtype, **IMPLS[impl])
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, CFG["vocab_size"], (B, T), generator=gen)
    grad_out = torch.randn(B, T, CFG["vocab_size"], dtype=dtype, generator=gen)
    packed, g_packed, separate, g_separate = packed_and_separate(model, tokens, layouts, grad_out)
    assert rel(packed, separate) < tol, layouts
    assert_grads_close(g_packed, g_separate, tol, layouts)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
def test_fast_packed_equals_separate_across_many_chunks_and_tiles(small_chunks, cpu_path, dtype, tol):
    rng = random.Random(7)
    B, T = 2, 203
    layouts = [[5, 70, 16, 112], layout(T, rng)]  # a document ending on a block boundary at 91
    model = build(dtype, attn_impl="fast")
    tokens = torch.randint(0, CFG["vocab_size"], (B, T), generator=torch.Generator().manual_seed(1))
    grad_out = torch.randn(B, T, CFG["vocab_size"], dtype=dtype, generator=torch.Generator().manual_seed(2))
    packed, g_packed, separate, g_separate = packed_and_separate(model, tokens, layouts, grad_out)
    assert rel(packed, separate) < tol
    assert_grads_close(g_packed, g_separate, tol, layouts)


def flash_attn_varlen_as_documented(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **kwargs):
    """flash_attn_varlen_func as documented: q (total_q, H, D), k, v (total_k, G, D); sequence i is
    query rows cu_seqlens_q[i] .. cu_seqlens_q[i + 1] against key rows cu_seqlens_k[i] ..
    cu_seqlens_k[i + 1], each as flash_attn_func (`flash_attn_as_documented`)."""
    from test_nsa_fast import flash_attn_as_documented

    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    assert max(b - a for a, b in zip(cq, cq[1:])) <= max_seqlen_q and max(b - a for a, b in zip(ck, ck[1:])) <= max_seqlen_k
    return torch.cat([flash_attn_as_documented(q[None, a:b], k[None, c:d], v[None, c:d], **kwargs)[0]
                      for a, b, c, d in zip(cq, cq[1:], ck, ck[1:])])


def test_window_branch_takes_flash_attn_varlen_as_documented(monkeypatch):
    """On GPUs the win branch with documents is flash_attn_varlen_func, each document one sequence
    of the flattened batch; checked with stand-ins written from flash-attn's documentation."""
    from test_nsa_fast import flash_attn_as_documented

    calls = []

    def varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **kwargs):
        calls.append((cu_seqlens_q.tolist(), cu_seqlens_k.tolist(), max_seqlen_q, kwargs))
        return flash_attn_varlen_as_documented(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                               **kwargs)

    monkeypatch.setattr(kernels_module, "flash_attn_varlen_func", varlen)
    monkeypatch.setattr(kernels_module, "flash_attn_func", flash_attn_as_documented)
    model = build(torch.float64, FAMILIES["flash"](), attn_impl="fast")
    layouts = [[20, 5, 100, 25], [150]]
    tokens = torch.randint(0, CFG["vocab_size"], (2, 150), generator=torch.Generator().manual_seed(8))
    grad_out = torch.randn(2, 150, CFG["vocab_size"], dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    packed, g_packed, separate, g_separate = packed_and_separate(model, tokens, layouts, grad_out)
    cu = [0, 20, 25, 125, 150, 300]
    assert calls[0] == (cu, cu, 150, {"causal": True, "window_size": (SPEC.w - 1, 0)})
    assert rel(packed, separate) < 1e-10
    assert_grads_close(g_packed, g_separate, 1e-10, layouts)


@pytest.mark.parametrize("q0,q1", [(0, 300), (100, 300), (40, 170)], ids=["all", "last-part", "middle-part"])
@pytest.mark.slow
def test_dense_baseline_flex_block_mask_equals_the_boolean_mask(q0, q1):
    """The dense baseline's GPU path with documents, FlexAttention's block-causal document mask, gives
    SDPA-with-a-T-x-T-mask's output (forward, on the CPU; tests/test_gpu.py checks the backward),
    for the whole sequence and for context-parallel parts of the queries; off a GPU no mask is built."""
    from nsa_titan.models.attention.dense import dense_causal, document_block_mask, with_block_masks

    ids = torch.tensor([[0] * 100 + [1] * 150 + [2] * 50, [0] * 30 + [1] * 270])
    docs = Documents.of(ids)
    assert with_block_masks(docs, [(q0, q1)]).block_masks == {}
    flex = dataclasses.replace(docs, block_masks={(q0, q1): document_block_mask(docs.start, q0, q1)})
    gen = torch.Generator().manual_seed(q0)
    q, k, v = (torch.randn(2, n, h, 16, generator=gen) for n, h in ((q1 - q0, 6), (300, 2), (300, 2)))
    torch.testing.assert_close(dense_causal(q, k, v, flex, q0), dense_causal(q, k, v, docs, q0), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", list(IMPLS))
def test_a_change_in_one_document_changes_no_other(impl):
    model = build(torch.float64, **IMPLS[impl])
    lengths = [40, 3, 57, 50]
    ids = ids_of(lengths)[None]
    tokens = torch.randint(0, CFG["vocab_size"], (1, 150), generator=torch.Generator().manual_seed(3))
    before = model(tokens, ids)
    changed = tokens.clone()
    for t in (45, 99):  # tokens of the third document (43..99), 99 just before the fourth (smear)
        changed[0, t] = (changed[0, t] + 1) % CFG["vocab_size"]
    after = model(changed, ids)
    same = torch.ones(150, dtype=torch.bool)
    same[45:100] = False
    assert torch.equal(after[0, same], before[0, same])
    assert not torch.allclose(after[0, 45:100], before[0, 45:100])


def test_one_document_is_the_unmasked_model():
    model = build(torch.float64, attn_impl="fast")
    tokens = torch.randint(0, CFG["vocab_size"], (2, 100), generator=torch.Generator().manual_seed(4))
    plain = model(tokens)
    assert rel(model(tokens, torch.zeros_like(tokens)), plain) < 1e-12


def test_geometry_hand_worked():
    """Documents [0, 3), [3, 40), [40, 45) with l = 8, d = 4: slots start at 3, 7, .., 31 (the second
    document's blocks, the last covering 31..38); the first and third are shorter than l."""
    docs = Documents.of(ids_of([3, 37, 5])[None], SPEC)
    assert docs.start[0].tolist() == [0] * 3 + [3] * 37 + [40] * 5
    assert docs.end[0].tolist() == [3] * 3 + [40] * 37 + [45] * 5
    assert docs.positions[0, [0, 2, 3, 39, 40, 44]].tolist() == [0, 2, 0, 36, 0, 4]
    assert docs.cmp_start[0].tolist() == [3, 7, 11, 15, 19, 23, 27, 31] + [45] * 3
    assert docs.first_slot[0, [0, 3, 39, 40]].tolist() == [0, 0, 0, 8]
    visible = docs.cmp_visible(SPEC, 0, 45, 11)[0]
    assert visible[10].sum() == 1 and visible[10, 0]  # t = 10 sees the block 3..10
    assert visible[39].sum() == 8 and visible[44].sum() == 0  # the third document has no block


def test_host_bounds_hand_worked():
    """Rows [3, 70] and [20, 53] (l = 8, d = 4, l' = 16, n = 5: at most 2 blocks chosen by score), the
    bounds worked by hand: row 0's second document has cmp slots 0..15 (starts 3, 7, .., 63), row 1's
    first 4 slots are its first document's; queries t with jt - 2 >= 1 (t - start >= 48) may choose
    min(2, jt - 2) blocks by score, of blocks 1 .. jt - 2 of their document."""
    bounds = Documents.of(torch.stack([ids_of([3, 70]), ids_of([20, 53])]), SPEC).bounds
    # every slot of row 0's document is seen by t = 72; t = 29 sees the blocks starting at 3 .. 19 (row 0)
    assert bounds.cmp_slots([(64, 73), (24, 30)]) == [(0, 16), (0, 5)]
    assert bounds.window_starts([(24, 30)], 8) == [17] and bounds.window_starts([(24, 30)], 24) == [3]  # row 0's start
    # row 0: 16 queries (51..66) with jt = 3 choose 1, 6 (67..72) with jt = 4 choose 2; row 1: 5 with
    # jt = 3 (68..72); blocks: row 0's block 1 and 2, row 1's block 1, named by the last query.
    assert bounds.scored_choices(0, 73) == (16 + 12 + 5, 2 + 1)
    assert bounds.scored_choices(48, 64) == (13, 1)
    model = build(torch.float64)
    assert model.documents(ids_of([3, 70])[None]).bounds is not None  # the trainer's ids: on the host
    assert Documents.of(ids_of([3, 70])[None]).bounds is None  # no NSA spec (the dense model): none


def test_wrong_document_ids_shape_is_a_clear_error():
    model = build(torch.float32)
    with pytest.raises(ValueError, match="one document index per token"):
        model(torch.zeros(1, 10, dtype=torch.long), torch.zeros(1, 9, dtype=torch.long))
