"""Shared test helpers: a tiny model config and a launcher that really spawns torchrun ranks."""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from nsa_titan.config import load_config
from nsa_titan.data import build_dataloader
from nsa_titan.data.tokenizer import ByteTokenizer
from nsa_titan.models.transformer import Transformer
from nsa_titan.optim import build_lr_scheduler, build_optimizer

ROOT = Path(__file__).resolve().parent.parent
SESSION_CACHE = pytest.StashKey[str]()


def pytest_configure(config: pytest.Config) -> None:
    """The kernels' verdicts (`[model] verify_kernels`) in a folder of this session's, removed at its end: each
    kernel is checked once a session, whatever an earlier run on this machine kept (NSA_TITAN_CACHE, if set, wins).
    The background commands' folder and idle CPU cgroup."""
    global BACKGROUND_FOLDER, IDLE_GROUP, JOIN_IDLE_GROUP
    BACKGROUND_FOLDER = Path(tempfile.mkdtemp(prefix="nsa_titan_background_"))
    IDLE_GROUP = idle_group()
    JOIN_IDLE_GROUP = str(IDLE_GROUP / "cgroup.procs") if IDLE_GROUP else ""
    if "NSA_TITAN_CACHE" not in os.environ:
        config.stash[SESSION_CACHE] = os.environ["NSA_TITAN_CACHE"] = tempfile.mkdtemp(prefix="nsa_titan_cache_")


def pytest_unconfigure(config: pytest.Config) -> None:
    if SESSION_CACHE in config.stash:
        shutil.rmtree(config.stash[SESSION_CACHE], ignore_errors=True)
    if BACKGROUND_FOLDER is not None:
        shutil.rmtree(BACKGROUND_FOLDER, ignore_errors=True)

PINNED = ["--model.kernels", "cpp"]
"""The runs the suite compares bit for bit take one family by name: `auto` times the families at each process's start
(`runtime/kernel_timing.py`), and two processes that both time on a busy machine may take different ones (a resume
keeps its checkpoint's: test_checkpoint.py). `auto`'s choice is tested on its own (`test_kernel_check.py`)."""
UNPINNED = ["--model.kernels", "auto"]
"""What a run with `attn_impl = "reference"` or `attention = "dense"` adds: a family named there is a config error."""

# A tiny NSA model whose sequence holds several blocks of every kind: 15 cmp blocks,
# 8 selection blocks of which 4 are chosen, a window shorter than the sequence.
TINY = [
    "--model.dim", "64", "--model.n_layers", "2", "--model.n_heads", "4", "--model.n_kv_groups", "2",
    "--model.head_dim", "16", "--model.vocab_size", "64", "--model.cmp_block_size", "8",
    "--model.cmp_stride", "4", "--model.sel_block_size", "8", "--model.sel_top_n", "4",
    "--model.window_size", "16", "--training.seq_len", "64", "--training.local_batch_size", "2",
    "--training.mixed_precision_param", "float32", "--lr_scheduler.warmup_steps", "2",
    "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "false", "--optimizer.lr", "1e-2",
    "--data.source", "synthetic", "--data.tokenizer", "byte", "--data.num_workers", "0",
    "--validation.enable", "false", "--eval.enable", "false", *PINNED,
]


