"""NSA attention speed and memory: fast vs reference vs dense SDPA vs the public peer, side by side.

    python benchmarks/kernels/attention_speed.py [--T 2048 8192 32768] [--repeats 3] [--interleave] [--reference_max_T 4096]
                                         [--peer_max_T 8192] [--allocators default tuned]
    python benchmarks/kernels/attention_speed.py --profile fast-core 32768

At the M7C attention shape (dim 768, 12 query heads, 2 KV groups, head dim 64; NSA l=32, d=16,
l'=64, n=16, w=512), batch 1, fp32 on CPU (bf16 on a GPU), forward + backward of one attention
layer *module* on x (1, T, 768), projections included:

  fast       nsa_titan NSAAttention, attn_impl = "fast"
  reference  nsa_titan NSAAttention, attn_impl = "reference" (dense masks: skipped above --reference_max_T)
  dense      nsa_titan DenseAttention (causal scaled_dot_product_attention, same heads)
  peer       native_sparse_attention_pytorch.SparseAttention at the same configuration (if installed:
             `pip install native-sparse-attention-pytorch`)
  fast-core, reference-core, dense-core, flash-core
             the attention function alone (the kernel family `auto` takes / nsa_reference / causal SDPA / flash-attn's
             causal attention, GPUs only) on random q, k, v, compressed blocks and gates of those
             shapes: no projections
  fast-torch-core
             nsa_fast with every branch in PyTorch (`kernels = "torch"`: on CPUs the PyTorch sel
             tiles and win chunks instead of NSA's C++ kernels, on GPUs instead of the Triton kernels)
  fast-own-core
             nsa_fast with NSA's C++ kernels (CPUs) and their own backward for cmp however many
             compressed keys (`fast-core` leaves runs of `cpu_attention.FUSED_BACKWARD_KEYS` keys or more
             to ATen's fused attention)

`--profile VARIANT T` prints instead torch.profiler's table of one forward + backward (the ops by their own
device time on a GPU, CPU time on CPUs), under the launcher's allocator settings (`tuned`; glibc's own with
`--allocators default`): where the time goes.

Each (variant, T, allocator) runs in its own process: the median time of `--repeats` runs after
one warm-up, and the peak resident memory it added. `--interleave` runs all variants in one process
instead, a pass of each in turn for `--repeats` rounds, and takes each ratio to the first variant within
a round (their median and range; no peak memory then): on a box whose speed wanders over minutes, a
ratio of variants timed minutes apart measures the box as much as the code. Allocators (host memory, CPU
runs): `default`, glibc malloc as it comes; `tuned`, the settings the launcher gives CPU ranks
(`nsa_titan.system.env.MALLOC_TUNING`). Both are measured side by side by default. Also prints the algorithmic
limit: the keys a query attends to, dense causal vs NSA, averaged over the sequence and at its last query.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from nsa_titan.config import Model  # noqa: E402
from nsa_titan.system.env import allocator_env  # noqa: E402
from nsa_titan.models.attention import Kernels, NSASpec, dense_causal, nsa_fast, nsa_reference  # noqa: E402
from nsa_titan.models.attention.families.cpp import cpu_attention  # noqa: E402
from nsa_titan.models.attention.families.choose import Auto  # noqa: E402
from nsa_titan.models.rope import rope_tables  # noqa: E402
from nsa_titan.models.transformer import DenseAttention, NSAAttention  # noqa: E402

M7C = dict(dim=768, n_heads=12, n_kv_groups=2, head_dim=64, cmp_block_size=32, cmp_stride=16, sel_block_size=64,
           sel_top_n=16, window_size=512)


VARIANTS = ("fast", "reference", "dense", "peer", "fast-core", "reference-core", "dense-core", "flash-core",
            "fast-torch-core", "fast-own-core")


def build_core(impl: str, T: int, device: torch.device) -> tuple[torch.nn.Module, object]:
    """The attention function alone on random q, k, v (and cmp blocks, gates), no projections."""
    spec = NSASpec(l=32, d=16, l_sel=64, n=16, w=512)
    g = torch.Generator().manual_seed(0)
    heads = lambda n: torch.randn(1, T, n, 64, generator=g)  # noqa: E731
    if impl in ("dense", "flash"):
        shapes = [heads(12), heads(2), heads(2)]
    else:
        blocks = lambda: torch.randn(1, spec.num_cmp_blocks(T), 2, 64, generator=g)  # noqa: E731
        shapes = [heads(12), blocks(), blocks(), heads(2), heads(2), heads(2), heads(2),
                  torch.rand(1, T, 12, 3, generator=g)]
    inputs = torch.nn.ParameterList(shapes).to(device)
    if impl == "dense":
        return inputs, lambda x: dense_causal(*inputs)
    if impl == "flash":  # flash-attn's causal attention (GPUs, bf16 / fp16)
        from flash_attn import flash_attn_func

        return inputs, lambda x: flash_attn_func(*inputs, causal=True)
    if impl == "fast-torch":  # every branch in PyTorch (on GPUs: the block-centric sel tiles, no Triton)
        return inputs, lambda x: nsa_fast(*inputs, spec, kernels=Kernels())
    if impl == "fast-own":  # the C++ kernel's own backward for cmp however long its runs
        cpu_attention.FUSED_BACKWARD_KEYS = (1 << 30, 1 << 30)
        return inputs, lambda x: nsa_fast(*inputs, spec, kernels=Kernels("cpp", "cpp", "cpp"))
    return inputs, lambda x: {"fast": Auto(), "reference": nsa_reference}[impl](*inputs, spec)


def build(variant: str, T: int, device: torch.device) -> tuple[torch.nn.Module, object]:
    if variant.endswith("-core"):
        return build_core(variant.removesuffix("-core"), T, device)
    if variant == "peer":
        from native_sparse_attention_pytorch import SparseAttention

        module = SparseAttention(dim=768, dim_head=64, heads=12, kv_heads=2, sliding_window_size=512,
                                 compress_block_size=32, compress_block_sliding_stride=16, selection_block_size=64,
                                 num_selected_blocks=16, causal=True)
        return module.to(device), lambda x: module(x)
    cfg = Model(**M7C, attention="dense" if variant == "dense" else "nsa",
                attn_impl="fast" if variant == "fast" else "reference")
    module = (DenseAttention(cfg) if variant == "dense" else NSAAttention(cfg)).to(device)
    for p in module.parameters():
        torch.nn.init.normal_(p, std=0.02)
    rope = rope_tables(Model(head_dim=64), T, device)
    return module, lambda x: module(x, rope)


def step_of(variant: str, T: int) -> tuple[Callable[[], None], torch.device]:
    """One forward + backward of `variant` at T (bf16 on a GPU, fp32 on CPUs), waiting for the device."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    module, fn = build(variant, T, device)
    module.to(dtype)
    x = torch.randn(1, T, 768, device=device, dtype=dtype, requires_grad=True)

    def step() -> None:
        fn(x).float().square().mean().backward()
        if device.type == "cuda":
            torch.cuda.synchronize()

    return step, device


