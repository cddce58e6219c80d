"""Learnability probe for long-range recall: repeated key-value bigrams, short sequences first.

    python benchmarks/quality/recall_probe.py --attn nsa --warm_steps 600 --steps 400 --pairs 96 --lr 1e-3
    python benchmarks/quality/recall_probe.py --attn nsa --branch win --warm_steps 600 --steps 400 --pairs 96 --lr 1e-3
    python benchmarks/quality/recall_probe.py --attn dense --warm_steps 600 --steps 400 --pairs 96 --lr 1e-3
    python benchmarks/quality/recall_probe.py --attn nsa --warm_steps 300 --steps 300 --pairs 96 --lr 3e-3 model.smear=true

Not the report (`recall_report.py` trains the shipped task through the trainer); a harness that
asks which signal lets the circuit form within a CPU budget. Each row of a batch draws `pairs`
(key, value) token pairs (keys 1-127, values 128-254) and is the sequence `k v k v ...` of pairs
drawn from them at random; every value whose key appeared earlier in the row is labelled (about
45% of the tokens), at the distance back to that earlier occurrence. The model is
`train_configs/recall.toml`'s (2 layers, dim 128, w = 64, so stacked windows reach 128 tokens),
trained with its AdamW and schedule: first `--warm_steps` steps on short rows (seq 256, 16 pairs,
batch 32: gaps of about 32 tokens), then `--steps` steps at `--seq` (1,024, batch 8). Every 100
steps: the accuracy of the labelled values on 4 held-out batches at `--seq`, by distance.
`--task recall` trains the rows at `--seq` on the shipped task instead (`[recall]` of recall.toml)
and reports its exact recall by distance (`nsa_titan.evaluate`), with every NSA branch ablated.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from nsa_titan.config import load_config  # noqa: E402
from nsa_titan.data.recall import recall_layout, recall_sample  # noqa: E402
from nsa_titan.evaluate import evaluate_recall, recall_ablations, recall_table  # noqa: E402
from nsa_titan.models.transformer import NSAAttention, Transformer  # noqa: E402
from nsa_titan.optim import build_lr_scheduler, build_optimizer  # noqa: E402

K = 127
"""Keys are tokens 1..K, values K+1..254."""
BINS = [(0, 64), (64, 128), (128, 256), (256, 512), (512, 2048)]


def bigram_batch(gen: torch.Generator, B: int, seq: int, pairs: int, min_pairs: int = 0
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """inputs, labels (-100: not asked), distances and earlier occurrences (B, seq) of B rows of
    repeated pairs; each row draws its pair count from [min_pairs, pairs] (min_pairs 0: always `pairs`)."""
    n = seq // 2 + 1
    keys = torch.stack([torch.randperm(K, generator=gen)[:pairs] + 1 for _ in range(B)])  # (B, P)
    vals = torch.randint(128, 255, (B, pairs), generator=gen)
    P = torch.randint(min_pairs or pairs, pairs + 1, (B, 1), generator=gen)
    pick = (torch.rand(B, n, generator=gen) * P).long()
    rows = torch.stack([keys.gather(1, pick), vals.gather(1, pick)], 2).flatten(1)[:, :seq + 1]  # k v k v ...
    labels, dist, seen_n = torch.full_like(rows, -100), torch.zeros_like(rows), torch.zeros_like(rows)
    last = torch.full((B, K + 1), -1)  # the previous position of each key
    count = torch.zeros((B, K + 1), dtype=torch.long)  # occurrences of each key so far
    for i in range(0, seq + 1, 2):
        key = rows[:, i]
        prev = last.gather(1, key[:, None])[:, 0]
        if i + 1 <= seq:
            seen = prev >= 0
            labels[:, i + 1] = torch.where(seen, rows[:, i + 1], -100)
            dist[:, i + 1] = torch.where(seen, i - prev, 0)
            seen_n[:, i + 1] = count.gather(1, key[:, None])[:, 0]
        last.scatter_(1, key[:, None], torch.full_like(key[:, None], i))
        count.scatter_add_(1, key[:, None], torch.ones_like(key[:, None]))
    return rows[:, :-1], labels[:, 1:], dist[:, 1:], seen_n[:, 1:]


def copy_batch(gen: torch.Generator, B: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """inputs and labels (B, seq) of rows that repeat a random segment of 16..seq/2 tokens: every
    token of the repeat after its first is labelled (what an induction head predicts)."""
    rows, labels = torch.empty(B, seq + 1, dtype=torch.long), torch.full((B, seq + 1), -100)
    for b in range(B):
        L = int(torch.randint(16, seq // 2 + 1, (1,), generator=gen))
        rows[b] = torch.randint(1, 255, (L,), generator=gen).repeat(seq // L + 1)[:seq + 1]
        labels[b, L + 1:] = rows[b, L + 1:]  # from the second token of the second copy: induction
    return rows[:, :-1], labels[:, 1:]


@torch.no_grad()
def accuracy_by_distance(model: torch.nn.Module, batches: list, seen: int = 0) -> str:
    """Accuracy of the labelled values by distance bin (`seen` > 0: only keys seen that many times before)."""
    model.eval()
    hit, total = torch.zeros(len(BINS)), torch.zeros(len(BINS))
    for x, y, d, c in batches:
        pred = model(x).argmax(-1)
        for j, (lo, hi) in enumerate(BINS):
            m = (y != -100) & (d >= lo) & (d < hi) & ((c == seen) if seen else True)
            hit[j] += (pred[m] == y[m]).sum()
            total[j] += m.sum()
    model.train()
    return " ".join(f"{lo}-{hi}:{100 * h / max(t, 1):.0f}%" for (lo, hi), h, t in zip(BINS, hit.tolist(), total.tolist()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--attn", choices=("nsa", "dense"), default="nsa")
    ap.add_argument("--branch", default="all", help="nsa_branch: win = the window alone")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--pairs", type=int, default=96, help="distinct pairs per row (at most 127)")
    ap.add_argument("--min_pairs", type=int, default=0, help="rows draw their pair count from [min_pairs, pairs]")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warm_steps", type=int, default=0, help="steps on short rows first")
    ap.add_argument("--warm_seq", type=int, default=256)
    ap.add_argument("--warm_pairs", type=int, default=16)
    ap.add_argument("--warm_batch", type=int, default=32)
    ap.add_argument("--warm_branch", default="", help="NSA branch(es) on during the short rows, e.g. win")
    ap.add_argument("--warm_task", choices=("pairs", "copy"), default="pairs",
                    help="the short rows: repeated pairs, or a random segment repeated (copy)")
    ap.add_argument("--task", choices=("pairs", "recall"), default="pairs",
                    help="the rows at --seq: repeated pairs, or the shipped recall task ([recall] of recall.toml)")
    ap.add_argument("overrides", nargs="*", help="more config overrides, e.g. model.head_dim=64")
    a = ap.parse_args()
    extra = [arg for o in a.overrides for arg in ("--" + o.split("=", 1)[0], o.split("=", 1)[1])]
    cfg, _ = load_config(["--config", str(ROOT / "train_configs" / "recall.toml"), "--model.attention", a.attn,
                          "--model.nsa_branch", a.branch, "--training.seq_len", str(a.seq), "--optimizer.lr",
                          str(a.lr), "--training.steps", str(a.steps), *extra], world_size=1)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Transformer(cfg.model, a.seq)
    model.to_empty(device="cpu")
    model.init_weights(0)
    opt = build_optimizer(model, cfg.optimizer)
    sched = build_lr_scheduler(opt, a.steps + a.warm_steps, cfg.lr_scheduler)
    print(sum(p.numel() for p in model.parameters()), "params", flush=True)
    gen, held_out = torch.Generator().manual_seed(1), torch.Generator().manual_seed(99)
    evals = [bigram_batch(held_out, 8, a.seq, a.pairs) for _ in range(4)]
    layout, distances = recall_layout(cfg.recall, a.seq, cfg.model.vocab_size)
    recall_evals = [32, 96, 256, 512, 960]
    start = time.time()
    warm_off = contextlib.ExitStack()  # during the short rows: the branches not in --warm_branch off
    for layer in range(len(model.layers) if a.warm_branch else 0):
        for branch in NSAAttention.BRANCHES:
            if branch not in a.warm_branch:
                warm_off.enter_context(model.branch_off(layer, branch))
    for step in range(1, a.steps + a.warm_steps + 1):
        if step == a.warm_steps + 1:
            warm_off.close()
        if step <= a.warm_steps and a.warm_task == "copy":
            x, y = copy_batch(gen, a.warm_batch, a.warm_seq)
        elif step <= a.warm_steps:
            x, y, *_ = bigram_batch(gen, a.warm_batch, a.warm_seq, a.warm_pairs, a.min_pairs)
        elif a.task == "recall":
            rows = [recall_sample(layout, cfg.data.seed, step * a.batch + i, distances)[0] for i in range(a.batch)]
            x, y = torch.stack([r.inputs for r in rows]), torch.stack([r.labels for r in rows])
        else:
            x, y, *_ = bigram_batch(gen, a.batch, a.seq, a.pairs, a.min_pairs)
        loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 50 == 0 or step == 1:
            report = "" if step % 100 else accuracy_by_distance(model, evals) if a.task == "pairs" else " ".join(
                f"{d}:{100 * c / max(n, 1):.0f}%" for d, (c, n) in evaluate_recall(model, cfg, recall_evals, 2).items())
            print(f"step {step} loss {loss.item():.3f} {time.time() - start:.0f}s {report}", flush=True)
    if a.task == "pairs":
        diagnose(model, evals)
    else:  # exact recall of the shipped task by distance, then with each branch of each layer off
        model.eval()
        with torch.no_grad():
            print(recall_table(recall_ablations(model, cfg, recall_evals, 8) if a.attn == "nsa" else
                               {"all on": evaluate_recall(model, cfg, recall_evals, 8)}))


def diagnose(model: Transformer, evals: list) -> None:
    """Accuracy by how often the key was seen before, and with each NSA branch switched off."""
    for seen in (1, 2, 3, 4):
        print(f"keys seen {seen}x before: {accuracy_by_distance(model, evals, seen)}")
    for layer in range(len(model.layers) if model.cfg.attention == "nsa" else 0):
        for branch in NSAAttention.BRANCHES:
            with model.branch_off(layer, branch):
                print(f"layer {layer} {branch} off: {accuracy_by_distance(model, evals)}")


if __name__ == "__main__":
    main()
