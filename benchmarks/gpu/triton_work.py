"""The Triton family's launches per NSA attention, counted on a CPU: what a GPU would be asked to run.

    python benchmarks/gpu/triton_work.py [--T 512 8192 32768 65536]

One forward and backward of the M7C attention (B 1, 12 heads in 2 KV groups, head dim 64, the paper's
l, d, l', n, w) in bf16 through the Triton family (`models/attention/families/triton/`) on the CPU,
each Triton kernel recorded instead of run (what it computes is checked interpreted, TRITON_INTERPRET=1,
in tests/test_families.py): its launches, and the ATen ops
dispatched besides them that would launch a kernel on a GPU (views, allocations and other metadata-only
ops not counted), without and with documents; then with the off-paper options (`sel_score_grad`,
`sel_score_explore`), whose score gradient runs in PyTorch after the op. A launch count that does not
grow with T, no host sync (`tests/test_host_syncs.py`) and no data-dependent shape: the op can be
captured in a CUDA graph. The same for the flex family's sel (the Triton kernels given Flex's cmp
log-sum-exp). Then the host time of one eager forward and backward (the kernels not run). Last, decoding:
the launches of a layer's attention per step through the Triton decode step (`triton_decode`), over d = 16
steps (one of which compresses a block).
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch.profiler import profile  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from nsa_titan.models.attention import Documents, NSASpec  # noqa: E402
from nsa_titan.models.attention.families.triton import (triton_decode, triton_nsa, triton_nsa_backward,  # noqa: E402
                                                         triton_nsa_sel)
from nsa_titan.models.attention.families.choose import FAMILIES  # noqa: E402
from nsa_titan.models.attention.families.triton.family import selected  # noqa: E402
from nsa_titan.config import Model  # noqa: E402
from nsa_titan.models import decode  # noqa: E402
from nsa_titan.models.decode import Decoder  # noqa: E402
from nsa_titan.models.transformer import Transformer  # noqa: E402
from benchmarks.decoding.decode_speed import random_fill  # noqa: E402

SPEC = NSASpec(l=32, d=16, l_sel=64, n=16, w=512)
G, R, D = 2, 6, 64  # M7C: 12 heads in 2 KV groups, head dim 64
KERNELS = {triton_nsa: ("_fwd_cmp", "_fwd_win", "_fwd_mix"), triton_nsa_sel: ("_fwd_sel", "_bwd_sel_kv"),
           triton_nsa_backward: ("_bwd_q", "_bwd_kv"), triton_decode: ("_decode", "_decode_sel_win", "_cmp_hidden", "_cmp_out")}
METADATA = {"detach", "view", "transpose", "slice", "expand", "_unsafe_view", "select", "unsqueeze", "squeeze", "t",
            "as_strided", "permute", "alias", "unbind", "split", "lift_fresh", "empty", "empty_strided", "reshape",
            "result_type", "to", "contiguous", "new_empty", "new_empty_strided", "empty_like", "flatten", "view_as",
            "chunk", "narrow", "unflatten", "promote_types", "resolve_conj", "resolve_neg", "unfold"}
"""ATen ops that launch no kernel on a GPU (views, allocations, type queries), left out of the counts; `to` and
`contiguous` launch one only through the copy they dispatch (`_to_copy`, `clone`), which is counted."""


def recorded(call: Callable[[], object]) -> collections.Counter:
    """The launches of each Triton kernel `call()` makes, none run: the chosen blocks come out as blocks
    0 .. n - 1, none valid (what the kernels would write is not needed to count what runs after them)."""
    counts: collections.Counter = collections.Counter()

    class Recorder:
        def __init__(self, fn):
            self.fn = fn

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                counts[self.fn.__name__] += 1
                if self.fn.__name__ == "_fwd_cmp":  # in numpy: no ATen op counted
                    kwargs["IDX"].numpy()[:] = np.arange(kwargs["IDX"].shape[-1])
                    kwargs["VALID"].numpy()[:] = 0
            return launch

    saved = {(module, name): getattr(module, name) for module, names in KERNELS.items() for name in names}
    try:
        for (module, name), fn in saved.items():
            setattr(module, name, Recorder(fn))
        call()
    finally:
        for (module, name), fn in saved.items():
            setattr(module, name, fn)
    return counts


def aten_ops(call: Callable[[], object]) -> list[str]:
    """The ATen ops `call()` dispatches that are not nested in another and launch a kernel on a GPU."""
    with profile() as prof:
        call()
    found = []
    for e in prof.events():
        name = e.name.removeprefix("aten::")
        if not e.name.startswith("aten::") or name in METADATA:
            continue
        parent = e.cpu_parent
        while parent is not None and not (parent.name.startswith("aten::") and
                                           parent.name.removeprefix("aten::") not in METADATA):
            parent = parent.cpu_parent
        if parent is None:
            found.append(name)
    return found


def _inputs(T: int, docs: bool, dtype: torch.dtype) -> tuple[list[torch.Tensor], torch.Tensor, Documents | None,
                                                             torch.Tensor]:
    """The M7C attention's leaves at T in `dtype` (q, the compressed and sel / win keys and values), random; the
    gates (fp32, as the layer makes them), the documents and an output gradient."""
    gen = torch.Generator().manual_seed(T)
    q = torch.randn(1, T, G * R, D, generator=gen)
    kv = [torch.randn(1, T // SPEC.d if docs else SPEC.num_cmp_blocks(T), G, D, generator=gen) for _ in range(2)]
    kv += [torch.randn(1, T, G, D, generator=gen) for _ in range(4)]
    inputs = [x.to(dtype).requires_grad_() for x in (q, *kv)]
    gates = torch.rand(1, T, G * R, 3, generator=gen, requires_grad=True)
    documents = Documents.of(torch.cumsum(torch.rand(1, T, generator=gen) < 4 / T, 1), SPEC) if docs else None
    return inputs, gates, documents, torch.randn(q.shape, generator=gen).to(dtype)


def attention_step(T: int, docs: bool, score_grad: float = 0.0, explore: int = 0, family: str = "triton",
                   dtype: torch.dtype = torch.bfloat16) -> Callable[[], None]:
    """One forward and backward of the M7C attention through `family` in `dtype`, random inputs."""
    inputs, gates, documents, grad = _inputs(T, docs, dtype)
    op = FAMILIES[family]()
    return lambda: op(*inputs, gates, SPEC, docs=documents, score_grad=score_grad, explore=explore).backward(grad)


def sel_step(T: int, docs: bool) -> Callable[[], None]:
    """One forward and backward of the flex family's sel by the Triton kernels (`triton/family.selected`) in bf16,
    given a random cmp log-sum-exp (what Flex returns)."""
    inputs, gates, documents, grad = _inputs(T, docs, torch.bfloat16)
    lse = torch.randn(1, G * R, T, generator=torch.Generator().manual_seed(T))
    return lambda: selected(*inputs[:5], gates, lse, SPEC, documents, 0)[0].backward(grad)


def launches(T: int, docs: bool, score_grad: float = 0.0, explore: int = 0, sel_only: bool = False
             ) -> tuple[collections.Counter, list[str]]:
    """The Triton launches by kernel and the ATen ops of one forward and backward (`sel_only`: the flex family's
    sel, `sel_step`)."""
    step, ops = sel_step(T, docs) if sel_only else attention_step(T, docs, score_grad, explore), []
    counts = recorded(lambda: ops.extend(aten_ops(step)))
    return counts, ops


def decode_state(context: int, layers: int = 2) -> tuple[Decoder, torch.Tensor]:
    """A decoder of `layers` M7C layers (bf16) whose caches hold `context` random positions
    (`decode_speed.random_fill`), and a token for its next steps."""
    cfg = Model(attention="nsa", dim=768, n_layers=layers, n_heads=12, n_kv_groups=2, head_dim=64, vocab_size=256)
    model = Transformer(cfg, context + 64)
    model.init_weights(0)
    decoder = Decoder(model.to(torch.bfloat16).eval(), context=model.max_seq_len)
    random_fill(decoder, 1, context, torch.bfloat16)
    return decoder, torch.zeros(1, 1, dtype=torch.long)


def decode_launches(decoder: Decoder, token: torch.Tensor, steps: int = 16) -> tuple[collections.Counter, list[str]]:
    """The Triton launches and the ATen ops of the attention (`decode._attention`: a new compressed block where one
    completes, the decode kernel) of `steps` decoding steps through the Triton decode step, recorded: over any d = 16
    steps one block completes."""
    ops, real, kernel = [], decode._attention, decoder.kernel

    def attention(*args: object) -> torch.Tensor:
        out = []
        ops.extend(aten_ops(lambda: out.append(real(*args))))
        return out[0]

    decode._attention, decoder.kernel = attention, "triton"
    try:
        with torch.no_grad():
            counts = recorded(lambda: [decoder.step(token) for _ in range(steps)])
    finally:
        decode._attention, decoder.kernel = real, kernel
    return counts, ops


def host_ms(T: int = 256, repeats: int = 50) -> float:
    """The median host milliseconds of one eager forward and backward, the kernels recorded, one thread: what
    the op's wrappers, dispatch and autograd cost a layer before any GPU work."""
    step, times, threads = attention_step(T, False), [], torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        def timed() -> None:
            for _ in range(repeats):
                start = time.perf_counter()
                step()
                times.append(time.perf_counter() - start)
        recorded(timed)
    finally:
        torch.set_num_threads(threads)
    return 1e3 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--T", type=int, nargs="+", default=[512, 8192, 32768, 65536])
    a = parser.parse_args()
    if triton_nsa.triton is None:
        sys.exit("triton is not installed (pip install -e '.[test]')")
    print(f"M7C attention (B 1, G {G}, r {R}, D {D}, l {SPEC.l}, d {SPEC.d}, l' {SPEC.l_sel}, n {SPEC.n}, w {SPEC.w}), "
          "bf16, forward + backward through the Triton family")
    print("| T | documents | options | Triton launches | ATen ops | in all | the ATen ops |")
    print("|---|---|---|---|---|---|---|")
    for T in a.T:
        for docs in (False, True):
            for label, options in (("paper", {}), ("score grad + explore 8", {"score_grad": 1.0, "explore": 8}),
                                   ("the flex family's sel", {"sel_only": True})):
                if "score_grad" in options and (docs or T > 8192):  # the options' PyTorch gradient: once, moderate T
                    continue
                counts, ops = launches(T, docs, **options)
                kinds = ", ".join(f"{n} {k}" for k, n in collections.Counter(ops).most_common())
                print(f"| {T:,} | {docs} | {label} | {sum(counts.values())} | {len(ops)} | "
                      f"{sum(counts.values()) + len(ops)} | {kinds} |", flush=True)
    print(f"\nHost time of one eager forward and backward at T = 256, the kernels not run: {host_ms():.2f} ms")
    layers, steps = 2, SPEC.d
    counts, ops = decode_launches(*decode_state(8192, layers), steps)
    kinds = ", ".join(f"{n} {k}" for k, n in collections.Counter(ops).most_common())
    print(f"\nDecoding (Triton decode step, {layers} M7C layers, bf16, {steps} steps from 8,192 tokens): "
          f"{dict(counts)}, {len(ops)} ATen ops ({kinds}): {(sum(counts.values()) + len(ops)) / layers / steps:.3f} "
          "launches per layer per step")


if __name__ == "__main__":
    main()
