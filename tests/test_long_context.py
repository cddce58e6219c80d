"""Long context the paper's way: RoPE scaling (tables equal to transformers'), adaptation runs from a
step folder and from a Hugging Face folder at a longer seq_len, generate and evaluate up to the declared
maximum (and a clear refusal past it), loss by position, and bad RoPE settings."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nsa_titan.checkpoint import inspect_folder, load_tensors
from nsa_titan.config import ConfigError, Model, load_config, max_context
from nsa_titan.data import HeldOutSets
from nsa_titan.observe.evals import token_positions
from nsa_titan.evaluate import evaluate
from nsa_titan.generate import generate
from nsa_titan.checkpoint.inference import load_model
from nsa_titan.models.loss import cross_entropy_loss
from nsa_titan.models.rope import check_source, hf_rope_parameters, rope_of, rope_settings, rope_tables

from conftest import ROOT, from_step, tb_losses

SCALINGS = {
    "linear": dict(rope_scaling="linear", rope_factor=4.0, rope_original_seq_len=1024),
    "yarn": dict(rope_scaling="yarn", rope_factor=4.0, rope_original_seq_len=1024),
    "yarn-8k-32k": dict(rope_scaling="yarn", rope_factor=4.0, rope_original_seq_len=8192, rope_theta=10000.0),
    "yarn-own": dict(rope_scaling="yarn", rope_factor=3.0, rope_original_seq_len=512, rope_beta_fast=16.0,
                     rope_beta_slow=2.0, rope_attention_factor=1.3),
}


@pytest.mark.parametrize("name", SCALINGS)
@pytest.mark.parametrize("head_dim", [32, 64])
def test_scaled_rope_tables_equal_transformers(name, head_dim):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    m = Model(**{"head_dim": head_dim, "rope_theta": 500000.0, **SCALINGS[name]})
    T = m.rope_original_seq_len * 4
    hf = LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim, max_position_embeddings=T,
                     rope_parameters=hf_rope_parameters(m))
    cos, sin = LlamaRotaryEmbedding(hf)(torch.zeros(1, T, head_dim), torch.arange(T)[None])
    theirs = torch.cat([cos[0, :, : head_dim // 2], sin[0, :, : head_dim // 2]], -1)
    ours = rope_tables(m, T)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
    assert not torch.allclose(ours, rope_tables(Model(head_dim=head_dim, rope_theta=500000.0), T))  # really scaled


@pytest.mark.parametrize("name", [None, *SCALINGS])
def test_rope_settings_round_trip_through_config_json(name):
    m = Model(head_dim=32, **(SCALINGS[name] if name else {}))
    back = dataclasses.replace(rope_of(rope_settings({"rope_parameters": hf_rope_parameters(m)})), head_dim=32)
    assert torch.equal(rope_tables(back, 2048), rope_tables(m, 2048))
    # An export written before rope_parameters existed: rope_theta at the top level.
    assert rope_settings({"rope_theta": 5e5}) == {"rope_theta": 5e5, "rope_scaling": "none"}


YARN = ["--model.rope_scaling", "yarn", "--model.rope_factor", "2", "--model.rope_original_seq_len", "128"]


@pytest.mark.parametrize("args, phrase", [
    ([*YARN[:4], "--model.rope_factor", "0.5", *YARN[4:]], "rope_factor = 0.5"),
    (["--model.rope_scaling", "ntk"], "rope_scaling = 'ntk' is invalid"),
    ([*YARN[:4], "--model.rope_original_seq_len", "512"], "rope_original_seq_len = 512"),
    ([*YARN[:4]], "rope_original_seq_len = 0"),
    (["--model.rope_factor", "2"], "rope_scaling = 'none'"),
    ([*YARN[:4], "--model.rope_original_seq_len", "64"], "exceeds rope_original_seq_len x rope_factor"),
    ([*YARN, "--model.rope_beta_fast", "0.5"], "rope_beta_fast = 0.5"),
    (["--model.max_seq_len", "100"], "max_seq_len = 100"),
])
def test_bad_rope_settings_are_config_errors_naming_the_key(args, phrase):
    with pytest.raises(ConfigError, match=phrase.replace("(", r"\(")):
        load_config(["--training.seq_len", "256", *args], world_size=1)


def test_declared_maximum_context():
    assert max_context(load_config(["--training.seq_len", "256"], world_size=1)[0]) == 256
    assert max_context(load_config(["--training.seq_len", "256", *YARN], world_size=1)[0]) == 256
    assert max_context(load_config(["--training.seq_len", "256", *YARN[:2], "--model.rope_factor", "8",
                                    *YARN[4:]], world_size=1)[0]) == 1024
    assert max_context(load_config(["--training.seq_len", "256", "--model.max_seq_len", "4096"], world_size=1)[0]) == 4096


def test_an_adaptation_scales_an_unscaled_source_from_its_length_and_nothing_else():
    plain, scaled = {"rope_theta": 1e4}, dict(rope_scaling="yarn", rope_factor=2.0, rope_original_seq_len=128)
    check_source(plain, 128, Model(**scaled), "src")  # pretrained at 128, stretched from 128
    check_source(scaled, 256, Model(**scaled), "src")  # an adaptation resumed under another name
    check_source(plain, 256, Model(), "src")  # a warm start without a scaling
    with pytest.raises(ConfigError, match="rope_original_seq_len = 128, but src was trained at seq_len 64"):
        check_source(plain, 64, Model(**scaled), "src")
    with pytest.raises(ConfigError, match="rope_theta = 500000, but src was trained with rope_theta = 10000"):
        check_source(plain, 128, Model(**scaled, rope_theta=5e5), "src")
    with pytest.raises(ConfigError, match="was trained with RoPE yarn x2 from 128, and this run asks for yarn x4"):
        check_source(scaled, 256, Model(**{**scaled, "rope_factor": 4.0}), "src")
    with pytest.raises(ConfigError, match="was trained with RoPE yarn x2 from 128, and this run asks for none"):
        check_source(scaled, 256, Model(), "src")


def test_token_positions_restart_with_each_document():
    ids = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2], [5, 5, 5, 5, 5, 5, 5, 5]])
    assert token_positions(ids, ids.shape).tolist() == [[0, 1, 2, 0, 1, 0, 1, 2], list(range(8))]
    assert token_positions(None, ids.shape).tolist() == [list(range(8))] * 2


# ------------------------------------------------------------------- runs, as users run them

SMALL = ["--model.dim", "64", "--model.n_layers", "2", "--model.n_heads", "4", "--model.head_dim", "16",
         "--training.local_batch_size", "4", "--metrics.log_freq", "1", "--validation.enable", "false",
         "--checkpoint.enable", "true", "--checkpoint.async_mode", "async", "--data.num_workers", "2",
         "--lr_scheduler.warmup_steps", "2", "--lr_scheduler.decay_type", "constant", "--optimizer.lr", "3e-3"]
ADAPT = ["--training.seq_len", "256", "--model.rope_scaling", "yarn", "--model.rope_factor", "4",
         "--model.rope_original_seq_len", "128"]
"""Twice the pretraining's seq_len; declared for 4 x 128 = 512 tokens."""


