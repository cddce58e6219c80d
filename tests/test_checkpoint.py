"""Distributed checkpointing on 2 gloo ranks: exact resume, crashes, resharding, export (stop signals: test_operations.py)."""

from __future__ import annotations

import os
import pickle
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from nsa_titan import export
from nsa_titan.checkpoint import load_tensors, recorded_kernels
from nsa_titan.checkpoint.integrity import HASH
from nsa_titan.system.hashing import file_hash

from conftest import (ROOT, Command, background, background_folder, free_port, from_step, launch_ranks, tb_losses,
                      tree_digest)
from jobs import assert_states_equal

pytestmark = [pytest.mark.multiprocess, pytest.mark.background]  # the first runs (BACKGROUND) start at once

# The default data pipeline (embedded corpus, sentencepiece, 2 loader workers) and a tiny model.
CK = [
    "--model.dim", "64", "--model.n_layers", "2", "--model.n_heads", "4", "--model.n_kv_groups", "2",
    "--model.head_dim", "16", "--training.seq_len", "64", "--training.local_batch_size", "4",
    "--training.mixed_precision_param", "float32", "--metrics.log_freq", "1", "--validation.enable", "false",
    "--checkpoint.enable", "true", "--data.num_workers", "2", "--checkpoint.keep_latest_k", "0",
    "--checkpoint.async_mode", "disabled",
    # Warmup past the resume point: a schedule that were not restored would show at once.
    "--lr_scheduler.warmup_steps", "15", "--lr_scheduler.decay_type", "constant",
]


def run_command(dump: Path, *args: str, nproc: int = 2, tb: str = "tb") -> Command:
    """The trainer on CK under torchrun (`--standalone`, as run_train.sh starts it)."""
    return Command([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--standalone", "-m",
                    "nsa_titan.train", *CK, "--job.dump_folder", str(dump), "--metrics.save_tb_folder", tb, *args],
                   {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}, sessions=True)


def run(dump: Path, *args: str, nproc: int = 2, tb: str = "tb") -> subprocess.CompletedProcess:
    command = run_command(dump, *args, nproc=nproc, tb=tb)
    return subprocess.run(command.argv, cwd=command.cwd, env={**os.environ, **command.env}, capture_output=True,
                          text=True, timeout=900)


