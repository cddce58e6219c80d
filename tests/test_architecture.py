"""House rules of the code, checked: the package's layout (entry points on top, no import circle, module
sizes), process-wide effects owned and undone, fault injection kept out of the production classes, the
Trainer's fields declared in one place."""

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
from nsa_titan.runtime.stop import StopRequest
from nsa_titan.system.signals import STOP_SIGNALS

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "nsa_titan"
MODULES = sorted(PACKAGE.rglob("*.py"))


ENTRY_POINTS = ["evaluate.py", "export.py", "generate.py", "launch.py", "plan.py", "train.py"]
"""The commands users run as `python -m nsa_titan.NAME`, the only modules at the package's top."""
PACKAGES = ["checkpoint", "config", "data", "distributed", "hf", "models", "observe", "optim", "runtime", "system"]


def test_no_module_is_longer_than_450_lines():
    long = {str(p.relative_to(ROOT)): n for p in MODULES if (n := len(p.read_text().splitlines())) > 450}
    assert not long, long


def test_the_top_level_holds_only_entry_points_and_packages():
    """`nsa_titan/` holds the entry points and the packages; each entry point runs as `python -m`, and every
    folder of Python code is a package (with its own `__init__.py`)."""
    assert sorted(p.name for p in PACKAGE.glob("*.py")) == ["__init__.py", *ENTRY_POINTS]
    assert sorted(p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__") == PACKAGES
    for name in ENTRY_POINTS:
        assert 'if __name__ == "__main__":' in (PACKAGE / name).read_text(), name
    folders = {p.parent for p in MODULES}
    assert all((f / "__init__.py").is_file() for f in folders), sorted(str(f) for f in folders
                                                                      if not (f / "__init__.py").is_file())


def import_graph(package: Path) -> dict[str, set[str]]:
    """Module -> the modules of `package` it imports (dotted names; a package is its `__init__`): imports at
    module level, inside functions and under TYPE_CHECKING alike. `from P import name` is an import of the
    module P.name where that is a module, else of P."""
    root = package.parent
    modules = {}
    for path in package.rglob("*.py"):
        parts = path.relative_to(root).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path

    def owner(name: str) -> str | None:  # the module that defines `name` (a module, or a name in one)
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        here = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        targets: set[str] = set()
        for n in ast.walk(ast.parse(path.read_text())):
            if isinstance(n, ast.Import):
                targets |= {a.name for a in n.names}
            elif isinstance(n, ast.ImportFrom):
                base = ".".join([*here[:len(here) - n.level + 1], *([n.module] if n.module else [])]) if n.level \
                    else n.module or ""
                targets |= {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in n.names}
        graph[module] = {m for t in targets if (m := owner(t)) and m != module}
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every group of modules that import each other, directly or through others (Tarjan's strongly
    connected components of more than one module)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = stack[stack.index(v):]
            del stack[stack.index(v):]
            if len(group) > 1:
                circles.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return circles


def test_no_import_circle_inside_the_package():
    graph = import_graph(PACKAGE)
    assert "nsa_titan.models.attention.spec" in graph["nsa_titan.models.attention.documents"]  # the graph is read
    assert "nsa_titan.system.cli" in graph["nsa_titan.train"]
    assert import_circles(graph) == []


LAYERS = [["system"], ["config"], ["distributed", "optim"], ["models"], ["data"], ["checkpoint"], ["runtime"],
          ["hf", "observe"]]
"""The packages from the bottom up (docs/architecture.md): each imports only packages of the layers below it;
the entry points, above them all, import any."""


def test_packages_import_only_the_layers_below():
    layer = {name: i for i, names in enumerate(LAYERS) for name in names}
    assert sorted(layer) == sorted(set(PACKAGES) - {"__pycache__"})
    upward = set()
    for module, targets in import_graph(PACKAGE).items():
        here = module.split(".")[1] if "." in module else None
        for target in targets:
            there = target.split(".")[1] if "." in target else None
            if here in layer and there is not None and here != there and not layer.get(there, len(LAYERS)) < layer[here]:
                upward.add(f"{module} -> {target}")
    assert not upward, sorted(upward)


def test_an_import_circle_is_found(tmp_path):
    """A circle through a lazy import and a TYPE_CHECKING import is caught; a package importing its children is
    not one."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .a import A\n")
    (pkg / "a.py").write_text("A = 1\n\ndef f():\n    from .sub import b\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..a import A\n")
    assert import_circles(import_graph(pkg)) == [["pkg.a", "pkg.sub.b"]]
    (pkg / "sub" / "b.py").write_text("import os\n")
    assert import_circles(import_graph(pkg)) == []


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


ON_USE = {"datasets": "text sources", "pandas": "text sources (under datasets)", "matplotlib": "plots",
          "transformers": "the Hugging Face export", "lm_eval": "lm-evaluation-harness tasks", "wandb": "W&B"}
"""Libraries a rank, `evaluate` and `generate` import only when a run uses what needs them: each costs every
process that starts without it up to a second (datasets with pandas: 0.7 s of a rank's 3.4 s of imports)."""


@pytest.mark.multiprocess
def test_entry_points_import_heavy_libraries_only_on_use():
    """Importing the training, evaluation and generation entry points (a synthetic-data rank's imports) leaves out
    every library of ON_USE."""
    probe = ("import json, sys, nsa_titan.train, nsa_titan.evaluate, nsa_titan.generate; "
             "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))")
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    imported = set(json.loads(done.stdout.strip().splitlines()[-1]))
    assert {name: why for name, why in ON_USE.items() if name in imported} == {}


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
    writers = [f"{p.relative_to(ROOT)}:{n.lineno}" for p in MODULES if p != PACKAGE / "system" / "env.py"
               for n in ast.walk(ast.parse(p.read_text())) if _writes_environ(n)]
    assert not writers, writers
    assert any(_writes_environ(n) for n in ast.walk(ast.parse((PACKAGE / "system" / "env.py").read_text())))


def test_the_checkpoint_package_needs_no_extra_and_no_entry_point():
    """checkpoint/ is below the trainer and the Hugging Face exporter (the layers): it never imports nsa_titan.hf (the
    end-of-run export is the trainer's), nor an entry point, nor the optional extras."""
    graph = import_graph(PACKAGE)
    for module, targets in graph.items():
        if module.startswith("nsa_titan.checkpoint"):
            bad = {t for t in targets if t.startswith(("nsa_titan.hf", "nsa_titan.system.extras"))
                   or t.count(".") == 1 and t.split(".")[1] in {n.removesuffix(".py") for n in ENTRY_POINTS}}
            assert not bad, f"{module} imports {sorted(bad)}"
    assert "nsa_titan.hf.export" in graph["nsa_titan.export"]  # the graph sees lazy imports


def test_the_attention_package_keeps_what_families_share_and_a_folder_per_family():
    """The top level holds the spec, rules, documents, reference, routing and the dense baseline; each kernel family
    all of its code in a folder (the C++ sources with the C++ family); the branch-by-branch path chooses no
    family (before, `fast.py` and `families/` imported each other)."""
    attention = PACKAGE / "models" / "attention"
    assert sorted(p.name for p in attention.glob("*.py")) == ["__init__.py", "common.py", "dense.py", "documents.py",
                                                              "reference.py", "routing.py", "spec.py"]
    families = attention / "families"
    assert sorted(p.name for p in families.iterdir() if p.is_dir() and (p / "__init__.py").is_file()) == [
        "cpp", "flex", "pytorch", "triton"]
    assert (families / "cpp" / "csrc" / "cpu_attention.cpp").is_file()
    graph = import_graph(PACKAGE)
    pytorch = {m: t for m, t in graph.items() if m.startswith("nsa_titan.models.attention.families.pytorch")}
    assert len(pytorch) >= 5
    assert not any("nsa_titan.models.attention.families.choose" in t for t in pytorch.values()), pytorch


def test_production_classes_know_nothing_of_fault_injection():
    runtime = PACKAGE / "runtime"
    for path in [PACKAGE / "train.py", runtime / "watchdog.py", runtime / "failure.py", *(PACKAGE / "data").glob("*.py"),
                 *(PACKAGE / "checkpoint").glob("*.py")]:
        text = path.read_text()
        assert not any(key in text for key in ("fault_hang", "fault_nan", "kill_in_save", "fault_raise")), path
    assert "install_faults" in (PACKAGE / "train.py").read_text()  # the one place they are installed


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
    from nsa_titan.system import env

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
