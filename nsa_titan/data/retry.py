"""Reading remote data through a flaky network: which errors are transient, and the retry budget.

A transient error (a connection reset or refused, a timeout, HTTP 408, 429 or 5xx, from aiohttp, httpx,
requests, huggingface_hub or the OS) is retried after a wait that doubles from `[data]
retry_wait_seconds` up to 60 s, at most `[data] read_retries` times in a row; the reader starts
again from the position it had reached. Any other error is raised as it is. When the budget is spent,
`DataUnavailable` stops the run, which saves and exits with the retryable code (docs/operations.md).
"""

from __future__ import annotations

import errno
import logging
import time

from ..config import RETRY_MAX_WAIT_S
from .errors import DataUnavailable

logger = logging.getLogger(__name__)

TRANSIENT_STATUS = {408, 429, 500, 502, 503, 504}
TRANSIENT_ERRNO = {errno.ECONNRESET, errno.ECONNREFUSED, errno.ECONNABORTED, errno.ETIMEDOUT, errno.EPIPE,
                   errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ENETDOWN, errno.EAGAIN}


def _status(e: BaseException) -> int | None:
    """The HTTP status an error carries (aiohttp's `status`, requests' and httpx's `response`), if any."""
    response = getattr(e, "response", None)
    for value in (getattr(e, "status", None), getattr(e, "status_code", None),
                  getattr(response, "status_code", None), getattr(response, "status", None)):
        if isinstance(value, int):
            return value
    return None


def transient(error: BaseException) -> str | None:
    """A one-line description of `error` if it, or an error it was raised from, is transient; else None."""
    seen: list[BaseException] = []
    e: BaseException | None = error
    while e is not None and e not in seen and len(seen) < 20:
        seen.append(e)
        names = {c.__name__ for c in type(e).__mro__}
        status = _status(e)
        line = f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"
        if status is not None:
            if status in TRANSIENT_STATUS:
                return line
            if status >= 400:  # 403, 404: the data is not there or not ours; retrying will not help
                return None
        if isinstance(e, (ConnectionError, TimeoutError)) or names & {"ClientError", "RequestError",
                                                                        "TransportError", "Timeout"}:
            return line
        if isinstance(e, OSError) and e.errno in TRANSIENT_ERRNO:
            return line
        e = e.__cause__ or e.__context__
    return None


class Retrier:
    """Counts the failed tries of one reader in a row (`ok` resets); `failed` waits before the next try,
    or raises: the error itself when it is not transient, `DataUnavailable` when the budget is spent."""

    def __init__(self, what: str, retries: int, wait_s: float):
        self.what, self.retries, self.wait_s = what, retries, wait_s
        self.failures = 0
        self.first_failure = 0.0

    def ok(self) -> None:
        self.failures = 0

    def failed(self, error: BaseException) -> None:
        why = transient(error)
        if why is None:
            raise error
        if self.failures == 0:
            self.first_failure = time.monotonic()
        if self.failures >= self.retries:
            raise DataUnavailable(
                f"{self.what} could not be read after {self.retries} retries over "
                f"{time.monotonic() - self.first_failure:.0f} s (last: {why}). Raise [data] read_retries or "
                f"retry_wait_seconds to wait out longer outages") from None
        wait = min(self.wait_s * 2**self.failures, RETRY_MAX_WAIT_S)
        self.failures += 1
        logger.warning("%s: a transient read error (%s); retry %d of %d in %.1f s, from the same position",
                       self.what, why, self.failures, self.retries, wait)
        time.sleep(wait)
