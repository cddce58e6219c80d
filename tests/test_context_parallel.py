"""Context parallelism: one sequence split across spawned gloo ranks trains exactly like one process."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from nsa_titan.checkpoint import load_tensors
from nsa_titan.config import ConfigError, load_config
from nsa_titan.evaluate import evaluate

from conftest import TINY, UNPINNED, from_step, launch_ranks, single_process_run, tb_losses, torchrun

STEPS = 6
# seq_len 72 is not a multiple of 2 x cp x l' = 32: the split pads it to 96 (chunks of 24).
# AdamW's eps is raised from 1e-8: with it, a weight whose gradient is ~1e-8 moves by a large part of
# lr whatever the gradient's rounding, and the parameters would differ by more than that rounding.
COMMON = [*TINY, "--debug.seed", "5", "--training.steps", str(STEPS), "--training.seq_len", "72",
          "--training.max_norm", "0.5", "--optimizer.eps", "1e-4"]
CP2 = ["--parallelism.context_parallel_degree", "2"]
AC_COMPILE = ["--activation_checkpoint.mode", "full", "--compile.enable", "true"]


# The dense run also mixes in each token's predecessor (`smear`): a rank's first token reads the
# last token of the other rank's part.
MODELS = {"nsa": [], "dense": ["--model.attention", "dense", "--model.smear", "true", *UNPINNED]}


@pytest.fixture(scope="module")
def cp_runs(tmp_path_factory):
    """2 ranks, cp = 2 (one data-parallel group): NSA and dense, with AC and compile."""
    specs = [{"name": name, "args": [*COMMON, *CP2, *AC_COMPILE, *args], "save_params": True}
             for name, args in MODELS.items()]
    return launch_ranks(specs, tmp_path_factory.mktemp("cp"))


@pytest.mark.multiprocess
@pytest.mark.parametrize("attention", list(MODELS))
def test_cp2_matches_one_process(cp_runs, attention):
    run = cp_runs[attention]
    losses, grad_norms, params = single_process_run([*COMMON, *MODELS[attention]])
    assert run["steps"] == list(range(1, STEPS + 1))
    torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(losses), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.tensor(run["grad_norms"]), torch.tensor(grad_norms), rtol=1e-4, atol=1e-6)
    assert losses[-1] < losses[0] - 0.2, "the reference run should learn"
    for name, p in params.items():
        torch.testing.assert_close(run["params"][name], p, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.multiprocess
def test_dp2_cp2_on_four_ranks_matches_dp2_on_two(tmp_path):
    """4 ranks: 2 data-parallel groups of 2 context-parallel ranks (FSDP over dp_shard x cp, and HSDP
    replicating across the groups), against 2 plain FSDP ranks."""
    args = [*COMMON, "--training.steps", "4"]
    hsdp = ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "1"]
    four = launch_ranks([{"name": "fsdp", "args": [*args, *CP2]}, {"name": "hsdp", "args": [*args, *CP2, *hsdp]}],
                        tmp_path / "four", nproc=4)
    two = launch_ranks([{"name": "dp2", "args": args}], tmp_path / "two", nproc=2)["dp2"]
    for name in ("fsdp", "hsdp"):
        torch.testing.assert_close(torch.tensor(four[name]["losses"]), torch.tensor(two["losses"]), rtol=1e-5,
                                   atol=1e-6, msg=name)


@pytest.mark.parametrize("args,world,message", [
    (["--parallelism.context_parallel_degree", "3"], 4, "context_parallel_degree = 3 does not divide the world size 4"),
    ([*CP2, "--training.seq_len", "24"], 2, "seq_len = 24 is too short to split across context_parallel_degree = 2"),
    ([*CP2, "--model.attn_impl", "reference", *UNPINNED], 2, "needs attn_impl = 'fast'"),
    ([*CP2, "--parallelism.data_parallel_shard_degree", "2"], 2, "world size / context_parallel_degree 2"),
])
def test_bad_layouts_stop_before_any_model_is_built(args, world, message):
    with pytest.raises(ConfigError, match=message):
        load_config([*TINY, *args], world_size=world)


# The default data pipeline (embedded corpus, sentencepiece, 2 loader workers), TINY's NSA sizes.
RESUME = [*TINY[:TINY.index("--training.mixed_precision_param")], "--training.mixed_precision_param", "float32",
          "--model.vocab_size", "0", "--data.source", "datasets", "--data.tokenizer", "sentencepiece",
          "--data.num_workers", "2", "--training.seq_len", "72", "--training.local_batch_size", "2",
          "--metrics.log_freq", "1", "--validation.enable", "true", "--validation.freq", "6",
          "--validation.steps", "2", "--checkpoint.enable", "true",
          "--checkpoint.interval", "3", "--checkpoint.keep_latest_k", "0", "--checkpoint.async_mode", "disabled",
          "--lr_scheduler.warmup_steps", "10", "--lr_scheduler.decay_type", "constant", "--training.steps", "6"]



def train(dump: Path, cp: int, tb: str) -> None:
    proc = torchrun(["-m", "nsa_titan.train", *RESUME, "--parallelism.context_parallel_degree", str(cp),
                     "--job.dump_folder", str(dump), "--metrics.save_tb_folder", tb], nproc=cp)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]


@pytest.mark.multiprocess
@pytest.mark.parametrize("saved_cp,loaded_cp", [(2, 1), (1, 2)])
def test_resume_across_cp_degrees_is_exact(tmp_path, saved_cp, loaded_cp):
    """Saved at step 3 with one cp degree, resumed with the other: steps 4-6, the validation loss
    and the model and optimizer at step 6 are those of the run that never stopped."""
    train(tmp_path / "a", saved_cp, "tb")
    train(from_step(tmp_path / "a", 3, tmp_path / "b"), loaded_cp, "tb")
    a, b = tb_losses(tmp_path / "a" / "tb"), tb_losses(tmp_path / "b" / "tb")
    assert sorted(b) == [4, 5, 6]
    torch.testing.assert_close(torch.tensor([b[s] for s in b]), torch.tensor([a[s] for s in b]), rtol=1e-5, atol=1e-6)
    va, vb = (tb_losses(tmp_path / x / "tb", "validation/loss") for x in "ab")
    assert list(va) == list(vb) == [6]
    torch.testing.assert_close(torch.tensor(vb[6]), torch.tensor(va[6]), rtol=1e-5, atol=1e-6)
    # A checkpoint trained with cp = 2 is evaluated by one process, to the trainer's validation loss.
    split = tmp_path / ("a" if saved_cp == 2 else "b")
    result = evaluate(str(split / "checkpoint" / "step-6"), "validation", batches=2)
    assert result["loss"] == pytest.approx(va[6], rel=1e-5)
    if saved_cp == 2:  # and by two ranks splitting each sequence, as training validated it
        proc = torchrun(["-m", "nsa_titan.evaluate", str(split / "checkpoint" / "step-6"), "--batches", "2",
                         "--context_parallel", "2"], nproc=2)
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
        loss = float(re.search(r"validation: loss (\S+) .* 2 batches, 288 tokens", proc.stdout).group(1))
        assert loss == pytest.approx(va[6], rel=1e-4)
    for prefix in ("model", "optimizer"):
        sa = load_tensors(tmp_path / "a" / "checkpoint" / "step-6", prefix)
        sb = load_tensors(tmp_path / "b" / "checkpoint" / "step-6", prefix)
        assert sa.keys() == sb.keys() and len(sa) > 10
        for k in sa:
            torch.testing.assert_close(sb[k], sa[k], rtol=1e-4, atol=1e-6, msg=f"{prefix}.{k}")


def test_evaluate_with_more_cp_ranks_than_it_has_stops_with_a_config_error():
    with pytest.raises(ConfigError, match="--context_parallel 2 does not divide the 1 evaluating ranks"):
        evaluate("no-checkpoint-needed", context_parallel=2)
