"""Loss spikes (`nsa_titan/runtime/guard.py`) as a run meets them: an injected spike flagged on every rank with its
batch, `skip` leaving the model and optimizer of the step before bit for bit, and the detector's rules.
Exact resume with spike detection on is every resume test's (`warn` is the default)."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest
import torch

from nsa_titan.checkpoint.folders import verify
from nsa_titan.config import Fault
from nsa_titan.runtime.guard import SpikeDetector, UpdateGuard

from conftest import background_folder
from jobs import STEPS, Job, assert_states_equal, job_command, job_in_background
from wandb_files import OFFLINE, assert_one_history_as_printed

SKIP = ["--fault.spike_window", "5", "--fault.spikes", "skip"]
LASTING = ["--debug.fault_spike_lasting", "true", "--fault.spike_window", "5"]
"""From --debug.fault_spike_step on, every step's logits scaled by 30: a loss that rose for good."""
STREAK = [*LASTING, "--fault.spikes", "rollback", "--fault.spike_rollback_count", "3", "--fault.spike_max_rollbacks",
          "1", "--debug.fault_spike_step", "23", "--checkpoint.interval", "2"]
RUNS = {
    "spikes-injected": (["--debug.fault_spike_step", "30", "--fault.spike_window", "10"], 2, {}),
    "spikes-skip-a": ([*SKIP, "--debug.fault_spike_step", "12", "--training.steps", "12", "--checkpoint.interval", "12"],
                      1, {}),
    "spikes-skip-b": ([*SKIP, "--training.steps", "11", "--checkpoint.interval", "11"], 1, {}),
    "spikes-rollback": ([*OFFLINE, "--fault.spikes", "rollback", "--fault.spike_rollback_count", "1",
                         "--fault.spike_window", "10", "--debug.fault_spike_step", "25", "--checkpoint.interval", "10"],
                        2, {}),
    "spikes-halt": ([*LASTING, "--fault.spikes", "skip", "--debug.fault_spike_step", "12"], 2, {"MAX_RESTARTS": "1"}),
    "spikes-streak": (STREAK, 2, {}),
}
BACKGROUND = {name: job_command(background_folder(name) / "out", *args, nproc=nproc, env=env)
              for name, (args, nproc, env) in RUNS.items()}
"""The runs each test below reads, as run_train.sh starts them (2 ranks: the shipped loader workers)."""


def test_the_detector_flags_only_what_stands_far_above_its_running_mean():
    detector = SpikeDetector(threshold=6.0, window=10)
    gen = torch.Generator().manual_seed(0)
    losses = (5.0 - 0.01 * torch.arange(60) + 0.02 * torch.randn(60, generator=gen)).tolist()
    assert [detector.check(x, 1.0) for x in losses[:10]] == [None] * 10  # not before `window` steps
    assert all(detector.check(x, 1.0) is None for x in losses[10:])  # a falling, noisy loss: no spike
    spike = detector.check(losses[-1] + 2.0, 9.0)
    assert spike is not None and (spike.loss - spike.loss_mean) / spike.loss_sd > 6 and detector.spikes == 1
    before = (detector.mean["loss"], detector.seen)
    assert detector.check(losses[-1] + 2.0, 9.0) is not None and (detector.mean["loss"], detector.seen) == before
    assert detector.check(losses[-1] - 2.0, 1.0) is None  # far below is no spike


def test_off_watches_nothing():
    guard = UpdateGuard(Fault(spikes="off"), 0, 1)
    assert guard.spikes is None and guard.spike_allows(1, 1e9, 1.0, lambda: "") and guard.counts() == (0, 0)


@pytest.mark.multiprocess
@pytest.mark.background
def test_an_injected_spike_is_flagged_on_every_rank_with_its_batch():
    """2 ranks, the shipped settings (loader workers): the spike of step 30 (logits scaled by 30 on every rank)
    is one warning line a rank, naming its batch; no other step is flagged; the summary counts it."""
    _, rc, out = job_in_background("spikes-injected", BACKGROUND)
    assert rc == 0, out[-4000:]
    lines = [line for line in out.splitlines() if "loss spike at step" in line]
    assert len(lines) == 2, out[-3000:]
    for rank in (0, 1):
        [line] = [line for line in lines if line.startswith(f"[rank{rank}]")]
        m = re.search(r"loss spike at step 30: loss ([\d.]+), ([\d.]+) sd above its running mean ([\d.]+) \(sd [\d.]+\); "
                      rf"grad norm [\d.]+ \(running mean [\d.]+\); batch: rank {rank}'s of step 30, tokens from "
                      r"python_docs 100%$", line)
        assert m and float(m.group(2)) > 6 and float(m.group(1)) > float(m.group(3)), line
    assert "1 loss spike (0 updates skipped)" in out


@pytest.mark.multiprocess
@pytest.mark.background
def test_skip_leaves_the_model_and_optimizer_of_the_step_before():
    """`skip` at an injected spike in the run's last step: its checkpoint holds, bit for bit, the model and
    optimizer state of a run that stopped one step earlier (the update never happened)."""
    a, rc, out = job_in_background("spikes-skip-a", BACKGROUND)
    assert rc == 0 and "update skipped" in out and "1 loss spike (1 update skipped)" in out, out[-3000:]
    b, rc, out = job_in_background("spikes-skip-b", BACKGROUND)
    assert rc == 0, out[-4000:]
    assert_states_equal(a / "checkpoint" / "step-12", b / "checkpoint" / "step-11")


