"""Job configuration: one dataclass per component, TOML file + `--section.key value` overrides.

Everything a run does is decided here, and every bad value stops the run before any work
with a `ConfigError` that names the key, the bad value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import tomli

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = REPO_ROOT / "train_configs" / "debug_model.toml"


class ConfigError(ValueError):
    """A configuration problem, with the key, the bad value and the fix in its message."""


@dataclass
class Job:
    dump_folder: str = "./outputs"
    """Root folder for everything a run writes (TensorBoard, later checkpoints)."""
    description: str = ""


@dataclass
class Model:
    attention: Literal["nsa", "dense"] = "nsa"
    """`nsa`: native sparse attention; `dense`: plain causal attention, the baseline."""
    attn_impl: Literal["fast", "reference"] = "fast"
    """NSA implementation: `fast`, sparse (cost grows with the keys attended, memory linear in
    T; Triton / flash-attn on GPUs when installed); `reference`, the exact definition with
    dense per-branch masks (O(T^2) memory), the yardstick."""
    dim: int = 256
    n_layers: int = 4
    n_heads: int = 4
    n_kv_groups: int = 2
    """Number of KV heads (GQA groups); the query heads of a group share keys and selection."""
    head_dim: int = 64
    vocab_size: int = 0
    """0 means the tokenizer's vocabulary, padded up to a multiple of 64."""
    ffn_hidden_dim: int = 0
    """SwiGLU hidden size; 0 means 8/3 * dim rounded up to a multiple of 64."""
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_embeddings: bool = False
    cmp_block_size: int = 32
    """l: length of a compression block."""
    cmp_stride: int = 16
    """d: stride between compression blocks."""
    cmp_mlp_hidden: int = 0
    """Hidden size of the compression MLP phi; 0 means 4 * head_dim."""
    sel_block_size: int = 64
    """l': length of a selection block."""
    sel_top_n: int = 16
    """n: selected blocks per query, including the initial block and the 2 local blocks."""
    window_size: int = 512
    """w: sliding-window length."""
    nsa_branch: Literal["all", "cmp", "sel", "win"] = "all"
    """Diagnostics: `cmp`, `sel` or `win` keeps that branch alone (the others' gates are 0)."""


@dataclass
class Optimizer:
    name: Literal["AdamW"] = "AdamW"
    lr: float = 3e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    implementation: Literal["foreach", "fused", "for-loop"] = "foreach"


@dataclass
class LRScheduler:
    warmup_steps: int = 100
    decay_type: Literal["cosine", "wsd", "constant"] = "cosine"
    """`cosine`: cosine decay after warmup; `wsd`: warmup-stable-decay (linear decay over the
    last `decay_ratio` of the steps); `constant`: no decay."""
    decay_ratio: float = 0.2
    min_lr_factor: float = 0.1
    """The lr at the end of decay, as a fraction of `optimizer.lr`."""


@dataclass
class Training:
    local_batch_size: int = 8
    """Sequences per rank per micro-batch."""
    global_batch_size: int = -1
    """Sequences per optimizer step over all ranks; -1 means local_batch_size * dp degree.
    A multiple of that product gives gradient accumulation."""
    seq_len: int = 2048
    steps: int = 1000
    max_norm: float = 1.0
    """Gradient-norm clipping threshold; 0 disables clipping (the norm is still logged)."""
    mixed_precision_param: Literal["bfloat16", "float32"] = "bfloat16"
    mixed_precision_reduce: Literal["float32", "bfloat16"] = "float32"


@dataclass
class Data:
    source: Literal["datasets", "synthetic"] = "datasets"
    """`datasets`: documents from `path` through `datasets.load_dataset(streaming=True)`;
    `synthetic`: seeded token streams with learnable structure (no files, no tokenizer use)."""
    path: str = "data/python_docs"
    """A hub dataset id (e.g. HuggingFaceFW/fineweb-edu), or a local parquet/jsonl/txt file or
    folder. Relative paths are taken from the working directory, else from the repository."""
    name: str = ""
    """Hub dataset config name (e.g. sample-10BT for FineWeb-Edu)."""
    split: str = "train"
    text_column: str = "text"
    shuffle_buffer: int = 1000
    """Documents held in the shuffle buffer (0: stream order)."""
    num_workers: int = 1
    """StatefulDataLoader worker processes per rank (0: load in the training process)."""
    seed: int = 1234
    tokenizer: Literal["sentencepiece", "byte"] = "sentencepiece"
    tokenizer_path: str = "data/python_docs/tokenizer.model"
    """The sentencepiece `.model` file (ignored for `byte`)."""


