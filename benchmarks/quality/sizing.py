"""Equal parameter counts for the quality and recall reports: the dense baseline's MLP widened
until it has as many parameters as the NSA model (which carries per-branch K/V projections, the
compression MLPs and the gates on top of the same queries, output and MLP)."""

from __future__ import annotations

import dataclasses
import warnings

import torch

from nsa_titan.config import JobConfig, Model, load_config, padded_vocab
from nsa_titan.data import build_tokenizer
from nsa_titan.models.transformer import Transformer


def param_count(model: Model, seq_len: int) -> int:
    """Parameters of the model `model` describes (built on the meta device: no memory, no init)."""
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return sum(p.numel() for p in Transformer(model, seq_len).parameters())


def resolved(overrides: list[str]) -> JobConfig:
    """The config `run_train.sh <overrides>` would run, vocabulary included."""
    cfg, _ = load_config(overrides, world_size=1)
    if cfg.model.vocab_size == 0 and cfg.data.source == "datasets":
        cfg, _ = load_config(overrides + ["--model.vocab_size", str(_tokenizer_vocab(cfg))], world_size=1)
    return cfg


def _tokenizer_vocab(cfg: JobConfig) -> int:
    return padded_vocab(build_tokenizer(cfg.data.tokenizer, cfg.data.tokenizer_path).vocab_size)


def dense_ffn_for(nsa: Model, seq_len: int) -> tuple[int, int, int]:
    """(ffn_hidden_dim, dense parameters, NSA parameters): the SwiGLU width (a multiple of 8) that
    brings the dense model closest to the NSA model's parameter count."""
    target = param_count(nsa, seq_len)
    dense = dataclasses.replace(nsa, attention="dense")
    base = param_count(dataclasses.replace(dense, ffn_hidden_dim=8), seq_len)
    per_unit = (param_count(dataclasses.replace(dense, ffn_hidden_dim=16), seq_len) - base) / 8
    hidden = max(8, 8 * round((8 + (target - base) / per_unit) / 8))
    return hidden, param_count(dataclasses.replace(dense, ffn_hidden_dim=hidden), seq_len), target
