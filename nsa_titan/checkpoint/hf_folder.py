"""A Hugging Face export folder (`nsa_titan.export --format hf`) read without transformers: its
config.json and safetensors, for a warm start (`initial_load_path`), evaluate and generate.

The settings that make the model's maths (ARCHITECTURE) must equal the run's: a folder from
another model config is refused with the keys that differ, before anything is loaded.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any

import torch

from ..config import Model
from ..config.paths import config_of_checkpoint
from ..models.rope import check_source, describe, hf_rope_parameters, rope_of, rope_settings
from .errors import CheckpointError

MODEL_TYPE = "nsa_titan"
ARCHITECTURE = ("attention", "dim", "n_layers", "n_heads", "n_kv_groups", "head_dim", "vocab_size", "ffn_hidden_dim",
                "norm_eps", "rope_theta", "tie_embeddings", "smear", "cmp_block_size", "cmp_stride", "cmp_mlp_hidden",
                "cmp_phi", "sel_block_size", "sel_top_n", "window_size")
"""The `[model]` settings an export must share with the model it is loaded into."""
PREFIX = "model."  # the Transformer's parameters inside NSATitanForCausalLM


def is_hf_folder(path: Path) -> bool:
    """A folder that is not a DCP checkpoint and holds config.json or safetensors."""
    return (path.is_dir() and not (path / ".metadata").exists()
            and ((path / "config.json").is_file() or any(path.glob("*.safetensors"))))


def read_settings(path: Path) -> dict[str, Any]:
    """config.json of an nsa_titan export, its RoPE as `[model]` keys (`models.rope.rope_settings`); a
    CheckpointError for a folder without one or of another model type."""
    config = path / "config.json"
    if not config.is_file():
        raise CheckpointError(f"{path} holds no config.json: it is not a Hugging Face model folder; export one with "
                              f"`python -m nsa_titan.export CHECKPOINT --format hf --output {path}`")
    try:
        settings = json.loads(config.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{config} cannot be read as JSON ({e})") from None
    if settings.get("model_type") != MODEL_TYPE:
        raise CheckpointError(f"{path} holds a '{settings.get('model_type')}' model, not an nsa_titan one: only "
                              f"folders that `nsa_titan.export --format hf` wrote load here")
    return {**settings, **rope_settings(settings)}


def check_settings(path: Path, settings: dict[str, Any], model: Model, scaling: bool = True) -> None:
    """A CheckpointError naming the ARCHITECTURE settings of the export that differ from `model`'s, and
    its RoPE scaling's unless `scaling` is False (an adaptation checks those, `models.rope.check_source`)."""
    wrong = [f"{k} = {settings[k]!r} there, {getattr(model, k)!r} here" for k in ARCHITECTURE
             if k in settings and settings[k] != getattr(model, k)]
    if scaling and hf_rope_parameters(rope_of(settings)) != hf_rope_parameters(model):
        wrong.append(f"RoPE scaling {describe(rope_of(settings))} there, {describe(model)} here")
    if wrong:
        raise CheckpointError(f"{path} was exported from a different model config ({'; '.join(wrong[:5])}): set "
                              f"[model] as the export's config.json has it (its nsa_titan.toml is the whole config)")


def read_hf_folder(path: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(config.json's settings, the Transformer's state dict) of an export folder, sharded or not."""
    from safetensors.torch import load_file

    settings = read_settings(path)
    index = path / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else ["model.safetensors"]
    state: dict[str, torch.Tensor] = {}
    for name in files:
        if not (path / name).is_file():
            raise CheckpointError(f"{path} is missing {name} (named by its config or index): export it again")
        state.update(load_file(path / name))
    state = {k[len(PREFIX):] if k.startswith(PREFIX) else k: v for k, v in state.items()}
    if settings.get("tie_embeddings") and "output.weight" not in state and "tok_embeddings.weight" in state:
        state["output.weight"] = state["tok_embeddings.weight"]  # saved once, as transformers saves tied weights
    return settings, state


def source_settings(path: Path) -> tuple[dict[str, Any], int] | None:
    """(the `[model]` settings, the training seq_len) a checkpoint was trained with: an export's config.json,
    else the config beside a step folder or model file; None where none is found."""
    if is_hf_folder(path):
        settings = read_settings(path)
        return settings, settings.get("max_position_embeddings", 0)
    config = config_of_checkpoint(path)
    if not config.is_file():
        return None
    try:
        saved = tomllib.loads(config.read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise CheckpointError(f"{config}, the config of {path}, cannot be read ({e})") from None
    return saved.get("model", {}), saved.get("training", {}).get("seq_len", 0)


def check_initial_source(path: Path, model: Model) -> tuple[dict[str, Any], int] | None:
    """`source_settings` of an initial load's `path`, after a ConfigError if its RoPE cannot start `model`
    (`models.rope.check_source`: the same, or an unscaled one `model` scales from its training length)."""
    source = source_settings(path)
    if source is not None:
        check_source(source[0], source[1], model, str(path))
    return source
