"""A mixture's realized shares over the whole run: the tokens and documents each source fed, summed over every
data-parallel rank, kept in the checkpoint with the weights they were fed at, which a resume checks."""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist

from ..config import Source
from ..data import DataError

logger = logging.getLogger(__name__)


class SourceShares:
    """The tokens and documents (counted by their <eos>) each source of a mixture fed: this rank's since the last
    `sync`, and the run's (every rank's, every earlier run's) at it. `sync` is a collective: at log steps and in
    each save (`state_dict`). `replicas`: the ranks that read the same batches (context parallelism)."""

    def __init__(self, sources: list[Source], eos_id: int, device: torch.device, replicas: int = 1,
                 new_weights: bool = False):
        self.labels, self.weights = [s.label for s in sources], [s.weight for s in sources]
        self.eos_id, self.device, self.replicas, self.new_weights = eos_id, device, replicas, new_weights
        self.local = torch.zeros(2, len(sources), dtype=torch.long)  # tokens, documents
        self.counts = torch.zeros(2, len(sources), dtype=torch.long)

    def add(self, inputs: torch.Tensor, sources: torch.Tensor) -> None:
        n = len(self.labels)
        self.local[0] += torch.bincount(sources.flatten(), minlength=n)
        self.local[1] += torch.bincount(sources[inputs == self.eos_id], minlength=n)

    def sync(self) -> None:
        """Add every rank's counts since the last sync to the run's (a collective: every rank calls it)."""
        if len(self.labels) < 2:
            return
        summed = self.local.to(self.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(summed)
        self.counts += summed.cpu() // self.replicas
        self.local.zero_()

    def shares(self) -> torch.Tensor:
        """(2, sources): each source's share of the run's tokens and documents at the last sync."""
        return self.counts / self.counts.sum(1, keepdim=True).clamp(min=1)

    def scalars(self) -> dict[str, float]:
        """`data/share_tokens/<label>` and `data/share_documents/<label>` of the run so far, after a sync (none
        for one source)."""
        self.sync()
        if len(self.labels) < 2:
            return {}
        share = self.shares()
        return {f"data/share_{what}/{label}": float(share[i, s]) for i, what in enumerate(("tokens", "documents"))
                for s, label in enumerate(self.labels)}

    def batch_line(self, sources: list[torch.Tensor]) -> str:
        """`, tokens from web 60%, code 40%`: the sources of one step's micro-batches on this rank, by token share."""
        counts = torch.bincount(torch.cat([s.flatten() for s in sources]), minlength=len(self.labels))
        share = counts / counts.sum().clamp(min=1)
        return ", tokens from " + ", ".join(f"{label} {share[s]:.0%}" for s, label in enumerate(self.labels) if share[s])

    def line(self) -> str:
        """`shares of the run (tokens / documents, weights): web 70.1% / 69.8% (0.7), ...`, at the last sync."""
        share, total = self.shares(), sum(self.weights)
        return "shares of the run (tokens / documents, weight): " + ", ".join(
            f"{label} {share[0, s]:.1%} / {share[1, s]:.1%} ({w / total:.3g})"
            for s, (label, w) in enumerate(zip(self.labels, self.weights)))

    def state_dict(self) -> dict[str, Any]:
        self.sync()
        return {"labels": self.labels, "weights": self.weights, "counts": self.counts.tolist()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The run's counts so far; weights that differ from the checkpoint's are refused, unless
        `[data] new_weights_on_resume` (then the shares count from here)."""
        if state["labels"] != self.labels:
            logger.info("data: the sources %s differ from the checkpoint's %s: their shares count from here",
                        self.labels, state["labels"])
            return
        if state["weights"] != self.weights:
            given = ", ".join(f"{label} {w:g}" for label, w in zip(self.labels, self.weights))
            saved = ", ".join(f"{label} {w:g}" for label, w in zip(self.labels, state["weights"]))
            if not self.new_weights:
                raise DataError(f"[[data.sources]] weights {given} differ from the checkpoint's ({saved}): resume with "
                                f"the checkpoint's weights, or pass --data.new_weights_on_resume true to go on with "
                                f"these from the data position reached")
            logger.warning("data: new weights %s (the checkpoint's: %s; [data] new_weights_on_resume): the mixture goes "
                           "on from the data position reached, its shares counted from here", given, saved)
            return
        self.counts = torch.tensor(state["counts"], dtype=torch.long)
