"""Check every command the README and docs/ show, without running it.

    python scripts/check_docs.py [FILE.md ...]      # default: README.md, docs/**/*.md, tests/ and benchmarks/README.md

A command is a line of a ```bash block (continuation lines joined), or an inline code span of the text
that starts with `python`, `./run_train.sh` or `make`. For each one:
  - `make T`: T is a target of the Makefile;
  - `./run_train.sh ARGS` and `python -m nsa_titan.train ARGS`: ARGS parse as the trainer's config does
    (every `--section.key` is in the schema, with a valid value; `--config FILE` exists) and pass its validation
    at the command's world size (`NGPU` x `NNODES` before `run_train.sh`, torchrun's `--nproc_per_node` x
    `--nnodes`; 1 if none);
  - `python -m MODULE ARGS`, `python SCRIPT ARGS`, `torchrun ... -m MODULE ARGS`: the module or script
    exists, every `--flag` is in its `--help`, and overrides after a bare `--` parse as the trainer's;
  - any argument that names a path in the repository (data/, train_configs/, scripts/, benchmarks/,
    tests/, docs/) exists, and so does a script run directly.
A command whose line, or the comment line just above it, says `needs a GPU`, `needs GPUs`, `needs the
network` or `needs several nodes` is skipped. Exit 1, listing the problems, if any command fails.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import re
import runpy
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from nsa_titan.config import ConfigError, parse_args  # noqa: E402
from nsa_titan.config.validation import validate  # noqa: E402

SKIP = re.compile(r"needs (a GPU|GPUs|the network|several nodes)")
REPO_PATH = re.compile(r"^(\./)?(data|train_configs|scripts|benchmarks|tests|docs)/")
Helps = Callable[[tuple[str, ...]], str | None]
"""A program's --help output, or None if it fails."""
PASS_THROUGH = {"pip", "tensorboard", "nvidia-smi"}
"""Programs whose arguments are not this project's to check."""


def commands(markdown: str) -> list[tuple[int, str, bool]]:
    """(line number, command, skipped) of every command in the ```bash blocks of `markdown`."""
    found, block, pending, start, skip_next = [], False, "", 0, False
    for n, line in enumerate(markdown.splitlines(), 1):
        text = line.strip()
        if text.startswith("```"):
            block, pending = text == "```bash", ""
            continue
        if not block or (not text and not pending):
            continue
        if text.startswith("#") and not pending:
            skip_next = bool(SKIP.search(text))
            continue
        pending, start = (pending + " " + text if pending else text), (start if pending else n)
        if pending.endswith("\\"):
            pending = pending[:-1]
            continue
        found.append((start, pending, skip_next or bool(SKIP.search(pending))))
        pending, skip_next = "", False
    for n, line in enumerate(markdown.splitlines(), 1):  # and commands in the text: `python ...`, `./run_train.sh ...`
        found += [(n, span, bool(SKIP.search(line))) for span in re.findall(r"`((?:python3? |\./run_train\.sh |make )[^`]+)`", line)]
    return found


def help_texts(programs: set[tuple[str, ...]]) -> dict[tuple[str, ...], str | None]:
    """Each program's `--help` output (None if it fails), all run in turn in one child interpreter: each imports
    torch, seconds that one child pays once (runpy runs a module or script as `python -m`/`python` would)."""
    if not programs:
        return {}
    order = sorted(programs)
    proc = subprocess.run([sys.executable, __file__, "--help-of", json.dumps(order)], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"the child running the programs' --help failed:\n{proc.stderr[-3000:]}")
    return dict(zip(order, json.loads(proc.stdout.splitlines()[-1])))


