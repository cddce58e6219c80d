"""A model as one file (`torch.save` of its full state dict, with `name.toml`, its config, beside it),
reading a DCP checkpoint's model without the training setup, and the check "does this state
dict fit this model" that every loader uses."""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Mapping
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ..config import DTYPES
from ..config.paths import model_config_path
from .errors import CheckpointError
from .folders import NO_HASHES, newest_verified, recorded_hashes, verify

Shapes = Mapping[str, tuple[int, ...]]
logger = logging.getLogger(__name__)


def shapes(state: Mapping[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor in a state dict."""
    return {k: tuple(v.shape) for k, v in state.items() if isinstance(v, torch.Tensor)}


def saved_shapes(path: Path, prefix: str = "model") -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor under `prefix` in the DCP checkpoint at `path` (metadata only)."""
    meta = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    return {k[len(prefix) + 1:]: tuple(v.size) for k, v in meta.items()
            if k.startswith(prefix + ".") and isinstance(v, TensorStorageMetadata)}


def check_fit(source: str, saved: Shapes, ours: Shapes, what: str = "model") -> None:
    """Raise a CheckpointError naming the first differences when the saved tensors are not exactly
    this model's (names and shapes)."""
    missing, extra = sorted(set(ours) - set(saved)), sorted(set(saved) - set(ours))
    wrong = [f"{k}: {saved[k]} in the checkpoint, {ours[k]} here" for k in sorted(set(ours) & set(saved))
             if tuple(saved[k]) != tuple(ours[k])]
    if missing or extra or wrong:
        detail = "; ".join(filter(None, [
            f"shapes differ: {', '.join(wrong[:4])}" if wrong else "",
            f"missing from the checkpoint: {', '.join(missing[:4])}" if missing else "",
            f"not in this model: {', '.join(extra[:4])}" if extra else "",
        ]))
        raise CheckpointError(f"{source} does not fit this {what} ({detail}); it was saved by a different model "
                              f"config: use that config, or another checkpoint")


def load_tensors(path: Path, prefix: str = "model") -> dict[str, torch.Tensor]:
    """Every tensor under `prefix` in the DCP checkpoint at `path`, full size, on the CPU, in one process,
    once its files match their manifest (sizes and content)."""
    problem = verify(path) if path.is_dir() else "no such checkpoint folder"
    if problem:
        good = newest_verified(path) if path.is_dir() else None
        raise CheckpointError(f"checkpoint {path} cannot be read: {problem}" +
                              (f"; {good.path} is the newest beside it that verifies" if good else ""))
    if recorded_hashes(path) is None:
        logger.warning("checkpoint %s %s", path, NO_HASHES)
    meta = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    state = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in meta.items()
             if k.startswith(prefix + ".") and isinstance(v, TensorStorageMetadata)}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=str(path), no_dist=True)
    return {k[len(prefix) + 1:]: v for k, v in state.items()}


def read_model_file(path: Path) -> dict[str, torch.Tensor]:
    """The state dict of a model file."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(f"'{path}' is not a torch.save state dict: {e}") from None


def write_model_file(state: Mapping[str, torch.Tensor], path: Path, dtype: str, config_toml: str | None) -> int:
    """Write `state` in `dtype` to `path` (atomically) and its config, when known, to `name.toml`;
    returns the bytes written."""
    if path.is_dir():
        raise CheckpointError(f"{path} is a folder: give the path of the .pt file to write")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CheckpointError(f"{path}: its folder cannot be created ({e.strerror})") from None
    tmp = path.with_name(path.name + ".tmp")
    torch.save({k: v.to(DTYPES[dtype]) for k, v in state.items()}, tmp)
    if config_toml is not None:
        model_config_path(path).write_text(config_toml)
    os.replace(tmp, path)
    return path.stat().st_size
