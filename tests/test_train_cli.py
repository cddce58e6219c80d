"""End-to-end: run_train.sh on the default config, its console line and TensorBoard output."""

from __future__ import annotations

import pytest

import os
import re
import subprocess

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from conftest import ROOT, tb_run
from nsa_titan.system import hostcpu

pytestmark = pytest.mark.multiprocess

LINE = re.compile(
    r"step +(\d+)/(\d+) \| loss +([\d.]+) \| grad_norm +([\d.]+) \| lr ([\d.e+-]+) \| tok/s ([\d,]+) "
    r"\| data ([\d.]+)% \| mem ([\d.]+)GiB \| eta (\d+:\d\d:\d\d)"
)


def test_run_train_sh_two_ranks_logs_one_line_per_step_and_tensorboard(tmp_path):
    """The default config (embedded corpus, sentencepiece, loader worker, validation) on 2 ranks."""
    dump = tmp_path / "out"
    proc = subprocess.run(
        [str(ROOT / "run_train.sh"), "--training.steps", "6", "--metrics.log_freq", "2",
         "--training.seq_len", "64", "--job.dump_folder", str(dump)],
        cwd=tmp_path, env={**os.environ, "NGPU": "2"}, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [m for m in map(LINE.search, proc.stdout.splitlines()) if m]
    assert [int(m.group(1)) for m in lines] == [1, 2, 4, 6]  # step 1, every log_freq, the last
    assert all(int(m.group(2)) == 6 for m in lines)
    assert float(lines[-1].group(3)) < float(lines[0].group(3))
    assert "FSDP mesh {'dp_shard': 2}" in proc.stdout
    # The startup log names the kernel that runs each branch (on a CPU: NSA's C++ kernel).
    assert "model: NSA attention, cpp family (NSA's C++ kernels)" in proc.stdout
    # The launcher gives CPU ranks the glibc malloc settings that stop large-block mmap churn.
    assert "host allocator: glibc malloc, MALLOC_MMAP_THRESHOLD_=17179869184" in proc.stdout
    assert f"host CPU: {hostcpu.vector_isa()}, " in proc.stdout  # and no bf16 warning: the config trains in fp32
    assert "mixed_precision_param = 'bfloat16' on a CPU" not in proc.stdout
    assert re.search(r"validation at step 6: loss [\d.]+ \| perplexity [\d.]+ \| 8 batches", proc.stdout)
    assert (dump / "config.toml").read_text().count("steps = 6") == 1
    events = EventAccumulator(tb_run(dump / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "train/grad_norm", "train/lr", "train/tokens_per_s", "train/memory_gib", "train/data_wait",
            "validation/loss", "validation/perplexity"} <= tags
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 4, 6]


def test_launcher_reads_its_shutdown_timeout_itself(monkeypatch):
    """torchrun has `--shutdown-timeout` only from torch 2.12 on (2.11's rejects it, as on the first
    GPU machine): the launcher takes it off the options it hands torchrun, and the trainer's own
    options pass through untouched."""
    from nsa_titan import launch

    torchrun_parse = launch.parse_args

    def older_torchrun(argv):
        assert not any(a.startswith("--shutdown") for a in argv), "torchrun < 2.12 would reject this"
        return torchrun_parse(argv)

    monkeypatch.setattr(launch, "parse_args", older_torchrun)
    args = launch.parse_launcher_args(["--nproc_per_node", "2", "--shutdown-timeout", "7", "--standalone", "-m",
                                       "nsa_titan.train", "--training.steps", "3", "--job.description", "x"])
    assert args.shutdown_timeout == 7 and str(args.nproc_per_node) == "2" and args.standalone
    assert args.module and args.training_script == "nsa_titan.train"
    assert args.training_script_args == ["--training.steps", "3", "--job.description", "x"]
    assert launch.parse_launcher_args(["--standalone", "-m", "nsa_titan.train"]).shutdown_timeout == 120
