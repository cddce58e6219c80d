"""Weights & Biases: the run's scalars (those TensorBoard gets) and its config, from rank 0.

The W&B run id is kept in the dump folder (`wandb_run_id`), so a resumed or restarted run continues the
same W&B run. Its history follows the training's: what was logged is kept beside it (`wandb_history.jsonl`),
and a run that goes back to a step (a resume after steps that were logged but not saved, a loss spike's
rollback) takes W&B's history back there. Offline, a new folder of the run replays the kept history up to that
step and the run's older folders are set aside (`wandb/superseded/`): `wandb sync <dump>/wandb/offline-run-*`
sends one history that holds every step once. Online, W&B rewinds the run (`resume_from`), where the server
offers it; else the steps logged again are dropped by W&B, with a warning.
W&B never stops or slows training: it starts in a thread of its own (scalars logged before it is up wait for
it), a W&B that cannot start or fails while logging is one warning and the run goes on without it, and online
logging is sent by W&B's own background process.
"""

from __future__ import annotations

import logging
import netrc
import os
import threading
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from ..config import Metrics
from ..system.jsonl import append_record, read_records, write_records

logger = logging.getLogger(__name__)

RUN_ID_FILE = "wandb_run_id"
HISTORY_FILE = "wandb_history.jsonl"
"""Every scalar logged to W&B, a line a log call: {"step": N, "scalars": {...}}."""


