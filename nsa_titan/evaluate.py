"""Loss, perplexity and bits per byte of a trained model on a dataset split, or its long-range recall.

    python -m nsa_titan.evaluate outputs/debug_model/checkpoint/step-300 [--split validation] [--batches 50]
    torchrun --nproc-per-node 2 -m nsa_titan.evaluate CHECKPOINT --context_parallel 2   # long sequences
    python -m nsa_titan.evaluate CHECKPOINT --task recall --distances 32 256 1024 [--batches 4] [--plot recall.png]
    python -m nsa_titan.evaluate CHECKPOINT --task recall --ablate     # ... with each NSA branch of each layer off
    python -m nsa_titan.evaluate CHECKPOINT --task documents --path docs.jsonl [--documents 100]
    python -m nsa_titan.evaluate CHECKPOINT --seq_len 4096 --by_position [--bucket 512]   # loss by position
    python -m nsa_titan.evaluate CHECKPOINT --task lm_eval --tasks TASK ... [--include_path DIR] [--limit N]

The loss reads the run's held-out text the way training validates (`[data] holdout` or the split; each
source of a mixture, `--batches` each; a prepared run's held-out parts; same packing, same batches, rank
shards under torchrun, and each sequence split across `--context_parallel` ranks as training splits it), so
at a checkpoint's step it reports the trainer's validation loss. The recall task
(`nsa_titan/data/recall.py`, sizes from the config's `[recall]`) asks, for each distance, for
values hidden that many tokens before their query, on held-out samples, and reports the share
of queries whose value tokens are all predicted exactly, then the share of value tokens predicted
right and, for NSA, how often each layer's selection chose the block holding the pair (where
the sel branch has to read it); `--ablate` repeats the first with each NSA branch of each layer
switched off in turn, which shows the branch that does the recall. The documents task scores each
document on its own, as lm-evaluation-harness's perplexity tasks (loglikelihood_rolling) do: after
one prefix token (the tokenizer's bos, else its eos), in windows of seq_len predicted tokens, each
window reading the seq_len tokens before its last; it reports the harness's word and byte
perplexity and bits per byte, which equal the harness's on a Hugging Face export of the model.
`--seq_len` sets the context of every task (default: the training length), up to the model's
declared maximum (`[model] max_seq_len`, or the RoPE scaling's reach; docs/long-context.md);
`--by_position` splits the loss by the position of the predicted token (in its document, with
document masking) in buckets of `--bucket` tokens. The lm_eval task runs lm-evaluation-harness's
loglikelihood tasks on the model in this process (`observe/lm_harness.py`), as a run's `[eval]` does.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import os
import re
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from tqdm import tqdm

from .checkpoint.inference import load_model
from .config import ConfigError, JobConfig, cp_multiple
from .data import DataError, HeldOutSets, Tokenizer
from .distributed.parallel import apply_cp
from .models.loss import IGNORE_INDEX, lm_loss
from .models.transformer import NSAAttention, Transformer
from .observe.evals import eval_layout, evaluate_recall, position_sums, recall_batch
from .observe.lm_harness import Harness, rolling_windows, score
from .system.cli import ArgumentParser, leave, run_command


def load_at(checkpoint: str, config: str | None, overrides: list[str] | None, seq_len: int = 0,
            context_parallel: int = 1) -> tuple[Transformer, Tokenizer, JobConfig]:
    """`load_model`, its config's training.seq_len set to the context asked for (`seq_len`; 0: the
    training length), which must lie within the model's declared maximum."""
    context = ("--seq_len", lambda _: seq_len) if seq_len else None
    model, tokenizer, cfg = load_model(checkpoint, config, overrides, context_parallel=context_parallel, context=context)
    return model, tokenizer, dataclasses.replace(cfg, training=dataclasses.replace(cfg.training,
                                                                                  seq_len=seq_len or cfg.training.seq_len))


