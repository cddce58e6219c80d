"""The Triton family's kernels and the decode step's (its compression's too) compiled for an H100 (sm_90) on a
machine without a GPU: registers, spills, shared memory, blocks per SM.

    python benchmarks/gpu/triton_compile.py [--T 8192] [--dtypes bf16 fp16 fp32] [--arch 90]

Each kernel is launched by its wrapper as the Triton family launches it at the M7C shape (12 heads in 2 KV
groups, head dim 64, the paper's l, d, l', n, w), without and with documents, the launch recorded instead of
run; Triton compiles it to PTX and the ptxas it bundles (`ptxas-blackwell`, the one that reads Triton 3.9's
PTX) assembles it for sm_90a with -v: registers per thread, spill stores and loads, stack. Blocks per SM are
the least of the register file (64K registers, allocated per warp in units of 256), shared memory (228 KiB,
1 KiB reserved a block) and 32 blocks, for the kernel's warps.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from nsa_titan.models.attention import Documents, NSASpec  # noqa: E402
from nsa_titan.models.attention.families.triton import (triton_decode, triton_nsa, triton_nsa_backward,  # noqa: E402
                                                         triton_nsa_sel)
from nsa_titan.models.attention.families.triton import family  # noqa: E402
from nsa_titan.models.transformer import Compressor  # noqa: E402

SPEC = NSASpec(l=32, d=16, l_sel=64, n=16, w=512)
H, G, D = 12, 2, 64
KERNELS = {triton_nsa: ("_fwd_cmp", "_fwd_win", "_fwd_mix"), triton_nsa_sel: ("_fwd_sel", "_bwd_sel_kv"),
           triton_nsa_backward: ("_bwd_q", "_bwd_kv"), triton_decode: ("_decode", "_decode_sel_win", "_cmp_hidden", "_cmp_out")}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int8: "i8", torch.int32: "i32",
         torch.int64: "i64", torch.bool: "i1"}
REGISTERS, SHARED, BLOCKS = 65536, 228 * 1024, 32
"""An H100 SM: 32-bit registers, shared memory (bytes), resident blocks."""


def recorded_launches(dtype: torch.dtype, docs: bool, T: int = 8192) -> list[tuple[object, dict]]:
    """(kernel, its arguments by name, launch options included) of every launch of one forward and backward;
    without documents, also of a decoding step at T cached positions (B 1): its compression and its kernel."""
    calls = []

    class Recorder:
        def __init__(self, fn):
            self.fn = fn

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                calls.append((self.fn, {**dict(zip(self.fn.arg_names, args)), **kwargs}))
            return launch

    saved = {(module, name): getattr(module, name) for module, names in KERNELS.items() for name in names}
    try:
        for (module, name), fn in saved.items():
            setattr(module, name, Recorder(fn))
        q = torch.zeros(1, T, H, D, dtype=dtype)
        keys = [torch.zeros(1, T // SPEC.d, G, D, dtype=dtype)] * 2 + [torch.zeros(1, T, G, D, dtype=dtype)] * 4
        gates = torch.zeros(1, T, H, 3)
        documents = Documents.of(torch.arange(T)[None] // 1000, SPEC) if docs else None
        out, ob, lse, idx, valid, offsets, readers, entry = family.forward(q, keys, gates, SPEC, documents, 0,
                                                                           (True, True, True))
        family.backward(q, q, keys, gates, ob, lse, offsets, readers, entry, SPEC, documents, 0, (True, True, True))
        if not docs:
            width, Ns = SPEC.num_cmp_blocks(T), SPEC.num_sel_blocks(T)
            caches = [torch.zeros(G, D, width + 16, dtype=dtype), torch.zeros(G, width + 16, D, dtype=dtype),
                      torch.zeros(G, D, T + 80, dtype=dtype), torch.zeros(G, T + 80, D, dtype=dtype),
                      torch.zeros(G, D, SPEC.w + 16, dtype=dtype), torch.zeros(G, SPEC.w + 16, D, dtype=dtype),
                      torch.zeros(G, SPEC.l, D, dtype=dtype), torch.zeros(G, SPEC.l, D, dtype=dtype)]
            new = [torch.zeros(1, 1, G, D, dtype=dtype)] * 6
            t = torch.full((1,), T - 1)
            phi = [Compressor(SPEC.l, SPEC.d, D, 4 * D, bias).to(dtype) for bias in (False, True)]
            triton_decode.compress_step(*phi, tuple(caches[6:]), tuple(new[4:]), t, caches[0], caches[1], G)
            triton_decode.decode_step(q[:, :1], gates[:, :1], caches, new, t, torch.zeros(G, 2, dtype=torch.int32), G,
                                      width, SPEC.w, SPEC.l, SPEC, Ns, SPEC.n)
    finally:
        for (module, name), fn in saved.items():
            setattr(module, name, fn)
    return calls


def compile_for(fn, bound: dict, arch: int):
    """The kernel compiled for sm_`arch` with the recorded arguments."""
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


def ptxas_use(ptx: str, arch: int) -> dict[str, int]:
    """ptxas -v of the PTX for sm_`arch`a: registers, spill stores and loads, stack (bytes)."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas-blackwell"
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "kernel.ptx"
        src.write_text(ptx)
        done = subprocess.run([str(tool), "-v", "--gpu-name", f"sm_{arch}a", str(src), "-o", str(Path(tmp) / "k.o")],
                              capture_output=True, text=True, check=True)
    text = done.stderr
    number = lambda pattern: int(re.search(pattern, text).group(1))  # noqa: E731
    return {"registers": number(r"Used (\d+) registers"), "spill_stores": number(r"(\d+) bytes spill stores"),
            "spill_loads": number(r"(\d+) bytes spill loads"), "stack": number(r"(\d+) bytes stack frame")}


