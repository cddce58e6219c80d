"""Evaluations inside a run (`[eval]`): the loss by position, the long-range recall probe and lm-eval tasks
on the model being trained, by every rank (FSDP, context parallelism).

The measures are `python -m nsa_titan.evaluate`'s own (`position_sums`, `evaluate_recall`,
`lm_harness.Harness`), read from the same batches, so an evaluation at step N equals `evaluate` on that
step's checkpoint. Every rank runs as many forwards as the others (each is collective under FSDP)."""

from __future__ import annotations

import dataclasses
import functools
import logging
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..config import JobConfig
from ..data import HeldOutSets, Tokenizer
from ..data.recall import RecallLayout, recall_accuracy, recall_sample
from ..models.loss import IGNORE_INDEX
from .metrics import MetricsLogger
from .validate import agreed_batches

logger = logging.getLogger(__name__)


def token_positions(document_ids: torch.Tensor | None, shape: torch.Size) -> torch.Tensor:
    """(B, T): each token's position in its row, or in its document (ids change where one starts)."""
    B, T = shape
    index = torch.arange(T).expand(B, T)
    if document_ids is None:
        return index
    starts = torch.ones(B, T, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    return index - torch.cummax(torch.where(starts, index, 0), dim=1).values


def position_sums(model: torch.nn.Module, logits: torch.Tensor, labels: torch.Tensor,
                  document_ids: torch.Tensor | None, bucket: int, buckets: int) -> torch.Tensor:
    """(2, buckets) float64 on the host: the summed loss and the count of the tokens of this rank's logits
    (B, T or Tl under context parallelism) predicted at positions [i x bucket, (i + 1) x bucket) of their
    row, or of their document when `document_ids` are given (`token_positions`)."""
    positions = token_positions(document_ids, labels.shape)
    if model.cp is not None:  # this rank's tokens of the padded sequence: the padding is never counted
        labels, positions = model.cp.shard(labels, IGNORE_INDEX), model.cp.shard(positions, 0)
    losses = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten().to(logits.device),
                             ignore_index=IGNORE_INDEX, reduction="none").double().cpu()
    counted = (labels.flatten() != IGNORE_INDEX).double()
    sums = torch.zeros(2, buckets, dtype=torch.float64)
    where = positions.flatten() // bucket
    sums[0].index_add_(0, where, losses * counted)
    sums[1].index_add_(0, where, counted)
    return sums


def eval_layout(cfg: JobConfig) -> RecallLayout:
    """The recall rows the evaluation reads: `[recall]`'s sizes, each pair asked once, no drill."""
    r = cfg.recall
    return RecallLayout(cfg.training.seq_len, cfg.model.vocab_size, r.key_tokens, r.value_tokens, r.pairs,
                        distinct=r.distinct)


