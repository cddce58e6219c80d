"""What the data pipeline yields: a window's inputs, labels and the document of each input token."""

from __future__ import annotations

from typing import NamedTuple

import torch


class Sample(NamedTuple):
    """One window (the loader stacks them into a batch of the same shape with a leading batch dim).

    inputs, labels: (seq_len,) long, labels = inputs shifted by one; document_ids: (seq_len,) long,
    the index (in the window) of the document each input token belongs to.
    """

    inputs: torch.Tensor
    labels: torch.Tensor
    document_ids: torch.Tensor


def eos_documents(inputs: torch.Tensor, eos_id: int) -> torch.Tensor:
    """Document index of each token of a packed window: an <eos> ends its document, the next token
    starts a new one."""
    eos = (inputs == eos_id).long()
    return torch.cumsum(eos, -1) - eos
