"""The config's data sections: `[data]` with its mixture's `[[data.sources]]`, `[recall]`, `[validation]`.

Part of the schema (`schema.py` imports them); in a file of their own for length.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass
class Source:
    """One source of a weighted mixture: `[[data.sources]]` in TOML, one table each."""

    path: str = ""
    """As `[data] path`: a hub dataset id, a local parquet/jsonl/txt file or folder, or a URL."""
    name: str = ""
    """As `[data] name`: the hub dataset config name."""
    split: str = "train"
    """As `[data] split`."""
    text_column: str = "text"
    """As `[data] text_column`."""
    weight: float = 1.0
    """Its share of the tokens, relative to the others' weights, streamed and prepared alike."""
    label: str = ""
    """Its name in logs, metrics and a prepared folder; default: the last part of `path`."""
    min_tokens: int = 0
    """Documents of fewer tokens are skipped (0: no bound)."""
    max_tokens: int = 0
    """Documents of more tokens are skipped (0: no bound)."""
    repeat: bool = True
    """A source read to its end starts its next epoch (counted and logged); false: the run saves the step before
    and ends there (exit code 0), and a rerun says the source is done."""


@dataclass
class Data:
    source: Literal["datasets", "synthetic", "recall"] = "datasets"
    """`datasets`: documents from `path` through `datasets.load_dataset(streaming=True)`;
    `synthetic`: seeded token streams with learnable structure (no files, no tokenizer use);
    `recall`: the long-range recall task of `[recall]` (no files, no tokenizer use)."""
    path: str = "data/python_docs"
    """A hub dataset id (e.g. HuggingFaceFW/fineweb-edu), a local parquet/jsonl/txt file or folder, or
    the URL of a file, folder or glob that fsspec reads (`https://`, `s3://`, `gs://`, `hf://`; s3 and gs
    need s3fs or gcsfs). Relative paths are taken from the working directory, else from the repository."""
    name: str = ""
    """Hub dataset config name (e.g. sample-10BT for FineWeb-Edu)."""
    split: str = "train"
    """The split to train on (local files: taken from their names, as on the hub)."""
    text_column: str = "text"
    """The column holding each document's text."""
    bad_documents: Literal["error", "skip"] = "error"
    """A document whose text is not text (null, a number, a list): `error` stops the run with exit code 2 and a
    line naming the source, the file and the row; `skip` leaves it out with a warning naming the same."""
    shuffle_buffer: int = 1000
    """Documents held in the shuffle buffer (0: stream order)."""
    num_workers: int = 1
    """StatefulDataLoader worker processes per rank (0: load in the training process)."""
    seed: int = 1234
    """Seed of the shuffle buffer and of the synthetic and recall sources."""
    holdout: float = 0.0
    """The share of the documents of `path` and `split` held out for validation, chosen by a hash of
    each document's text (the same on every rank, run and resume): training never reads them, and
    validation reads them instead of `[validation] path` and `split` (for sources with one split,
    such as FineWeb-Edu). 0: none held out."""
    read_retries: int = 10
    """A remote source (URL, hub id): transient read errors (connection resets, timeouts, HTTP 429 and 5xx)
    retried this many times in a row, from the same position; then the run saves and exits with code 75,
    to be resumed (docs/operations.md). 0: no retries."""
    retry_wait_seconds: float = 1.0
    """The first wait before a retry; each further one doubles, up to 60 s (the defaults wait about 5
    minutes in all, which must stay below [fault] step_timeout_seconds)."""
    sources: list[Source] = field(default_factory=list)
    """A weighted mixture (`[[data.sources]]` tables, docs/data.md); empty: the one source of `path`,
    `name`, `split` and `text_column`. Set in the TOML file, not on the command line."""
    new_weights_on_resume: bool = False
    """A resumed run whose `[[data.sources]]` weights differ from its checkpoint's: refused (false), or (true)
    logged and mixed with the new weights from the data position reached, the shares counted from there."""
    prepared: str = ""
    """A folder of token shards written by `python -m nsa_titan.data.prepare` from these sources and
    tokenizer: read with random access in an order that does not depend on the ranks. Empty: stream text."""
    tokenizer: Literal["sentencepiece", "hf", "byte"] = "sentencepiece"
    """`sentencepiece` (a `.model` file), `hf` (a Hugging Face `tokenizer.json`, read by the `tokenizers`
    package) or `byte` (UTF-8 bytes and <eos>, vocabulary 257)."""
    tokenizer_path: str = "data/python_docs/tokenizer.model"
    """sentencepiece: the `.model` file. hf: a `tokenizer.json`, a folder holding one (with its
    `tokenizer_config.json`, which names the eos and bos tokens), or a hub model id such as
    `HuggingFaceTB/SmolLM2-135M`, fetched once into the Hugging Face cache. Ignored for `byte`."""


@dataclass
class Recall:
    """The long-range recall task (`nsa_titan/data/recall.py`): the `recall` data source and
    `python -m nsa_titan.evaluate --task recall`."""

    key_tokens: int = 4
    """Tokens per key."""
    value_tokens: int = 4
    """Tokens per value (each labelled at the query)."""
    pairs: int = 4
    """Key-value pairs hidden per sequence."""
    asks: int = 1
    """Queries per pair in training, each at its own distance. More than 1 repeats each value in the
    row, as text repeats what matters: a denser signal for learning the lookup (a later query may
    copy from an earlier one). The evaluation asks once, at the distance it names."""
    min_distance: int = 16
    """Training draws each pair's distance (query start - pair start) from [min_distance, max_distance]."""
    max_distance: int = 0
    """0: as far as seq_len allows."""
    distance_scale: Literal["linear", "log", "mixed"] = "linear"
    """How training draws distances: `linear`, every distance equally often; `log`, every scale
    equally often (as many pairs in [16, 32) as in [512, 1024)), so that short pairs, which the
    window alone can recall, come often enough to teach the lookup that long ones need; `mixed`,
    half the draws each way (short pairs still often, the longest ones 2.5x as often as `log`)."""
    distinct: bool = False
    """Every key and value token of a row distinct (drawn without replacement from the key-value
    alphabet, so pairs * (key_tokens + value_tokens) must fit in it). A key's last token then names
    its pair, and a one-layer lookup on it is not ambiguous; with repeats, a token of one pair's key
    recurs in another pair of a 10-pair row about half the time."""
    drill: bool = False
    """Rows of single-token pairs instead: a dictionary of `pairs` pairs from the key-value
    alphabet, the row `k v k v ...` of its pairs in random order, every value whose key came before
    labelled. Each pair recurs many times, so the lookup forms within a few hundred steps, where
    the sparse answers of the recall rows leave the loss at chance; it then carries over to them
    (docs/recall.md: a drill run, then the recall run from its checkpoint)."""


@dataclass
class Validation:
    enable: bool = False
    """Validate on a held-out split during training."""
    path: str = ""
    """The held-out source; empty means [data] path, or for a mixture each source's own, each with its loss
    (unused with `[data] holdout`)."""
    split: str = "validation"
    """The held-out split (unused with `[data] holdout`)."""
    freq: int = 100
    """Validate every `freq` steps and after the last step."""
    steps: int = 10
    """Batches per validation and source (fewer if the held-out text runs out first), read once a run and kept."""
