"""Config parsing: overrides, printing, and bad input stopping the run before any model is built."""

from __future__ import annotations

import copy
import os
import subprocess
from pathlib import Path

import pytest
import tomli

from nsa_titan import train
from nsa_titan.config import (
    ActivationCheckpoint, ConfigError, JobConfig, Model, ac_layers, derive, load_config, parse_args, validate,
)

from conftest import ROOT

BAD_TOML = {
    "syntax.toml": "[training\nsteps = 3\n",
    "section.toml": "[trainng]\nsteps = 3\n",
    "key.toml": "[model]\ndimm = 64\n",
    "type.toml": '[training]\nsteps = "ten"\n',
    "toplevel.toml": "steps = 5\n",
}

# (argv, world size, fragments the message must contain)
BAD = [
    (["--config", "no/such/file.toml"], 1, ["config file 'no/such/file.toml' not found", "--config"]),
    (["--config", "{tmp}/syntax.toml"], 1, ["is not valid TOML"]),
    (["--config", "{tmp}/section.toml"], 1, ["unknown section [trainng]", "known sections", "training"]),
    (["--config", "{tmp}/key.toml"], 1, ["unknown key 'dimm' in [model]", "dim"]),
    (["--config", "{tmp}/type.toml"], 1, ["[training] steps = 'ten' is invalid: expected an integer"]),
    (["--config", "{tmp}/toplevel.toml"], 1, ["top-level key 'steps' must be a [section] table"]),
    (["--training.stepz", "5"], 1, ["unknown key 'stepz' in [training]", "steps"]),
    (["--trainin.steps", "5"], 1, ["unknown section [trainin]"]),
    (["--steps", "5"], 1, ["'--steps' must be --section.key"]),
    (["--training.steps", "abc"], 1, ["[training] steps = 'abc' is invalid: expected an integer"]),
    (["--training.steps"], 1, ["--training.steps needs a value (an integer)"]),
    (["--compile.enable", "yes"], 1, ["[compile] enable = 'yes' is invalid: expected true or false"]),
    (["--activation_checkpoint.mode=partial"], 1, ["mode = 'partial'", "one of 'none', 'full', 'selective'"]),
    (["--model.attention", "flash"], 1, ["one of 'nsa', 'dense'"]),
    (["--training.steps", "0"], 1, ["[training] steps = 0: must be a positive integer"]),
    (["--model.sel_score_grad", "-1"], 1, ["[model] sel_score_grad = -1.0", "must be >= 0"]),
    (["--model.attention", "dense", "--model.sel_score_grad", "0.5"], 1, ["sel_score_grad = 0.5", "0 for attention = 'dense'"]),
    (["--model.sel_score_explore", "4"], 1, ["[model] sel_score_explore = 4", "only with sel_score_grad > 0"]),
    (["--model.sel_score_grad", "1", "--model.sel_score_explore", "-1"], 1, ["sel_score_explore = -1", "must be >= 0"]),
    (["--model.n_heads", "6", "--model.n_kv_groups", "4"], 1,
     ["n_heads = 6 is not divisible by n_kv_groups = 4"]),
    (["--model.head_dim", "31"], 1, ["head_dim = 31: must be even"]),
    (["--training.seq_len", "8"], 1, ["seq_len = 8 is shorter than the NSA blocks", "use seq_len >= 16"]),
    (["--model.cmp_stride", "5"], 1, ["cmp_stride = 5 must divide cmp_block_size = 16"]),
    (["--model.sel_block_size", "20"], 1, ["cmp_stride = 8 must divide sel_block_size = 20"]),
    (["--model.sel_top_n", "2"], 1, ["sel_top_n = 2: must be >= 3", "initial block and the 2 local"]),
    (["--optimizer.lr", "-1"], 1, ["[optimizer] lr = -1.0: must be > 0"]),
    (["--parallelism.data_parallel_shard_degree", "4"], 2,
     ["data_parallel_shard_degree (4) = 4, but the world size is 2", "must multiply to the number of ranks"]),
    (["--parallelism.data_parallel_replicate_degree", "3"], 2, ["replicate_degree = 3 does not divide the world size 2"]),
    (["--training.global_batch_size", "12"], 1,
     ["global_batch_size = 12 must be a positive multiple of local_batch_size x dp degree = 8 x 1 = 8"]),
    (["stray"], 1, ["unexpected argument 'stray'"]),
    (["--fault.collective_timeout_seconds", "60", "--fault.step_timeout_seconds", "120"], 1,
     ["collective_timeout_seconds = 60.0 must be greater than step_timeout_seconds = 120.0"]),
    (["--fault.failure_save_wait_seconds", "-1"], 1, ["failure_save_wait_seconds = -1: must be >= 0"]),
    (["--debug.fault_raise_where", "write", "--debug.fault_raise_step", "3", "--fault.heartbeat", "false"], 1,
     ["fault_raise_where = 'write' fails the heartbeat's write: it needs [fault] heartbeat = true"]),
    (["--model.kernels", "triton", "--model.attn_impl", "reference"], 1,
     ["kernels = 'triton' chooses kernels of the fast NSA path", "attn_impl = 'reference'"]),
    (["--optimizer.name", "AdamW"], 1, ["unknown key 'name' in [optimizer]"]),
]


