"""The check and benchmark scripts' contracts that need no GPU: `scripts/gpu_check.sh` on a machine
without CUDA, and `benchmarks/attention_speed.py --profile`."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from conftest import ROOT

pytestmark = pytest.mark.multiprocess


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
def test_gpu_check_without_cuda_says_so_exits_0_and_writes_no_report(tmp_path):
    report = tmp_path / "report.md"
    proc = subprocess.run([str(ROOT / "scripts" / "gpu_check.sh"), str(report)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "no CUDA device on this machine" in proc.stdout
    assert not report.exists()


def test_attention_profile_prints_where_the_time_goes():
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "attention_speed.py"), "--profile", "fast-core",
                           "1024"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Self CPU time total" in proc.stdout
    assert "nsa_titan::" in proc.stdout  # NSA's own ops are in the table
