"""Validation: checks the combination of a config's values for a world size, and changes nothing.

Called before any model is built, so a bad config costs nothing. Every problem is a
`ConfigError` that names the keys, their values and the fix.
"""

from __future__ import annotations

import re
from pathlib import Path

from .parsing import resolve_path
from .schema import ConfigError, JobConfig, Model, Recall

RETRY_MAX_WAIT_S = 60.0
"""The longest wait between two tries of a remote read (`data/retry.py`)."""


def retry_wait_total(retries: int, wait_s: float) -> float:
    """The longest a remote reader waits in all before it gives up: its backoff waits, doubling from
    `wait_s` up to RETRY_MAX_WAIT_S."""
    return sum(min(wait_s * 2**i, RETRY_MAX_WAIT_S) for i in range(retries))


URL = re.compile(r"^[a-z][a-z0-9+.-]*://")
"""A `[data] path` that fsspec reads: https://, s3://, gs://, hf://."""
HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")
"""A `[data] path` that names a Hugging Face hub dataset (owner/name), unless it is a local path."""


def is_remote(path: str) -> bool:
    """Whether a `[data] path` is read over a network: a URL, or a hub id (owner/name) that is not a local path."""
    return bool(URL.match(path)) or (bool(HUB_ID.match(path)) and not Path(resolve_path(path)).expanduser().exists())


KERNEL_FAULTS = {f"{family}:{part}" for family in ("torch", "flash", "cpp", "triton", "flex")
                 for part in ("cmp", "sel", "win", "dq", "dk_cmp", "dv_cmp", "dk_sel", "dv_sel", "dk_win", "dv_win",
                              "dgates", "slow")} | {f"decode:{kernel}{slow}" for kernel in ("cpp", "triton")
                                                    for slow in ("", ":slow")}
"""`[debug] fault_kernel`'s values (`runtime/fault_injection.py`)."""


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
    "eval": ("freq", "recall_batches"),
    "checkpoint": ("interval",),
}
"""Integer keys that must be > 0."""


