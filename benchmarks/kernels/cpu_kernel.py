"""NSA's C++ CPU kernel branch by branch (`models/attention/families/cpp/cpu_attention.py`), at a config's shape.

    python benchmarks/kernels/cpu_kernel.py [--config train_configs/recall.toml] [--explore 8] [--repeats 15] [-- overrides...]

At the config's batch, seq_len, heads, KV groups, head_dim and NSA block sizes (after the overrides, as
`run_train.sh` takes them: `-- --training.seq_len 8192 --training.local_batch_size 1`), fp32, random queries,
keys and values: the sel forward, its backward and the block scores' weight gradient
(`sel_weight_grad`, `--explore` explored blocks per query beside the n read ones), the win forward and
backward, the cmp forward with the group probabilities the sel blocks are chosen from, the cmp
backward, the choice of the sel blocks from those probabilities (as training makes it: a chunk of
`CHUNK_CMP` queries at a time, without documents and with documents of ~1,024 tokens, and beside it the
same in PyTorch, `common.choose_blocks`), the explored blocks' draw and the
scores' gradient through the cmp probabilities (`cmp_scores_backward`); beside the win and cmp
backwards, ATen's fused attention on the PyTorch path's chunks, which training takes for runs of
`FUSED_BACKWARD_KEYS` keys or more. The sel blocks are each query's forced ones (first, local) and
random others of those it can see. Prints the minimum milliseconds over `--repeats` after one warm-up. To compare two versions of the kernel, run it
in each checkout (`git worktree add ../old HEAD~1`) one after the other, twice.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from nsa_titan.config import load_config  # noqa: E402
from nsa_titan.models.attention import Documents, common  # noqa: E402
from nsa_titan.models.attention.families.cpp import cpu_attention  # noqa: E402
from nsa_titan.models.attention.families.pytorch import fast_shared  # noqa: E402
from nsa_titan.models.transformer import nsa_spec  # noqa: E402


def best_ms(f: Callable[[], object], repeats: int) -> float:
    """The minimum milliseconds of f over `repeats` calls, after one warm-up."""
    f()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        f()
        times.append(time.perf_counter() - start)
    return 1e3 * min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(ROOT / "train_configs" / "recall.toml"))
    parser.add_argument("--explore", type=int, default=8, help="explored blocks per query in the weight gradient")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("overrides", nargs="*", help="config overrides after --")
    args = parser.parse_args()
    cfg, _ = load_config(["--config", args.config, *args.overrides], world_size=1)
    m, B, T = cfg.model, cfg.training.local_batch_size, cfg.training.seq_len
    spec, G, D = nsa_spec(m), m.n_kv_groups, m.head_dim
    r = m.n_heads // G
    if why := cpu_attention.problem(torch.device("cpu"), torch.float32, spec, r, D):
        raise SystemExit(why)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(B, G, T, r, D, generator=gen)
    k, v, do = torch.randn(B, G, T, D, generator=gen), torch.randn(B, G, T, D, generator=gen), torch.randn_like(q)
    t, Ns = torch.arange(T), spec.num_sel_blocks(T)
    score = torch.rand(B, G, T, Ns, generator=gen).masked_fill(torch.arange(Ns) * spec.l_sel > t[:, None], -1.0)
    score[..., 0] = 2.0  # the first block and the local one: forced
    score.scatter_(-1, (t // spec.l_sel)[None, None, :, None].expand(B, G, T, 1), 3.0)
    idx = score.topk(min(spec.n + args.explore, Ns), -1).indices
    valid = score.gather(-1, idx) >= 0
    n = min(spec.n, Ns)
    out, lse = cpu_attention.sel_forward(q, k, v, idx[..., :n], valid[..., :n], spec, None, 0)
    w_out, w_lse = cpu_attention.window_forward(q, k, v, spec, None, 0)
    kc = torch.randn(B, G, spec.num_cmp_blocks(T), D, generator=gen)
    keys = cpu_attention.cmp_keys(kc, torch.randn_like(kc))
    c_out, c_lse = torch.empty_like(q), torch.empty(B, G, T, r)
    group = cpu_attention.cmp_forward(q, keys, c_out, c_lse, 0, T, 0, spec, None)
    d_log_s = torch.randn(idx.shape, generator=gen) * (idx > 0)
    docs = Documents.of(torch.cumsum(torch.rand(B, T, generator=gen) < 1 / 1024, 1), spec)
    chunks = [(t0, group[:, :, t0:t0 + fast_shared.CHUNK_CMP].contiguous()) for t0 in range(0, T, fast_shared.CHUNK_CMP)]

    def choice(choose: Callable, documents: Documents | None) -> Callable[[], object]:
        return lambda: [choose(g, spec, t0, T, documents) for t0, g in chunks]

    fused = {kind: (lambda a, kind=kind: fast_shared.shared_backward(do, q, *a, kind, spec, 0, None, None, "torch"))
             for kind in ("win", "cmp")}  # the PyTorch path: ATen's fused attention chunk by chunk
    rows: dict[str, Callable[[], object]] = {
        "sel forward": lambda: cpu_attention.sel_forward(q, k, v, idx[..., :n], valid[..., :n], spec, None, 0),
        "sel backward": lambda: cpu_attention.sel_backward(do, q, k, v, idx[..., :n], valid[..., :n], out, lse, spec,
                                                           None, 0),
        f"sel weight gradient ({n} read + {idx.shape[-1] - n} explored)":
            lambda: cpu_attention.sel_weight_grad(do, q, k, v, idx, valid, n, spec, None, 0),
        "win forward": lambda: cpu_attention.window_forward(q, k, v, spec, None, 0),
        "win backward": lambda: cpu_attention.window_backward(do, q, k, v, w_out, w_lse, spec, None, 0),
        "win backward, ATen fused (chunks)": lambda: fused["win"]((k, v, w_out, w_lse)),
        "cmp forward (with group probabilities)":
            lambda: cpu_attention.cmp_forward(q, keys, c_out, c_lse, 0, T, 0, spec, None),
        "cmp backward": lambda: cpu_attention.cmp_backward(do, q, kc, kc, c_out, c_lse, spec, 0, None),
        "cmp backward, ATen fused (chunks)": lambda: fused["cmp"]((kc, kc, c_out, c_lse)),
        "sel choice (top n from the group probabilities, chunk by chunk)": choice(cpu_attention.choose_blocks, None),
        "sel choice, PyTorch": choice(common.choose_blocks, None),
        "sel choice, documents of ~1,024": choice(cpu_attention.choose_blocks, docs),
        "sel choice, documents of ~1,024, PyTorch": choice(common.choose_blocks, docs),
        f"explored blocks' draw ({idx.shape[-1] - n} a query)":
            lambda: cpu_attention.explore_blocks(idx[..., :n], t[None], Ns, spec, idx.shape[-1] - n, 0),
        "scores' gradient through the cmp probabilities": lambda: cpu_attention.cmp_scores_backward(q, kc, idx, d_log_s,
                                                                                                     spec, 0),
    }
    print(f"{args.config}: B {B}, T {T:,}, {m.n_heads} heads, {G} KV groups, head_dim {D}, l {spec.l}, d {spec.d}, "
          f"l' {spec.l_sel}, n {spec.n}, w {spec.w}; {torch.get_num_threads()} threads\n\n| kernel | ms |\n|---|---|")
    for name, f in rows.items():
        print(f"| {name} | {best_ms(f, args.repeats):.1f} |")


if __name__ == "__main__":
    main()
