"""The kernel checks' verdicts (`kernel_check`), kept so that a machine checks each kernel once: a JSON file in the
cache folder (`system.env.cache_dir`), an entry a key. The key names the machine (the device's name and compute
capability, the driver, the CPU's instruction sets, torch's and Triton's versions) and the problem (the kernels'
sources and the check's, the model's shapes, the dtype, a fault injected): any change of them checks again."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
from pathlib import Path
from typing import Any

import torch

from ..config import Model
from ..system.env import cache_dir
from ..system.hostcpu import cpu_flags

FILE = "kernel_checks.json"
MODELS = Path(__file__).resolve().parent.parent / "models"
ATTENTION = MODELS / "attention"
FAMILY_SOURCES = {"torch": ("pytorch",), "flash": ("pytorch",), "cpp": ("cpp", "pytorch"), "triton": ("triton",)}
"""The folders of `families/` each family runs (cpp goes through the branch-by-branch path of pytorch/)."""
DECODE_SOURCES = {"cpp": ("cpp",), "triton": ("triton",)}


def path() -> Path:
    return cache_dir() / FILE


def machine(device: torch.device) -> dict[str, Any]:
    """What a verdict holds for: the device, its driver, the libraries."""
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    found: dict[str, Any] = {"torch": torch.__version__, "triton": triton_version, "device_type": device.type}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        driver = getattr(torch._C, "_cuda_getDriverVersion", lambda: None)()
        found.update(device=props.name, capability=f"{props.major}.{props.minor}", driver=driver,
                     cuda=torch.version.cuda)
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
                                       "sel_block_size", "sel_top_n", "window_size", "sel_score_grad")}


def _layer(m: Model) -> dict[str, Any]:
    """What of the model config one decoding layer sees (all but its depth, vocabulary and kernel settings)."""
    skip = ("n_layers", "vocab_size", "kernels", "decode_kernels", "verify_kernels")
    return {k: v for k, v in dataclasses.asdict(m).items() if k not in skip}


def family_key(name: str, device: torch.device, dtype: torch.dtype, m: Model, documents: bool, parts: bool,
               fault: str = "") -> dict[str, Any]:
    return {"check": "family", "name": name, **machine(device), "dtype": str(dtype), **_shapes(m),
            "documents": documents, "parts": parts, "fault": fault,
            "sources": source_hash(FAMILY_SOURCES.get(name, ()))}


def decode_key(name: str, device: torch.device, dtype: torch.dtype, m: Model, fault: str = "") -> dict[str, Any]:
    extra = (MODELS / "decode.py", MODELS / "transformer.py")
    return {"check": "decode", "name": name, **machine(device), "dtype": str(dtype), **_layer(m), "fault": fault,
            "sources": source_hash(DECODE_SOURCES.get(name, ()), extra)}


def _id(key: dict[str, Any]) -> str:
    return hashlib.sha1(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()


def _read() -> dict[str, Any]:
    try:
        found = json.loads(path().read_text())
        return found if isinstance(found, dict) else {}
    except (OSError, ValueError):  # none yet, or unreadable: checked again
        return {}


def get(key: dict[str, Any]) -> dict[str, Any] | None:
    """The verdict kept for `key` ({"passed", "line", "seconds"}), or None."""
    return _read().get(_id(key))


def put(key: dict[str, Any], entry: dict[str, Any]) -> None:
    """Keep `entry` for `key` (written whole and renamed into place; a folder that cannot be written: not kept)."""
    found = _read()
    found[_id(key)] = {**entry, "key": key}
    try:
        path().parent.mkdir(parents=True, exist_ok=True)
        tmp = path().with_name(f"{FILE}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(found, indent=1, sort_keys=True, default=str))
        os.replace(tmp, path())
    except OSError:
        pass
