"""The flex family (`families/flex/`): cmp and win through FlexAttention, sel through the Triton family's kernels
(interpreted here, TRITON_INTERPRET=1, in a fresh process: Triton decides at definition; this file run as a script,
one case each) or, where those cannot run, the torch family's op. On a CPU its forward (eager Flex; the backward is
GPU-only in torch 2.13, checked on the user's GPU by the startup check) equals the reference, and so does sel's
backward through the Triton kernels over the blocks chosen from Flex; its block masks are built once a batch, for
every layer, without a host sync."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from nsa_titan.config import ConfigError, Model  # noqa: E402
from nsa_titan.models.attention import FAMILIES, Documents, choose_family  # noqa: E402
from nsa_titan.models.attention.families.flex import family as flex  # noqa: E402
from nsa_titan.models.transformer import Transformer, nsa_spec  # noqa: E402
from nsa_titan.runtime import kernel_check  # noqa: E402
from conftest import interpreted, interpreted_commands  # noqa: E402
from test_host_syncs import host_syncs, report  # noqa: E402

CPU = torch.device("cpu")
DEBUG = Model(dim=128, n_heads=4, n_kv_groups=2, head_dim=32, cmp_block_size=16, cmp_stride=8, sel_block_size=16,
              sel_top_n=4, window_size=64)
M7C = Model(dim=768, n_heads=12, n_kv_groups=2, head_dim=64)
CASES = {"debug-causal": (DEBUG, False), "debug-documents-2-parts": (DEBUG, True)}
"""Interpreted cases: (model, documents and two context-parallel parts). M7C's sizes run with sel by the torch op
(below): Flex's tiles are what they test; the Triton top-n and sel at M7C's group are tests/test_families.py's."""
SEL = (False, True, False)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach() - b.detach()).norm() / b.detach().norm())


