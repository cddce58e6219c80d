"""nsa_titan: a torchtitan-style trainer for Native Sparse Attention language models."""

from .system import signals as _signals  # noqa: F401  first, before torch: the parent this process started under
