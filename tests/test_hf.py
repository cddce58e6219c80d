"""Hugging Face interop: HF tokenizers in training, the export that transformers loads (equal logits,
greedy generate() equal to nsa_titan's through NSA's own cache), lm-evaluation-harness on it, a warm
start from it, and its bad input. CPU and offline; the HF tokenizer is trained here on the shipped corpus."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from nsa_titan import export
from nsa_titan.checkpoint import write_model_file
from nsa_titan.config import derive, load_config, max_context, to_toml
from nsa_titan.data import DataError, build_tokenizer
from nsa_titan.data.batch import eos_documents
from nsa_titan.config import Source
from nsa_titan.data.packing import PackedTextDataset
from nsa_titan.data.sources import open_text_stream
from nsa_titan.data.train_tokenizer import train_tokenizer
from nsa_titan.evaluate import evaluate_documents
from nsa_titan.models.decode import Decoder
from nsa_titan.observe.lm_harness import rolling_windows
from nsa_titan.generate import generate
from nsa_titan.checkpoint.inference import load_model
from nsa_titan.models.rope import SCALED as SCALED_KEYS, hf_rope_parameters
from nsa_titan.models.transformer import Transformer

from conftest import ROOT, free_port, launch_ranks, tb_losses, torchrun, tree_digest
from lm_tasks import CORPUS, GEN_PROMPTS, local_tasks, texts

MODEL = ["--model.dim", "64", "--model.n_layers", "2", "--model.n_heads", "4", "--model.n_kv_groups", "2",
         "--model.head_dim", "16", "--model.cmp_block_size", "8", "--model.cmp_stride", "4",
         "--model.sel_block_size", "8", "--model.sel_top_n", "4", "--model.window_size", "16",
         "--training.seq_len", "64", "--training.mixed_precision_param", "float32"]
OFF_PAPER = {"nsa": ["--model.smear", "true", "--model.cmp_phi", "mean", "--model.tie_embeddings", "true",
                     "--model.sel_score_grad", "1.0", "--model.sel_score_explore", "8"],
             "dense": ["--model.smear", "true", "--model.tie_embeddings", "true"]}
# name: (attention, off-paper options on, tokenizer kind)
VARIANTS = {"nsa": ("nsa", False, "hf"), "nsa-offpaper": ("nsa", True, "hf"), "dense": ("dense", False, "hf"),
            "dense-offpaper": ("dense", True, "hf"), "nsa-sentencepiece": ("nsa", False, "sentencepiece"),
            "dense-bytes": ("dense", False, "byte"), "nsa-yarn": ("nsa", False, "hf")}
YARN = ["--model.rope_scaling", "yarn", "--model.rope_factor", "4", "--model.rope_original_seq_len", "32"]
"""Trained at 64 (the MODEL's seq_len) from 32: declared for 4 x 32 = 128 tokens, twice the training length."""
SCALED = {"nsa-yarn": YARN}
PROMPT = "The with statement"
BATCH_TEXTS = ["The with statement", "def", "Raised when an operation is applied", "A list"]
"""Prompts of different lengths for one left-padded batch."""


def variant_args(name: str, tokenizer_dir: Path) -> list[str]:
    attention, off, kind = VARIANTS[name]
    path = {"hf": str(tokenizer_dir), "sentencepiece": str(CORPUS / "tokenizer.model"), "byte": ""}[kind]
    return [*MODEL, "--model.attention", attention, *(OFF_PAPER[attention] if off else []), *SCALED.get(name, []),
            "--data.tokenizer", kind, "--data.tokenizer_path", path]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    """A byte-level BPE tokenizer.json (1,000 pieces) trained on the shipped corpus."""
    folder = tmp_path_factory.mktemp("tokenizer")
    train_tokenizer(str(CORPUS), str(folder / "tokenizer.json"), 1000, max_docs=300, kind="hf")
    return folder


@pytest.fixture(scope="module")
def exported(tmp_path_factory, tokenizer_dir) -> dict[str, Path]:
    """Each variant as a .pt model (random weights, its config beside it) and its HF export (fp32);
    one export sharded into several safetensors files."""
    base = tmp_path_factory.mktemp("exported")
    for k, name in enumerate(VARIANTS):
        cfg, _ = load_config(variant_args(name, tokenizer_dir), world_size=1)
        cfg = derive(cfg, 1, build_tokenizer(cfg.data.tokenizer, cfg.data.tokenizer_path).vocab_size)
        model = Transformer(cfg.model, cfg.training.seq_len)
        model.init_weights(k)
        write_model_file(model.state_dict(), base / f"{name}.pt", "float32", to_toml(cfg))
        shards = ["--max_shard_size", "100KB"] if name == "nsa-offpaper" else []
        assert export.main([str(base / f"{name}.pt"), "--format", "hf", "--output", str(base / name), "--dtype",
                            "float32", *shards]) == 0
    return base


@pytest.fixture(scope="module")
def loaded(exported, tmp_path_factory) -> dict[str, dict]:
    """What a fresh interpreter with transformers sees of each export (tests/hf_check.py), and the ids asked."""
    work = tmp_path_factory.mktemp("hf_check")
    ids = torch.randint(1, 900, (2, 120), generator=torch.Generator().manual_seed(0))
    folders = {}
    for name in VARIANTS:
        _, tok, _ = load_model(str(exported / f"{name}.pt"))
        rows = ids[:, :120 if name in SCALED else 60] % tok.vocab_size  # past the training length, if declared
        rows[:, 25] = tok.eos_id  # a document ends here (the configs' document masking)
        folders[name] = {"dir": str(exported / name), "ids": rows.tolist(), "prompt": tok.encode(PROMPT)}
    request = {"folders": folders, "new_tokens": 12, "texts": texts(6) + [" odd  spacing\t\n", "é 日本"],
               "batch_texts": BATCH_TEXTS}
    (work / "request.json").write_text(json.dumps(request))
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "hf_check.py"), str(work / "request.json"),
                           str(work / "result.pt")], cwd=work, env={**os.environ, "HF_HUB_OFFLINE": "1"},
                          capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = torch.load(work / "result.pt")
    return {name: {**results[name], **folders[name], "texts": request["texts"]} for name in VARIANTS}