@pytest.mark.multiprocess
@pytest.mark.background
def test_rollback_reloads_the_newest_checkpoint_and_goes_on_past_the_batches():
    """`rollback` after 1 spike (the one injected at step 25), 2 ranks, saves every 10 steps: the state of
    step 20 is reloaded, steps 21-25 run again on the next batches (other losses than the first time), and the
    run ends at step 40 with a checkpoint that verifies. W&B (offline) logs it: its history holds steps 21-25
    once, with the values of their second pass, as the console printed them."""
    dump, rc, out = job_in_background("spikes-rollback", BACKGROUND)
    assert rc == 0, out[-4000:]
    assert re.search(r"1 loss spike\(s\) within 100 steps, the first at step 25, the last at step 25 \(rollback 1 "
                     r"of at most 3\): rolled back to \S+/step-20; training goes on from step 20 with the next "
                     r"batches", out), out[-3000:]
    losses = {}
    for m in re.finditer(r"\[rank0\] .* step (\d+)/40 \| loss +([\d.]+)", out):
        losses.setdefault(int(m.group(1)), []).append(float(m.group(2)))
    assert [len(losses[s]) for s in range(21, 27)] == [2, 2, 2, 2, 1, 1]  # step 25's first run: rolled back
    assert all(a != b for a, b in (losses[s] for s in range(21, 25)))  # other batches the second time
    assert "run summary: reached step 40 of 40" in out and "1 loss spike (1 update skipped)" in out
    assert verify(dump / "checkpoint" / "step-40") is None
    assert_one_history_as_printed(dump, out, STEPS)


@pytest.mark.multiprocess
@pytest.mark.background
def test_skip_halts_when_the_loss_rose_for_good():
    """`skip` under a lasting rise from step 12 (2 ranks, loader workers, async saves): 5 spikes in a row
    (`max_consecutive_skips`) halt the run at step 16 with exit 3, one line that says the loss rose for good and
    what to do, and no restart."""
    _, rc, out = job_in_background("spikes-halt", BACKGROUND)
    assert rc == 3, out[-3000:]
    assert re.search(r"the loss rose for good: 5 loss spikes in a row, steps 12-16 \(\[fault\] max_consecutive_skips "
                     r"= 5\), each update skipped.*resume with \[fault\] spikes = 'warn'", out), out[-3000:]
    assert "step 17/" not in out and "restart 1 of 1" not in out


@pytest.mark.multiprocess
@pytest.mark.background
def test_rollback_lands_before_the_streak_and_halts_after_spike_max_rollbacks(tmp_path):
    """`rollback` after 3 spikes under a lasting rise from step 23, saves every 2 steps (2 ranks, async saves): the
    save of step 24 lies inside the streak 23-25, the rollback lands on step 22, before it, with that checkpoint's
    estimate, which flags the rise again; with spike_max_rollbacks = 1 the second call for a rollback halts (exit
    3). The estimate is in the checkpoint: a run resumed from step 22 flags step 23 at once (a fresh one would
    fold 5 steps in first)."""
    first, rc, out = job_in_background("spikes-streak", BACKGROUND)
    shutil.copytree(first, tmp_path / "out")  # kept as it ended: the steps below change the copy
    assert rc == 3, out[-3000:]
    assert re.search(r"3 loss spike\(s\) within 100 steps, the first at step 23, the last at step 25 \(rollback 1 of "
                     r"at most 1\): rolled back to \S+/step-22; training goes on from step 22", out), out[-3000:]
    assert re.search(r"the loss spikes again after 1 rollback\(s\) \(\[fault\] spike_max_rollbacks = 1\): 3 spikes "
                     r"within 100 steps, the last at step 25", out), out[-3000:]
    assert len(re.findall(r"\[rank0\] .*loss spike at step 23:", out)) == 2
    # The same command again (a restart): from step 24, saved after the rollback, the count goes on (it started
    # again from 0 at every restart, so a run under MAX_RESTARTS rolled back without end).
    shutil.copytree(tmp_path / "out", tmp_path / "again")
    rc, again = Job(tmp_path / "again", *STREAK, nproc=2).finish()
    assert rc == 3 and re.search(r"resumed from \S+/step-24 at step 24", again), again[-3000:]
    assert "rolled back to" not in again and re.search(r"the loss spikes again after 1 rollback\(s\) \(\[fault\] "
                                                       r"spike_max_rollbacks = 1\)", again), again[-3000:]
    subprocess.run(["rm", "-r", *map(str, (tmp_path / "out" / "checkpoint").glob("step-2[4-9]*"))], check=True)
    rc, out = Job(tmp_path / "out", *STREAK, nproc=2).finish()
    assert "resumed from" in out and re.search(r"\[rank0\] .*loss spike at step 23:", out), out[-3000:]
