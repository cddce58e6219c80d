"""The capacity planner: fast at any world size, counts and per-rank memory equal to real runs."""

from __future__ import annotations

import subprocess
import sys
import resource

import pytest

from nsa_titan.config import load_config
from nsa_titan.models.transformer import Transformer

from conftest import ROOT, TINY, UNPINNED, launch_ranks

# m7c.toml with the embedded corpus's tokenizer (4,096 pieces), offline: its own is fetched from the hub.
M7C_OFFLINE = ["--config", str(ROOT / "train_configs" / "m7c.toml"), "--data.tokenizer", "sentencepiece",
               "--data.tokenizer_path", "data/python_docs/tokenizer.model"]


def plan(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nsa_titan.plan", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [1, 8, 64])
def test_plans_m7c_at_any_world_size_in_seconds(world):
    """Seconds of CPU time (not wall time, which a busy machine stretches): the plan shards meta
    tensors and runs one block at a short length, never the model's weights or the world's ranks."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = plan("--world_size", str(world), *M7C_OFFLINE)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    assert proc.returncode == 0, proc.stderr
    cpu_s = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert cpu_s < 60, cpu_s
    assert f"plan: {world} ranks (replicate 1 x shard {world} x context 1)" in proc.stdout
    cfg, _ = load_config(["--config", str(ROOT / "train_configs" / "m7c.toml"), "--model.vocab_size", "4096"],
                         world_size=world)
    real = sum(p.numel() for p in Transformer(cfg.model, 64).parameters())  # materialised on the CPU
    assert f"parameters: {real / 1e6:.2f}M total" in proc.stdout


@pytest.mark.multiprocess
def test_per_rank_parameter_and_optimizer_memory_match_a_real_fsdp_run(tmp_path):
    args = [*TINY, "--training.steps", "1"]
    real = launch_ranks([{"name": "m", "args": args, "rank_bytes": True}], tmp_path)["m"]["rank_bytes"]
    out = plan("--world_size", "2", *args).stdout
    gib = {line.split("  ")[1].strip(): float(line.split()[-2]) * 2**30 for line in out.splitlines()
           if line.startswith("  ") and line.strip().endswith("GiB")}
    assert gib["parameters (fp32 shards)"] == pytest.approx(real["params"], rel=0.02, abs=0.006 * 2**30)
    assert gib["optimizer state (AdamW, 2 x fp32)"] == pytest.approx(real["optimizer"], rel=0.02, abs=0.006 * 2**30)


def test_plan_counts_shards_exactly():
    """The same numbers, unrounded: the planner's shard sizes are the trainer's."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from nsa_titan.plan import make_plan

    cfg, _ = load_config([*TINY, "--model.n_layers", "3"], world_size=4)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        p = make_plan(cfg, 4, 1e12, 0.5)
    finally:
        dist.destroy_process_group()
    total = sum(x.numel() for x in Transformer(cfg.model, 64).parameters())
    assert p.params_total == total
    # FSDP pads each parameter's dim 0 up to a multiple of the shard count.
    padded = sum(-(-x.shape[0] // 4) * (x.numel() // x.shape[0]) for x in Transformer(cfg.model, 64).parameters())
    assert p.rank_bytes["parameters (fp32 shards)"] == padded * 4
    assert p.rank_bytes["optimizer state (AdamW, 2 x fp32)"] == padded * 8
    assert p.flops_per_token > 0 and p.tokens_per_second > 0


@pytest.mark.multiprocess
def test_impossible_plans_are_reported_with_numbers():
    bad_mesh = plan("--world_size", "8", "--parallelism.data_parallel_replicate_degree", "3")
    assert bad_mesh.returncode == 2
    assert "nsa_titan.plan: config error:" in bad_mesh.stderr and "does not divide the world size 8" in bad_mesh.stderr
    too_big = plan("--world_size", "1", *M7C_OFFLINE,
                   "--activation_checkpoint.mode", "none", "--training.seq_len", "32768", "--gpu_memory_gib", "40")
    assert too_big.returncode == 1
    assert "DOES NOT FIT:" in too_big.stdout and "GiB per rank needed, 40 GiB available" in too_big.stdout


@pytest.mark.parametrize("impl", ["fast", "reference"])
def test_activation_estimate_matches_the_memory_a_whole_model_keeps_for_backward(impl):
    """Estimated from one block at two short lengths; measured on the whole 4-block model at
    seq 512 (saved tensors of the forward pass, AC off)."""
    import torch
    import torch.nn.functional as F

    from nsa_titan.plan import activation_bytes

    args = [*TINY, "--model.n_layers", "4", "--training.seq_len", "512", "--training.local_batch_size", "2",
            "--model.attn_impl", impl, *(UNPINNED if impl == "reference" else [])]
    cfg, _ = load_config(args, world_size=1)
    model = Transformer(cfg.model, 512)
    model.init_weights(0)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    tokens = torch.randint(0, 64, (2, 513))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        F.cross_entropy(model(tokens[:, :-1]).float().flatten(0, 1), tokens[:, 1:].flatten())
    measured = sum(seen.values())
    assert activation_bytes(cfg) == pytest.approx(measured, rel=0.25)


@pytest.mark.slow
@pytest.mark.parametrize("ac", ["none", "full"])
@pytest.mark.parametrize("model", ["tiny", "m7c"])
def test_activation_estimate_within_25_percent_of_the_measured_peak(ac, model):
    """The peak of live tensor bytes over a real forward + backward on this CPU (profiler
    allocation events), fast NSA attention, activation checkpointing off and full."""
    from nsa_titan.plan import check_activations

    base = ([*TINY, "--model.n_layers", "4", "--training.seq_len", "512", "--model.attn_impl", "fast"]
            if model == "tiny" else ["--config", str(ROOT / "train_configs" / "m7c.toml"), "--model.vocab_size", "4096"])
    cfg, _ = load_config([*base, "--activation_checkpoint.mode", ac], world_size=1)
    predicted, measured, small = check_activations(cfg)
    assert small.training.local_batch_size == 1 and small.model.n_layers == 2
    assert predicted == pytest.approx(measured, rel=0.25), (predicted, measured)
