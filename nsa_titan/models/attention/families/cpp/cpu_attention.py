"""NSA's own attention kernel for CPUs (`csrc/cpu_attention.cpp`), for every branch, fp32.

Each branch is, per (batch x group, query), softmax attention over a few runs of consecutive keys
(cmp: the visible compressed slots; sel: the chosen blocks of l'; win: the last w keys), the r
query heads of the group side by side. The kernel reads each query's runs in one pass: scores,
softmax and both products in a per-thread buffer, no gathered rows, no zero-filled tile buffers.
For cmp it also returns each query's probabilities summed over the group's heads, which the sel
blocks are chosen from (here too, with or without documents: `choose_blocks`, per chunk of queries). The backward
goes query by query, each thread adding into its own dk, dv; the sel backward of longer sequences goes
block by block instead, through the reverse index (`block_readers`), a chunk of queries at a time, so
that its working set does not grow with T; so does the sel forward of longer sequences (an online
softmax over each query's blocks). The cmp backward of long runs of keys is left to ATen's fused
attention (`own_backward`), faster there. The block scores' straight-through gradient (`routing.py`) runs
here too: dL/dlog s_j query by query (`sel_weight_grad`), the explored blocks' draw (`explore_blocks`)
and, without documents, its way back through the cmp probabilities (`cmp_scores_backward`). So does the
gated sum of the branches (`mix`): one pass, straight into the heads' layout.

Built at first use by torch.utils.cpp_extension for the machine it runs on (`scripts/install.sh`
builds it; a cached build loads in a fraction of a second). Where it cannot be built or cannot take
a problem, `problem()` says why and `kernels = auto` keeps the PyTorch kernels."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F

from .....system.hostcpu import cpu_flags
from ... import common
from ...common import block_readers
from ...documents import Documents
from ...spec import NSASpec

SOURCES = (Path(__file__).parent / "csrc" / "cpu_attention.cpp", Path(__file__).parent / "csrc" / "tiles.h")
"""The kernel and its vector layer (a header, built in; `tests/test_cpu_attention.py` also builds it alone)."""
HEADS = (1, 2, 3, 4, 6, 8, 16)
HEAD_DIMS = (16, 32, 64, 128)
ROWS_MAX_KEYS = 4096
"""The sel backward goes query by query up to this many keys per (batch, group), block by block
beyond (2-core AMD EPYC, M7C shape: 0.079 against 0.079 s at 2k, 0.41 against 0.37 s at 8k, 1.06
against 0.79 s at 16k)."""
FUSED_BACKWARD_KEYS = (256, 1024)
"""cmp runs of this many keys or more (the compressed keys of the sequence) go backward through ATen's
fused attention chunk by chunk (`fast_shared`), which beats this kernel's query-by-query backward there:
the first for groups of fewer than 4 query heads, the second for 4 or more (the kernel adds each key's dk, dv
once for the group's heads: the more heads, the more work per key). Shorter runs, and every win branch, stay
here. 2-core Intel Xeon (AVX-512), both on 2 threads (`benchmarks/kernels/cpu_kernel.py`, 2026-11-26): M7C (6
heads a group) cmp 103-119 against 124-142 ms at 8k (511 keys), 376 against 381 ms at 16k, 1.72 against
1.49 s at 32k (2,047 keys); recall.toml (2 heads, 511 keys) 35-44 against 21-32 ms; win (w = 512) 225
against 284-316 ms at 8k and 0.98 against 1.00 s at 32k, (w = 64) 10-15 against 15-23 ms."""
FORWARD_ROWS_MAX_KEYS = 8192
"""The sel forward goes query by query up to this many keys per (batch, group), block by block beyond
(2-core Intel Xeon, AVX-512, M7C shape, `benchmarks/kernels/sel_backward.py --forward`: 0.085 against 0.092 s at
4k, 0.177 against 0.186 s at 8k, 0.53 against 0.48 s at 16k, 1.13 against 0.84 s at 32k, 2.89 against
2.17 s at 64k). Query by query, each query reads its n blocks from all over the sequence, out of cache."""
CHUNK_BYTES = 1 << 20
"""The block-by-block sel forward and backward take the queries in chunks of this many bytes of q (as
many of dO and dq, or of the output), so that a chunk's rows stay in cache while the blocks they chose
pass (backward at 32k: 2.41 s in one chunk, 1.73 s in chunks of 1 MiB = 682 queries;
`benchmarks/kernels/sel_backward.py`)."""


CFLAGS = ["-O3", "-march=native", "-ffp-contract=fast", "-std=c++17", "-fopenmp"]
"""-fopenmp: at::parallel_for runs its loop on the intra-op threads only where OpenMP is on (torch's own
libgomp, loaded already: the same threads, `torch.set_num_threads` holds); without it, one thread."""


def tool_version(tool: str) -> str:
    """The first line `tool --version` prints (the first `tool` on PATH, as torch runs it), or "" if there is none."""
    found = shutil.which(tool)
    if found is None:
        return ""
    try:
        out = subprocess.run([found, "--version"], capture_output=True, text=True, timeout=60).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.splitlines()[0] if out else ""


def compiler() -> str:
    """The C++ compiler torch builds the kernels with (`CXX`, else `c++`) and its version: what -march=native means
    and how the kernels' sums are ordered depend on it."""
    cxx = os.environ.get("CXX", "c++")
    return f"{cxx}: {tool_version(cxx)}"


def _build_tag() -> str:
    """A tag of this CPU's instruction sets, the flags, the sources and where they are, the compiler and the ninja: a
    build for -march=native is only loaded where it was made, a changed header (which torch's own source check does
    not read) or another compiler builds anew, each checkout keeps its own build (one build folder for two paths
    would be rebuilt at every switch), and so does each ninja version (two read each other's build log as changed commands: a process of
    the venv's interpreter with the system's ninja first on PATH rebuilt the venv's build, two minutes on 2 cores,
    and the next process of the other kind rebuilt it back)."""
    text = " ".join([platform.machine(), *sorted(cpu_flags()), *CFLAGS, str(SOURCES[0]), f"ninja {tool_version('ninja')}",
                     compiler(),
                     *(p.read_text() for p in SOURCES)])
    return hashlib.sha1(text.encode()).hexdigest()[:10]


LOCK_WAIT = 300.0
"""Seconds a build (about a minute here) may take before `_build` names torch's build lock on stderr."""


@contextlib.contextmanager
def said_if_waiting(lock: Path, seconds: float) -> Iterator[None]:
    """Inside: if it has not finished after `seconds` and `lock` exists, one line on stderr naming the lock. torch
    waits on it without a word, and a build killed mid-way (a job stopped by hand) leaves it behind for good."""
    def say() -> None:
        if lock.exists():
            print(f"nsa_titan: waiting {seconds:.0f} s so far on torch's build lock {lock} for NSA's C++ kernels: "
                  "if no other build is running (a build killed mid-way leaves it behind), remove that file",
                  file=sys.stderr, flush=True)

    timer = threading.Timer(seconds, say)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


@functools.cache
def _build() -> tuple[ModuleType | None, str | None]:
    """The compiled kernels, or None and why not."""
    try:
        from torch.utils.cpp_extension import _get_build_directory, load

        name = f"nsa_titan_cpu_attention_{_build_tag()}"
        with said_if_waiting(Path(_get_build_directory(name, verbose=False)) / "lock", LOCK_WAIT):
            module = load(name=name, sources=[str(SOURCES[0])], extra_cflags=CFLAGS, extra_ldflags=["-fopenmp"],
                          verbose=False)
        return module, None
    except Exception as e:  # no compiler, no ninja, or it failed: the PyTorch kernels stay
        return None, f"NSA's C++ kernels did not build ({type(e).__name__}: {str(e).strip().splitlines()[-1][:200]})"


def kernels() -> ModuleType | None:
    """The compiled kernels, or None where they did not build (`problem` says why)."""
    return _build()[0]


@torch.compiler.assume_constant_result
def _build_problem() -> str | None:
    """Why the kernels did not build, or None; a constant to torch.compile, which runs it once while
    tracing (a block compiled with `kernels = None` chooses its kernels inside the graph)."""
    return _build()[1]


def problem(device: torch.device, dtype: torch.dtype, spec: NSASpec, heads_per_group: int, head_dim: int) -> str | None:
    """Why NSA's C++ kernels cannot run this problem, or None."""
    if device.type != "cpu":
        return f"NSA's C++ kernels run on CPUs and this run is on {device.type}"
    if torch.promote_types(dtype, torch.float32) != torch.float32:  # bf16 / fp16: sel and win in fp32 on CPUs
        return f"NSA's C++ kernels compute in float32, and the compute dtype is {dtype}"
    if heads_per_group not in HEADS or head_dim not in HEAD_DIMS:
        return (f"NSA's C++ kernels take {HEADS} query heads per KV group and head_dim in {HEAD_DIMS} (they are "
                f"{heads_per_group} and {head_dim})")
    return _build_problem()


def own_backward(kind: str, n_keys: int, heads_per_group: int) -> bool:
    """Whether this kernel's backward takes a win or cmp branch over `n_keys` keys (else ATen's fused
    attention does: `FUSED_BACKWARD_KEYS`)."""
    return kind == "win" or n_keys < FUSED_BACKWARD_KEYS[heads_per_group >= 4]


def _keys(x: torch.Tensor, reach: int = 0) -> torch.Tensor:
    """Keys or values (B, G, T, D) as rows (BG, P, D): P = T + reach + 16, zero rows after T, so that
    reading 16 keys at a time from a query's runs (or, `reach`, a whole block past it) never leaves them."""
    return F.pad(x, (0, 0, 0, reach + 16)).view(x.shape[0] * x.shape[1], -1, x.shape[-1])


def _backward_keys(ks: torch.Tensor, vs: torch.Tensor, reach: int = 0) -> tuple[torch.Tensor, ...]:
    """The keys as rows and transposed, and the values transposed: what both backwards read."""
    k = _keys(ks, reach)
    return k, _transposed(k), _transposed(_keys(vs, reach))


def _transposed(rows: torch.Tensor) -> torch.Tensor:
    """(BG, P, D) -> (BG, D, P), contiguous: 16 consecutive keys of one dimension are one vector."""
    return rows.transpose(1, 2).contiguous()


def _rows(x: torch.Tensor) -> torch.Tensor:
    """(B, G, Tq, ...) -> (B * G, Tq, ...), contiguous."""
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:]).contiguous()


