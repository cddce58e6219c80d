"""What a checkpoint holds, each part as a `Stateful` for DCP: the train state, the model and the
optimizer (sharded, keyed by parameter name, so they load on any number of ranks), opaque blobs
(the data loader) and the RNG states."""

from __future__ import annotations

import pickle
import random
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict, get_optimizer_state_dict, set_model_state_dict, set_optimizer_state_dict,
)


@dataclass
class TrainState:
    step: int = 0
    tokens_seen: int = 0
    dp_world_size: int = 1

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step, "tokens_seen": self.tokens_seen, "dp_world_size": self.dp_world_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.tokens_seen = int(state["step"]), int(state["tokens_seen"])
        self.dp_world_size = int(state["dp_world_size"])


class ModelState:
    """The model's sharded state dict under clean parameter names (no AC / compile prefixes)."""

    def __init__(self, model: nn.Module):
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        return get_model_state_dict(self.model)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_model_state_dict(self.model, state)


class OptimizerState:
    """The optimizer's state keyed by parameter name: loads on any number of ranks."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        return get_optimizer_state_dict(self.model, self.optimizer)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_optimizer_state_dict(self.model, self.optimizer, state)


class Opaque:
    """A state kept as one pickled blob, not flattened key by key: its nested structure (the
    data loader's worker snapshots) differs between a fresh object and a saved one."""

    def __init__(self, inner: Any):
        self.inner = inner

    def state_dict(self) -> dict[str, bytes]:
        return {"pickle": pickle.dumps(self.inner.state_dict())}

    def load_state_dict(self, state: dict[str, bytes]) -> None:
        self.inner.load_state_dict(pickle.loads(state["pickle"]))


class RunPart:
    """A rank's part of a checkpoint besides model, optimizer and schedule: its loader's position, and the run's
    `records` by name (the mixture's shares, the loss spikes' estimate: the same on every rank; loaded first, as
    one may refuse). A record the checkpoint lacks is left as it is."""

    def __init__(self, loader: Any, records: dict[str, Any] | None = None):
        self.loader, self.records = loader, records or {}

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.loader.state_dict() if self.loader is not None else None,
                "records": {k: r.state_dict() for k, r in self.records.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "position" not in state:  # saved before the records were kept: the loader's position alone
            state = {"position": state, "records": {}}
        for name, record in self.records.items():
            if name in state["records"]:
                record.load_state_dict(state["records"][name])
        if self.loader is not None:  # None: the records alone (a rollback, the data going on)
            self.loader.load_state_dict(state["position"])


class FixedState:
    """A state captured earlier (the data loader's position before a step that did not run), saved as it is."""

    def __init__(self, state: dict[str, Any]):
        self.state = state

    def state_dict(self) -> dict[str, Any]:
        return self.state


class RNGState:
    """Every generator a step may draw from: python, numpy, torch CPU and CUDA."""

    def state_dict(self) -> dict[str, Any]:
        import numpy as np

        # Generator states as bytes: a pickled tensor's bytes vary from save to save.
        state = {"python": random.getstate(), "numpy": np.random.get_state(),
                 "torch": torch.get_rng_state().numpy().tobytes()}
        if torch.cuda.is_available():
            state["cuda"] = [s.numpy().tobytes() for s in torch.cuda.get_rng_state_all()]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        import numpy as np

        random.setstate(state["python"])
        np.random.set_state(state["numpy"])
        as_tensor = lambda b: torch.frombuffer(bytearray(b), dtype=torch.uint8)  # noqa: E731
        torch.set_rng_state(as_tensor(state["torch"]))
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all([as_tensor(b) for b in state["cuda"]])
