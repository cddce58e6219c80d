"""The config schema: one dataclass per component, its keys, defaults and their meaning.

Parsing (TOML + overrides) is in `parsing.py`, the checks in `validation.py`, and the values a
run derives from the config (mesh degrees, batch, vocabulary, AC layers) in `derived.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from ..system.errors import BadInput
from .data_sections import Data, Recall, Source, Validation  # in a file of their own, for length

REPO_ROOT = Path(__file__).resolve().parent.parent.parent
DEFAULT_CONFIG = REPO_ROOT / "train_configs" / "debug_model.toml"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""The dtype names the config uses (mixed precision, export)."""


class ConfigError(BadInput, ValueError):
    """A configuration problem, with the key, the bad value and the fix in its message."""

    kind = "config"


@dataclass
class Job:
    dump_folder: str = "./outputs"
    """Root folder for everything a run writes (TensorBoard, later checkpoints)."""
    description: str = ""
    """A label for the run, shown in the startup log."""
    owner_heartbeat_seconds: float = 30.0
    """The run holds dump_folder through `<dump_folder>/owner.json` and renews its heartbeat this often
    (docs/operations.md, "One run per folder")."""
    owner_stale_seconds: float = 300.0
    """An owner record from another host whose heartbeat is older than this belongs to a run that is
    gone, and is taken over (on the same host, a holder whose pid has exited is gone at once)."""


