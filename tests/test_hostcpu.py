"""The host CPU as the startup log names it, and the warning for bfloat16 on CPUs without it."""

from __future__ import annotations

import platform
from pathlib import Path

import pytest
import torch

from nsa_titan.system import hostcpu

CPU = torch.device("cpu")


@pytest.mark.parametrize("flags, isa, bf16", [
    ({"fma", "avx2"}, "AVX2", False),
    ({"avx2", "avx512f"}, "AVX-512", False),
    ({"avx2", "avx512f", "avx512_bf16"}, "AVX-512", True),
    ({"avx2", "avx512f", "amx_bf16"}, "AVX-512", True),
])
def test_the_instruction_set_and_native_bf16_come_from_the_cpu_flags(monkeypatch, flags, isa, bf16):
    monkeypatch.setattr(hostcpu, "cpu_flags", lambda: frozenset(flags))
    assert hostcpu.vector_isa() == isa
    assert hostcpu.native_bf16() is bf16
    assert hostcpu.describe().startswith(f"{isa}, {'native' if bf16 else 'no native'} bfloat16, ")
    warning = hostcpu.bf16_warning(CPU, torch.bfloat16)
    assert (warning is None) is bf16
    if warning:
        assert "--training.mixed_precision_param float32" in warning
    assert hostcpu.bf16_warning(CPU, torch.float32) is None
    assert hostcpu.bf16_warning(torch.device("meta"), torch.bfloat16) is None  # accelerators: not a CPU's business


@pytest.mark.skipif(not Path("/proc/cpuinfo").exists(), reason="no /proc/cpuinfo")
def test_this_machines_flags_are_read():
    flags = hostcpu.cpu_flags()
    assert flags
    if platform.machine() == "x86_64":  # every x86-64 box CI has had offers AVX2
        assert "avx2" in flags and hostcpu.vector_isa() in ("AVX2", "AVX-512")