def _sel_runs(idx: torch.Tensor, valid: torch.Tensor, spec: NSASpec, start: torch.Tensor | None) -> torch.Tensor:
    """(BG, Tq, n') int32: the first key of each chosen block (its document's start + j l'), -1 if none."""
    first = idx * spec.l_sel if start is None else start[:, None, :, None] + idx * spec.l_sel
    return _rows(torch.where(valid, first, -1).to(torch.int32))


def _window_runs(B: int, G: int, Tq: int, spec: NSASpec, start: torch.Tensor | None, q0: int) -> torch.Tensor:
    """(BG, Tq, 1) int32: the first key of each query's window, t - w + 1, not before its document."""
    t = torch.arange(q0, q0 + Tq)[None, :]
    first = (t - spec.w + 1).clamp(min=0) if start is None else torch.maximum(t - spec.w + 1, start)
    return first.to(torch.int32).expand(B, Tq)[:, None, :, None].expand(B, G, Tq, 1).reshape(B * G, Tq, 1).contiguous()


def _forward(q: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor, runs: torch.Tensor, L: int, q0: int
             ) -> tuple[torch.Tensor, torch.Tensor]:
    B, G, Tq, r, D = q.shape
    kt, v = _transposed(_keys(ks)), _keys(vs)
    out, lse, _ = _build()[0].runs_forward(_rows(q), kt, v, runs, None, L, q0, D**-0.5, False)
    return out.view(q.shape), lse.view(B, G, Tq, r)


