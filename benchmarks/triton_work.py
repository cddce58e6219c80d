"""The Triton kernels' work per program at the M7C shape, counted on a CPU: what bounds them on a GPU.

    python benchmarks/triton_work.py [--T 8192 32768 65536] [--docs]

No kernel runs: each wrapper's launches are recorded instead (grid and arguments), on the sel blocks
the cmp branch chooses over random inputs (`sel_inputs`, as training picks them at initialisation).
For the kernels whose programs loop a data-dependent number of times, it prints the programs
launched and the longest program's serial steps, for the launch the wrappers make now and for the
layout before the 2026-11-27 rework (one program per query, or all r heads as the rows of one program):
  sel forward, dQ   blocks loaded per program and in all (per query before; per tile of BT queries,
                    the union of their blocks, now)
  sel dK, dV        steps of the block with the most readers (block 0: every query reads it)
  cmp dK, dV        steps of the longest program (the first slot tile sees every query; without
                    documents, which only shorten it)
A GPU runs a kernel no faster than its longest program, one step after another.

Then, for the whole M7C attention (`nsa_fast`, bf16, the GPU's chunk sizes), forward and backward:
the Triton launches, and the ATen ops dispatched besides them (each a kernel launch on a GPU; views
and other metadata-only ops not counted), with the sel blocks chosen by PyTorch ops (as before
the `_choose` kernel) and by the `_choose` kernel, one launch per cmp chunk; and the host time of one eager
forward and backward at T = 256 with the kernels not run (wrappers, dispatch, autograd: on a GPU,
time the device waits for unless it has work queued).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import math
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch.profiler import profile

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from nsa_titan.models.attention import (Documents, Kernels, NSASpec, common, fast_shared, nsa_fast,  # noqa: E402
                                        triton_sel, triton_shared)
from nsa_titan.models.attention.common import block_readers  # noqa: E402
from test_cpu_attention import sel_inputs  # noqa: E402  (the kernel tests' inputs, at the M7C shape)

SPEC = NSASpec(l=32, d=16, l_sel=64, n=16, w=512)
G, R, D = 2, 6, 64  # M7C: 12 heads in 2 KV groups, head dim 64


KERNELS = {triton_sel: ("_sel_fwd", "_sel_bwd_dq", "_sel_bwd_dkv"), triton_shared: ("_fwd", "_bwd_dq", "_bwd_dkv", "_choose")}
METADATA = {"detach", "view", "transpose", "slice", "expand", "_unsafe_view", "select", "unsqueeze", "squeeze", "t",
            "as_strided", "permute", "alias", "unbind", "split", "lift_fresh", "empty", "empty_strided", "reshape",
            "result_type", "to", "contiguous", "new_empty", "new_empty_strided", "empty_like", "flatten", "view_as",
            "chunk", "narrow", "unflatten", "promote_types", "resolve_conj", "resolve_neg"}
"""ATen ops that launch no kernel on a GPU (views, allocations, type queries), left out of the counts."""


def recorded(call) -> tuple[dict[str, tuple[tuple, dict]], collections.Counter]:
    """{kernel: (grid, arguments by name)} of the last launch of each kernel `call()` makes, none run,
    and the launches of each."""
    launches, counts = {}, collections.Counter()

    class Recorder:
        def __init__(self, fn):
            self.fn = fn

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches[self.fn.__name__] = (grid, {**dict(zip(self.fn.arg_names, args)), **kwargs})
                counts[self.fn.__name__] += 1
            return launch

    saved = {(module, n): getattr(module, n) for module, names in KERNELS.items() for n in names}
    try:
        for (module, n), fn in saved.items():
            setattr(module, n, Recorder(fn))
        call()
    finally:
        for (module, n), fn in saved.items():
            setattr(module, n, fn)
    return launches, counts


def aten_ops(call) -> int:
    """The ATen ops `call()` dispatches that are not nested in another and launch a kernel on a GPU."""
    with profile() as prof:
        call()
    count = 0
    for e in prof.events():
        name = e.name.removeprefix("aten::")
        if not e.name.startswith("aten::") or name in METADATA:
            continue
        parent = e.cpu_parent
        while parent is not None and not (parent.name.startswith("aten::") and
                                           parent.name.removeprefix("aten::") not in METADATA):
            parent = parent.cpu_parent
        count += parent is None
    return count


@contextlib.contextmanager
def as_on_a_gpu(choose: Callable | None = None) -> Iterator[None]:
    """The GPU's chunk sizes (and `choose` in place of `triton_shared.choose_blocks`, if given) inside."""
    sizes, kernel = (fast_shared.CHUNK_CMP, fast_shared.CHUNK_WIN), triton_shared.choose_blocks
    try:
        fast_shared.CHUNK_CMP, fast_shared.CHUNK_WIN = fast_shared.GPU_CHUNK_CMP, fast_shared.GPU_CHUNK_WIN
        triton_shared.choose_blocks = choose or kernel
        yield
    finally:
        fast_shared.CHUNK_CMP, fast_shared.CHUNK_WIN = sizes
        triton_shared.choose_blocks = kernel


