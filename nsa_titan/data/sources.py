"""Text sources, all through one `datasets.load_dataset(..., streaming=True)` call.

`path` is a Hugging Face hub dataset id (e.g. HuggingFaceFW/fineweb-edu with name
sample-10BT), a local folder of parquet / jsonl / txt files (split from the file names, e.g.
train-00000-of-00008.parquet, exactly as on the hub), a single such file, or the URL of a file,
a folder or a glob that `fsspec` reads (`https://`, `s3://`, `gs://`, `hf://`). Opening a remote
source retries transient errors (`retry.py`); so does reading it (`packing.py`).
"""

from __future__ import annotations

import copy
import functools
import glob
import logging
import math
import re
import socket
from pathlib import Path
from urllib.parse import urlparse

import datasets
import fsspec
import pyarrow as pa
import xxhash
from datasets import IterableDataset, load_dataset
from datasets.data_files import DataFilesList
from datasets.distributed import split_dataset_by_node
from datasets.utils.sharding import _split_gen_kwargs
from torch.utils.data import get_worker_info

from ..config import HUB_ID, URL, Data, Source, is_remote
from ..system.env import own_streaming_retries
from .errors import DataError
from .retry import Retrier, transient

logger = logging.getLogger(__name__)

BUILDERS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".txt": "text"}
SPLIT_WORD = re.compile(r"(?:^|(?<=[-._ /]))(train|validation|test)(?=[-._ 0-9/]|$)")
"""A split named in a remote file's path, as on the hub: train-00000-of-00008.parquet, validation/x.jsonl."""
FSSPEC_PACKAGES = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs"}
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


def remote_files(url: str, split: str) -> list[str]:
    """The files of `split` at `url`: the file itself, the matches of a glob, or a folder's files of that
    split (named as on the hub: train-00000-of-00008.parquet; every file of a folder without split names
    is `train`)."""
    try:
        fs, inner = fsspec.core.url_to_fs(url)
    except (ImportError, ValueError) as e:
        package = FSSPEC_PACKAGES.get(url.split("://", 1)[0], "the fsspec filesystem of this protocol")
        raise DataError(f"[data] path = '{url}' cannot be read here ({e}): pip install {package}") from None
    if glob.has_magic(inner):
        files = [f if URL.match(f) else fs.unstrip_protocol(f) for f in sorted(fs.glob(inner))]
    elif Path(urlparse(url).path).suffix in BUILDERS:  # a file (an HTTP server answers for folders too)
        files = [url]
    else:  # a folder: one listing; its files of `split`, or all of them where no name holds a split
        listed = [f if URL.match(f) else fs.unstrip_protocol(f) for f in sorted(fs.find(inner))]
        named = {f: SPLIT_WORD.findall(urlparse(f).path[len(urlparse(url).path):]) for f in listed}
        if any(named.values()):
            files = [f for f, words in named.items() if split in words]
        else:
            files = listed if split == "train" else []
    files = [f for f in files if Path(urlparse(f).path).suffix in BUILDERS]
    if not files:
        raise DataError(f"[data] path = '{url}': no parquet, jsonl or txt files there (split '{split}')")
    return files


def open_text_stream(path: str, name: str, split: str, text_column: str, read_retries: int = 0,
                     retry_wait_s: float = 1.0) -> IterableDataset:
    """A streaming dataset of documents with a `text_column` column; checked to be non-empty. A remote
    source's transient errors while it is opened are retried `read_retries` times."""
    retrier = Retrier(f"[data] path = '{path}'", read_retries, retry_wait_s)
    if is_remote(path):
        own_streaming_retries()
    while True:
        try:
            return _open(path, name, split, text_column)
        except DataError:
            raise
        except Exception as e:  # noqa: BLE001 - the retrier re-raises what is not transient
            retrier.failed(e)


def node_stream(src: Source, data: Data, dp_rank: int, dp_size: int, held: bool) -> IterableDataset:
    """`src`'s documents that dp rank `dp_rank` of `dp_size` reads: those `[data] holdout` holds out (`held`) or
    those it does not, shared out among the ranks."""
    stream = open_text_stream(src.path, src.name, src.split, src.text_column, data.read_retries,
                              data.retry_wait_seconds)
    if data.holdout:
        stream = stream.filter(functools.partial(_select, column=src.text_column, share=data.holdout, keep=held))
    return split_dataset_by_node(stream, rank=dp_rank, world_size=dp_size)


def is_held_out(text: str, share: float) -> bool:
    """Whether `[data] holdout = share` holds the document `text` out: its text's hash below `share` of the range."""
    return xxhash.xxh3_64_intdigest(text.encode()) < share * 2**64


def _select(example: dict, column: str, share: float, keep: bool) -> bool:
    """Whether `example` stays: a held-out document if `keep`, else one that is not (as is one that holds no
    text, for training to name: `document_text`)."""
    text = example[column]
    return (isinstance(text, str) and is_held_out(text, share)) == keep