def has_credentials() -> bool:
    """Whether W&B has an API key: WANDB_API_KEY, or a netrc entry for its server (`wandb login` writes one)."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or "api.wandb.ai"
    try:
        return netrc.netrc().authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def wandb_mode(m: Metrics) -> str:
    """`[metrics] wandb_mode`, with `auto` as online where credentials are configured, else offline."""
    if m.wandb_mode != "auto":
        return m.wandb_mode
    return "online" if has_credentials() else "offline"


def _why(e: Exception) -> str:
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"


def _finish(run: Any) -> None:
    """End a W&B run; a failure is one warning."""
    try:
        run.finish()
    except Exception as e:  # noqa: BLE001
        logger.warning("W&B did not finish cleanly (%s)", _why(e))


class WandbRun:
    """The W&B run of this training run on rank 0 (nothing elsewhere, when off, or once W&B failed)."""

    def __init__(self, m: Metrics, root: Path, config: dict[str, Any], rank: int, step: int = 0):
        """`step`: the step the training starts from (a resume's), where W&B's history is taken back to."""
        self.run: Any = None
        self.pending: list[tuple[dict[str, float], int]] = []  # logged before the run is up
        self.lock = threading.Lock()
        self.thread: threading.Thread | None = None
        self.history_warned = False
        mode = wandb_mode(m)
        if not m.enable_wandb or rank != 0 or mode == "disabled":
            return
        import wandb  # the `wandb` extra; the trainer names the pip command when it is missing

        # W&B's own processes (its service, git) are started here, before the loader forks its workers: a fork
        # in another thread meanwhile would hold a pipe that such a start waits on.
        wandb.setup(wandb.Settings(init_timeout=m.wandb_start_timeout_seconds, console="off", silent=True))
        self.timeout, self.history, self.id_file = m.wandb_start_timeout_seconds, root / HISTORY_FILE, root / RUN_ID_FILE
        run_id = self.id_file.read_text().strip() if self.id_file.is_file() else uuid.uuid4().hex[:12]
        self.settings = dict(project=m.wandb_project, entity=m.wandb_entity or None, group=m.wandb_group or None,
                             name=m.wandb_name or None, id=run_id, resume="allow", dir=str(root), config=config,
                             mode=mode)
        self._begin(step)

    def _begin(self, step: int) -> None:
        """Start W&B's run in a thread of its own, its history taken back to `step` (the kept history too)."""
        kept, rewound = self._history_to(step)
        self.thread = threading.Thread(target=self._start, args=(kept, rewound, step), name="wandb-start",
                                       daemon=True)
        self.thread.start()

    def _history_to(self, step: int) -> tuple[list[dict[str, Any]], bool]:
        """The kept history up to `step`, the file cut back to it, and whether steps after it were dropped. A torn
        line (a kill or a full disk mid-write) is dropped with one warning; a file that cannot be read or rewritten
        is one warning too, and the replay is what could be read."""
        try:
            rows, torn = read_records(self.history)
        except OSError as e:
            self._history_failed(e)
            return [], False
        kept = [row for row in rows if isinstance(row.get("step"), int) and row["step"] <= step]
        if torn:
            logger.warning("%s: %d incomplete line(s) dropped (a write cut short by a kill or a full disk); W&B's "
                           "history resumes from step %d", self.history, torn, step)
        if torn or len(kept) < len(rows):
            try:
                write_records(self.history, kept)
            except OSError as e:
                self._history_failed(e)
        return kept, len(kept) < len(rows)

    def _history_failed(self, e: OSError) -> None:
        """A read or write of the kept history failed: one warning (the first), and W&B goes on."""
        if not self.history_warned:
            self.history_warned = True
            logger.warning("W&B's kept history %s could not be read or written (%s): training and W&B go on; a "
                           "resume replays only what was kept", self.history, _why(e))

    def _init(self, rewind: bool, step: int) -> Any:
        """wandb.init of the run; online with steps after `step` logged (`rewind`), rewound there where W&B can."""
        import wandb

        settings = self.settings
        if rewind and settings["mode"] == "online":
            try:
                return wandb.init(**{k: v for k, v in settings.items() if k not in ("id", "resume")},
                                  resume_from=f"{settings['id']}?_step={step}")
            except Exception as e:  # noqa: BLE001 - rewinding is a W&B preview feature: go on without it
                logger.warning("W&B could not rewind the run to step %d (%s): the steps after it, logged again, are "
                               "dropped by W&B (TensorBoard and the console hold them)", step, _why(e))
        return wandb.init(**settings)

    def _start(self, kept: list[dict[str, Any]], rewind: bool, step: int) -> None:
        try:
            run = self._init(rewind, step)
        except Exception as e:  # noqa: BLE001 - any failure of W&B: the run goes on without it
            logger.warning("W&B did not start (%s): training goes on without it", _why(e))
            with self.lock:
                self.pending = []
            return
        self.id_file.write_text(self.settings["id"])
        folder = Path(run.dir).parent
        logger.info("W&B run %s (%s) in %s", self.settings["id"], self.settings["mode"], folder)
        with self.lock:
            self.run = run
            if self.settings["mode"] == "offline":  # this folder holds the whole history: the older ones go aside
                for row in kept:
                    self._log(row["scalars"], row["step"])
                for old in folder.parent.glob(f"offline-run-*-{self.settings['id']}"):
                    if old != folder:
                        (folder.parent / "superseded").mkdir(exist_ok=True)
                        old.rename(folder.parent / "superseded" / old.name)
            for scalars, logged_at in self.pending:
                self._log(scalars, logged_at)
            self.pending = []

    def _log(self, scalars: dict[str, float], step: int) -> None:
        try:
            self.run.log(scalars, step=step)
        except Exception as e:  # noqa: BLE001
            logger.warning("W&B failed while logging (%s): training goes on without it", _why(e))
            self.run = None

    def log(self, scalars: dict[str, float], step: int) -> None:
        if self.thread is None:
            return
        with self.lock:
            try:
                append_record(self.history, {"step": step, "scalars": scalars})
            except OSError as e:
                self._history_failed(e)
            if self.run is not None:
                self._log(scalars, step)
            elif self.thread.is_alive():
                self.pending.append((scalars, step))

    def rewind(self, step: int) -> None:
        """The training went back to `step` (a rollback): so does W&B's history, the steps after it to be logged
        again (`_begin`)."""
        if self.thread is None:
            return
        self.thread.join(self.timeout)
        with self.lock:
            run, self.run = self.run, None
            self.pending = [(scalars, at) for scalars, at in self.pending if at <= step]  # a start still under way
        if run is None:  # W&B did not start, or failed: the run goes on without it, its history kept to `step`
            self._history_to(step)
            return
        _finish(run)
        self._begin(step)

    def close(self) -> None:
        if self.thread is None:
            return
        self.thread.join(self.timeout)  # a run shorter than W&B's start waits for it (its start gives up by then)
        with self.lock:
            run, self.run = self.run, None
            starting = self.thread.is_alive()
        if starting:  # stop its service, which the process would otherwise wait for at exit
            logger.warning("W&B had not started by the end of the run: its scalars are not in W&B")
            import wandb

            wandb.teardown(exit_code=1)
        if run is not None:
            _finish(run)
