"""Export a model to a Hugging Face folder that `AutoModelForCausalLM.from_pretrained(DIR,
trust_remote_code=True)`, `AutoTokenizer.from_pretrained(DIR)` and lm-evaluation-harness load (or,
`llama`, a dense model as transformers' own Llama, which needs no remote code):

    config.json                 model_type nsa_titan, auto_map, every [model] setting, eos/bos ids
    model.safetensors           (or model-0000k-of-0000n.safetensors and their index past max_shard_size)
    generation_config.json
    tokenizer.json, tokenizer_config.json   the run's tokenizer, converted exactly
    configuration_nsa_titan.py, modeling_nsa_titan.py   the classes (they import the nsa_titan package)
    nsa_titan.toml              the training config

transformers writes all of it (`save_pretrained`). The folder is built beside `output` and moved
into place whole; an `output` that holds another model (or anything else) is left untouched.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path

import torch
from transformers.utils import logging as hf_logging

from ..checkpoint import CheckpointError, check_fit, shapes
from ..checkpoint.inference import SINGLE_PROCESS
from ..config import DTYPES, JobConfig, Model, derive, load_config, max_context
from ..data import Tokenizer, build_tokenizer
from ..data.tokenizer import ByteTokenizer, HFTokenizer, SentencePieceTokenizer
from ..models.rope import SCALED, hf_rope_parameters
from ..models.transformer import Transformer
from . import NSATitanConfig, NSATitanForCausalLM

SOURCE_KEY = "nsa_titan_source"
"""config.json's record of the checkpoint an export came from (a re-export may replace it)."""
TRAINING_CONFIG = "nsa_titan.toml"  # where paths.config_of_checkpoint finds it
SAMPLES = ["The with statement wraps a block.\n\tdef f(x):  return x ** 2  # 2.5e-3", " leading, trailing  ",
           "Unicode: é, ß, 日本語, emoji 🙂", "\n\n"]
"""Texts the converted tokenizer must encode exactly as the run's own."""


def fast_tokenizer(tokenizer: Tokenizer, kind: str):
    """The run's tokenizer as a transformers PreTrainedTokenizerFast with its eos (and bos) token;
    a CheckpointError if the conversion does not encode SAMPLES exactly as the original."""
    from tokenizers import AddedToken, Tokenizer as Tok, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import SentencePieceExtractor, SpmConverter, bytes_to_unicode

    if isinstance(tokenizer, HFTokenizer):
        tok = Tok.from_file(str(tokenizer.file))
    elif isinstance(tokenizer, SentencePieceTokenizer):
        proto = SentencePieceExtractor(tokenizer.path).proto
        if not hasattr(SpmConverter, "build_tokenizer_from_spm_proto"):
            raise CheckpointError("this transformers version cannot convert a sentencepiece model by itself: "
                                  "pip install -U 'transformers>=5,<6', or export with --format pt")
        tok = SpmConverter.build_tokenizer_from_spm_proto(proto, {p.piece: i for i, p in enumerate(proto.pieces)})
        tok.add_special_tokens([AddedToken(tokenizer.sp.IdToPiece(tokenizer.eos_id), special=True, normalized=False)])
    else:  # bytes: each byte its own id (GPT-2's byte-to-character map), <eos> = 256
        assert isinstance(tokenizer, ByteTokenizer)
        chars = bytes_to_unicode()
        tok = Tok(models.BPE(vocab={chars[b]: b for b in range(256)}, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens([AddedToken("<eos>", special=True, normalized=False)])
    for text in SAMPLES:
        if tok.encode(text, add_special_tokens=False).ids != tokenizer.encode(text):
            raise CheckpointError(f"the run's {kind} tokenizer cannot be converted to a Hugging Face tokenizer that "
                                  f"encodes as it does (it differs on {text!r}); export with --format pt, or train "
                                  f"with [data] tokenizer = \"hf\"")
    name = lambda i: None if i is None else tok.id_to_token(i)  # noqa: E731
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=name(tokenizer.eos_id),
                                   bos_token=name(tokenizer.bos_id), pad_token=name(tokenizer.eos_id),
                                   model_max_length=1 << 30)


def check_output(output: Path, source: str) -> None:
    """A CheckpointError unless `output` is new, empty, or an export of the same checkpoint."""
    if output.is_file():
        raise CheckpointError(f"--output {output} is a file: give a folder for the Hugging Face export")
    if not output.is_dir() or not any(output.iterdir()):
        return
    config = output / "config.json"
    try:
        held = json.loads(config.read_text()).get(SOURCE_KEY) if config.is_file() else None
    except (OSError, ValueError):
        held = None
    if held != source:
        what = f"an export of {held}" if held else "files that are not an nsa_titan export"
        raise CheckpointError(f"--output {output} already holds {what}: nothing was written; choose a new folder, "
                              f"or remove that one first")


def hf_config(cfg: JobConfig, tokenizer: Tokenizer, source: str) -> NSATitanConfig:
    """The NSATitanConfig of a run's derived config."""
    return model_config(cfg.model, max_context(cfg), document_masking=cfg.training.document_masking,
                        eos_token_id=tokenizer.eos_id, bos_token_id=tokenizer.bos_id, pad_token_id=tokenizer.eos_id,
                        **{SOURCE_KEY: source})


def model_config(model: Model, declared: int, **keys) -> NSATitanConfig:
    """The NSATitanConfig of a `[model]` section declared for `declared` tokens, with transformers' `keys`
    (eos / bos / pad ids, document_masking): RoPE's settings as transformers' rope_parameters."""
    settings = {k: v for k, v in dataclasses.asdict(model).items() if k not in ("rope_theta", "max_seq_len", *SCALED)}
    return NSATitanConfig(max_position_embeddings=declared, rope_parameters=hf_rope_parameters(model),
                          tie_word_embeddings=model.tie_embeddings, **keys, **settings)


def llama_model(cfg: JobConfig, tokenizer: Tokenizer, source: str, state: Mapping[str, torch.Tensor]):
    """transformers' LlamaForCausalLM holding a dense model's weights (no remote code), or a
    CheckpointError naming what Llama cannot express."""
    from transformers import LlamaConfig, LlamaForCausalLM

    m = cfg.model
    cannot = [why for bad, why in ((m.attention != "dense", f"attention = '{m.attention}' (only dense is Llama's)"),
                                   (m.smear, "smear = true"),
                                   (cfg.training.document_masking, "document_masking = true (Llama attends across "
                                                                   "end-of-text tokens)")) if bad]
    if cannot:
        raise CheckpointError(f"{source} cannot be expressed as a Llama model: {'; '.join(cannot)}; export it with "
                              f"--format hf, nsa_titan's own classes")
    G, D = m.n_kv_groups, m.head_dim
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=m.vocab_size, hidden_size=m.dim, intermediate_size=state["layers.0.feed_forward.w1.weight"].shape[0],
        num_hidden_layers=m.n_layers, num_attention_heads=m.n_heads, num_key_value_heads=G, head_dim=D,
        rms_norm_eps=m.norm_eps, rope_parameters=hf_rope_parameters(m), max_position_embeddings=max_context(cfg),
        tie_word_embeddings=m.tie_embeddings, eos_token_id=tokenizer.eos_id, bos_token_id=tokenizer.bos_id,
        pad_token_id=tokenizer.eos_id, **{SOURCE_KEY: source}))
    renamed = {"model.embed_tokens.weight": state["tok_embeddings.weight"], "model.norm.weight": state["norm.weight"],
               "lm_head.weight": state["output.weight"]}
    for i in range(m.n_layers):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}."
        k, v = state[ours + "attention.wkv.weight"].view(2, G * D, -1).unbind(0)  # wkv's rows: k's, then v's
        for name, weight in (("self_attn.q_proj", state[ours + "attention.wq.weight"]), ("self_attn.k_proj", k),
                             ("self_attn.v_proj", v), ("self_attn.o_proj", state[ours + "attention.wo.weight"]),
                             ("mlp.gate_proj", state[ours + "feed_forward.w1.weight"]),
                             ("mlp.up_proj", state[ours + "feed_forward.w3.weight"]),
                             ("mlp.down_proj", state[ours + "feed_forward.w2.weight"]),
                             ("input_layernorm", state[ours + "attention_norm.weight"]),
                             ("post_attention_layernorm", state[ours + "ffn_norm.weight"])):
            renamed[f"{theirs}{name}.weight"] = weight
    model.load_state_dict({k: v.float() for k, v in renamed.items()}, strict=True)
    return model


