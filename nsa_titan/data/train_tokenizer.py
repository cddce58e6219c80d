"""Train a tokenizer on a text source: sentencepiece (a `.model` file) or Hugging Face (`tokenizer.json`).

    python -m nsa_titan.data.train_tokenizer --path data/python_docs --vocab_size 4096 \\
        --output data/python_docs/tokenizer.model
    python -m nsa_titan.data.train_tokenizer --kind hf --path data/python_docs --vocab_size 8192 \\
        --output outputs/tokenizer/tokenizer.json

sentencepiece: the normalization is the identity and whitespace is kept as it is (runs of spaces,
tabs, newlines), with byte fallback for anything unseen. hf: byte-level BPE (GPT-2's scheme) with
`<|endoftext|>` as its end-of-text token, written with a `tokenizer_config.json` naming it. Either
way decode(encode(text)) == text for code, whitespace and any unicode.
"""

from __future__ import annotations

import argparse
import io
import itertools
import json
from collections.abc import Iterator
from pathlib import Path

from .sources import open_text_stream

EOS = "<|endoftext|>"
"""The end-of-text token of the Hugging Face tokenizers trained here."""


def _texts(path: str, name: str, split: str, text_column: str, max_docs: int) -> Iterator[str]:
    stream = open_text_stream(path, name, split, text_column)
    return (ex[text_column] for ex in (itertools.islice(stream, max_docs) if max_docs else stream))


def train_sentencepiece(texts: Iterator[str], output: Path, vocab_size: int) -> None:
    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=texts, model_writer=model, vocab_size=vocab_size, model_type="bpe",
        normalization_rule_name="identity", remove_extra_whitespaces=False, split_by_whitespace=True,
        allow_whitespace_only_pieces=True, split_digits=True, byte_fallback=True,
        user_defined_symbols=["\n", "\t"], max_sentence_length=1 << 20, character_coverage=0.9999,
        unk_id=0, bos_id=-1, eos_id=1, pad_id=-1, num_threads=2, minloglevel=2,
    )
    output.write_bytes(model.getvalue())


def train_hf(texts: Iterator[str], output: Path, vocab_size: int) -> None:
    """Byte-level BPE through the `tokenizers` package; `tokenizer_config.json` beside it names EOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    tok.save(str(output))
    (output.parent / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS, "model_max_length": 1 << 30}, indent=2))


def train_tokenizer(path: str, output: str, vocab_size: int, name: str = "", split: str = "train",
                    text_column: str = "text", max_docs: int = 0, kind: str = "sentencepiece") -> None:
    """Train on the documents of `path` (all of them, or the first `max_docs`); write `output`."""
    out = Path(output)
    out.parent.mkdir(parents=True, exist_ok=True)
    train = train_hf if kind == "hf" else train_sentencepiece
    train(_texts(path, name, split, text_column, max_docs), out, vocab_size)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--path", required=True, help="hub id, or local parquet/jsonl/txt file or folder")
    parser.add_argument("--output", required=True, help="the .model (sentencepiece) or tokenizer.json (hf) to write")
    parser.add_argument("--kind", choices=["sentencepiece", "hf"], default="sentencepiece")
    parser.add_argument("--vocab_size", type=int, default=4096)
    parser.add_argument("--name", default="")
    parser.add_argument("--split", default="train")
    parser.add_argument("--text_column", default="text")
    parser.add_argument("--max_docs", type=int, default=0, help="train on the first N documents (0: all)")
    a = parser.parse_args()
    if a.kind == "hf" and Path(a.output).suffix != ".json":
        parser.error(f"--kind hf writes a tokenizer.json: give --output a .json path, not '{a.output}'")
    train_tokenizer(a.path, a.output, a.vocab_size, a.name, a.split, a.text_column, a.max_docs, a.kind)
    print(f"wrote {a.output}")


if __name__ == "__main__":
    main()
