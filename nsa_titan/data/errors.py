"""The errors of the data pipeline: bad input (a message naming the problem and the fix), a source that a
flaky network kept from being read, and a source read to its end with `repeat = false`."""

from ..system.errors import BadInput


class DataError(BadInput, ValueError):
    """A dataset, file or tokenizer that cannot be used, with what to do about it."""

    kind = "data"


class DataStop(RuntimeError):
    """The data ends the run, which saves first. Built from one string, as a loader worker's error is re-raised
    in its rank (with the worker's traceback before the message)."""

    @property
    def reason(self) -> str:
        """The message alone, without a worker's traceback."""
        text, head = str(self), f"{type(self).__name__}: "
        return text.rsplit(head, 1)[-1].strip() if head in text else text


class DataUnavailable(DataStop):
    """A data source stayed unreadable through every retry (`retry.py`): the run saves and exits with
    the retryable code, to be resumed."""


class SourceEnded(DataStop):
    """A source with `repeat = false` is read to its end: the run saves and ends (exit code 0)."""


def source_ended(label: str) -> str:
    """SourceEnded's message for the source `label`."""
    return (f"[[data.sources]] '{label}' is read to its end and repeat = false: training ends here (set repeat = "
            f"true to read it again, reshuffled)")
