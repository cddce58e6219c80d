"""House rules of the code, checked: module sizes, process-wide effects owned and undone, fault
injection kept out of the production classes, the Trainer's fields declared in one place."""

from __future__ import annotations

import ast
import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from nsa_titan.checkpoint import CheckpointManager, TrainState
from nsa_titan.config import Checkpoint
from nsa_titan.stop import STOP_SIGNALS, StopRequest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "nsa_titan"
MODULES = sorted(PACKAGE.rglob("*.py"))


def test_no_module_is_longer_than_450_lines():
    long = {str(p.relative_to(ROOT)): n for p in MODULES if (n := len(p.read_text().splitlines())) > 450}
    assert not long, long


PROBE = """
import importlib, json, logging, os, pkgutil, signal, sys
import torch
mode = sys.argv[1]
if mode == "nsa_titan":  # every module of the package
    import nsa_titan
    for m in pkgutil.walk_packages(nsa_titan.__path__, "nsa_titan."):
        importlib.import_module(m.name)
else:  # the same third-party modules, in the same order, without nsa_titan
    for name in json.loads(sys.stdin.read()):
        try:
            importlib.import_module(name)
        except Exception:
            pass
loggers = {n: l.level for n, l in logging.Logger.manager.loggerDict.items() if isinstance(l, logging.Logger)}
print(json.dumps({"env": dict(os.environ), "root": logging.getLogger().level, "loggers": loggers,
                  "signals": {s.name: str(signal.getsignal(s)) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)},
                  "deterministic": torch.are_deterministic_algorithms_enabled(), "threads": torch.get_num_threads(),
                  "modules": [m for m in sys.modules if not m.startswith("nsa_titan")]}))
"""


@pytest.mark.multiprocess
def test_importing_nsa_titan_changes_no_process_setting():
    """Environment, log levels, signal handlers and torch's global switches after importing every
    module of nsa_titan equal those after importing only the libraries it imports."""
    def probe(mode: str, stdin: str = "") -> dict:
        done = subprocess.run([sys.executable, "-c", PROBE, mode], cwd=ROOT, input=stdin, capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    ours = probe("nsa_titan")
    theirs = probe("libraries", json.dumps(ours.pop("modules")))
    theirs.pop("modules")
    assert ours["loggers"] == {n: theirs["loggers"].get(n, 0) for n in ours["loggers"]}  # 0: NOTSET
    assert {k: v for k, v in ours.items() if k != "loggers"} == {k: v for k, v in theirs.items() if k != "loggers"}


def _writes_environ(node: ast.AST) -> bool:
    """`os.environ[...] = ...`, `os.environ.setdefault/update/pop(...)` or `os.putenv(...)`."""
    def is_environ(n: ast.AST) -> bool:
        return isinstance(n, ast.Attribute) and n.attr == "environ"
    if isinstance(node, ast.Assign):
        return any(isinstance(t, ast.Subscript) and is_environ(t.value) for t in node.targets)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        f = node.func
        return (is_environ(f.value) and f.attr in ("setdefault", "update", "pop")) or f.attr == "putenv"
    return False


def test_environment_variables_are_set_in_env_py_only():
    writers = [f"{p.relative_to(ROOT)}:{n.lineno}" for p in MODULES if p.name != "env.py"
               for n in ast.walk(ast.parse(p.read_text())) if _writes_environ(n)]
    assert not writers, writers
    assert any(_writes_environ(n) for n in ast.walk(ast.parse((PACKAGE / "env.py").read_text())))


def _imports(path: Path) -> set[str]:
    """The nsa_titan modules `path` imports, at module level or inside a function, as dotted names."""
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    found = set()
    for n in ast.walk(ast.parse(path.read_text())):
        if isinstance(n, ast.ImportFrom):
            base = package.rsplit(".", n.level - 1)[0] if n.level else ""
            module = ".".join(x for x in (base, n.module) if x) if n.level else n.module or ""
            found |= {module} | {f"{module}.{a.name}" for a in n.names}
        elif isinstance(n, ast.Import):
            found |= {a.name for a in n.names}
    return found


def test_the_checkpoint_package_imports_no_higher_layer():
    """checkpoint/ is below the trainer and the Hugging Face exporter: it never imports nsa_titan.hf (the
    end-of-run export is the trainer's), nor the trainer, nor the export command."""
    for path in sorted((PACKAGE / "checkpoint").glob("*.py")):
        higher = {m for m in _imports(path) if m.split(".")[:2] in (["nsa_titan", "hf"], ["nsa_titan", "train"],
                                                                     ["nsa_titan", "export"], ["nsa_titan", "extras"])}
        assert not higher, f"{path.relative_to(ROOT)} imports {sorted(higher)}"
    assert "nsa_titan.hf" in {m[:12] for m in _imports(PACKAGE / "export.py")}  # the check sees lazy imports


def test_the_attention_package_keeps_what_families_share_and_a_folder_per_family():
    """The top level holds the rules, documents, reference, routing and the dense baseline; each kernel family
    all of its code in a folder (the C++ sources with the C++ family); the branch-by-branch path chooses no
    family (before, `fast.py` and `families/` imported each other)."""
    attention = PACKAGE / "models" / "attention"
    assert sorted(p.name for p in attention.glob("*.py")) == ["__init__.py", "common.py", "dense.py", "documents.py",
                                                              "reference.py", "routing.py"]
    families = attention / "families"
    assert sorted(p.name for p in families.iterdir() if p.is_dir() and (p / "__init__.py").is_file()) == [
        "cpp", "pytorch", "triton"]
    assert (families / "cpp" / "csrc" / "cpu_attention.cpp").is_file()
    for path in (families / "pytorch").glob("*.py"):
        assert not any(m.startswith("nsa_titan.models.attention.families.choose") for m in _imports(path)), path


def test_production_classes_know_nothing_of_fault_injection():
    for path in [PACKAGE / "train.py", PACKAGE / "fault.py", PACKAGE / "failure.py", *(PACKAGE / "data").glob("*.py"),
                 *(PACKAGE / "checkpoint").glob("*.py")]:
        text = path.read_text()
        assert not any(key in text for key in ("fault_hang", "fault_nan", "kill_in_save", "fault_raise")), path
    assert "install_debug_hooks" in (PACKAGE / "train.py").read_text()  # the one place they are installed


def test_trainer_declares_every_field_in_init():
    tree = ast.parse((PACKAGE / "train.py").read_text())
    trainer = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Trainer")

    def assigned(fn: ast.FunctionDef) -> set[str]:
        names = set()
        for node in ast.walk(fn):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, (ast.AnnAssign, ast.AugAssign)) else []
            for t in targets:
                for e in (t.elts if isinstance(t, ast.Tuple) else [t]):
                    if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id == "self":
                        names.add(e.attr)
        return names

    methods = [n for n in trainer.body if isinstance(n, ast.FunctionDef)]
    in_init = assigned(next(m for m in methods if m.name == "__init__"))
    later = {f"{m.name}: self.{a}" for m in methods if m.name != "__init__" for a in assigned(m) - in_init}
    assert not later, later