def _backward_rows(d_out: torch.Tensor, q: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, runs: torch.Tensor, L: int, q0: int, last: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    T, D = ks.shape[2], q.shape[-1]
    module, go = _build()[0], _rows(d_out)
    dq, dk, dv = module.runs_backward_rows(_rows(q), *_backward_keys(ks, vs), runs, last, go, _rows(lse),
                                           module.delta(go, _rows(out)), L, q0, D**-0.5)
    return dq.view(q.shape), dk[:, :T].view(ks.shape), dv[:, :T].view(vs.shape)


def sel_forward(q: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor, idx: torch.Tensor, valid: torch.Tensor,
                spec: NSASpec, start: torch.Tensor | None, q0: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`fast_sel.selected_forward`'s contract (no host bounds needed): out (B, G, Tq, r, D), logsumexp (B, G, Tq, r).
    Query by query up to FORWARD_ROWS_MAX_KEYS keys, else block by block through the reverse index."""
    B, G, Tq, r, D = q.shape
    T, L = ks.shape[2], spec.l_sel
    if T <= FORWARD_ROWS_MAX_KEYS:
        return _forward(q, ks, vs, _sel_runs(idx, valid, spec, start), L, q0)
    offsets, readers = _readers(idx, valid, start, L, T)
    out, lse = _build()[0].runs_forward_blocks(_rows(q), _transposed(_keys(ks, L)), _keys(vs, L), offsets, readers, T, L,
                                               q0, D**-0.5, CHUNK_BYTES // (r * D * 4))
    return out.view(q.shape), lse.view(B, G, Tq, r)


def _readers(idx: torch.Tensor, valid: torch.Tensor, start: torch.Tensor | None, L: int, T: int
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """`block_readers` of the chosen sel blocks idx, valid (B, G, Tq, n), start (B, Tq) or None."""
    B, _, Tq, _ = idx.shape
    start32 = torch.zeros(B, Tq, dtype=torch.int32) if start is None else start.to(torch.int32)
    return block_readers(torch.where(valid, idx, -1).to(torch.int32), start32, L, T)


def sel_backward(d_out: torch.Tensor, q: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor, idx: torch.Tensor,
                 valid: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, spec: NSASpec, start: torch.Tensor | None,
                 q0: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients (dq, dks, dvs) of `sel_forward`'s output: query by query up to ROWS_MAX_KEYS keys,
    else block by block through the reverse index (which the Triton backward uses too)."""
    B, G, Tq, r, D = q.shape
    T, L = ks.shape[2], spec.l_sel
    if T <= ROWS_MAX_KEYS:
        return _backward_rows(d_out, q, ks, vs, out, lse, _sel_runs(idx, valid, spec, start), L, q0)
    offsets, readers = _readers(idx, valid, start, L, T)
    keys = _backward_keys(ks, vs, L)  # each block's tile is copied whole, up to a block past its last reader
    module, go = _build()[0], _rows(d_out)
    dq, dk, dv = module.runs_backward_blocks(_rows(q), *keys, offsets, readers, go, _rows(lse), module.delta(go, _rows(out)),
                                             T, L, q0, D**-0.5, CHUNK_BYTES // (r * D * 4))
    return dq.view(q.shape), dk.view(ks.shape), dv.view(vs.shape)


def sel_weight_grad(d_out: torch.Tensor, q: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor, idx: torch.Tensor,
                    valid: torch.Tensor, n_read: int, spec: NSASpec, start: torch.Tensor | None, q0: int) -> torch.Tensor:
    """`routing.score_grad` query by query: dL/dlog s_j (B, G, Tq, n) of the blocks idx, valid (B, G, Tq, n),
    the first n_read of them read by the sel branch, the rest explored; d_out (B, G, Tq, r, D) the gradient
    reaching the sel output, q (B, G, Tq, r, D), ks, vs (B, G, T, D)."""
    B, G, Tq, r, D = q.shape
    grad = _build()[0].runs_weight_grad(_rows(q), _transposed(_keys(ks)), _transposed(_keys(vs)),
                                        _sel_runs(idx, valid, spec, start), _rows(d_out), spec.l_sel, n_read, q0, D**-0.5)
    return grad.view(B, G, Tq, -1)


def window_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: NSASpec, start: torch.Tensor | None,
                   q0: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The win branch: q (B, G, Tq, r, D) at positions q0 .., k, v (B, G, T, D) of the whole sequence,
    start (B, Tq): each query's document start or None -> out (B, G, Tq, r, D), logsumexp (B, G, Tq, r)."""
    B, G, Tq = q.shape[:3]
    return _forward(q, k, v, _window_runs(B, G, Tq, spec, start, q0), spec.w, q0)


def window_backward(d_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                    lse: torch.Tensor, spec: NSASpec, start: torch.Tensor | None, q0: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients (dq, dk, dv) of `window_forward`'s output (query by query: a window's keys are in cache)."""
    B, G, Tq = q.shape[:3]
    return _backward_rows(d_out, q, k, v, out, lse, _window_runs(B, G, Tq, spec, start, q0), spec.w, q0)


def _cmp_runs(B: int, G: int, t0: int, t1: int, spec: NSASpec, docs: Documents | None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """The visible cmp slots of queries t0 .. t1 - 1, first (BG, C, 1) and last (BG, C) int32: blocks
    wholly in the past (i d + l - 1 <= t), with documents the slots of t's document; last < first
    when there is none."""
    t = torch.arange(t0, t1)[None, :]
    if docs is None:
        first = torch.zeros_like(t)
        last = torch.div(t - spec.l + 1, spec.d, rounding_mode="floor")
    else:
        first = docs.first_slot[:, t0:t1]
        last = torch.searchsorted(docs.cmp_start, (t - spec.l + 1).expand(B, -1).contiguous(), right=True) - 1
    per_group = lambda x: x.expand(B, -1)[:, None].expand(B, G, -1).reshape(B * G, -1).to(torch.int32)  # noqa: E731
    return per_group(first)[..., None].contiguous(), per_group(last).contiguous()


def cmp_keys(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The S compressed keys transposed and values as rows, and S, for `cmp_forward` (once for all chunks)."""
    S = k.shape[2]
    return _transposed(_keys(k)), _keys(v), S


def cmp_forward(q: torch.Tensor, keys: tuple[torch.Tensor, torch.Tensor, int], out: torch.Tensor, lse: torch.Tensor,
                a: int, b: int, q0: int, spec: NSASpec, docs: Documents | None) -> torch.Tensor:
    """The cmp branch for the rows a .. b - 1 of q (B, G, Tq, r, D) (positions q0 + a ..): writes their
    out and logsumexp, and returns the probabilities summed over each group's heads at every slot
    (B, G, C, S), which the sel blocks are chosen from (as the PyTorch chunks' `p.sum(3)`)."""
    B, G, _, r, D = q.shape
    kt, v, S = keys
    first, last = _cmp_runs(B, G, q0 + a, q0 + b, spec, docs)
    o, ls, group = _build()[0].runs_forward(_rows(q[:, :, a:b]), kt, v, first, last, S, q0 + a, D**-0.5, True)
    out[:, :, a:b] = o.view(B, G, b - a, r, D)
    lse[:, :, a:b] = ls.view(B, G, b - a, r)
    return group.view(B, G, b - a, S)


def cmp_backward(d_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor, spec: NSASpec, q0: int, docs: Documents | None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients (dq, dk, dv) of the cmp branch's output, query by query."""
    B, G, Tq = q.shape[:3]
    first, last = _cmp_runs(B, G, q0, q0 + Tq, spec, docs)
    return _backward_rows(d_out, q, k, v, out, lse, first, k.shape[2], q0, last)


def choose_blocks(group: torch.Tensor, spec: NSASpec, t0: int, T: int, docs: Documents | None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """`common.choose_blocks` of the cmp forward's group scores (B, G, C, S) (`cmp_forward`) of the queries
    t0 .. t0 + C - 1: by the kernel where a sel block's cmp members are consecutive slots (l and l' multiples of
    d), with or without documents, else in PyTorch. The same blocks in the same order either way."""
    if not spec.strided_members():
        return common.choose_blocks(group, spec, t0, T, docs)
    B, G, C, _ = group.shape
    Ns = spec.num_sel_blocks(T)
    n = min(spec.n, Ns)
    t = common.query_positions(t0, C, group.device, docs)  # (1 or B, C)
    first = torch.zeros_like(t) if docs is None else docs.first_slot[:, t0:t0 + C]  # the document's slot 0
    idx, valid = _build()[0].choose(group.contiguous(), t.contiguous(), first.contiguous(), G, spec.l, spec.d,
                                    spec.l_sel, Ns, n)
    return idx.view(B, G, C, n), valid.view(B, G, C, n)


def explore_blocks(idx: torch.Tensor, t: torch.Tensor, Ns: int, spec: NSASpec, m: int, seed: torch.Tensor | int = 0
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """`routing.explore_blocks` by the kernel: the same blocks in the same order where ok, and the same ok."""
    B, G, C, n = idx.shape
    m = min(m, Ns)
    extra, ok = _build()[0].explore(_rows(idx), t.contiguous(), torch.as_tensor(seed), G, Ns, m, spec.l_sel)
    return extra.view(B, G, C, m), ok.view(B, G, C, m)


def cmp_scores_backward(q: torch.Tensor, kc: torch.Tensor, idx: torch.Tensor, d_log_s: torch.Tensor, spec: NSASpec,
                        q0: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`routing.scores_backward`'s (dq, dkc) without documents, query by query: the gradients d_log_s (B, G, Tq, n)
    of the blocks idx (B, G, Tq, n) (0: none) through the group-summed cmp probabilities (recomputed) of the
    queries q (B, G, Tq, r, D) at q0 .. over the compressed keys kc (B, G, S, D)."""
    B, G, Tq, r, D = q.shape
    S = kc.shape[2]
    _, last = _cmp_runs(B, G, q0, q0 + Tq, spec, None)
    k = _keys(kc)
    dq, dk = _build()[0].cmp_scores_backward(_rows(q), k, _transposed(k), last, _rows(idx), _rows(d_log_s.float()), S,
                                             spec.l, spec.d, spec.l_sel, D**-0.5)
    return dq.view(q.shape), dk[:, :S].view(kc.shape)


def mix(gates: torch.Tensor, outs: list[torch.Tensor], which: list[int]) -> torch.Tensor:
    """`common.mix_branches` in one pass, in the heads' layout: gates (B, Tq, G r, 3) and the outputs (B, G, Tq, r, D)
    of the branches `which` (0 cmp, 1 sel, 2 win) -> (B, Tq, G r, D), fp32."""
    return _build()[0].mix(gates, outs, which)


def mix_backward(d_out: torch.Tensor, gates: torch.Tensor, outs: list[torch.Tensor], which: list[int]
                 ) -> list[torch.Tensor]:
    """`mix`'s gradients: the gates' (0 for the branches not given), then each branch output's."""
    return _build()[0].mix_backward(d_out, gates, outs, which)