def blocks_per_sm(registers: int, shared: int, warps: int) -> int:
    """Resident blocks of a kernel on an H100 SM (registers allocated per warp in units of 256)."""
    per_warp = -(-registers * 32 // 256) * 256
    by_registers = REGISTERS // (per_warp * warps)
    by_shared = SHARED // (shared + 1024) if shared else BLOCKS
    return min(by_registers, by_shared, BLOCKS)


def report(dtypes: list[str], arch: int, T: int) -> list[dict]:
    """One row per (kernel, variant, dtype): what ptxas and Triton say of it."""
    rows = []
    for name in dtypes:
        for docs in (False, True):
            for fn, bound in recorded_launches(DTYPES[name], docs, T):
                kernel = compile_for(fn, bound, arch)
                ptx = kernel.asm["ptx"]
                use = ptxas_use(ptx, arch)
                warps = bound.get("num_warps", 4)
                kind = (" (win)" if bound["WIN"] else " (cmp)") if fn.__name__ == "_bwd_kv" else ""
                rows.append({"kernel": fn.__name__ + kind,
                             "docs": docs, "dtype": name, "warps": warps, **use, "shared": kernel.metadata.shared,
                             "blocks_per_sm": blocks_per_sm(use["registers"], kernel.metadata.shared, warps),
                             "atomics": len(re.findall(r"\b(?:atom|red)\.", ptx)),
                             "ordered_atomics": len(re.findall(r"\b(?:atom|red)\.[\w.]*\.(?:acq_rel|acquire|release|sc)\b",
                                                               ptx)),
                             "async_copies": len(re.findall(r"\bcp\.async\.(?:ca|cg)\b", ptx)),
                             "stages": kernel.metadata.num_stages,
                             "tensor_cores": len(re.findall(r"\b(?:mma\.sync|wgmma\.mma_async)", ptx))})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--T", type=int, default=8192)
    parser.add_argument("--dtypes", nargs="+", default=["bf16"], choices=list(DTYPES))
    parser.add_argument("--arch", type=int, default=90)
    a = parser.parse_args()
    print(f"Triton family, M7C shape (H {H}, G {G}, D {D}), T {a.T}, sm_{a.arch}a")
    print("| kernel | documents | dtype | warps | registers | spills (st / ld bytes) | shared memory (bytes) | "
          "blocks per SM | atomics (ordered) | tensor-core ops | pipelined loads (cp.async) | stages |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in report(a.dtypes, a.arch, a.T):
        print(f"| {r['kernel']} | {r['docs']} | {r['dtype']} | {r['warps']} | {r['registers']} | "
              f"{r['spill_stores']} / {r['spill_loads']} | {r['shared']:,} | {r['blocks_per_sm']} | {r['atomics']} "
              f"({r['ordered_atomics']}) | {r['tensor_cores']} | {r['async_copies']} | {r['stages']} |", flush=True)


if __name__ == "__main__":
    main()