@torch.no_grad()
def evaluate(checkpoint: str, split: str = "validation", batches: int = 0, config: str | None = None,
             overrides: list[str] | None = None, context_parallel: int = 1, seq_len: int = 0,
             by_position: bool = False, bucket: int = 0) -> dict[str, Any]:
    """{'loss', 'perplexity', 'bits_per_byte', 'batches', 'tokens'} over up to `batches` batches (0: all)
    per data-parallel rank of `seq_len` tokens (0: the training length); `by_position` adds
    'by_position': {(first, end): (loss or None, tokens)} of the tokens predicted at positions [first, end),
    `bucket` wide (0: seq_len / 8; positions from `token_positions`). With `context_parallel` = cp > 1
    (under torchrun) each sequence is split across cp ranks as in training, and the other ranks are
    data-parallel."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    cp = context_parallel
    if world % cp:
        raise ConfigError(f"--context_parallel {cp} does not divide the {world} evaluating ranks: run under torchrun "
                          f"with a multiple of {cp} ranks (e.g. NGPU={cp} / --nproc-per-node {cp})")
    model, tokenizer, cfg = load_at(checkpoint, config, overrides, seq_len, cp)
    T = cfg.training.seq_len
    bucket = bucket or max(1, T // 8)
    buckets = torch.zeros(2, -(-T // bucket) if by_position else 0, dtype=torch.float64)  # loss sums, tokens
    dp_rank, dp_world = rank // cp, world // cp
    if cp > 1:  # the cp ranks of a data-parallel group neighbours, as in training
        mesh = init_device_mesh("cpu", (dp_world, cp), mesh_dim_names=("dp", "cp"))
        apply_cp(model, mesh, cp_multiple(cfg.model, cp))
    # The run's held-out text, as its validation reads it: each source of a mixture, a prepared run's parts.
    sets = HeldOutSets(cfg.data, dataclasses.replace(cfg.validation, split=split), tokenizer, T,
                       cfg.training.local_batch_size, dp_rank, dp_world)
    loader = itertools.chain.from_iterable(itertools.islice(s, batches or None) for s in sets.loaders())
    totals = torch.zeros(4, dtype=torch.float64)  # sum of batch losses, batches, tokens, bytes
    masking = cfg.training.document_masking  # as in training
    for inputs, labels, doc_ids, _ in tqdm(loader, desc="evaluate", disable=rank != 0):
        logits = model(inputs, doc_ids if masking else None)
        loss = lm_loss(logits, labels, model.cp)
        if by_position:
            buckets += position_sums(model, logits, labels, doc_ids if masking else None, bucket, buckets.shape[1])
        text_bytes = sum(len(tokenizer.decode(row).encode()) for row in labels.tolist())
        # Each of the cp ranks adds 1 / cp of its group's batch: its loss share averages to the batch's.
        totals += torch.tensor([loss.item(), 1, labels.numel(), text_bytes], dtype=torch.float64) / cp
    if dist.is_initialized():
        dist.all_reduce(totals)
        dist.all_reduce(buckets)
    if totals[1] == 0:
        raise DataError(f"the held-out text ({', '.join(sets.describe(i) for i in range(len(sets.sets)))}) gave no "
                        f"batch of seq_len {T}")
    loss = float(totals[0] / totals[1])
    result: dict[str, Any] = {"loss": loss, "perplexity": math.exp(min(loss, 50)),
                              "bits_per_byte": loss * float(totals[2]) / float(totals[3]) / math.log(2),
                              "batches": round(float(totals[1])) // dp_world, "tokens": round(float(totals[2]))}
    if by_position:
        result["by_position"] = {(i * bucket, min(T, (i + 1) * bucket)): (float(s / n) if n else None, int(n))
                                 for i, (s, n) in enumerate(buckets.T.tolist())}  # None: no token there
    return result


@torch.no_grad()
def evaluate_documents(checkpoint: str, path: str = "", split: str = "validation", documents: int = 0,
                       config: str | None = None, overrides: list[str] | None = None, seq_len: int = 0
                       ) -> dict[str, float]:
    """Each document of `path` (default: the validation source) scored on its own (`rolling_windows`):
    {'documents', 'tokens', 'loss' (per token), 'perplexity', 'word_perplexity', 'byte_perplexity',
    'bits_per_byte'}, as lm-evaluation-harness defines the last three; windows of `seq_len` (0: the training length)."""
    model, tokenizer, cfg = load_at(checkpoint, config, overrides, seq_len)
    column = cfg.data.text_column
    from .data.sources import open_text_stream  # `datasets` under it: imported only for documents
    stream = open_text_stream(path or cfg.validation.path or cfg.data.path, cfg.data.name, split, column)
    prefix = tokenizer.bos_id if tokenizer.bos_id is not None else tokenizer.eos_id
    eos = tokenizer.eos_id if cfg.training.document_masking else None  # as the model was trained, and the export runs
    nll, tokens, words, text_bytes, n_docs = 0.0, 0, 0, 0, 0
    for example in itertools.islice(stream, documents or None):
        text = example[column]
        for inputs, targets in rolling_windows(tokenizer.encode(text), prefix, cfg.training.seq_len):
            nll -= score(model, [(inputs, targets)], eos, torch.device("cpu"))[0][0]
            tokens += len(targets)
        words += len(re.split(r"\s+", text))
        text_bytes += len(text.encode("utf-8"))
        n_docs += 1
    if n_docs == 0:
        raise DataError(f"{path or 'the validation source'} split '{split}' holds no documents")
    return {"documents": n_docs, "tokens": tokens, "loss": nll / max(tokens, 1), "perplexity": math.exp(nll / max(tokens, 1)),
            "word_perplexity": math.exp(nll / words), "byte_perplexity": math.exp(nll / text_bytes),
            "bits_per_byte": nll / text_bytes / math.log(2)}


@torch.no_grad()
def recall_routing(model: torch.nn.Module, cfg: JobConfig, distances: list[int], batches: int
                   ) -> dict[int, dict[str, float]]:
    """Where recall fails, by distance: the share of value tokens predicted right ("value tokens"),
    and for each NSA layer i the share of them whose query chose (in any of its KV groups) the sel
    block holding the pair's copy of that token ("layer i found"), which is where the selection
    has to read it from. A value token labelled at position t is input token t + 1; its copy sits
    `distance` tokens earlier."""
    layout, attns = eval_layout(cfg), [m for m in model.modules() if isinstance(m, NSAAttention)]
    for m in attns:
        m.record_selection = True
    results: dict[int, dict[str, float]] = {}
    try:
        for d in distances:
            counts = torch.zeros(1 + len(attns))
            asked = 0
            for inputs, labels in (recall_batch(layout, cfg.data.seed + 1, cfg.training.local_batch_size, d, b)
                                   for b in range(batches)):
                mask = labels != IGNORE_INDEX  # (B, T)
                counts[0] += (model(inputs).argmax(-1) == labels)[mask].sum()
                copy = torch.arange(labels.shape[1]) + 1 - d  # (T,) the copy's position
                for i, m in enumerate(attns):
                    idx, valid = m.selection  # (B, G, T, n')
                    block = (copy // m.spec.l_sel)[None, None, :, None]
                    counts[1 + i] += ((idx == block) & valid).any(-1).any(1)[mask].sum()
                asked += int(mask.sum())
            shares = (counts / max(asked, 1)).tolist()
            results[d] = {"value tokens": shares[0], **{f"layer {i} found": v for i, v in enumerate(shares[1:])}}
    finally:
        for m in attns:
            m.record_selection, m.selection = False, None
    return results


def recall_ablations(model: Transformer, cfg: JobConfig, distances: list[int], batches: int
                     ) -> dict[str, dict[int, tuple[int, int]]]:
    """`evaluate_recall` with every NSA branch on ("all on"), then with each branch of each layer off."""
    results = {"all on": evaluate_recall(model, cfg, distances, batches)}
    for layer in range(cfg.model.n_layers):
        for branch in NSAAttention.BRANCHES:
            with model.branch_off(layer, branch):
                results[f"layer {layer} {branch} off"] = evaluate_recall(model, cfg, distances, batches)
    return results


def recall_table(results: dict[str, dict[int, tuple[int, int]]]) -> str:
    """Markdown: a row per model or ablation, a column per distance, exact recall in %."""
    distances = list(next(iter(results.values())))
    lines = ["| | " + " | ".join(f"{d:,}" for d in distances) + " |", "|---|" + "---|" * len(distances)]
    lines += [f"| {name} | " + " | ".join(f"{c / max(n, 1):.1%}" for c, n in by.values()) + " |"
              for name, by in results.items()]
    return "\n".join(lines)


def position_table(by_position: dict[tuple[int, int], tuple[float | None, int]]) -> str:
    """Markdown: a row per position bucket, its loss (- where it holds no token) and tokens."""
    lines = ["| positions | loss | tokens |", "|---|---|---|"]
    lines += [f"| {a:,}-{b:,} | {'-' if loss is None else f'{loss:.4f}'} | {n:,} |"
              for (a, b), (loss, n) in by_position.items()]
    return "\n".join(lines)


def routing_table(results: dict[int, dict[str, float]]) -> str:
    """Markdown: a row per distance, a column per `recall_routing` share, in %."""
    names = list(next(iter(results.values())))
    lines = ["| distance | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    lines += [f"| {d:,} | " + " | ".join(f"{v:.1%}" for v in by.values()) + " |" for d, by in results.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="nsa_titan.evaluate", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="a step-N checkpoint folder, an exported .pt file or a Hugging Face export")
    parser.add_argument("--task", choices=("loss", "recall", "documents", "lm_eval"), default="loss")
    parser.add_argument("--split", default="validation")
    parser.add_argument("--path", default="", help="documents: the text source (default: the validation source)")
    parser.add_argument("--documents", type=int, default=0, help="documents: at most this many (0: all)")
    parser.add_argument("--distances", type=int, nargs="+", default=[64, 256, 1024],
                        help="recall: the pair-to-query distances to test")
    parser.add_argument("--plot", help="recall: also draw accuracy by distance into this PNG file")
    parser.add_argument("--ablate", action="store_true",
                        help="recall: also with each NSA branch of each layer switched off in turn")
    parser.add_argument("--batches", type=int, default=0, help="at most this many batches per rank (0: all)")
    parser.add_argument("--config", help="the training config (default: the checkpoint's config.toml)")
    parser.add_argument("--seq_len", type=int, default=0,
                        help="the context of every task (default: the training length), up to the model's declared "
                             "maximum (docs/long-context.md)")
    parser.add_argument("--by_position", action="store_true",
                        help="loss: also by the position of the predicted token, in buckets of --bucket tokens")
    parser.add_argument("--bucket", type=int, default=0, help="--by_position's bucket width (default: seq_len / 8)")
    parser.add_argument("--tasks", nargs="+", default=[], help="lm_eval: the harness's task names")
    parser.add_argument("--include_path", default="", help="lm_eval: a folder of task YAML files (local tasks)")
    parser.add_argument("--limit", type=int, default=0, help="lm_eval: documents per task (0: all)")
    parser.add_argument("--context_parallel", type=int, default=1,
                        help="loss: split each sequence across this many ranks (under torchrun; default 1)")
    args, overrides = parser.parse_known_args(argv)
    if args.batches < 0:
        parser.error("--batches must be >= 0 (0: the whole split; for recall, 4 per distance)")
    if min(args.distances) < 1:
        parser.error("--distances must be >= 1")
    if args.seq_len < 0 or args.bucket < 0:
        parser.error("--seq_len and --bucket must be >= 0 (0: the training length, and seq_len / 8)")
    if args.by_position and args.task != "loss":
        parser.error("--by_position splits the loss task's tokens: use it with --task loss")
    if (args.task == "lm_eval") != bool(args.tasks) or args.limit < 0:
        parser.error("--task lm_eval needs --tasks (and --tasks needs --task lm_eval); --limit must be >= 0")
    if args.context_parallel < 1 or (args.task != "loss" and args.context_parallel > 1):
        parser.error("--context_parallel must be >= 1, and 1 for --task recall or documents (one process)")
    if "WORLD_SIZE" in os.environ:  # under torchrun: each rank evaluates its shard
        dist.init_process_group("gloo")
    try:
        return run_command("nsa_titan.evaluate", lambda: _report(args, overrides))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _report(args: argparse.Namespace, overrides: list[str]) -> int:
    if args.task == "documents":
        r = evaluate_documents(args.checkpoint, args.path, args.split, args.documents, args.config, overrides,
                               args.seq_len)
        print(f"{r['documents']} documents, {r['tokens']:,} tokens: loss {r['loss']:.4f} | perplexity "
              f"{r['perplexity']:.3f} | word perplexity {r['word_perplexity']:.3f} | byte perplexity "
              f"{r['byte_perplexity']:.4f} | bits/byte {r['bits_per_byte']:.4f}")
        return 0
    if args.task == "lm_eval":
        model, tokenizer, cfg = load_at(args.checkpoint, args.config, overrides, args.seq_len)
        harness = Harness(args.tasks, args.include_path, args.limit)
        scores = harness.run(  # in batches of the run's local size
            model, tokenizer, cfg.training.seq_len, tokenizer.eos_id if cfg.training.document_masking else None,
            torch.device("cpu"), cfg.training.local_batch_size)
        print("\n".join(f"{name}: {value:.4f}" for name, value in scores.items()))
        print(f"lm_eval requests: {harness.scored[0]}")
        return 0
    if args.task == "recall":
        model, _, cfg = load_at(args.checkpoint, args.config, overrides, args.seq_len)
        if args.ablate and cfg.model.attention != "nsa":
            raise ConfigError(f"--ablate switches NSA branches off, but {args.checkpoint} is a "
                              f"{cfg.model.attention} attention model: leave --ablate out")
        try:
            runs = (recall_ablations(model, cfg, args.distances, args.batches or 4) if args.ablate else
                    {"all on": evaluate_recall(model, cfg, args.distances, args.batches or 4)})
        except ValueError as e:
            raise DataError(str(e)) from None
        results = runs["all on"]
        print("| distance | recalled | queries |\n|---|---|---|")
        for d, (correct, total) in results.items():
            print(f"| {d:,} | {correct / max(total, 1):.1%} | {total} |")
        print("\nvalue tokens predicted right, and (NSA) how often the query's selection held the pair's "
              "copy of the token:\n" + routing_table(recall_routing(model, cfg, args.distances, args.batches or 4)))
        if args.ablate:
            print("\nexact recall by distance with one branch switched off:\n" + recall_table(runs))
        if args.plot:
            from .observe.plots import line_chart  # matplotlib: imported only for a plot
            m = cfg.model
            marks = {"w": m.window_size, "layers x w": m.n_layers * m.window_size} if m.attention == "nsa" else {}
            line_chart({args.checkpoint: {d: c / max(n, 1) for d, (c, n) in results.items()}}, args.plot,
                       "exact recall by distance", "distance (tokens)", "exact recall", (0.0, 1.0), marks)
            print(f"plot: {args.plot}")
        return 0
    r = evaluate(args.checkpoint, args.split, args.batches, args.config, overrides, args.context_parallel,
                 args.seq_len, args.by_position, args.bucket)
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"{args.split}: loss {r['loss']:.4f} | perplexity {r['perplexity']:.2f} | bits/byte "
              f"{r['bits_per_byte']:.4f} | {r['batches']} batches, {r['tokens']:,} tokens")
        if args.by_position:
            print(position_table(r["by_position"]))
    return 0


if __name__ == "__main__":
    leave(main())