def measure_one(variant: str, T: int, repeats: int) -> dict:
    """In this process: warm up once, then time `repeats` forward+backward passes."""
    step, device = step_of(variant, T)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for k in range(repeats + 1):
        start = time.perf_counter()
        step()
        if k:  # the first run warms up
            times.append(time.perf_counter() - start)
    peak = (torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda"
            else (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 2**20)
    return {"seconds": statistics.median(times), "peak_gib": peak, "device": device.type}


def measure_interleaved(variants: list[str], T: int, repeats: int) -> dict[str, list[float]]:
    """In this process: each variant warmed up once, then `repeats` rounds of one forward+backward of each in turn
    -> the seconds of each variant's passes, round by round."""
    steps = {}
    for variant in variants:
        steps[variant] = step_of(variant, T)[0]
        steps[variant]()
    times: dict[str, list[float]] = {v: [] for v in variants}
    for _ in range(repeats):
        for variant, step in steps.items():
            start = time.perf_counter()
            step()
            times[variant].append(time.perf_counter() - start)
    return times


def max_T(variant: str, args: argparse.Namespace) -> float:
    """The longest sequence `variant` runs at (the reference's dense masks and the peer: their flags)."""
    limits = {"reference": args.reference_max_T, "reference-core": args.reference_max_T, "peer": args.peer_max_T}
    return limits.get(variant, math.inf)


def failure(proc: subprocess.CompletedProcess) -> str:
    """Why a measuring child failed: its last line of stderr, or how it was killed."""
    return (proc.stderr.strip().splitlines() or [f"killed (exit {proc.returncode}; out of memory?)"])[-1]


def interleaved_rows(T: int, allocator: str, args: argparse.Namespace) -> None:
    """The `--interleave` table rows of T: medians, and the ratios to the first variant round by round."""
    variants = [v for v in args.variants if T <= max_T(v, args)]
    for variant in sorted(set(args.variants) - set(variants)):
        print(f"| {T} | {allocator} | {variant} | skipped (above --{variant}_max_T) | | |", flush=True)
    proc = subprocess.run([sys.executable, __file__, "--interleaved", str(T), str(args.repeats), *variants],
                          capture_output=True, text=True, env=allocator_env(allocator))
    if proc.returncode != 0:
        print(f"| {T} | {allocator} | {' / '.join(variants)} | failed: {failure(proc)[:80]} | | |", flush=True)
        return
    times = json.loads(proc.stdout.strip().splitlines()[-1])
    first = times[variants[0]]
    for variant in variants:
        ratios = sorted(b / a for a, b in zip(first, times[variant]))
        print(f"| {T} | {allocator} | {variant} | {statistics.median(times[variant]):.4g} | "
              f"{statistics.median(ratios):.2f}x ({ratios[0]:.2f}-{ratios[-1]:.2f}) | - |", flush=True)


def profile_one(variant: str, T: int, rows: int = 20) -> str:
    """torch.profiler's table of one forward + backward after a warm-up, by the ops' own device time
    (CPU time on CPUs): where the time goes."""
    step, device = step_of(variant, T)
    step()
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        step()
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=sort, row_limit=rows)


