"""Text sources, all through one `datasets.load_dataset(..., streaming=True)` call.

`path` is a Hugging Face hub dataset id (e.g. HuggingFaceFW/fineweb-edu with name
sample-10BT), a local folder of parquet / jsonl / txt files (split from the file names, e.g.
train-00000-of-00008.parquet, exactly as on the hub), or a single such file.
"""

from __future__ import annotations

import logging
import re
import socket
from pathlib import Path
from urllib.parse import urlparse

import datasets
import pyarrow as pa
from datasets import IterableDataset, load_dataset

from .errors import DataError

logger = logging.getLogger(__name__)

BUILDERS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".txt": "text"}
HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")
HUB_TIMEOUT_S = 5.0


LOCAL_DATA = ("Without network, point [data] path at local files: a folder or a file of parquet, jsonl or "
              "txt documents (e.g. data/python_docs), or set [data] source = 'synthetic'.")


def check_hub_reachable(hub_id: str, setting: str = "[data] path", what: str = "dataset", fix: str = LOCAL_DATA) -> None:
    """Fail in seconds, with the way out (`fix`), when the hub cannot be reached for `setting`."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        raise DataError(f"{setting} = '{hub_id}' is a Hugging Face hub {what} id, but HF_HUB_OFFLINE is set. {fix}")
    url = urlparse(constants.ENDPOINT)
    host, port = url.hostname or "huggingface.co", url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((host, port), timeout=HUB_TIMEOUT_S).close()
    except OSError as e:
        raise DataError(f"{setting} = '{hub_id}' is a Hugging Face hub {what} id, but the hub "
                        f"({constants.ENDPOINT}) is unreachable: {e}. {fix}") from None


def local_builder(path: Path) -> str:
    """The `datasets` builder for a local file or folder, from its file suffixes."""
    files = [path] if path.is_file() else [f for f in path.rglob("*") if f.is_file()]
    kinds = {BUILDERS[f.suffix] for f in files if f.suffix in BUILDERS}
    if len(kinds) != 1:
        found = "no parquet, jsonl or txt files" if not kinds else f"mixed kinds {sorted(kinds)}"
        raise DataError(f"[data] path = '{path}': {found}; a local source is one file or a folder of "
                        f"files of one kind (.parquet, .jsonl/.json or .txt)")
    return kinds.pop()


def open_text_stream(path: str, name: str, split: str, text_column: str) -> IterableDataset:
    """A streaming dataset of documents with a `text_column` column; checked to be non-empty."""
    local = Path(path).expanduser()
    try:
        if local.exists():
            builder = local_builder(local)
            kwargs = {"sample_by": "document"} if builder == "text" else {}  # a .txt file is one document
            if local.is_dir():
                ds = load_dataset(str(local), name=name or None, split=split, streaming=True, **kwargs)
            else:
                ds = load_dataset(builder, data_files=str(local), split="train", streaming=True, **kwargs)
        elif HUB_ID.match(path):
            check_hub_reachable(path)
            ds = load_dataset(path, name=name or None, split=split, streaming=True)
        else:
            raise DataError(f"[data] path = '{path}': no such file or folder, and not a hub id (owner/name); "
                            f"give a local parquet/jsonl/txt file or folder, or a hub dataset id")
    except DataError:
        raise
    except (ValueError, FileNotFoundError, datasets.exceptions.DatasetNotFoundError) as e:
        raise DataError(f"[data] path = '{path}' (name '{name}', split '{split}') cannot be loaded: {e}") from None
    try:
        first = next(iter(ds))
    except StopIteration:
        raise DataError(f"[data] path = '{path}', split '{split}': the dataset is empty") from None
    except (pa.ArrowException, OSError, ValueError) as e:  # e.g. a parquet file with no rows, a truncated file
        raise DataError(f"[data] path = '{path}', split '{split}': the dataset is empty or cannot be read ({e})") from None
    if text_column not in first:
        raise DataError(f"[data] text_column = '{text_column}' is not a column of '{path}'; its columns are "
                        f"{sorted(first)}: set [data] text_column to the one holding the text")
    return ds
