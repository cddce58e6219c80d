"""One run owns its output folder: `<dump_folder>/owner.json`, taken at start, renewed, released at exit.

The record names the job (`job_key`: the Slurm job, the torchrun rendezvous, or the process), the host,
the pid that holds it (and that pid's start time, so a reused pid is not taken for the holder), the
start time and a heartbeat the holder renews every `[job] owner_heartbeat_seconds`. A run that finds
a record of another job stops with exit code 2 before it writes anything, unless that job is gone:

- on the same host, its pid is no longer the process that wrote the record;
- on another host, its heartbeat is older than `[job] owner_stale_seconds` (hosts' clocks are
  assumed to agree to well within that bound, as NTP keeps them).

A gone holder's record is taken over with one warning. A record of the same job (a torchrun restart,
a Slurm requeue, another node of the job) is joined while its holder lives, and taken back at once
when it does not. Creation is `os.link` of a fully written file (atomic on NFS and Lustre, where
`flock` is not reliable); a takeover is serialised by a second such link, `owner.json.takeover`.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from ..config import ConfigError
from ..config.paths import make_folder
from ..system.env import JOB_KEY

logger = logging.getLogger(__name__)

OWNER_FILE = "owner.json"
TAKEOVER_STALE_S = 60.0
"""A takeover lock older than this was left by a process that died while taking over: it is removed."""


class FolderInUse(ConfigError):
    """The output folder belongs to another run that is still alive."""


@dataclass
class OwnerRecord:
    job: str
    host: str
    pid: int
    pid_start: str  # the holder's start time in clock ticks since boot (/proc/PID/stat, field 22)
    started: float
    heartbeat: float
    command: str = ""


def job_key(rendezvous: str | None = None) -> str:
    """What every process of one job shares, across its restarts and requeues: the Slurm job (array task
    and step), the launcher's key (in its ranks), the multi-node rendezvous `rendezvous` (`id@endpoint`,
    the launcher's), torchrun's run id, or else this process alone."""
    env = os.environ
    if env.get(JOB_KEY):
        return env[JOB_KEY]
    if env.get("SLURM_JOB_ID"):
        array = f"_{env['SLURM_ARRAY_TASK_ID']}" if env.get("SLURM_ARRAY_TASK_ID") else ""
        return f"slurm job {env['SLURM_JOB_ID']}{array} step {env.get('SLURM_STEP_ID', 'batch')}"
    if rendezvous:
        return f"rendezvous {rendezvous}"
    if env.get("TORCHELASTIC_RUN_ID"):
        return f"torchrun {env['TORCHELASTIC_RUN_ID']} at {env.get('MASTER_ADDR', '?')}"
    return f"process {os.getpid()} on {socket.gethostname()}"


def _process_start(pid: int) -> str:
    """The start time of process `pid` (clock ticks since boot), '' if there is no such process."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


def _read(path: Path) -> OwnerRecord | None:
    try:
        return OwnerRecord(**json.loads(path.read_text()))
    except (FileNotFoundError, NotADirectoryError):  # no record, or no folder (make_folder names the problem)
        return None
    except (ValueError, TypeError) as e:  # not ours, or cut short: name it rather than guess
        raise FolderInUse(f"{path} is not an owner record nsa_titan can read ({e}): if no run uses "
                          f"{path.parent}, remove it; else choose another --job.dump_folder") from None


