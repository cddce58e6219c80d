"""The Python processes each test starts and the CPU seconds each spends: ranks, launchers, `python -m nsa_titan...`
commands, interpreted Triton cases, forked loader workers, pytest itself.

    python scripts/suite_processes.py tests/test_spikes.py -k skip   # pytest's arguments (default: tests)
    python scripts/suite_processes.py --log processes.jsonl          # keep every process's line

For the run, a `.pth` file in site-packages has every Python interpreter that starts import a hook (from a folder of
the run's own) that, as the process ends (its exit handlers, or `os._exit`, which forked children call), adds a line
to a log: its test (as pytest's PYTEST_CURRENT_TEST names it when the interpreter starts; a forked child's when it
ends), its command line, whether it was forked, its nice (19: a background command's, `conftest.BACKGROUND`) and its
CPU seconds (user + system). A process killed by a signal it does not handle writes none. Both files are removed at
the end. Prints the CPU seconds by kind of process and by test, most first (a background command's processes count
under its name), and the totals. tests/README.md ("Measuring the suite") has the figures.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOG = "NSA_TITAN_PROCESS_LOG"
HOOK = '''"""Written by scripts/suite_processes.py for one run: a line to the log as this process ends."""
import atexit, json, os, resource, time
_start, _test, _nice = os.getpid(), os.environ.get("PYTEST_CURRENT_TEST", ""), os.getpriority(os.PRIO_PROCESS, 0)
_argv = open("/proc/self/cmdline", "rb").read().replace(b"\\0", b" ").decode(errors="replace")[:3000]
_written = set()
def _write():
    pid = os.getpid()
    if pid in _written:
        return
    _written.add(pid)
    usage, forked = resource.getrusage(resource.RUSAGE_SELF), pid != _start
    with open(os.environ["''' + LOG + '''"], "a") as f:
        f.write(json.dumps({"test": os.environ.get("PYTEST_CURRENT_TEST", "") if forked else _test, "argv": _argv,
                            "forked": forked, "nice": _nice, "cpu": usage.ru_utime + usage.ru_stime}) + "\\n")
atexit.register(_write)
_exit = os._exit
def _ending(code):
    _write()
    _exit(code)
os._exit = _ending
'''
"""The hook: the module every interpreter of the run imports at its start (a no-op without the log's variable)."""
BACKGROUND = re.compile(r"nsa_titan_background_[^/]+/([^/ ]+)|--job\.dump_folder \S*?([^/ ]+/[^/ ]+)(?: |$)")


def kind(line: dict) -> str:
    """What the process was: a forked child, an interpreted case, a launcher, a rank, pytest, or a command."""
    argv = line["argv"]
    if line["forked"]:
        return "forked child (loader worker, case)"
    for name, marks in (("interpreted Triton", ("interpreter.py",)),
                        ("launcher", ("nsa_titan.launch", "torch.distributed.run")),
                        ("rank", ("nsa_titan.train", "dist_worker.py")), ("pytest", (" -m pytest",))):
        if any(m in argv for m in marks):
            return name
    return "command (nsa_titan's tools, scripts, lm_eval)"


def owner(line: dict) -> str:
    """The test a process counts under, or the background command it belongs to."""
    if line["nice"] == 19:  # conftest's background commands run at nice 19, and so do their children
        found = BACKGROUND.search(line["argv"])
        return f"background: {(found.group(1) or found.group(2)) if found else ' '.join(line['argv'].split()[1:4])[-80:]}"
    return line["test"].rsplit(" (", 1)[0] or "(outside any test: pytest, collection)"


def measured(pytest_args: list[str], keep: Path | None) -> tuple[int, list[dict]]:
    """pytest's exit code and every process's line."""
    pth = Path(sysconfig.get_paths()["purelib"]) / "nsa_titan_process_log.pth"
    with tempfile.TemporaryDirectory(prefix="suite_processes_") as tmp:
        (Path(tmp) / "nsa_titan_process_hook.py").write_text(HOOK)
        log = Path(tmp) / "processes.jsonl"
        log.touch()
        pth.write_text(f"{tmp}\nimport os; os.environ.get('{LOG}') and __import__('nsa_titan_process_hook')\n")
        try:
            rc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *pytest_args],
                                cwd=ROOT, env={**os.environ, LOG: str(log)}).returncode
        finally:
            pth.unlink()
        if keep:
            shutil.copyfile(log, keep)
        return rc, [json.loads(x) for x in log.read_text().splitlines() if x.strip()]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--most", type=int, default=40, help="how many tests to list (default 40)")
    parser.add_argument("--log", type=Path, help="keep every process's line (JSON lines) in this file")
    args, pytest_args = parser.parse_known_args()  # the rest is pytest's (default: tests)
    rc, lines = measured(pytest_args or ["tests"], args.log)
    cpu, count = collections.Counter(), collections.Counter()
    for line in lines:
        for key in (("kind", kind(line)), ("test", owner(line))):
            cpu[key] += line["cpu"]
            count[key] += 1
    total = sum(line["cpu"] for line in lines)
    print("CPU seconds by kind of process (processes, mean):")
    for (group, name), seconds in cpu.most_common():
        if group == "kind":
            print(f"{seconds:9.1f}  {count[group, name]:5d}  {seconds / count[group, name]:6.2f}  {name}")
    print(f"CPU seconds by test, the {args.most} most (processes):")
    for (group, name), seconds in [x for x in cpu.most_common() if x[0][0] == "test"][:args.most]:
        print(f"{seconds:9.1f}  {count[group, name]:5d}  {name}")
    print(f"{len(lines)} processes ({sum(1 for x in lines if not x['forked'])} interpreters started, the rest forked) "
          f"spent {total:,.0f} CPU seconds; pytest exit {rc}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
