"""The trainer: `python -m nsa_titan.train --config FILE [--section.key value ...]` under torchrun.

Reads top to bottom: config -> output folder, stop signals, watchdog -> distributed -> model on
meta -> AC/compile/FSDP -> materialise + init -> optimizer, schedule, data -> resume -> loop
(accumulate, clip, check, step, log, heartbeat, save, stop on a signal) -> a summary line.

Exit codes: 0 done or stopped by a signal (after saving), 2 bad input, 3 halted on a non-finite
step, 4 the run's last save failed, 75 the data source stayed unreadable (saved: resume to go on),
124 a hang found by the watchdog, 130 a second Ctrl-C, 1 a crash.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import time
from collections.abc import Iterator
from typing import NoReturn

import torch
import torch.distributed as dist

from .checkpoint import CheckpointManager, TrainState, folder_check, recorded_kernels
from .config import JobConfig, ac_layers, cp_multiple, data_sources, derive, grad_accum_steps, load_config, to_toml
from .config.paths import RunPaths, make_folder
from .data import (DataUnavailable, HeldOutSets, Sample, SourceEnded, build_dataloader, build_tokenizer, dead_workers,
                   shutdown_workers)
from .distributed.parallel import build_mesh, data_parallel_rank, device_for_rank, init_distributed, parallelize
from .export import export_trained
from .models.attention import describe_attention, set_explore_step
from .models.loss import IGNORE_INDEX, lm_loss
from .models.transformer import Transformer
from .observe.evals import InRunEvals
from .observe.shares import SourceShares
from .observe.metrics import (MetricsLogger, StepStats, Throughput, current_rss_gib, log_setup,
                              peak_flops, peak_memory_gib, run_summary)
from .observe.validate import agreed_batches, validate
from .optim import build_lr_scheduler, build_optimizer, clip_grad_norm_
from .runtime.diagnostics import dtype_report, first_nonfinite_grad, nsa_stats, report_missing_grads, step_profiler
from .runtime.failure import EXIT_CRASH, EXIT_RETRY, EXIT_SAVE_FAILED, exit_now, report_failure, restart_line
from .runtime.failure_channel import FailureChannel
from .runtime.fault_injection import install_faults, kernel_fault
from .runtime.guard import UpdateGuard, suspect
from .runtime.kernel_check import checked_kernels
from .runtime.ownership import FolderOwner, job_key, other_holder
from .runtime.step_batches import StepBatches
from .runtime.stop import StopRequest
from .runtime.watchdog import Heartbeat, StepWatchdog, set_collective_timeout
from .system.cli import leave, note_failure, report, run_command, setup_logging
from .system.env import LAUNCHED_BY, set_deterministic
from .system.errors import BadInput
from .system.extras import require_hf, require_wandb
from .system.signals import end_with_launcher

logger = logging.getLogger("nsa_titan")


class Trainer:
    """Owns everything a run needs; `train()` runs the loop."""

    def __init__(self, cfg: JobConfig, stop: StopRequest | None = None):
        """`cfg`: the run's config (`config.load_config`); `stop`: the process's stop-signal handlers, or None."""
        t, m = cfg.training, cfg.model
        self.cfg, self.paths = cfg, RunPaths.of(cfg)
        # The folder is this run's before anything is written (under the launcher, the launcher holds it).
        self.owner = None if os.environ.get(LAUNCHED_BY) else FolderOwner.claim(
            self.paths.root, cfg.job.owner_heartbeat_seconds, cfg.job.owner_stale_seconds)
        make_folder(self.paths.root, "[job] dump_folder")
        if cfg.checkpoint.export_at_end and cfg.checkpoint.export_format == "hf":  # found out now, not at the end
            require_hf("[checkpoint] export_format = 'hf' (set 'pt' to do without)")
        if cfg.metrics.enable_wandb and cfg.metrics.wandb_mode != "disabled":
            require_wandb("[metrics] enable_wandb = true")
        self.owns_stop, self.stop = stop is None, stop or StopRequest()
        self.started = time.monotonic()
        self.stopped_by: str | None = None  # the stop signal that ended the run early
        self.last_validation: tuple[int, float] | None = None
        self.history: list[StepStats] = []

        # Fault detection first: a hang in start-up (rendezvous, compile) is reported too.
        rank = int(os.environ.get("RANK", "0"))
        self.heartbeat = Heartbeat(self.paths.heartbeat, rank) if cfg.fault.heartbeat else None
        self.watchdog = StepWatchdog(cfg.fault, self.paths.fault, rank, self.heartbeat)
        try:
            # Distributed: one process per device, all of them data-parallel.
            self.device = device_for_rank()
            self.owns_process_group = init_distributed(self.device, cfg.fault.first_step_timeout_seconds + 60,
                                                       self.paths.fault)
            self.watchdog.listen(FailureChannel.of_job())  # another rank's failure, the launcher's loss
            self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
            self.mesh = build_mesh(cfg.parallelism, self.device)
            torch.manual_seed(cfg.debug.seed)
            if cfg.debug.deterministic:
                set_deterministic()

            # The tokenizer fixes the vocabulary unless the config sets a (large enough) one.
            self.tokenizer = build_tokenizer(cfg.data.tokenizer, cfg.data.tokenizer_path)
            self.cfg = cfg = derive(cfg, self.world_size, self.tokenizer.vocab_size)
            log_setup(cfg, self.tokenizer.vocab_size, self.device, self.paths.root)
            # Data first: the training sources opened, the held-out text read (and kept); text that gives no batch
            # stops the run in seconds. The context-parallel ranks of a data-parallel group read the same batches.
            self.dp_rank, self.dp_world_size = data_parallel_rank(self.mesh)
            self.dataloader = build_dataloader(cfg.data, self.tokenizer, t.seq_len, cfg.model.vocab_size,
                                               t.local_batch_size, self.dp_rank, self.dp_world_size, cfg.recall)
            self.held_out = HeldOutSets(cfg.data, cfg.validation, self.tokenizer, t.seq_len, t.local_batch_size,
                                        self.dp_rank, self.dp_world_size) if cfg.validation.enable else None
            self.evals = InRunEvals(cfg, self.tokenizer, self.device, self.dp_rank, self.dp_world_size)
            for sets, what in ((self.held_out, "validation"), (self.evals.positions, "[eval] position")):
                if sets is not None:
                    agreed_batches(sets, self.device, what)

            # Model: its kernels checked here ([model] verify_kernels; a resume keeps its checkpoint's family); built
            # on meta, wrapped, materialised, initialised.
            folders = folder_check(cfg.checkpoint, self.paths.checkpoints)
            resuming = folders.resume_target() if cfg.checkpoint.enable else None
            family, self.speed = checked_kernels(cfg, self.device, *kernel_fault(cfg.debug),
                                                 trained=recorded_kernels(resuming)) \
                if m.attention == "nsa" else (None, None)
            cp = cfg.parallelism.context_parallel_degree
            multiple = cp_multiple(m, cp)
            with torch.device("meta"):  # under cp the sequence is padded to a multiple of 2 x cp chunks
                model = Transformer(cfg.model, -(-t.seq_len // multiple) * multiple, family)
            parallelize(model, self.mesh, ac_layers(cfg.model, cfg.activation_checkpoint), cfg.compile, t,
                        cfg.parallelism, multiple)
            model.to_empty(device=self.device)
            model.init_weights(cfg.debug.seed)
            self.model = model
            self.params = [p for p in model.parameters() if p.requires_grad]
            flops = model.flops_per_token(t.seq_len)
            logger.info("model: %s, %.2fM parameters, %.3f GFLOP per token",
                        describe_attention(m, family), sum(p.numel() for p in self.params) / 1e6, flops / 1e9)

            self.optimizer = build_optimizer(model, cfg.optimizer)
            self.lr_scheduler = build_lr_scheduler(self.optimizer, t.steps, cfg.lr_scheduler)
            self.grad_accum_steps = grad_accum_steps(cfg)
            self.throughput = Throughput(t.global_batch_size * t.seq_len, flops, peak_flops(cfg.metrics, self.device),
                                         self.world_size)
            self.shares = SourceShares(data_sources(cfg.data), self.tokenizer.eos_id, self.device,
                                       self.world_size // self.dp_world_size, cfg.data.new_weights_on_resume)
            self.batches = StepBatches(self.dataloader, self.grad_accum_steps, self.device, cfg.data.source == "datasets",
                                       t.document_masking, self.rank, self.shares, self.throughput.data_wait)
            self.documents = self.batches.documents
            self.guard = UpdateGuard(cfg.fault, self.rank, self.world_size)

            # Checkpoint: resume everything (model, optimizer, schedule, data, RNG, step) if there is one.
            self.state = TrainState(dp_world_size=self.dp_world_size)
            self.checkpointer = CheckpointManager(
                cfg.checkpoint, folder=self.paths.checkpoints, config_toml=to_toml(cfg), model=model,
                optimizer=self.optimizer, lr_scheduler=self.lr_scheduler, dataloader=self.dataloader,
                train_state=self.state, dp_rank=self.dp_rank, dp_world_size=self.dp_world_size,
                other_owner=lambda: other_holder(self.paths.root, job_key()),
                records={"shares": self.shares, "guard": self.guard,
                         **({"spikes": self.guard.spikes} if self.guard.spikes else {})},
                check=folders, kernels=family.name if family is not None else None)
            install_faults(cfg.debug, model=model, optimizer=self.optimizer, checkpointer=self.checkpointer,
                           dataloader=self.dataloader, heartbeat=self.heartbeat, rank=self.rank,
                           world_size=self.world_size, current_step=lambda: self.state.step,
                           batches_per_step=self.grad_accum_steps)
            resumed = self.checkpointer.load()
            self.first_step = self.state.step + 1  # compiles and warms up: its own time limit
            if restart := restart_line(resumed, self.state.step):
                logger.info("%s", restart)
            self.metrics = MetricsLogger(cfg.metrics, self.paths.tensorboard, self.rank, t.steps, self.paths.root,
                                         dataclasses.asdict(cfg), self.state.step)
            if self.speed is not None:  # `auto`'s measurement at the run's first step (0 unless resumed)
                self.metrics.log_scalars(self.state.step, {"attention/nsa_vs_dense": self.speed.ratio})
            if self.rank == 0:
                self.paths.config.write_text(self.checkpointer.config_toml)
            logger.info("training %d steps%s: global batch %d = %d data-parallel ranks x %d local x %d accumulation, "
                        "seq_len %d%s", t.steps, f" ({max(t.steps - self.state.step, 0)} remain after step "
                        f"{self.state.step})" if self.state.step else "", t.global_batch_size, self.dp_world_size,
                        t.local_batch_size, self.grad_accum_steps, t.seq_len,
                        f", each sequence split across {cp} context-parallel ranks" if cp > 1 else "")
        except BaseException:
            self.release()
            raise

    def forward_backward(self, inputs: torch.Tensor, labels: torch.Tensor, document_ids: torch.Tensor | None = None
                         ) -> torch.Tensor:
        """One micro-batch: fp32 cross-entropy, backward of loss / accumulation steps."""
        loss = self.loss(self.model(inputs, document_ids), labels)
        (loss / self.grad_accum_steps).backward()
        return loss.detach()

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The mean cross-entropy of this rank's micro-batch (its share under context parallelism)."""
        return lm_loss(logits, labels, self.model.cp)

    def train_step(self, batches: Iterator[Sample]) -> tuple[torch.Tensor, float, float]:
        """Accumulate over micro-batches, clip, check, step.

        Returns (local mean loss, its value, the global gradient norm): one host sync per step,
        which the non-finite check needs before it lets the optimizer step.
        """
        self.optimizer.zero_grad(set_to_none=True)
        set_explore_step(self.model, self.state.step)  # `sel_score_explore` draws other blocks each step
        losses = [self.forward_backward(*batch) for batch in self.batches.fetch(batches)]
        if self.state.step == self.first_step and self.cfg.debug.report_missing_grads:
            report_missing_grads(self.model)
        for p in self.params:  # unused (a branch switched off): a 0 gradient keeps its optimizer state, which
            if p.grad is None:  # a checkpoint needs to load into a fresh optimizer (DCP initialises every state)
                p.grad = torch.zeros_like(p)
        grad_norm = clip_grad_norm_(self.params, self.cfg.training.max_norm)
        loss = torch.stack(losses).mean()
        loss_value, norm_value, mean_loss = self.guard.values(loss, grad_norm)
        if not math.isfinite(norm_value):  # the global norm: every rank takes the same branch
            where, step = first_nonfinite_grad(self.model), self.state.step
            self.optimizer.zero_grad(set_to_none=True)
            self.guard.nonfinite(step, loss_value, norm_value, where,  # soon after a resume: suspect that checkpoint
                                 suspect(self.checkpointer.resumed_from, step - self.first_step + 1))
        elif self.guard.spike_allows(self.state.step, mean_loss, norm_value, self.batch_line):
            self.optimizer.step()
        self.lr_scheduler.step()
        return loss, loss_value, norm_value

    def roll_back(self) -> bool:
        """Spikes enough for `[fault] spikes = "rollback"`: the state of the newest checkpoint before the first of
        them, its spike estimate too, the data going on from here. Whether there was one to roll back to."""
        why, self.guard.roll_back_due = self.guard.roll_back_due, ""
        target = self.checkpointer.roll_back(self.guard.roll_back_before, {"spikes": self.guard.spikes})
        if target is not None:
            self.metrics.wandb.rewind(self.state.step)
        self.throughput.start(self.state.step)
        logger.warning("%s: %s", why, f"rolled back to {target}; training goes on from step {self.state.step} "
                       f"with the next batches" if target else "no checkpoint before it to roll back to: going on")
        return target is not None

    def batch_line(self) -> str:
        """The step's batch for a spike's line: this rank's sources, and a prepared run's global samples."""
        where, state = self.shares.batch_line(self.batches.sources), self.batches.loader_at_start or {}
        if "next" in state:
            where += f", prepared global samples {state['next']}..{state['next'] + self.cfg.training.global_batch_size - 1}"
        return where

    def log_step(self, loss: torch.Tensor, grad_norm: float, lr: float) -> None:
        """The console line and TensorBoard scalars (the loss averaged over ranks)."""
        loss = loss.detach().clone()
        dist.all_reduce(loss, op=dist.ReduceOp.SUM)
        step_time, tokens_per_s, mfu, data_wait = self.throughput.window(self.state.step)
        stats = StepStats(self.state.step, loss.item() / self.world_size, grad_norm, lr, tokens_per_s, mfu,
                          peak_memory_gib(self.device), step_time, data_wait)
        self.metrics.log(stats)
        if self.cfg.metrics.nsa_stats:
            inputs, labels, documents = self.batches.last  # a recall batch's labels are its answers: their gates too
            answers = labels != IGNORE_INDEX if self.cfg.data.source == "recall" else None
            self.metrics.log_scalars(self.state.step, nsa_stats(self.model, inputs, documents, answers))
        self.metrics.log_scalars(self.state.step, self.shares.scalars())
        self.history.append(stats)

    def train(self) -> list[StepStats]:
        """Run from the current step to `training.steps`; returns the logged StepStats."""
        t, v, d = self.cfg.training, self.cfg.validation, self.cfg.debug
        if self.state.step >= t.steps:
            logger.info("already at step %d of training.steps = %d: nothing to train (raise --training.steps to "
                        "continue)", self.state.step, t.steps)
        batches = iter(self.dataloader)
        self.throughput.start(self.state.step)
        while self.state.step < t.steps:
            self.state.step += 1
            step, last = self.state.step, self.state.step == t.steps
            self.throughput.step_started()
            self.watchdog.beat(step, "the training step", first_step_done=step > self.first_step)
            lr = self.lr_scheduler.get_last_lr()[0]
            try:
                with step_profiler(step, d.profile_step, d.memory_snapshot_step, self.paths.profile, self.rank,
                                   self.device):
                    loss, loss_value, norm_value = self.train_step(batches)
            except DataUnavailable as e:  # the step did not run: save the one before, with the data position then
                self.state.step -= 1
                self.stop_for_data(e, self.batches.loader_at_start)
            except SourceEnded as e:
                self.state.step -= 1
                self.end_of_data(e)
                break
            self.state.tokens_seen += t.global_batch_size * t.seq_len
            if self.guard.roll_back_due and self.roll_back():
                continue
            if step == self.first_step:
                set_collective_timeout(self.cfg.fault.collective_timeout_seconds)
                if d.dtype_report:
                    logger.info(dtype_report(self.model, self.optimizer, t.mixed_precision_param,
                                             t.mixed_precision_reduce))
            if self.heartbeat is not None:
                step_time, tokens_per_s = self.throughput.last_step()
                self.heartbeat.write(step=step, loss=loss_value, grad_norm=norm_value, step_time_s=round(step_time, 4),
                                     tokens_per_s=round(tokens_per_s),
                                     memory_gib=round(peak_memory_gib(self.device), 3),
                                     rss_gib=round(current_rss_gib(), 4),
                                     data_wait_s=round(self.throughput.data_wait_s, 4), skipped=self.guard.skipped)
            self.watchdog.beat(step, "validation, logging and checkpointing", first_step_done=True)
            stopping = self.stop.agreed(self.device)  # a stop signal on any rank, agreed by all
            if v.enable and (step % v.freq == 0 or last) and not stopping:  # stopping: save first, quickly
                with self.throughput.paused():
                    try:
                        result = validate(self.model, self.held_out, self.loss, self.documents, self.device,
                                          self.world_size)
                    except DataUnavailable as e:
                        self.stop_for_data(e, None)
                    self.metrics.log_validation(step, result)
                    self.last_validation = (step, result.loss)
            if self.evals.due(step, last) and not stopping:  # new shapes compile: the first step's time limit
                self.watchdog.beat(step, "the evaluations", first_step_done=False)
                with self.throughput.paused():
                    try:
                        self.evals.run(self.model, step, time.monotonic() - self.started, self.metrics)
                    except DataUnavailable as e:
                        self.stop_for_data(e, None)
            if step % self.cfg.metrics.log_freq == 0 or step == 1 or last or stopping:
                self.log_step(loss, norm_value, lr)
            with self.throughput.paused():
                saved = self.checkpointer.maybe_save(step, force=stopping or last)
            if stopping:
                self.stopped_by = self.stop.name or "a stop signal to another rank"
                logger.info("stopped by %s after step %d: %s", self.stopped_by, step,
                            f"checkpoint {saved}; the same command resumes from it" if saved else
                            "nothing saved ([checkpoint] enable = false)")
                break
        self.watchdog.watch_peers(False)  # from here a rank done first may have left
        self.stop.finish_vote()
        if self.cfg.checkpoint.export_at_end and self.state.step == t.steps:
            export_trained(self.model, self.cfg.checkpoint, self.paths.checkpoints, self.state.step,
                           self.checkpointer.config_toml)
        if self.guard.skips_total:
            logger.warning("%d non-finite step(s) were skipped in this run", self.guard.skips_total)
        return self.history

    def stop_for_data(self, error: DataUnavailable, loader_state: dict | None) -> NoReturn:
        """A data source stayed unreadable on some rank (every rank is here): save this step, with the data
        position `loader_state` (None: the loader's own), unless it is saved already; then stop (EXIT_RETRY)."""
        self.stop.finish_vote()
        saved = self.checkpointer.save_now(self.state.step, loader_state)
        where = f"checkpoint {saved}" if saved else "no checkpoint (nothing trained yet, or the save failed)"
        raise DataUnavailable(f"{error.reason}. Stopped after step {self.state.step} with {where}; the same command "
                              f"resumes exactly (exit code {EXIT_RETRY}: retry later)")

    def end_of_data(self, ended: SourceEnded) -> None:
        """A source with `repeat = false` is read to its end on some rank (every rank is here): the step before is
        saved, with the data position then, unless this run trained nothing (a rerun: the source is done)."""
        self.stop.finish_vote()
        if self.state.step < self.first_step:
            logger.info("data: %s. Nothing more to train after step %d: the source is done", ended.reason,
                        self.state.step)
            return
        saved = self.checkpointer.save_now(self.state.step, self.batches.loader_at_start)
        logger.info("data: %s. Stopped after step %d with %s", ended.reason, self.state.step,
                    f"checkpoint {saved}" if saved else "nothing saved")

    def summary(self) -> str:
        """The run in one line: steps, wall time, final losses, the last checkpoint."""
        c = self.checkpointer
        return run_summary(self.state.step, self.cfg.training.steps, self.state.step - self.first_step + 1,
                           time.monotonic() - self.started, self.stopped_by, self.history, self.last_validation,
                           c.last_saved, c.resumed_from, c.failure, self.shares, self.guard.counts())

    def close(self) -> None:
        """Finish what is in flight (an async save), then release threads, files, groups and the folder."""
        try:
            self.checkpointer.close()
        finally:
            self.release()
            if self.owns_process_group:
                dist.destroy_process_group()

    def release(self) -> None:
        """Release this rank's own threads, files, loader workers and folder (no collective; any start-up stage)."""
        self.watchdog.stop()
        if self.owner is not None:
            self.owner.release()
        if hasattr(self, "metrics"):
            self.metrics.close()
        if self.heartbeat is not None:
            self.heartbeat.close()
        if hasattr(self, "dataloader"):  # a checkpoint load starts its workers: they would hold the exit
            shutdown_workers(self.dataloader)
        if self.owns_stop:
            self.stop.close()

    def fail(self, error: BaseException) -> int:
        """Training ended with `error` here, with no collective from now on (the other ranks may never join one):
        its line and traceback, the job told, then an async save in flight completed or set aside; the exit code."""
        w = self.watchdog
        w.watch_peers(False)
        code, line = report_failure(error, self.rank, w.step, w.what, dead_workers(self.dataloader),
                                    self.paths.fault / f"rank{self.rank}_error.txt", self.stop.name, w.channel)
        if self.heartbeat is not None:
            with contextlib.suppress(OSError):  # the disk that failed may be this one
                self.heartbeat.write(event="failed", step=w.step, phase=w.what, line=line, exit_code=code)
        f = self.cfg.fault
        if settled := self.checkpointer.abandon(min(f.failure_save_wait_seconds, f.step_timeout_seconds / 2)):
            logger.warning("%s", settled)
        self.release()
        return code


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the process exit code (see the module docstring)."""
    end_with_launcher()
    setup_logging()
    return run_command("nsa_titan", lambda: _run(argv))


def _run(argv: list[str] | None) -> int:
    cfg, print_config = load_config(argv)
    if print_config:
        if int(os.environ.get("RANK", "0")) == 0:
            print(to_toml(cfg))
        return 0
    stop = StopRequest()
    trainer = None
    try:
        trainer = Trainer(cfg, stop)
        try:
            trainer.train()
        except BaseException as e:  # noqa: BLE001 - every failure ends the same way, with no collective
            code = EXIT_CRASH
            try:
                code = trainer.fail(e)
            finally:  # teardown could wait on threads blocked in a collective
                if trainer.world_size > 1:
                    exit_now(code)
            return code
        trainer.close()  # an async save still in flight is finished here, and its failure known
        logger.info(trainer.summary())
        if trainer.checkpointer.failure is not None:
            report(f"nsa_titan: save error: the run's last save, of step {trainer.checkpointer.failure[0]}, failed "
                   f"(the error line above says why); exit code {EXIT_SAVE_FAILED}")
            return EXIT_SAVE_FAILED
        return 0
    except BadInput:
        raise  # one line and exit code 2 (run_command)
    except Exception as e:
        rank, what = os.environ.get("RANK", "0"), f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
        line = f"nsa_titan: rank {rank} failed: {what}"
        if stop.signal is not None:  # torchrun stops the other ranks after one failed: a consequence (failure.py)
            report(f"nsa_titan: rank {rank} stopped after another rank's failure (stopping on {stop.name}: {what})")
            return 1
        note_failure(line)
        raise
    finally:
        stop.close()
        if trainer is None and dist.is_initialized():  # the trainer failed while starting up
            dist.destroy_process_group()


if __name__ == "__main__":
    leave(main())
