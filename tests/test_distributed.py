"""Spawned 2-rank gloo runs: FSDP2 vs one process, HSDP, and the AC x compile x precision matrix."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from nsa_titan.config import load_config
from nsa_titan.models.transformer import Transformer

from conftest import TINY, UNPINNED, launch_ranks, single_process_run

pytestmark = pytest.mark.multiprocess

STEPS = 8
SEED = ["--debug.seed", "3"]


@pytest.fixture(scope="module")
def fsdp_runs(tmp_path_factory):
    """2 ranks: FSDP (local batch 2, gradient accumulation 2) and HSDP on a 2x1 mesh."""
    # max_norm 0.5 < the gradient norms of these steps: clipping is exercised.
    common = [*TINY, *SEED, "--training.steps", str(STEPS), "--training.global_batch_size", "8",
              "--training.max_norm", "0.5"]
    specs = [
        {"name": "fsdp", "args": common, "save_params": True},
        {"name": "hsdp", "args": [*common, "--parallelism.data_parallel_replicate_degree", "2",
                                   "--parallelism.data_parallel_shard_degree", "1"], "save_params": True},
        {"name": "tied", "args": [*common, "--model.tie_embeddings", "true"], "save_params": True},
        {"name": "reference", "args": [*common, "--model.attn_impl", "reference", *UNPINNED], "save_params": True},
        {"name": "unmasked", "args": [*common, "--training.document_masking", "false"]},
    ]
    return launch_ranks(specs, tmp_path_factory.mktemp("fsdp")), common


def test_fsdp_two_ranks_match_one_process(fsdp_runs):
    runs, common = fsdp_runs
    fsdp = runs["fsdp"]
    # One process sees each global batch whole: local batch 4 = 2 ranks x 2.
    losses, grad_norms, params = single_process_run([*common, "--training.local_batch_size", "4"])
    assert fsdp["steps"] == list(range(1, STEPS + 1))
    torch.testing.assert_close(torch.tensor(fsdp["losses"]), torch.tensor(losses), rtol=1e-5, atol=1e-6)
    # The sharded norm is the full gradient's norm, and clipping by it acted on most steps.
    torch.testing.assert_close(torch.tensor(fsdp["grad_norms"]), torch.tensor(grad_norms), rtol=1e-4, atol=1e-6)
    assert sum(g > 0.5 for g in grad_norms) >= STEPS // 2
    # Parameters are DTensors sharded on dim 0 over the 2 ranks.
    assert all(pl == ["S(0)"] for pl in fsdp["placements"].values()), fsdp["placements"]
    assert losses[-1] < losses[0] - 0.3, "the reference run should learn"
    assert fsdp["params"].keys() == params.keys()
    for name, p in params.items():
        torch.testing.assert_close(fsdp["params"][name], p, rtol=1e-4, atol=1e-5, msg=name)


def test_the_runs_mask_documents(fsdp_runs):
    """Every run above trains with document masking (the default; the synthetic windows hold about
    4 documents each): without it the same steps give other losses."""
    runs, common = fsdp_runs
    cfg, _ = load_config(common, world_size=2)
    assert cfg.training.document_masking and cfg.data.source == "synthetic"
    assert runs["unmasked"]["steps"] == runs["fsdp"]["steps"]
    assert all(abs(a - b) > 1e-4 for a, b in zip(runs["unmasked"]["losses"][1:], runs["fsdp"]["losses"][1:]))


def test_fsdp_with_tied_embeddings_matches_one_process(fsdp_runs):
    runs, common = fsdp_runs
    losses, _, params = single_process_run([*common, "--training.local_batch_size", "4", "--model.tie_embeddings", "true"])
    torch.testing.assert_close(torch.tensor(runs["tied"]["losses"]), torch.tensor(losses), rtol=1e-5, atol=1e-6)
    assert "output.weight" not in params  # one shared parameter, listed once
    for name, p in params.items():
        torch.testing.assert_close(runs["tied"]["params"][name], p, rtol=1e-4, atol=1e-5, msg=name)


def test_fast_attention_trains_like_the_reference_under_fsdp(fsdp_runs):
    runs, _ = fsdp_runs  # "fsdp" runs the default, attn_impl = "fast"
    torch.testing.assert_close(torch.tensor(runs["fsdp"]["losses"]), torch.tensor(runs["reference"]["losses"]),
                               rtol=1e-5, atol=1e-6)
    for name, p in runs["reference"]["params"].items():
        torch.testing.assert_close(runs["fsdp"]["params"][name], p, rtol=1e-4, atol=1e-5, msg=name)


def test_hsdp_2x1_mesh_trains_like_fsdp(fsdp_runs):
    runs, _ = fsdp_runs
    assert all(pl == ["R", "S(0)"] for pl in runs["hsdp"]["placements"].values())
    torch.testing.assert_close(torch.tensor(runs["hsdp"]["losses"]), torch.tensor(runs["fsdp"]["losses"]),
                               rtol=1e-5, atol=1e-6)
    for name, p in runs["fsdp"]["params"].items():
        torch.testing.assert_close(runs["hsdp"]["params"][name], p, rtol=1e-4, atol=1e-5, msg=name)


# The failure matrix of the old trainer on 2 ranks, every pair of settings covered: each AC mode x compile in fp32,
# and bf16 with each AC mode and each compile setting (3 runs, not 6).
AC_MODES = {"ac_none": ["--activation_checkpoint.mode", "none"],
            "ac_full": ["--activation_checkpoint.mode", "full"],
            "ac_every2": ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.every_n_layers", "2"]}
COMPILE = {"eager": ["--compile.enable", "false"], "compiled": ["--compile.enable", "true"]}
PRECISION = {"fp32": ["--training.mixed_precision_param", "float32"],
             "bf16": ["--training.mixed_precision_param", "bfloat16"]}
LONG_RUN = ("ac_full", "compiled", "bf16")  # 80 steps: the old trainer stalled at ~60
LONG_STEPS = 80
MATRIX_STEPS = 5
COMBOS = [*((ac, comp, "fp32") for ac, comp in itertools.product(AC_MODES, COMPILE)),
          ("ac_none", "eager", "bf16"), LONG_RUN, ("ac_every2", "compiled", "bf16")]


def matrix_args(combo: tuple[str, str, str]) -> list[str]:
    steps = LONG_STEPS if combo == LONG_RUN else MATRIX_STEPS
    args = [*TINY, *SEED, "--training.steps", str(steps), "--model.n_layers", "4",
            *AC_MODES[combo[0]], *COMPILE[combo[1]], *PRECISION[combo[2]]]
    return args + (["--metrics.log_freq", "10"] if combo == LONG_RUN else [])


def param_names(combo: tuple[str, str, str]) -> set[str]:
    """Parameter names of the plain (unwrapped) model of this run."""
    cfg, _ = load_config(matrix_args(combo), world_size=2)
    with torch.device("meta"):
        return {n for n, _ in Transformer(cfg.model, cfg.training.seq_len).named_parameters()}


@pytest.fixture(scope="module")
def matrix_runs(tmp_path_factory):
    specs = [{"name": "-".join(combo), "args": matrix_args(combo), "grad_check": True}
             for combo in COMBOS]
    # The matrix runs the default fast attention; the reference, eager without AC, is the yardstick.
    plain = ("ac_none", "eager", "fp32")
    specs.append({"name": "reference", "args": [*matrix_args(plain), "--model.attn_impl", "reference", *UNPINNED],
                  "grad_check": True})
    return launch_ranks(specs, tmp_path_factory.mktemp("matrix"))


@pytest.mark.parametrize("combo", COMBOS, ids="-".join)
def test_matrix_combination_trains_and_every_param_gets_a_gradient(matrix_runs, combo):
    run = matrix_runs["-".join(combo)]
    steps = LONG_STEPS if combo == LONG_RUN else MATRIX_STEPS
    assert run["steps"][-1] == steps
    assert all(math.isfinite(x) for x in run["losses"])
    assert run["missing_grads"] == []
    assert run["grads"].keys() == param_names(combo), "every parameter of the model has a gradient"
    for name, g in run["grads"].items():
        assert torch.isfinite(g).all(), name
        assert g.abs().sum() > 0, f"{name} received an all-zero gradient"


def test_ac_and_compile_do_not_change_losses_or_gradients(matrix_runs):
    base = matrix_runs["ac_none-eager-fp32"]
    for ac, comp in itertools.product(AC_MODES, COMPILE):
        run = matrix_runs[f"{ac}-{comp}-fp32"]
        assert run["grad_loss"] == pytest.approx(base["grad_loss"], rel=1e-5)
        torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(base["losses"]), rtol=1e-4, atol=1e-5)
        for name, g in base["grads"].items():
            torch.testing.assert_close(run["grads"][name], g, rtol=1e-4, atol=1e-6, msg=f"{ac}-{comp}: {name}")


def test_fast_attention_compiled_and_checkpointed_gives_the_reference_gradients(matrix_runs):
    fast, ref = matrix_runs["ac_full-compiled-fp32"], matrix_runs["reference"]
    assert fast["missing_grads"] == [] and fast["grad_loss"] == pytest.approx(ref["grad_loss"], rel=1e-5)
    for name, g in ref["grads"].items():
        torch.testing.assert_close(fast["grads"][name], g, rtol=1e-4, atol=1e-6, msg=name)


def test_bf16_gradients_track_fp32(matrix_runs):
    for ac, comp, _ in (c for c in COMBOS if c[2] == "bf16"):
        fp32, bf16 = matrix_runs[f"{ac}-{comp}-fp32"], matrix_runs[f"{ac}-{comp}-bf16"]
        assert bf16["grad_loss"] == pytest.approx(fp32["grad_loss"], abs=0.02)
        for name, g in fp32["grads"].items():
            # 5% relative, with a floor far below the model's gradient scale (~0.5): the few
            # gradients that are ~1e-10 at init are bf16 rounding noise in both directions.
            err = (bf16["grads"][name] - g).norm()
            assert err <= 0.05 * g.norm() + 1e-6, f"{ac}-{comp}: {name} bf16 gradient off by {err:.2e}"


def test_long_run_completes_and_learns(matrix_runs):
    run = matrix_runs["-".join(LONG_RUN)]
    assert run["steps"][0] == 1 and run["steps"][-1] == LONG_STEPS
    assert run["losses"][-1] < run["losses"][0] - 1.0