pytestmark = pytest.mark.multiprocess


@pytest.mark.parametrize("name", VARIANTS)
def test_transformers_loads_the_export_with_equal_logits(exported, loaded, name):
    got = loaded[name]
    assert got["module"].startswith("transformers_modules."), "not loaded through the folder's own code"
    assert got["dtype"] == "torch.float32"
    model, tok, cfg = load_model(str(exported / f"{name}.pt"))
    ids = torch.tensor(got["ids"])
    with torch.no_grad():
        ours = model(ids, eos_documents(ids, tok.eos_id) if cfg.training.document_masking else None)
    torch.testing.assert_close(got["logits"], ours, rtol=1e-5, atol=1e-5)
    files = {p.name for p in (exported / name).iterdir()}
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "configuration_nsa_titan.py", "modeling_nsa_titan.py", "nsa_titan.toml"} <= files
    sharded = name == "nsa-offpaper"
    assert ("model.safetensors.index.json" in files) == sharded and ("model.safetensors" in files) != sharded
    settings = json.loads((exported / name / "config.json").read_text())
    assert settings["model_type"] == "nsa_titan" and set(settings["auto_map"]) == {"AutoConfig", "AutoModelForCausalLM"}
    for key, value in vars(cfg.model).items():  # every [model] setting, the off-paper ones included
        if key not in ("rope_theta", "max_seq_len", *SCALED_KEYS):  # RoPE's as transformers' rope_parameters
            assert settings[key] == value, key
    assert settings["rope_parameters"] == hf_rope_parameters(cfg.model)
    assert settings["vocab_size"] % 64 == 0 and settings["max_position_embeddings"] == max_context(cfg)
    assert max_context(cfg) == (128 if name in SCALED else cfg.training.seq_len)