@functools.lru_cache(maxsize=256)
def recall_batch(layout: RecallLayout, seed: int, B: int, distance: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch b of held-out recall samples (every pair `distance` tokens before its query), made once: an
    ablation or routing pass over the same distances reads it again."""
    samples = [recall_sample(layout, seed, b * B + i, [distance])[0] for i in range(B)]
    return torch.stack([s.inputs for s in samples]), torch.stack([s.labels for s in samples])


@torch.no_grad()
def evaluate_recall(model: torch.nn.Module, cfg: JobConfig, distances: list[int], batches: int, dp_rank: int = 0,
                    dp_world: int = 1, device: torch.device | None = None) -> dict[int, tuple[int, int]]:
    """{distance: (queries recalled exactly, queries)} over `batches` batches of held-out recall samples
    (seed [data] seed + 1) with every pair at that distance; under torchrun the batches are shared out among
    the `dp_world` data-parallel ranks (each as many forwards) and the counts summed."""
    layout, B, T = eval_layout(cfg), cfg.training.local_batch_size, cfg.training.seq_len
    rounds = -(-batches // dp_world)
    counts = torch.zeros(len(distances), 2, dtype=torch.int64)
    for i, d in enumerate(distances):
        layout.check(d)
        for b in range(dp_rank, rounds * dp_world, dp_world):
            inputs, labels = recall_batch(layout, cfg.data.seed + 1, B, d, min(b, batches - 1))
            predicted = model(inputs.to(device) if device else inputs).argmax(-1)
            if getattr(model, "cp", None) is not None:
                predicted = model.cp.gather(predicted)[:, :T]
            if b < batches:  # a rank past the last batch ran it again, for the collectives, and counts nothing
                counts[i] += torch.tensor(recall_accuracy(predicted.cpu(), labels, layout))
    if dist.is_initialized() and dist.get_world_size() > 1:
        summed = counts.to(device or "cpu")
        dist.all_reduce(summed)
        counts = summed.cpu() // (dist.get_world_size() // dp_world)  # the cp ranks of a group counted alike
    return {d: (int(c), int(n)) for d, (c, n) in zip(distances, counts.tolist())}


class InRunEvals:
    """`[eval]` of a run: what is due when, its data read once, the results logged with the time they took."""

    def __init__(self, cfg: JobConfig, tokenizer: Tokenizer, device: torch.device, dp_rank: int, dp_world: int):
        self.cfg, self.e, self.tokenizer, self.device = cfg, cfg.eval, tokenizer, device
        self.dp_rank, self.dp_world = dp_rank, dp_world
        t = cfg.training
        self.bucket = self.e.bucket or max(1, t.seq_len // 8)
        # The run's own held-out text, as validation reads it: a mixture's every source, a prepared run's parts.
        self.positions = HeldOutSets(cfg.data, dataclasses.replace(cfg.validation, steps=self.e.position_batches),
                                     tokenizer, t.seq_len, t.local_batch_size, dp_rank, dp_world) \
            if self.e.enable and self.e.position_batches else None
        self.harness = None
        if self.e.lm_eval_tasks:
            from .lm_harness import Harness
            self.harness = Harness(self.e.lm_eval_tasks, self.e.lm_eval_include_path, self.e.lm_eval_limit)
        self.seconds = 0.0  # all evaluations so far
        self.warned_empty = False  # the loss by position's empty buckets: warned once a run

    def due(self, step: int, last: bool) -> bool:
        return self.e.enable and (step % self.e.freq == 0 or last)

    @torch.no_grad()
    def run(self, model: torch.nn.Module, step: int, run_seconds: float, metrics: MetricsLogger) -> dict[str, float]:
        """Every evaluation of `[eval]` at `step`; the console line and the scalars (`eval/...`), with the time
        taken and its share of the run's `run_seconds` so far."""
        started, scalars = time.monotonic(), {}
        model.eval()
        try:
            if self.positions is not None:
                scalars.update(self.by_position(model))
            if self.e.recall_distances:
                found = evaluate_recall(model, self.cfg, self.e.recall_distances, self.e.recall_batches, self.dp_rank,
                                        self.dp_world, self.device)
                scalars.update({f"eval/recall/{d}": c / max(n, 1) for d, (c, n) in found.items()})
            if self.harness is not None:
                eos = self.tokenizer.eos_id if self.cfg.training.document_masking else None
                t = self.cfg.training
                scores = self.harness.run(model, self.tokenizer, t.seq_len, eos, self.device, t.local_batch_size,
                                          self.dp_rank, self.dp_world)
                scalars.update({f"eval/lm_eval/{k}": v for k, v in scores.items()})
        finally:
            model.train()
        seconds = time.monotonic() - started
        self.seconds += seconds
        share = self.seconds / max(run_seconds + seconds, 1e-9)
        metrics.log_scalars(step, {**scalars, "eval/seconds": seconds, "eval/share_of_run": share})
        shown = " | ".join(f"{k.removeprefix('eval/')} {v:.4f}" for k, v in scalars.items()
                           if not k.startswith("eval/tokens_by_position/"))
        if self.harness is not None:
            shown += f" | lm_eval requests a rank {' / '.join(map(str, self.harness.scored))}"
        logger.info("eval at step %d: %s | %.2f s (evaluations %.1f%% of the run so far)", step, shown, seconds,
                    100 * share)
        return scalars

    def by_position(self, model: torch.nn.Module) -> dict[str, float]:
        """The loss of the held-out batches (of every set: a mixture's sources) by position bucket, over every
        rank's tokens."""
        sets, counts = agreed_batches(self.positions, self.device, "[eval] position")
        T = self.cfg.training.seq_len
        n = -(-T // self.bucket)
        sums = torch.zeros(2, n, dtype=torch.float64)
        masking = self.cfg.training.document_masking
        for batches, count in zip(sets, counts):
            for inputs, labels, document_ids, _ in batches[:count]:
                documents = document_ids if masking else None
                sums += position_sums(model, model(inputs.to(self.device), documents), labels, documents, self.bucket,
                                      n)
        sums = sums.to(self.device)
        dist.all_reduce(sums)
        scalars, empty = {}, []
        for i, (loss, tokens) in enumerate(sums.cpu().T.tolist()):
            bucket = f"{i * self.bucket}-{min(T, (i + 1) * self.bucket)}"
            scalars[f"eval/tokens_by_position/{bucket}"] = tokens
            if tokens:
                scalars[f"eval/loss_by_position/{bucket}"] = loss / tokens
            else:  # no loss to log: a 0 would read as a perfect prediction
                empty.append(bucket)
        if empty and not self.warned_empty and dist.get_rank() == 0:  # every rank has the same sums
            self.warned_empty = True
            logger.warning("eval: the held-out text of the loss by position has no token at positions %s (its "
                           "documents%s are shorter): those buckets are not logged. Hold out longer documents (a "
                           "long-document source's holdout, as m7c_32k_adapt.toml does) or raise [eval] "
                           "position_batches", ", ".join(empty), " and rows" * (not self.cfg.training.document_masking))
        return scalars