def test_stop_request_restores_the_signal_handlers():
    before = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    stop = StopRequest()
    assert all(signal.getsignal(sig) != before[sig] for sig in STOP_SIGNALS)
    stop.close()
    assert {sig: signal.getsignal(sig) for sig in STOP_SIGNALS} == before


@pytest.mark.parametrize("enable", [False, True])
def test_a_checkpoint_group_exists_only_when_checkpointing(enable, tmp_path, monkeypatch):
    made = []
    real_new_group = dist.new_group
    monkeypatch.setattr(dist, "new_group", lambda *a, **k: made.append(k) or real_new_group(*a, **k))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = nn.Linear(2, 2)
        optimizer = torch.optim.AdamW(model.parameters())
        manager = CheckpointManager(Checkpoint(enable=enable), folder=tmp_path, config_toml="", model=model,
                                    optimizer=optimizer, lr_scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: 1),
                                    dataloader=[], train_state=TrainState(), dp_rank=0)
        assert (manager.pg is not None) == enable and len(made) == int(enable)
        manager.close()
    finally:
        dist.destroy_process_group()


def test_malloc_tuning_is_for_cpu_ranks_and_yields_to_the_user(monkeypatch):
    from nsa_titan import env

    for key in [*env.MALLOC_TUNING, "NSA_TITAN_MALLOC"]:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert env.malloc_tuning() == env.MALLOC_TUNING
    monkeypatch.setenv("NSA_TITAN_MALLOC", "default")
    assert env.malloc_tuning() == {}
    monkeypatch.delenv("NSA_TITAN_MALLOC")
    monkeypatch.setenv("MALLOC_TOP_PAD_", "4096")  # the user's own settings win, all of them
    assert env.malloc_tuning() == {}
    assert env.allocator_setup() == "glibc malloc, MALLOC_TOP_PAD_=4096"
    monkeypatch.delenv("MALLOC_TOP_PAD_")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert env.malloc_tuning() == {}  # GPU machines keep glibc's defaults
