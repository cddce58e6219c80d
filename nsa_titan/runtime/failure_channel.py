"""The job's failure channel: the first failure of a torchrun attempt, told to every rank through the job's store,
waited on rather than polled.

A failing rank sets one key of the attempt (its rank, exit code and line) first thing on its way out, then every
rank's wake key in one request (`announce`). Every rank has a thread blocked in one `wait` on its wake key, on a
store connection of its own (`listen`): it wakes when the key is set, or when the store's host (rank 0, or the
launcher) is gone: its connection closed and a new one refused. A connection that times out (a host busy with
thousands of ranks at start-up) or breaks while the host still accepts connections is made again. While nothing
fails, the store serves one request per rank per `WAIT_S`; polling once a second served one per rank per second (`benchmarks/operations/store_load.py` measures
both). A rank that ends sets its own wake key (`close`): its listener returns before the interpreter's teardown,
which would abort a thread woken inside the store's C++ call.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

WAIT_S = 24 * 3600.0
"""A listener's wait on the key, re-issued when it runs out: one request per rank a day while nothing fails."""
CONNECT_S = 5.0
"""How long a connection to the store may take (its host may be the process that is gone)."""
RETRY_S = 1.0
"""A listener's pause between connections that timed out or broke while the host still accepts them."""
PATIENCE_S = 120.0
"""How long a listener tries to connect to a host that neither answers nor refuses before it counts it gone (a
machine down: its connections time out)."""


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

    def __init__(self, host: str, port: int, rank: int, world_size: int):
        self.host, self.port, self.rank, self.world_size = host, port, rank, world_size
        self.key = f"nsa_titan/failure/attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        self.told: Failure | None = None  # what the listener has heard
        self._store: dist.TCPStore | None = None  # for announce and first: connected when first needed
        self.listener: threading.Thread | None = None
        self.closing = threading.Event()

    def wake_key(self, rank: int) -> str:
        return f"{self.key}/wake/rank{rank}"

    @classmethod
    def of_job(cls) -> FailureChannel | None:
        """The channel of this rank's job (the store its process group was started from); None when the rank is
        alone, or its group was not started from an address (MASTER_ADDR, MASTER_PORT)."""
        if not dist.is_initialized() or dist.get_world_size() == 1 or "MASTER_PORT" not in os.environ:
            return None
        return cls(os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ["MASTER_PORT"]), dist.get_rank(),
                   dist.get_world_size())

    def _connect(self) -> dist.TCPStore:
        return dist.TCPStore(self.host, self.port, is_master=False, wait_for_workers=False,
                             timeout=timedelta(seconds=CONNECT_S))

    @property
    def store(self) -> dist.TCPStore:
        if self._store is None:
            self._store = self._connect()
        return self._store

    def announce(self, failure: Failure) -> bool:
        """Record `failure` as the attempt's first and wake every rank, unless another rank's came first; whether
        it is. Best effort: False when the store cannot be reached."""
        try:
            if self.store.compare_set(self.key, "", failure.encode()).decode() != failure.encode():
                return False
            self.store.multi_set([self.wake_key(r) for r in range(self.world_size)], ["failure"] * self.world_size)
            return True
        except Exception:  # noqa: BLE001 - telling the others is a courtesy; the exit tells torchrun
            return False

    def first(self) -> Failure | None:
        """The attempt's first failure, if one was announced; raises if the store cannot be reached."""
        if self.told is not None:
            return self.told
        return Failure.decode(self.store.get(self.key)) if self.store.check([self.key]) else None

    def host_gone(self) -> bool:
        """Whether the store's host refuses connections (nothing listens at its port any more). A connection that
        times out (a host busy with many ranks at start-up, a slow network) is not a host gone."""
        try:
            with socket.create_connection((self.host, self.port), timeout=CONNECT_S):
                return False
        except ConnectionRefusedError:
            return True
        except OSError:
            return False

    def listen(self, heard: Callable[[Failure | None], None]) -> None:
        """From a thread of its own, call `heard(failure)` once the attempt's first failure is announced, or
        `heard(None)` once the store's host is gone (its connection closed, and a new one refused, or none made for
        `PATIENCE_S`); a connection that times out or breaks while the host lives is made again. Nothing after
        `close`."""
        def wait() -> None:
            store, failing_since = None, None
            while not self.closing.is_set():
                try:
                    store = store or self._connect()  # a connection of its own: the wait holds it
                    failing_since = None
                    store.wait([self.wake_key(self.rank)], timedelta(seconds=WAIT_S))
                    if store.get(self.wake_key(self.rank)) == b"failure":
                        self.told = Failure.decode(store.get(self.key))
                        heard(self.told)
                    return  # woken: a failure, or closed
                except dist.DistStoreError:  # the wait ran out: wait again
                    continue
                except Exception:  # noqa: BLE001 - the connection broke or was not made: is the host gone?
                    store, failing_since = None, failing_since or time.monotonic()
                    if self.host_gone() or time.monotonic() - failing_since > PATIENCE_S:
                        if not self.closing.is_set():
                            heard(None)
                        return
                    self.closing.wait(RETRY_S)

        self.listener = threading.Thread(target=wait, name="nsa_titan-failure-listener", daemon=True)
        self.listener.start()

    def close(self, timeout: float = CONNECT_S) -> None:
        """End the listener (a rank that ends, or fails, hears of no failure after): its own wake key, set."""
        self.closing.set()  # a listener still making its connection stops trying
        if self.listener is None or not self.listener.is_alive():  # woken already: a failure, or the host gone
            self.listener = None
            return
        try:
            self.store.compare_set(self.wake_key(self.rank), "", "closed")
        except Exception:  # noqa: BLE001 - the store's host is gone: the listener has woken on its own
            pass
        self.listener.join(timeout)
        self.listener = None
