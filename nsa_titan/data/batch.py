"""What the data pipeline yields: a window's inputs, labels and the document of each input token."""

from __future__ import annotations

from typing import NamedTuple

import torch


class Sample(NamedTuple):
    """One window (the loader stacks them into a batch of the same shape with a leading batch dim).

    inputs, labels: (seq_len,) long, labels = inputs shifted by one; document_ids: (seq_len,) long,
    the index (in the window) of the document each input token belongs to; sources: (seq_len,) long, the
    mixture's source (`[[data.sources]]` index) of each input token (0 for a single source).
    """

    inputs: torch.Tensor
    labels: torch.Tensor
    document_ids: torch.Tensor
    sources: torch.Tensor


def eos_documents(inputs: torch.Tensor, eos_id: int) -> torch.Tensor:
    """Document index of each token of a packed window: an <eos> ends its document, the next token
    starts a new one."""
    eos = (inputs == eos_id).long()
    return torch.cumsum(eos, -1) - eos


def document_starts(tokens: torch.Tensor, previous: torch.Tensor, attention_mask: torch.Tensor | None = None,
                    eos_id: int | None = None) -> torch.Tensor:
    """(B, S): whether each of `tokens` (B, S), the last S of a sequence whose mask is `attention_mask` (B, >= S + 1)
    and whose token before them is `previous` (B, 1), starts a document as `document_ids` of the whole sequence
    would have it: a change of the mask, or the token after an `eos_id`. A decoder's follow-up tokens, one at a time."""
    starts = torch.zeros_like(tokens, dtype=torch.bool)
    if attention_mask is not None and not bool(attention_mask.all()):
        last = attention_mask[:, -tokens.shape[1] - 1:]
        starts |= last[:, 1:] != last[:, :-1]
    if eos_id is not None:
        starts |= torch.cat([previous, tokens[:, :-1]], 1) == eos_id
    return starts


def document_ids(inputs: torch.Tensor, attention_mask: torch.Tensor | None = None, eos_id: int | None = None
                 ) -> torch.Tensor | None:
    """(B, T) document ids of a batch given to a model (not packed by the loader), or None where every
    token of a row attends to all before it: a change of the attention mask (padding, left or right)
    starts a document, and so does the token after each `eos_id` (document masking), if given."""
    ids = None
    if attention_mask is not None and not bool(attention_mask.all()):
        change = (attention_mask[:, 1:] != attention_mask[:, :-1]).long()
        ids = torch.nn.functional.pad(change.cumsum(-1), (1, 0))
    if eos_id is not None:
        eos = eos_documents(inputs, eos_id)
        ids = eos if ids is None else ids + eos
    return ids