def export_hf(state: Mapping[str, torch.Tensor], config_toml: str | None, source: str, output: Path, dtype: str,
              max_shard_size: str = "2GB", fmt: str = "hf") -> int:
    """Write the Hugging Face folder of a model's full state dict and its training config, as nsa_titan's
    classes (`hf`) or, for a dense model Llama expresses, as transformers' Llama (`llama`); returns the bytes."""
    if config_toml is None:
        raise CheckpointError(f"{source} has no config.toml beside it: the export needs the training config")
    check_output(output, source)
    partial = output.parent / f".{output.name}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    try:
        partial.mkdir(parents=True)
    except OSError as e:
        raise CheckpointError(f"--output {output}: its folder cannot be created ({e.strerror})") from None
    try:
        (partial / TRAINING_CONFIG).write_text(config_toml)
        cfg, _ = load_config(["--config", str(partial / TRAINING_CONFIG), *SINGLE_PROCESS], world_size=1)
        if cfg.data.source != "datasets":
            raise CheckpointError(f"{source} was trained on [data] source = '{cfg.data.source}' tokens, not text: no "
                                  f"tokenizer describes its vocabulary, so a Hugging Face folder cannot express it; "
                                  f"export it with --format pt")
        tokenizer = build_tokenizer(cfg.data.tokenizer, cfg.data.tokenizer_path)
        cfg = derive(cfg, 1, tokenizer.vocab_size)
        vocab = state["tok_embeddings.weight"].shape[0] if "tok_embeddings.weight" in state else 0
        if tokenizer.vocab_size > vocab:
            raise CheckpointError(f"the tokenizer ({cfg.data.tokenizer_path}) has {tokenizer.vocab_size} tokens, more "
                                  f"than the model's vocabulary of {vocab}: it is not the tokenizer this model was "
                                  f"trained with; export with that run's config")
        with torch.device("meta"):  # shapes only: no weights drawn for a check
            check_fit(f"checkpoint {source}", shapes(state), shapes(Transformer(cfg.model, 1).state_dict()))
        if fmt == "llama":
            model = llama_model(cfg, tokenizer, source, state)
        else:
            model = NSATitanForCausalLM(hf_config(cfg, tokenizer, source))
            model.model.load_state_dict({k: v.float() for k, v in state.items()})
        hf_logging.disable_progress_bar()
        model.to(DTYPES[dtype]).save_pretrained(partial, max_shard_size=max_shard_size)
        fast_tokenizer(tokenizer, cfg.data.tokenizer).save_pretrained(partial)
        size = sum(f.stat().st_size for f in partial.iterdir())
        old = output.parent / f".{output.name}.old"
        if output.exists():
            os.replace(output, old)
        os.replace(partial, output)
        shutil.rmtree(old, ignore_errors=True)
        return size
    finally:
        shutil.rmtree(partial, ignore_errors=True)