@dataclass
class Model:
    attention: Literal["nsa", "dense"] = "nsa"
    """`nsa`: native sparse attention; `dense`: plain causal attention, the baseline."""
    attn_impl: Literal["fast", "reference"] = "fast"
    """NSA implementation: `fast`, sparse (cost grows with the keys attended, memory linear in
    T); `reference`, the exact definition with dense per-branch masks (O(T^2) memory), the yardstick."""
    kernels: Literal["auto", "torch", "triton", "flash", "cpp", "flex"] = "auto"
    """The kernel family of the fast path (docs/kernels.md), chosen once at startup: `torch`, PyTorch; `triton`,
    Triton kernels (CUDA); `flash`, PyTorch with the win branch through flash-attn (CUDA); `flex`, cmp and win
    through FlexAttention (CUDA); `cpp`, NSA's C++ kernels (CPUs, built at install or first use); `auto`, the
    fastest of those that can run here (the device, the dtype, installed or built) and pass their check, timed at
    startup on the run's shapes beside dense attention (kept in $NSA_TITAN_CACHE: a machine times once). One named that cannot run stops the run with the reason; the
    startup log names the family and, with `auto`, NSA's speed against dense."""
    decode_kernels: Literal["auto", "triton", "cpp", "torch"] = "auto"
    """The kernel of a decoding step (generate, the Hugging Face model): `triton`, the Triton decode step (CUDA);
    `cpp`, NSA's C++ step (CPUs); `torch`, PyTorch's ops; `auto`, the first of triton, cpp that can run and passes
    its check, else torch."""
    verify_kernels: Literal["once", "always", "off"] = "once"
    """Before step 1, check the family this run takes and the decoding step's kernel against the reference on the
    run's device and dtype (docs/kernels.md): `once`, each once a machine (the verdict kept in $NSA_TITAN_CACHE,
    default ~/.cache/nsa_titan, by device, driver, torch and Triton versions and the kernels' sources); `always`;
    `off` (`auto` then takes the first of triton, cpp, flash, torch that can run, untimed). One that fails stops the
    run with the reason (`auto` leaves it out)."""
    dim: int = 256
    """Model width (M7C: 768)."""
    n_layers: int = 4
    """Transformer blocks (M7C: 12)."""
    n_heads: int = 4
    """Query heads per layer."""
    n_kv_groups: int = 2
    """Number of KV heads (GQA groups); the query heads of a group share keys and selection."""
    head_dim: int = 64
    """Width of each query and KV head."""
    vocab_size: int = 0
    """0 means the tokenizer's vocabulary, padded up to a multiple of 64."""
    ffn_hidden_dim: int = 0
    """SwiGLU hidden size; 0 means 8/3 * dim rounded up to a multiple of 64."""
    norm_eps: float = 1e-5
    """Epsilon of every RMSNorm."""
    rope_theta: float = 10000.0
    """RoPE base; larger keeps far positions apart (recall.toml: 500000)."""
    rope_scaling: Literal["none", "linear", "yarn"] = "none"
    """RoPE stretched past the pretraining length (docs/long-context.md): `linear`, every frequency divided by
    rope_factor (position interpolation); `yarn`, YaRN (arXiv 2309.00071): only the slow frequencies
    divided, cos and sin times rope_attention_factor. The tables equal transformers' rope types."""
    rope_factor: float = 1.0
    """s: how many times rope_original_seq_len the scaled model reaches (>= 1; 1 without a scaling)."""
    rope_original_seq_len: int = 0
    """With a scaling: the length the model was pretrained at (<= training.seq_len; YaRN's L)."""
    rope_beta_fast: float = 32.0
    """YaRN: a frequency that turns more than this many times over the original length is kept."""
    rope_beta_slow: float = 1.0
    """YaRN: one that turns fewer times than this is interpolated (divided by s); a linear ramp between."""
    rope_attention_factor: float = 0.0
    """YaRN: the factor cos and sin are multiplied by; 0 means YaRN's 0.1 ln(s) + 1."""
    max_seq_len: int = 0
    """The longest context the model is declared for (generate, evaluate, the HF export's
    max_position_embeddings); 0 means rope_original_seq_len x rope_factor with a scaling, else
    training.seq_len. A context beyond it is refused; set it to evaluate past that on purpose."""
    tie_embeddings: bool = False
    """Share the token embedding with the output head."""
    smear: bool = False
    """Add to each token's embedding its predecessor's through a learned dim x dim matrix (random at
    first; nothing at a document's first token): a token then carries the one before it, in
    directions of its own, which lets a single attention layer match "the token after an earlier
    occurrence of this one" (induction) without also matching the occurrence itself."""
    # NSA, with the paper's names:
    cmp_block_size: int = 32
    """l: keys per compression block (the paper: 32)."""
    cmp_stride: int = 16
    """d: stride between compression blocks (the paper: 16); l must be a multiple of d."""
    cmp_mlp_hidden: int = 0
    """Hidden size of the compression MLP phi; 0 means 4 * head_dim."""
    cmp_phi: Literal["mlp", "mean"] = "mlp"
    """phi, the compression of a block of l keys (values) to one: `mlp`, the paper's MLP with an
    intra-block position table; `mean` (off-paper, as fla's NSA), the block's mean, no parameters: a
    block's score is then its keys' mean logit, the same for a key wherever it sits in the block."""
    sel_block_size: int = 64
    """l': keys per selection block (the paper: 64); a multiple of d."""
    sel_top_n: int = 16
    """n: selection blocks per query (the paper: 16), the initial block and the 2 local blocks included."""
    window_size: int = 512
    """w: the sliding window's length in keys (the paper: 512)."""
    nsa_branch: Literal["all", "cmp", "sel", "win"] = "all"
    """Diagnostics: `cmp`, `sel` or `win` keeps that branch alone (the others' gates are 0)."""
    sel_score_grad: float = 0.0
    """Off-paper (`models/attention/routing.py`): give the block scores that choose the sel blocks the
    gradient they would get if they biased the sel logits of their blocks' keys (straight-through),
    times this weight; in the paper (0) they learn only through the cmp output. It recomputes the
    cmp probabilities densely, a (T, T/d) matrix per layer."""
    sel_score_explore: int = 0
    """Off-paper, with sel_score_grad: this many unchosen candidate blocks per query (a fixed hash,
    uniform over the candidates) also get that gradient, as if blended into the sel softmax at weight
    0; the forward reads nothing more. A block that is never chosen otherwise never learns it helps."""


@dataclass
class Optimizer:
    """AdamW; weight decay on matrices only."""

    lr: float = 3e-4
    """Peak learning rate (after warmup)."""
    beta1: float = 0.9
    """AdamW's first-moment decay."""
    beta2: float = 0.95
    """AdamW's second-moment decay."""
    eps: float = 1e-8
    """AdamW's epsilon."""
    weight_decay: float = 0.1
    """Decoupled weight decay, on matrices only (not norms, biases or gates)."""
    implementation: Literal["foreach", "fused", "for-loop"] = "foreach"
    """torch.optim.AdamW's implementation: `foreach` (multi-tensor), `fused` or `for-loop`."""


