"""The Triton family's kernels compiled for an H100 on a machine without a GPU (`benchmarks/gpu/triton_compile.py`).

The interpreter (tests/test_families.py) checks what the kernels compute; only Triton's compiler says whether
they build for a GPU (a kernel can run interpreted and not compile) and how they use its registers. Each kernel
is launched by its wrapper at M7C's shape, recorded instead of run, compiled by Triton and assembled by the
ptxas in the triton wheel for sm_90a: in bf16 and fp16, with and without documents, no kernel spills; so is the
decode step's kernels (`triton_decode`: the step and its compression).
"""

from __future__ import annotations

import importlib.util
import sys

import pytest

from conftest import ROOT

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")]

sys.path.insert(0, str(ROOT))


@pytest.fixture(scope="module")
def compiled() -> list[dict]:
    from benchmarks.gpu import triton_compile
    from triton.runtime.interpreter import InterpretedFunction

    from nsa_titan.models.attention.families.triton import triton_nsa

    if isinstance(triton_nsa._fwd_cmp, InterpretedFunction):
        pytest.skip("the kernels were defined under TRITON_INTERPRET=1")
    return triton_compile.report(["bf16", "fp16"], 90, 8192)


def test_every_kernel_compiles_for_h100(compiled):
    assert {r["kernel"] for r in compiled} == {"_fwd_cmp", "_fwd_win", "_fwd_sel", "_fwd_mix", "_bwd_q", "_bwd_sel_kv",
                                               "_bwd_kv (cmp)", "_bwd_kv (win)", "_decode", "_decode_sel_win",
                                               "_cmp_hidden", "_cmp_out"}
    assert {(r["dtype"], r["docs"]) for r in compiled} == {(d, x) for d in ("bf16", "fp16") for x in (False, True)}


def test_no_kernel_spills_registers(compiled):
    spills = [r for r in compiled if r["spill_stores"] or r["spill_loads"] or r["stack"]]
    assert not spills, spills


def test_products_run_on_tensor_cores_and_atomics_only_where_meant(compiled):
    """Every kernel's products are tensor-core instructions (the gated sum and the compression's output, a row's
    64 sums of 256 products, have none). Atomics: the forward's counts
    and slots of the inverse index, each key-gradient program's one add of its keys (sel's dQ rows are written);
    the decode step's one count of a program's arrival a launch, the only ordered ones (its stores before, the last
    program's loads after)."""
    assert {r["kernel"] for r in compiled if not r["tensor_cores"]} == {"_fwd_mix", "_cmp_out"}
    assert {r["kernel"] for r in compiled if r["atomics"]} == {"_fwd_cmp", "_fwd_win", "_bwd_sel_kv",
                                                               "_bwd_kv (cmp)", "_bwd_kv (win)", "_decode",
                                                               "_decode_sel_win"}
    ordered = {(r["kernel"], r["atomics"], r["ordered_atomics"]) for r in compiled if r["ordered_atomics"]}
    assert ordered == {("_decode", 1, 1), ("_decode_sel_win", 1, 1)}, ordered  # the training kernels' adds relaxed: none orders memory
