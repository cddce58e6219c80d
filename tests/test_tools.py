"""The check and benchmark scripts' contracts that need no GPU: `scripts/gpu_check.sh` on a machine
without CUDA, `benchmarks/attention_speed.py --profile` and `--interleave`, and
`benchmarks/triton_work.py`."""

from __future__ import annotations

import importlib.util
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


def test_attention_interleave_takes_each_ratio_within_a_round():
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "attention_speed.py"), "--T", "512",
                           "--repeats", "3", "--interleave", "--variants", "fast-core", "dense-core", "reference-core",
                           "--reference_max_T", "256", "--allocators", "tuned"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {line.split("|")[3].strip(): [c.strip() for c in line.split("|")[4:7]]
            for line in proc.stdout.splitlines() if line.startswith("| 512 | tuned |")}
    assert rows["reference-core"][0] == "skipped (above --reference-core_max_T)"
    assert rows["fast-core"][1] == "1.00x (1.00-1.00)"  # the first variant against itself, round by round
    seconds, ratio, memory = rows["dense-core"]
    low, high = (float(x) for x in ratio.split("(")[1].rstrip(")").split("-"))
    assert float(seconds) > 0 and 0 < low <= float(ratio.split("x")[0]) <= high and memory == "-"


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_triton_work_counts_the_launches_the_wrappers_make():
    """The Triton kernels' longest programs, counted from their recorded launches at the M7C shape:
    the dK, dV kernels walk a block every query reads in 32 queries a step, not 4 (r = 6 heads as
    rows), and the sel forward's tiles load fewer blocks than query by query; a forward and backward
    makes 10 launches (cmp, its choice of sel blocks, sel and win, then 2 for each backward) and
    fewer ATen ops with the choice in one launch than in PyTorch."""
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "triton_work.py"), "--T", "2048"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    cells = [[c.strip() for c in line.split("|")[2:8]] for line in proc.stdout.splitlines() if line.startswith("| 2,048 |")]
    rows = {c[0]: c[1:] for c in cells if not c[0].isdigit()}
    (launches, before, now, _), = [c[:4] for c in cells if c[0].isdigit()]
    assert int(launches) == 10 and int(now) < int(before)
    assert "Host time of one eager forward and backward at T = 256" in proc.stdout
    assert rows.keys() == {"sel forward, dQ", "sel dK, dV", "cmp dK, dV"}
    steps = lambda x: int(x.split()[0].replace(",", ""))  # noqa: E731
    assert steps(rows["sel dK, dV"][1]) == 2048 // 4 and steps(rows["sel dK, dV"][3]) == 2048 // 32
    assert steps(rows["cmp dK, dV"][1]) == -(-(2048 - 31) // 4) and steps(rows["cmp dK, dV"][3]) <= (2048 - 31) // 32 + 1
    before, now = (int(x.replace(",", "")) for x in rows["sel forward, dQ"][4].split(" (")[0].split(" / "))
    assert now < before