@dataclass
class LRScheduler:
    warmup_steps: int = 100
    """Steps of linear warmup from 0 to `optimizer.lr`."""
    decay_type: Literal["cosine", "wsd", "constant"] = "cosine"
    """`cosine`: cosine decay after warmup; `wsd`: warmup-stable-decay (linear decay over the
    last `decay_ratio` of the steps); `constant`: no decay."""
    decay_ratio: float = 0.2
    """With `wsd`: the share of the steps the final decay takes."""
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
    """Tokens per sequence (the packed window)."""
    steps: int = 1000
    """Optimizer steps of the whole run (a resumed run continues to this step)."""
    max_norm: float = 1.0
    """Gradient-norm clipping threshold; 0 disables clipping (the norm is still logged)."""
    mixed_precision_param: Literal["bfloat16", "float32"] = "bfloat16"
    """FSDP2's compute dtype of the parameters (kept in fp32); float32 on CPUs without native bfloat16."""
    mixed_precision_reduce: Literal["float32", "bfloat16"] = "float32"
    """The dtype gradients are reduced across ranks in."""
    document_masking: bool = True
    """Each token attends only to its own document of the packed window (an <eos> ends one; the
    synthetic source cuts its own), with positions from 0 at each document's start: every NSA
    branch, the dense baseline, validation and evaluation. false: attention crosses documents."""


@dataclass
class Checkpoint:
    enable: bool = False
    """Save checkpoints, and resume from the latest complete one."""
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
    content_hashes: bool = True
    """Record each file's content hash (xxh3_128, hashed by the rank that wrote it) in the `.complete`
    manifest, and check them before a checkpoint is read: a flipped byte is a checkpoint error. false
    skips both; sizes are checked either way."""
    on_damaged: Literal["set_aside", "stop"] = "set_aside"
    """A resume whose newest checkpoints fail their check (a file missing, truncated or altered): `set_aside`
    renames each to `step-N.damaged-TIME` (never deleted), with one warning naming the problem, and resumes from the
    newest that verifies; `stop` stops the run (exit 2) for a person to decide. Either way a run with no checkpoint
    that verifies stops, and an explicit `load_step` is never replaced."""
    export_at_end: bool = False
    """After training, write the model alone (`export_format`) into the checkpoint folder."""
    export_format: Literal["pt", "hf"] = "pt"
    """`pt`: one torch.save file, `model-step-N.pt`; `hf`: a Hugging Face folder, `model-step-N-hf/`, that
    transformers and lm-evaluation-harness load (needs the `[hf]` extra)."""
    export_dtype: Literal["bfloat16", "float32", "float16"] = "bfloat16"
    """The dtype of the exported model file."""


@dataclass
class Parallelism:
    data_parallel_shard_degree: int = -1
    """FSDP degree; -1 means world_size / data_parallel_replicate_degree."""
    data_parallel_replicate_degree: int = 1
    """HSDP replicas (across nodes); 1 means plain FSDP; -1 means world_size / data_parallel_shard_degree."""
    fsdp_reshard_after_forward: Literal["default", "always", "never"] = "default"
    """`default`: reshard every block but not the root (its params are used at once in backward)."""
    context_parallel_degree: int = 1
    """Ranks that split each sequence between them (context parallelism, docs/long-context.md):
    a zigzag of 2 x cp chunks, keys and values all-gathered per layer. The data-parallel degrees
    multiply to world_size / cp; FSDP shards over dp_shard x cp."""


@dataclass
class ActivationCheckpoint:
    mode: Literal["none", "full", "selective"] = "none"
    """`full`: every block; `selective`: every `every_n_layers`-th block."""
    every_n_layers: int = 2
    """With `selective`: checkpoint every n-th block."""
    first_layer: int = 0
    """Only blocks first_layer..last_layer are considered (bisecting a bad layer)."""
    last_layer: int = -1
    """-1: the last block."""


@dataclass
class Compile:
    enable: bool = False
    """torch.compile each transformer block."""
    backend: str = "inductor"
    """torch.compile's backend."""
    fullgraph: bool = True
    """Compile each block as one graph (a graph break is an error, not a silent slowdown)."""