def ok(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc.stdout


ASYNC = [*(a if a != "disabled" else "async" for a in CK), "--checkpoint.interval", "2"]


def train_command(dump: Path, steps: int, *args: str, nproc: int) -> Command:
    """A run under the launcher as run_train.sh starts it (the trainer's exit code, its error line once)."""
    return Command([sys.executable, "-m", "nsa_titan.launch", "--nproc_per_node", str(nproc), "--standalone", "-m",
                    "nsa_titan.train", *ASYNC, "--job.dump_folder", str(dump), "--training.steps", str(steps),
                    "--metrics.save_tb_folder", f"tb-{steps}", *args],
                   {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}, sessions=True)


SAVED = {f"saved-{n}": train_command(background_folder(f"saved-{n}"), 4, *(["--checkpoint.export_at_end", "true"]
                                                                           if n == 1 else []), nproc=n)
         for n in (1, 2)}
"""A run to step 4 (async saves at 2 and 4; on one rank exported at the end) on each number of ranks, which the
tests here and in test_integrity.py read, reshard and load (`saved`)."""


def saved(nproc: int) -> Path:
    """The dump folder of the run to step 4 on `nproc` ranks (`SAVED`); copy it to change it."""
    ok(background(f"saved-{nproc}", SAVED))
    return background_folder(f"saved-{nproc}")


FAST = ["--compile.enable", "true", "--activation_checkpoint.mode", "full", "--checkpoint.interval", "10"]
FIRST = {
    "checkpoint-compiled": (FAST, "--training.steps", "20"),
    "checkpoint-unused-win": ("--model.nsa_branch", "win", "--checkpoint.interval", "2", "--training.steps", "4"),
    "checkpoint-unused-sel": ("--model.nsa_branch", "sel", "--checkpoint.interval", "2", "--training.steps", "4"),
    "checkpoint-keep": ("--training.steps", "12", "--checkpoint.interval", "2", "--checkpoint.keep_latest_k", "3"),
    "checkpoint-hsdp": ("--training.steps", "4", "--parallelism.data_parallel_replicate_degree", "2"),
}
BACKGROUND = {**{name: run_command(background_folder(name), *(a for arg in args for a in (
    arg if isinstance(arg, list) else [arg]))) for name, args in FIRST.items()}, **SAVED}
"""The runs that the tests below resume, reshard or read, started in the background."""


def first(name: str) -> tuple[Path, str]:
    """The folder and output of the finished run `name` of BACKGROUND."""
    return background_folder(name), ok(background(name, BACKGROUND))



def step_dirs(dump: Path) -> list[str]:
    return sorted(p.name for p in (dump / "checkpoint").iterdir() if p.name.startswith("step-"))


def saved_rng(step: Path, rank: int) -> dict:
    """The generator states rank `rank` saved in the checkpoint at `step`."""
    state = {f"rng.rank_{rank}.pickle": None}
    dcp.load(state, checkpoint_id=str(step), no_dist=True)
    return pickle.loads(state[f"rng.rank_{rank}.pickle"])


@pytest.mark.filterwarnings("ignore:.*assuming the intent is to load in a single process")
def test_resume_is_bit_exact_with_compile_ac_and_loader_workers(tmp_path):
    a, _ = first("checkpoint-compiled")
    # Another seed on resume: only a restored RNG state brings the generators back to run a's.
    out = ok(run(from_step(a, 10, tmp_path / "b"), *FAST, "--training.steps", "20", "--debug.seed", "1"))
    assert f"resumed from {tmp_path / 'b' / 'checkpoint' / 'step-10'} at step 10" in out
    assert "no RNG state" not in out
    for rank in (0, 1):
        # torch's generator, which the seed sets (python's and numpy's start from OS entropy)
        ra, rb = (saved_rng(x / "checkpoint" / "step-20", rank)["torch"] for x in (a, tmp_path / "b"))
        assert ra == rb, f"rank {rank}'s torch generator was not restored on resume"
    la, lb = tb_losses(a / "tb"), tb_losses(tmp_path / "b" / "tb")
    assert sorted(la) == list(range(1, 21)) and sorted(lb) == list(range(11, 21))
    assert [la[s] for s in lb] == [lb[s] for s in lb], "losses differ after resume"
    assert_states_equal(a / "checkpoint" / "step-20", tmp_path / "b" / "checkpoint" / "step-20")


@pytest.mark.parametrize("branch", ["win", "sel"])
def test_a_run_with_unused_parameters_resumes_exactly(tmp_path, branch):
    """`nsa_branch` win leaves cmp's and sel's parameters out of the graph, sel leaves cmp's: they get
    no gradient, yet their optimizer state is saved, so the checkpoint loads into a fresh optimizer. The
    manifest records the kernel family `auto` took; made the slower here (`FAMILY:slow`), a resume keeps it all
    the same: another family's numbers differ by rounding, and the states would not be bit-equal."""
    a, first_out = first(f"checkpoint-unused-{branch}")
    trained = recorded_kernels(a / "checkpoint" / "step-2")
    assert trained in ("cpp", "torch") and f"kernels = 'auto' takes the {trained} family" in first_out
    out = ok(run(from_step(a, 2, tmp_path / "b"), *FIRST[f"checkpoint-unused-{branch}"], "--debug.fault_kernel",
                 f"{trained}:slow"))
    assert f"resumed from {tmp_path / 'b' / 'checkpoint' / 'step-2'} at step 2" in out
    assert re.search(f"kernels = 'auto' keeps the {trained} family, the resumed checkpoint's, for an exact resume "
                     r"\(a fresh run takes the fastest: (cpp|torch)\)", out), out[-3000:]
    la, lb = tb_losses(a / "tb"), tb_losses(tmp_path / "b" / "tb")
    assert sorted(la) == [1, 2, 3, 4] and sorted(lb) == [3, 4] and [la[s] for s in lb] == [lb[s] for s in lb]
    assert_states_equal(a / "checkpoint" / "step-4", tmp_path / "b" / "checkpoint" / "step-4")


def test_rank_killed_mid_save_resumes_from_previous_complete_checkpoint(tmp_path):
    args = ["--training.steps", "30", "--checkpoint.interval", "10"]
    crashed = run(tmp_path, *args, "--debug.fault_kill_in_save_step", "20")
    assert crashed.returncode != 0
    names = step_dirs(tmp_path)
    assert "step-10" in names and "step-20" not in names
    assert any(n.startswith("step-20.incomplete-") for n in names), names
    out = ok(run(tmp_path, *args))  # the same command, without the fault
    assert "an interrupted save (never committed)" in out and "is ignored" in out
    assert f"resumed from {tmp_path / 'checkpoint' / 'step-10'} at step 10" in out
    assert step_dirs(tmp_path) == ["step-10", "step-20", "step-30"]  # the broken one is gone now


@pytest.mark.parametrize("saved_on,loaded_on", [(2, 1), (1, 2)])
def test_reshard_model_and_optimizer_between_world_sizes(tmp_path, saved_on, loaded_on):
    dump = saved(saved_on)
    ckpt = dump / "checkpoint" / "step-4"
    before = tree_digest(dump / "checkpoint")
    # Without consent the data position is not silently dropped.
    refused = run(dump, "--training.steps", "4", nproc=loaded_on)
    assert refused.returncode != 0
    assert f"was saved by {saved_on} data-parallel ranks and this run has {loaded_on}" in refused.stderr
    assert tree_digest(dump / "checkpoint") == before
    loaded = launch_ranks([{"name": "r", "args": [*CK, "--training.steps", "4", "--checkpoint.restart_data_on_reshard",
                                                  "true", "--checkpoint.folder", str(dump / "checkpoint")],
                            "save_params": True, "save_optimizer": True}], tmp_path / "load", nproc=loaded_on)["r"]
    assert loaded["step"] == 4
    model, optim = load_tensors(ckpt, "model"), load_tensors(ckpt, "optimizer")
    assert loaded["params"].keys() == model.keys()
    for k, v in model.items():
        assert torch.equal(loaded["params"][k], v), k
    for k, v in loaded["optimizer"].items():
        assert torch.equal(v, optim[f"state.{k}"]), k


def test_keep_latest_k_keeps_exactly_k_complete_checkpoints():
    dump, out = first("checkpoint-keep")
    assert step_dirs(dump) == ["step-10", "step-12", "step-8"]
    assert out.count("removed checkpoint") == 3
    assert "training blocked" in out and "MB in" in out  # size and save time are logged


def test_async_save_writes_the_same_bytes_as_sync_save(tmp_path):
    launch_ranks([{"name": "s", "args": [*CK, "--training.steps", "3", "--checkpoint.interval", "1000"],
                   "save_sync_and_async": True}], tmp_path)
    sync, async_ = tmp_path / "s-sync" / "step-3", tmp_path / "s-async" / "step-3"
    data = sorted(p.name for p in sync.glob("*.distcp"))
    assert data == ["__0_0.distcp", "__1_0.distcp"]
    for name in (*data, "config.toml"):
        assert (sync / name).read_bytes() == (async_ / name).read_bytes(), name
    # The index is the same but for where and when it was written (the path, the save's id).
    meta_s, meta_a = (FileSystemReader(str(p)).read_metadata() for p in (sync, async_))
    assert meta_s.state_dict_metadata == meta_a.state_dict_metadata
    assert meta_s.storage_data == meta_a.storage_data and meta_s.planner_data == meta_a.planner_data
    assert meta_s.storage_meta.save_id != meta_a.storage_meta.save_id


@pytest.fixture(scope="module")
def saved_run() -> Path:
    """A run of 4 steps on one rank, checkpoints at 2 and 4, exported at the end."""
    return saved(1)


def single(dump: Path, *args: str) -> subprocess.CompletedProcess:
    """One plain process, no torchrun (a fresh process: forked loader workers elsewhere in this
    test session must not inherit the threads a trainer leaves behind), with CK's 2 loader workers:
    a load that fails once they run must still end the process."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MASTER_PORT": str(free_port())}
    return subprocess.run([sys.executable, "-m", "nsa_titan.train", *CK, "--job.dump_folder", str(dump), *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def test_incompatible_model_stops_and_overwrites_nothing(saved_run):
    before = tree_digest(saved_run / "checkpoint")
    proc = single(saved_run, "--training.steps", "6", "--model.dim", "96")
    assert proc.returncode == 2
    err = proc.stderr
    assert f"checkpoint {saved_run / 'checkpoint' / 'step-4'} does not fit this model" in err
    assert re.search(r"shapes differ: layers\.0\.[\w.]+: \(\d+, 64\) in the checkpoint, \(\d+, 96\) here", err), err
    assert tree_digest(saved_run / "checkpoint") == before


@pytest.mark.parametrize("case", ["asked-to-stop", "none-verifies"])
def test_truncated_file_stops_naming_checkpoint_and_file(saved_run, tmp_path, case):
    """`--checkpoint.on_damaged stop`; or the default, where no older checkpoint verifies either: nothing is set
    aside, nothing changed, and the run does not start afresh."""
    dump = tmp_path / "copy"
    shutil.copytree(saved_run, dump)
    for step in ("step-4", "step-2") if case == "none-verifies" else ("step-4",):
        shard = dump / "checkpoint" / step / "__0_0.distcp"
        shard.write_bytes(shard.read_bytes()[:1000])
    before = tree_digest(dump / "checkpoint")
    proc = single(dump, "--training.steps", "6", *(["--checkpoint.on_damaged", "stop"] if case == "asked-to-stop"
                                                     else []))
    assert proc.returncode == 2
    err = proc.stderr
    assert f"checkpoint {dump / 'checkpoint' / 'step-4'} cannot be used: file __0_0.distcp is truncated" in err
    if case == "asked-to-stop":
        assert "--checkpoint.load_step 2" in err  # the way out
    else:
        assert "no older checkpoint verifies: repair it, or move the checkpoint folder aside to start afresh" in err
    assert tree_digest(dump / "checkpoint") == before


def test_checkpoint_without_part_of_the_state_stops_and_the_loader_workers_end(saved_run, tmp_path):
    """A complete checkpoint without an entry this run expects (one parameter's optimizer state, as an
    earlier nsa_titan saved for parameters that never got a gradient). The load fails after it started
    the 2 loader workers (to read their position): the process still exits at once with code 2,
    naming the missing entry and the ways out."""
    import json
    dump = tmp_path / "copy"
    shutil.copytree(saved_run, dump)
    step = dump / "checkpoint" / "step-4"
    meta = pickle.loads((step / ".metadata").read_bytes())
    gone = next(k for k in meta.state_dict_metadata if k.startswith("optimizer.state.") and k.endswith(".exp_avg"))
    del meta.state_dict_metadata[gone]
    (step / ".metadata").write_bytes(pickle.dumps(meta))
    manifest = json.loads((step / ".complete").read_text())
    manifest["files"][".metadata"] = (step / ".metadata").stat().st_size
    manifest[HASH][".metadata"] = file_hash(step / ".metadata", HASH)
    (step / ".complete").write_text(json.dumps(manifest))
    before = tree_digest(dump / "checkpoint")
    proc = single(dump, "--training.steps", "6")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert (f"checkpoint {step} has no {gone} (the optimizer state this run expects): resume from another checkpoint "
            "with --checkpoint.load_step, or without its optimizer with --checkpoint.exclude_from_loading optimizer"
            in proc.stderr), proc.stderr[-3000:]
    assert tree_digest(dump / "checkpoint") == before


@pytest.mark.parametrize("args,message", [
    (["--checkpoint.load_step", "3"], "there is no {ck}/step-3 (complete checkpoints: 2, 4)"),
    (["--checkpoint.folder", "elsewhere", "--checkpoint.initial_load_path", "/no/such/ckpt"],
     "initial_load_path = '/no/such/ckpt': no such checkpoint folder or file"),
])
def test_missing_checkpoint_stops_with_message(saved_run, args, message):
    before = tree_digest(saved_run / "checkpoint")
    proc = single(saved_run, "--training.steps", "6", *args)
    assert proc.returncode == 2
    assert message.format(ck=saved_run / "checkpoint") in proc.stderr
    assert tree_digest(saved_run / "checkpoint") == before


def test_export_command_and_warm_start_from_the_file(saved_run, tmp_path):
    out = tmp_path / "model.pt"
    assert export.main([str(saved_run / "checkpoint" / "step-4"), "--output", str(out), "--dtype", "float32"]) == 0
    exported = torch.load(out, weights_only=True)
    # Its config beside it (model.toml), where evaluate and generate find it.
    assert (tmp_path / "model.toml").read_text() == (saved_run / "checkpoint" / "step-4" / "config.toml").read_text()
    dcp_model = load_tensors(saved_run / "checkpoint" / "step-4", "model")
    assert exported.keys() == dcp_model.keys()
    assert all(torch.equal(exported[k], dcp_model[k]) for k in exported)
    at_end = torch.load(saved_run / "checkpoint" / "model-step-4.pt", weights_only=True)  # export_at_end
    assert all(at_end[k].dtype == torch.bfloat16 and torch.equal(at_end[k], dcp_model[k].bfloat16()) for k in at_end)
    started = launch_ranks([{"name": "w", "args": [*CK, "--training.steps", "1",
                                                   "--checkpoint.enable", "false", "--optimizer.lr", "1e-30",
                                                   "--checkpoint.initial_load_path", str(out)],
                             "save_params": True}], tmp_path / "warm")["w"]
    for k, v in exported.items():  # lr ~0: one step leaves the weights as loaded
        torch.testing.assert_close(started["params"][k], v, rtol=0, atol=1e-6, msg=k)
    assert export.main([str(saved_run / "checkpoint" / "step-3"), "--output", str(out)]) == 2


def test_hsdp_checkpoint_loads_under_fsdp_and_on_one_rank(tmp_path):
    dump, _ = first("checkpoint-hsdp")
    ckpt = dump / "checkpoint" / "step-4"
    model, optim = load_tensors(ckpt, "model"), load_tensors(ckpt, "optimizer")
    for nproc, extra in ((2, []), (1, ["--checkpoint.restart_data_on_reshard", "true"])):
        loaded = launch_ranks([{"name": "l", "args": [*CK, "--training.steps", "4", *extra,
                                                      "--checkpoint.folder", str(dump / "checkpoint")],
                                "save_params": True, "save_optimizer": True}], tmp_path / f"load{nproc}",
                              nproc=nproc)["l"]
        assert loaded["step"] == 4
        assert all(torch.equal(loaded["params"][k], v) for k, v in model.items())
        assert all(torch.equal(v, optim[f"state.{k}"]) for k, v in loaded["optimizer"].items())


SIDE_GROUP = """
import os, sys, torch, torch.distributed as dist
from nsa_titan.distributed.parallel import side_group
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2], RANK="0", WORLD_SIZE="1")
torch.set_num_threads(2)  # the default 1-rank CPU job's intra-op threads
dist.init_process_group("gloo")
group = side_group() if sys.argv[1] == "side" else dist.new_group(backend="gloo")
torch.ones(1 << 20).add_(1)  # the main thread's own team, which training has too
before = len(os.listdir("/proc/self/task"))
for _ in range(4):  # what a save runs on the group: gathered plans, large tensors
    dist.all_gather_object([None], bytes(4_000_000), group=group)
    dist.all_reduce(torch.ones(1 << 20), group=group)
print(len(os.listdir("/proc/self/task")) - before, torch.get_num_threads())
dist.destroy_process_group()
"""


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="counts threads in /proc")
def test_the_checkpoint_groups_threads_make_no_openmp_team():
    """A plain gloo group's worker threads keep an OpenMP team after their first large copy (the
    cause of ~35% slower steps after a save); the checkpoint manager's `side_group` does not, and
    leaves the main thread's intra-op threads as they were."""
    added = {}
    for kind in ("plain", "side"):
        out = subprocess.run([sys.executable, "-c", SIDE_GROUP, kind, str(free_port())], capture_output=True, text=True,
                             cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        added[kind], threads = map(int, out.stdout.split())
        assert threads == 2
    assert added["plain"] >= 1 and added["side"] == 0, added
