"""The errors of the data pipeline: bad input (a message naming the problem and the fix), and a source
that a flaky network kept from being read."""

from ..system.errors import BadInput


class DataError(BadInput, ValueError):
    """A dataset, file or tokenizer that cannot be used, with what to do about it."""

    kind = "data"


class DataUnavailable(RuntimeError):
    """A data source stayed unreadable through every retry (`retry.py`): the run saves and exits with
    the retryable code, to be resumed. Built from one string, as a loader worker's error is re-raised
    in its rank (with the worker's traceback before the message)."""

    @property
    def reason(self) -> str:
        """The message alone, without a worker's traceback."""
        text = str(self)
        return text.rsplit("DataUnavailable: ", 1)[-1].strip() if "DataUnavailable: " in text else text