@dataclass
class Metrics:
    log_freq: int = 10
    """Print the console line (and log to TensorBoard) every this many steps, and at step 1 and the last."""
    enable_tensorboard: bool = True
    """Write the metrics as TensorBoard events under save_tb_folder."""
    save_tb_folder: str = "tb"
    """Under job.dump_folder; each run writes its events to its own subfolder named by its start time."""
    peak_flops: float = 0.0
    """Peak FLOP/s of one device for MFU; 0 means look it up from the GPU name (no MFU on CPU)."""
    nsa_stats: bool = False
    """Per-layer gate and selection statistics to TensorBoard at log steps (one extra forward)."""
    enable_wandb: bool = False
    """Log the same scalars as TensorBoard, and the config, to Weights & Biases (rank 0; needs `wandb`)."""
    wandb_project: str = "nsa_titan"
    """The W&B project."""
    wandb_entity: str = ""
    """The W&B entity (user or team); empty: the account's default."""
    wandb_group: str = ""
    """The W&B group (e.g. a sweep's name); empty: none."""
    wandb_name: str = ""
    """The W&B run's display name; empty: W&B's own."""
    wandb_start_timeout_seconds: float = 60.0
    """How long W&B may take to start (in a thread of its own: training does not wait) before it is given up
    with one warning; the end of a run shorter than that waits for it as long."""
    wandb_mode: Literal["auto", "online", "offline", "disabled"] = "auto"
    """`auto`: online where W&B credentials are configured (WANDB_API_KEY or `wandb login`), else offline
    (files under <dump_folder>/wandb, sent later by `wandb sync`); `disabled`: nothing logged."""


@dataclass
class Eval:
    """Evaluations inside the run (`nsa_titan/observe/evals.py`) on the model being trained, by every rank, each equal
    to `python -m nsa_titan.evaluate` on that step's checkpoint."""

    enable: bool = False
    """Run the evaluations every `freq` steps and after the last step."""
    freq: int = 500
    """Steps between evaluations."""
    position_batches: int = 2
    """Batches a data-parallel rank scores for the loss by position (the `[validation]` source and split, as
    `evaluate --by_position` reads it; read once a run); 0: no loss by position."""
    bucket: int = 0
    """Width in tokens of the position buckets (0: seq_len / 8)."""
    recall_distances: list[int] = field(default_factory=list)
    """The recall probe's pair-to-query distances (`[recall]` sizes; `evaluate --task recall`); empty: no probe."""
    recall_batches: int = 1
    """Batches of the recall probe per distance, shared out among the data-parallel ranks."""
    lm_eval_tasks: list[str] = field(default_factory=list)
    """lm-evaluation-harness tasks run in-process on the model (`evaluate --task lm_eval`; needs `lm-eval`);
    empty: none. Loglikelihood tasks (multiple choice, perplexity); not generation."""
    lm_eval_include_path: str = ""
    """A folder of task YAML files (local tasks) for lm_eval_tasks; empty: lm-eval's own tasks."""
    lm_eval_limit: int = 0
    """Documents per lm-eval task (0: all)."""


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
    """With `nonfinite = "skip"`: halt after this many non-finite steps in a row; with `spikes = "skip"`, after
    this many loss spikes in a row (a loss that rose for good: the run would stop learning)."""
    spikes: Literal["off", "warn", "skip", "rollback"] = "warn"
    """A loss spike (the loss, averaged over the ranks, more than spike_threshold standard deviations above its
    running mean): `warn` with one line (step, loss, how far out, grad norm, the batch); `skip` also drops the
    update (the batch counts as read, the optimizer does not step); `rollback` skips too, and after
    spike_rollback_count spikes within spike_rollback_steps steps reloads the newest checkpoint before the first
    of them (not the data position: training goes on past those batches) with its estimate; `off`: not
    watched (no per-step all-reduce). The estimate is in the checkpoint."""
    spike_rollback_count: int = 3
    """With `rollback`: the spikes that trigger it..."""
    spike_rollback_steps: int = 100
    """... within this many steps."""
    spike_max_rollbacks: int = 3
    """With `rollback`: halt when the spikes call for one more rollback than this in a run (the loss rises
    again after each: it rose for good, or the cause is not in the data the rollback skips)."""
    spike_threshold: float = 6.0
    """Standard deviations above the running mean that make a spike."""
    spike_window: int = 100
    """The running estimate's span in steps (an exponentially weighted mean and variance); spikes are looked
    for once this many steps have been folded in."""
    failure_save_wait_seconds: float = 15.0
    """A rank that fails waits up to this long (at most half the step timeout) for an async save in flight to
    be written and committed (then it is complete under its step name; else it stays aside) before it exits."""


