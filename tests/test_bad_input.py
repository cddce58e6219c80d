"""Bad input to every entry point (train, evaluate, generate, plan, export): exit code 2, one line on
stderr naming the problem, no traceback, and nothing that existed before is changed."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from conftest import ROOT, Command, background_folder, finished, tree_digest

pytestmark = [pytest.mark.multiprocess, pytest.mark.background]

TINY_RUN = ["--model.dim", "64", "--model.n_layers", "2", "--model.n_heads", "4", "--model.head_dim", "16",
            "--training.seq_len", "64", "--training.local_batch_size", "2", "--training.steps", "2",
            "--validation.enable", "false", "--data.num_workers", "0"]


BACKGROUND = {"bad-input-run": Command([str(ROOT / "run_train.sh"), *TINY_RUN, "--job.dump_folder",
                                         str(background_folder("bad-input") / "run"), "--checkpoint.export_at_end",
                                         "true"], {"NGPU": "1", "OMP_NUM_THREADS": "1"}, background_folder("bad-input"),
                                        sessions=True)}


@pytest.fixture(scope="module")
def world() -> Path:
    """A trained run (step-2 checkpoint, an export) and its copy, a broken checkpoint copy, a file and a junk .pt
    file."""
    finished("bad-input-run", BACKGROUND)
    base = background_folder("bad-input")
    broken = base / "broken" / "step-2"
    broken.mkdir(parents=True)
    for f in (base / "run" / "checkpoint" / "step-2").iterdir():
        if f.name != ".complete":
            (broken / f.name).write_bytes(f.read_bytes())
    shutil.copytree(base / "run", base / "run-copy")  # a second run folder: two bad training commands at a time
    (base / "a_file").write_text("not a folder\n")
    (base / "junk.pt").write_bytes(b"not a state dict")
    (base / "other.toml").write_text((ROOT / "train_configs" / "debug_model.toml").read_text())
    return base


def cases(w: Path) -> dict[str, list[tuple[list[str], str]]]:
    """Per entry point: (command, a phrase its one line must contain)."""
    step, cfg = str(w / "run" / "checkpoint" / "step-2"), str(w / "run" / "config.toml")
    train = [str(ROOT / "run_train.sh"), *TINY_RUN, "--job.dump_folder", str(w / "run")]
    py = [sys.executable, "-m"]
    return {
        "train": [
            ([*train, "--training.stepz", "3"], "unknown key 'stepz' in [training]"),
            ([*train, "--model.n_heads", "6", "--model.n_kv_groups", "4"], "n_heads = 6 is not divisible"),
            ([*train, "--job.dump_folder", str(w / "a_file")], "is a file, not a folder"),
            ([*train, "--job.dump_folder", str(w / "a_file" / "sub")], "cannot be created or written"),
            ([*train, "--config", str(w / "missing.toml")], "missing.toml"),
            ([*train, "--data.path", str(w / "no_data")], "data error"),
            ([*train, "--data.tokenizer_path", str(w / "no.model")], "no.model"),
            ([*train, "--checkpoint.load_step", "7"], "load_step = 7"),
            ([*train, "--model.dim", "128", "--model.head_dim", "32"], "does not fit this model"),
            ([*train, "--model.kernels", "flash"], "kernels = 'flash' cannot run: flash-attn"),
        ],
        "evaluate": [
            ([*py, "nsa_titan.evaluate", str(w / "nowhere")], "not found"),
            ([*py, "nsa_titan.evaluate", step, "--batches", "-1"], "--batches must be >= 0"),
            ([*py, "nsa_titan.evaluate", step, "--split", "nope"], "nope"),
            ([*py, "nsa_titan.evaluate", step, "--model.dim", "128"], "does not fit"),
            ([*py, "nsa_titan.evaluate", str(w / "broken" / "step-2"), "--config", cfg], "no .complete manifest"),
            ([*py, "nsa_titan.evaluate", step, "--config", str(w / "missing.toml")], "missing.toml"),
        ],
        "generate": [
            ([*py, "nsa_titan.generate", str(w / "nowhere")], "not found"),
            ([*py, "nsa_titan.generate", step, "--top_p", "2"], "--top_p must lie in (0, 1]"),
            ([*py, "nsa_titan.generate", step, "--temperature", "warm"], "invalid float value"),
            ([*py, "nsa_titan.generate", step, "--config", str(w / "other.toml")], "does not fit"),
            ([*py, "nsa_titan.generate", str(w / "junk.pt"), "--config", cfg], "is not a torch.save state dict"),
        ],
        "plan": [
            ([*py, "nsa_titan.plan"], "--world_size"),
            ([*py, "nsa_titan.plan", "--world_size", "0"], "--world_size must be >= 1"),
            ([*py, "nsa_titan.plan", "--world_size", "3", "--parallelism.data_parallel_shard_degree", "2"],
             "but the world size is 3"),
            ([*py, "nsa_titan.plan", "--world_size", "2", "--training.stepz", "1"], "unknown key 'stepz'"),
            ([*py, "nsa_titan.plan", "--world_size", "2", "--config", str(w / "missing.toml")], "missing.toml"),
            ([*py, "nsa_titan.plan", "--world_size", "2", "--mfu", "2"], "--mfu must lie in (0, 1]"),
        ],
        "export": [
            ([*py, "nsa_titan.export", str(w / "nowhere"), "--output", str(w / "x.pt")], "no such checkpoint folder"),
            ([*py, "nsa_titan.export", str(w / "broken" / "step-2"), "--output", str(w / "x.pt")], "no .complete"),
            ([*py, "nsa_titan.export", step, "--output", str(w / "x.pt"), "--dtype", "int8"], "invalid choice"),
            ([*py, "nsa_titan.export", step, "--output", str(w / "run")], "is a folder"),
            ([*py, "nsa_titan.export", step, "--output", str(w / "a_file" / "x.pt")], "cannot be created"),
            ([*py, "nsa_titan.export", step], "--output"),
        ],
    }


@pytest.mark.parametrize("entry", ["train", "evaluate", "generate", "plan", "export"])
def test_bad_input_exits_2_with_one_line_and_changes_nothing(world, entry):
    before = tree_digest(world)
    env = {**os.environ, "NGPU": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}

    def run(case: tuple[list[str], str]) -> tuple[list[str], str, subprocess.CompletedProcess]:
        cmd, phrase = case
        return cmd, phrase, subprocess.run(cmd, cwd=world, env=env, capture_output=True, text=True, timeout=300)

    found = cases(world)[entry]
    if entry == "train":  # two runs at once on one folder are refused: every other one on the run's copy
        found = [([*cmd, "--job.dump_folder", str(world / "run-copy")] if k % 2 and "--job.dump_folder" not in cmd[-2:]
                  else cmd, phrase) for k, (cmd, phrase) in enumerate(found)]
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(run, found))
    assert len(results) >= 5
    for cmd, phrase, proc in results:
        shown = f"{' '.join(cmd[-4:])}\nstdout: {proc.stdout[-1500:]}\nstderr: {proc.stderr[-1500:]}"
        assert proc.returncode == 2, shown
        assert "Traceback" not in proc.stdout + proc.stderr, shown
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and phrase in lines[0], shown
    after = tree_digest(world)
    assert {k: after.get(k) for k in before} == before, "a file that existed before was changed"
