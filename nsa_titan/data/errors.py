"""The error every bad data input raises: a message naming the problem and the fix."""


class DataError(ValueError):
    """A dataset, file or tokenizer that cannot be used, with what to do about it."""
