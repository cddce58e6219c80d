"""The check and benchmark scripts' contracts that need no GPU: `scripts/gpu_check.sh` on a machine
without CUDA, `benchmarks/kernels/attention_speed.py --profile` and `--interleave`, and
`benchmarks/gpu/triton_work.py`."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, Command, background

pytestmark = pytest.mark.multiprocess

GPU = ROOT / "benchmarks" / "gpu"
TRITON = importlib.util.find_spec("triton") is not None
BACKGROUND = {  # the scripts whose output these tests read, no timing among them (a timing waits for an idle machine)
    "gpu_prediction": Command([sys.executable, str(GPU / "gpu_prediction.py"), "--T", "8192"]),
    **({"triton_work": Command([sys.executable, str(GPU / "triton_work.py"), "--T", "512", "2048"]),
        "decode_prediction": Command([sys.executable, str(GPU / "decode_prediction.py"), "--contexts", "8192", "65536",
                                      "--batch", "1"])} if TRITON else {}),
}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
def test_gpu_check_without_cuda_says_so_exits_0_and_writes_no_report(tmp_path):
    report = tmp_path / "report.md"
    proc = subprocess.run([str(ROOT / "scripts" / "gpu_check.sh"), str(report)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "no CUDA device on this machine" in proc.stdout
    assert not report.exists()


def test_attention_profile_prints_where_the_time_goes():
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "kernels" / "attention_speed.py"), "--profile", "fast-core",
                           "1024"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Self CPU time total" in proc.stdout
    assert "nsa_titan::" in proc.stdout  # NSA's own ops are in the table


def test_attention_interleave_takes_each_ratio_within_a_round():
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "kernels" / "attention_speed.py"), "--T", "512",
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


@pytest.mark.skipif(not TRITON, reason="triton is not installed")
@pytest.mark.background
def test_triton_work_prints_the_launches_of_each_setting():
    """The script's table: the same 6 Triton launches and 4 ATen ops at 512 and 2,048, with and without
    documents; with the off-paper options the PyTorch score gradient's ops come on top."""
    proc = background("triton_work", BACKGROUND)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [[c.strip() for c in line.split("|")[1:7]] for line in proc.stdout.splitlines() if line.startswith("| 5")
            or line.startswith("| 2,048")]
    paper = [r for r in rows if r[2] == "paper"]
    assert len(paper) == 4 and {tuple(r[3:6]) for r in paper} == {("8", "4", "12")}
    options = [r for r in rows if r[2] != "paper"]
    assert options and all(int(r[4]) > 2 for r in options)


@pytest.mark.skipif(not TRITON, reason="triton is not installed")
@pytest.mark.background
def test_decode_prediction_counts_the_compression_and_predicts_each_context():
    """`benchmarks/gpu/decode_prediction.py`: the compression's launches recorded (one of each kernel over d steps, no
    ATen op), and a row per batch and context with the step as built, the next design and dense."""
    proc = background("decode_prediction", BACKGROUND)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "{'_cmp_hidden': 1, '_cmp_out': 1, 'ATen ops': 0}" in proc.stdout
    rows = [line.split("|")[1:-1] for line in proc.stdout.splitlines() if line.startswith("| 1 |")]
    assert [r[1].strip() for r in rows] == ["8,192", "65,536"]
    for r in rows:  # fitted / pessimistic, the next design, dense: positive times
        assert all(float(x) > 0 for x in (*r[2].split("/"), r[3], r[4])), r


