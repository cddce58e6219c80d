"""Tokenizers: byte-level, and sentencepiece from any `.model` file.

Both append nothing themselves; the packer adds `eos_id` after every document.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from .errors import DataError

class Tokenizer(Protocol):
    vocab_size: int
    eos_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes 0..255, plus <eos> = 256."""

    vocab_size = 257
    eos_id = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class SentencePieceTokenizer:
    """A sentencepiece model loaded from `path`; its </s> piece ends documents.

    Pickles as its path, so each data-loader worker loads its own copy.
    """

    def __init__(self, path: str):
        import sentencepiece as spm

        self.path = path
        if not Path(path).is_file():
            raise DataError(f"[data] tokenizer_path = '{path}': file not found; train one with "
                            f"`python -m nsa_titan.data.train_tokenizer` or point at an existing .model file")
        self.sp = spm.SentencePieceProcessor()
        try:
            self.sp.Load(path)
        except (OSError, RuntimeError) as e:
            raise DataError(f"[data] tokenizer_path = '{path}' is not a sentencepiece model: {e}") from None
        self.vocab_size = self.sp.GetPieceSize()
        self.eos_id = self.sp.eos_id()
        if self.eos_id < 0:
            raise DataError(f"[data] tokenizer_path = '{path}': the model has no </s> (eos) piece to end "
                            f"documents with; train it with eos_id >= 0")

    def encode(self, text: str) -> list[int]:
        return self.sp.EncodeAsIds(text)

    def decode(self, ids: list[int]) -> str:
        return self.sp.DecodeIds(ids)

    def __getstate__(self) -> dict:
        return {"path": self.path}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["path"])


def build_tokenizer(kind: str, path: str) -> Tokenizer:
    """`byte`, or `sentencepiece` loaded from `path`."""
    if kind == "byte":
        return ByteTokenizer()
    return SentencePieceTokenizer(path)