def tree_digest(folder: Path) -> dict[str, str]:
    """sha256 of every file under `folder`, by relative path: to show that nothing changed."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def tb_run(folder: Path) -> str:
    """The one run folder under a TensorBoard root (each run writes into a subfolder of its own)."""
    runs = sorted(p for p in Path(folder).iterdir() if p.is_dir())
    assert len(runs) == 1, f"expected one TensorBoard run under {folder}, found {[p.name for p in runs]}"
    return str(runs[0])


def from_step(saved: Path, step: int, dump: Path) -> Path:
    """`dump`, a new run folder holding the checkpoint that the run in `saved` wrote at `step` (and nothing else): a
    run there resumes from it, its first `step` steps being `saved`'s."""
    shutil.copytree(saved / "checkpoint" / f"step-{step}", dump / "checkpoint" / f"step-{step}")
    return dump


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(args: list[str], nproc: int = 2, timeout: float = 900, env: dict | None = None
             ) -> subprocess.CompletedProcess:
    """`torchrun --nproc_per_node nproc ARGS` on a free loopback port; output captured."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()), *args]
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)


class Command(NamedTuple):
    """A test's command that may run in the background: its arguments, what it adds to the environment, the
    folder it runs in (made if missing), whether its stderr joins its stdout (a job's console, read as one), and
    whether it starts processes in sessions of their own (torchrun's ranks), which leave a nice and an autogroup
    behind: those run in the background only inside a CPU cgroup (`IDLE_GROUP`)."""
    argv: list[str]
    env: dict[str, str] = {}
    cwd: Path = ROOT
    merged: bool = False
    sessions: bool = False


BACKGROUND: dict[str, Future] = {}
"""The commands started so far, by name. A module whose tests read what self-contained commands print or write
(interpreted Triton cases, scripts' reports, the uninterrupted runs that others are compared with) lists them in
`BACKGROUND = {name: a Command, or a tuple of them run in turn}` and marks those tests `background`: when such a
test is collected, its module's commands start at the session's start (`pytest_collection_finish`), at the lowest
priority, on the cores the rest of the suite leaves idle; the tests take their results (`background`). A name is
one command whichever modules list it."""
BACKGROUND_FOLDER: Path | None = None
"""Where the background commands write (`background_folder`): made when pytest starts, removed with the session
(a script that imports this module, as the interpreted cases do, makes none)."""
STARTED = time.monotonic()
POOL = ThreadPoolExecutor(os.cpu_count() or 1, thread_name_prefix="background")
RUNNING: set[subprocess.Popen] = set()
PRCTL = ctypes.CDLL(None).prctl if sys.platform == "linux" else None  # looked up here, not in a forked child


def in_session() -> bool:
    """Whether pytest runs this process: not a child that imports a test module (a `spawn` child, the interpreted
    cases' `tests/interpreter.py`), for which no background folder is made."""
    return BACKGROUND_FOLDER is not None


def background_folder(name: str) -> Path:
    """The folder of the background command `name`'s outputs."""
    assert BACKGROUND_FOLDER is not None, "pytest makes the background folder (pytest_configure)"
    return BACKGROUND_FOLDER / name


def idle_group() -> Path | None:
    """A CPU cgroup of this session's own at the lowest weight, idle-scheduled where the kernel has it (v1's `cpu`
    controller or v2's), or None where cgroups cannot be made here: every process started in it, and every one
    those start in sessions of their own, gets only the CPU no other process wants."""
    for root, weight in ((Path("/sys/fs/cgroup/cpu"), ("cpu.shares", "2")), (Path("/sys/fs/cgroup"), ("cpu.weight", "1"))):
        try:
            if weight[0] == "cpu.weight" and "cpu" not in (root / "cgroup.subtree_control").read_text().split():
                continue
            for left in root.glob("nsa_titan_tests_*"):  # a killed session's, once its processes are gone
                if not Path(f"/proc/{left.name.rsplit('_', 1)[1]}").exists():
                    with contextlib.suppress(OSError):
                        left.rmdir()
            group = root / f"nsa_titan_tests_{os.getpid()}"
            group.mkdir()
            (group / weight[0]).write_text(weight[1])
            if (group / "cpu.idle").exists():
                (group / "cpu.idle").write_text("1")
            return group
        except OSError:
            continue
    return None


IDLE_GROUP: Path | None = None
"""The idle CPU cgroup, made when pytest starts (`idle_group`), removed at the session's end."""
JOIN_IDLE_GROUP = ""


def lowest_priority() -> None:
    """In a child before exec: a session of its own at nice 19, in the idle CPU cgroup (where there is none: its
    scheduler autogroup at nice 19 too, as autogroups give each session an equal share whatever its nice); killed
    if pytest dies (Linux's parent-death signal)."""
    os.setsid()
    os.nice(19)
    try:
        with open(JOIN_IDLE_GROUP or "/proc/self/autogroup", "w") as f:
            f.write(str(os.getpid()) if JOIN_IDLE_GROUP else "19")
    except OSError:  # neither here: nice alone ranks it
        pass
    if PRCTL is not None:
        PRCTL(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: the command ends with pytest's thread


def steps(commands: Command | tuple[Command, ...]) -> tuple[Command, ...]:
    """A background entry's commands, in turn."""
    return (commands,) if isinstance(commands, Command) else commands


def run_lowest(commands: Command | tuple[Command, ...]) -> subprocess.CompletedProcess:
    """`commands` (one, or several in turn until one fails) at the lowest priority, output captured (30 minutes
    each at most): the last one's result, its `outputs` each one's stdout and stderr, in turn."""
    outputs = []
    for command in steps(commands):
        Path(command.cwd).mkdir(parents=True, exist_ok=True)
        with subprocess.Popen(command.argv, cwd=command.cwd, env={**os.environ, **command.env},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT if command.merged else subprocess.PIPE,
                              text=True, preexec_fn=lowest_priority) as proc:
            RUNNING.add(proc)
            try:
                out, err = proc.communicate(timeout=1800)
            finally:
                RUNNING.discard(proc)
        outputs.append(out + (err or ""))  # err: None when merged
        if proc.returncode != 0:
            break
    done = subprocess.CompletedProcess(command.argv, proc.returncode, out, err or "")
    done.outputs = outputs
    return done


def timed(name: str, commands: Command | tuple[Command, ...], queued: float) -> subprocess.CompletedProcess:
    """`run_lowest(commands)`, its queued, started and ended times (seconds after pytest started) added to the
    file NSA_TITAN_BACKGROUND_TIMES names, if set (a JSON line each: where the background's time goes)."""
    started = time.monotonic()
    done = run_lowest(commands)
    if os.environ.get("NSA_TITAN_BACKGROUND_TIMES"):
        with open(os.environ["NSA_TITAN_BACKGROUND_TIMES"], "a") as f:
            f.write(json.dumps({"name": name, "rc": done.returncode, **{k: round(v - STARTED, 1) for k, v in (
                ("queued", queued), ("started", started), ("ended", time.monotonic()))}}) + "\n")
    return done


def start_background(commands: dict[str, Command | tuple[Command, ...]]) -> None:
    """Start each command not yet started; without the idle CPU cgroup, not those that start sessions (their
    ranks would take as large a share of the CPU as the tests': `background` runs them when a test asks)."""
    for name, command in commands.items():
        if name not in BACKGROUND and (IDLE_GROUP or not any(c.sessions for c in steps(command))):
            BACKGROUND[name] = POOL.submit(timed, name, command, time.monotonic())


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The modules whose tests read background commands run after the others (each module's tests together and in
    their order): their commands run on the core the other modules leave idle, instead of the tests waiting."""
    waiting = {item.module for item in items if item.get_closest_marker("background")}
    items.sort(key=lambda item: item.module in waiting)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the commands of the modules of the collected tests marked `background`, in the order the tests come."""
    if session.config.option.collectonly:
        return
    for item in session.items:
        if item.get_closest_marker("background"):
            start_background(item.module.BACKGROUND)


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Commands no test waited for (a run stopped early, `-x`) end with the session, and the idle group with them."""
    POOL.shutdown(wait=False, cancel_futures=True)
    for proc in list(RUNNING):
        os.killpg(proc.pid, signal.SIGKILL)
    if IDLE_GROUP:
        for _ in range(100):  # every process in it (ranks start sessions of their own), until it is empty
            for pid in (IDLE_GROUP / "cgroup.procs").read_text().split():
                with contextlib.suppress(OSError):
                    os.kill(int(pid), signal.SIGKILL)
            try:
                IDLE_GROUP.rmdir()
                break
            except OSError:
                time.sleep(0.1)


def background(name: str, commands: dict[str, Command | tuple[Command, ...]]) -> subprocess.CompletedProcess:
    """The finished command `name` (of `commands`), run now if it was not started in the background."""
    if name not in BACKGROUND:
        BACKGROUND[name] = POOL.submit(run_lowest, commands[name])
    return BACKGROUND[name].result()


def outputs(name: str, commands: dict[str, Command | tuple[Command, ...]]) -> list[str]:
    """The output (stdout and stderr) of each command of the background entry `name`, in turn; each must have
    exited 0."""
    done = background(name, commands)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return done.outputs


def finished(name: str, commands: dict[str, Command | tuple[Command, ...]]) -> str:
    """The output of the background command `name` (of its last, for several), which must have exited 0."""
    return outputs(name, commands)[-1]


def interpreted_commands(script: str, cases: list[str]) -> dict[str, Command]:
    """`python tests/interpreter.py script triton CASE...`, named by the script's stem, under TRITON_INTERPRET=1
    (Triton decides at definition): the script's imports once, each case in a child forked from there; none
    without Triton."""
    if importlib.util.find_spec("triton") is None:
        return {}
    return {Path(script).stem: Command([sys.executable, str(ROOT / "tests" / "interpreter.py"), script, "triton",
                                        *cases], {"TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"})}


def interpreted(commands: dict[str, Command]) -> dict[str, dict]:
    """{case: the JSON of its last line} for the interpreted cases `commands` (`interpreted_commands`), each of
    which must have exited 0; skips without Triton."""
    from interpreter import MARK

    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed (pip install -e '.[test]' installs it)")
    found = {}
    for name, command in commands.items():
        done = background(name, commands)
        parts = done.stdout.split(f"{MARK} ")[1:]  # "CASE\n...output...\n", "exit CODE\n", in turn
        outputs = {case.partition("\n")[0]: (case.partition("\n")[2], end.split()[1])
                   for case, end in zip(parts[::2], parts[1::2])}
        for case in command.argv[4:]:
            output, code = outputs.get(case, ("", "missing"))
            assert code == "0", f"{name} {case}: exit {code}\n{output[-2000:]}\n{done.stderr[-3000:]}"
            found[case] = json.loads(output.strip().splitlines()[-1])
    return found


def launch_ranks(specs: list[dict], out_dir: Path, nproc: int = 2, timeout: float = 1200) -> dict[str, dict]:
    """Run training specs (see tests/dist_worker.py) on `nproc` spawned ranks; {name: result}."""
    for spec in specs:
        spec["args"] = ["--job.dump_folder", str(out_dir / spec["name"]), *spec["args"]]
    out_dir.mkdir(parents=True, exist_ok=True)
    spec_file = out_dir / "spec.json"
    spec_file.write_text(json.dumps(specs))
    proc = torchrun([str(ROOT / "tests" / "dist_worker.py"), str(spec_file), str(out_dir)],
                    nproc=nproc, timeout=timeout)
    assert proc.returncode == 0, f"ranks failed:\n{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}"
    return {s["name"]: torch.load(out_dir / f"{s['name']}.pt") for s in specs}


@pytest.fixture
def small_chunks(monkeypatch):
    """Fast-path chunks and tiles much smaller than T, so every loop runs many times with partial last
    chunks (sel chunks: 2 blocks of l' = 16)."""
    from nsa_titan.models.attention.families.pytorch import fast_sel, fast_shared

    monkeypatch.setattr(fast_shared, "CHUNK_CMP", 24)
    monkeypatch.setattr(fast_shared, "CHUNK_WIN", 16)
    monkeypatch.setattr(fast_sel, "CHUNK_SEL", 32)
    monkeypatch.setattr(fast_sel, "TILE", 3)


@pytest.fixture(params=["fused", "ops"])
def cpu_path(request, monkeypatch) -> str:
    """Both ways the fast path runs its chunks: on CPUs through ATen's fused kernels (`fused_attention`),
    and as separate ops, the path other devices take (forced here by saying the kernels do not serve
    this device)."""
    from nsa_titan.models.attention.families.pytorch import fused_attention

    if request.param == "ops":
        monkeypatch.setattr(fused_attention, "fused", lambda x: False)
    return request.param


def single_process_run(args: list[str]) -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    """The same training, written plainly: no FSDP, no process group, one process."""
    cfg, _ = load_config(args, world_size=1)
    t = cfg.training
    torch.manual_seed(cfg.debug.seed)
    with torch.device("meta"):
        model = Transformer(cfg.model, t.seq_len)
    model.to_empty(device="cpu")
    model.init_weights(cfg.debug.seed)
    opt = build_optimizer(model, cfg.optimizer)
    sched = build_lr_scheduler(opt, t.steps, cfg.lr_scheduler)
    batches = iter(build_dataloader(cfg.data, ByteTokenizer(), t.seq_len, cfg.model.vocab_size, t.local_batch_size,
                                    0, 1))
    accum = t.global_batch_size // t.local_batch_size
    losses, grad_norms = [], []
    for _ in range(t.steps):
        opt.zero_grad()
        step_loss = 0.0
        for _ in range(accum):
            inputs, labels, document_ids, _ = next(batches)
            logits = model(inputs, document_ids if t.document_masking else None)
            loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
            (loss / accum).backward()
            step_loss += loss.item() / accum
        grad_norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), t.max_norm).item())
        opt.step()
        sched.step()
        losses.append(step_loss)
    return losses, grad_norms, {n: p.detach().clone() for n, p in model.named_parameters()}


def tb_losses(folder: Path, tag: str = "train/loss") -> dict[int, float]:
    """{step: value} of a loss (`tag`) in the TensorBoard run in `folder`."""
    events = EventAccumulator(tb_run(folder))
    events.Reload()
    return {e.step: e.value for e in events.Scalars(tag)}


def uninterrupted_commands(variants: list[tuple[int, int]]) -> dict[str, Command]:
    """The uninterrupted runs of `jobs.Job` with (loader workers, ranks) of `variants`, as background commands."""
    from jobs import job_command  # jobs imports this module

    return {f"uninterrupted-w{w}-r{n}": job_command(background_folder(f"uninterrupted-w{w}-r{n}") / "out",
                                                    "--data.num_workers", str(w), nproc=n) for w, n in variants}


@pytest.fixture(scope="session")
def uninterrupted():
    """The dump folder of the uninterrupted run of each (loader workers, ranks) of `jobs.Job` (its modules start
    the variants they use in the background: `uninterrupted_commands`)."""

    def get(workers: int, nproc: int) -> Path:
        [(name, command)] = uninterrupted_commands([(workers, nproc)]).items()
        finished(name, {name: command})
        return Path(command.cwd) / "out"

    return get
