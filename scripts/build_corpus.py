"""Build the embedded corpus: the Python 3.11 documentation as FineWeb-Edu-shaped parquet shards.

    python scripts/build_corpus.py [--deb python3.11-doc_*.deb] [--out data/python_docs]

Source: Debian's `python3.11-doc` package (fetched with `apt-get download` when no --deb is
given), whose `_sources/**/*.rst.txt` hold the reStructuredText of every page: about 11 MB of
modern English prose with code. Pages are cut at paragraph boundaries into documents of about
4,000 characters; about 3% of the documents (by a hash of their id) form the validation split.
Output, named as on the Hugging Face hub so that `load_dataset(folder)` finds the splits:
train-0000K-of-00008.parquet and validation-00000-of-00001.parquet, with FineWeb-Edu's
columns text, id, dump, url, file_path, language.
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parent.parent
SOURCES = "usr/share/doc/python3.11/html/_sources"
DOC_CHARS = 4000
TRAIN_SHARDS = 8
VALIDATION_PERCENT = 3


def fetch_deb(workdir: Path) -> Path:
    subprocess.run(["apt-get", "download", "python3.11-doc"], cwd=workdir, check=True)
    return next(workdir.glob("python3.11-doc_*.deb"))


def documents(sources: Path) -> list[dict[str, str]]:
    """Every page cut into ~DOC_CHARS-character documents at paragraph boundaries."""
    docs = []
    for page in sorted(sources.rglob("*.rst.txt")):
        rel = page.relative_to(sources).as_posix().removesuffix(".rst.txt")
        paragraphs = page.read_text(encoding="utf-8").split("\n\n")
        chunk: list[str] = []
        parts = []
        for para in paragraphs:
            chunk.append(para)
            if sum(len(p) + 2 for p in chunk) >= DOC_CHARS:
                parts.append("\n\n".join(chunk))
                chunk = []
        if chunk:
            parts.append("\n\n".join(chunk))
        for k, text in enumerate(p for p in parts if p.strip()):
            docs.append({
                "text": text.strip("\n") + "\n",
                "id": f"python-3.11-docs/{rel}#{k}",
                "dump": "python3.11-doc 3.11.2 (Debian bookworm)",
                "url": f"https://docs.python.org/3.11/{rel}.html",
                "file_path": f"{SOURCES}/{rel}.rst.txt",
                "language": "en",
            })
    return docs


def is_validation(doc_id: str) -> bool:
    return int(hashlib.sha256(doc_id.encode()).hexdigest(), 16) % 100 < VALIDATION_PERCENT


def write(docs: list[dict[str, str]], out: Path, split: str, shards: int) -> None:
    for k in range(shards):
        part = docs[k::shards]
        table = pa.Table.from_pylist(part)
        pq.write_table(table, out / f"{split}-{k:05d}-of-{shards:05d}.parquet", compression="zstd",
                       compression_level=19)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--deb", type=Path, help="a downloaded python3.11-doc .deb (default: apt-get download)")
    parser.add_argument("--out", type=Path, default=ROOT / "data" / "python_docs")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        deb = args.deb or fetch_deb(Path(tmp))
        subprocess.run(["dpkg-deb", "-x", str(deb), tmp], check=True)
        docs = documents(Path(tmp) / SOURCES)
    args.out.mkdir(parents=True, exist_ok=True)
    for old in args.out.glob("*.parquet"):
        old.unlink()
    train = [d for d in docs if not is_validation(d["id"])]
    val = [d for d in docs if is_validation(d["id"])]
    write(train, args.out, "train", TRAIN_SHARDS)
    write(val, args.out, "validation", 1)
    chars = sum(len(d["text"]) for d in docs)
    print(f"{len(train)} train and {len(val)} validation documents, {chars / 1e6:.1f}M characters -> {args.out}")


if __name__ == "__main__":
    main()
