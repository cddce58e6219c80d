"""Two "nodes" on one machine: two run_train.sh launches joined by a c10d rendezvous on loopback."""

from __future__ import annotations

import pytest

import os
import subprocess

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from conftest import ROOT, TINY, free_port, tb_run

pytestmark = pytest.mark.multiprocess

STEPS = ["--training.steps", "6", "--metrics.enable_tensorboard", "true"]


def tb_losses(folder) -> list[float]:
    events = EventAccumulator(tb_run(folder))
    events.Reload()
    return [e.value for e in events.Scalars("train/loss")]


def test_two_node_hsdp_over_loopback_matches_one_node_fsdp(tmp_path):
    port = free_port()
    nodes = []
    for node in (0, 1):
        env = {**os.environ, "NGPU": "1", "NNODES": "2", "NODE_RANK": str(node), "RDZV_ID": f"test{port}",
               "RDZV_ENDPOINT": f"127.0.0.1:{port}", "OMP_NUM_THREADS": "1"}
        nodes.append(subprocess.Popen(
            [str(ROOT / "run_train.sh"), *TINY, *STEPS, "--job.dump_folder", str(tmp_path / "hsdp"),
             "--parallelism.data_parallel_replicate_degree", "2"],
            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = [p.communicate(timeout=300)[0] for p in nodes]
    assert all(p.returncode == 0 for p in nodes), outs[0][-3000:] + outs[1][-3000:]
    log = "".join(outs)
    assert "FSDP mesh {'dp_replicate': 2, 'dp_shard': 1}" in log
    one_node = subprocess.run([str(ROOT / "run_train.sh"), *TINY, *STEPS, "--job.dump_folder", str(tmp_path / "fsdp")],
                              cwd=tmp_path, env={**os.environ, "NGPU": "2"}, capture_output=True, text=True, timeout=300)
    assert one_node.returncode == 0, one_node.stderr[-3000:]
    hsdp, fsdp = tb_losses(tmp_path / "hsdp" / "tb"), tb_losses(tmp_path / "fsdp" / "tb")
    assert len(hsdp) == len(fsdp) == 6
    for a, b in zip(hsdp, fsdp):
        assert abs(a - b) <= 1e-5 * abs(b), (hsdp, fsdp)
