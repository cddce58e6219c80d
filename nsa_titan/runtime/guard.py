"""Whether a step's update is applied: a non-finite gradient norm (halt, or skip) and a loss spike (warn, or
skip), decided the same way on every rank.

A loss spike: the loss averaged over the ranks more than `[fault] spike_threshold` standard deviations above
its running mean, an exponentially weighted mean and variance over `spike_window` steps, looked for once that
many steps have been folded in (a spike is not). Its warning names the step, the loss, how far out it is, the
gradient norm and the batch (this rank's sources, and a prepared run's global samples); `skip` drops its
update (the batch counts as read, the optimizer does not step), and halts after `max_consecutive_skips` in a
row (a loss that rose for good would otherwise never be learnt from again); `rollback` drops it too and, after
enough spikes close together, has the trainer reload the newest checkpoint before the first of them, with its
estimate, while the data goes on, and halts when one more rollback than `spike_max_rollbacks` is due.
The estimate and the rollbacks made are saved with the checkpoint (`SpikeDetector.state_dict`,
`UpdateGuard.state_dict`): a restarted run flags at once and goes on counting toward `spike_max_rollbacks`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..config import Fault
from .failure import TrainingHalted

logger = logging.getLogger("nsa_titan")

SUSPECT_AFTER_RESUME = 10
"""A non-finite step within this many steps of a resume names the checkpoint resumed from as a suspect."""


def suspect(resumed_from: Path | None, steps_since_resume: int) -> str:
    """For a non-finite step's report: the checkpoint this run resumed from, named as a suspect when the step
    came within SUSPECT_AFTER_RESUME steps of the resume; else nothing."""
    if resumed_from is None or steps_since_resume > SUSPECT_AFTER_RESUME:
        return ""
    return (f". This run resumed from {resumed_from} {steps_since_resume} step(s) before: that checkpoint is a "
            f"suspect (check it with `python -m nsa_titan.checkpoint verify {resumed_from}`, or resume from an "
            f"older one with --checkpoint.load_step)")


@dataclass
class Spike:
    loss: float
    loss_mean: float
    loss_sd: float
    grad_norm: float
    norm_mean: float

    def line(self, step: int) -> str:
        return (f"loss spike at step {step}: loss {self.loss:.4f}, {(self.loss - self.loss_mean) / self.loss_sd:.1f} sd "
                f"above its running mean {self.loss_mean:.4f} (sd {self.loss_sd:.4f}); grad norm {self.grad_norm:.4f} "
                f"(running mean {self.norm_mean:.4f})")


class SpikeDetector:
    """The running estimate of the loss and the gradient norm; `check` returns a Spike, or folds the step in."""

    def __init__(self, threshold: float, window: int):
        self.threshold, self.window, self.alpha = threshold, window, 2.0 / (window + 1)
        self.mean = {"loss": 0.0, "grad_norm": 0.0}
        self.var = {"loss": 0.0, "grad_norm": 0.0}
        self.seen = self.spikes = 0

    def state_dict(self) -> dict[str, Any]:
        return {"mean": dict(self.mean), "var": dict(self.var), "seen": self.seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.mean, self.var, self.seen = dict(state["mean"]), dict(state["var"]), int(state["seen"])

    def check(self, loss: float, grad_norm: float) -> Spike | None:
        sd = max(math.sqrt(self.var["loss"]), 1e-12)
        if self.seen >= self.window and loss > self.mean["loss"] + self.threshold * sd:
            self.spikes += 1
            return Spike(loss, self.mean["loss"], sd, grad_norm, self.mean["grad_norm"])
        for name, x in (("loss", loss), ("grad_norm", grad_norm)):
            diff = x - self.mean[name] if self.seen else 0.0
            self.mean[name] = self.mean[name] + self.alpha * diff if self.seen else x
            self.var[name] = (1 - self.alpha) * (self.var[name] + self.alpha * diff * diff)
        self.seen += 1
        return None


class UpdateGuard:
    """The step's update checks, with their counts for the run's summary."""

    def __init__(self, f: Fault, rank: int, world_size: int):
        self.f, self.rank, self.world_size = f, rank, world_size
        self.skips_in_a_row = self.skips_total = self.spikes_skipped = 0
        self.skipped = False  # whether the last step's update was dropped
        self.recent: list[int] = []  # the steps of the spikes within spike_rollback_steps
        self.streak: list[int] = []  # the steps of the spikes in a row up to the last step
        self.roll_back_due = ""  # why the trainer is to reload a checkpoint now (`rollback`)...
        self.roll_back_before = 0  # ... the newest before this step: the first spike that called for it
        self.rollbacks = 0  # kept in every checkpoint (`state_dict`): a restart goes on counting
        self.spikes = SpikeDetector(f.spike_threshold, f.spike_window) if f.spikes != "off" else None

    def state_dict(self) -> dict[str, Any]:
        return {"rollbacks": self.rollbacks}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rollbacks = int(state["rollbacks"])

    def values(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> tuple[float, float, float]:
        """(this rank's loss, the global gradient norm, the loss averaged over the ranks when spikes are watched):
        one host sync, and one small all-reduce when they are."""
        watched = torch.stack([loss.float(), grad_norm.float(), loss.float()])
        if self.spikes is not None:
            dist.all_reduce(watched[2:], op=dist.ReduceOp.SUM)
        loss_value, norm_value, total = watched.tolist()
        return loss_value, norm_value, total / self.world_size

    def nonfinite(self, step: int, loss_value: float, norm_value: float, where: str | None, suspect: str) -> None:
        """`halt`: stop with a report (saving nothing); `skip`: count it (the caller drops the update)."""
        what = (f"step {step}: non-finite gradient norm {norm_value} (rank {self.rank} loss {loss_value}); first "
                f"parameter with a non-finite gradient: {where or 'none (the loss itself)'}{suspect}")
        if self.f.nonfinite == "halt":
            raise TrainingHalted(f"{what}. Halted without saving: the existing checkpoints are the last good "
                                 f"state. Lower the lr, check the data, or set [fault] nonfinite = 'skip'")
        self.skips_in_a_row += 1
        self.skips_total += 1
        self.skipped = True
        logger.warning("%s: update skipped (%d in a row, %d in total)", what, self.skips_in_a_row, self.skips_total)
        if self.skips_in_a_row >= self.f.max_consecutive_skips:
            raise TrainingHalted(f"{self.skips_in_a_row} non-finite steps in a row (max_consecutive_skips = "
                                 f"{self.f.max_consecutive_skips}); last: {what}")

    def spike_allows(self, step: int, mean_loss: float, norm_value: float, batch: Callable[[], str]) -> bool:
        """Whether the update goes ahead: not for a spike under `skip` (warned with the step's `batch()`)."""
        spike = self.spikes.check(mean_loss, norm_value) if self.spikes is not None else None
        skip = spike is not None and self.f.spikes in ("skip", "rollback")
        self.streak = self.streak + [step] if spike is not None else []
        if spike is not None:
            self.spikes_skipped += skip
            logger.warning("%s; batch: rank %d's of step %d%s%s", spike.line(step), self.rank, step, batch(),
                           "; update skipped" if skip else "")
            if self.f.spikes == "skip" and len(self.streak) >= self.f.max_consecutive_skips:
                raise TrainingHalted(
                    f"the loss rose for good: {len(self.streak)} loss spikes in a row, steps {self.streak[0]}-{step} "
                    f"([fault] max_consecutive_skips = {self.f.max_consecutive_skips}), each update skipped, so the run "
                    f"has stopped learning. A lasting rise (a new source, a longer context) is not a spike: resume "
                    f"with [fault] spikes = 'warn' or a larger spike_threshold; a divergence: resume from a checkpoint "
                    f"before step {self.streak[0]} (--checkpoint.load_step) with a lower lr")
            self.recent = [s for s in self.recent if s > step - self.f.spike_rollback_steps] + [step]
            if self.f.spikes == "rollback" and len(self.recent) >= self.f.spike_rollback_count:
                if self.rollbacks >= self.f.spike_max_rollbacks:
                    raise TrainingHalted(
                        f"the loss spikes again after {self.rollbacks} rollback(s) ([fault] spike_max_rollbacks = "
                        f"{self.f.spike_max_rollbacks}): {len(self.recent)} spikes within {self.f.spike_rollback_steps} "
                        f"steps, the last at step {step}. It rose for good, or its cause is not in the batches a "
                        f"rollback skips: resume with [fault] spikes = 'warn', a larger spike_threshold or a lower lr")
                self.rollbacks += 1
                self.roll_back_before, self.recent = self.recent[0], []
                self.roll_back_due = (f"{self.f.spike_rollback_count} loss spike(s) within "
                                      f"{self.f.spike_rollback_steps} steps, the first at step {self.roll_back_before}, "
                                      f"the last at step {step} (rollback {self.rollbacks} of at most "
                                      f"{self.f.spike_max_rollbacks})")
        if not skip:
            self.skips_in_a_row = 0
        self.skipped = skip
        return not skip

    def counts(self) -> tuple[int, int]:
        """(loss spikes, updates skipped for them) in this run."""
        return (self.spikes.spikes if self.spikes else 0), self.spikes_skipped