@dataclass
class Validation:
    enable: bool = False
    path: str = ""
    """The held-out source; empty means [data] path."""
    split: str = "validation"
    freq: int = 100
    """Validate every `freq` steps and after the last step."""
    steps: int = 10
    """Batches per validation (fewer if the split runs out first)."""


@dataclass
class Checkpoint:
    enable: bool = False
    folder: str = "checkpoint"
    """Under job.dump_folder; one `step-N` folder per checkpoint."""
    interval: int = 500
    """Save every `interval` steps, and always after the last step."""
    keep_latest_k: int = 0
    """Keep only the newest k complete checkpoints (0: keep all)."""
    async_mode: Literal["disabled", "async"] = "disabled"
    """`async`: write in a background thread (its own gloo group); training waits only for staging."""
    load_step: int = -1
    """Resume from this step; -1: the latest complete checkpoint, if any."""
    initial_load_path: str = ""
    """When there is nothing to resume: start from this DCP step folder or exported .pt file."""
    initial_load_model_only: bool = True
    """With initial_load_path: load the model only (a warm start), not optimizer/schedule/data/step."""
    exclude_from_loading: list[str] = field(default_factory=list)
    """Parts of a checkpoint not to restore on resume: any of model, optimizer, lr_scheduler,
    dataloader, train_state, rng (e.g. `--checkpoint.exclude_from_loading dataloader`)."""
    restart_data_on_reshard: bool = False
    """Resuming on a different number of data-parallel ranks: the loader position cannot be
    resharded exactly; true restarts the data stream (with a warning) instead of stopping."""
    export_at_end: bool = False
    """After training, write the model alone as one torch.save file (`model-step-N.pt`)."""
    export_dtype: Literal["bfloat16", "float32", "float16"] = "bfloat16"


@dataclass
class Parallelism:
    data_parallel_shard_degree: int = -1
    """FSDP degree; -1 means world_size / data_parallel_replicate_degree."""
    data_parallel_replicate_degree: int = 1
    """HSDP replicas (across nodes); 1 means plain FSDP; -1 means world_size / data_parallel_shard_degree."""
    fsdp_reshard_after_forward: Literal["default", "always", "never"] = "default"
    """`default`: reshard every block but not the root (its params are used at once in backward)."""


@dataclass
class ActivationCheckpoint:
    mode: Literal["none", "full", "selective"] = "none"
    """`full`: every block; `selective`: every `every_n_layers`-th block."""
    every_n_layers: int = 2
    first_layer: int = 0
    """Only blocks first_layer..last_layer are considered (bisecting a bad layer)."""
    last_layer: int = -1
    """-1: the last block."""


@dataclass
class Compile:
    enable: bool = False
    """torch.compile each transformer block."""
    backend: str = "inductor"
    fullgraph: bool = True


@dataclass
class Metrics:
    log_freq: int = 10
    enable_tensorboard: bool = True
    save_tb_folder: str = "tb"
    """Under job.dump_folder; each run writes its events to its own subfolder named by its start time."""
    peak_flops: float = 0.0
    """Peak FLOP/s of one device for MFU; 0 means look it up from the GPU name (no MFU on CPU)."""
    nsa_stats: bool = False
    """Per-layer gate and selection statistics to TensorBoard at log steps (one extra forward)."""


