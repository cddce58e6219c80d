"""Export a DCP checkpoint's model as one torch.save file, for inference or a warm start.

    python -m nsa_titan.export outputs/m7c/checkpoint/step-1000 --output m7c.pt [--dtype bfloat16]

Works on one process without the training config: shapes and dtypes come from the
checkpoint's metadata. The step folder's config.toml is written beside the file (m7c.toml), where
evaluate and generate find it. Load the file as a starting model with
`--checkpoint.initial_load_path m7c.pt`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .checkpoint import load_tensors, write_model_file
from .cli import ArgumentParser, run_command
from .config import DTYPES
from .paths import config_of_checkpoint


def export(path: Path, output: Path, dtype: str) -> int:
    """Write the model of checkpoint `path` to `output` in `dtype`, its config beside it; returns the bytes."""
    state = load_tensors(path)
    config = config_of_checkpoint(path)
    return write_model_file(state, output, dtype, config.read_text() if config.is_file() else None)


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="nsa_titan.export", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path, help="a complete step-N checkpoint folder")
    parser.add_argument("--output", type=Path, required=True, help="the .pt file to write")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    args = parser.parse_args(argv)

    def write() -> int:
        size = export(args.checkpoint, args.output, args.dtype)
        print(f"wrote {args.output} ({size / 1e6:.1f} MB, {args.dtype})")
        return 0

    return run_command("nsa_titan.export", write)


if __name__ == "__main__":
    sys.exit(main())
