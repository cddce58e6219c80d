"""Tokenizers: byte-level, sentencepiece from any `.model` file, and Hugging Face `tokenizer.json`.

None adds special tokens itself; the packer puts `bos_id` (where the tokenizer has its own) before
every document and `eos_id` after it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Protocol

from .errors import DataError

class Tokenizer(Protocol):
    vocab_size: int
    eos_id: int
    bos_id: int | None  # a begin-of-document token distinct from eos, else None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


def document_tokens(tokenizer: Tokenizer, text: str) -> list[int]:
    """A document as the packer (and a prepared shard) joins it: <bos> where the tokenizer has its own, its
    tokens, <eos>."""
    return ([tokenizer.bos_id] if tokenizer.bos_id is not None else []) + tokenizer.encode(text) + [tokenizer.eos_id]


class ByteTokenizer:
    """UTF-8 bytes 0..255, plus <eos> = 256."""

    vocab_size = 257
    eos_id = 256
    bos_id = None

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
        self.bos_id = self.sp.bos_id() if self.sp.bos_id() >= 0 else None
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


EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>")
"""End-of-text tokens looked for among a tokenizer.json's special tokens when no tokenizer_config.json names one."""
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def tokenizer_file(path: str) -> Path:
    """The local tokenizer.json that `path` names: the file, a folder holding one, or a hub model's,
    fetched once into the Hugging Face cache (offline: the cached copy)."""
    local = Path(path)
    if local.is_file():
        return local
    if local.is_dir():
        if not (local / "tokenizer.json").is_file():
            raise DataError(f"[data] tokenizer_path = '{path}': the folder holds no tokenizer.json; point at the "
                            f"file, or train one with `python -m nsa_titan.data.train_tokenizer --kind hf`")
        return local / "tokenizer.json"
    if not _HUB_ID.match(path) or path.startswith((".", "/")):
        raise DataError(f"[data] tokenizer_path = '{path}': no such file or folder (nor a hub model id)")
    import huggingface_hub

    from .sources import check_hub_reachable  # `datasets` under it: imported only for a hub id

    def fetch(name: str, local_only: bool) -> Path:
        return Path(huggingface_hub.hf_hub_download(path, name, local_files_only=local_only))

    try:  # the cached copy, without asking the hub
        return fetch("tokenizer.json", True)
    except Exception:
        pass
    fix = (f"Fetch it once where the network is reachable (`hf download {path} tokenizer.json "
           f"tokenizer_config.json`), or give a local tokenizer.json.")
    check_hub_reachable(path, "[data] tokenizer_path", "model", fix)
    try:
        file = fetch("tokenizer.json", False)
    except Exception as e:  # unknown repository, no such file, a gated model
        raise DataError(f"[data] tokenizer_path = '{path}': not a local file or folder, and its tokenizer.json "
                        f"could not be fetched from the hub ({type(e).__name__}). {fix}") from None
    try:  # its special tokens' names, when the repository has them
        fetch("tokenizer_config.json", False)
    except Exception:
        pass
    return file


class HFTokenizer:
    """A Hugging Face `tokenizers` tokenizer (`tokenizer.json`). Its end-of-text token ends documents,
    and its begin-of-text token, where it has one distinct from that, starts them: both as
    `tokenizer_config.json` beside the file names them, else by the usual names (EOS_NAMES).

    Pickles as its file's path, so each data-loader worker loads its own copy.
    """

    def __init__(self, path: str):
        from tokenizers import Tokenizer as HFTokenizerModel

        self.path, self.file = path, tokenizer_file(path)
        try:
            self.tok = HFTokenizerModel.from_file(str(self.file))
        except Exception as e:
            raise DataError(f"[data] tokenizer_path = '{path}': {self.file} is not a Hugging Face tokenizer.json "
                            f"({str(e).splitlines()[0][:120]}); give a tokenizer.json that `tokenizers` "
                            f"writes, or train one with `python -m nsa_titan.data.train_tokenizer --kind hf`") from None
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        named = self.special_tokens()
        eos = named.get("eos_token") or next((t for t in EOS_NAMES if self.tok.token_to_id(t) is not None), None)
        if eos is None or self.tok.token_to_id(eos) is None:
            raise DataError(f"[data] tokenizer_path = '{path}': the tokenizer has no end-of-text token to end documents "
                            f"with (looked for {', '.join(EOS_NAMES)}); add one as a special token, or name it as "
                            f"eos_token in a tokenizer_config.json beside the file")
        self.eos_id = self.tok.token_to_id(eos)
        bos = named.get("bos_token")
        bos_id = self.tok.token_to_id(bos) if bos else None
        self.bos_id = bos_id if bos_id != self.eos_id else None

    def special_tokens(self) -> dict[str, str]:
        """The eos and bos tokens that tokenizer_config.json beside the file names ({} without one)."""
        config = self.file.parent / "tokenizer_config.json"
        if not config.is_file():
            return {}
        try:
            named = json.loads(config.read_text())
        except (OSError, ValueError):
            return {}
        unwrap = lambda t: t.get("content") if isinstance(t, dict) else t  # noqa: E731 (AddedToken as a dict)
        return {k: unwrap(named[k]) for k in ("eos_token", "bos_token") if isinstance(unwrap(named.get(k)), str)}

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False)

    def __getstate__(self) -> dict:
        return {"path": str(self.file)}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["path"])


def build_tokenizer(kind: str, path: str) -> Tokenizer:
    """`byte`, `sentencepiece` loaded from `path`, or `hf` (a tokenizer.json, its folder or a hub model)."""
    if kind == "byte":
        return ByteTokenizer()
    if kind == "hf":
        return HFTokenizer(path)
    return SentencePieceTokenizer(path)
