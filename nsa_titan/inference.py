"""Loading a trained model for evaluation and generation: a DCP step folder or an exported file."""

from __future__ import annotations

from pathlib import Path

import torch

from .checkpoint import CheckpointError
from .config import JobConfig, load_config
from .data import Tokenizer, build_tokenizer, vocab_for_model
from .export import load_tensors
from .models.transformer import Transformer


def find_config(checkpoint: Path) -> Path:
    """The config.toml a checkpoint was trained with: in a step folder, or beside/above a file."""
    for candidate in (checkpoint / "config.toml", checkpoint.parent / "config.toml",
                      checkpoint.parent.parent / "config.toml"):
        if candidate.is_file():
            return candidate
    raise CheckpointError(f"no config.toml found for {checkpoint}; pass the training config with --config")


def load_model(checkpoint: str, config: str | None = None, overrides: list[str] | None = None,
               max_seq_len: int = 0, device: str = "cpu") -> tuple[Transformer, Tokenizer, JobConfig]:
    """The model (eval mode, on `device`), its tokenizer and its config."""
    path = Path(checkpoint)
    if not path.exists():
        raise CheckpointError(f"checkpoint '{checkpoint}' not found: give a step-N folder or an exported .pt file")
    cfg, _ = load_config(["--config", str(Path(config) if config else find_config(path)), *(overrides or [])],
                         world_size=1)
    tokenizer = build_tokenizer(cfg.data.tokenizer, cfg.data.tokenizer_path)
    cfg.model.vocab_size = vocab_for_model(tokenizer, cfg.model.vocab_size, cfg.data.source != "synthetic")
    if path.is_dir():
        state = load_tensors(path, "model")
    else:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:
            raise CheckpointError(f"'{checkpoint}' is not a torch.save state dict: {e}") from None
    model = Transformer(cfg.model, max(max_seq_len, cfg.training.seq_len))
    model.init_weights(0)  # the rope table; every parameter is then overwritten
    ours = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    theirs = {k: tuple(v.shape) for k, v in state.items()}
    if ours != theirs:
        diff = sorted(k for k in ours.keys() | theirs.keys() if ours.get(k) != theirs.get(k))
        raise CheckpointError(f"checkpoint '{checkpoint}' does not fit the config's model (first differences: "
                              + ", ".join(f"{k}: {theirs.get(k)} saved, {ours.get(k)} here" for k in diff[:3])
                              + "); pass the config it was trained with")
    model.load_state_dict({k: v.float() for k, v in state.items()})
    return model.to(device).eval(), tokenizer, cfg