@dataclass
class Debug:
    seed: int = 0
    """Seed of the model's initialisation and of torch's RNG."""
    deterministic: bool = False
    """Deterministic algorithms only (torch.use_deterministic_algorithms), for bit-exact reruns."""
    report_missing_grads: bool = False
    """After the first backward, name the parameters that got no (or an all-zero) gradient."""
    dtype_report: bool = False
    """After the first step, log the dtypes of parameters, compute, gradients and optimizer state."""
    profile_step: int = 0
    """Write a torch.profiler trace of this step to <dump_folder>/profile/ (0: off)."""
    memory_snapshot_step: int = 0
    """Write a CUDA memory snapshot after this step to <dump_folder>/profile/ (0: off; GPUs only)."""
    fault_hang_rank: int = -1
    """Fault injection for tests (installed by `runtime/fault_injection.py`): this rank sleeps forever at
    fault_hang_step, in fault_hang_where."""
    fault_hang_step: int = 0
    """Fault injection for tests: the step at which fault_hang_rank hangs (0: never)."""
    fault_hang_where: Literal["forward", "optimizer"] = "forward"
    """Fault injection for tests: hang in the forward pass or in the optimizer step."""
    fault_nan_step: int = 0
    """Fault injection for tests: rank 0's loss becomes NaN at this step."""
    fault_spike_step: int = 0
    """Fault injection for tests: every rank's logits are scaled by 30 at this step (a loss spike)."""
    fault_spike_lasting: bool = False
    """With fault_spike_step: the logits are scaled at that step and every later one (a loss that rose for good),
    a rolled-back run's too."""
    fault_kill_in_save_step: int = 0
    """Fault injection for tests: the last rank SIGKILLs itself while saving this step's checkpoint."""
    fault_fail_commit_step: int = 0
    """Fault injection for tests: this step's checkpoint folder vanishes once written, so its commit fails."""
    fault_save_delay_seconds: float = 0.0
    """Fault injection for tests: every rank's writing of every checkpoint starts this much later (a slow
    filesystem), so that an async save is in flight for that long."""
    fault_raise_rank: int = -1
    """Fault injection for tests: this rank raises at fault_raise_step, in fault_raise_where, in the first
    fault_raise_attempts of torchrun's attempts."""
    fault_raise_attempts: int = 1
    """Fault injection for tests: the torchrun attempts the fault_raise_* fault fires in, counted from the first:
    1, the first only (a transient fault, which a restart runs through); 0, every attempt (a deterministic one,
    which spends the restarts)."""
    fault_raise_step: int = 0
    """Fault injection for tests: the step at which fault_raise_rank raises (0: never; counted from step 0)."""
    fault_raise_where: Literal["data", "forward", "write"] = "forward"
    """Fault injection for tests: `data`, a loader worker raises on that step's batch (a corrupt document);
    `forward`, an out-of-memory error in the forward; `write`, the rank's heartbeat write of that step fails (disk
    full: one warning, the run goes on)."""
    fault_kernel: str = ""
    """Fault injection for tests: a wrong kernel for the startup check to catch. `FAMILY:PART`, that family's (torch,
    flash, cpp, triton) branch output scaled by 1.5 (PART: cmp, sel, win) or one of its gradients (dq, dk_cmp,
    dv_cmp, dk_sel, dv_sel, dk_win, dv_win, dgates), or (PART `slow`) each of its calls 0.25 s late, right but slow
    for `auto`'s measurement; `decode:KERNEL`, that decoding step's output (cpp, triton), or (`decode:KERNEL:slow`)
    each of its steps 0.25 s late."""


@dataclass
class JobConfig:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    training: Training = field(default_factory=Training)
    data: Data = field(default_factory=Data)
    recall: Recall = field(default_factory=Recall)
    validation: Validation = field(default_factory=Validation)
    parallelism: Parallelism = field(default_factory=Parallelism)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    metrics: Metrics = field(default_factory=Metrics)
    eval: Eval = field(default_factory=Eval)
    fault: Fault = field(default_factory=Fault)
    debug: Debug = field(default_factory=Debug)
