"""The documentation: page sizes, relative links, the configuration reference in sync with the schema,
every command the pages show checked (scripts/check_docs.py), and no internal labels in the text."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import check_docs  # noqa: E402
import config_reference  # noqa: E402
from conftest import Command, background  # noqa: E402

BACKGROUND = {"check_docs": Command([sys.executable, str(ROOT / "scripts" / "check_docs.py")])}
LIMITS = {"README.md": 12_000, "benchmarks/README.md": 15_000}
PAGE_LIMIT = 10_000


def tracked(pattern: str = "*") -> list[Path]:
    """The repository's files that git tracks or would add (not ignored), matching `pattern`."""
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", pattern], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    return [ROOT / p for p in out.splitlines() if (ROOT / p).is_file()]


def test_pages_are_short():
    for name, limit in LIMITS.items():
        assert (ROOT / name).stat().st_size <= limit, f"{name} is over {limit:,} bytes"
    pages = sorted((ROOT / "docs").rglob("*.md"))
    assert len(pages) >= 12
    assert [p.name for p in pages if p.stat().st_size > PAGE_LIMIT] == []


def slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(md: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", md.read_text(), flags=re.S)
    return {slug(h) for h in re.findall(r"^#{1,6} (.+)$", text, re.M)}


def broken_links(md: Path, root: Path = ROOT) -> list[str]:
    """The relative links of `md` whose file or heading does not exist, named relative to `root`."""
    text = re.sub(r"```.*?```", "", md.read_text(), flags=re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    bad = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"^[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (md.parent / path).resolve() if path else md
        if not dest.exists():
            bad.append(f"{md.relative_to(root)}: {target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{md.relative_to(root)}: {target} (no such heading)")
    return bad


def test_every_relative_link_resolves():
    files = tracked("*.md")
    assert len(files) > 40
    assert [b for md in files for b in broken_links(md)] == []


def test_a_broken_link_is_found(tmp_path):
    md = tmp_path / "page.md"
    md.write_text("# Title\n\n[ok](#title), [gone](nowhere.md), [no heading](#elsewhere)\n")
    assert broken_links(md, tmp_path) == ["page.md: nowhere.md (no such file)", "page.md: #elsewhere (no such heading)"]


def test_the_configuration_reference_matches_the_schema():
    pages = config_reference.render()
    on_disk = {p.name: p.read_text() for p in (ROOT / "docs" / "config").glob("*.md")}
    assert on_disk == pages, "docs/config is out of date: run python scripts/config_reference.py"


def test_a_key_added_to_the_schema_fails_the_reference(tmp_path):
    schema = (ROOT / "nsa_titan" / "config" / "schema.py").read_text()
    anchor = '    content_hashes: bool = True\n'
    assert anchor in schema
    undocumented = tmp_path / "schema.py"
    undocumented.write_text(schema.replace(anchor, "    new_key: int = 3\n" + anchor))
    with pytest.raises(ValueError, match=r"\[checkpoint\] new_key has no docstring"):
        config_reference.render(undocumented)
    documented = tmp_path / "schema2.py"
    documented.write_text(schema.replace(anchor, '    new_key: int = 3\n    """A new key."""\n' + anchor))
    assert config_reference.render(documented)["checkpoint.md"] != config_reference.render()["checkpoint.md"]


@pytest.mark.multiprocess
@pytest.mark.background
def test_every_command_in_the_docs_checks_out():
    found = [c for f in check_docs.default_files() for c in check_docs.commands(f.read_text())]
    assert len([c for c in found if not c[2]]) >= 30
    checked = background("check_docs", BACKGROUND)  # check_docs.check over the default files
    assert checked.returncode == 0 and checked.stdout.endswith("check_docs: 0 problem(s)\n"), checked.stdout[-3000:]


@pytest.mark.multiprocess
@pytest.mark.parametrize("command,problem", [
    ("./run_train.sh --training.stepz 10", "unknown key 'stepz' in [training]"),
    ("./run_train.sh --config train_configs/nope.toml", "train_configs/nope.toml does not exist"),
    ("python -m nsa_titan.nope CKPT", "module nsa_titan.nope does not exist"),
    ("python benchmarks/kernels/attention_speed.py --nope 1", "--nope is not an option of benchmarks/kernels/attention_speed.py"),
    ("python -m nsa_titan.export CKPT --data.path data/nowhere", "data/nowhere does not exist"),
    ("make tests", "make has no target tests"),
    ("./run_train.sh --config train_configs/recall.toml --training.seq_len 256",  # parses; the trainer refuses it
     "the trainer refuses the config at 1 rank(s): [eval] recall_distances = [64, 512, 960]"),
    ("NGPU=3 ./run_train.sh --parallelism.data_parallel_replicate_degree 2",
     "the trainer refuses the config at 3 rank(s): [parallelism] data_parallel_replicate_degree = 2"),
])
def test_a_planted_bad_command_fails_the_check(tmp_path, command, problem):
    md = tmp_path / "page.md"
    md.write_text(f"# A page\n\n```bash\n./run_train.sh --training.steps 10\n{command}\n"
                  f"{command}   # needs a GPU: skipped\n```\n")
    problems = check_docs.check([md])  # the bad line alone: not the good one, not the one marked as skipped
    assert problems and all(p.startswith(f"{md}:5: ") for p in problems), problems
    assert any(problem in p for p in problems), problems


def test_no_internal_labels_in_the_text():
    label = re.compile(r"\b[Ss]essions? \d+|\bstop \d+\b|(?<![&\w])#\d{1,3}\b|\b[Ii]ssue \d+")
    hits = [f"{p.relative_to(ROOT)}:{n}: {line.strip()[:100]}" for p in tracked()
            if p.suffix in (".md", ".py", ".toml", ".sh", ".cpp", ".h", ".cff", "") and p.name != "LICENSE"
            for n, line in enumerate(p.read_text(errors="ignore").splitlines(), 1) if label.search(line)]
    assert hits == []


def test_the_declared_torch_floor_is_the_release_the_suite_runs_on():
    """pyproject.toml declared torch>=2.7 while the suite ran 2.13 and the launcher used torchrun options of late
    releases: the floor, install.sh's GPU default and its CPU pin (the tested release) agree, and the torch here
    meets them."""
    import tomllib

    import torch

    [torch_req] = [d for d in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
                   if re.match(r"torch\b", d)]
    floor = re.fullmatch(r"torch>=(\d+\.\d+)", torch_req).group(1)
    install = (ROOT / "scripts" / "install.sh").read_text()
    assert f'torch_spec="${{TORCH_SPEC:-torch>={floor}}}"' in install  # GPU
    pinned = re.search(r'torch_spec="\$\{TORCH_SPEC:-torch==(\d+\.\d+)\.\d+\}"', install).group(1)  # CPU
    assert pinned == floor
    assert tuple(map(int, torch.__version__.split("+")[0].split(".")[:2])) >= tuple(map(int, floor.split(".")))
