"""What an offline W&B run left on disk, read back: its `.wandb` records, their history, and the console's losses to
compare them with (tests/test_wandb.py, and the rollback and restart journeys that log to W&B)."""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

from wandb.proto import wandb_internal_pb2 as pb

OFFLINE = ["--metrics.enable_wandb", "true", "--metrics.wandb_mode", "offline"]


def records(run: Path) -> list[pb.Record]:
    """The records of an offline run's `.wandb` file: W&B's log format (a 7-byte file header, then blocks of
    32 KiB holding records, each a 7-byte header of checksum, length and kind before its protobuf bytes)."""
    data = next(run.glob("*.wandb")).read_bytes()
    assert data[:4] == b":W&B"
    pos, block, out, part = 7, 32768, [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        part, pos = part + data[pos + 7:pos + 7 + n], pos + 7 + n
        if kind in (1, 4):  # a whole record, or the last piece of one
            record = pb.Record()
            record.ParseFromString(part)
            out.append(record)
            part = b""
    return out


def history(run: Path) -> dict[int, dict[str, float]]:
    """{step: {key: value}} of the scalars an offline run logged; each step once (asserted)."""
    out = {}
    for r in records(run):
        if r.WhichOneof("record_type") == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            assert int(items["_step"]) not in out, f"step {items['_step']} twice in {run}"
            out[int(items["_step"])] = {k: v for k, v in items.items() if not k.startswith("_")}
    return out


def console_losses(out: str) -> dict[int, str]:
    """{step: its loss as the console printed it last} (a step trained again prints again)."""
    return {int(m.group(1)): m.group(2) for m in re.finditer(r"\[rank0\] .* step +(\d+)/\d+ \| loss +([\d.]+)", out)}


def assert_one_history_as_printed(dump: Path, out: str, steps: int) -> None:
    """The dump's W&B folder holds one offline run (the others set aside), whose history holds steps 1..`steps`
    once each, with the losses the console printed last."""
    [run] = runs(dump)
    logged, printed = history(run), console_losses(out)
    assert sorted(logged) == list(range(1, steps + 1)) == sorted(printed)
    for step, loss in printed.items():
        assert f"{logged[step]['train/loss']:.4f}" == loss, (step, logged[step], loss)


def runs(dump: Path) -> list[Path]:
    return sorted((dump / "wandb").glob("offline-run-*"))
