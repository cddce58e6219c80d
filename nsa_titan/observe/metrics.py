"""Metrics: the one-line-per-step console log, TensorBoard scalars, MFU and memory."""

from __future__ import annotations

import logging
import math
import resource
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch

from ..config import DTYPES, JobConfig, Metrics, data_sources
from ..system import hostcpu
from ..system.env import allocator_setup
from .shares import SourceShares
from .validate import ValidationLoss
from .wandb_run import WandbRun

logger = logging.getLogger(__name__)

# Dense bf16 peak FLOP/s of one device, matched against torch.cuda.get_device_name().
PEAK_BF16_FLOPS = {
    "H200": 989e12,
    "H100 PCIe": 756e12,
    "H100": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "A10G": 125e12,
    "L4": 121e12,
}


def peak_flops(m: Metrics, device: torch.device) -> float | None:
    """Configured peak, else the table's value for this GPU; None on CPU or an unknown GPU."""
    if m.peak_flops > 0:
        return m.peak_flops
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, value in PEAK_BF16_FLOPS.items():
        if key in name:
            return value
    logger.warning("unknown GPU %r: set [metrics] peak_flops to get MFU", name)
    return None


def peak_memory_gib(device: torch.device) -> float:
    """Peak memory so far: reserved by the CUDA allocator, or the process's max RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_reserved(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def current_rss_gib() -> float:
    """This process's resident memory now (the heartbeat's leak check; peak_memory_gib only grows)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**30


