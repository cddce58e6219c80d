"""Loading a trained model for evaluation and generation: a DCP step folder, an exported file or a
Hugging Face export folder."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ..config import JobConfig, check_context, cp_multiple, derive, load_config, max_context
from ..config.paths import config_of_checkpoint
from ..data import Tokenizer, build_tokenizer
from ..models.transformer import Transformer
from .errors import CheckpointError
from .hf_folder import check_settings, is_hf_folder, read_hf_folder, read_settings
from .model_file import check_fit, load_tensors, read_model_file, shapes


SINGLE_PROCESS = ["--parallelism.data_parallel_shard_degree", "-1", "--parallelism.data_parallel_replicate_degree",
                  "1", "--parallelism.context_parallel_degree", "1"]
"""The parallelism overrides under which a checkpoint's config is read for inference."""
Context = tuple[str, Callable[[Tokenizer], int]] | None
"""What asks for a context, and its length in tokens given the model's tokenizer."""


def load_model(checkpoint: str, config: str | None = None, overrides: list[str] | None = None,
               device: str = "cpu", context_parallel: int = 1, context: Context = None
               ) -> tuple[Transformer, Tokenizer, JobConfig]:
    """The model (eval mode, on `device`), its tokenizer and its config (by default the one saved with
    the checkpoint). The model takes contexts up to its declared maximum (`config.max_context`);
    `context` (what asks for one, and its tokens given the tokenizer) is checked against it once the
    checkpoint is read and fits, before any use. With `context_parallel` > 1 the config is checked
    for that split (a ConfigError if it cannot run) and the model takes the padded sequence
    (`parallel.apply_cp` then splits it)."""
    path = Path(checkpoint)
    if not path.exists():
        raise CheckpointError(f"checkpoint '{checkpoint}' not found: give a step-N folder, an exported .pt file or "
                              f"a Hugging Face export folder")
    if is_hf_folder(path):
        read_settings(path)  # an nsa_titan export, before its config is looked for
    config_path = Path(config) if config else config_of_checkpoint(path)
    if not config and not config_path.is_file():
        raise CheckpointError(f"no config found for {checkpoint} (looked for {config_path}); pass the training "
                              f"config with --config")
    # One process reads the model, whatever layout trained it (the saved config has that run's degrees).
    split = ["--parallelism.context_parallel_degree", str(context_parallel), "--metrics.nsa_stats", "false"]
    cfg, _ = load_config(["--config", str(config_path), *SINGLE_PROCESS, *(overrides or []),
                          *(split if context_parallel > 1 else [])], world_size=context_parallel)
    tokenizer = build_tokenizer(cfg.data.tokenizer, cfg.data.tokenizer_path)
    cfg = derive(cfg, context_parallel, tokenizer.vocab_size)
    multiple = cp_multiple(cfg.model, context_parallel) if context_parallel > 1 else 1  # the cp padding
    if is_hf_folder(path):
        settings, state = read_hf_folder(path)
        check_settings(path, settings, cfg.model)
    else:
        state = load_tensors(path) if path.is_dir() else read_model_file(path)
    model = Transformer(cfg.model, -(-max_context(cfg) // multiple) * multiple)
    model.init_weights(0)  # the rope table; every parameter is then overwritten
    check_fit(f"checkpoint '{checkpoint}'", shapes(state), shapes(model.state_dict()))
    model.load_state_dict({k: v.float() for k, v in state.items()})
    if context is not None:
        check_context(cfg, context[1](tokenizer), context[0])
    return model.to(device).eval(), tokenizer, cfg
