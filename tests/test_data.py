"""The data pipeline: exact resume, sharding, epochs, the streaming path, tokenizers, bad input."""

from __future__ import annotations

import collections
import re
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from nsa_titan import train
from nsa_titan.config import Data, Validation, load_config, padded_vocab
from nsa_titan.data import (
    DataError, HeldOutSets, build_dataloader, build_tokenizer,
)
from nsa_titan.data import sources
from nsa_titan.data.batch import eos_documents
from nsa_titan.data.synthetic import SyntheticTokens
from nsa_titan.data.tokenizer import ByteTokenizer, SentencePieceTokenizer
from nsa_titan.data.train_tokenizer import train_tokenizer

from conftest import ROOT

N_DOCS, N_SHARDS = 64, 4
DOC_BYTES = 16  # + <eos> = 17 tokens: a window of seq_len + 1 = 34 tokens holds exactly 2 documents
SEQ_LEN, BATCH = 33, 2
EPOCH_BATCHES = N_DOCS // 2 // 2 // BATCH  # per rank: 64 docs / 2 ranks / 2 docs per window / batch


def doc_text(i: int) -> str:
    return f"doc{i:04d}:".ljust(DOC_BYTES - 1, "x") + "\n"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A FineWeb-Edu-shaped folder: 4 train shards of 16 documents and a validation shard."""
    root = tmp_path_factory.mktemp("corpus")
    for k in range(N_SHARDS):
        ids = range(k, N_DOCS, N_SHARDS)
        pq.write_table(pa.table({"text": [doc_text(i) for i in ids], "id": [f"d{i}" for i in ids],
                                 "url": [f"https://example.org/{i}" for i in ids]}),
                       root / f"train-{k:05d}-of-{N_SHARDS:05d}.parquet")
    pq.write_table(pa.table({"text": [doc_text(1000 + i) for i in range(8)], "id": [str(i) for i in range(8)],
                             "url": [""] * 8}), root / "validation-00000-of-00001.parquet")
    return root


def loader(corpus, rank: int, workers: int, shuffle: int = 8):
    data = Data(source="datasets", path=str(corpus), tokenizer="byte", shuffle_buffer=shuffle,
                num_workers=workers, seed=7)
    return build_dataloader(data, ByteTokenizer(), SEQ_LEN, 320, BATCH, rank, 2)


def take(it, n: int) -> list[torch.Tensor]:
    return [next(it)[0] for _ in range(n)]


def docs_in(batches: list[torch.Tensor]) -> list[str]:
    """The documents of a list of input batches (each window holds exactly 2 whole ones)."""
    tok = ByteTokenizer()
    out = []
    for batch in batches:
        for window in batch.tolist():
            text = tok.decode(window)  # inputs drop the window's last token: the second <eos>
            out += [text[:DOC_BYTES], text[DOC_BYTES:]]
    return out


@pytest.mark.parametrize("workers", [0, 2])
def test_each_epoch_sees_every_document_once_over_two_ranks(corpus, workers):
    seen = [docs_in(take(iter(loader(corpus, r, workers)), 2 * EPOCH_BATCHES)) for r in (0, 1)]
    for epoch in (0, 1):
        half = EPOCH_BATCHES * BATCH * 2
        docs = [d for s in seen for d in s[epoch * half:(epoch + 1) * half]]
        counts = collections.Counter(docs)
        assert sorted(counts) == sorted(doc_text(i) for i in range(N_DOCS)), f"epoch {epoch}"
        assert set(counts.values()) == {1}, f"epoch {epoch}: duplicated documents"
    assert set(seen[0]).isdisjoint(seen[1])  # the ranks hold different shards
    assert seen[0][: len(seen[0]) // 2] != seen[0][len(seen[0]) // 2 :]  # a new epoch reshuffles


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("stop", [3, EPOCH_BATCHES - 1, EPOCH_BATCHES + 3])
def test_restored_loader_state_gives_the_same_next_batches(corpus, workers, stop):
    total = 2 * EPOCH_BATCHES + 2  # crosses the epoch boundary after the stop (or before it)
    for rank in (0, 1):
        reference = take(iter(loader(corpus, rank, workers)), total)
        first = loader(corpus, rank, workers)
        it = iter(first)
        take(it, stop)
        state = first.state_dict()
        resumed = loader(corpus, rank, workers)
        resumed.load_state_dict(state)
        after = take(iter(resumed), total - stop)
        for k, (a, b) in enumerate(zip(after, reference[stop:])):
            assert torch.equal(a, b), f"rank {rank}, batch {stop + k} differs after resume"


def test_validation_loader_is_one_ordered_pass(corpus):
    v = Validation(enable=True, split="validation", steps=1000)
    data = Data(source="datasets", path=str(corpus), tokenizer="byte")
    batches = [HeldOutSets(data, v, ByteTokenizer(), SEQ_LEN, 1, r, 2).batches()[0] for r in (0, 1)]
    docs = [d for b in batches for d in docs_in([sample.inputs for sample in b])]
    assert sorted(docs) == sorted(doc_text(1000 + i) for i in range(8))  # 8 docs, one pass, no repeat


@pytest.mark.parametrize("workers", [0, 2])
def test_holdout_gives_validation_documents_that_training_never_reads(corpus, workers):
    """[data] holdout = 0.25: a fixed quarter of the train split's documents, by hash, on both ranks;
    the training stream (2 ranks, an epoch) has the other three quarters, and resumes exactly."""
    data = Data(source="datasets", path=str(corpus), tokenizer="byte", shuffle_buffer=8, num_workers=workers, seed=7,
                holdout=0.25)
    v = Validation(enable=True, split="validation", steps=1000)  # split unused with holdout: the held-out train documents
    held = [d for r in (0, 1) for b in HeldOutSets(data, v, ByteTokenizer(), 16, 1, r, 2).batches()[0]
            for d in [ByteTokenizer().decode(b.inputs[0].tolist())[:DOC_BYTES]]]
    held_docs = {d for d in held if d.startswith("doc")}
    assert 6 <= len(held_docs) <= 26 and not any(d.startswith("doc1") for d in held_docs)  # ~16 of 64, train split
    trained = [d for r in (0, 1) for batch in take(iter(build_dataloader(data, ByteTokenizer(), SEQ_LEN, 320, BATCH, r,
                                                                          2)), 4) for d in docs_in([batch])]
    assert trained and held_docs.isdisjoint(trained)
    first = build_dataloader(data, ByteTokenizer(), SEQ_LEN, 320, BATCH, 0, 2)
    it = iter(first)
    reference = take(it, 5)
    again = build_dataloader(data, ByteTokenizer(), SEQ_LEN, 320, BATCH, 0, 2)
    it2 = iter(again)
    take(it2, 2)
    resumed = build_dataloader(data, ByteTokenizer(), SEQ_LEN, 320, BATCH, 0, 2)
    resumed.load_state_dict(again.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(take(iter(resumed), 3), reference[2:]))


def test_hub_id_and_local_folder_take_the_same_streaming_call(corpus, monkeypatch):
    calls = []
    real = sources.load_dataset

    def spy(path, **kwargs):
        calls.append((path, kwargs))
        return real(str(corpus) if path == "someone/fineweb-like" else path, **kwargs)

    monkeypatch.setattr(sources, "load_dataset", spy)
    monkeypatch.setattr(sources, "check_hub_reachable", lambda hub_id: None)
    local = [ex["id"] for ex in sources.open_text_stream(str(corpus), "", "train", "text")]
    hub = [ex["id"] for ex in sources.open_text_stream("someone/fineweb-like", "", "train", "text")]
    assert calls[0] == (str(corpus), {"name": None, "split": "train", "streaming": True})
    assert calls[1] == ("someone/fineweb-like", {"name": None, "split": "train", "streaming": True})
    assert local == hub and len(local) == N_DOCS


def test_embedded_corpus_is_fineweb_shaped_with_splits():
    ds = sources.open_text_stream(str(ROOT / "data" / "python_docs"), "", "train", "text")
    first = next(iter(ds))
    assert {"text", "id", "url", "dump", "language", "file_path"} <= set(first)
    assert ds.num_shards == 8
    assert sum(1 for _ in sources.open_text_stream(str(ROOT / "data" / "python_docs"), "", "validation", "text")) > 50


ROUND_TRIP = [
    "plain English, with punctuation: yes!",
    "def f(x):\n\tif x  >  1:\n        return {'k': [1, 2]}  # comment\n\n\n",
    "unicode: héllo — naïve café, 世界, Ωμέγα, emoji 🎉🚀, combining e\u0301",
    "   leading and trailing spaces   \r\n\twith CRLF and\ttabs\t",
    "",
]


@pytest.mark.parametrize("text", ROUND_TRIP)
def test_byte_tokenizer_round_trip(text):
    tok = ByteTokenizer()
    assert tok.decode(tok.encode(text)) == text
    assert tok.eos_id == 256 and padded_vocab(tok.vocab_size) == 320


@pytest.mark.parametrize("text", ROUND_TRIP)
def test_shipped_sentencepiece_round_trip(text):
    tok = SentencePieceTokenizer(str(ROOT / "data" / "python_docs" / "tokenizer.model"))
    assert tok.decode(tok.encode(text)) == text
    assert tok.vocab_size == 4096 and padded_vocab(tok.vocab_size) == 4096
    assert tok.eos_id not in tok.encode(text)


def test_train_tokenizer_command_round_trips(tmp_path):
    out = tmp_path / "tok.model"
    train_tokenizer(str(ROOT / "data" / "python_docs"), str(out), vocab_size=400, max_docs=200)
    tok = build_tokenizer("sentencepiece", str(out))
    assert tok.vocab_size == 400
    for text in ROUND_TRIP:
        assert tok.decode(tok.encode(text)) == text
    assert len(tok.encode("the function returns")) < 0.8 * len("the function returns")  # it learned merges



def test_train_tokenizer_stops_reading_after_max_docs(tmp_path, monkeypatch):
    """--max_docs stops the stream there (a hub dataset is not streamed to its end)."""
    import nsa_titan.data.train_tokenizer as tt

    def stream(*args, **kwargs):
        for k in range(10**9):
            if k >= 300:
                raise AssertionError("read past max_docs")
            yield {"text": f"document {k}: def f(x): return x + {k}\n" * 5}

    monkeypatch.setattr(tt, "open_text_stream", stream)
    tt.train_tokenizer("unused", str(tmp_path / "t.model"), vocab_size=300, max_docs=300)
    assert (tmp_path / "t.model").stat().st_size > 0

def test_model_vocab_follows_the_tokenizer(monkeypatch):
    cfg, _ = load_config(["--training.steps", "1"], world_size=1)
    assert cfg.model.vocab_size == 0  # decided once the tokenizer is loaded
    tok = build_tokenizer(cfg.data.tokenizer, cfg.data.tokenizer_path)
    assert padded_vocab(tok.vocab_size) == 4096


# Bad input: each stops with its message (and exit code 2 through main).

def test_hub_id_without_network_fails_within_seconds(monkeypatch):
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
    monkeypatch.setattr("huggingface_hub.constants.ENDPOINT", "http://127.0.0.1:9")  # nothing listens
    start = time.monotonic()
    with pytest.raises(DataError, match="the hub .* is unreachable.*point \\[data\\] path at local files"):
        sources.open_text_stream("HuggingFaceFW/fineweb-edu", "sample-10BT", "train", "text")
    assert time.monotonic() - start < 10
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    with pytest.raises(DataError, match="HF_HUB_OFFLINE is set"):
        sources.open_text_stream("HuggingFaceFW/fineweb-edu", "sample-10BT", "train", "text")


def write_bad_inputs(tmp_path):
    (tmp_path / "empty").mkdir()
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), tmp_path / "empty" / "train-00000-of-00001.parquet")
    (tmp_path / "nocol").mkdir()
    pq.write_table(pa.table({"content": ["a b c"]}), tmp_path / "nocol" / "train-00000-of-00001.parquet")
    (tmp_path / "nodata").mkdir()
    (tmp_path / "nodata" / "notes.md").write_text("# not data")
    (tmp_path / "mixed").mkdir()
    (tmp_path / "mixed" / "a.txt").write_text("hello")
    (tmp_path / "mixed" / "b.jsonl").write_text('{"text": "hello"}\n')
    (tmp_path / "garbage.model").write_bytes(b"this is not a sentencepiece model")


BAD_DATA = [
    (["--data.path", "{tmp}/missing"], "no such file or folder, not a URL and not a hub id"),
    (["--data.path", "{tmp}/empty"], "the dataset is empty"),
    (["--data.path", "{tmp}/nocol"], "text_column = 'text' is not a column of .*its columns are \\['content'\\]"),
    (["--data.path", "{tmp}/nodata"], "no parquet, jsonl or txt files"),
    (["--data.path", "{tmp}/mixed"], "mixed kinds"),
    (["--data.tokenizer_path", "{tmp}/garbage.model"], "is not a sentencepiece model"),
    (["--data.tokenizer_path", "{tmp}/none.model"], "file not found; train one with"),
    (["--model.vocab_size", "1000"], "config error: \\[model\\] vocab_size = 1000 is smaller than the tokenizer's 4096"),
    (["--data.split", "test"], "cannot be loaded"),
]


@pytest.mark.parametrize("args,message", BAD_DATA, ids=[b[1][:30] for b in BAD_DATA])
def test_bad_data_input_stops_with_message(args, message, tmp_path, capsys, monkeypatch):
    write_bad_inputs(tmp_path)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    argv = ["--training.steps", "1", "--data.num_workers", "0", "--metrics.enable_tensorboard", "false",
            "--job.dump_folder", str(tmp_path / "out"), *(a.replace("{tmp}", str(tmp_path)) for a in args)]
    assert train.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("nsa_titan: data error:" if "config error" not in message else "nsa_titan: "), err
    assert re.search(message, err), err


def test_document_ids_follow_eos_in_every_window(corpus):
    """An <eos> ends its document and the next token starts the next one; the ids come with every
    batch (and are a function of the window, so a restored loader gives the same ones)."""
    eos = ByteTokenizer().eos_id
    assert eos_documents(torch.tensor([5, eos, 7, 8, eos, eos, 9]), eos).tolist() == [0, 0, 1, 1, 1, 2, 3]
    batch = next(iter(loader(corpus, 0, 0)))
    assert batch.document_ids.shape == batch.inputs.shape
    for inputs, ids in zip(batch.inputs, batch.document_ids):
        starts = (ids[1:] != ids[:-1]).nonzero().flatten() + 1
        assert starts.numel() >= 1 and bool((inputs[starts - 1] == eos).all())  # each new one follows an <eos>
        assert int((inputs == eos).sum()) == starts.numel() + int(inputs[-1] == eos)


def test_synthetic_windows_hold_several_documents():
    ds = SyntheticTokens(0, 256, 64, 0, 1, 2)
    counts = [int(s.document_ids.max()) + 1 for s, _ in zip(ds, range(20))]
    assert min(counts) >= 1 and 3 <= sum(counts) / len(counts) <= 6
    first, again = SyntheticTokens(0, 256, 64, 0, 1, 2), SyntheticTokens(0, 256, 64, 0, 1, 2)
    assert all(torch.equal(a.document_ids, b.document_ids) for a, b, _ in zip(first, again, range(3)))


def test_skipping_many_bad_rows_costs_a_counter_not_a_copy_and_a_message_each(tmp_path, caplog, monkeypatch):
    """2,700 null rows of 3,000 under `bad_documents = 'skip'`: each skip deep-copied the stream to find its row and
    kept its message for good (a source of many null rows slowed down and grew without bound). Now 10 are named,
    at most PLACED_SKIPS looked up, and the count said at 100 and 1,000."""
    from nsa_titan.config import Source

    rows = [f"def f{i}(x):\n    return x + {i}\n" * 4 if i % 10 == 0 else None for i in range(3000)]
    pq.write_table(pa.table({"text": rows}), tmp_path / "train-00000-of-00001.parquet")
    src = Source(path=str(tmp_path))
    stream = sources.open_text_stream(str(tmp_path), "", "train", "text")
    looked_up, place = [], sources.document_place
    monkeypatch.setattr(sources, "document_place", lambda s: looked_up.append(1) or place(s))
    monkeypatch.setattr(sources, "_skips", {})
    caplog.set_level("WARNING", logger="nsa_titan")
    texts = [sources.document_text(example, src, stream, "skip") for example in stream]
    assert sum(t is None for t in texts) == 2700 and len(looked_up) <= sources.PLACED_SKIPS
    named = [r.getMessage() for r in caplog.records if "skipped a document" in r.getMessage()]
    assert len(named) == sources.NAMED_SKIPS and "row 1: its 'text' is null" in named[0], named[:2]
    assert "further ones are counted, not named" in named[-1]
    counts = [r.getMessage() for r in caplog.records if "times so far" in r.getMessage()]
    assert [re.search(r"skipped ([\d,]+) times", m).group(1) for m in counts] == ["100", "1,000"], counts
    assert len(caplog.records) == len(named) + 2
