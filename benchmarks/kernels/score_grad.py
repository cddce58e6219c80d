"""The block scores' straight-through gradient alone (`routing.with_score_grad`, `[model] sel_score_grad`),
one NSA layer's worth, forward and backward, side by side in one process.

    python benchmarks/kernels/score_grad.py [--config train_configs/recall.toml] [--explore 8] [--repeats 5]

At the config's shape (batch, seq_len, heads, KV groups, head_dim, l, d, l', n) with random queries,
compressed keys, sel keys and values, the blocks chosen by the cmp probabilities as the attention returns
them, and `--explore` explored blocks per query. Rows: dL/dlog s_j in PyTorch (`score_grad`, every
earlier key's logit as matrix products) or in NSA's C++ kernel (the read and explored blocks' keys
alone); the choice given or recomputed from the cmp probabilities (`chosen = None`). Prints the
minimum milliseconds over `--repeats`.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from nsa_titan.config import load_config  # noqa: E402
from nsa_titan.models.attention import nsa_fast, with_score_grad  # noqa: E402
from nsa_titan.models.attention.families.cpp import cpu_attention  # noqa: E402
from nsa_titan.models.transformer import nsa_spec  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(ROOT / "train_configs" / "recall.toml"))
    parser.add_argument("--explore", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    a = parser.parse_args()
    cfg, _ = load_config(["--config", a.config], world_size=1)
    m, spec = cfg.model, nsa_spec(cfg.model)
    B, T, H, G, D = cfg.training.local_batch_size, cfg.training.seq_len, m.n_heads, m.n_kv_groups, m.head_dim
    gen = torch.Generator().manual_seed(0)
    q, kc, vc = (torch.randn(B, n, h, D, generator=gen) for n, h in ((T, H), (spec.num_cmp_blocks(T), G),
                                                                      (spec.num_cmp_blocks(T), G)))
    ks, vs, kw, vw = (torch.randn(B, T, G, D, generator=gen) for _ in range(4))
    gates, d_o = torch.rand(B, T, H, 3, generator=gen), torch.randn(B, T, H, D, generator=gen)
    _, idx, valid = nsa_fast(q, kc, vc, ks, vs, kw, vw, gates, spec, return_selection=True)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; B {B}, T {T}, H {H}, G {G}, D {D}, {spec}, "
          f"explore {a.explore}")
    print("| dL/dlog s_j | blocks | forward + backward (ms) |\n|---|---|---|")
    for kernel in ("torch", "cpp"):
        if kernel == "cpp" and (why := cpu_attention.problem(q.device, q.dtype, spec, H // G, D)):
            print(f"| cpp | - | {why} |")
            continue
        for chosen in ((idx, valid), None):
            times = []
            for _ in range(a.repeats + 1):
                leaves = (q.clone().requires_grad_(), kc.clone().requires_grad_())
                start = time.perf_counter()
                out = with_score_grad(leaves[0] * 0.0, *leaves, ks, vs, gates, spec, 1.0, explore=a.explore, seed=1,
                                      chosen=chosen, kernel=kernel)
                torch.autograd.grad(out, leaves, d_o)
                times.append(time.perf_counter() - start)
            print(f"| {kernel} | {'given' if chosen else 'recomputed'} | {1e3 * min(times[1:]):.1f} |")


if __name__ == "__main__":
    main()