def _help_of(program: list[str]) -> str | None:
    """In the child: one program's `--help` output, or None if it fails."""
    out, module = io.StringIO(), program[0] == "-m"
    target, rest = (program[1], program[2:]) if module else (str(ROOT / program[0]), program[1:])
    sys.argv = [target, *rest, "--help"]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            if module:
                runpy.run_module(target, run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(target, run_name="__main__")
    except SystemExit as e:
        return out.getvalue() if e.code in (0, None) else None
    except Exception:  # noqa: BLE001 - a program that cannot show its --help is a problem of the doc's command
        return None
    return out.getvalue()


def trainer_problems(args: list[str], world_size: int | None = None) -> list[str]:
    """The trainer's config of `args` parsed, and with `world_size` validated as a run of that many ranks."""
    try:
        cfg, _ = parse_args([a for a in args if a != "--print_config"])
    except ConfigError as e:
        return [f"the trainer's config does not parse: {e}"]
    try:
        if world_size is not None:
            validate(cfg, world_size)
    except ConfigError as e:
        return [f"the trainer refuses the config at {world_size} rank(s): {e}"]
    return []


def _ranks(env: dict[str, str], args: list[str]) -> int:
    """The world size a launch asks for: `NGPU` x `NNODES`, or torchrun's `--nproc_per_node` x `--nnodes`."""
    flag = lambda name: next((args[i + 1] for i, a in enumerate(args[:-1]) if a == name), None)  # noqa: E731
    per_node = flag("--nproc_per_node") or env.get("NGPU", "1")
    nodes = flag("--nnodes") or env.get("NNODES", "1")
    return int(per_node) * int(nodes) if per_node.isdigit() and nodes.isdigit() else 1


def program_problems(program: tuple[str, ...], args: list[str], helps: Helps) -> list[str]:
    """Flags of a module or script against its --help; trainer overrides after a bare `--`."""
    own, _, overrides = (args[:args.index("--")], "--", args[args.index("--") + 1:]) if "--" in args else (args, "", [])
    text = helps(program)
    if text is None:
        return [f"`{' '.join(program)} --help` fails"]
    keys = []  # `--section.key value`: the config's overrides, as the planner and evaluate take them
    for i, a in enumerate(own):
        if a.startswith("--") and "." in a.split("=")[0]:
            keys += [a] if "=" in a or i + 1 == len(own) or own[i + 1].startswith("--") else [a, own[i + 1]]
    flags = [a.split("=")[0] for a in own if a.startswith("--") and "." not in a.split("=")[0]]
    problems = [f"{flag} is not an option of {' '.join(program)}" for flag in flags
                if not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text)]
    return problems + (trainer_problems(keys + overrides) if keys or overrides else [])


def problems_of(command: str, helps: Helps) -> list[str]:
    """What is wrong with one command (empty: nothing); `helps` gives a program's --help output."""
    words, env = shlex.split(command, comments=True), {}
    while words and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]):  # NGPU=2 ...
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    if not words:
        return []
    program, args = words[0], words[1:]
    problems = [f"{a} does not exist" for a in args if REPO_PATH.match(a) and not (ROOT / a.split("=")[-1]).exists()]
    name = Path(program).name
    if program == "make":
        targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))
        return problems + [f"make has no target {t}" for t in args if t not in targets]
    if name == "run_train.sh":
        return problems + trainer_problems(args, _ranks(env, args))
    if name in ("python", "python3", "torchrun"):
        if "-m" not in args:
            if name == "torchrun" or not args:
                return problems + ["no -m MODULE or script to check"]
            script, rest = args[0], args[1:]
            if not (ROOT / script).is_file():
                return problems + [f"script {script} does not exist"]
            return problems + program_problems((script,), rest, helps)
        i = args.index("-m")
        module, rest = args[i + 1], args[i + 2:]
        if not module.startswith("nsa_titan"):
            return problems  # pytest, pip, ...: not ours
        if importlib.util.find_spec(module) is None:
            return problems + [f"module {module} does not exist"]
        if module == "nsa_titan.train":
            return problems + trainer_problems(rest, _ranks(env, args[:i]))
        sub = (rest[0],) if rest and not rest[0].startswith("-") and module == "nsa_titan.checkpoint" else ()
        return problems + program_problems(("-m", module, *sub), rest[len(sub):], helps)
    if name in PASS_THROUGH:
        return problems
    if REPO_PATH.match(program) or program.startswith("./"):
        return problems + ([] if (ROOT / program).is_file() else [f"{program} does not exist"])
    if name == "sbatch":
        return problems
    return problems + [f"unknown program {program}: check it here or mark it as needing a GPU, the network or nodes"]


def check(files: list[Path]) -> list[str]:
    """Every problem of every command in `files`, as `file:line: command: problem`."""
    found = [(f, n, command) for f in files for n, command, skipped in commands(f.read_text()) if not skipped]
    wanted: set[tuple[str, ...]] = set()  # a dry pass names the programs whose --help the commands need
    for _, _, command in found:
        problems_of(command, lambda program: wanted.add(program) or "")
    texts = help_texts(wanted)
    problems = [problems_of(command, texts.__getitem__) for _, _, command in found]
    return [f"{f.relative_to(ROOT) if f.is_relative_to(ROOT) else f}:{n}: {command}: {p}"
            for (f, n, command), found_problems in zip(found, problems) for p in found_problems]


def default_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), ROOT / "tests" / "README.md",
            ROOT / "benchmarks" / "README.md"]


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["--help-of"]:  # the child of help_texts: a JSON list of the outputs, on the last line
        texts = [_help_of(program) for program in json.loads(args[1])]
        sys.stdout = sys.__stdout__
        print(json.dumps(texts))
        return 0
    problems = check([Path(a).resolve() for a in args] or default_files())
    for p in problems:
        print(p)
    print(f"check_docs: {len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
