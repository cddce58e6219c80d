"""The Triton kernels compiled for NVIDIA GPUs on a machine without one.

The interpreter (tests/test_nsa_triton.py) checks what the kernels compute; only Triton's compiler
says whether they build for a GPU (the first GPU run found a kernel that ran interpreted and did
not compile) and how they use its registers. Each kernel is launched by its wrapper as nsa_fast
launches it at M7C's shape (r = 6, head dim 64, the paper's blocks), with the launch recorded
instead of run, then compiled by Triton and ptxas (both in the triton wheel) to a cubin for an
A100 (sm_80) and an H100 (sm_90). The PTX shows no atomics and tensor-core products; cuobjdump,
also in the wheel, reports each kernel's registers and stack: in bf16 and fp16 on sm_90 no kernel
spills.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")]

KERNELS = {"triton_sel": ("_sel_fwd", "_sel_bwd_dq", "_sel_bwd_dkv"),
           "triton_shared": ("_fwd", "_bwd_dq", "_bwd_dkv", "_choose")}
TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int8: "i8", torch.int32: "i32",
         torch.int64: "i64"}


def recorded_launches(dtype: torch.dtype) -> list[tuple[object, dict]]:
    """(kernel, its arguments by name) of every launch the wrappers make, on CPU tensors in `dtype`."""
    from nsa_titan.models.attention import Documents, NSASpec, triton_sel, triton_shared

    calls = []

    class Recorder:
        def __init__(self, fn):
            self.fn = fn

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                calls.append((self.fn, {**dict(zip(self.fn.arg_names, args)), **kwargs}))
            return launch

    spec, (B, G, T, r, D) = NSASpec(), (1, 2, 4096, 6, 64)
    with pytest.MonkeyPatch.context() as mp:
        for module in (triton_sel, triton_shared):
            for name in KERNELS[module.__name__.rsplit(".", 1)[1]]:
                mp.setattr(module, name, Recorder(getattr(module, name)))
        q, ks = torch.zeros(B, G, T, r, D, dtype=dtype), torch.zeros(B, G, T, D, dtype=dtype)
        idx, valid = torch.zeros(B, G, T, 16, dtype=torch.long), torch.ones(B, G, T, 16, dtype=torch.bool)
        lse = torch.zeros(B, G, T, r)
        triton_sel.sel_forward(q, ks, ks, idx, valid, spec, None, 0)
        triton_sel.sel_backward(q, q, ks, ks, idx, valid, q, lse, spec, None, 0)
        docs = Documents.of(torch.arange(T)[None] // 1000, spec)
        for kind, k in (("cmp", torch.zeros(B, G, T // spec.d, D, dtype=dtype)), ("win", ks)):
            for d in (None, docs):
                triton_shared.forward(q, k, k, q.clone(), lse.clone(), kind, 0, 1024, 0, spec, d)
                triton_shared.backward(q, q, k, k, q, lse, kind, 0, spec, d)
        for d in (None, docs):  # the cmp scores of a chunk of 1,024 queries, fp32 in every dtype
            triton_shared.choose_blocks(torch.zeros(B, G, 1024, T // spec.d), spec, 1024, T, d)
    return calls


def compile_for(fn, bound: dict, arch: int):
    """The kernel compiled for sm_`arch` with the recorded arguments (launch options included)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    signature, constants = {}, {}
    for p in fn.params:
        v = bound[p.name]
        if p.is_constexpr:
            signature[p.name], constants[p.name] = "constexpr", v
        elif isinstance(v, torch.Tensor):
            signature[p.name] = "*" + TYPES[v.dtype]
        elif isinstance(v, float):
            signature[p.name] = "fp32"
        else:
            signature[p.name] = "i32" if abs(v) < 2**31 else "i64"
    options = {k: bound[k] for k in ("num_warps",) if k in bound}
    return compile(ASTSource(fn, signature, constants), target=GPUTarget("cuda", arch, 32), options=options)


def resources(cubin: bytes) -> dict[str, int] | None:
    """cuobjdump's resource usage of a cubin ({"REG": .., "STACK": ..}), or None without cuobjdump."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        return None
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        Path(path).write_bytes(cubin)
        done = subprocess.run([str(tool), "--dump-resource-usage", path], capture_output=True, text=True, check=True)
    line = next(x for x in done.stdout.splitlines() if "REG:" in x)
    return {k: int(v) for k, v in (f.split(":") for f in line.split()[:2])}


@pytest.fixture(scope="module")
def compiled() -> list[dict]:
    from triton.runtime.interpreter import InterpretedFunction

    rows = []
    for dtype, archs in ((torch.bfloat16, (80, 90)), (torch.float16, (90,)), (torch.float32, (90,))):
        for fn, bound in recorded_launches(dtype):
            if isinstance(fn, InterpretedFunction):
                pytest.skip("the kernels were defined under TRITON_INTERPRET=1")
            for arch in archs:
                kernel = compile_for(fn, bound, arch)
                ptx = kernel.asm["ptx"]
                rows.append({"kernel": fn.__name__, "variant": {k: bound[k] for k in ("WIN", "DOCS") if k in bound},
                             "dtype": TYPES[dtype], "arch": arch, "cubin": len(kernel.asm["cubin"]),
                             "use": resources(kernel.asm["cubin"]), "atomics": len(re.findall(r"\b(?:atom|red)\.", ptx)),
                             "tensor_cores": len(re.findall(r"\b(?:mma\.sync|wgmma\.mma_async)", ptx))})
    return rows


def test_every_kernel_compiles_for_a100_and_h100(compiled):
    names = {k for ks in KERNELS.values() for k in ks}
    assert {r["kernel"] for r in compiled} == names
    variants = {(r["kernel"], tuple(r["variant"].items())) for r in compiled if r["kernel"] == "_bwd_dkv"}
    assert len(variants) == 4  # cmp / win, with and without documents
    for r in compiled:
        assert r["cubin"] > 0, r
    assert {(r["dtype"], r["arch"]) for r in compiled} == {("bf16", 80), ("bf16", 90), ("fp16", 90), ("fp32", 90)}


def test_no_kernel_uses_atomics_and_every_one_uses_tensor_cores(compiled):
    """The backwards write each gradient once (no atomic adds in the PTX), and in half precision
    every kernel's products are tensor-core instructions (mma, or wgmma on the H100); the choice of
    sel blocks has no products."""
    assert [r for r in compiled if r["atomics"]] == []
    assert [r for r in compiled if r["dtype"] != "fp32" and not r["tensor_cores"] and r["kernel"] != "_choose"] == []


def test_no_kernel_spills_registers_on_h100_in_half_precision(compiled):
    half = [r for r in compiled if r["arch"] == 90 and r["dtype"] in ("bf16", "fp16")]
    if half[0]["use"] is None:
        pytest.skip("cuobjdump is not in this triton wheel")
    spills = [(r["kernel"], r["variant"], r["dtype"], r["use"]) for r in half if r["use"]["STACK"] > 0]
    assert not spills, spills