def _staged(path: Path, record: OwnerRecord) -> Path:
    """`record` written in full to a new file beside `path`, to be linked or renamed into place."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    tmp.write_text(json.dumps(asdict(record), indent=1))
    return tmp


def _write_new(path: Path, record: OwnerRecord) -> bool:
    """Create `path` holding `record` if it does not exist, atomically (a fully written file linked in)."""
    tmp = _staged(path, record)
    try:
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    except OSError:  # a filesystem without hard links: an exclusive create
        try:
            with open(path, "x") as f:
                f.write(tmp.read_text())
            return True
        except FileExistsError:
            return False
    finally:
        tmp.unlink(missing_ok=True)


def _replace(path: Path, record: OwnerRecord) -> None:
    os.replace(_staged(path, record), path)


def _holder(record: OwnerRecord) -> str:
    age = time.time() - record.heartbeat
    label = "a run" if record.job.startswith("process ") else record.job
    return (f"{label} (pid {record.pid} on {record.host}, started "
            f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(record.started))}, heartbeat {age:.0f} s ago)")


def holder_alive(record: OwnerRecord, stale_s: float) -> tuple[bool, str]:
    """Whether the process that holds `record` still runs, and why it is taken to be gone."""
    if record.host == socket.gethostname():
        alive = _process_start(record.pid) == record.pid_start
        return alive, f"its pid {record.pid} on this host has exited"
    age = time.time() - record.heartbeat
    return age <= stale_s, f"its heartbeat is {age:.0f} s old (> owner_stale_seconds = {stale_s:g})"


def other_holder(folder: Path, job: str) -> str | None:
    """Who holds `folder` if its owner record names another job than `job` (a takeover while this run was
    thought gone), else None (no record, or this job's)."""
    try:
        found = _read(folder / OWNER_FILE)
    except FolderInUse as e:
        return str(e)
    return _holder(found) if found is not None and found.job != job else None


class FolderOwner:
    """This process's hold on a folder: `claim` it, and `release` it at the end (a thread renews it)."""

    def __init__(self, path: Path, record: OwnerRecord, holds: bool, heartbeat_s: float):
        self.path, self.record, self.holds = path, record, holds
        self.lost: str | None = None  # why the record is no longer this job's, if it is not
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if holds:
            self._thread = threading.Thread(target=self._renew, args=(heartbeat_s,), name="owner-heartbeat",
                                            daemon=True)
            self._thread.start()

    @classmethod
    def claim(cls, folder: Path, heartbeat_s: float, stale_s: float, job: str | None = None) -> FolderOwner:
        """Take `folder` (created if missing) for this job, or raise FolderInUse naming its holder.
        Nothing is written into the folder when it is refused."""
        job = job or job_key()
        path = folder / OWNER_FILE
        me = OwnerRecord(job=job, host=socket.gethostname(), pid=os.getpid(), pid_start=_process_start(os.getpid()),
                         started=time.time(), heartbeat=time.time(), command=" ".join(sys.argv)[:300])
        for _ in range(20):  # another run may change the record between our read and write: look again
            found = _read(path)
            if found is None:
                make_folder(folder, "[job] dump_folder")
                if _write_new(path, me):
                    return cls(path, me, True, heartbeat_s)
                continue
            alive, why_gone = holder_alive(found, stale_s)
            if found.job == job and alive:  # another process of this job holds it (a node, a rank)
                return cls(path, found, False, heartbeat_s)
            if found.job != job and alive:
                raise FolderInUse(
                    f"[job] dump_folder = '{folder}' is in use by {_holder(found)}, which still runs: it was "
                    f"not touched. Give this run another --job.dump_folder, or stop the other run first "
                    f"(its record: {path})")
            if cls._take_over(path, found, me):
                if found.job == job:
                    logger.info("%s: taken back by this job (%s: a restart or requeue)", path, why_gone)
                else:
                    logger.warning("%s: taken over from %s, which is gone: %s", path, _holder(found), why_gone)
                return cls(path, me, True, heartbeat_s)
        raise FolderInUse(f"[job] dump_folder = '{folder}': its owner record {path} keeps changing (several runs "
                          f"starting on it at once?): start one run per folder")

    @staticmethod
    def _take_over(path: Path, judged: OwnerRecord, me: OwnerRecord) -> bool:
        """Replace `judged` (a gone holder's record) by `me`, one taker at a time; False if the record
        changed meanwhile or another run is taking it over (the caller looks again)."""
        lock = path.with_name(path.name + ".takeover")
        if not _write_new(lock, me):
            try:
                if time.time() - lock.stat().st_mtime > TAKEOVER_STALE_S:
                    lock.unlink(missing_ok=True)
            except FileNotFoundError:
                pass
            time.sleep(0.05)
            return False
        try:
            if _read(path) != judged:
                return False
            _replace(path, me)
            return True
        finally:
            lock.unlink(missing_ok=True)

    def _renew(self, heartbeat_s: float) -> None:
        while not self._stop.wait(heartbeat_s):
            try:
                found = _read(self.path)
            except FolderInUse as e:
                found, self.lost = None, str(e)
            if found is None or found.job != self.record.job or found.pid != self.record.pid:
                self.lost = self.lost or (f"{self.path} was removed" if found is None else
                                          f"{self.path} now names {_holder(found)}")
                logger.error("this run no longer owns its folder: %s", self.lost)
                return
            self.record.heartbeat = time.time()
            try:
                _replace(self.path, self.record)
            except OSError as e:  # a full or briefly unreachable disk: the next beat tries again
                logger.warning("could not renew the owner record %s: %s", self.path, e)

    def release(self) -> None:
        """Stop renewing; remove the record if this process holds it (still under its own name)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if not self.holds:
            return
        try:
            found = _read(self.path)
        except FolderInUse:
            return
        if found is not None and found.job == self.record.job and found.pid == self.record.pid:
            self.path.unlink(missing_ok=True)
