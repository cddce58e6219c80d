"""Check every command the README and docs/ show, without running it.

    python scripts/check_docs.py [FILE.md ...]      # default: README.md, docs/**/*.md, tests/ and benchmarks/README.md

A command is a line of a ```bash block (continuation lines joined), or an inline code span of the text
that starts with `python`, `./run_train.sh` or `make`. For each one:
  - `make T`: T is a target of the Makefile;
  - `./run_train.sh ARGS` and `python -m nsa_titan.train ARGS`: ARGS parse as the trainer's config does
    (every `--section.key` is in the schema, with a valid value; `--config FILE` exists);
  - `python -m MODULE ARGS`, `python SCRIPT ARGS`, `torchrun ... -m MODULE ARGS`: the module or script
    exists, every `--flag` is in its `--help`, and overrides after a bare `--` parse as the trainer's;
  - any argument that names a path in the repository (data/, train_configs/, scripts/, benchmarks/,
    tests/, docs/) exists, and so does a script run directly.
A command whose line, or the comment line just above it, says `needs a GPU`, `needs GPUs`, `needs the
network` or `needs several nodes` is skipped. Exit 1, listing the problems, if any command fails.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from nsa_titan.config import ConfigError, parse_args  # noqa: E402

SKIP = re.compile(r"needs (a GPU|GPUs|the network|several nodes)")
REPO_PATH = re.compile(r"^(\./)?(data|train_configs|scripts|benchmarks|tests|docs)/")
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


_HELP_RUNS = ThreadPoolExecutor(os.cpu_count() or 1)
_HELP: dict[tuple[str, ...], Future[str | None]] = {}
_HELP_LOCK = threading.Lock()


def _run_help(program: tuple[str, ...]) -> str | None:
    proc = subprocess.run([sys.executable, *program, "--help"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    return proc.stdout + proc.stderr if proc.returncode == 0 else None


def help_text(*program: str) -> str | None:
    """`program --help`'s output, or None if it fails: each program's once, as many at a time as there are cores
    (each imports torch: seconds)."""
    with _HELP_LOCK:
        if program not in _HELP:
            _HELP[program] = _HELP_RUNS.submit(_run_help, program)
    return _HELP[program].result()


def trainer_problems(args: list[str]) -> list[str]:
    try:
        parse_args([a for a in args if a != "--print_config"])
    except ConfigError as e:
        return [f"the trainer's config does not parse: {e}"]
    return []


def program_problems(program: tuple[str, ...], args: list[str]) -> list[str]:
    """Flags of a module or script against its --help; trainer overrides after a bare `--`."""
    own, _, overrides = (args[:args.index("--")], "--", args[args.index("--") + 1:]) if "--" in args else (args, "", [])
    text = help_text(*program)
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


def problems_of(command: str) -> list[str]:
    """What is wrong with one command (empty: nothing)."""
    words = shlex.split(command, comments=True)
    while words and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]):  # NGPU=2 ...
        words.pop(0)
    if not words:
        return []
    program, args = words[0], words[1:]
    problems = [f"{a} does not exist" for a in args if REPO_PATH.match(a) and not (ROOT / a.split("=")[-1]).exists()]
    name = Path(program).name
    if program == "make":
        targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))
        return problems + [f"make has no target {t}" for t in args if t not in targets]
    if name == "run_train.sh":
        return problems + trainer_problems(args)
    if name in ("python", "python3", "torchrun"):
        if "-m" not in args:
            if name == "torchrun" or not args:
                return problems + ["no -m MODULE or script to check"]
            script, rest = args[0], args[1:]
            if not (ROOT / script).is_file():
                return problems + [f"script {script} does not exist"]
            return problems + program_problems((script,), rest)
        i = args.index("-m")
        module, rest = args[i + 1], args[i + 2:]
        if not module.startswith("nsa_titan"):
            return problems  # pytest, pip, ...: not ours
        if importlib.util.find_spec(module) is None:
            return problems + [f"module {module} does not exist"]
        if module == "nsa_titan.train":
            return problems + trainer_problems(rest)
        sub = (rest[0],) if rest and not rest[0].startswith("-") and module == "nsa_titan.checkpoint" else ()
        return problems + program_problems(("-m", module, *sub), rest[len(sub):])
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
    with ThreadPoolExecutor(min(len(found), 64) or 1) as pool:  # the commands wait on their programs' --help together
        problems = list(pool.map(problems_of, [command for _, _, command in found]))
    return [f"{f.relative_to(ROOT) if f.is_relative_to(ROOT) else f}:{n}: {command}: {p}"
            for (f, n, command), found_problems in zip(found, problems) for p in found_problems]


def default_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), ROOT / "tests" / "README.md",
            ROOT / "benchmarks" / "README.md"]


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    problems = check([Path(a).resolve() for a in args] or default_files())
    for p in problems:
        print(p)
    print(f"check_docs: {len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
