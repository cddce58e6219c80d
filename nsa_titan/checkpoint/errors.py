"""The error of a checkpoint that cannot be used or written."""


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used, named, with the problem and the way out."""