def run_train(dump: Path, *args: str, expect: int = 0) -> str:
    proc = subprocess.run([str(ROOT / "run_train.sh"), *SMALL, "--job.dump_folder", str(dump), *args],
                          env={**os.environ, "NGPU": "2", "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == expect, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory) -> Path:
    """12 steps at seq_len 128 (2 ranks, 2 loader workers, async saves), exported as an HF folder at the end."""
    dump = tmp_path_factory.mktemp("pretrain") / "run"
    run_train(dump, "--training.seq_len", "128", "--training.steps", "12", "--checkpoint.interval", "12",
              "--checkpoint.export_at_end", "true", "--checkpoint.export_format", "hf",
              "--checkpoint.export_dtype", "float32")
    return dump / "checkpoint"


@pytest.fixture(scope="module")
def adaptation(pretrained, tmp_path_factory) -> tuple[Path, str]:
    """The adaptation from the step folder: 12 steps at twice the length, checkpoints at 6 and 12; its output."""
    dump = tmp_path_factory.mktemp("adaptation") / "run"
    return dump, run_train(dump, *ADAPT, "--training.steps", "12", "--checkpoint.interval", "6",
                           "--checkpoint.initial_load_path", str(pretrained / "step-12"))


@pytest.fixture(scope="module")
def adapted(adaptation) -> Path:
    """The adaptation's step-6 checkpoint (a run stopped there and resumed trains on bit-equal: the test below)."""
    return adaptation[0] / "checkpoint" / "step-6"


@pytest.mark.multiprocess
@pytest.mark.parametrize("source", ["step-12", "model-step-12-hf"])
def test_adaptation_at_twice_the_length_learns_names_its_source_and_resumes_exactly(pretrained, adaptation, source,
                                                                                     tmp_path):
    """From a step folder and from an HF folder: the log names the source, the loss falls; interrupted at step 6
    and resumed (from the step folder: a resume reads the adaptation's own checkpoint, whatever its source), the
    run ends bit-equal."""
    src = pretrained / source
    if source == "step-12":  # the module's adaptation is this run
        straight, out = adaptation
    else:
        straight = tmp_path / "straight"
        out = run_train(straight, *ADAPT, "--training.steps", "12", "--checkpoint.interval", "6",
                        "--checkpoint.initial_load_path", str(src))
    assert (f"initial model weights from {src}, trained at seq_len 128 with RoPE none; this run: seq_len 256, RoPE "
            f"yarn x4 from 128; fresh optimizer, lr schedule and data position") in out
    losses = tb_losses(straight / "tb")
    assert sorted(losses) == list(range(1, 13))
    assert sum(losses[s] for s in (10, 11, 12)) < sum(losses[s] for s in (1, 2, 3)) - 0.3, losses
    if source != "step-12":
        return
    # Interrupted at step 6 (a new folder holding the run's step-6 checkpoint alone) and resumed by the same
    # command: the adaptation's own checkpoint, not the source, and bit-equal.
    split = from_step(straight, 6, tmp_path / "split")
    out = run_train(split, *ADAPT, "--training.steps", "12", "--checkpoint.interval", "6",
                    "--checkpoint.initial_load_path", str(src))
    assert f"resumed from {split / 'checkpoint' / 'step-6'} at step 6" in out and "initial model weights" not in out
    a, b = straight / "checkpoint" / "step-12", split / "checkpoint" / "step-12"
    assert inspect_folder(a) is None and inspect_folder(b) is None
    for prefix in ("model", "optimizer"):
        ta, tb = load_tensors(a, prefix), load_tensors(b, prefix)
        assert ta.keys() == tb.keys() and len(ta) > 10
        assert all(torch.equal(ta[k], tb[k]) for k in ta), f"{prefix} differs after the resume"


@pytest.mark.multiprocess
def test_generate_and_evaluate_past_the_training_length_agree_with_the_forward(adapted):
    model, tokenizer, cfg = load_model(str(adapted))
    assert cfg.training.seq_len == 256 and model.max_seq_len == 512  # the declared maximum, 4 x 128
    new = list(generate(model, tokenizer, "def f(x):", 400, temperature=0))
    ids = torch.tensor([tokenizer.encode("def f(x):") + new])
    assert 256 < ids.shape[1] <= 512, "the greedy run ended early: choose another prompt"
    with torch.no_grad():
        full = model(ids).argmax(-1)[0, -len(new) - 1:-1]
    assert full.tolist() == new  # each token the forward's greedy choice at its position
    result = evaluate(str(adapted), batches=1, seq_len=512, by_position=True, bucket=128)
    inputs, labels, doc_ids, _ = HeldOutSets(cfg.data, cfg.validation, tokenizer, 512, cfg.training.local_batch_size,
                                             0, 1).batches()[0][0]
    with torch.no_grad():
        loss = cross_entropy_loss(model(inputs, doc_ids), labels)
    assert result["loss"] == pytest.approx(float(loss), rel=1e-6) and result["tokens"] == labels.numel()
    buckets = result["by_position"]
    assert list(buckets) == [(0, 128), (128, 256), (256, 384), (384, 512)]
    total = sum(n for _, n in buckets.values())
    assert total == labels.numel()
    assert sum(v * n for v, n in buckets.values()) / total == pytest.approx(result["loss"], rel=1e-6)


@pytest.mark.multiprocess
def test_recall_takes_distances_past_the_training_length(adapted):
    """Held-out recall rows of 512 tokens (twice the training length) with each pair 300 tokens back."""
    proc = subprocess.run([sys.executable, "-m", "nsa_titan.evaluate", str(adapted), "--task", "recall", "--seq_len",
                           "512", "--distances", "64", "300", "--batches", "1"], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [line.split("|")[1:4] for line in proc.stdout.splitlines() if line.startswith("| 300 |")]
    assert rows and int(rows[0][2]) > 0, proc.stdout  # queries asked at distance 300


@pytest.mark.multiprocess
@pytest.mark.parametrize("command, phrase", [
    (["nsa_titan.evaluate", "{ckpt}", "--seq_len", "1024", "--batches", "1"],
     "--seq_len: a context of 1,024 tokens is beyond the model's declared maximum of 512 (rope_original_seq_len 128 "
     "x rope_factor 4)"),
    (["nsa_titan.evaluate", "{ckpt}", "--task", "recall", "--seq_len", "600", "--distances", "300"],
     "beyond the model's declared maximum of 512"),
    (["nsa_titan.generate", "{ckpt}", "--prompt", "def", "--max_new_tokens", "600"],
     "the prompt and --max_new_tokens: a context of 601 tokens is beyond the model's declared maximum of 512"),
])
def test_a_context_past_the_declared_maximum_is_one_line_and_exit_2(adapted, command, phrase):
    cmd = [sys.executable, "-m", *(c.format(ckpt=adapted) for c in command)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and phrase in lines[0], proc.stderr[-2000:]


@pytest.mark.multiprocess
@pytest.mark.parametrize("args, phrase", [
    (["--model.rope_original_seq_len", "64"], "rope_original_seq_len = 64, but {src} was trained at seq_len 128"),
    (["--model.rope_theta", "500000"], "rope_theta = 500000, but {src} was trained with rope_theta = 10000"),
    (["--model.rope_factor", "0.5"], "rope_factor = 0.5: the context grows by this factor"),
    (["--model.rope_scaling", "ntk"], "rope_scaling = 'ntk' is invalid"),
    (["--model.rope_original_seq_len", "512"], "rope_original_seq_len = 512: with rope_scaling = 'yarn'"),
])
def test_bad_rope_settings_or_sources_exit_2_with_one_line_and_write_nothing(pretrained, tmp_path, args, phrase):
    src = pretrained / "step-12"
    out = run_train(tmp_path / "run", *ADAPT, *args, "--checkpoint.initial_load_path", str(src), expect=2)
    errors = [line for line in out.splitlines() if "error" in line]
    assert len(errors) == 1 and phrase.format(src=src) in errors[0], out[-3000:]
    assert not (tmp_path / "run").exists()