def _open(path: str, name: str, split: str, text_column: str) -> IterableDataset:
    local = Path(path).expanduser()
    try:
        if local.exists():
            builder = local_builder(local)
            kwargs = {"sample_by": "document"} if builder == "text" else {}  # a .txt file is one document
            if local.is_dir():
                ds = load_dataset(str(local), name=name or None, split=split, streaming=True, **kwargs)
            else:
                ds = load_dataset(builder, data_files=str(local), split="train", streaming=True, **kwargs)
        elif URL.match(path):
            files = remote_files(path, split)
            builder = BUILDERS[Path(urlparse(files[0]).path).suffix]
            kwargs = {"sample_by": "document"} if builder == "text" else {}
            listed = DataFilesList(files, [(f,) for f in files])  # as listed: not looked up again file by file
            ds = load_dataset(builder, data_files={"train": listed}, split="train", streaming=True, **kwargs)
        elif HUB_ID.match(path):
            check_hub_reachable(path)
            ds = load_dataset(path, name=name or None, split=split, streaming=True)
        else:
            raise DataError(f"[data] path = '{path}': no such file or folder, not a URL and not a hub id (owner/name); "
                            f"give a local parquet/jsonl/txt file or folder, a URL (https://, s3://, gs://, hf://) "
                            f"or a hub dataset id")
    except DataError:
        raise
    except (ValueError, FileNotFoundError, datasets.exceptions.DatasetNotFoundError) as e:
        if transient(e):
            raise  # open_text_stream retries it
        raise DataError(f"[data] path = '{path}' (name '{name}', split '{split}') cannot be loaded: {e}") from None
    try:
        first = next(iter(ds))
    except StopIteration:
        raise DataError(f"[data] path = '{path}', split '{split}': the dataset is empty") from None
    except (pa.ArrowException, OSError, ValueError) as e:  # e.g. a parquet file with no rows, a truncated file
        if transient(e):
            raise
        raise DataError(f"[data] path = '{path}', split '{split}': the dataset is empty or cannot be read ({e})") from None
    if text_column not in first:
        raise DataError(f"[data] text_column = '{text_column}' is not a column of '{path}'; its columns are "
                        f"{sorted(first)}: set [data] text_column to the one holding the text")
    return ds


def document_place(stream: IterableDataset) -> str:
    """Where the document that `stream` yielded last lies, in words: 'file F, row R' (rows counted from 0), as the
    stream's state and its sharding over nodes and loader workers tell (`datasets`' own bookkeeping, which has no
    public form); '(file and row unknown)' where they do not."""
    try:
        state, rebatched = stream.state_dict()["examples_iterable"], None
        while "shard_idx" not in state:  # down the wrappers (filters, rebatching) to the files' own iterable
            if state.get("type") == "RebatchedArrowExamplesIterable" and state.get("previous_state"):
                rebatched = state
            state = state.get("examples_iterable") or state["ex_iterable"]
        row = state["shard_example_idx"] - 1  # the files' iterable yields rows, or whole tables when rebatched:
        if rebatched is not None:  # then the rows since the state before this table, which began the file or
            before = rebatched["previous_state"]  # went on from that state's row
            start = before["shard_example_idx"] if before["shard_idx"] == state["shard_idx"] else 0
            row = start + rebatched["num_chunks_since_previous_state"] - 1
        # Prepared from a copy: preparing the stream itself would reset its live state.
        iterable, info = copy.deepcopy(stream)._prepare_ex_iterable_for_iteration(), get_worker_info()
        if info is not None:  # as datasets shards a stream over a torch loader's workers
            iterable = iterable.shard_data_sources(num_shards=info.num_workers, index=info.id, contiguous=False)
        while hasattr(iterable, "ex_iterable"):
            iterable = iterable.ex_iterable
        shard = _split_gen_kwargs(iterable.kwargs, max_num_jobs=iterable.num_shards)[state["shard_idx"]]
        return f"file {(shard.get('files') or shard['base_files'])[0]}, row {row}"
    except Exception:  # noqa: BLE001 - the words are a courtesy: datasets may keep its state otherwise
        return "(file and row unknown)"


NAMED_SKIPS, PLACED_SKIPS = 10, 100
"""A process names at most `NAMED_SKIPS` skipped documents (file and row: a warning each, once however many epochs
read them again), and looks up the place of at most `PLACED_SKIPS` skips (from a copy of the stream's state); past
them it counts, and says the count at each power of ten from 100: a source with millions of null rows costs a
counter, not a copy and a kept message each."""
_skips: dict[str, tuple[int, set[str]]] = {}
"""By source path: the skips so far in this process (re-reads included), and the documents named."""


def _skip(src: Source, stream: IterableDataset, text: object) -> None:
    """Count a skip of a document of `src`; name the document while few are named, say the count now and then."""
    count, named = _skips.get(src.path, (0, set()))
    _skips[src.path] = (count := count + 1, named)
    if count <= PLACED_SKIPS and len(named) < NAMED_SKIPS and (what := _bad(src, stream, text)) not in named:
        named.add(what)
        logger.warning("data: skipped a document: %s ([data] bad_documents = 'skip')%s", what,
                       "; further ones are counted, not named" if len(named) == NAMED_SKIPS else "")
    if count >= 100 and math.log10(count).is_integer():
        logger.warning("data: documents of [data] path = '%s' skipped %s times so far in this process (null or not "
                       "text, re-reads included; [data] bad_documents = 'skip')", src.path, f"{count:,}")


def _bad(src: Source, stream: IterableDataset, text: object) -> str:
    return (f"[data] path = '{src.path}', {document_place(stream)}: its '{src.text_column}' is "
            f"{'null' if text is None else type(text).__name__}, not text")


def document_text(example: dict, src: Source, stream: IterableDataset, bad_documents: str) -> str | None:
    """The text of `example`, the document of `src` that `stream` yielded last. One that holds no text (null, a
    number) is bad input named by source, file and row: a DataError, or with `[data] bad_documents = 'skip'`,
    None and a warning (`_skip`: the first ones named, then a count)."""
    text = example[src.text_column]
    if isinstance(text, str):
        return text
    if bad_documents == "skip":
        _skip(src, stream, text)
        return None
    raise DataError(f"{_bad(src, stream, text)}. Mend or drop that row, or set [data] bad_documents = 'skip' to leave "
                    f"such documents out (the first named in warnings, then counted)")
