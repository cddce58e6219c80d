"""Per-rank training StatefulDataLoaders, and `[data] holdout`'s choice of documents."""

from __future__ import annotations

import dataclasses
import functools
import os
import signal
import warnings

import torch
from torch.utils.data._utils import signal_handling
from torchdata.stateful_dataloader import StatefulDataLoader

from ..config import Data, Recall, data_sources
from ..system.signals import die_with_parent, ignore_stop_signals
from .prepared import PreparedLoader, PreparedWindows, open_prepared
from .recall import RecallTokens, recall_layout
from .synthetic import SyntheticTokens
from .tokenizer import Tokenizer

warnings.filterwarnings("ignore", message="'set_vital' is deprecated")  # torchdata's own call

SNAPSHOT_EVERY = 16
"""Workers send their state (shuffle buffer included) every this many batches, not every batch;
a restore replays the batches since the last snapshot, which is exact and cheap."""


def build_dataloader(data: Data, tokenizer: Tokenizer, seq_len: int, vocab_size: int, local_batch: int,
                     dp_rank: int, dp_size: int, recall: Recall | None = None) -> StatefulDataLoader:
    """Training batches (`Sample`: inputs, labels, document_ids), each (local_batch, seq_len), for one dp rank.

    The loader's state_dict() holds every worker's position: restoring it resumes exactly. Its
    workers ignore the stop signals, so that the rank can save their position before they stop.
    """
    if data.num_workers > 0:
        find_dead_workers_when_waiting()
    data = dataclasses.replace(data, sources=data_sources(data))
    if data.source == "synthetic":
        dataset = SyntheticTokens(data.seed, seq_len, vocab_size, dp_rank, dp_size, local_batch)
    elif data.source == "recall":
        layout, distances = recall_layout(recall, seq_len, vocab_size)
        dataset = RecallTokens(layout, data.seed, distances, dp_rank, dp_size, local_batch)
    elif data.prepared:
        dataset = PreparedWindows(open_prepared(data, tokenizer), data.sources, seq_len, tokenizer.eos_id, data.seed,
                                  dp_rank, dp_size, local_batch)
        # Read in the training process: a batch of prepared windows costs less there (~0.1 ms for M7C's) than
        # handing it over from a loader worker (~1 ms), so `num_workers` serves streamed text only.
        return PreparedLoader(dataset, batch_size=local_batch, generator=own_generator(data.seed, dp_rank))
    else:
        from .packing import PackedTextDataset  # `datasets` under these: imported only for text sources
        from .sources import node_stream
        streams = [node_stream(s, data, dp_rank, dp_size, held=False) for s in data.sources]
        dataset = PackedTextDataset(streams, data.sources, tokenizer, seq_len, data.shuffle_buffer, data.seed, dp_rank,
                                    (data.read_retries, data.retry_wait_seconds), data.bad_documents)
    return StatefulDataLoader(dataset, batch_size=local_batch, num_workers=data.num_workers,
                              persistent_workers=data.num_workers > 0, snapshot_every_n_steps=SNAPSHOT_EVERY,
                              worker_init_fn=functools.partial(start_worker, rank=os.getpid()), generator=own_generator(data.seed, dp_rank))


def start_worker(worker_id: int, rank: int) -> None:
    """`worker_init_fn` of the training loaders' workers: the rank decides when they stop, not a stop signal
    (`signals.ignore_stop_signals`), and they die with their rank, pid `rank`. A SIGKILLed rank's workers would otherwise live
    on, each blocked at its exit on a result queue that its sibling holds open, and keep the job's output open."""
    ignore_stop_signals(worker_id)
    die_with_parent(rank)


def own_generator(seed: int, dp_rank: int) -> torch.Generator:
    """The loader's own generator: each new iterator draws its base seed from it, not from the global
    torch generator, which a resumed run restores and must then find where the stopped run left it."""
    return torch.Generator().manual_seed(seed * 1_000_003 + dp_rank)


def find_dead_workers_when_waiting() -> None:
    """Keep torch's SIGCHLD handler out of this process. It raises a dead worker's error in the main thread
    wherever that thread is: inside a log call (which prints and swallows it), a checkpoint's staging, or the
    report of the failure it caused. Without it the loader still finds a dead worker itself, when it waits
    on it (every MP_STATUS_CHECK_INTERVAL, 5 s), and raises in the step's data fetch (main thread only)."""
    installed = signal.getsignal(signal.SIGCHLD)
    if getattr(installed, "__module__", "") == signal_handling.__name__:  # by an earlier loader: the default again
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal_handling._SIGCHLD_handler_set = True  # torch's flag: "installed", so it is not


def dead_workers(loader: StatefulDataLoader) -> list[tuple[int, int]]:
    """(pid, exit code) of each of the loader's worker processes that has exited (a negative code: the
    signal that killed it), for a rank's failure line."""
    iterator = loader._iterator
    return [(w.pid, w.exitcode) for w in getattr(iterator, "_workers", []) if w.exitcode is not None]


def shutdown_workers(loader: StatefulDataLoader) -> None:
    """Stop the loader's worker processes now. They ignore the stop signals and are ended by their
    rank: here, rather than by the interpreter's exit, which would wait on them."""
    iterator = loader._iterator
    if iterator is not None and hasattr(iterator, "_shutdown_workers"):
        iterator._shutdown_workers()
    loader._iterator = None
