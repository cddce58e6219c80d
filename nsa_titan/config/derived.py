"""Derived values: what a run computes from its config, in one place that every entry point calls.

`derive` returns a new, complete `JobConfig` (the one a run uses and saves as its config.toml):
the inferred mesh degrees, the global batch, paths resolved against the repository, and the
model vocabulary from the tokenizer's. The config it is given is not changed.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from pathlib import Path

from .parsing import parse_args, resolve_path
from .schema import ActivationCheckpoint, ConfigError, Data, JobConfig, Model, Source, Validation
from .validation import dp_degrees, last_ac_layer, validate

VOCAB_MULTIPLE = 64
"""The model's vocabulary is the tokenizer's, padded up to a multiple of this (for speed)."""


def padded_vocab(tokenizer_vocab: int) -> int:
    """The tokenizer's vocabulary size padded up to a multiple of VOCAB_MULTIPLE."""
    return -(-tokenizer_vocab // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


def model_vocab(cfg: JobConfig, tokenizer_vocab: int) -> int:
    """`[model] vocab_size`, or the tokenizer's padded up when it is 0. A set size must hold every
    token id, except for the synthetic and recall sources, which draw ids below the model's vocabulary
    (their validation and loss by position, if enabled, still read tokenized text)."""
    configured = cfg.model.vocab_size
    if configured == 0:
        return padded_vocab(tokenizer_vocab)
    reads_text = cfg.validation.enable or (cfg.eval.enable and cfg.eval.position_batches > 0)
    if (cfg.data.source == "datasets" or reads_text) and configured < tokenizer_vocab:
        raise ConfigError(f"[model] vocab_size = {configured} is smaller than the tokenizer's {tokenizer_vocab} "
                          f"tokens; set it to 0 to use the tokenizer's ({padded_vocab(tokenizer_vocab)})"
                          + ("" if cfg.data.source == "datasets" else ", or switch off what reads text here "
                             "([validation] enable, [eval] position_batches)"))
    return configured


def ac_layers(m: Model, ac: ActivationCheckpoint) -> list[int]:
    """The blocks wrapped in activation checkpointing: all (`full`) or every N-th (`selective`),
    among first_layer..last_layer."""
    if ac.mode == "none":
        return []
    last = last_ac_layer(m, ac.last_layer)
    return [i for i in range(m.n_layers)
            if ac.first_layer <= i <= last and (ac.mode == "full" or (i + 1) % ac.every_n_layers == 0)]


def derive(cfg: JobConfig, world_size: int, tokenizer_vocab: int | None = None) -> JobConfig:
    """A validated copy of `cfg` with every derived value filled in (the model vocabulary only when
    `tokenizer_vocab` is given); `cfg` itself is left as it is."""
    validate(cfg, world_size)
    out = copy.deepcopy(cfg)
    p, t = out.parallelism, out.training
    p.data_parallel_replicate_degree, p.data_parallel_shard_degree = dp_degrees(cfg, world_size)
    if t.global_batch_size == -1:
        t.global_batch_size = t.local_batch_size * p.data_parallel_replicate_degree * p.data_parallel_shard_degree
    for section, key in (("data", "path"), ("data", "tokenizer_path"), ("data", "prepared"), ("validation", "path"),
                         ("checkpoint", "initial_load_path")):
        sec = getattr(out, section)
        setattr(sec, key, resolve_path(getattr(sec, key)))
    data_sources(out.data)  # checked here; the config keeps the sources as given (a single `path` stays one)
    if tokenizer_vocab is not None:
        out.model.vocab_size = model_vocab(out, tokenizer_vocab)
    return out


def data_sources(data: Data) -> list[Source]:
    """The sources a run reads, paths resolved and each labelled: `[[data.sources]]`, else the one of `[data]
    path`, `name`, `split` and `text_column`."""
    given = data.sources or [Source(data.path, data.name, data.split, data.text_column)]
    sources = [dataclasses.replace(s, path=local_or_as_given(s.path), label=s.label or source_label(s.path))
               for s in given]
    labels = [s.label for s in sources]
    if len(set(labels)) < len(labels):
        raise ConfigError(f"[[data.sources]] labels {labels}: each label names one source (a default label is the "
                          f"last part of the path); give the sources different labels")
    return sources


def validation_sets(data: Data, v: Validation) -> list[Source]:
    """The held-out sets a run validates on: for a mixture, each source's own (its `[data] holdout` documents,
    else its `[validation] split`, within its length bounds; weighted as in the mixture), unless `[validation]
    path` is given without a holdout; else the one set of `[data] holdout` or `[validation] path` and `split`."""
    if data.sources and not (v.path and not data.holdout):
        return [dataclasses.replace(s, split=s.split if data.holdout else v.split) for s in data_sources(data)]
    path, split = (data.path, data.split) if data.holdout else (v.path or data.path, v.split)
    return [Source(local_or_as_given(path), data.name, split, data.text_column, label="validation")]


def local_or_as_given(path: str) -> str:
    """A source's path, absolute where it is a local file or folder (a prepared folder compares it), else as given."""
    resolved = resolve_path(path)
    return str(Path(resolved).resolve()) if resolved and Path(resolved).exists() else resolved


def source_label(path: str) -> str:
    """A source's default label: the last part of its path or URL, without a file suffix."""
    last = path.rstrip("/").rsplit("/", 1)[-1]
    return last.split(".", 1)[0] or "source"


def max_context(cfg: JobConfig) -> int:
    """The longest context the model is declared for: `[model] max_seq_len`, else rope_original_seq_len x
    rope_factor with a RoPE scaling, else training.seq_len."""
    m = cfg.model
    if m.max_seq_len:
        return m.max_seq_len
    return int(m.rope_original_seq_len * m.rope_factor) if m.rope_scaling != "none" else cfg.training.seq_len


def check_context(cfg: JobConfig, context: int, what: str) -> None:
    """A ConfigError if `context` tokens (`what` asked for them) exceed `max_context`."""
    if context > (limit := max_context(cfg)):
        m = cfg.model
        declared = (f"[model] max_seq_len = {m.max_seq_len}" if m.max_seq_len else
                    f"rope_original_seq_len {m.rope_original_seq_len} x rope_factor {m.rope_factor:g}"
                    if m.rope_scaling != "none" else f"training.seq_len = {cfg.training.seq_len}, no RoPE scaling")
        raise ConfigError(f"{what}: a context of {context:,} tokens is beyond the model's declared maximum of "
                          f"{limit:,} ({declared}): adapt the model to a longer context (docs/long-context.md), or "
                          f"pass --model.max_seq_len {context} to run it past its length anyway")


def dp_world(cfg: JobConfig) -> int:
    """Data-parallel ranks of a derived config: the world size / context_parallel_degree."""
    return cfg.parallelism.data_parallel_replicate_degree * cfg.parallelism.data_parallel_shard_degree


def grad_accum_steps(cfg: JobConfig) -> int:
    """Micro-batches per optimizer step on each rank (of a derived config)."""
    return cfg.training.global_batch_size // (cfg.training.local_batch_size * dp_world(cfg))


def load_config(argv: list[str] | None = None, world_size: int | None = None) -> tuple[JobConfig, bool]:
    """Parse, validate and derive, for the world size torchrun gave (WORLD_SIZE, default 1).
    Returns (the derived config, whether --print_config was given)."""
    cfg, print_config = parse_args(argv)
    return derive(cfg, int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size), print_config
