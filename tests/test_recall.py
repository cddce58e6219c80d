"""The long-range recall task: where its answers are, exact resume, and the evaluation's accuracy."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from conftest import ROOT, tb_run, torchrun

from nsa_titan.config import ConfigError, Data, Recall, load_config
from nsa_titan.data import build_dataloader
from nsa_titan.data.recall import (
    IGNORE, KEY, QUERY, RecallLayout, drill_sample, oracle_logits, recall_accuracy, recall_layout, recall_sample,
)
from nsa_titan.data.tokenizer import ByteTokenizer
from nsa_titan.evaluate import evaluate_recall, recall_routing
from nsa_titan.models.nsa_stats import gate_stats
from nsa_titan.models.transformer import Transformer

LAYOUT = RecallLayout(seq_len=256, vocab_size=64, key_tokens=3, value_tokens=2, pairs=4)


def test_pairs_sit_at_their_distance_and_only_values_are_labelled():
    S = LAYOUT.span
    for k in range(20):
        sample, placed = recall_sample(LAYOUT, 0, k, [9, 40, 200])
        x = sample.inputs
        queries = (x == QUERY).nonzero().flatten().tolist()
        assert 1 <= len(queries) == len(placed) <= LAYOUT.pairs
        in_pairs = torch.zeros_like(x, dtype=torch.bool)
        distances = []
        for q in queries:
            key = x[q + 1:q + 4].tolist()
            d = next(d for d in (9, 40, 200) if q >= d and x[q - d] == KEY and x[q - d + 1:q - d + 4].tolist() == key)
            p = q - d
            distances.append(d)
            assert sample.labels[q + 3:q + 5].tolist() == x[p + 4:p + 6].tolist()  # position q+3 predicts value 1
            in_pairs[p:p + S] = in_pairs[q:q + S] = True
        assert sorted(distances) == sorted(placed)
        assert int((sample.labels != IGNORE).sum()) == 2 * len(queries)
        assert bool((x[~in_pairs] >= 2 + LAYOUT.alphabet).all())  # the rest is filler, disjoint from keys


def test_a_perfect_oracle_scores_100_percent():
    samples = [recall_sample(LAYOUT, 1, k, [9, 100, 240])[0] for k in range(16)]
    inputs, labels = torch.stack([s.inputs for s in samples]), torch.stack([s.labels for s in samples])
    correct, total = recall_accuracy(oracle_logits(inputs, LAYOUT).argmax(-1), labels, LAYOUT)
    assert total >= 16 and correct == total


def test_accuracy_counts_a_query_only_when_every_value_token_is_right():
    sample = recall_sample(LAYOUT, 2, 0, [50])[0]
    logits = oracle_logits(sample.inputs[None], LAYOUT)
    first = int((sample.labels != IGNORE).nonzero()[0])
    logits[0, first] = 0  # one value token of the first query is now wrong (argmax 0 = KEY)
    correct, total = recall_accuracy(logits.argmax(-1), sample.labels[None], LAYOUT)
    assert correct == total - 1


class Copier(torch.nn.Module):
    """A hand-built model: recalls perfectly (the oracle) or never (always a filler token)."""

    def __init__(self, perfect: bool):
        super().__init__()
        self.perfect = perfect

    def forward(self, tokens: torch.Tensor, document_ids: torch.Tensor | None = None) -> torch.Tensor:
        if self.perfect:
            return oracle_logits(tokens, LAYOUT)
        logits = torch.zeros(*tokens.shape, LAYOUT.vocab_size)
        logits[..., -1] = 1.0
        return logits


def test_the_evaluation_on_models_that_always_and_never_copy():
    cfg, _ = load_config(["--data.source", "recall", "--training.seq_len", "256", "--model.vocab_size", "64",
                          "--training.local_batch_size", "3", "--recall.key_tokens", "3", "--recall.value_tokens", "2"],
                         world_size=1)
    perfect = evaluate_recall(Copier(True), cfg, [10, 100, 240], batches=2)
    never = evaluate_recall(Copier(False), cfg, [10, 100, 240], batches=2)
    assert all(c == n >= 6 for c, n in perfect.values())
    assert all(c == 0 and n >= 6 for c, n in never.values())
    with pytest.raises(ValueError, match="does not fit in seq_len 256"):
        evaluate_recall(Copier(True), cfg, [250], batches=1)


def test_the_recall_probe_shared_out_among_ranks_counts_what_one_process_counts():
    """Batches shared out among data-parallel ranks (5 batches on 2 ranks: one rank runs its last again, for the
    collectives, and counts it once), summed, against one process; on a model that recalls some rows only."""
    cfg, _ = load_config(["--data.source", "recall", "--training.seq_len", "256", "--model.vocab_size", "64",
                          "--training.local_batch_size", "3", "--recall.key_tokens", "3", "--recall.value_tokens", "2"],
                         world_size=1)

    class Some(torch.nn.Module):  # recalls the rows whose token sum is even
        def forward(self, tokens: torch.Tensor, document_ids: torch.Tensor | None = None) -> torch.Tensor:
            return oracle_logits(tokens, LAYOUT) * (tokens.sum(1) % 2 == 0)[:, None, None]

    one = evaluate_recall(Some(), cfg, [10, 100], batches=5)
    parts = [evaluate_recall(Some(), cfg, [10, 100], batches=5, dp_rank=r, dp_world=2) for r in range(2)]
    assert {d: tuple(map(sum, zip(*(p[d] for p in parts)))) for d in one} == one
    assert all(0 < c < n == 5 * 3 * 4 for c, n in one.values()), one  # some recalled, some not: 5 x 3 rows x 4 pairs


@pytest.mark.parametrize("top_n", [3, 8])
def test_routing_finds_the_block_holding_the_pairs_copy_exactly_when_it_is_chosen(top_n):
    """seq 128 in 16-token sel blocks. With top_n 8 every visible block is chosen, so the copy's block
    is always found; with top_n 3 only the forced ones (block 0 and the query's two local blocks),
    so it is found exactly when the copy lies in one of those."""
    cfg, _ = load_config(["--data.source", "recall", "--training.seq_len", "128", "--model.vocab_size", "64",
                          "--training.local_batch_size", "4", "--recall.key_tokens", "3", "--recall.value_tokens", "2",
                          "--model.dim", "64", "--model.n_layers", "2", "--model.n_heads", "4", "--model.n_kv_groups", "2",
                          "--model.head_dim", "16", "--model.cmp_block_size", "16", "--model.cmp_stride", "8",
                          "--model.sel_block_size", "16", "--model.sel_top_n", str(top_n), "--model.window_size", "32"],
                         world_size=1)
    model = Transformer(cfg.model, 128)
    model.init_weights(0)
    distances = [20, 40, 100]
    routing = recall_routing(model, cfg, distances, batches=2)
    layout = RecallLayout(128, 64, 3, 2, cfg.recall.pairs)
    for d in distances:
        forced = []  # per labelled position: is the copy's block one of the forced ones
        for k in range(8):
            labels = recall_sample(layout, cfg.data.seed + 1, k, [d])[0].labels
            t = (labels != IGNORE).nonzero().flatten()
            block, copy = t // 16, (t + 1 - d) // 16
            forced += ((copy == 0) | (block - copy < 2)).tolist()
        expected = 1.0 if top_n == 8 else sum(forced) / len(forced)
        assert set(routing[d]) == {"value tokens", "layer 0 found", "layer 1 found"}
        assert routing[d]["layer 0 found"] == routing[d]["layer 1 found"] == pytest.approx(expected, abs=1e-6)
    if top_n == 3:
        assert 0 < routing[20]["layer 0 found"] < 1 and routing[100]["layer 0 found"] < routing[20]["layer 0 found"]
    assert all(m.selection is None for m in model.modules() if hasattr(m, "selection"))


@pytest.mark.parametrize("workers,drill", [(0, False), (2, False), (2, True)])
def test_recall_loader_resumes_exactly(workers, drill):
    data = Data(source="recall", num_workers=workers, seed=5)
    recall = Recall(key_tokens=3, value_tokens=2, pairs=4, min_distance=8, drill=drill)
    make = lambda: build_dataloader(data, ByteTokenizer(), 128, 64, 2, 1, 2, recall)  # noqa: E731
    reference = [b for b, _ in zip(make(), range(7))]
    first = make()
    it = iter(first)
    [next(it) for _ in range(3)]
    resumed = make()
    resumed.load_state_dict(first.state_dict())
    for a, b in zip(resumed, reference[3:]):
        assert torch.equal(a.inputs, b.inputs) and torch.equal(a.labels, b.labels)


def test_each_pair_is_asked_asks_times_at_its_drawn_distances():
    layout = RecallLayout(seq_len=512, vocab_size=64, key_tokens=3, value_tokens=2, pairs=6, asks=3)
    S, K = layout.span, layout.key_tokens
    n_pairs = 0
    for k in range(20):
        sample, placed = recall_sample(layout, 0, k, list(range(9, 200)))
        x = torch.cat([sample.inputs, sample.labels[-1:]])  # the whole row: a query may end it
        pairs = {tuple(x[p + 1:p + S].tolist()): p for p in (x == KEY).nonzero().flatten().tolist()}
        queries = (x == QUERY).nonzero().flatten().tolist()
        assert len(queries) == 3 * len(pairs) == len(placed)
        distances = []
        for q in queries:
            p = pairs[tuple(x[q + 1:q + S].tolist())]  # the query repeats a pair before it
            distances.append(q - p)
            assert sample.labels[q + K:q + S - 1].tolist() == x[p + K + 1:p + S].tolist()
        assert sorted(distances) == sorted(placed)
        assert int((sample.labels != IGNORE).sum()) == len(queries) * layout.value_tokens
        n_pairs += len(pairs)
    assert n_pairs >= 20


def one_token_lookup(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(B, T, vocab) one-hot logits of the lookup one attention layer with `smear` can do: at each
    position, the token that followed the latest earlier occurrence of this position's token."""
    logits = torch.zeros(*tokens.shape, vocab_size)
    for b, row in enumerate(tokens.tolist()):
        after: dict[int, int] = {}
        for t, token in enumerate(row):
            if token in after:
                logits[b, t, after[token]] = 1.0
            if t:
                after[row[t - 1]] = token
    return logits


@pytest.mark.parametrize("distinct", [True, False])
def test_distinct_rows_make_the_one_token_lookup_exact(distinct):
    """`[recall] distinct`: no key or value token is shared by two pairs of a row, so a key's last
    token names its pair and the one-token lookup recalls every query exactly; with repeats (the
    default), it does not."""
    layout = RecallLayout(seq_len=512, vocab_size=64, key_tokens=3, value_tokens=2, pairs=6, asks=2, distinct=distinct)
    S, correct, total, shared = layout.span, 0, 0, 0
    for k in range(20):
        sample, placed = recall_sample(layout, 0, k, list(range(9, 200)))
        x = torch.cat([sample.inputs, sample.labels[-1:]])
        kv = [x[p + 1:p + S].tolist() for p in (x == KEY).nonzero().flatten().tolist()]
        tokens = [t for pair in kv for t in pair]
        shared += len(tokens) - len(set(tokens))
        assert len(placed) == 2 * len(kv) >= 4
        c, n = recall_accuracy(one_token_lookup(sample.inputs[None], 64).argmax(-1), sample.labels[None], layout)
        correct, total = correct + c, total + n
    if distinct:
        assert shared == 0 and correct == total
    else:
        assert shared > 0 and correct < total


def test_drill_rows_label_every_value_whose_key_came_before():
    """`[recall] drill`: `k v k v ...` of at most `pairs` pairs from the key-value alphabet, each key
    always followed by its value; a value is labelled exactly when its key came earlier in the row."""
    layout = RecallLayout(seq_len=255, vocab_size=64, pairs=6, drill=True)
    for k in range(10):
        sample = drill_sample(layout, 0, k)
        row = torch.cat([sample.inputs, sample.labels[-1:]]).tolist()  # the 256 tokens of the row
        keys, values = row[0::2], row[1::2]
        assert all(2 <= t < 2 + layout.alphabet for t in row)
        value_of = dict(zip(keys, values))
        assert len(value_of) <= 6 and all(value_of[key] == v for key, v in zip(keys, values))
        expected = [IGNORE] * 256
        for i, key in enumerate(keys):
            if key in keys[:i]:
                expected[2 * i + 1] = values[i]
        assert sample.labels.tolist() == expected[1:]
    assert sum(drill_sample(layout, 0, k).labels.ne(IGNORE).sum() for k in range(10)) > 10 * 100
    with pytest.raises(ValueError, match="lower \\[recall\\] pairs"):
        RecallLayout(seq_len=64, vocab_size=64, pairs=40, drill=True).check(20)


def test_log_scale_draws_every_scale_equally_often():
    """`distance_scale = log`: as many training distances in [16, 32) as in [512, 1024), the ends
    included; `linear`: each distance once; `mixed`: half of each, so the longest distances come
    over twice as often as on the log scale."""
    layout, linear = recall_layout(Recall(min_distance=16, max_distance=1006), 1024, 256)
    assert linear == list(range(16, 1007))
    _, log = recall_layout(Recall(min_distance=16, max_distance=1006, distance_scale="log"), 1024, 256)
    assert log[0] == 16 and log[-1] == 1006 and log == sorted(log)
    octaves = [sum(lo <= d < 2 * lo for d in log) for lo in (16, 32, 64, 128, 256, 512)]
    assert max(octaves) - min(octaves) <= 2, octaves  # 1006 / 16 = 2^5.97: six octaves, the last one short
    drawn = [d for k in range(40) for d in recall_sample(layout, 0, k, log)[1]]
    assert sum(d < 128 for d in drawn) > len(drawn) / 3  # linear: 11% of [16, 1006] lies below 128
    _, mixed = recall_layout(Recall(min_distance=16, max_distance=1006, distance_scale="mixed"), 1024, 256)
    even = mixed[len(log):]  # `mixed`: the log scale's distances and as many evenly spaced ones
    assert mixed[:len(log)] == log and len(even) == len(log) and even[0] == 16 and even[-1] == 1006
    assert max(b - a for a, b in zip(even, even[1:])) - min(b - a for a, b in zip(even, even[1:])) <= 1
    share = lambda ds, lo: sum(d >= lo for d in ds) / len(ds)  # noqa: E731
    assert share(mixed, 900) > 2 * share(log, 900) and share(mixed, 900) == (share(log, 900) + share(even, 900)) / 2


def test_gate_statistics_of_the_labelled_tokens_average_their_gates_alone():
    """`[metrics] nsa_stats` on a recall batch: `gate_*_labelled` is each branch's mean gate over the answers."""
    gates = torch.full((2, 6, 4, 3), 0.25)  # (B, T, H, branch)
    answers = torch.zeros(2, 6, dtype=torch.bool)
    answers[0, 4], answers[1, 1] = True, True
    gates[..., 1][answers] = 0.75  # the sel gate is 0.75 at the answers, 0.25 elsewhere
    gates[1, 1, 0] = torch.tensor([0.5, 0.25, 1.0])
    stats = gate_stats(gates, answers)
    assert float(stats["gate_sel"]) == pytest.approx((40 * 0.25 + 7 * 0.75 + 0.25) / 48)
    assert float(stats["gate_sel_labelled"]) == pytest.approx((7 * 0.75 + 0.25) / 8)
    assert float(stats["gate_cmp_labelled"]) == pytest.approx((7 * 0.25 + 0.5) / 8)
    assert float(stats["gate_win_labelled"]) == pytest.approx((7 * 0.25 + 1.0) / 8)
    assert "gate_sel_labelled" not in gate_stats(gates)


@pytest.mark.parametrize("override,message", [
    (["--recall.min_distance", "3"], "min_distance = 3: must lie in"),
    (["--recall.max_distance", "300"], "max_distance = 300"),
    (["--recall.pairs", "0"], "pairs = 0: must be >= 1"),
    (["--recall.asks", "0"], "asks = 0: must be >= 1"),
    (["--recall.distance_scale", "square"], "distance_scale"),
    (["--recall.distinct", "true", "--recall.pairs", "40", "--model.vocab_size", "64"],
     "distinct needs pairs x \\(key_tokens \\+ value_tokens\\) = 320 distinct tokens.*raise \\[model\\] vocab_size to at least 642"),
])
def test_bad_recall_sizes_are_config_errors(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(["--data.source", "recall", "--training.seq_len", "256", *override], world_size=1)


@pytest.mark.multiprocess
def test_the_shipped_recall_config_trains_and_its_checkpoint_is_evaluated_by_distance(tmp_path):
    """train_configs/recall.toml as the report runs it (loader worker, gate statistics, final save),
    shortened; then `nsa_titan.evaluate --task recall --ablate` on the step folder."""
    proc = torchrun(["-m", "nsa_titan.train", "--config", str(ROOT / "train_configs" / "recall.toml"),
                     "--training.steps", "3", "--metrics.log_freq", "1", "--job.dump_folder", str(tmp_path)], nproc=1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    events = EventAccumulator(tb_run(tmp_path / "tb"))
    events.Reload()
    assert [e.step for e in events.Scalars("nsa/layer1/gate_sel")] == [1, 2, 3]
    answers = [e.value for e in events.Scalars("nsa/layer0/gate_sel_labelled")]  # the gates at the answers alone
    assert len(answers) == 3 and answers != [e.value for e in events.Scalars("nsa/layer0/gate_sel")]
    out = subprocess.run([sys.executable, "-m", "nsa_titan.evaluate", str(tmp_path / "checkpoint" / "step-3"),
                          "--task", "recall", "--distances", "32", "900", "--batches", "1", "--plot",
                          str(tmp_path / "recall.png"), "--ablate"],
                         capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    table, rest = out.stdout.split("value tokens predicted right")
    routing, ablations = rest.split("with one branch switched off")
    rows = [line.split("|")[1:4] for line in table.splitlines() if line.startswith("| ") and "%" in line]
    assert [r[0].strip() for r in rows] == ["32", "900"] and all(int(r[2]) >= 8 for r in rows)
    assert "| distance | value tokens | layer 0 found | layer 1 found |" in routing
    assert [line.split("|")[1].strip() for line in routing.splitlines() if "%" in line] == ["32", "900"]
    names = [line.split("|")[1].strip() for line in ablations.splitlines() if "%" in line]
    assert names == ["all on"] + [f"layer {i} {b} off" for i in (0, 1) for b in ("cmp", "sel", "win")]
    assert [line.split("|")[2:4] for line in ablations.splitlines() if "all on" in line][0] == \
        [f" {r[1].strip()} " for r in rows]  # the same held-out queries with every branch on
    assert Image.open(tmp_path / "recall.png").size == (820, 500)