@dataclass
class Fault:
    step_timeout_seconds: float = 600.0
    """A training step that makes no progress for this long is a hang."""
    first_step_timeout_seconds: float = 1800.0
    """The limit for start-up and the first step (compile, warm-up)."""
    action: Literal["exit", "warn"] = "exit"
    """On a hang, after writing every thread's stack: `exit` the rank (non-zero, so torchrun stops
    the job) or only `warn` and keep waiting."""
    collective_timeout_seconds: float = 1800.0
    """Process-group timeout after the first step (start-up and the first step get
    first_step_timeout_seconds); keep it above step_timeout_seconds so the watchdog reports first."""
    heartbeat: bool = True
    """One JSON line per step per rank in <dump_folder>/heartbeat/rank<R>.jsonl."""
    nonfinite: Literal["halt", "skip"] = "halt"
    """A non-finite loss or gradient norm: `halt` with a report, or `skip` the update."""
    max_consecutive_skips: int = 5
    """With `skip`: halt after this many non-finite steps in a row."""


@dataclass
class Debug:
    seed: int = 0
    deterministic: bool = False
    report_missing_grads: bool = False
    """After the first backward, name the parameters that got no (or an all-zero) gradient."""
    dtype_report: bool = False
    """After the first step, log the dtypes of parameters, compute, gradients and optimizer state."""
    profile_step: int = 0
    """Write a torch.profiler trace of this step to <dump_folder>/profile/ (0: off)."""
    memory_snapshot_step: int = 0
    """Write a CUDA memory snapshot after this step to <dump_folder>/profile/ (0: off; GPUs only)."""
    fault_hang_rank: int = -1
    """Fault injection for tests: this rank sleeps forever at fault_hang_step, in fault_hang_where."""
    fault_hang_step: int = 0
    fault_hang_where: Literal["forward", "optimizer"] = "forward"
    fault_nan_step: int = 0
    """Fault injection for tests: rank 0's loss becomes NaN at this step."""
    fault_kill_in_save_step: int = 0
    """Fault injection for tests: the last rank SIGKILLs itself while saving this step's checkpoint."""


@dataclass
class JobConfig:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    training: Training = field(default_factory=Training)
    data: Data = field(default_factory=Data)
    validation: Validation = field(default_factory=Validation)
    parallelism: Parallelism = field(default_factory=Parallelism)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    metrics: Metrics = field(default_factory=Metrics)
    fault: Fault = field(default_factory=Fault)
    debug: Debug = field(default_factory=Debug)

    def to_toml(self) -> str:
        """The fully resolved config, as a TOML file that reproduces this run."""
        lines: list[str] = []
        for section in dataclasses.fields(self):
            lines.append(f"[{section.name}]")
            for f in dataclasses.fields(getattr(self, section.name)):
                lines.append(f"{f.name} = {_toml_value(getattr(getattr(self, section.name), f.name))}")
            lines.append("")
        return "\n".join(lines)


USAGE = """usage: run_train.sh [--config FILE] [--print_config] [--section.key VALUE | --section.key=VALUE ...]

Reads FILE (default train_configs/debug_model.toml), then applies the overrides, which win
over the file. Booleans take true/false (a bare --section.key means true).
--print_config prints the fully resolved config as TOML and exits.
"""


def _toml_value(v: Any) -> str:
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return repr(v)


