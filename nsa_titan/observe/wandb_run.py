"""Weights & Biases: the run's scalars (those TensorBoard gets) and its config, from rank 0.

The W&B run id is kept in the dump folder (`wandb_run_id`), so a resumed or restarted run continues the
same W&B run. W&B never stops or slows training: it starts in a thread of its own (scalars logged before it
is up wait for it), a W&B that cannot start or fails while logging is one warning and the run goes on
without it, and online logging is sent by W&B's own background process.
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

logger = logging.getLogger(__name__)

RUN_ID_FILE = "wandb_run_id"


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


class WandbRun:
    """The W&B run of this training run on rank 0 (nothing elsewhere, when off, or once W&B failed)."""

    def __init__(self, m: Metrics, root: Path, config: dict[str, Any], rank: int):
        self.run: Any = None
        self.pending: list[tuple[dict[str, float], int]] = []  # logged before the run is up
        self.lock = threading.Lock()
        self.thread: threading.Thread | None = None
        mode = wandb_mode(m)
        if not m.enable_wandb or rank != 0 or mode == "disabled":
            return
        import wandb  # the `wandb` extra; the trainer names the pip command when it is missing

        # W&B's own processes (its service, git) are started here, before the loader forks its workers: a fork
        # in another thread meanwhile would hold a pipe that such a start waits on.
        wandb.setup(wandb.Settings(init_timeout=m.wandb_start_timeout_seconds, console="off", silent=True))
        self.timeout = m.wandb_start_timeout_seconds
        id_file = root / RUN_ID_FILE
        run_id = id_file.read_text().strip() if id_file.is_file() else uuid.uuid4().hex[:12]
        settings = dict(project=m.wandb_project, entity=m.wandb_entity or None, group=m.wandb_group or None,
                        name=m.wandb_name or None, id=run_id, resume="allow", dir=str(root), config=config, mode=mode)
        self.thread = threading.Thread(target=self._start, args=(settings, id_file), name="wandb-start", daemon=True)
        self.thread.start()

    def _start(self, settings: dict[str, Any], id_file: Path) -> None:
        import wandb

        try:
            run = wandb.init(**settings)
        except Exception as e:  # noqa: BLE001 - any failure of W&B: the run goes on without it
            logger.warning("W&B did not start (%s): training goes on without it", _why(e))
            with self.lock:
                self.pending = []
            return
        id_file.write_text(settings["id"])
        logger.info("W&B run %s (%s) in %s", settings["id"], settings["mode"], Path(settings["dir"]) / "wandb")
        with self.lock:
            self.run = run
            for scalars, step in self.pending:
                self._log(scalars, step)
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
            if self.run is not None:
                self._log(scalars, step)
            elif self.thread.is_alive():
                self.pending.append((scalars, step))

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
            try:
                run.finish()
            except Exception as e:  # noqa: BLE001
                logger.warning("W&B did not finish cleanly (%s)", _why(e))
