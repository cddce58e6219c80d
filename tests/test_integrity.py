"""Checkpoint integrity: every file's content hash in the manifest, checked wherever a checkpoint is read.

Saved as the shipped configs save (async, 2 loader workers) on 1 and 2 gloo ranks; one byte flipped
at a random offset inside one kind of content (a model or optimizer shard, `.metadata`, a loader
or RNG state) is refused at resume, by export, evaluate, generate and `verify`, with nothing in
the dump folder changed; the previous step then resumes to the same bits as an uninterrupted run.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from nsa_titan.checkpoint import load_tensors
from nsa_titan.checkpoint.folders import verify
from nsa_titan.checkpoint.integrity import HASH

from conftest import ROOT, tree_digest
from test_checkpoint import SAVED, saved, train_command

pytestmark = [pytest.mark.multiprocess, pytest.mark.background]


def train(dump: Path, steps: int, *args: str, nproc: int) -> subprocess.CompletedProcess:
    command = train_command(dump, steps, *args, nproc=nproc)
    return subprocess.run(command.argv, cwd=command.cwd, env={**os.environ, **command.env}, capture_output=True,
                          text=True, timeout=600)


def ok(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def command(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


BACKGROUND = SAVED
"""The runs to step 4 on 1 and 2 ranks (`test_checkpoint.SAVED`), read through `saved`."""


def flip(step: Path, part: str, seed: int) -> str:
    """Flip one byte at a random offset inside `part` of checkpoint `step` ('.metadata', or the first
    stored item whose name starts with `part`); returns the name of the file changed."""
    rng = random.Random(seed)
    if part == ".metadata":
        name, lo, hi = ".metadata", 0, (step / ".metadata").stat().st_size
    else:
        meta = pickle.loads((step / ".metadata").read_bytes())
        info = next(v for k, v in sorted(meta.storage_data.items(), key=lambda kv: kv[0].fqn)
                    if k.fqn.startswith(part))
        name, lo, hi = info.relative_path, info.offset, info.offset + info.length
    data = bytearray((step / name).read_bytes())
    data[rng.randrange(lo, hi)] ^= 1 << rng.randrange(8)
    (step / name).write_bytes(data)
    return name


def corrupted_copy(saved_dump: Path, tmp_path: Path, part: str, seed: int = 0) -> tuple[Path, str]:
    dump = tmp_path / "copy"
    shutil.copytree(saved_dump, dump)
    return dump, flip(dump / "checkpoint" / "step-4", part, seed)


@pytest.mark.parametrize("nproc,part,mode", [(2, "model.", "stop"), (2, "optimizer.", "set_aside"),
                                             (2, ".metadata", "stop"), (2, "dataloader.", "set_aside"),
                                             (2, "rng.", "stop"), (1, "model.", "set_aside"),
                                             (1, "dataloader.", "stop")])
def test_a_flipped_byte_is_named_and_the_newest_checkpoint_set_aside_or_the_run_stopped(tmp_path, nproc, part,
                                                                                       mode):
    """`[checkpoint] on_damaged`: `set_aside` (the default) renames the damaged step folder, unchanged, and resumes
    from the one before it; `stop` exits 2 with nothing in the dump folder changed."""
    dump, name = corrupted_copy(saved(nproc), tmp_path, part, seed=len(part) + nproc)
    step = dump / "checkpoint" / "step-4"
    before, damaged = tree_digest(dump), tree_digest(step)
    proc = train(dump, 6, *(["--checkpoint.on_damaged", "stop"] if mode == "stop" else []), nproc=nproc)
    problem = f"checkpoint {step} cannot be used: file {name} does not match its recorded content ({HASH} "
    if mode == "stop":
        assert proc.returncode == 2, proc.stderr[-3000:]
        (line,) = [x for x in proc.stderr.splitlines() if "checkpoint error" in x]
        assert problem in line
        assert "Nothing was loaded or overwritten; resume from step 2, the newest that verifies, with " \
               "--checkpoint.load_step 2" in line, line
        assert "resumed from" not in proc.stdout
        assert tree_digest(dump) == before
        return
    out = ok(proc)
    (line,) = [x for x in out.splitlines() if "cannot be used" in x]
    assert problem in line and f"resuming from {dump / 'checkpoint' / 'step-2'}" in line, line
    (aside,) = (dump / "checkpoint").glob("step-4.damaged-*")
    assert f"Set aside as {aside} (kept, never read)" in line
    assert tree_digest(aside) == damaged
    assert f"resumed from {dump / 'checkpoint' / 'step-2'} at step 2" in out


def test_export_evaluate_generate_and_verify_refuse_it_and_the_previous_step_resumes_bit_equal(tmp_path):
    dump, name = corrupted_copy(saved(2), tmp_path, "model.", seed=7)
    ck = dump / "checkpoint"
    before = tree_digest(dump)
    out = tmp_path / "model.pt"
    refusing = (["nsa_titan.export", str(ck / "step-4"), "--output", str(out)],
                ["nsa_titan.evaluate", str(ck / "step-4"), "--batches", "1"],
                ["nsa_titan.generate", str(ck / "step-4"), "--prompt", "def", "--max_new_tokens", "2"])
    verifying = (["nsa_titan.checkpoint", "verify", str(ck)], ["nsa_titan.checkpoint", "verify", str(ck / "step-2")])
    with ThreadPoolExecutor(2) as pool:  # each reads the folder alone, and changes nothing (asserted below)
        *refused, verified, verified_2 = pool.map(lambda args: command(*args), (*refusing, *verifying))
    for proc in refused:
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert f"checkpoint {ck / 'step-4'} cannot be read: file {name} does not match its recorded content" \
               in proc.stderr, proc.stderr[-2000:]
        assert f"{ck / 'step-2'} is the newest beside it that verifies" in proc.stderr
    assert not out.exists()
    assert verified.returncode == 1
    assert verified.stdout.splitlines() == [
        f"{ck / 'step-2'}: ok (4 files, {sum(f.stat().st_size for f in (ck / 'step-2').iterdir() if f.name != '.complete') / 1e6:,.1f} MB, "
        f"{HASH} content and sizes match)",
        f"{ck / 'step-4'}: FAILED, {verify(ck / 'step-4')}"]
    assert verified_2.returncode == 0
    assert tree_digest(dump) == before

    resumed = train(dump, 6, "--checkpoint.load_step", "2", nproc=2)
    assert f"resumed from {ck / 'step-2'} at step 2" in ok(resumed)
    whole = tmp_path / "uninterrupted"
    ok(train(whole, 6, nproc=2))
    for prefix in ("model", "optimizer"):
        a, b = load_tensors(ck / "step-6", prefix), load_tensors(whole / "checkpoint" / "step-6", prefix)
        assert a.keys() == b.keys() and len(a) > 10
        assert all(torch.equal(a[k], b[k]) for k in a), prefix


def test_a_checkpoint_without_hashes_resumes_with_a_warning(tmp_path):
    dump = tmp_path / "copy"
    shutil.copytree(saved(1), dump)
    manifest = dump / "checkpoint" / "step-4" / ".complete"
    old = json.loads(manifest.read_text())
    del old[HASH]  # as nsa_titan wrote manifests before it recorded hashes
    manifest.write_text(json.dumps(old))
    out = ok(train(dump, 5, nproc=1))
    step = dump / "checkpoint" / "step-4"
    assert out.count(f"checkpoint {step} has no content hashes (saved before nsa_titan recorded them): its files "
                     f"are checked by size only") == 1, out[-3000:]
    assert f"resumed from {step} at step 4" in out
    assert HASH in json.loads((dump / "checkpoint" / "step-5" / ".complete").read_text())
    verified = command("nsa_titan.checkpoint", "verify", str(step))
    assert verified.returncode == 0 and "sizes match; it has no content hashes" in verified.stdout


def test_a_non_finite_step_after_a_resume_names_the_checkpoint(tmp_path):
    dump = tmp_path / "copy"
    shutil.copytree(saved(1), dump)
    proc = train(dump, 8, "--debug.fault_nan_step", "6", nproc=1)
    assert proc.returncode == 3, proc.stderr[-3000:]
    step = dump / "checkpoint" / "step-4"
    assert ("step 6: non-finite gradient norm nan" in proc.stderr and f"This run resumed from {step} 2 step(s) "
            f"before: that checkpoint is a suspect (check it with `python -m nsa_titan.checkpoint verify {step}`"
            in proc.stderr), proc.stderr[-3000:]


def test_verify_skips_interrupted_saves_and_needs_a_checkpoint(tmp_path):
    ck = tmp_path / "checkpoint"
    shutil.copytree(saved(1) / "checkpoint", ck)
    shutil.copytree(ck / "step-4", ck / "step-6.incomplete-123")
    (ck / "step-6.incomplete-123" / ".complete").unlink()
    proc = command("nsa_titan.checkpoint", "verify", str(ck))
    assert proc.returncode == 0, proc.stdout
    assert proc.stdout.splitlines()[-1] == f"{ck / 'step-6.incomplete-123'}: skipped, an interrupted save (never committed)"
    proc = command("nsa_titan.checkpoint", "verify", str(tmp_path / "nothing"))
    assert proc.returncode == 2
    assert proc.stderr.strip() == (f"nsa_titan.checkpoint: checkpoint error: {tmp_path / 'nothing'} holds no checkpoint: "
                                   f"give a step-N folder or the checkpoint folder that holds them")


def test_a_flipped_byte_in_a_warm_start_folder_names_the_one_beside_it_that_verifies(tmp_path):
    dump, name = corrupted_copy(saved(1), tmp_path, "optimizer.", seed=3)
    step = dump / "checkpoint" / "step-4"
    proc = train(tmp_path / "warm", 1, "--checkpoint.initial_load_path", str(step), nproc=1)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert (f"checkpoint {step} cannot be used: file {name} does not match its recorded content" in proc.stderr and
            f"pass --checkpoint.initial_load_path {dump / 'checkpoint' / 'step-2'}, the newest beside it that "
            f"verifies" in proc.stderr), proc.stderr[-3000:]
