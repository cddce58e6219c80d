"""Job configuration in three parts: the schema (`schema.py`), parsing a TOML file plus
`--section.key value` overrides (`parsing.py`), and validation (`validation.py`); the values a
run derives from it come from `derived.py`."""

from .derived import (
    ac_layers, check_context, data_sources, derive, dp_world, grad_accum_steps, load_config, max_context, padded_vocab,
    validation_sets,
)
from .parsing import USAGE, parse_args, resolve_path, to_toml
from .schema import (
    DEFAULT_CONFIG, DTYPES, REPO_ROOT, ActivationCheckpoint, Checkpoint, Compile, ConfigError, Data, Debug, Eval, Fault,
    Job, JobConfig, LRScheduler, Metrics, Model, Optimizer, Parallelism, Recall, Source, Training, Validation,
)
from .validation import HUB_ID, RETRY_MAX_WAIT_S, URL, cp_multiple, is_remote, retry_wait_total, validate

__all__ = [
    "DEFAULT_CONFIG", "DTYPES", "HUB_ID", "REPO_ROOT", "RETRY_MAX_WAIT_S", "URL", "USAGE", "ActivationCheckpoint",
    "Checkpoint", "Compile", "ConfigError", "Data", "Debug", "Eval", "Fault", "Job", "JobConfig", "LRScheduler", "Metrics",
    "Model", "Optimizer", "Parallelism", "Recall", "Source", "Training", "Validation", "ac_layers", "check_context", "cp_multiple",
    "data_sources", "derive", "dp_world", "grad_accum_steps", "is_remote", "load_config", "max_context", "padded_vocab", "parse_args", "resolve_path",
    "retry_wait_total", "to_toml", "validate", "validation_sets",
]