def validate(cfg: JobConfig, world_size: int) -> None:
    """Check the combination of values for `world_size` ranks (`cfg` is not changed)."""
    m, t, j = cfg.model, cfg.training, cfg.job
    _require(j.owner_heartbeat_seconds > 0 and j.owner_stale_seconds >= 3 * j.owner_heartbeat_seconds,
             f"[job] owner_heartbeat_seconds = {j.owner_heartbeat_seconds:g}, owner_stale_seconds = "
             f"{j.owner_stale_seconds:g}: the heartbeat must be positive and the stale bound at least 3 heartbeats, "
             f"so that a live run is never taken for a gone one (defaults: 30 and 300)")
    for section, keys in _POSITIVE.items():
        for key in keys:
            v = getattr(getattr(cfg, section), key)
            _require(v > 0, f"[{section}] {key} = {v}: must be a positive integer")
    _require(m.n_heads % m.n_kv_groups == 0,
             f"[model] n_heads = {m.n_heads} is not divisible by n_kv_groups = {m.n_kv_groups}: "
             f"each KV group must serve the same number of query heads (e.g. n_kv_groups = 1, 2, ... "
             f"dividing {m.n_heads})")
    _require(m.head_dim % 2 == 0, f"[model] head_dim = {m.head_dim}: must be even (RoPE rotates pairs)")
    _validate_rope(m, t.seq_len)
    _require(m.ffn_hidden_dim >= 0 and m.cmp_mlp_hidden >= 0,
             "[model] ffn_hidden_dim and cmp_mlp_hidden must be >= 0 (0 picks the default)")
    _require(m.kernels == "auto" or (m.attention == "nsa" and m.attn_impl == "fast"),
             f"[model] kernels = '{m.kernels}' chooses kernels of the fast NSA path, and this model has attention = "
             f"'{m.attention}', attn_impl = '{m.attn_impl}': set kernels = 'auto' or use attn_impl = 'fast'")
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
    _require(m.sel_score_grad >= 0 and (m.sel_score_grad == 0 or m.attention == "nsa"),
             f"[model] sel_score_grad = {m.sel_score_grad}: the weight of the block scores' gradient must be >= 0, and 0 "
             f"for attention = '{m.attention}' (only NSA layers choose blocks)")
    _require(m.sel_score_explore >= 0 and (m.sel_score_explore == 0 or m.sel_score_grad > 0),
             f"[model] sel_score_explore = {m.sel_score_explore}: the explored blocks per query must be >= 0, and "
             f"they get the block scores' gradient only with sel_score_grad > 0 (set it, or sel_score_explore = 0)")
    _require(t.max_norm >= 0, f"[training] max_norm = {t.max_norm}: must be >= 0 (0 disables clipping)")
    _require(cfg.optimizer.lr > 0, f"[optimizer] lr = {cfg.optimizer.lr}: must be > 0")
    _require(0 <= cfg.optimizer.beta1 < 1 and 0 <= cfg.optimizer.beta2 < 1,
             "[optimizer] beta1 and beta2 must lie in [0, 1)")
    s = cfg.lr_scheduler
    _require(s.warmup_steps >= 0, f"[lr_scheduler] warmup_steps = {s.warmup_steps}: must be >= 0")
    _require(0 < s.decay_ratio <= 1, f"[lr_scheduler] decay_ratio = {s.decay_ratio}: must lie in (0, 1]")
    _require(0 <= s.min_lr_factor <= 1, f"[lr_scheduler] min_lr_factor = {s.min_lr_factor}: must lie in [0, 1]")
    _require(m.vocab_size >= 0, f"[model] vocab_size = {m.vocab_size}: must be >= 0 (0: from the tokenizer)")
    _require(cfg.metrics.wandb_start_timeout_seconds > 0, f"[metrics] wandb_start_timeout_seconds = "
             f"{cfg.metrics.wandb_start_timeout_seconds}: must be > 0")
    dt = cfg.data
    _require(dt.num_workers >= 0, f"[data] num_workers = {dt.num_workers}: must be >= 0")
    _require(dt.shuffle_buffer >= 0, f"[data] shuffle_buffer = {dt.shuffle_buffer}: must be >= 0")
    _require(0 <= dt.holdout < 1, f"[data] holdout = {dt.holdout}: the held-out share must lie in [0, 1) (e.g. 0.001)")
    for i, src in enumerate(dt.sources):
        where = f"[[data.sources]] {i} ('{src.label or src.path}')"
        _require(bool(src.path), f"{where}: path is empty: give a hub dataset id, a local file or folder, or a URL")
        _require(src.weight > 0, f"{where}: weight = {src.weight:g}: weights must be positive (a share relative "
                                 f"to the other sources' weights); leave the source out to read none of it")
        _require(src.min_tokens >= 0 and src.max_tokens >= 0 and (not src.max_tokens or src.max_tokens >= src.min_tokens),
                 f"{where}: min_tokens = {src.min_tokens}, max_tokens = {src.max_tokens}: bounds must be >= 0 "
                 f"(0: none) and max_tokens >= min_tokens")
    _require(not dt.sources or dt.source == "datasets",
             f"[[data.sources]] is set but [data] source = '{dt.source}' reads no text: set source = 'datasets'")
    _require(dt.source != "datasets" or bool(dt.path),
             "[data] path is empty: give a hub dataset id or a local file or folder, or set source = 'synthetic'")
    if dt.source == "recall":
        _validate_recall(cfg.recall, t.seq_len, cfg.model.vocab_size)
    _validate_eval(cfg)
    f = cfg.fault
    _require(dt.read_retries >= 0 and dt.retry_wait_seconds > 0,
             f"[data] read_retries = {dt.read_retries}, retry_wait_seconds = {dt.retry_wait_seconds:g}: must be >= 0 "
             f"and > 0")
    waits = retry_wait_total(dt.read_retries, dt.retry_wait_seconds)
    _require(dt.source != "datasets" or not is_remote(dt.path) or f.action == "warn" or waits < f.step_timeout_seconds,
             f"[data] read_retries = {dt.read_retries} with retry_wait_seconds = {dt.retry_wait_seconds:g} may wait "
             f"{waits:.0f} s for a remote source, and [fault] step_timeout_seconds = {f.step_timeout_seconds:g} would "
             f"call that a hang: lower the retries or raise the step timeout")

    for key in ("step_timeout_seconds", "first_step_timeout_seconds", "collective_timeout_seconds"):
        _require(getattr(f, key) > 0, f"[fault] {key} = {getattr(f, key)}: must be > 0")
    _require(f.collective_timeout_seconds > f.step_timeout_seconds,
             f"[fault] collective_timeout_seconds = {f.collective_timeout_seconds} must be greater than "
             f"step_timeout_seconds = {f.step_timeout_seconds}: a rank waiting in a collective for a stuck peer "
             f"would time out before the watchdog reports where the peer is stuck")
    _require(f.max_consecutive_skips >= 1, f"[fault] max_consecutive_skips = {f.max_consecutive_skips}: must be >= 1")
    _require(f.spike_threshold > 0 and f.spike_window >= 1, f"[fault] spike_threshold = {f.spike_threshold}, "
             f"spike_window = {f.spike_window}: the threshold must be > 0 and the window >= 1")
    _require(min(f.spike_rollback_count, f.spike_rollback_steps, f.spike_max_rollbacks) >= 1, f"[fault] "
             f"spike_rollback_count = {f.spike_rollback_count}, spike_rollback_steps = {f.spike_rollback_steps}, "
             f"spike_max_rollbacks = {f.spike_max_rollbacks}: each must be >= 1")
    _require(f.spikes != "rollback" or cfg.checkpoint.enable, "[fault] spikes = 'rollback' reloads checkpoints: "
             "set [checkpoint] enable = true, or choose spikes = 'skip'")
    _require(f.failure_save_wait_seconds >= 0,
             f"[fault] failure_save_wait_seconds = {f.failure_save_wait_seconds:g}: must be >= 0 (0: do not wait)")
    d = cfg.debug
    _require(d.fault_raise_attempts >= 0, f"[debug] fault_raise_attempts = {d.fault_raise_attempts}: must be >= 0 "
             "(0: every attempt)")
    _require(d.fault_raise_where != "write" or d.fault_raise_step <= 0 or f.heartbeat,
             "[debug] fault_raise_where = 'write' fails the heartbeat's write: it needs [fault] heartbeat = true")
    _require(not d.fault_kernel or d.fault_kernel in KERNEL_FAULTS, f"[debug] fault_kernel = '{d.fault_kernel}': "
             "expected FAMILY:PART (FAMILY torch, flash, cpp, triton or flex; PART cmp, sel, win, a gradient: dq, "
             "dk_cmp, dv_cmp, dk_sel, dv_sel, dk_win, dv_win, dgates, or slow) or decode:KERNEL or decode:KERNEL:slow "
             "(KERNEL cpp or triton)")
    ac = cfg.activation_checkpoint
    last = last_ac_layer(m, ac.last_layer)
    _require(0 <= ac.first_layer <= last < m.n_layers,
             f"[activation_checkpoint] first_layer = {ac.first_layer}, last_layer = {ac.last_layer}: need "
             f"0 <= first_layer <= last_layer < n_layers = {m.n_layers} (last_layer -1 means the last block)")
    ck = cfg.checkpoint
    _require(ck.keep_latest_k >= 0, f"[checkpoint] keep_latest_k = {ck.keep_latest_k}: must be >= 0 (0 keeps all)")
    _require(ck.load_step >= -1, f"[checkpoint] load_step = {ck.load_step}: must be a step >= 0, or -1 for the latest")
    parts = ("model", "optimizer", "lr_scheduler", "dataloader", "train_state", "rng")
    for part in ck.exclude_from_loading:
        _require(part in parts, f"[checkpoint] exclude_from_loading has '{part}'; allowed: {', '.join(parts)}")

    _validate_context_parallel(cfg, world_size)
    replicate, shard = dp_degrees(cfg, world_size)
    dp = replicate * shard
    micro = t.local_batch_size * dp
    _require(t.global_batch_size == -1 or (t.global_batch_size > 0 and t.global_batch_size % micro == 0),
             f"[training] global_batch_size = {t.global_batch_size} must be a positive multiple of "
             f"local_batch_size x dp degree = {t.local_batch_size} x {dp} = {micro} "
             f"(the multiple is the number of gradient-accumulation steps), or -1 for {micro}")
    _validate_prepared_shares(cfg, t.steps * (micro if t.global_batch_size == -1 else t.global_batch_size))


