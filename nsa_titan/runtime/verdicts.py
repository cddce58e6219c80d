"""The kernel checks' verdicts (`kernel_check`), kept so that a machine checks each kernel once: a JSON file in the
cache folder (`system.env.cache_dir`), an entry a key; `auto`'s timings (`kernel_timing`) beside them, a verdict's key
and the length timed. The key names the machine (the device's name and compute
capability, the NVIDIA driver's build, the CPU's instruction sets, the C++ compiler, torch's, Triton's and
flash-attn's versions) and the problem (every source the check runs, the check's own, the model's settings the
kernels see, the dtype, a fault injected): any change of them checks again. Only passes are kept: a failure (a
fault since gone, one node's trouble) is checked again at the next start. The file is shared by every process that
shares the cache folder, on one node or several: each change is made under a lock on it (`fcntl.lockf`, which NFS
honours) and renamed into place whole."""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import importlib.metadata
import json
import os
import platform
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ..config import Model
from ..system.env import cache_dir
from ..system.hostcpu import cpu_flags

FILE = "kernel_checks.json"
MODELS = Path(__file__).resolve().parent.parent / "models"
ATTENTION = MODELS / "attention"
FAMILY_SOURCES = {"torch": ("pytorch",), "flash": ("pytorch",), "cpp": ("cpp", "pytorch"), "triton": ("triton",),
                  "flex": ("flex", "pytorch", "triton")}
"""The folders of `families/` each family runs (cpp goes through the branch-by-branch path of pytorch/; flex's sel
through triton/'s kernels, or pytorch/'s op where those cannot run)."""
DECODE_SOURCES = {"cpp": ("cpp",), "triton": ("triton",)}
DRIVER_FILE = Path("/proc/driver/nvidia/version")
LOCK_WAIT_S = 60.0
"""How long a change of the verdicts waits for another process's lock before it is not kept (a verdict not kept is
checked again next time: nothing is wrong)."""


def path() -> Path:
    return cache_dir() / FILE


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def nvidia_driver() -> str | None:
    """The NVIDIA kernel module's version line (its build: the CUDA driver API version stays across builds)."""
    try:
        return DRIVER_FILE.read_text().splitlines()[0].strip()
    except (OSError, IndexError):
        return None


def machine(device: torch.device) -> dict[str, Any]:
    """What a verdict holds for: the device, its driver, the libraries."""
    found: dict[str, Any] = {"torch": torch.__version__, "triton": _version("triton"),
                             "flash_attn": _version("flash-attn"), "device_type": device.type}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        driver = getattr(torch._C, "_cuda_getDriverVersion", lambda: None)()
        found.update(device=props.name, capability=f"{props.major}.{props.minor}", driver=driver,
                     driver_build=nvidia_driver(), cuda=torch.version.cuda)
    else:
        found.update(device=platform.machine(), flags=hashlib.sha1(" ".join(sorted(cpu_flags())).encode()).hexdigest())
    return found


def source_hash(folders: tuple[str, ...], extra: tuple[Path, ...] = ()) -> str:
    """The hash of the attention rules, the families' shared files, `folders` of `families/` and `extra` files, and of
    the check itself."""
    here = Path(__file__).resolve().parent
    files = [*sorted(ATTENTION.glob("*.py")), *sorted((ATTENTION / "families").glob("*.py")),
             *(p for f in folders for p in sorted((ATTENTION / "families" / f).rglob("*"))
               if p.suffix in (".py", ".cpp", ".h")), *extra, here / "kernel_check.py", here / "fault_injection.py"]
    h = hashlib.sha1()
    for p in files:
        h.update(p.name.encode() + p.read_bytes())
    return h.hexdigest()


def _shapes(m: Model) -> dict[str, Any]:
    """What of the model config the attention op sees."""
    return {k: getattr(m, k) for k in ("n_heads", "n_kv_groups", "head_dim", "cmp_block_size", "cmp_stride",
                                       "sel_block_size", "sel_top_n", "window_size", "sel_score_grad",
                                       "sel_score_explore", "nsa_branch")}