def attention_step(T: int, docs: bool, kernels: Kernels = Kernels("triton", "triton", "triton")
                   ) -> Callable[[], None]:
    """One forward and backward of the M7C attention (`nsa_fast`, bf16) on `kernels`, random inputs."""
    gen = torch.Generator().manual_seed(T)
    q = torch.randn(1, T, G * R, D, generator=gen)
    kv = [torch.randn(1, SPEC.num_cmp_blocks(T) if i < 2 else T, G, D, generator=gen) for i in range(6)]
    inputs = [x.bfloat16().requires_grad_() for x in (q, *kv)]
    gates = torch.rand(1, T, G * R, 3, generator=gen, requires_grad=True)
    documents = Documents.of(torch.cumsum(torch.rand(1, T, generator=gen) < 4 / T, 1), SPEC) if docs else None
    grad = torch.randn(q.shape, generator=gen).bfloat16()
    return lambda: nsa_fast(*inputs, gates, SPEC, kernels, documents).backward(grad)


def glue(T: int, docs: bool) -> tuple[int, list[int]]:
    """The Triton launches of one forward and backward, and the ATen ops it dispatches with the sel blocks
    chosen by PyTorch ops and by `_choose` (the kernels recorded)."""
    step, counts = attention_step(T, docs), []
    for choose in (common.choose_blocks, None):
        with as_on_a_gpu(choose):
            _, launches = recorded(lambda: counts.append(aten_ops(step)))
    return sum(launches.values()), counts


def host_ms(T: int, repeats: int = 50) -> float:
    """The median host milliseconds of one eager forward and backward at a small T, the kernels recorded,
    one thread: what the attention's wrappers, dispatch and autograd cost a layer before any GPU work."""
    step, times, threads = attention_step(T, False), [], torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        def timed() -> None:
            for _ in range(repeats):
                start = time.perf_counter()
                step()
                times.append(time.perf_counter() - start)
        with as_on_a_gpu():
            recorded(timed)
    finally:
        torch.set_num_threads(threads)
    return 1e3 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--T", type=int, nargs="+", default=[8192, 32768, 65536])
    parser.add_argument("--docs", action="store_true", help="random documents (~4 per row)")
    a = parser.parse_args()
    if not triton_sel.AVAILABLE:
        sys.exit("triton is not installed (pip install -e '.[test]')")
    print(f"M7C attention (B 1, G {G}, r {R}, D {D}, l' {SPEC.l_sel}, n {SPEC.n}), documents {a.docs}; "
          "the sel blocks chosen over random inputs")
    print("| T | kernel | programs before | longest before (steps) | programs now | longest now (steps) | blocks loaded "
          "before / now |")
    print("|---|---|---|---|---|---|---|")
    for T in a.T:
        q, ks, vs, idx, valid, start = sel_inputs(1, G, T, R, D, SPEC, a.docs, seed=T)
        lse = torch.zeros(1, G, T, R)
        sel, _ = recorded(lambda: triton_sel.sel_backward(q, q, ks, vs, idx, valid, q, lse, SPEC, start, 0))
        grid, args = sel["_sel_bwd_dq"]
        per_query, union = int(valid.sum()), int(args["COUNT"].sum())
        print(f"| {T:,} | sel forward, dQ | {T * G:,} | {SPEC.n} | {math.prod(grid):,} | "
              f"{int(args['COUNT'].max())} (mean {union / math.prod(grid):.1f}, {args['BT']} queries) | "
              f"{per_query:,} / {union:,} ({per_query / union:.2f}x fewer) |")
        idx32, start32 = triton_sel._prepared(idx, valid, start, 1, T)
        offsets, _ = block_readers(idx32, start32, SPEC.l_sel, T)
        most = int((offsets[1:] - offsets[:-1]).max())
        grid, args = sel["_sel_bwd_dkv"]
        before_rows = triton_sel.DKV_ROWS // (1 << (R - 1).bit_length())  # a reader: r heads padded to 2^k rows
        print(f"| {T:,} | sel dK, dV | {T * G:,} | {-(-most // before_rows):,} | {math.prod(grid):,} | "
              f"{-(-most // args['BQ']):,} | |")
        S = SPEC.num_cmp_blocks(T)
        kc = torch.zeros(1, G, S, D)
        cmp, _ = recorded(lambda: triton_shared.backward(q, q, kc, kc, q, lse, "cmp", 0, SPEC, None))
        grid, args = cmp["_bwd_dkv"]
        rows = T - (SPEC.l - 1)  # the queries that may see the first slot tile
        tiles = -(-S // triton_shared.BLOCK_N)
        print(f"| {T:,} | cmp dK, dV | {tiles * G:,} | {-(-rows // before_rows):,} | {math.prod(grid):,} | "
              f"{-(-min(rows, args['SEG']) // args['BM']):,} | |")
    print("\n| T | Triton launches | ATen ops, the choice in PyTorch | ATen ops, the choice by `_choose` | fewer by |")
    print("|---|---|---|---|---|")
    for T in a.T:
        launches, (before, now) = glue(T, a.docs)
        print(f"| {T:,} | {launches} | {before} | {now} | {before / now:.1f}x |", flush=True)
    print(f"\nHost time of one eager forward and backward at T = 256, the kernels not run (on a GPU, hidden only "
          f"while earlier kernels still run): {host_ms(256):.2f} ms")


if __name__ == "__main__":
    main()