@pytest.mark.parametrize("name", VARIANTS)
def test_greedy_generate_equals_nsa_titans_through_the_cache(exported, loaded, name):
    got = loaded[name]
    model, tok, cfg = load_model(str(exported / f"{name}.pt"))
    ours = list(generate(model, tok, PROMPT, 12, temperature=0, document_masking=cfg.training.document_masking))
    theirs = got["generated"][:-1] if got["generated"][-1:] == [tok.eos_id] else got["generated"]
    assert theirs == ours and len(ours) >= 3
    # The decoding step's kernel: `auto` as exported (the C++ step on CPUs for NSA), `torch` when asked for.
    assert got["decode_kernel"] == Decoder(model).kernel and got["decode_kernel_torch"] == "torch"
    # The prompt went through the blocks once; every new token after the first was one incremental step.
    assert got["generate_counts"] == {"block_tokens": len(got["prompt"]) * got["n_layers"],
                                      "steps": len(got["generated"]) - 1}
    # One more token on a prefilled cache: no block recomputes the prefix, and the logits are a full forward's.
    assert got["one_token_counts"] == {"block_tokens": 0, "steps": 1}
    torch.testing.assert_close(got["one_token_logits"], got["one_token_full"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", VARIANTS)
def test_batched_generate_of_prompts_of_different_lengths_equals_each_alone(loaded, name):
    """transformers' generate() of 4 prompts of different lengths in one left-padded batch: each row's new tokens
    are those of its prompt generated alone (up to the end-of-text token where a row stops early)."""
    got = loaded[name]
    assert len(got["batched"]) == len(BATCH_TEXTS) and any(len(a) >= 3 for a in got["alone"])
    for row, alone in zip(got["batched"], got["alone"]):
        assert row[:len(alone)] == alone
    assert re.search(r"right padding.*padding_side = 'left'", got["right_padded"]), got["right_padded"]


@pytest.mark.parametrize("name", ["nsa", "nsa-sentencepiece", "dense-bytes"])
def test_the_exported_tokenizer_encodes_as_the_runs_own(exported, loaded, name):
    got = loaded[name]
    _, tok, _ = load_model(str(exported / f"{name}.pt"))
    assert got["encoded"] == [tok.encode(t) for t in got["texts"]]
    assert got["decoded"] == got["texts"]
    assert (got["eos"], got["bos"]) == (tok.eos_id, tok.bos_id)


@pytest.mark.parametrize("scaling", [[], YARN, ["--model.rope_scaling", "linear", "--model.rope_factor", "2",
                                                "--model.rope_original_seq_len", "64"]])
def test_a_dense_model_exports_as_llama_without_remote_code(tokenizer_dir, tmp_path, scaling):
    """Dense attention without smear or document masking is Llama's layout: `--format llama` writes a
    folder transformers loads as LlamaForCausalLM, equal logits (up to the declared maximum context,
    past the training length with a RoPE scaling) and greedy generate()."""
    from transformers import AutoModelForCausalLM

    cfg, _ = load_config([*variant_args("dense", tokenizer_dir), "--training.document_masking", "false",
                          "--model.rope_theta", "50000", *scaling], world_size=1)
    cfg = derive(cfg, 1, build_tokenizer(cfg.data.tokenizer, cfg.data.tokenizer_path).vocab_size)
    model = Transformer(cfg.model, cfg.training.seq_len)
    model.init_weights(3)
    write_model_file(model.state_dict(), tmp_path / "dense.pt", "float32", to_toml(cfg))
    assert export.main([str(tmp_path / "dense.pt"), "--format", "llama", "--output", str(tmp_path / "llama"),
                        "--dtype", "float32"]) == 0
    assert json.loads((tmp_path / "llama" / "config.json").read_text())["model_type"] == "llama"
    assert not list((tmp_path / "llama").glob("*.py"))  # no remote code
    llama = AutoModelForCausalLM.from_pretrained(tmp_path / "llama").eval()
    assert type(llama).__name__ == "LlamaForCausalLM"
    model, tok, _ = load_model(str(tmp_path / "dense.pt"))
    assert llama.config.max_position_embeddings == model.max_seq_len == max_context(cfg)
    ids = torch.randint(0, tok.vocab_size, (2, max_context(cfg)), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(llama(ids).logits, model(ids), rtol=1e-5, atol=1e-5)
        prompt = torch.tensor([tok.encode(PROMPT)])
        out = llama.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12, do_sample=False)[0]
    theirs = out[prompt.shape[1]:].tolist()
    theirs = theirs[:-1] if theirs[-1:] == [tok.eos_id] else theirs
    assert theirs == list(generate(model, tok, PROMPT, 12, temperature=0))


# Training with the HF tokenizer, as the shipped configs run: 2 ranks, 2 loader workers, async saves.
TRAIN = [*MODEL, "--training.local_batch_size", "4", "--metrics.log_freq", "1", "--validation.enable", "false",
         "--data.num_workers", "2", "--checkpoint.enable", "true", "--checkpoint.async_mode", "async",
         "--optimizer.lr", "1e-2", "--lr_scheduler.warmup_steps", "2", "--lr_scheduler.decay_type", "constant",
         "--data.tokenizer", "hf"]


def train(dump: Path, tokenizer_dir: Path, *args: str, tb: str = "tb") -> str:
    proc = torchrun(["-m", "nsa_titan.train", *TRAIN, "--data.tokenizer_path", str(tokenizer_dir), "--job.dump_folder",
                     str(dump), "--metrics.save_tb_folder", tb, *args], nproc=2)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.fixture(scope="module")
def hf_run(tmp_path_factory, tokenizer_dir) -> Path:
    """16 steps with the HF tokenizer, straight through; ends with its HF export (fp32)."""
    dump = tmp_path_factory.mktemp("hf_run")
    train(dump, tokenizer_dir, "--training.steps", "16", "--checkpoint.interval", "8", "--checkpoint.export_at_end",
          "true", "--checkpoint.export_format", "hf", "--checkpoint.export_dtype", "float32")
    return dump


def test_training_with_an_hf_tokenizer_learns_and_resumes_exactly(hf_run, tokenizer_dir, tmp_path):
    straight = tb_losses(hf_run / "tb")
    assert sorted(straight) == list(range(1, 17))
    assert straight[16] < straight[1] - 1.0, straight  # from ln(1024) = 6.9 at the start
    train(tmp_path, tokenizer_dir, "--training.steps", "8", "--checkpoint.interval", "8", tb="tb1")
    out = train(tmp_path, tokenizer_dir, "--training.steps", "16", "--checkpoint.interval", "8", tb="tb2")
    assert f"resumed from {tmp_path / 'checkpoint' / 'step-8'} at step 8" in out
    resumed = {**tb_losses(tmp_path / "tb1"), **tb_losses(tmp_path / "tb2")}
    assert [resumed[s] for s in range(1, 17)] == [straight[s] for s in range(1, 17)], "losses differ after resume"


def test_export_at_end_writes_the_hf_folder(hf_run):
    folder = hf_run / "checkpoint" / "model-step-16-hf"
    settings = json.loads((folder / "config.json").read_text())
    assert settings["model_type"] == "nsa_titan" and settings["dtype"] == "float32"
    assert settings["nsa_titan_source"] == str((hf_run / "checkpoint" / "step-16").resolve())
    model, _, _ = load_model(str(hf_run / "checkpoint" / "step-16"))
    from_folder, _, _ = load_model(str(folder))  # evaluate and generate read the folder too
    for k, v in model.state_dict().items():
        assert torch.equal(from_folder.state_dict()[k], v), k


def test_warm_start_from_the_hf_folder_gives_the_models_logits(exported, tokenizer_dir, tmp_path):
    """2 FSDP ranks start from the NSA export with the off-paper options; lr ~0 leaves the weights as loaded."""
    started = launch_ranks([{"name": "w", "args": [*variant_args("nsa-offpaper", tokenizer_dir), "--training.steps",
                                                   "1", "--optimizer.lr", "1e-30", "--data.num_workers", "0",
                                                   "--validation.enable", "false", "--checkpoint.initial_load_path",
                                                   str(exported / "nsa-offpaper")],
                             "save_params": True}], tmp_path)["w"]
    model, tok, _ = load_model(str(exported / "nsa-offpaper.pt"))
    warm = Transformer(model.cfg, model.max_seq_len)
    warm.init_weights(0)
    warm.load_state_dict(started["params"], strict=False)  # tied: output.weight is tok_embeddings.weight
    ids = torch.randint(0, tok.vocab_size, (2, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(warm(ids), model(ids), rtol=1e-5, atol=1e-5)


def test_lm_eval_runs_local_tasks_and_its_perplexity_equals_evaluates(hf_run, tmp_path):
    folder, tasks = hf_run / "checkpoint" / "model-step-16-hf", local_tasks(tmp_path / "tasks")
    proc = subprocess.run(["lm_eval", "--model", "hf", "--model_args", f"pretrained={folder},trust_remote_code=True",
                           "--tasks", "nsa_titan_mc,nsa_titan_ppl", "--include_path", str(tasks), "--device", "cpu",
                           "--batch_size", "1", "--output_path", str(tmp_path / "results")], cwd=tmp_path,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}, capture_output=True,
                          text=True, timeout=600, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(next((tmp_path / "results").rglob("results_*.json")).read_text())["results"]
    assert 0 <= results["nsa_titan_mc"]["acc,none"] <= 1
    ours = evaluate_documents(str(hf_run / "checkpoint" / "step-16"), str(tasks / "ppl.jsonl"), "test")
    assert ours["documents"] == 4 and ours["tokens"] > 4 * 64
    for metric in ("word_perplexity", "byte_perplexity", "bits_per_byte"):
        assert results["nsa_titan_ppl"][f"{metric},none"] == pytest.approx(ours[metric], rel=1e-5), metric


def test_lm_eval_generate_until_in_batches_of_8_equals_batches_of_1(hf_run, tmp_path):
    """lm-eval's generate_until over 10 prompts of different lengths: batch size 8 (left-padded rows, each at its
    own position; caches sized to each batch) gives every prompt the continuation that batch size 1 gives it."""
    folder, tasks = hf_run / "checkpoint" / "model-step-16-hf", local_tasks(tmp_path / "tasks")

    def responses_at(batch: int) -> dict[str, str]:
        out = tmp_path / f"results-{batch}"
        proc = subprocess.run(["lm_eval", "--model", "hf", "--model_args", f"pretrained={folder},trust_remote_code=True",
                               "--tasks", "nsa_titan_gen", "--include_path", str(tasks), "--device", "cpu",
                               "--batch_size", str(batch), "--output_path", str(out), "--log_samples"], cwd=tmp_path,
                              env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                                   "OMP_NUM_THREADS": "1"},
                              capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        samples = [json.loads(line) for line in next(out.rglob("samples_nsa_titan_gen_*.jsonl")).read_text().splitlines()]
        return {s["doc"]["prompt"]: s["resps"][0][0] for s in samples}

    with ThreadPoolExecutor(2) as pool:  # the two batch sizes at once, a core each
        responses = list(pool.map(responses_at, (1, 8)))
    assert sorted(responses[0]) == sorted(GEN_PROMPTS) and sum(map(len, responses[0].values())) > 10
    assert responses[1] == responses[0]


def test_rolling_windows_score_every_token_once_with_at_most_seq_len_inputs():
    ids = list(range(10, 33))  # 23 tokens, windows of 8
    windows = list(rolling_windows(ids, 0, 8))
    assert [t for _, targets in windows for t in targets] == ids
    assert windows[0] == ([0, *ids[:7]], ids[:8])
    for inputs, targets in windows[1:]:
        assert len(inputs) == 8 and inputs[-1] == targets[-1] - 1  # the last input precedes the last target
    assert list(rolling_windows([], 0, 8)) == []


# HF tokenizers: a hub id through the cache, offline; end-of-text and begin-of-text tokens.

def test_hub_tokenizer_loads_from_the_cache_offline_and_without_it_names_the_fix(tokenizer_dir, tmp_path, monkeypatch):
    snapshot = tmp_path / "hub" / "models--someone--tiny" / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (snapshot / f).write_bytes((tokenizer_dir / f).read_bytes())
    (tmp_path / "hub" / "models--someone--tiny" / "refs").mkdir()
    (tmp_path / "hub" / "models--someone--tiny" / "refs" / "main").write_text("a" * 40)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))
    tok = build_tokenizer("hf", "someone/tiny")
    assert tok.vocab_size == 1000 and tok.encode("def f(x):") == build_tokenizer("hf", str(tokenizer_dir)).encode("def f(x):")
    with pytest.raises(DataError, match=r"'someone/other' is a Hugging Face hub model id, but HF_HUB_OFFLINE is set. Fetch it once "
                                        r".*`hf download someone/other tokenizer.json"):
        build_tokenizer("hf", "someone/other")


def test_documents_are_begun_with_bos_and_ended_with_eos_as_the_tokenizer_names_them(tokenizer_dir, tmp_path):
    """A tokenizer whose config names a bos distinct from eos (as Llama 3's): each packed document is
    <bos> text <eos>; GPT-2-style tokenizers (bos == eos, or none) add eos alone."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    tok.add_special_tokens(["<|begin_of_text|>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|begin_of_text|>",
                                                                "eos_token": {"content": "<|endoftext|>"}}))
    with_bos, plain = build_tokenizer("hf", str(tmp_path)), build_tokenizer("hf", str(tokenizer_dir))
    assert (with_bos.eos_id, with_bos.bos_id, plain.bos_id) == (0, 1000, None)
    docs = texts(3)
    stream = open_text_stream(str(CORPUS), "", "validation", "text")
    window = next(iter(PackedTextDataset([stream], [Source(str(CORPUS), label="v")], with_bos, 4096, 0, 0, 0,
                                         epochs=1)))
    expected = [t for d in docs for t in [1000, *with_bos.encode(d), 0]]
    assert window.inputs.tolist()[:len(expected)] == expected


def test_a_file_that_is_not_a_tokenizer_json_is_a_data_error(tmp_path):
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "model": 3}')
    with pytest.raises(DataError, match=r"is not a Hugging Face tokenizer.json .*train one with"):
        build_tokenizer("hf", str(tmp_path / "tokenizer.json"))
    with pytest.raises(DataError, match="the folder holds no tokenizer.json"):
        build_tokenizer("hf", str(CORPUS))


# Bad input: one line, exit 2, nothing that existed before is changed.

@pytest.fixture(scope="module")
def bad(exported, tokenizer_dir, tmp_path_factory) -> Path:
    """Folders and files that the bad-input cases point at."""
    base = tmp_path_factory.mktemp("hf_bad")
    (base / "not_a_tokenizer.json").write_text("[1, 2, 3]\n")
    (base / "weights_only").mkdir()
    (base / "weights_only" / "model.safetensors").write_bytes(
        (exported / "nsa" / "model.safetensors").read_bytes())
    (base / "llama").mkdir()
    (base / "llama" / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    (base / "occupied").mkdir()
    (base / "occupied" / "notes.txt").write_text("my notes\n")
    # A model whose vocabulary (512) is smaller than its config's tokenizer (1,000 pieces).
    cfg, _ = load_config([*variant_args("nsa", tokenizer_dir), "--model.vocab_size", "512", "--data.tokenizer",
                          "byte"], world_size=1)
    cfg = derive(cfg, 1, 257)
    small = Transformer(cfg.model, 64)
    small.init_weights(0)
    write_model_file(small.state_dict(), base / "small_vocab.pt", "float32",
                     to_toml(cfg).replace('tokenizer = "byte"', 'tokenizer = "hf"').replace(
                         'tokenizer_path = ""', f'tokenizer_path = "{tokenizer_dir}"'))
    # A model trained on synthetic tokens.
    cfg, _ = load_config([*MODEL, "--data.source", "synthetic", "--data.tokenizer", "byte", "--model.vocab_size", "64"],
                         world_size=1)
    synthetic = Transformer(cfg.model, 64)
    synthetic.init_weights(0)
    write_model_file(synthetic.state_dict(), base / "synthetic.pt", "float32", to_toml(cfg))
    # transformers that cannot be imported, as without the [hf] extra.
    (base / "no_hf" / "transformers").mkdir(parents=True)
    (base / "no_hf" / "transformers" / "__init__.py").write_text("raise ImportError('not installed')\n")
    return base


def bad_cases(b: Path, exported: Path, tokenizer_dir: Path) -> list[tuple[list[str], str, dict]]:
    py, ex = [sys.executable, "-m"], [sys.executable, "-m", "nsa_titan.export"]
    train = [sys.executable, "-m", "nsa_titan.train", *variant_args("nsa", tokenizer_dir), "--training.steps", "1",
             "--data.num_workers", "0", "--validation.enable", "false", "--job.dump_folder", str(b / "run")]
    no_hf = {"PYTHONPATH": os.pathsep.join([str(b / "no_hf"), str(ROOT)])}  # transformers hidden, this tree found
    return [
        ([*train, "--data.tokenizer_path", str(b / "not_a_tokenizer.json")], "is not a Hugging Face tokenizer.json", {}),
        ([*train, "--model.vocab_size", "512"], "vocab_size = 512 is smaller than the tokenizer's 1000 tokens", {}),
        ([*ex, str(b / "small_vocab.pt"), "--format", "hf", "--output", str(b / "out1")], "smaller than the tokenizer's", {}),
        ([*train, "--checkpoint.initial_load_path", str(b / "weights_only")], "holds no config.json", {}),
        ([*train, "--checkpoint.initial_load_path", str(b / "llama")], "holds a 'llama' model, not an nsa_titan one", {}),
        ([*py, "nsa_titan.evaluate", str(b / "llama")], "holds a 'llama' model", {}),
        ([*train, "--model.dim", "96", "--checkpoint.initial_load_path", str(exported / "nsa")],
         "was exported from a different model config (dim = 64 there, 96 here", {}),
        ([*ex, str(exported / "dense.pt"), "--format", "hf", "--output", str(exported / "nsa")],
         f"already holds an export of {(exported / 'nsa.pt').resolve()}: nothing was written", {}),
        ([*ex, str(exported / "nsa.pt"), "--format", "hf", "--output", str(b / "occupied")],
         "already holds files that are not an nsa_titan export", {}),
        ([*ex, str(exported / "nsa.pt"), "--format", "llama", "--output", str(b / "out4")],
         "cannot be expressed as a Llama model: attention = 'nsa' (only dense is Llama's); document_masking = true", {}),
        ([*ex, str(b / "synthetic.pt"), "--format", "hf", "--output", str(b / "out2")],
         "was trained on [data] source = 'synthetic' tokens, not text", {}),
        ([*ex, str(exported / "nsa.pt"), "--format", "hf", "--output", str(b / "out3")],
         "needs transformers, which is not installed: pip install 'nsa_titan[hf]'", no_hf),
        ([*train, "--checkpoint.export_at_end", "true", "--checkpoint.export_format", "hf"],
         "needs transformers, which is not installed: pip install 'nsa_titan[hf]'", no_hf),
    ]


def test_bad_input_exits_2_with_one_line_and_changes_nothing(bad, exported, tokenizer_dir):
    before = {**tree_digest(bad), **tree_digest(exported)}

    def run(case: tuple[list[str], str, dict]) -> tuple[list[str], str, subprocess.CompletedProcess]:
        cmd, phrase, env = case
        if "--job.dump_folder" in cmd:  # each training run its own folder: two runs at once on one are refused
            cmd = [*cmd, "--job.dump_folder", str(bad / f"run-{phrase.__hash__() & 0xffff}")]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "MASTER_PORT": str(free_port()), **env}
        return cmd, phrase, subprocess.run(cmd, cwd=bad, capture_output=True, text=True, timeout=300, env=env)

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(run, bad_cases(bad, exported, tokenizer_dir)))
    for cmd, phrase, proc in results:
        shown = f"{' '.join(cmd[-6:])}\nstdout: {proc.stdout[-1500:]}\nstderr: {proc.stderr[-1500:]}"
        assert proc.returncode == 2, shown
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and phrase in lines[0], shown
    after = {**tree_digest(bad), **tree_digest(exported)}
    assert {k: after.get(k) for k in before} == before, "a file that existed before was changed"
    assert not any((bad / f"out{k}").exists() for k in (1, 2, 3, 4))
