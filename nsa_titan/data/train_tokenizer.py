"""Train a sentencepiece tokenizer on a text source.

    python -m nsa_titan.data.train_tokenizer --path data/python_docs --vocab_size 4096 \\
        --output data/python_docs/tokenizer.model

The normalization is the identity and whitespace is kept as it is (runs of spaces, tabs,
newlines), with byte fallback for anything unseen, so decode(encode(text)) == text for code,
whitespace and any unicode.
"""

from __future__ import annotations

import argparse
import io
import itertools
from pathlib import Path

import sentencepiece as spm

from .sources import open_text_stream


def train_tokenizer(path: str, output: str, vocab_size: int, name: str = "", split: str = "train",
                    text_column: str = "text", max_docs: int = 0) -> None:
    """Train on the documents of `path` (all of them, or the first `max_docs`); write `output`."""
    stream = open_text_stream(path, name, split, text_column)
    texts = (ex[text_column] for ex in (itertools.islice(stream, max_docs) if max_docs else stream))
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=texts, model_writer=model, vocab_size=vocab_size, model_type="bpe",
        normalization_rule_name="identity", remove_extra_whitespaces=False, split_by_whitespace=True,
        allow_whitespace_only_pieces=True, split_digits=True, byte_fallback=True,
        user_defined_symbols=["\n", "\t"], max_sentence_length=1 << 20, character_coverage=0.9999,
        unk_id=0, bos_id=-1, eos_id=1, pad_id=-1, num_threads=2, minloglevel=2,
    )
    Path(output).parent.mkdir(parents=True, exist_ok=True)
    Path(output).write_bytes(model.getvalue())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--path", required=True, help="hub id, or local parquet/jsonl/txt file or folder")
    parser.add_argument("--output", required=True, help="where to write the .model file")
    parser.add_argument("--vocab_size", type=int, default=4096)
    parser.add_argument("--name", default="")
    parser.add_argument("--split", default="train")
    parser.add_argument("--text_column", default="text")
    parser.add_argument("--max_docs", type=int, default=0, help="train on the first N documents (0: all)")
    a = parser.parse_args()
    train_tokenizer(a.path, a.output, a.vocab_size, a.name, a.split, a.text_column, a.max_docs)
    print(f"wrote {a.output}")


if __name__ == "__main__":
    main()
