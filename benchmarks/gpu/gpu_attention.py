"""NSA attention against the fastest dense causal kernel on one GPU: forward, backward and both, side by side.

    python benchmarks/gpu/gpu_attention.py [--T 8192 32768 65536] [--repeats 10] [--docs 1024 4096] [--profile 32768]

At the M7C attention shape (B 1, H 12, G 2, D 64; NSA l 32, d 16, l' 64, n 16, w 512), bf16, the attention
function alone on random inputs (no projections). In one process, at each T:

  nsa            the kernel family `auto` picks on this GPU (the Triton op where Triton is installed)
  nsa-docs-M     the same with packed documents of mean length M (log-normal, as benchmarks/kernels/document_masking.py)
  sdpa-flash     causal scaled_dot_product_attention, flash backend only
  sdpa-cudnn     the same, cuDNN backend only
  flash-attn     flash_attn_func(causal=True), where flash-attn is installed
  flex-docs-M    dense with the documents of nsa-docs-M: FlexAttention's block-causal document mask, the mask
                 built once outside the timing (as torchtitan builds it once a batch)

Each time is the median of `--repeats` after two warm-ups, by CUDA events: forward alone, backward alone
(the forward run untimed before each), and forward + backward. "best dense" is the fastest of the plain
causal dense kernels at that T; the last column is best dense / this (above 1: faster than dense).
`--profile T` prints after the tables torch.profiler's kernels of one NSA forward + backward at T, by GPU time.
Without CUDA it says so and exits 0.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.kernels.attention_speed import build_core  # noqa: E402
from benchmarks.kernels.document_masking import document_ids  # noqa: E402

from nsa_titan.models.attention import Documents, NSASpec, choose_family  # noqa: E402

SPEC = NSASpec(l=32, d=16, l_sel=64, n=16, w=512)
DENSE = ("sdpa-flash", "sdpa-cudnn", "flash-attn")


def timed(fn: Callable[[], None], repeats: int, before: Callable[[], object] | None = None) -> float:
    """Median milliseconds of fn() by CUDA events, after two warm-ups; `before` runs untimed ahead of each."""
    times = []
    for k in range(repeats + 2):
        state = before() if before else None
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn() if state is None else fn(state)
        end.record()
        torch.cuda.synchronize()
        if k >= 2:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def nsa_case(T: int, mean: int | None) -> tuple[list[torch.Tensor], Callable[[], torch.Tensor]]:
    """The NSA attention's leaf inputs at T (bf16, CUDA) and its forward by the family `auto` takes, with
    documents of mean length `mean`."""
    inputs, _ = build_core("fast", T, torch.device("cuda"))
    leaves = [p.detach().to(torch.bfloat16).requires_grad_(True) for p in inputs]
    family = choose_family("auto", torch.device("cuda"), torch.bfloat16, SPEC, 6, 64)
    docs = None if mean is None else Documents.of(document_ids(T, mean), SPEC).to(torch.device("cuda"))
    return leaves, lambda: family(*leaves, SPEC, docs=docs)


def dense_case(kind: str, T: int, mean: int | None) -> tuple[list[torch.Tensor], Callable[[], torch.Tensor]]:
    """A dense kernel's leaf inputs (q, k, v at 12 heads, bf16) and its forward."""
    g = torch.Generator().manual_seed(0)
    leaves = [torch.randn(1, 12, T, 64, generator=g).cuda().to(torch.bfloat16).requires_grad_(True) for _ in range(3)]
    q, k, v = leaves
    if kind == "flash-attn":
        from flash_attn import flash_attn_func

        return leaves, lambda: flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True)
    if kind == "flex-docs":
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        ids = document_ids(T, mean)[0].cuda()
        mask = lambda b, h, qi, ki: (ids[qi] == ids[ki]) & (ki <= qi)  # noqa: E731
        block_mask = create_block_mask(mask, None, None, T, T, device="cuda")
        flex = torch.compile(flex_attention)
        return leaves, lambda: flex(q, k, v, block_mask=block_mask)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"sdpa-flash": SDPBackend.FLASH_ATTENTION, "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION}[kind]

    def forward() -> torch.Tensor:
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    return leaves, forward


def measure(leaves: list[torch.Tensor], forward: Callable[[], torch.Tensor], repeats: int) -> tuple[float, float, float]:
    """(forward, backward, forward + backward) median milliseconds."""
    grad = torch.randn_like(forward())

    def fwd() -> None:
        with torch.no_grad():
            forward()

    def bwd(out: torch.Tensor) -> None:
        torch.autograd.grad(out, leaves, grad)

    def both() -> None:
        torch.autograd.grad(forward(), leaves, grad)

    return timed(fwd, repeats), timed(bwd, repeats, before=forward), timed(both, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--T", type=int, nargs="+", default=[8192, 32768, 65536])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--docs", type=int, nargs="*", default=[1024, 4096], help="mean document lengths")
    parser.add_argument("--profile", type=int, default=0, help="a T to profile NSA's kernels at (0: none)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_attention: no CUDA device: nothing to measure")
        return
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"family {choose_family('auto', torch.device('cuda'), torch.bfloat16, SPEC, 6, 64).name}")
    print("| T | variant | forward (ms) | backward (ms) | fwd+bwd (ms) | best dense / this (fwd, bwd, both) |")
    print("|---|---|---|---|---|---|")
    for T in args.T:
        rows: dict[str, tuple[float, float, float]] = {}
        cases = [(d, lambda d=d: dense_case(d, T, None)) for d in DENSE]
        cases += [("nsa", lambda: nsa_case(T, None))]
        for m in args.docs:
            cases += [(f"nsa-docs-{m}", lambda m=m: nsa_case(T, m)), (f"flex-docs-{m}", lambda m=m: dense_case("flex-docs", T, m))]
        for name, make in cases:
            try:
                rows[name] = measure(*make(), args.repeats)
            except Exception as e:  # noqa: BLE001 - a kernel this GPU or install lacks: say so, go on
                print(f"| {T} | {name} | failed: {type(e).__name__}: {str(e).splitlines()[0][:100]} | | | |", flush=True)
                continue
            torch.cuda.empty_cache()
        best = [min(rows[d][i] for d in DENSE if d in rows) for i in range(3)] if any(d in rows for d in DENSE) else None
        for name, t in rows.items():
            ratio = ", ".join(f"{b / x:.2f}x" for b, x in zip(best, t)) if best else "-"
            print(f"| {T} | {name} | {t[0]:.3f} | {t[1]:.3f} | {t[2]:.3f} | {ratio} |", flush=True)
    if args.profile:
        leaves, forward = nsa_case(args.profile, None)
        grad = torch.randn_like(forward())
        torch.autograd.grad(forward(), leaves, grad)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            torch.autograd.grad(forward(), leaves, grad)
            torch.cuda.synchronize()
        print(f"\nNSA fwd+bwd at T = {args.profile}, kernels by GPU time:")
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=70))


if __name__ == "__main__":
    main()