def _field_types(section_cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(section_cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(section_cls)}


def _allowed(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if tp == list[str]:
        return "a list of strings (on the command line: comma-separated)"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}[tp]


def _coerce(where: str, tp: Any, value: Any, from_cli: bool) -> Any:
    """Convert `value` (TOML-typed, or a CLI string) to `tp`, or raise a ConfigError."""
    bad = ConfigError(f"{where} = {value!r} is invalid: expected {_allowed(tp)}")
    if typing.get_origin(tp) is Literal:
        if value not in typing.get_args(tp):
            raise bad
        return value
    if tp is bool:
        if from_cli and isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        if isinstance(value, bool):
            return value
        raise bad
    if tp in (int, float):
        if from_cli and isinstance(value, str):
            try:
                return tp(value)
            except ValueError:
                raise bad from None
        accepted = (int,) if tp is int else (int, float)  # TOML `lr = 1` is a fine float
        if isinstance(value, accepted) and not isinstance(value, bool):
            return tp(value)
        raise bad
    if tp == list[str]:
        if from_cli and isinstance(value, str):
            return [v for v in value.split(",") if v]
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return list(value)
        raise bad
    if tp is str:
        if isinstance(value, str):
            return value
        raise bad
    raise TypeError(f"unsupported config field type {tp} at {where}")


def _lookup(cfg: JobConfig, section: str, key: str, origin: str) -> tuple[Any, Any]:
    """The section object and the declared type of `section.key`, or a ConfigError."""
    sections = {f.name for f in dataclasses.fields(cfg)}
    if section not in sections:
        raise ConfigError(
            f"{origin}: unknown section [{section}]; known sections: {', '.join(sorted(sections))}"
        )
    sec = getattr(cfg, section)
    types_ = _field_types(type(sec))
    if key not in types_:
        raise ConfigError(
            f"{origin}: unknown key '{key}' in [{section}]; known keys: {', '.join(types_)}"
        )
    return sec, types_[key]


def _set(cfg: JobConfig, section: str, key: str, value: Any, origin: str, from_cli: bool) -> None:
    sec, tp = _lookup(cfg, section, key, origin)
    if value is None:  # a bare command-line flag: allowed for booleans only
        if tp is not bool:
            raise ConfigError(f"{origin} needs a value ({_allowed(tp)})")
        value = "true"
    setattr(sec, key, _coerce(f"{origin}: [{section}] {key}", tp, value, from_cli))


def _load_toml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(
            f"config file '{path}' not found; pass an existing file with --config "
            f"(see train_configs/ for examples)"
        )
    try:
        with path.open("rb") as f:
            return tomli.load(f)
    except tomli.TOMLDecodeError as e:
        raise ConfigError(f"config file '{path}' is not valid TOML: {e}") from None


def _split_overrides(args: list[str]) -> tuple[Path, bool, list[tuple[str, str | None]]]:
    """Split argv into (config path, print_config, [(dotted key, raw value or None)])."""
    config_path = DEFAULT_CONFIG
    print_config = False
    overrides: list[tuple[str, str | None]] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if arg in ("-h", "--help"):
            print(USAGE)
            sys.exit(0)
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument '{arg}'; overrides look like --section.key value\n{USAGE}")
        name, eq, value = arg[2:].partition("=")
        has_value = bool(eq)
        if not has_value and i + 1 < len(args) and not args[i + 1].startswith("--"):
            value, has_value = args[i + 1], True
            i += 1
        i += 1
        if name in ("config", "job.config_file"):
            if not has_value:
                raise ConfigError("--config needs a file path, e.g. --config train_configs/m7c.toml")
            config_path = Path(resolve_path(value))  # from the working directory, else the repository
        elif name == "print_config":
            print_config = value.lower() != "false" if has_value else True
        else:
            overrides.append((name, value if has_value else None))
    return config_path, print_config, overrides


def parse_args(argv: list[str] | None = None) -> tuple[JobConfig, bool]:
    """Build the JobConfig from `--config FILE` and overrides; returns (config, print_config).

    Structural checks only (names, types, choices); `validate` checks the combination.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    config_path, print_config, overrides = _split_overrides(args)
    cfg = JobConfig()
    for section, table in _load_toml(config_path).items():
        if not isinstance(table, dict):
            raise ConfigError(f"{config_path}: top-level key '{section}' must be a [section] table")
        for key, value in table.items():
            _set(cfg, section, key, value, str(config_path), from_cli=False)
    for name, value in overrides:
        section, dot, key = name.partition(".")
        if not dot:
            raise ConfigError(f"override '--{name}' must be --section.key (e.g. --training.steps 10)")
        _set(cfg, section, key, value, f"override --{name}", from_cli=True)
    return cfg, print_config


def resolve_path(path: str) -> str:
    """`path` as given if it exists (or is empty or absolute), else relative to the repository."""
    if not path or Path(path).is_absolute() or Path(path).exists():
        return path
    in_repo = REPO_ROOT / path
    return str(in_repo) if in_repo.exists() else path


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


_POSITIVE = {
    "model": ("dim", "n_layers", "n_heads", "n_kv_groups", "head_dim", "cmp_block_size",
              "cmp_stride", "sel_block_size", "sel_top_n", "window_size"),
    "training": ("local_batch_size", "seq_len", "steps"),
    "activation_checkpoint": ("every_n_layers",),
    "metrics": ("log_freq",),
    "validation": ("freq", "steps"),
    "checkpoint": ("interval",),
}
"""Integer keys that must be > 0."""


def validate(cfg: JobConfig, world_size: int) -> None:
    """Check the combination of values for `world_size` ranks; fills in derived values.

    Called before any model is built, so a bad config costs nothing.
    """
    m, t, p = cfg.model, cfg.training, cfg.parallelism
    for section, keys in _POSITIVE.items():
        for key in keys:
            v = getattr(getattr(cfg, section), key)
            _require(v > 0, f"[{section}] {key} = {v}: must be a positive integer")
    _require(m.n_heads % m.n_kv_groups == 0,
             f"[model] n_heads = {m.n_heads} is not divisible by n_kv_groups = {m.n_kv_groups}: "
             f"each KV group must serve the same number of query heads (e.g. n_kv_groups = 1, 2, ... "
             f"dividing {m.n_heads})")
    _require(m.head_dim % 2 == 0, f"[model] head_dim = {m.head_dim}: must be even (RoPE rotates pairs)")
    _require(m.ffn_hidden_dim >= 0 and m.cmp_mlp_hidden >= 0,
             "[model] ffn_hidden_dim and cmp_mlp_hidden must be >= 0 (0 picks the default)")
    if m.attention == "nsa":
        l, d, ls = m.cmp_block_size, m.cmp_stride, m.sel_block_size
        _require(l % d == 0,
                 f"[model] cmp_stride = {d} must divide cmp_block_size = {l} (paper: d | l), e.g. "
                 f"cmp_block_size = 32, cmp_stride = 16")
        _require(ls % d == 0,
                 f"[model] cmp_stride = {d} must divide sel_block_size = {ls} (paper: d | l'), e.g. "
                 f"sel_block_size = 64, cmp_stride = 16")
        _require(m.sel_top_n >= 3,
                 f"[model] sel_top_n = {m.sel_top_n}: must be >= 3, since it includes the initial "
                 f"block and the 2 local blocks")
        _require(t.seq_len >= max(l, ls),
                 f"[training] seq_len = {t.seq_len} is shorter than the NSA blocks (cmp_block_size = {l}, "
                 f"sel_block_size = {ls}): no compressed block would ever be complete; use seq_len >= "
                 f"{max(l, ls)} or smaller blocks")
    _require(t.max_norm >= 0, f"[training] max_norm = {t.max_norm}: must be >= 0 (0 disables clipping)")
    _require(cfg.optimizer.lr > 0, f"[optimizer] lr = {cfg.optimizer.lr}: must be > 0")
    _require(0 <= cfg.optimizer.beta1 < 1 and 0 <= cfg.optimizer.beta2 < 1,
             "[optimizer] beta1 and beta2 must lie in [0, 1)")
    s = cfg.lr_scheduler
    _require(s.warmup_steps >= 0, f"[lr_scheduler] warmup_steps = {s.warmup_steps}: must be >= 0")
    _require(0 < s.decay_ratio <= 1, f"[lr_scheduler] decay_ratio = {s.decay_ratio}: must lie in (0, 1]")
    _require(0 <= s.min_lr_factor <= 1, f"[lr_scheduler] min_lr_factor = {s.min_lr_factor}: must lie in [0, 1]")
    _require(m.vocab_size >= 0, f"[model] vocab_size = {m.vocab_size}: must be >= 0 (0: from the tokenizer)")
    dt = cfg.data
    _require(dt.num_workers >= 0, f"[data] num_workers = {dt.num_workers}: must be >= 0")
    _require(dt.shuffle_buffer >= 0, f"[data] shuffle_buffer = {dt.shuffle_buffer}: must be >= 0")
    _require(dt.source == "synthetic" or bool(dt.path),
             "[data] path is empty: give a hub dataset id or a local file or folder, or set source = 'synthetic'")
    for section, key in (("data", "path"), ("data", "tokenizer_path"), ("validation", "path")):
        sec = getattr(cfg, section)
        setattr(sec, key, resolve_path(getattr(sec, key)))

    f = cfg.fault
    for key in ("step_timeout_seconds", "first_step_timeout_seconds", "collective_timeout_seconds"):
        _require(getattr(f, key) > 0, f"[fault] {key} = {getattr(f, key)}: must be > 0")
    _require(f.max_consecutive_skips >= 1, f"[fault] max_consecutive_skips = {f.max_consecutive_skips}: must be >= 1")
    ac = cfg.activation_checkpoint
    last = m.n_layers - 1 if ac.last_layer == -1 else ac.last_layer
    _require(0 <= ac.first_layer <= last < m.n_layers,
             f"[activation_checkpoint] first_layer = {ac.first_layer}, last_layer = {ac.last_layer}: need "
             f"0 <= first_layer <= last_layer < n_layers = {m.n_layers} (last_layer -1 means the last block)")
    ck = cfg.checkpoint
    _require(ck.keep_latest_k >= 0, f"[checkpoint] keep_latest_k = {ck.keep_latest_k}: must be >= 0 (0 keeps all)")
    _require(ck.load_step >= -1, f"[checkpoint] load_step = {ck.load_step}: must be a step >= 0, or -1 for the latest")
    parts = ("model", "optimizer", "lr_scheduler", "dataloader", "train_state", "rng")
    for part in ck.exclude_from_loading:
        _require(part in parts, f"[checkpoint] exclude_from_loading has '{part}'; allowed: {', '.join(parts)}")
    ck.initial_load_path = resolve_path(ck.initial_load_path)

    # Mesh degrees: replicate x shard must equal the world size.
    _require(not (p.data_parallel_replicate_degree == -1 and p.data_parallel_shard_degree == -1),
             "[parallelism] data_parallel_replicate_degree and data_parallel_shard_degree are both -1: set one of "
             "them (e.g. the shard degree to the GPUs per node) and the other is inferred")
    if p.data_parallel_replicate_degree == -1:
        _require(p.data_parallel_shard_degree >= 1 and world_size % p.data_parallel_shard_degree == 0,
                 f"[parallelism] data_parallel_shard_degree = {p.data_parallel_shard_degree} does not divide the "
                 f"world size {world_size}")
        p.data_parallel_replicate_degree = world_size // p.data_parallel_shard_degree
    _require(p.data_parallel_replicate_degree >= 1,
             f"[parallelism] data_parallel_replicate_degree = {p.data_parallel_replicate_degree}: must be >= 1 or -1")
    if p.data_parallel_shard_degree == -1:
        _require(world_size % p.data_parallel_replicate_degree == 0,
                 f"[parallelism] data_parallel_replicate_degree = {p.data_parallel_replicate_degree} "
                 f"does not divide the world size {world_size}")
        p.data_parallel_shard_degree = world_size // p.data_parallel_replicate_degree
    _require(p.data_parallel_shard_degree >= 1,
             f"[parallelism] data_parallel_shard_degree = {p.data_parallel_shard_degree}: must be >= 1 or -1")
    dp = p.data_parallel_shard_degree * p.data_parallel_replicate_degree
    _require(dp == world_size,
             f"[parallelism] data_parallel_replicate_degree ({p.data_parallel_replicate_degree}) x "
             f"data_parallel_shard_degree ({p.data_parallel_shard_degree}) = {dp}, but the world size "
             f"is {world_size}: the degrees must multiply to the number of ranks (set the shard degree "
             f"to -1 to infer it)")
    micro = t.local_batch_size * dp
    if t.global_batch_size == -1:
        t.global_batch_size = micro
    _require(t.global_batch_size > 0 and t.global_batch_size % micro == 0,
             f"[training] global_batch_size = {t.global_batch_size} must be a positive multiple of "
             f"local_batch_size x dp degree = {t.local_batch_size} x {dp} = {micro} "
             f"(the multiple is the number of gradient-accumulation steps)")


def load_config(argv: list[str] | None = None, world_size: int | None = None) -> tuple[JobConfig, bool]:
    """parse_args + validate, with the world size torchrun gave (WORLD_SIZE, default 1)."""
    cfg, print_config = parse_args(argv)
    validate(cfg, int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size)
    return cfg, print_config