def _validate_prepared_shares(cfg: JobConfig, samples: int) -> None:
    """Each source of a prepared mixture gets a sample over the run's `samples` (`prepared.Mixture` deals source s's
    first at 1/2 / f_s): a share f_s below 1/2 sample of the run would get none, silently."""
    dt = cfg.data
    if not dt.prepared or len(dt.sources) < 2:
        return
    total = sum(src.weight for src in dt.sources)
    for i, src in enumerate(dt.sources):
        share, others = src.weight / total, total - src.weight
        _require(samples * share >= 0.5, f"[[data.sources]] {i} ('{src.label or src.path}'): weight = {src.weight:g} is "
                 f"{share:.3g} of the mixture: no sample of it among this run's {samples:,} (steps x "
                 f"global_batch_size); give it a weight of at least {0.5 * others / (samples - 0.5):.3g}, or leave it out")


def _validate_rope(m: Model, seq_len: int) -> None:
    """The RoPE scaling keys (docs/long-context.md)."""
    _require(m.rope_theta > 0, f"[model] rope_theta = {m.rope_theta:g}: must be > 0")
    if m.rope_scaling == "none":
        _require(m.rope_factor == 1 and m.rope_original_seq_len == 0,
                 f"[model] rope_factor = {m.rope_factor:g}, rope_original_seq_len = {m.rope_original_seq_len} with "
                 f"rope_scaling = 'none': they stretch a scaling; set rope_scaling = 'yarn' (or 'linear'), or leave "
                 f"them at 1 and 0")
    else:
        _require(m.rope_factor >= 1, f"[model] rope_factor = {m.rope_factor:g}: the context grows by this factor, so "
                                     f"it must be >= 1 (e.g. 4 for 1,024 -> 4,096)")
        _require(0 < m.rope_original_seq_len <= seq_len,
                 f"[model] rope_original_seq_len = {m.rope_original_seq_len}: with rope_scaling = '{m.rope_scaling}' "
                 f"give the length the model was pretrained at, > 0 and <= training.seq_len = {seq_len} (the "
                 f"scaling stretches it to a longer context, never a shorter one)")
        _require(m.max_seq_len or seq_len <= m.rope_original_seq_len * m.rope_factor,
                 f"[training] seq_len = {seq_len} exceeds rope_original_seq_len x rope_factor = "
                 f"{m.rope_original_seq_len} x {m.rope_factor:g}, the length the scaling reaches: raise rope_factor "
                 f"to {seq_len / m.rope_original_seq_len:g}")
    _require(m.rope_beta_fast > m.rope_beta_slow > 0 and m.rope_attention_factor >= 0,
             f"[model] rope_beta_fast = {m.rope_beta_fast:g}, rope_beta_slow = {m.rope_beta_slow:g}, "
             f"rope_attention_factor = {m.rope_attention_factor:g}: YaRN needs beta_fast > beta_slow > 0 and an "
             f"attention factor >= 0 (0: 0.1 ln(s) + 1; defaults 32, 1, 0)")
    _require(m.max_seq_len == 0 or m.max_seq_len >= seq_len,
             f"[model] max_seq_len = {m.max_seq_len}: the declared maximum context must be >= training.seq_len = "
             f"{seq_len} (0: derived)")