def _layer(m: Model) -> dict[str, Any]:
    """What of the model config one decoding layer sees (all but its depth, vocabulary and kernel settings)."""
    skip = ("n_layers", "vocab_size", "kernels", "decode_kernels", "verify_kernels")
    return {k: v for k, v in dataclasses.asdict(m).items() if k not in skip}


def _compiler(name: str) -> str | None:
    """The C++ compiler of the `cpp` kernels (built with -march=native), None for the others."""
    if name != "cpp":
        return None
    from ..models.attention.families.cpp.cpu_attention import compiler
    return compiler()


def family_key(name: str, device: torch.device, dtype: torch.dtype, m: Model, documents: bool, parts: bool,
               fault: str = "") -> dict[str, Any]:
    return {"check": "family", "name": name, **machine(device), "compiler": _compiler(name), "dtype": str(dtype),
            **_shapes(m), "documents": documents, "parts": parts, "fault": fault,
            "sources": source_hash(FAMILY_SOURCES.get(name, ()), (MODELS / "transformer.py",))}


def dense_key(device: torch.device, dtype: torch.dtype, m: Model, documents: bool) -> dict[str, Any]:
    """Dense attention's timing (`kernel_timing`): the machine, the dtype, the heads and documents, the attention
    rules' sources (dense.py among them)."""
    return {"check": "dense", **machine(device), "dtype": str(dtype), "n_heads": m.n_heads,
            "n_kv_groups": m.n_kv_groups, "head_dim": m.head_dim, "documents": documents, "sources": source_hash(())}


def decode_key(name: str, device: torch.device, dtype: torch.dtype, m: Model, fault: str = "") -> dict[str, Any]:
    """The decode check runs the model's layer, forward and decoding step: every file of models/ is in its key."""
    return {"check": "decode", "name": name, **machine(device), "compiler": _compiler(name), "dtype": str(dtype),
            **_layer(m), "fault": fault, "sources": source_hash(DECODE_SOURCES.get(name, ()),
                                                                tuple(sorted(MODELS.glob("*.py"))))}


def _id(key: dict[str, Any]) -> str:
    return hashlib.sha1(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()


def _read() -> dict[str, Any]:
    try:
        found = json.loads(path().read_text())
        return found if isinstance(found, dict) else {}
    except (OSError, ValueError):  # none yet, or unreadable: checked again
        return {}


def get(key: dict[str, Any]) -> dict[str, Any] | None:
    """The passing verdict kept for `key` ({"passed", "line", "seconds"}; a timing's {"passed", "ms"}), or None (a
    failure kept by an earlier release is not taken either)."""
    entry = _read().get(_id(key))
    return entry if entry is not None and entry.get("passed") else None


@contextlib.contextmanager
def _locked() -> Iterator[bool]:
    """Inside: whether this process holds the verdicts' lock (`FILE.lock` beside it), waited on for `LOCK_WAIT_S`."""
    try:
        path().parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path().with_name(FILE + ".lock"), os.O_RDWR | os.O_CREAT, 0o666)
    except OSError:
        yield False
        return
    try:
        deadline = time.monotonic() + LOCK_WAIT_S
        while True:
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError:
                if time.monotonic() > deadline:
                    yield False
                    return
                time.sleep(0.05)
        yield True
    finally:
        os.close(fd)  # releases the lock


def put(key: dict[str, Any], entry: dict[str, Any]) -> None:
    """Keep the passing `entry` for `key`: read, changed and written whole under the lock, renamed into place (a
    folder that cannot be written, or a lock not had in time: not kept)."""
    with _locked() as held:
        if not held:
            return
        found = _read()
        found[_id(key)] = {**entry, "key": key}
        tmp = path().with_name(f"{FILE}.{socket.gethostname()}-{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps(found, indent=1, sort_keys=True, default=str))
            os.replace(tmp, path())
        except OSError:
            tmp.unlink(missing_ok=True)
