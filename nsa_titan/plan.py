"""Capacity planner: will a config fit, and how fast will it go, at a given world size?

    python -m nsa_titan.plan --world_size 8 --config train_configs/m7c.toml [--gpu_memory_gib 80]
                             [--peak_tflops 989] [--mfu 0.4] [--section.key value ...]

Without a GPU and without allocating weights: the model is built on the meta device and the
real parallelism plan (`parallelize`: AC, FSDP/HSDP) is applied on a fake process group of
`world_size` ranks, so the per-rank shard sizes are the ones training would have. Reports
parameter counts (total, per part, per block), per-rank memory for parameters, gradients,
optimizer state, the gathered compute copy and activations, the NSA-aware FLOPs per token,
and the step time and tokens/s at the given peak and MFU. Exit code 1 when it does not fit.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import sys
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .config import DTYPES, JobConfig, ac_layers, cp_multiple, derive, grad_accum_steps, load_config
from .data import build_tokenizer
from .distributed.parallel import apply_ac, build_mesh, parallelize
from .models.loss import cross_entropy_loss
from .models.rope import rope_tables
from .models.transformer import Transformer, TransformerBlock
from .system.cli import ArgumentParser, leave, run_command

GIB = 2**30


@dataclass
class Plan:
    params_total: int
    params_by_part: dict[str, int]
    params_per_block: int
    rank_bytes: dict[str, float]
    comm_bytes: dict[str, float]
    flops_per_token: float
    step_seconds: float
    tokens_per_second: float


def block_saved_bytes(cfg: JobConfig, T: int) -> float:
    """Bytes one block keeps for backward at sequence length T (batch 1), measured by running
    one real block of this config on the CPU at T under saved-tensor hooks."""
    m = cfg.model
    dtype = DTYPES[cfg.training.mixed_precision_param]
    block = TransformerBlock(m).to(dtype)
    block.init_weights(0.02, 0.02, torch.Generator().manual_seed(0))
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    x = torch.randn(1, T, m.dim, dtype=dtype, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x, rope_tables(m, T).to(dtype))
    return float(sum(seen.values()))


def split_lengths(cfg: JobConfig) -> tuple[int, int]:
    """(T, Tl): the sequence length a rank's attention reads and the tokens it computes (T = Tl =
    seq_len without context parallelism; else seq_len padded to `cp_multiple` and its 1/cp share)."""
    cp, T = cfg.parallelism.context_parallel_degree, cfg.training.seq_len
    if cp > 1:
        multiple = cp_multiple(cfg.model, cp)
        T = -(-T // multiple) * multiple
    return T, T // cp


def gathered_bytes_per_token(cfg: JobConfig) -> float:
    """What context parallelism adds per token of the other ranks, per block: the all-gathered keys
    and values (3 branches x K, V for NSA, K, V for dense), and for NSA the compression MLPs' saved
    inputs and hidden activations, since each rank compresses the whole sequence."""
    m = cfg.model
    size = DTYPES[cfg.training.mixed_precision_param].itemsize
    G, D = m.n_kv_groups, m.head_dim
    if m.attention != "nsa":
        return 2 * G * D * size
    hidden = (m.cmp_mlp_hidden or 4 * D) if m.cmp_phi == "mlp" else 0
    compressor = 2 * G * (m.cmp_block_size * D + 2 * hidden) / m.cmp_stride  # K and V, per token
    return (6 * G * D + compressor) * size


def activation_bytes(cfg: JobConfig) -> float:
    """Activation memory of one micro-batch on one rank.

    What a block keeps for backward is measured on one real block at two short lengths and
    extrapolated to seq_len as a*T + b*T^2 (the b term is the reference NSA's T x T masks).
    AC none keeps every block's; a checkpointed block keeps its input only, and one block's
    worth is rebuilt during its recompute. Plus the fp32 log-probabilities the loss keeps (the
    logits themselves are not kept: `loss.cross_entropy_loss` holds no reference to them).
    Under context parallelism a rank keeps this for its Tl tokens, plus what the gathered rest of
    the sequence costs (`gathered_bytes_per_token`).
    """
    m, t = cfg.model, cfg.training
    T1 = min(t.seq_len, max(256, m.window_size, 2 * m.sel_block_size))
    T2 = 2 * T1
    s1, s2 = block_saved_bytes(cfg, T1), block_saved_bytes(cfg, T2)
    b = max(0.0, (s2 / T2 - s1 / T1) / (T2 - T1))  # per token, per extra token of context
    a = s1 / T1 - b * T1
    T, Tl = split_lengths(cfg)
    per_block = t.local_batch_size * (a * Tl + b * Tl * T + (T - Tl) * gathered_bytes_per_token(cfg))
    wrapped = len(ac_layers(m, cfg.activation_checkpoint))
    block_input = t.local_batch_size * Tl * m.dim * DTYPES[t.mixed_precision_param].itemsize
    logits = t.local_batch_size * Tl * m.vocab_size * 4
    return (m.n_layers - wrapped) * per_block + wrapped * block_input + (per_block if wrapped else 0) + logits


def comm_bytes(cfg: JobConfig, params_local: int, world_size: int) -> dict[str, float]:
    """Bytes one rank receives per optimizer step: FSDP's parameter all-gathers (forward, and again
    in backward for resharded blocks) and gradient reduce-scatters, each moving (N - 1)/N of the
    full tensors over N shards; and context parallelism's K/V all-gathers (forward, the recompute of
    checkpointed blocks) and their gradients' reduce-scatters (backward), (cp - 1)/cp of the
    gathered K/V per block per micro-batch."""
    m, t, p = cfg.model, cfg.training, cfg.parallelism
    shards = world_size // p.data_parallel_replicate_degree
    compute = DTYPES[t.mixed_precision_param].itemsize
    full_params = params_local * shards
    regather = 2 if p.fsdp_reshard_after_forward != "never" else 1
    accum = grad_accum_steps(cfg)
    out = {"FSDP parameter all-gathers": accum * regather * full_params * compute * (shards - 1) / shards,
           "FSDP gradient reduce-scatters": accum * full_params * DTYPES[t.mixed_precision_reduce].itemsize
           * (shards - 1) / shards}
    cp = p.context_parallel_degree
    if cp > 1:
        T, _ = split_lengths(cfg)
        kv = (6 if m.attention == "nsa" else 2) * m.n_kv_groups * m.head_dim * compute
        passes = 2 * m.n_layers + len(ac_layers(m, cfg.activation_checkpoint))  # fwd + bwd + recomputes
        out["context-parallel K/V"] = accum * passes * t.local_batch_size * T * kv * (cp - 1) / cp
    return out


def measured_activation_peak(cfg: JobConfig) -> float:
    """Peak bytes of tensors alive during one real forward + backward of the whole model on this
    machine (parameters and gradients allocated before; the allocator's cache not counted):
    the CUDA allocator's peak on a GPU, the profiler's allocation events on the CPU."""
    from torch.profiler import ProfilerActivity, profile

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = DTYPES[cfg.training.mixed_precision_param]
    model = Transformer(cfg.model, cfg.training.seq_len).to(device)
    model.init_weights(0)
    model.to(dtype)
    apply_ac(model, ac_layers(cfg.model, cfg.activation_checkpoint))
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    tokens = torch.randint(0, cfg.model.vocab_size, (cfg.training.local_batch_size, cfg.training.seq_len + 1),
                           device=device)

    def step() -> None:
        cross_entropy_loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()

    if device.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        return float(torch.cuda.max_memory_allocated() - base)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    live = peak = 0
    for _, change in sorted((e.time_range.start, e.self_cpu_memory_usage) for e in prof.events()
                            if e.self_cpu_memory_usage):
        live += change
        peak = max(peak, live)
    return float(peak)


def check_activations(cfg: JobConfig) -> tuple[float, float, JobConfig]:
    """Predicted vs measured activation memory on this machine, for the config cut to a size it
    can run (at most 2 blocks, seq 1024, micro-batch 1, fp32 on a CPU)."""
    small = copy.deepcopy(cfg)
    small.model.n_layers = min(cfg.model.n_layers, 2)
    small.training.seq_len = min(cfg.training.seq_len, 1024)
    small.training.local_batch_size = 1
    if not torch.cuda.is_available():
        small.training.mixed_precision_param = "float32"
    small.activation_checkpoint.last_layer = -1
    return activation_bytes(small), measured_activation_peak(small), small


def make_plan(cfg: JobConfig, world_size: int, peak_flops: float, mfu: float) -> Plan:
    """Build on meta, shard on the (fake) process group, count. Needs dist initialised."""
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "Initializing zero-element tensors is a no-op"
        model = Transformer(cfg.model, cfg.training.seq_len)
    by_part = model.parameter_parts()
    total = sum(by_part.values())
    per_block = sum(p.numel() for p in next(iter(model.layers.values())).parameters())
    root = total - sum(p.numel() for p in model.layers.parameters())
    fpt = model.flops_per_token(cfg.training.seq_len)
    act = activation_bytes(cfg)

    no_compile = dataclasses.replace(cfg.compile, enable=False)  # the plan needs the shards, not compiled code
    parallelize(model, build_mesh(cfg.parallelism, torch.device("cpu")),
                ac_layers(cfg.model, cfg.activation_checkpoint), no_compile, cfg.training, cfg.parallelism)
    local = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters())
    comm = comm_bytes(cfg, local, world_size)
    compute = DTYPES[cfg.training.mixed_precision_param].itemsize
    rank_bytes = {
        "parameters (fp32 shards)": local * 4.0,
        "gradients (fp32 shards)": local * 4.0,
        "optimizer state (AdamW, 2 x fp32)": local * 8.0,
        # all-gathered compute copies: the block in use and the one prefetched, plus the root's
        "gathered parameters": (2 * per_block + root) * compute,
        "activations (one micro-batch)": act,
    }
    t = cfg.training
    step = t.global_batch_size * t.seq_len * fpt / (world_size * peak_flops * mfu)
    return Plan(total, by_part, per_block, rank_bytes, comm, fpt, step, t.global_batch_size * t.seq_len / step)


def report(plan: Plan, cfg: JobConfig, world_size: int, gpu_gib: float, peak_flops: float, mfu: float) -> bool:
    p = cfg.parallelism
    print(f"plan: {world_size} ranks (replicate {p.data_parallel_replicate_degree} x shard "
          f"{p.data_parallel_shard_degree} x context {p.context_parallel_degree}), seq {cfg.training.seq_len}, "
          f"micro-batch {cfg.training.local_batch_size}, "
          f"global batch {cfg.training.global_batch_size}, AC {cfg.activation_checkpoint.mode}, "
          f"{cfg.model.attention} attention ({cfg.model.attn_impl})")
    print(f"parameters: {plan.params_total / 1e6:.2f}M total, {plan.params_per_block / 1e6:.2f}M per block")
    for part, n in sorted(plan.params_by_part.items(), key=lambda kv: -kv[1]):
        print(f"  {part:<24} {n / 1e6:9.2f}M")
    print("per-rank memory:")
    for what, b in plan.rank_bytes.items():
        print(f"  {what:<36} {b / GIB:8.2f} GiB")
    need = sum(plan.rank_bytes.values())
    print(f"  {'total':<36} {need / GIB:8.2f} GiB of {gpu_gib:.0f} GiB")
    print("per-rank communication per step (received):")
    for what, b in plan.comm_bytes.items():
        print(f"  {what:<36} {b / GIB:8.2f} GiB")
    print(f"FLOPs per token {plan.flops_per_token / 1e9:.3f} G; at {peak_flops / 1e12:.0f} TFLOP/s x {mfu:.0%} MFU: "
          f"{plan.step_seconds:.2f} s per step, {plan.tokens_per_second:,.0f} tokens/s "
          f"({plan.tokens_per_second / world_size:,.0f} per rank)")
    fits = need <= gpu_gib * GIB
    if not fits:
        print(f"DOES NOT FIT: {need / GIB:.1f} GiB per rank needed, {gpu_gib:.0f} GiB available; try activation "
              f"checkpointing, a smaller micro-batch, or more ranks")
    return fits


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="nsa_titan.plan", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world_size", type=int, required=True)
    parser.add_argument("--gpu_memory_gib", type=float, default=80.0)
    parser.add_argument("--peak_tflops", type=float, default=989.0, help="bf16 peak of one GPU (H100: 989)")
    parser.add_argument("--mfu", type=float, default=0.4)
    parser.add_argument("--check_activations", action="store_true",
                        help="also run the config, cut to a size this machine can run, and compare the activation "
                             "estimate with the measured peak")
    args, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    for bad, why in ((args.world_size < 1, "--world_size must be >= 1"),
                     (args.gpu_memory_gib <= 0, "--gpu_memory_gib must be > 0"),
                     (args.peak_tflops <= 0, "--peak_tflops must be > 0"),
                     (not 0 < args.mfu <= 1, "--mfu must lie in (0, 1]")):
        if bad:
            parser.error(why)
    return run_command("nsa_titan.plan", lambda: _plan(args, rest))


def _plan(args: argparse.Namespace, rest: list[str]) -> int:
    cfg, _ = load_config(rest, world_size=args.world_size)
    cfg = derive(cfg, args.world_size, build_tokenizer(cfg.data.tokenizer, cfg.data.tokenizer_path).vocab_size)
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.world_size)
    try:
        plan = make_plan(cfg, args.world_size, args.peak_tflops * 1e12, args.mfu)
    finally:
        dist.destroy_process_group()
    fits = report(plan, cfg, args.world_size, args.gpu_memory_gib, args.peak_tflops * 1e12, args.mfu)
    if args.check_activations:
        predicted, measured, small = check_activations(cfg)
        print(f"activation check on this machine ({small.model.n_layers} blocks, seq {small.training.seq_len}, "
              f"micro-batch 1, {small.training.mixed_precision_param}): predicted {predicted / GIB:.3f} GiB, "
              f"measured peak {measured / GIB:.3f} GiB ({predicted / measured:.2f}x)")
    return 0 if fits else 1


if __name__ == "__main__":
    leave(main())
