"""Export a checkpoint's model: one torch.save file (`--format pt`, read here) or a Hugging Face folder
(`--format hf`, read by transformers, lm-evaluation-harness and `--checkpoint.initial_load_path`).

    python -m nsa_titan.export outputs/m7c/checkpoint/step-1000 --output m7c.pt [--dtype bfloat16]
    python -m nsa_titan.export outputs/m7c/checkpoint/step-1000 --format hf --output m7c-hf [--max_shard_size 2GB]
    python -m nsa_titan.export DENSE_CHECKPOINT --format llama --output dense-llama   # no remote code

Works on one process without the training config: shapes and dtypes come from the checkpoint's
metadata, the settings from its config.toml. `pt` writes the config beside the file (m7c.toml),
where evaluate and generate find it; `hf` writes it into the folder (nsa_titan.toml), with the
tokenizer (see nsa_titan/hf/export.py). Either starts a run with `--checkpoint.initial_load_path`.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Mapping
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from .checkpoint import CheckpointError, load_tensors, read_model_file, write_model_file
from .config import DTYPES
from .config import Checkpoint as CheckpointConfig
from .config.paths import config_of_checkpoint
from .system.cli import ArgumentParser, leave, run_command
from .system.extras import require_hf

logger = logging.getLogger(__name__)


def write_export(state: Mapping[str, torch.Tensor], toml: str | None, source: str, output: Path, dtype: str,
                 fmt: str = "pt", max_shard_size: str = "2GB") -> int:
    """Write a full model state dict (from `source`, named in the export) to `output` in `dtype` and format
    `fmt`, with its training config `toml`; returns the bytes written."""
    if fmt in ("hf", "llama"):
        require_hf(f"nsa_titan.export --format {fmt}")
        from .hf.export import export_hf

        return export_hf(state, toml, source, output, dtype, max_shard_size, fmt)
    return write_model_file(state, output, dtype, toml)


def export(path: Path, output: Path, dtype: str, fmt: str = "pt", max_shard_size: str = "2GB") -> int:
    """Write the model of checkpoint `path` (a step folder or a .pt export) to `output` in `dtype`, with
    its config; returns the bytes written."""
    if not path.exists():
        raise CheckpointError(f"{path}: no such checkpoint folder or exported .pt file")
    state = load_tensors(path) if path.is_dir() else read_model_file(path)
    config = config_of_checkpoint(path)
    return write_export(state, config.read_text() if config.is_file() else None, str(path.resolve()), output, dtype,
                        fmt, max_shard_size)


def export_trained(model: torch.nn.Module, cfg: CheckpointConfig, folder: Path, step: int, config_toml: str
                   ) -> Path | None:
    """The end of a run (`[checkpoint] export_at_end`): the full model gathered on rank 0 (a collective)
    and written there in `export_dtype` with its config, as `model-step-N.pt` or the Hugging Face folder
    `model-step-N-hf/` (`export_format`). Returns the path on rank 0."""
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() != 0:
        return None
    path = folder / (f"model-step-{step}-hf" if cfg.export_format == "hf" else f"model-step-{step}.pt")
    size = write_export(state, config_toml, str((folder / f"step-{step}").resolve()), path, cfg.export_dtype,
                        cfg.export_format)
    logger.info("exported the model (%s) to %s: %.1f MB", cfg.export_dtype, path, size / 1e6)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="nsa_titan.export", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path, help="a complete step-N checkpoint folder (or a .pt export)")
    parser.add_argument("--output", type=Path, required=True, help="the .pt file (pt) or the folder (hf, llama) to write")
    parser.add_argument("--format", choices=["pt", "hf", "llama"], default="pt",
                        help="pt: one torch.save file; hf: a Hugging Face folder (nsa_titan's classes, remote code); "
                             "llama: a dense model as transformers' Llama")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--max_shard_size", default="2GB", help="hf: safetensors shards above this size (e.g. 500MB)")
    args = parser.parse_args(argv)

    def write() -> int:
        size = export(args.checkpoint, args.output, args.dtype, args.format, args.max_shard_size)
        print(f"wrote {args.output} ({size / 1e6:.1f} MB, {args.dtype}, {args.format})")
        return 0

    return run_command("nsa_titan.export", write)


if __name__ == "__main__":
    leave(main())