@pytest.fixture
def no_model(monkeypatch):
    """Fail the test if the trainer (and so any model) would be built."""

    def trap(*args, **kwargs):
        raise AssertionError("a model was built for a bad config")

    monkeypatch.setattr(train, "Trainer", trap)


@pytest.mark.parametrize("argv,world,fragments", BAD, ids=[" ".join(b[0]) for b in BAD])
def test_bad_config_stops_with_clear_message(argv, world, fragments, tmp_path, monkeypatch, capsys, no_model):
    for name, text in BAD_TOML.items():
        (tmp_path / name).write_text(text)
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("RANK", "0")
    code = train.main([a.replace("{tmp}", str(tmp_path)) for a in argv])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("nsa_titan: config error:")
    for fragment in fragments:
        assert fragment in err, f"{fragment!r} missing from: {err}"


@pytest.mark.multiprocess
def test_bad_config_through_run_train_sh_exits_nonzero_on_every_rank(tmp_path):
    # From another directory, with 2 ranks: both stop before building anything.
    proc = subprocess.run([str(ROOT / "run_train.sh"), "--parallelism.data_parallel_shard_degree", "3"],
                          cwd=tmp_path, env={**os.environ, "NGPU": "2"}, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode != 0
    assert "must multiply to the number of ranks" in proc.stderr
    assert "parallelized" not in proc.stdout  # no model was built


def test_overrides_win_over_the_file_in_both_forms():
    cfg, _ = parse_args(["--training.steps", "7", "--model.dim=96", "--compile.enable", "--debug.seed", "5"])
    assert (cfg.training.steps, cfg.model.dim, cfg.compile.enable, cfg.debug.seed) == (7, 96, True, 5)
    cfg, _ = parse_args(["--compile.enable=false", "--training.max_norm", "0"])
    assert cfg.compile.enable is False and cfg.training.max_norm == 0.0


def test_derived_values_filled_in():
    cfg, _ = load_config(["--training.global_batch_size", "32"], world_size=2)
    assert cfg.parallelism.data_parallel_shard_degree == 2
    assert cfg.training.global_batch_size == 32  # 8 local x 2 ranks x 2 accumulation steps
    cfg, _ = load_config(["--parallelism.data_parallel_replicate_degree", "2"], world_size=4)
    assert cfg.parallelism.data_parallel_shard_degree == 2 and cfg.training.global_batch_size == 32


def test_validation_and_derivation_leave_the_parsed_config_as_it_was(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # data/python_docs is then found in the repository
    parsed, _ = parse_args(["--training.global_batch_size", "-1", "--parallelism.data_parallel_shard_degree", "-1",
                            "--data.path", "data/python_docs", "--model.vocab_size", "0"])
    before = copy.deepcopy(parsed)
    validate(parsed, 2)
    derived = derive(parsed, 2, tokenizer_vocab=4000)
    assert parsed == before  # the user's values, untouched
    assert (derived.training.global_batch_size, derived.parallelism.data_parallel_shard_degree) == (16, 2)
    assert derived.model.vocab_size == 4032  # the tokenizer's 4000, padded to a multiple of 64
    assert Path(derived.data.path).is_absolute() and derived.data.path.endswith("data/python_docs")
    assert derive(derived, 2, tokenizer_vocab=4000) == derived  # derived values are a fixed point


def test_activation_checkpoint_layers_have_one_home():
    m = Model(n_layers=6)
    assert ac_layers(m, ActivationCheckpoint(mode="none")) == []
    assert ac_layers(m, ActivationCheckpoint(mode="full", first_layer=2, last_layer=3)) == [2, 3]
    assert ac_layers(m, ActivationCheckpoint(mode="selective", every_n_layers=2)) == [1, 3, 5]


def test_hsdp_degrees_inferred_from_either_side():
    cfg, _ = load_config(["--parallelism.data_parallel_replicate_degree", "-1",
                          "--parallelism.data_parallel_shard_degree", "8"], world_size=64)
    assert (cfg.parallelism.data_parallel_replicate_degree, cfg.parallelism.data_parallel_shard_degree) == (8, 8)
    with pytest.raises(ConfigError, match="both -1"):
        load_config(["--parallelism.data_parallel_replicate_degree", "-1"], world_size=8)
    with pytest.raises(ConfigError, match="data_parallel_shard_degree = 3 does not divide the world size 8"):
        load_config(["--parallelism.data_parallel_replicate_degree", "-1",
                     "--parallelism.data_parallel_shard_degree", "3"], world_size=8)


def test_print_config_is_a_toml_that_reproduces_the_run(tmp_path, capsys):
    assert train.main(["--print_config", "--model.dim", "96", "--job.description", 'a "quoted" run']) == 0
    printed = capsys.readouterr().out
    (tmp_path / "resolved.toml").write_text(printed)
    again, _ = load_config(["--config", str(tmp_path / "resolved.toml")], world_size=1)
    first, _ = load_config(["--model.dim", "96", "--job.description", 'a "quoted" run'], world_size=1)
    assert again == first


@pytest.mark.parametrize("name", sorted(p.name for p in (ROOT / "train_configs").glob("*.toml")))
@pytest.mark.parametrize("world", [1, 8])
def test_shipped_configs_validate(name, world):
    """At 1 and 8 data-parallel ranks (times the config's context-parallel degree)."""
    cp = tomli.loads((ROOT / "train_configs" / name).read_text()).get("parallelism", {}).get(
        "context_parallel_degree", 1)
    cfg, _ = load_config(["--config", str(ROOT / "train_configs" / name)], world_size=world * cp)
    assert isinstance(cfg, JobConfig)


def test_m7c_is_the_reference_size():
    cfg = load_config(["--config", str(ROOT / "train_configs" / "m7c.toml")], world_size=8)[0]
    m = cfg.model
    assert (m.dim, m.n_layers, m.n_heads, m.n_kv_groups, m.head_dim) == (768, 12, 12, 2, 64)
    # An English tokenizer for FineWeb-Edu, a held-out slice to validate on, a Hugging Face folder at the end.
    assert (cfg.data.path, cfg.data.tokenizer, cfg.data.tokenizer_path) == (
        "HuggingFaceFW/fineweb-edu", "hf", "HuggingFaceTB/SmolLM2-135M")
    assert cfg.validation.enable and cfg.data.holdout > 0 and cfg.checkpoint.export_format == "hf"
    assert (m.cmp_block_size, m.cmp_stride, m.sel_block_size, m.sel_top_n, m.window_size) == (32, 16, 64, 16, 512)