def last_ac_layer(m: Model, last_layer: int) -> int:
    """[activation_checkpoint] last_layer with -1 meaning the last block."""
    return m.n_layers - 1 if last_layer == -1 else last_layer


def cp_multiple(m: Model, cp: int) -> int:
    """The context-parallel split pads a sequence to a multiple of this: 2 x cp chunks, each a
    whole number of sel blocks (the fast path's query parts start on one)."""
    return 2 * cp * (m.sel_block_size if m.attention == "nsa" else 1)


def _validate_context_parallel(cfg: JobConfig, world_size: int) -> None:
    """A cp degree that divides the world, a sequence long enough to split, and what runs under it."""
    cp, m, t = cfg.parallelism.context_parallel_degree, cfg.model, cfg.training
    _require(cp >= 1, f"[parallelism] context_parallel_degree = {cp}: must be >= 1 (1: no context parallelism)")
    _require(world_size % cp == 0,
             f"[parallelism] context_parallel_degree = {cp} does not divide the world size {world_size}: each "
             f"sequence is split across cp ranks and the rest of the world is data-parallel; use a cp degree "
             f"dividing {world_size}")
    if cp == 1:
        return
    need = cp_multiple(m, cp)
    _require(t.seq_len >= need,
             f"[training] seq_len = {t.seq_len} is too short to split across context_parallel_degree = {cp} ranks: "
             f"each of the 2 x cp zigzag chunks needs at least " +
             (f"one sel block (sel_block_size = {m.sel_block_size})" if m.attention == "nsa" else "one token") +
             f"; use seq_len >= {need} or a smaller context_parallel_degree")
    _require(m.attention == "dense" or m.attn_impl == "fast",
             f"[parallelism] context_parallel_degree = {cp} needs attn_impl = 'fast' for NSA (the reference "
             f"builds dense T x T masks of the whole sequence on every rank)")
    _require(not cfg.metrics.nsa_stats,
             f"[metrics] nsa_stats = true does not run under context_parallel_degree = {cp} yet: turn it off, or "
             f"measure the statistics in a run without context parallelism")