def tb_run_folder(root: Path) -> Path:
    """A new folder under `root` for this run's TensorBoard events, named by its start time, so that
    separate runs (a resume, a restart) show as separate curves."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    folder, k = root / stamp, 1
    while folder.exists():
        k += 1
        folder = root / f"{stamp}-{k}"
    return folder


@dataclass
class StepStats:
    step: int
    loss: float
    grad_norm: float
    lr: float
    tokens_per_s: float
    mfu: float | None
    memory_gib: float
    step_time_s: float
    """Mean over the steps since the last log line."""
    data_wait: float
    """Fraction of the time since the last log line spent waiting for batches."""


class Throughput:
    """The clock of the training loop: each step's time and tokens/s (the heartbeat), and per window
    between log lines the mean step time, tokens/s, MFU and the share spent waiting for data.
    Time inside `paused()` (validation, checkpoints) counts in neither."""

    def __init__(self, tokens_per_step: int, flops_per_token: float, peak_flops: float | None, world_size: int):
        self.tokens_per_step, self.flops_per_token = tokens_per_step, flops_per_token
        self.peak_flops, self.world_size = peak_flops, world_size
        self.window_start = self.step_start = time.perf_counter()
        self.window_step, self.data_wait_s = 0, 0.0

    def start(self, step: int) -> None:
        """A new window after `step` (the loop's start, or a log line)."""
        self.window_start, self.window_step, self.data_wait_s = time.perf_counter(), step, 0.0

    def step_started(self) -> None:
        self.step_start = time.perf_counter()

    @contextmanager
    def paused(self) -> Iterator[None]:
        start = time.perf_counter()
        yield
        self.window_start += time.perf_counter() - start

    @contextmanager
    def data_wait(self) -> Iterator[None]:
        """Around waiting for a batch."""
        start = time.perf_counter()
        yield
        self.data_wait_s += time.perf_counter() - start

    def last_step(self) -> tuple[float, float]:
        """(seconds, tokens/s) of the step since `step_started`."""
        seconds = time.perf_counter() - self.step_start
        return seconds, self.tokens_per_step / seconds

    def window(self, step: int) -> tuple[float, float, float | None, float]:
        """(mean step time, tokens/s, MFU or None, data-wait share) since the window began; then a new one."""
        elapsed = time.perf_counter() - self.window_start
        step_time = elapsed / max(1, step - self.window_step)
        tokens_per_s = self.tokens_per_step / step_time
        mfu = tokens_per_s / self.world_size * self.flops_per_token / self.peak_flops if self.peak_flops else None
        data_wait = self.data_wait_s / elapsed if elapsed > 0 else 0.0
        self.start(step)
        return step_time, tokens_per_s, mfu, data_wait


class MetricsLogger:
    """Formats the step metrics for the console; writes them to TensorBoard and W&B (rank 0 only)."""

    def __init__(self, m: Metrics, tb_root: Path, rank: int, total_steps: int, root: Path, config: dict,
                 step: int = 0):
        """`root`, `config`: the run's folder, where W&B keeps its files and run id, and the config W&B records;
        `step`: the step the training starts from."""
        self.total_steps = total_steps
        self.writer = None
        if m.enable_tensorboard and rank == 0:
            from torch.utils.tensorboard import SummaryWriter

            log_dir = tb_run_folder(tb_root)
            self.writer = SummaryWriter(log_dir=str(log_dir))
            logger.info("TensorBoard logs in %s", log_dir)
        self.wandb = WandbRun(m, root, config, rank, step)

    def log(self, s: StepStats) -> None:
        width = len(str(self.total_steps))
        parts = [
            f"step {s.step:>{width}}/{self.total_steps}",
            f"loss {s.loss:7.4f}",
            f"grad_norm {s.grad_norm:8.4f}",
            f"lr {s.lr:.2e}",
            f"tok/s {s.tokens_per_s:,.0f}",
        ]
        if s.mfu is not None:
            parts.append(f"mfu {100 * s.mfu:5.2f}%")
        parts += [f"data {100 * s.data_wait:.1f}%", f"mem {s.memory_gib:.2f}GiB", f"eta {timedelta(seconds=round(s.step_time_s * (self.total_steps - s.step)))}"]
        logger.info(" | ".join(parts))
        scalars = {"loss": s.loss, "grad_norm": s.grad_norm, "lr": s.lr, "tokens_per_s": s.tokens_per_s,
                   "memory_gib": s.memory_gib, "step_time_s": s.step_time_s, "data_wait": s.data_wait}
        if s.mfu is not None:
            scalars["mfu"] = s.mfu
        self.log_scalars(s.step, {f"train/{key}": value for key, value in scalars.items()})

    def log_validation(self, step: int, v: ValidationLoss) -> None:
        """The validation line (a mixture's: also each source's loss) and its scalars."""
        sources = "".join(f" | {label} {loss:.4f}" for label, loss in v.by_source.items())
        logger.info("validation at step %d: loss %.4f | perplexity %.2f | %d batches%s", step, v.loss,
                    math.exp(min(v.loss, 50.0)), v.batches, sources)
        self.log_scalars(step, {"validation/loss": v.loss, "validation/perplexity": math.exp(min(v.loss, 50.0)),
                                **{f"validation/loss/{label}": loss for label, loss in v.by_source.items()}})

    def log_scalars(self, step: int, scalars: dict[str, float]) -> None:
        """Scalars to TensorBoard and W&B (not the console)."""
        if self.writer is not None:
            for key, value in scalars.items():
                self.writer.add_scalar(key, value, step)
        self.wandb.log(scalars, step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.wandb.close()


def run_summary(step: int, steps: int, steps_in_run: int, wall_s: float, stopped_by: str | None,
                history: list[StepStats], validation: tuple[int, float] | None, saved: Path | None,
                resumed_from: Path | None, failure: tuple[int, str] | None, shares: SourceShares | None = None,
                spikes: tuple[int, int] = (0, 0)) -> str:
    """A run in one line: the step reached (or the signal that stopped it), this run's steps and wall time,
    the final training and validation losses, loss spikes, a mixture's realized shares (the run's), the last checkpoint
    it committed (and a failed last save)."""
    how = f"stopped by {stopped_by} at" if stopped_by else "reached"
    parts = [f"run summary: {how} step {step} of {steps} ({steps_in_run} steps in this run, "
             f"{timedelta(seconds=round(wall_s))})"]
    if history:
        parts.append(f"loss {history[-1].loss:.4f}")
    if validation is not None:
        parts.append(f"validation loss {validation[1]:.4f} (step {validation[0]})")
    if spikes[0]:
        parts.append(f"{spikes[0]} loss spike{'s' * (spikes[0] != 1)} ({spikes[1]} update{'s' * (spikes[1] != 1)} "
                     f"skipped)")
    if shares is not None and len(shares.labels) > 1:
        parts.append(shares.line())
    resumed = f" (it resumed from {resumed_from})" if resumed_from else ""
    parts.append(f"last checkpoint {saved}" if saved else f"no checkpoint saved by this run{resumed}")
    if failure is not None:
        parts.append(f"the save of step {failure[0]} FAILED")
    return " | ".join(parts)


def log_setup(cfg: JobConfig, vocab: int, device: torch.device, output: Path) -> None:
    """The startup lines: what the run reads (`vocab`: the tokenizer's) and where it writes (`output`)."""
    d, ck = cfg.data, cfg.checkpoint
    if cfg.job.description:
        logger.info("job: %s", cfg.job.description)
    r = cfg.recall
    recall = (f"recall drill (seed {d.seed}, rows of {r.pairs} single-token pairs)" if r.drill else
              f"recall task (seed {d.seed}, {r.pairs} pairs of {r.key_tokens}-token keys and {r.value_tokens}-token "
              f"values, each asked {r.asks}x, {r.distance_scale} distances {r.min_distance}..{r.max_distance or 'max'})")
    sources = data_sources(d)
    total = sum(s.weight for s in sources)
    text = (f"'{d.path}' (name {d.name or '-'}, split {d.split}, column {d.text_column})" if len(sources) < 2 else
            "a mixture of " + ", ".join(f"'{s.label}' {s.weight / total:.0%}" for s in sources))
    source = {"synthetic": f"synthetic tokens (seed {d.seed})", "recall": recall,
              }.get(d.source, text + (f", prepared in {d.prepared}" if d.prepared else ""))
    logger.info("data: %s | tokenizer %s%s, %d tokens -> model vocab %d | %d loader workers per rank",
                source, d.tokenizer, f" {d.tokenizer_path}" if d.tokenizer == "sentencepiece" else "",
                vocab, cfg.model.vocab_size, d.num_workers)
    logger.info("host allocator: %s", allocator_setup())
    if device.type == "cpu":
        logger.info("host CPU: %s", hostcpu.describe())
    if why := hostcpu.bf16_warning(device, DTYPES[cfg.training.mixed_precision_param]):
        logger.warning(why)
    logger.info("output: %s | checkpoints %s", output.resolve(),
                f"in {ck.folder}/ every {ck.interval} steps and at the end ({ck.async_mode})" if ck.enable
                else "off ([checkpoint] enable = false)")