def by_parts(m: Model, documents: bool, branches: tuple[bool, bool, bool] = (True, True, True), grads: bool = False
             ) -> dict[str, float | bool]:
    """The flex family against the reference on the kernel check's problem (`kernel_check.family_inputs`: at M7C's
    group of 6 and head dim 64, T = 1,152, 9 of Flex's query tiles of 128 and 18 sel blocks, n = 16 chosen), with
    documents in two context-parallel parts: the output's relative error, whether the chosen blocks are the
    reference's, and with `grads` those of q, sel's keys and values and the gates for one output gradient."""
    spec = nsa_spec(m)
    args, docs = kernel_check.family_inputs(m, documents)
    T = args[0].shape[1]
    ref_leaves = [a.clone().requires_grad_(grads) for a in args]
    ref, ref_idx, ref_valid = FAMILIES["reference"]()(*ref_leaves, spec, docs=docs, branches=branches,
                                                      return_selection=True)
    leaves = [a.clone().requires_grad_(grads) for a in args]
    family = FAMILIES["flex"]()
    edges = [0, T // 2 // spec.l_sel * spec.l_sel, T] if documents else [0, T]
    found = [family(leaves[0][:, a:b], *leaves[1:7], leaves[7][:, a:b], spec, docs=docs, q0=a, branches=branches,
                    return_selection=True) for a, b in zip(edges, edges[1:])]
    out = torch.cat([f[0] for f in found], 1)
    errors = {"T": T, "out": rel(out, ref), "idx": torch.equal(torch.cat([f[1] for f in found], 2), ref_idx),
              "valid": torch.equal(torch.cat([f[2] for f in found], 2), ref_valid)}
    if grads:
        grad_out = torch.randn(ref.shape, generator=torch.Generator().manual_seed(3))
        at = (0, 3, 4, 7)  # q, k_sel, v_sel, gates
        ref_grads = torch.autograd.grad(ref, [ref_leaves[i] for i in at], grad_out)
        found_grads = torch.autograd.grad(out, [leaves[i] for i in at], grad_out)
        errors.update({f"d{n}": rel(g, r) for n, g, r in zip(("q", "k_sel", "v_sel", "gates"), found_grads,
                                                              ref_grads)})
    return errors


def opcheck() -> dict[str, str]:
    """The Triton op given cmp's log-sum-exp (`triton/family.selected`: sel alone, its blocks chosen from it) as one
    custom op: schema, fake implementation, registered backward, on a part of the queries with documents."""
    from nsa_titan.models.attention.families.triton import family

    spec = nsa_spec(DEBUG)
    args, docs = kernel_check.family_inputs(DEBUG, True)
    q0 = 2 * spec.l_sel
    args = [a[:, q0:] if i in (0, 7) else a for i, a in enumerate(args)]
    fields = [[spec.l, spec.d, spec.l_sel, spec.n, spec.w], q0]
    docs_fields = (docs.start, docs.cmp_start, docs.first_slot)
    lse = family._op(*args, *fields, [True, True, True], *docs_fields)[2][0].transpose(1, 2)  # cmp's (B, H, Tq)
    try:
        torch.library.opcheck(family._op, (*[x.clone().requires_grad_(True) for x in args], *fields,
                                           [False, True, False], *docs_fields, lse))
        return {"given": "ok"}
    except Exception as e:  # noqa: BLE001 (reported to the test)
        return {"given": f"{type(e).__name__}: {e}"[:500]}


EXTRAS = {"sel-gradients": lambda: by_parts(DEBUG, True, SEL, grads=True), "opcheck": opcheck}
BACKGROUND = interpreted_commands(__file__, [*CASES, *EXTRAS])


@pytest.fixture(scope="module")
def triton_sel() -> dict[str, dict]:
    return interpreted(BACKGROUND)


@pytest.mark.multiprocess
@pytest.mark.background
@pytest.mark.parametrize("case", list(CASES))
def test_the_flex_forward_with_triton_sel_equals_the_reference(triton_sel, case):
    """fp32, sel by the Triton kernels (interpreted), its blocks chosen by their top-n pass from Flex's log-sum-exp:
    the output and the chosen blocks."""
    found = triton_sel[case]
    assert found["out"] < 1e-5 and found["idx"] and found["valid"], found


@pytest.mark.multiprocess
@pytest.mark.background
def test_sel_backward_through_the_triton_kernels_equals_the_reference(triton_sel):
    """sel alone (Flex's cmp only for its log-sum-exp, no gradient through it): the gradients of q, sel's keys and
    values and the gates, with documents, in two parts."""
    found = triton_sel["sel-gradients"]
    assert max(v for k, v in found.items() if k.startswith("d") or k == "out") < 1e-5 and found["idx"], found


@pytest.mark.multiprocess
@pytest.mark.background
def test_the_triton_op_given_cmps_log_sum_exp_passes_opcheck(triton_sel):
    assert triton_sel["opcheck"] == {"given": "ok"}, triton_sel["opcheck"]


@pytest.mark.parametrize("documents", [False, True], ids=["causal", "documents-2-parts"])
@pytest.mark.parametrize("m", [DEBUG, M7C], ids=["debug", "m7c"])
def test_the_flex_forward_with_the_torch_sel_equals_the_reference(m, documents):
    """Where the Triton kernels cannot run (here: not interpreted), sel by the torch family's op: the output and the
    chosen blocks, at M7C's sizes T over 3 of Flex's query tiles; at the debug model sel's gradients too."""
    found = by_parts(m, documents)
    assert found["T"] > 3 * 128 or m is DEBUG
    assert found["out"] < 1e-5 and found["idx"] and found["valid"], found
    if m is DEBUG:
        found = by_parts(DEBUG, documents, SEL, grads=True)
        assert max(v for k, v in found.items() if k.startswith("d") or k == "out") < 1e-5, found


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


if __name__ == "__main__":  # one interpreted case: python tests/test_flex.py triton <case or extra>
    case = sys.argv[2]
    print(json.dumps(EXTRAS[case]() if case in EXTRAS else by_parts(*CASES[case])))