def keys_per_query(T: int) -> tuple[float, float, float, float]:
    """(dense mean, NSA mean, dense at the last query, NSA at the last query)."""
    spec = NSASpec(l=32, d=16, l_sel=64, n=16, w=512)
    nsa_last = spec.num_cmp_blocks(T) + min(spec.n, spec.num_sel_blocks(T)) * spec.l_sel + min(T, spec.w)
    return (T + 1) / 2, spec.mean_keys_per_query(T), float(T), float(nsa_last)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--T", type=int, nargs="+", default=[2048, 8192, 32768])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--reference_max_T", type=int, default=4096)
    parser.add_argument("--peer_max_T", type=int, default=8192, help="the peer runs out of memory above (24 GiB)")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=["fast", "reference", "dense", "peer"])
    parser.add_argument("--allocators", nargs="+", choices=["default", "tuned"], default=["default", "tuned"])
    parser.add_argument("--interleave", action="store_true",
                        help="all variants in one process, a pass of each in turn, `--repeats` rounds: the ratios taken "
                             "round by round (median and range); no peak memory")
    parser.add_argument("--one", nargs=3, metavar=("VARIANT", "T", "REPEATS"), help=argparse.SUPPRESS)
    parser.add_argument("--interleaved", nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("--profile", nargs=2, metavar=("VARIANT", "T"),
                        help="instead of timing: the profiler's table of one forward + backward of VARIANT at T, under "
                             "the launcher's allocator settings (glibc's own with --allocators default)")
    parser.add_argument("--profile_one", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.profile_one:
        print(profile_one(args.profile_one[0], int(args.profile_one[1])))
        return
    if args.profile:  # in its own process, for the allocator's settings to apply
        allocator = "tuned" if "tuned" in args.allocators else "default"
        print(f"allocator: {allocator}", flush=True)
        sys.exit(subprocess.run([sys.executable, __file__, "--profile_one", *args.profile],
                                env=allocator_env(allocator)).returncode)
    if args.one:
        print(json.dumps(measure_one(args.one[0], int(args.one[1]), int(args.one[2]))))
        return
    if args.interleaved:
        T, repeats, *variants = args.interleaved
        print(json.dumps(measure_interleaved(variants, int(T), int(repeats))))
        return
    if importlib.util.find_spec("native_sparse_attention_pytorch") is None:
        args.variants = [v for v in args.variants if v != "peer"]
        print("peer not installed (pip install native-sparse-attention-pytorch): skipped")
    print("| T | keys/query dense (mean, last) | keys/query NSA (mean, last) | dense/NSA keys (mean) |")
    print("|---|---|---|---|")
    for T in args.T:
        dm, nm, dl, nl = keys_per_query(T)
        print(f"| {T} | {dm:,.0f}, {dl:,.0f} | {nm:,.0f}, {nl:,.0f} | {dm / nm:.2f}x |")
    print()
    print(f"| T | allocator | variant | fwd+bwd median (s) | vs {args.variants[0]} | peak memory added (GiB) |")
    print("|---|---|---|---|---|---|")
    for T in args.T:
        for allocator in args.allocators:
            if args.interleave:
                interleaved_rows(T, allocator, args)
                continue
            env = allocator_env(allocator)
            results = {}
            for variant in args.variants:
                if T > max_T(variant, args):
                    print(f"| {T} | {allocator} | {variant} | skipped (above --{variant}_max_T) | | |", flush=True)
                    continue
                proc = subprocess.run([sys.executable, __file__, "--one", variant, str(T), str(args.repeats)],
                                      capture_output=True, text=True, env=env)
                if variant == "flash-core" and "No module named 'flash_attn'" in proc.stderr:
                    print(f"| {T} | {allocator} | {variant} | skipped (flash-attn is not installed) | | |", flush=True)
                    continue
                if proc.returncode != 0:
                    print(f"| {T} | {allocator} | {variant} | failed: {failure(proc)[:80]} | | |", flush=True)
                    continue
                r = results[variant] = json.loads(proc.stdout.strip().splitlines()[-1])
                ratio = r["seconds"] / next(iter(results.values()))["seconds"]
                print(f"| {T} | {allocator} | {variant} | {r['seconds']:.4g} | {ratio:.2f}x | {r['peak_gib']:.2f} |",
                      flush=True)


if __name__ == "__main__":
    main()
