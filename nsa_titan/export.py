"""Export a DCP checkpoint's model as one torch.save file, for inference or a warm start.

    python -m nsa_titan.export outputs/m7c/checkpoint/step-1000 --output m7c.pt [--dtype bfloat16]

Works on one process without the training config: shapes and dtypes come from the
checkpoint's metadata. Load the file as a starting model with
`--checkpoint.initial_load_path m7c.pt`.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from .checkpoint import EXPORT_DTYPES, CheckpointError, inspect_folder
from .cli import ArgumentParser, run_command


def load_tensors(path: Path, prefix: str = "model") -> dict[str, torch.Tensor]:
    """Every tensor under `prefix` in the DCP checkpoint at `path`, full size, on the CPU."""
    problem = inspect_folder(path) if path.is_dir() else "no such checkpoint folder"
    if problem:
        raise CheckpointError(f"checkpoint {path} cannot be exported: {problem}")
    meta = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    state = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in meta.items()
             if k.startswith(prefix + ".") and isinstance(v, TensorStorageMetadata)}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=str(path), no_dist=True)
    return {k[len(prefix) + 1:]: v for k, v in state.items()}


def export(path: Path, output: Path, dtype: str) -> int:
    """Write the model of checkpoint `path` to `output` in `dtype`; returns the byte size."""
    if output.is_dir():
        raise CheckpointError(f"--output {output} is a folder: give the path of the .pt file to write")
    state = {k: v.to(EXPORT_DTYPES[dtype]) for k, v in load_tensors(path).items()}
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CheckpointError(f"--output {output}: its folder cannot be created ({e.strerror})") from None
    tmp = output.with_name(output.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, output)
    return output.stat().st_size


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="nsa_titan.export", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path, help="a complete step-N checkpoint folder")
    parser.add_argument("--output", type=Path, required=True, help="the .pt file to write")
    parser.add_argument("--dtype", choices=sorted(EXPORT_DTYPES), default="bfloat16")
    args = parser.parse_args(argv)

    def write() -> int:
        size = export(args.checkpoint, args.output, args.dtype)
        print(f"wrote {args.output} ({size / 1e6:.1f} MB, {args.dtype})")
        return 0

    return run_command("nsa_titan.export", write)


if __name__ == "__main__":
    sys.exit(main())
