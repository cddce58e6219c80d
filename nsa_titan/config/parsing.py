"""Parsing: a TOML file plus `--section.key value` overrides into a `JobConfig`, and back to TOML.

Structural checks only (names, types, choices), each a `ConfigError` naming the key, the bad
value and what is allowed; `validation.py` checks the combination.
"""

from __future__ import annotations

import dataclasses
import sys
import typing
from pathlib import Path
from typing import Any, Literal

import tomli

from .schema import DEFAULT_CONFIG, REPO_ROOT, ConfigError, JobConfig, Source

TABLES = {list[Source]: Source}
"""Keys whose value is a TOML array of tables (`[[data.sources]]`), and the dataclass of each table."""

USAGE = """usage: run_train.sh [--config FILE] [--print_config] [--section.key VALUE | --section.key=VALUE ...]

Reads FILE (default train_configs/debug_model.toml), then applies the overrides, which win
over the file. Booleans take true/false (a bare --section.key means true).
--print_config prints the fully resolved config as TOML and exits.
"""


def _toml_value(v: Any) -> str:
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return repr(v)


def _field_types(section_cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(section_cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(section_cls)}


def _allowed(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if tp in (list[str], list[int]):
        return f"a list of {'strings' if tp == list[str] else 'integers'} (on the command line: comma-separated)"
    if tp in TABLES:
        return "an array of tables"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}[tp]


def _coerce(where: str, tp: Any, value: Any, from_cli: bool) -> Any:
    """Convert `value` (TOML-typed, or a CLI string) to `tp`, or raise a ConfigError."""
    bad = ConfigError(f"{where} = {value!r} is invalid: expected {_allowed(tp)}")
    if typing.get_origin(tp) is Literal:
        if value not in typing.get_args(tp):
            raise bad
        return value
    if tp is bool:
        if from_cli and isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        if isinstance(value, bool):
            return value
        raise bad
    if tp in (int, float):
        if from_cli and isinstance(value, str):
            try:
                return tp(value)
            except ValueError:
                raise bad from None
        accepted = (int,) if tp is int else (int, float)  # TOML `lr = 1` is a fine float
        if isinstance(value, accepted) and not isinstance(value, bool):
            return tp(value)
        raise bad
    if tp == list[str]:
        if from_cli and isinstance(value, str):
            return [v for v in value.split(",") if v]
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return list(value)
        raise bad
    if tp == list[int]:
        if from_cli and isinstance(value, str):
            try:
                return [int(v) for v in value.split(",") if v]
            except ValueError:
                raise bad from None
        if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            return list(value)
        raise bad
    if tp is str:
        if isinstance(value, str):
            return value
        raise bad
    if tp in TABLES:
        return _tables(where, TABLES[tp], value, from_cli)
    raise TypeError(f"unsupported config field type {tp} at {where}")


def _tables(where: str, cls: type, value: Any, from_cli: bool) -> list[Any]:
    """A TOML array of tables as a list of `cls`, each key checked as a section's keys are."""
    if from_cli:
        raise ConfigError(f"{where} is an array of tables: set it in the TOML file ([[...]] tables, docs/data.md), "
                          f"not on the command line")
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        raise ConfigError(f"{where} must be an array of tables ([[...]] in TOML)")
    types_ = _field_types(cls)
    tables = []
    for i, table in enumerate(value):
        item = cls()
        for key, v in table.items():
            if key not in types_:
                raise ConfigError(f"{where}[{i}]: unknown key '{key}'; known keys: {', '.join(types_)}")
            setattr(item, key, _coerce(f"{where}[{i}] {key}", types_[key], v, from_cli=False))
        tables.append(item)
    return tables


def _lookup(cfg: JobConfig, section: str, key: str, origin: str) -> tuple[Any, Any]:
    """The section object and the declared type of `section.key`, or a ConfigError."""
    sections = {f.name for f in dataclasses.fields(cfg)}
    if section not in sections:
        raise ConfigError(
            f"{origin}: unknown section [{section}]; known sections: {', '.join(sorted(sections))}"
        )
    sec = getattr(cfg, section)
    types_ = _field_types(type(sec))
    if key not in types_:
        raise ConfigError(
            f"{origin}: unknown key '{key}' in [{section}]; known keys: {', '.join(types_)}"
        )
    return sec, types_[key]


def _set(cfg: JobConfig, section: str, key: str, value: Any, origin: str, from_cli: bool) -> None:
    sec, tp = _lookup(cfg, section, key, origin)
    if value is None:  # a bare command-line flag: allowed for booleans only
        if tp is not bool:
            raise ConfigError(f"{origin} needs a value ({_allowed(tp)})")
        value = "true"
    setattr(sec, key, _coerce(f"{origin}: [{section}] {key}", tp, value, from_cli))


def _load_toml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(
            f"config file '{path}' not found; pass an existing file with --config "
            f"(see train_configs/ for examples)"
        )
    try:
        with path.open("rb") as f:
            return tomli.load(f)
    except tomli.TOMLDecodeError as e:
        raise ConfigError(f"config file '{path}' is not valid TOML: {e}") from None


def _split_overrides(args: list[str]) -> tuple[Path, bool, list[tuple[str, str | None]]]:
    """Split argv into (config path, print_config, [(dotted key, raw value or None)])."""
    config_path = DEFAULT_CONFIG
    print_config = False
    overrides: list[tuple[str, str | None]] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if arg in ("-h", "--help"):
            print(USAGE)
            sys.exit(0)
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument '{arg}'; overrides look like --section.key value\n{USAGE}")
        name, eq, value = arg[2:].partition("=")
        has_value = bool(eq)
        if not has_value and i + 1 < len(args) and not args[i + 1].startswith("--"):
            value, has_value = args[i + 1], True
            i += 1
        i += 1
        if name in ("config", "job.config_file"):
            if not has_value:
                raise ConfigError("--config needs a file path, e.g. --config train_configs/m7c.toml")
            config_path = Path(resolve_path(value))  # from the working directory, else the repository
        elif name == "print_config":
            print_config = value.lower() != "false" if has_value else True
        else:
            overrides.append((name, value if has_value else None))
    return config_path, print_config, overrides


def parse_args(argv: list[str] | None = None) -> tuple[JobConfig, bool]:
    """Build the JobConfig from `--config FILE` and overrides; returns (config, print_config).

    Structural checks only (names, types, choices); `validate` checks the combination.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    config_path, print_config, overrides = _split_overrides(args)
    cfg = JobConfig()
    for section, table in _load_toml(config_path).items():
        if not isinstance(table, dict):
            raise ConfigError(f"{config_path}: top-level key '{section}' must be a [section] table")
        for key, value in table.items():
            _set(cfg, section, key, value, str(config_path), from_cli=False)
    for name, value in overrides:
        section, dot, key = name.partition(".")
        if not dot:
            raise ConfigError(f"override '--{name}' must be --section.key (e.g. --training.steps 10)")
        _set(cfg, section, key, value, f"override --{name}", from_cli=True)
    return cfg, print_config


def resolve_path(path: str) -> str:
    """`path` as given if it exists (or is empty or absolute), else relative to the repository."""
    if not path or Path(path).is_absolute() or Path(path).exists():
        return path
    in_repo = REPO_ROOT / path
    return str(in_repo) if in_repo.exists() else path


def to_toml(cfg: JobConfig) -> str:
    """The config as a TOML file that `parse_args` reads back to an equal config."""
    lines: list[str] = []
    for section in dataclasses.fields(cfg):
        sec = getattr(cfg, section.name)
        lines.append(f"[{section.name}]")
        tables = [f for f in dataclasses.fields(sec) if _field_types(type(sec))[f.name] in TABLES]
        for f in dataclasses.fields(sec):
            if f not in tables:
                lines.append(f"{f.name} = {_toml_value(getattr(sec, f.name))}")
        for f in tables:  # after the section's keys: [[section.key]] tables end it
            for item in getattr(sec, f.name):
                lines.append(f"[[{section.name}.{f.name}]]")
                lines += [f"{g.name} = {_toml_value(getattr(item, g.name))}" for g in dataclasses.fields(item)]
        lines.append("")
    return "\n".join(lines)
