"""The job's failure channel: the first failure of a torchrun attempt, told to every rank through the job's store,
waited on rather than polled.

A failing rank sets one key of the attempt (its rank, exit code and line) first thing on its way out (`announce`).
Every other rank has a thread blocked in one `wait` on that key, on a store connection of its own (`listen`): it
wakes when the key is set, or when the connection closes because the store's host (the launcher under torchrun,
else rank 0) is gone. While nothing fails, the store serves one request per rank per `WAIT_S`; polling once a
second served one per rank per second (`benchmarks/operations/store_load.py` measures both).
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

WAIT_S = 24 * 3600.0
"""A listener's wait on the key, re-issued when it runs out: one request per rank a day while nothing fails."""
CONNECT_S = 5.0
"""How long a connection to the store may take (its host may be the process that is gone)."""


@dataclasses.dataclass(frozen=True)
class Failure:
    """A rank's failure as the job is told of it."""

    rank: int
    code: int
    line: str

    def encode(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def decode(cls, text: str | bytes) -> Failure:
        return cls(**json.loads(text))


class FailureChannel:
    """This rank's end of the channel: the store at `host`:`port`, the key of this attempt."""

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self.key = f"nsa_titan/failure/attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        self.told: Failure | None = None  # what the listener has heard
        self._store: dist.TCPStore | None = None  # for announce and first: connected when first needed

    @classmethod
    def of_job(cls) -> FailureChannel | None:
        """The channel of this rank's job (the store its process group was started from); None when the rank is
        alone, or its group was not started from an address (MASTER_ADDR, MASTER_PORT)."""
        if not dist.is_initialized() or dist.get_world_size() == 1 or "MASTER_PORT" not in os.environ:
            return None
        return cls(os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ["MASTER_PORT"]))

    def _connect(self) -> dist.TCPStore:
        return dist.TCPStore(self.host, self.port, is_master=False, wait_for_workers=False,
                             timeout=timedelta(seconds=CONNECT_S))

    @property
    def store(self) -> dist.TCPStore:
        if self._store is None:
            self._store = self._connect()
        return self._store

    def announce(self, failure: Failure) -> bool:
        """Record `failure` as the attempt's first, unless another rank's came first; whether it is. Best effort:
        False when the store cannot be reached."""
        try:
            return self.store.compare_set(self.key, "", failure.encode()).decode() == failure.encode()
        except Exception:  # noqa: BLE001 - telling the others is a courtesy; the exit tells torchrun
            return False

    def first(self) -> Failure | None:
        """The attempt's first failure, if one was announced; raises if the store cannot be reached."""
        if self.told is not None:
            return self.told
        return Failure.decode(self.store.get(self.key)) if self.store.check([self.key]) else None

    def listen(self, heard: Callable[[Failure | None], None]) -> None:
        """From a thread of its own, call `heard(failure)` once the attempt's first failure is announced, or
        `heard(None)` if the store's connection closes first (its host is gone)."""
        def wait() -> None:
            try:
                store = self._connect()  # a connection of its own: the wait holds it
                while True:
                    try:
                        store.wait([self.key], timedelta(seconds=WAIT_S))
                        break
                    except dist.DistStoreError:  # the wait ran out: wait again
                        continue
                self.told = Failure.decode(store.get(self.key))
            except Exception:  # noqa: BLE001 - the connection closed or cannot be made: the host is gone
                heard(None)
                return
            heard(self.told)

        threading.Thread(target=wait, name="nsa_titan-failure-listener", daemon=True).start()