def dp_degrees(cfg: JobConfig, world_size: int) -> tuple[int, int]:
    """(replicate, shard): the data-parallel mesh degrees, a -1 inferred from the ranks left for data
    parallelism (world_size / context_parallel_degree)."""
    p = cfg.parallelism
    replicate, shard = p.data_parallel_replicate_degree, p.data_parallel_shard_degree
    cp = p.context_parallel_degree
    _require(cp >= 1 and world_size % cp == 0,
             f"[parallelism] context_parallel_degree = {cp} does not divide the world size {world_size}")
    world_size //= cp
    _require(not (replicate == -1 and shard == -1),
             "[parallelism] data_parallel_replicate_degree and data_parallel_shard_degree are both -1: set one of "
             "them (e.g. the shard degree to the GPUs per node) and the other is inferred")
    if replicate == -1:
        _require(shard >= 1 and world_size % shard == 0,
                 f"[parallelism] data_parallel_shard_degree = {shard} does not divide the world size {world_size}")
        replicate = world_size // shard
    _require(replicate >= 1, f"[parallelism] data_parallel_replicate_degree = {replicate}: must be >= 1 or -1")
    if shard == -1:
        _require(world_size % replicate == 0,
                 f"[parallelism] data_parallel_replicate_degree = {replicate} does not divide the world size "
                 f"{world_size}")
        shard = world_size // replicate
    _require(shard >= 1, f"[parallelism] data_parallel_shard_degree = {shard}: must be >= 1 or -1")
    _require(replicate * shard == world_size,
             f"[parallelism] data_parallel_replicate_degree ({replicate}) x data_parallel_shard_degree ({shard}) = "
             f"{replicate * shard}, but the world size is {world_size}" +
             ("" if cp == 1 else f" per context-parallel rank (world size / context_parallel_degree {cp})") +
             ": the degrees must multiply to the number of ranks (set the shard degree to -1 to infer it)")
    return replicate, shard


def _validate_eval(cfg: JobConfig) -> None:
    """`[eval]`: counts >= 0, and the recall probe's distances within one sequence of the `[recall]` sizes."""
    e = cfg.eval
    _require(e.position_batches >= 0 and e.bucket >= 0 and e.lm_eval_limit >= 0,
             f"[eval] position_batches = {e.position_batches}, bucket = {e.bucket}, lm_eval_limit = {e.lm_eval_limit}: "
             f"must be >= 0 (0: no loss by position, seq_len / 8, every document)")
    if e.enable and e.recall_distances:
        r, longest = cfg.recall, cfg.training.seq_len + 1 - 2 * (1 + cfg.recall.key_tokens + cfg.recall.value_tokens)
        bad = [d for d in e.recall_distances if not 1 + r.key_tokens + r.value_tokens <= d <= longest]
        _require(not bad, f"[eval] recall_distances = {e.recall_distances}: {bad} do not fit a pair and its query "
                          f"in seq_len = {cfg.training.seq_len} with the [recall] sizes; use distances in "
                          f"[{1 + r.key_tokens + r.value_tokens}, {longest}]")
    _require(not e.lm_eval_include_path or Path(resolve_path(e.lm_eval_include_path)).is_dir(),
             f"[eval] lm_eval_include_path = '{e.lm_eval_include_path}' is not a folder: give the folder of your "
             f"task YAML files, or leave it empty for lm-eval's own tasks")


def _validate_recall(r: Recall, seq_len: int, vocab_size: int) -> None:
    """The recall task's sizes: a pair and its query must fit apart in one sequence, and distinct
    pairs in the key-value alphabet (`data/recall.py`: half of the tokens after the two markers)."""
    for key in ("key_tokens", "value_tokens", "pairs", "asks"):
        _require(getattr(r, key) >= 1, f"[recall] {key} = {getattr(r, key)}: must be >= 1")
    span = 1 + r.key_tokens + r.value_tokens
    longest = seq_len + 1 - 2 * span
    _require(span <= r.min_distance <= longest,
             f"[recall] min_distance = {r.min_distance}: must lie in [{span}, {longest}] (a pair and its query are "
             f"{span} tokens each and must fit apart in seq_len = {seq_len})")
    _require(r.max_distance == 0 or r.min_distance <= r.max_distance <= longest,
             f"[recall] max_distance = {r.max_distance}: must be 0 (as far as seq_len allows: {longest}) or lie in "
             f"[min_distance, {longest}]")
    kv = r.pairs * (r.key_tokens + r.value_tokens)
    _require(not r.distinct or r.drill or kv <= (vocab_size - 2) // 2,
             f"[recall] distinct needs pairs x (key_tokens + value_tokens) = {kv} distinct tokens, but the key-value "
             f"alphabet of vocab_size {vocab_size} has {(vocab_size - 2) // 2}: lower [recall] pairs or raise "
             f"[model] vocab_size to at least {2 * kv + 2}")