@pytest.mark.background
def test_gpu_prediction_calibrates_then_predicts_every_kernel_fitted_and_pessimistic():
    """`benchmarks/gpu/gpu_prediction.py`: the calibration on the H100 profile (each old kernel predicted back in sample
    and left out, the ones it cannot fit named), the new family's kernels (and every fill and cast) at the T asked
    for with both sets of constants, the totals against the measured dense time, and the M7C training step."""
    proc = background("gpu_prediction", BACKGROUND)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "Calibration on the H100 profile at T 32,768" in out
    back = [[c.strip() for c in line.split("|")[1:-1]] for line in out.splitlines()
            if line.startswith("| _") and line.endswith(("yes |", "no |"))]
    assert len(back) == 6 and all(0.7 <= float(row[5]) <= 1.3 for row in back), back  # in sample: all within 30%
    missed = {row[0] for row in back if row[8] == "no"}
    assert all(0.7 <= float(row[7]) <= 1.3 for row in back if row[0] not in missed)  # left out
    assert missed <= {"_sel_bwd_dkv", "_bwd_dkv (cmp + win)"}, missed
    assert "Left out, two cannot be fitted: _sel_bwd_dkv is the only kernel bound by its longest program" in out
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in out.splitlines() if line.startswith("| 8,192 | ")]
    kernels = {r[1]: r for r in rows if len(r) == 10 and not r[1][0].isdigit()}
    assert set(kernels) == {"_fwd_cmp", "_fwd_win", "_fwd_sel", "_fwd_mix", "_bwd_q", "_bwd_q: sel's dQ rows",
                            "_bwd_sel_kv", "_bwd_kv (cmp)", "_bwd_kv (win)", "fills, cumsum, casts"}
    assert all(float(r[9]) >= float(r[8]) > 0 for r in kernels.values())  # pessimistic >= fitted, each kernel
    assert float(kernels["_bwd_sel_kv"][7].replace(",", "")) > 0  # its key gradients' atomic adds
    (total,) = [r for r in rows if len(r) == 8]
    assert float(total[2]) >= float(total[1]) > 0 and total[7] in ("yes / yes", "yes / no", "no / yes", "no / no")
    training = [r for r in rows if len(r) == 7 and "x /" in r[4]]
    assert [r[1] for r in training] == ["1,024", "4,096"]  # against Flex with documents of both mean lengths
    # the flex family: Flex's block costs fitted on the H100's Flex runs (each predicted back within 10%), then its
    # cmp, win, top-n pass, sel and gated sum, its total fitted / pessimistic beside the Triton family's
    flex_fit = [r for r in rows if len(r) == 7 and "x /" not in r[4]]
    assert [r[1] for r in flex_fit] == ["1,024", "4,096"] and all(0.9 <= float(r[6]) <= 1.1 for r in flex_fit)
    (flex,) = [r for r in rows if len(r) == 10 and r[1][0].isdigit()]
    assert all(float(x) > 0 for x in flex[1:6])
    flex_fitted, flex_pessimistic = (float(x) for x in flex[6].split("/"))
    assert flex_pessimistic >= flex_fitted == pytest.approx(sum(float(x) for x in flex[1:6]), rel=0.1)
    assert flex[7] == f"{float(total[1]):.2f} / {float(total[2]):.2f}"  # the Triton family's, beside it

def test_line_chart_draws_each_series_its_band_and_marks(tmp_path):
    """matplotlib's chart of two series (one with a band) and a mark: an 820 x 500 PNG holding both lines'
    colours, the band's lighter shade of the first, and nothing drawn by pyplot's global state."""
    import numpy as np
    from matplotlib import colors
    from PIL import Image

    from nsa_titan.observe.plots import line_chart

    a, b = {1: 0.1, 2: 0.5, 4: 0.9}, {1: 0.2, 2: 0.3, 4: 0.4}
    band = ({x: y - 0.1 for x, y in a.items()}, {x: y + 0.1 for x, y in a.items()})
    line_chart({"a": a, "b": b}, tmp_path / "c.png", "t", "x", "y", (0.0, 1.0), {"w": 2}, {"a": band})
    image = np.asarray(Image.open(tmp_path / "c.png").convert("RGB")).astype(int)
    assert image.shape == (500, 820, 3)

    def pixels(color: str, tolerance: int = 8) -> int:
        rgb = np.array(colors.to_rgb(color)) * 255
        return int((np.abs(image - rgb).max(-1) <= tolerance).sum())

    assert pixels("C0") > 500 and pixels("C1") > 500  # the two lines (and their markers)
    shade = 255 - 0.2 * (255 - np.array(colors.to_rgb("C0")) * 255)  # C0 at alpha 0.2 over white
    assert int((np.abs(image - shade).max(-1) <= 8).sum()) > 5000  # the band
    import matplotlib.pyplot as plt

    assert plt.get_fignums() == []
