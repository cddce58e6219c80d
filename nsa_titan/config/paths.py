"""Every path of a run's output folder (`[job] dump_folder`), named once:

    <dump_folder>/
      config.toml              the run's derived config (what reproduces it)
      <checkpoint.folder>/     step-N/ checkpoints (each with its config.toml), model-step-N.pt exports
      <metrics.save_tb_folder>/<start time>/   TensorBoard events of one run
      heartbeat/rank<R>.jsonl  one record per step per rank
      wandb/, wandb_run_id     W&B's files ([metrics] enable_wandb) and the run id a resumed run continues
      fault/                   watchdog stack dumps (and NCCL traces on GPUs)
      profile/                 profiler traces and memory snapshots of chosen steps

A model file (an export) carries its config beside it: `name.pt` and `name.toml`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from .schema import ConfigError, JobConfig


@dataclass(frozen=True)
class RunPaths:
    root: Path
    config: Path
    checkpoints: Path
    tensorboard: Path
    heartbeat: Path
    fault: Path
    profile: Path

    @classmethod
    def of(cls, cfg: JobConfig) -> RunPaths:
        root = Path(cfg.job.dump_folder)
        return cls(root=root, config=root / "config.toml", checkpoints=root / cfg.checkpoint.folder,
                   tensorboard=root / cfg.metrics.save_tb_folder, heartbeat=root / "heartbeat",
                   fault=root / "fault", profile=root / "profile")


def model_config_path(model_file: Path) -> Path:
    """Where an exported model file's config is written: beside it, `name.toml` for `name.pt`."""
    return model_file.with_suffix(".toml")


def config_of_checkpoint(checkpoint: Path) -> Path:
    """Where the config a checkpoint was trained with is: a step folder's config.toml, a Hugging Face
    export's nsa_titan.toml, or a model file's `name.toml`."""
    if checkpoint.is_dir():
        return checkpoint / ("config.toml" if (checkpoint / "config.toml").exists() else "nsa_titan.toml")
    return model_config_path(checkpoint)


def make_folder(path: Path, what: str) -> None:
    """Create `path` (with parents) and check that files can be written there; ConfigError if not."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except FileExistsError:
        raise ConfigError(f"{what} = '{path}' is a file, not a folder: choose another path") from None
    except OSError as e:
        reason = "a part of the path is a file" if isinstance(e, NotADirectoryError) else e.strerror
        raise ConfigError(f"{what} = '{path}' cannot be created or written ({reason}): choose a folder "
                          f"you can write to") from None
