"""Jobs as operators run them: `run_train.sh` in a session of its own, output read live, on the shipped
default config (embedded corpus, sentencepiece, loader workers, checkpoints) with a smaller model, so
that a run takes seconds; and the final state of a run, compared bit for bit."""

from __future__ import annotations

import os
import re
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from nsa_titan.checkpoint import inspect_folder, load_tensors
from nsa_titan.launch import child_pids

from conftest import PINNED, ROOT, Command, background

STEPS = 40
SMALL = ["--model.dim", "64", "--model.n_layers", "2", "--model.n_heads", "4", "--model.head_dim", "16",
         "--training.seq_len", "128", "--training.local_batch_size", "4", "--training.steps", str(STEPS),
         "--metrics.log_freq", "1", "--validation.enable", "false", "--eval.enable", "false", "--checkpoint.interval", "1000",
         "--data.shuffle_buffer", "64", *PINNED]


def job_command(dump: Path, *args: str, nproc: int = 1, env: dict | None = None, launcher: Sequence[str] = (),
                under: Sequence[str] = ()) -> Command:
    """`run_train.sh ARGS` on the small model, writing to `dump`, from its parent folder, its output as one stream.
    `launcher`: the command in place of `run_train.sh` (torchrun called directly); `under`: what starts it (a PID
    namespace, a subreaper)."""
    return Command([*under, *(launcher or [str(ROOT / "run_train.sh")]), *SMALL, "--job.dump_folder", str(dump), *args],
                   {"NGPU": str(nproc), "OMP_NUM_THREADS": "1", **(env or {})}, dump.parent, merged=True,
                   sessions=True)


class Job:
    """`run_train.sh ARGS` in a session of its own (as a scheduler or a terminal starts it), output read live."""

    def __init__(self, dump: Path, *args: str, nproc: int = 1, env: dict | None = None,
                 preexec: Callable[[], None] | None = None, launcher: Sequence[str] = (), under: Sequence[str] = ()):
        """The arguments as `job_command` takes them."""
        command = job_command(dump, *args, nproc=nproc, env=env, launcher=launcher, under=under)
        self.cmd = command.argv
        self.proc = subprocess.Popen(self.cmd, cwd=command.cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True, preexec_fn=preexec,
                                     env={**os.environ, **command.env})
        self.lines: list[str] = []
        self.times: list[float] = []  # when each line was read (time.monotonic)
        self.ended: float | None = None  # when the job exited

    def wait_for(self, pattern: str, timeout: float = 300) -> re.Match:
        deadline = time.monotonic() + timeout
        for line in self.proc.stdout:
            self.lines.append(line)
            self.times.append(time.monotonic())
            m = re.search(pattern, line)
            if m:
                return m
            assert time.monotonic() < deadline, f"no line matching {pattern!r} in time:\n{self.out[-3000:]}"
        raise AssertionError(f"the job ended without a line matching {pattern!r}:\n{self.out[-4000:]}")

    def finish(self, timeout: float = 300) -> tuple[int, str]:
        """Read to the end: (exit code, whole output)."""
        rest, _ = self.proc.communicate(timeout=timeout)
        self.ended = time.monotonic()
        self.lines.append(rest)
        return self.proc.returncode, self.out

    @property
    def out(self) -> str:
        return "".join(self.lines)

    def rank_pid(self, rank: int) -> int:
        """The pid of global rank `rank`: the launcher's child with RANK=`rank` in its environment."""
        for pid in child_pids(self.proc.pid):
            if f"\0RANK={rank}\0".encode() in b"\0" + Path(f"/proc/{pid}/environ").read_bytes():
                return pid
        raise AssertionError(f"rank {rank} not found among the launcher's children")


def run_job(dump: Path, *args: str, nproc: int = 1, env: dict | None = None) -> str:
    rc, out = Job(dump, *args, nproc=nproc, env=env).finish()
    assert rc == 0, out[-4000:]
    return out


def job_in_background(name: str, commands: dict[str, Command]) -> tuple[Path, int, str]:
    """The dump folder, exit code and output of the finished background job `name` (`job_command`'s)."""
    done = background(name, commands)
    return Path(commands[name].argv[commands[name].argv.index("--job.dump_folder") + 1]), done.returncode, done.stdout


def assert_states_equal(a: Path, b: Path) -> None:
    """The model and optimizer tensors of two step folders (each complete and verified), bit for bit."""
    for path in (a, b):
        assert inspect_folder(path) is None, f"{path}: {inspect_folder(path)}"
    for prefix in ("model", "optimizer"):
        ta, tb = load_tensors(a, prefix), load_tensors(b, prefix)
        assert ta.keys() == tb.keys() and len(ta) > 10
        for k in ta:
            assert torch.equal(ta[k], tb[k]), f"{prefix}.{k} differs: {a} against {b}"


def assert_bit_equal(a: Path, b: Path) -> None:
    """The final (step STEPS) model and optimizer of two runs' dump folders, bit for bit."""
    assert_states_equal(a / "checkpoint" / f"step-{STEPS}", b / "checkpoint" / f"step-{STEPS}")


