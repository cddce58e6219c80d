"""What the host CPU offers that changes how fast a CPU run is: its vector instruction set (NSA's
C++ kernel is built for it) and whether it computes in bfloat16 natively.

Without native bfloat16 (AVX512_BF16 or AMX), bf16 matrix products are emulated: on a 2-core AVX2
EPYC the recall model trained at 1,029 tok/s in bf16 against 11,807 in fp32 (benchmarks/README.md,
"CPUs without AVX-512")."""

from __future__ import annotations

import functools
import platform
from pathlib import Path

import torch


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    try:
        line = next(x for x in Path("/proc/cpuinfo").read_text().splitlines() if x.startswith(("flags", "Features")))
    except (OSError, StopIteration):
        return frozenset()
    return frozenset(line.split(":", 1)[1].split())


def vector_isa() -> str:
    """The widest x86 vector instruction set NSA's C++ kernel is built for here, in words."""
    flags = cpu_flags()
    if "avx512f" in flags:
        return "AVX-512"
    return "AVX2" if "avx2" in flags else f"{platform.machine() or 'unknown'} without AVX2"


def native_bf16() -> bool:
    """Whether the CPU multiplies bfloat16 matrices in hardware (AVX512_BF16 or AMX)."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


def describe() -> str:
    """The host CPU in a few words, for the startup log of CPU runs."""
    return f"{vector_isa()}, {'native' if native_bf16() else 'no native'} bfloat16, {torch.get_num_threads()} threads"


def bf16_warning(device: torch.device, param_dtype: torch.dtype) -> str | None:
    """A warning when a CPU run computes in bfloat16 without hardware for it, or None."""
    if device.type != "cpu" or param_dtype != torch.bfloat16 or native_bf16():
        return None
    return ("[training] mixed_precision_param = 'bfloat16' on a CPU without native bfloat16 (no AVX512_BF16 or "
            "AMX): its matrix products are emulated, about 10x slower than float32 here; set "
            "--training.mixed_precision_param float32 for CPU runs")
