"""The fast (chunked, sparse) NSA attention against the reference: outputs, gradients, causality."""

from __future__ import annotations

import functools
from typing import Callable

import pytest
import torch

from nsa_titan.config import Model
from nsa_titan.models.attention import Documents, NSASpec, nsa_fast, nsa_reference
from nsa_titan.config import ConfigError
from nsa_titan.models.attention import FAMILIES, Family, Kernels, choose_family
from nsa_titan.models.attention.families.pytorch import kernels as kernels_module
from nsa_titan.models.attention.families.cpp import cpu_attention
from nsa_titan.models.attention.families.pytorch import ops
from nsa_titan.models.attention.families.triton import triton_nsa
from nsa_titan.models.rope import rope_tables
from nsa_titan.models.transformer import NSAAttention

from test_nsa_reference import random_inputs

SPEC = NSASpec(l=8, d=4, l_sel=16, n=5, w=24)  # l/d = 2, l'/d = 4 as in the paper, scaled down


def module_pair(H: int, G: int, D: int, spec: NSASpec, dtype: torch.dtype) -> tuple[NSAAttention, NSAAttention]:
    cfg = dict(dim=48, n_heads=H, n_kv_groups=G, head_dim=D, cmp_block_size=spec.l, cmp_stride=spec.d,
               sel_block_size=spec.l_sel, sel_top_n=spec.n, window_size=spec.w)
    ref, fast = NSAAttention(Model(**cfg, attn_impl="reference")), NSAAttention(Model(**cfg, attn_impl="fast"))
    ref.init_weights(0.3, 0.3, torch.Generator().manual_seed(0))
    fast.load_state_dict(ref.state_dict())
    return ref.to(dtype), fast.to(dtype)


NAMES = ("q", "k_cmp", "v_cmp", "k_sel", "v_sel", "k_win", "v_win", "gates")


def fast_and_reference(args: tuple[torch.Tensor, ...], grad_out: torch.Tensor | None = None,
                       fast: Callable = nsa_fast) -> list:
    """[(output, gradients of every input)] of `fast` (default nsa_fast, `auto`), then nsa_reference, for the
    loss sum(out * grad_out) (default: sum(out^2))."""
    for a in args:
        a.requires_grad_(True)
    results = []
    for fn in (fast, nsa_reference):
        out = fn(*args, SPEC)
        loss = out.square().sum() if grad_out is None else (out * grad_out).sum()
        results.append((out.detach(), torch.autograd.grad(loss, args)))
    return results


CASES = [  # (batch, T, H, G, D): T not a multiple of l, d or l'; T < l; T < l'; T < w; GQA 1, 6, 16
    (2, 5, 4, 4, 32),     # T < l: no compressed block at all
    (2, 13, 6, 1, 32),    # T < l' and T < w; MQA-like ratio 6
    (1, 37, 16, 1, 32),   # GQA ratio 16
    (2, 100, 12, 2, 64),  # the M7C head layout (ratio 6)
    (1, 150, 4, 4, 128),  # MHA (ratio 1), head dim 128
    (1, 257, 6, 1, 64),   # several chunks of 64 queries, a partial last one
]


FP32_TOL = 2e-4
"""fp32 against the fp32 reference. They round differently: on CPUs NSA's C++ kernel (and the fused
kernels of `kernels = torch`) take their own exp and d_out . out where the reference sums p * dp. Measured against the fp64 reference, both
are equally far off (up to ~1e-3 for the input's gradient at T = 257, where fp32 and fp64 pick
different blocks), and up to 1e-4 from each other. fp64 (1e-10) is the exactness check."""


@pytest.mark.parametrize("B,T,H,G,D", CASES, ids=[f"B{c[0]}-T{c[1]}-H{c[2]}-G{c[3]}-D{c[4]}" for c in CASES])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, FP32_TOL)])
def test_fast_equals_reference_output_and_every_gradient(B, T, H, G, D, dtype, tol):
    ref, fast = module_pair(H, G, D, SPEC, dtype)
    rope = rope_tables(Model(head_dim=D), T).to(dtype)
    x = torch.randn(B, T, 48, dtype=dtype, generator=torch.Generator().manual_seed(T))
    xr, xf = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    out_r, out_f = ref(xr, rope), fast(xf, rope)
    grad_out = torch.randn(out_r.shape, dtype=dtype, generator=torch.Generator().manual_seed(T + 1))
    (out_r * grad_out).sum().backward()
    (out_f * grad_out).sum().backward()

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).detach().norm() / b.detach().norm().clamp_min(1e-30))

    assert rel(out_f, out_r) < tol
    assert rel(xf.grad, xr.grad) < tol
    params_f = dict(fast.named_parameters())
    for name, p in ref.named_parameters():  # q/k/v projections of every branch, compressors, gate, output
        if p.grad is None or p.grad.norm() == 0:
            assert params_f[name].grad is None or params_f[name].grad.norm() == 0, name
            continue
        assert rel(params_f[name].grad, p.grad) < tol, name


@pytest.mark.parametrize("T", [40, 130])
def test_fast_equals_reference_on_raw_branch_inputs_in_fp64(T):
    (fast, grads_fast), (ref, grads_ref) = fast_and_reference(random_inputs(2, T, 12, 2, 16, SPEC, seed=T))
    torch.testing.assert_close(fast, ref, rtol=1e-10, atol=1e-12)
    for name, gf, gr in zip(NAMES, grads_fast, grads_ref):
        torch.testing.assert_close(gf, gr, rtol=1e-9, atol=1e-11, msg=name)


BRANCH_OF = {"q": None, "k_cmp": 0, "v_cmp": 0, "k_sel": 1, "v_sel": 1, "k_win": 2, "v_win": 2, "gates": None}
"""The branch whose keys and values each input is (None: all branches read it)."""


@pytest.mark.parametrize("branches", [(False, False, True), (True, False, False), (False, True, False),
                                      (True, True, False), (False, True, True)])
def test_branches_left_out_add_nothing_and_are_not_computed(monkeypatch, branches):
    """`branches` (what `nsa_branch` and `branch_off` pass): the output and every gradient are those
    of all branches with the others' gates at 0, in both implementations; in nsa_fast a branch left
    out runs no op and its inputs get no gradient (cmp's op still runs for sel, whose blocks it picks)."""
    args = random_inputs(2, 70, 12, 2, 16, SPEC, seed=3)
    for a in args:
        a.requires_grad_(True)
    gated = nsa_reference(*args[:-1], args[-1] * torch.tensor(branches, dtype=torch.float64), SPEC)
    expected = torch.autograd.grad(gated.square().sum(), args)
    ran = []

    def counted(op, kind: Callable[[tuple], str]) -> Callable:
        def run(*a):
            ran.append(kind(a))
            return op(*a)
        return run

    monkeypatch.setattr(ops, "shared", counted(ops.shared, lambda a: a[3]))  # its kind: cmp or win
    monkeypatch.setattr(ops, "selected", counted(ops.selected, lambda a: "sel"))
    torch.testing.assert_close(nsa_reference(*args, SPEC, branches=branches), gated, rtol=1e-12, atol=1e-14)
    out = nsa_fast(*args, SPEC, kernels=Kernels("torch", "torch", "torch"), branches=branches)
    torch.testing.assert_close(out, gated, rtol=1e-10, atol=1e-12)
    assert ran == [kind for kind, on in zip(("cmp", "sel", "win"), (branches[0] or branches[1], *branches[1:])) if on]
    grads = torch.autograd.grad(out.square().sum(), args, allow_unused=True)
    for name, g, want in zip(NAMES, grads, expected):
        if BRANCH_OF[name] is not None and not branches[BRANCH_OF[name]]:
            assert g is None and not want.any(), name  # gated off, its gradient is 0: here not computed at all
        else:
            torch.testing.assert_close(g, want, rtol=1e-9, atol=1e-11, msg=name)


@pytest.mark.parametrize("T", [70, 200])
def test_fast_is_causal(cpu_path, T):
    _, fast = module_pair(12, 2, 16, SPEC, torch.float64)
    rope = rope_tables(Model(head_dim=16), T).double()
    x = torch.randn(1, T, 48, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    y = fast(x, rope)
    for s in (0, 15, 16, 63, 64, 65, T - 1):  # block and chunk edges
        x2 = x.clone()
        x2[:, s] += 1.0
        y2 = fast(x2, rope)
        assert torch.equal(y2[:, :s], y[:, :s]), f"output before {s} changed"
        assert not torch.equal(y2[:, s], y[:, s])


@pytest.mark.parametrize("T", [90, 203])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, FP32_TOL)])
def test_fast_equals_reference_across_many_chunks_and_tiles(small_chunks, cpu_path, T, dtype, tol):
    args = random_inputs(2, T, 12, 2, 16, SPEC, dtype=dtype, seed=T + 1)
    grad_out = torch.randn(args[0].shape, dtype=dtype, generator=torch.Generator().manual_seed(0))
    (fast, grads_fast), (ref, grads_ref) = fast_and_reference(args, grad_out)
    assert float((fast - ref).norm() / ref.norm()) < tol
    for name, gf, gr in zip(NAMES, grads_fast, grads_ref):
        assert float((gf - gr).norm() / gr.norm()) < tol, name


def test_cpu_runs_every_branch_through_the_fused_kernels(monkeypatch):
    """On CPUs the PyTorch kernels' win forward, sel forward's three parts and every backward call
    ATen's fused kernels (the cmp forward computes its probabilities itself: it picks the sel
    blocks from them)."""
    from nsa_titan.models.attention.families.pytorch import fused_attention

    calls = {"attend": 0, "attend_backward": 0}
    unmasked = []  # the key counts of the backward's calls without a bias
    for name in calls:
        def counted(*args, _fn=getattr(fused_attention, name), _name=name):
            calls[_name] += 1
            if _name == "attend_backward" and args[6] is None:
                unmasked.append(args[2].shape[1])
            return _fn(*args)
        monkeypatch.setattr(fused_attention, name, counted)
    args = random_inputs(1, 300, 12, 2, 16, SPEC, seed=3)  # cmp: 2 chunks of 256, win: 5 of 64, sel: 1
    for a in args:
        a.requires_grad_(True)
    nsa_fast(*args, SPEC, Kernels()).sum().backward()
    # cmp's second chunk (queries 256 ..) in two parts: the slots its first query sees, without a mask, then the rest
    assert calls == {"attend": 5 + 3, "attend_backward": 3 + 5 + 3}  # sel: tiles, loc, ini
    assert (256 - SPEC.l) // SPEC.d + 1 in unmasked


@pytest.mark.parametrize("kind", ["cmp", "win"])
def test_cmp_and_win_take_bf16_chunks_as_on_cuda(small_chunks, kind):
    """On CUDA nsa_fast hands the cmp and win chunks to the fused kernel in bf16 / fp16 (tensor
    cores). The same plumbing on the CPU's fused kernel: the same sel blocks as fp32 on the same
    values (their scores are fp32), an fp32 logsumexp, and dk, dv summed over chunks in fp32."""
    g = torch.Generator().manual_seed(0)
    B, G, T, r, D = 1, 2, 150, 3, 32
    S = SPEC.num_cmp_blocks(T) if kind == "cmp" else T
    xs = [torch.randn(*shape, generator=g).bfloat16() for shape in ((B, G, T, r, D), (B, G, S, D), (B, G, S, D))]
    weight = torch.randn(B, G, T, r, D, generator=g)
    runs = {}
    for dtype in (torch.bfloat16, torch.float32):
        ins = [x.to(dtype).requires_grad_(True) for x in xs]
        out, idx, _ = ops.shared(*ins, kind, SPEC, T, 0, None)
        runs[dtype] = out.detach(), idx, torch.autograd.grad((out.float() * weight).sum(), ins)
    (o16, i16, g16), (o32, i32, g32) = runs[torch.bfloat16], runs[torch.float32]
    rel = lambda a, b: float((a.float() - b).norm() / b.norm())  # noqa: E731
    assert o16.dtype == torch.bfloat16 and rel(o16, o32) < 1e-2
    assert all(d.dtype == torch.bfloat16 and rel(d, d32) < 2e-2 for d, d32 in zip(g16, g32))
    if kind == "cmp":
        assert torch.equal(i16, i32)


def test_fast_backward_does_not_keep_per_chunk_scores(small_chunks):
    """Activation memory saved for backward is O(T): each chunk's scores are recomputed."""
    saved = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.numel())
        return t

    T = 512
    args = random_inputs(1, T, 12, 2, 16, SPEC, dtype=torch.float32, seed=1)
    for a in args:
        a.requires_grad_(True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        nsa_fast(*args, SPEC).sum()
    largest = max(saved)
    # The largest saved tensor is an input or the output (12 x 512 x 16), never a score block
    # (one sel chunk's scores alone would be 12 x 40 x 80, all T x T ones 12 x 512 x 512).
    assert largest <= 12 * T * 16, largest


def flash_attn_as_documented(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1)):
    """flash_attn_func as flash-attn documents it: q (B, Sq, H, D), k, v (B, Sk, G, D) with G | H;
    query i reads keys j in [i + Sk - Sq - left, i + Sk - Sq + right] (-1: unbounded), and
    j <= i + Sk - Sq when causal. Dense, for checking how nsa_fast calls it."""
    B, Sq, H, D = q.shape
    Sk, G = k.shape[1], k.shape[2]
    i = torch.arange(Sq)[:, None] + Sk - Sq
    j = torch.arange(Sk)[None, :]
    ok = torch.ones(Sq, Sk, dtype=torch.bool)
    if window_size[0] >= 0:
        ok &= j >= i - window_size[0]
    if window_size[1] >= 0:
        ok &= j <= i + window_size[1]
    if causal:
        ok &= j <= i
    k, v = k.repeat_interleave(H // G, 2), v.repeat_interleave(H // G, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * (softmax_scale or D**-0.5)
    return torch.einsum("bhqk,bkhd->bqhd", s.masked_fill(~ok, float("-inf")).softmax(-1), v)


def test_window_branch_calls_flash_attn_as_documented(monkeypatch):
    """On GPUs with flash-attn the win branch is flash_attn_func's sliding window; checked here
    with a stand-in written from its documentation (flash-attn itself needs CUDA)."""
    calls = []

    def standin(*args, **kwargs):
        calls.append(kwargs)
        return flash_attn_as_documented(*args, **kwargs)

    monkeypatch.setattr(kernels_module, "flash_attn_func", standin)
    (out, grads), (ref, grads_ref) = fast_and_reference(random_inputs(2, 90, 12, 2, 16, SPEC, seed=4),
                                                        fast=FAMILIES["flash"]())
    assert calls == [{"causal": True, "window_size": (SPEC.w - 1, 0)}]
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    for name, gf, gr in zip(NAMES, grads, grads_ref):
        torch.testing.assert_close(gf, gr, rtol=1e-9, atol=1e-11, msg=name)


CPU = torch.device("cpu")


def test_kernel_choice_is_explicit_and_says_why_a_kernel_cannot_run(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert choose_family("torch", CPU, torch.float32, SPEC, 6, 64).name == "torch"
    assert choose_family("auto", CPU, torch.bfloat16, SPEC, 6, 64).name == "cpp"  # test_cpu_attention.py
    with pytest.raises(ConfigError, match="kernels = 'flash' cannot run: flash-attn (is not installed|runs on CUDA)"):
        choose_family("flash", CPU, torch.bfloat16, SPEC, 6, 64)
    monkeypatch.setattr(kernels_module, "flash_attn_func", lambda *a, **k: None)  # "installed"
    with pytest.raises(ConfigError, match="flash-attn runs on CUDA devices and this run is on cpu"):
        choose_family("flash", CPU, torch.bfloat16, SPEC, 6, 64)
    if triton_nsa.triton is not None:
        with pytest.raises(ConfigError, match="kernels = 'triton' cannot run: the Triton kernels run on CUDA"):
            choose_family("triton", CPU, torch.float32, SPEC, 6, 64)
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        assert choose_family("triton", CPU, torch.float32, SPEC, 6, 64).name == "triton"
        with pytest.raises(ConfigError, match="take float32, float16 or bfloat16, and the compute dtype is torch.float64"):
            choose_family("triton", CPU, torch.float64, SPEC, 6, 64)
        with pytest.raises(ConfigError, match="powers of two >= 16 \\(they are 24 and 16\\)"):
            choose_family("triton", CPU, torch.float32, SPEC, 6, 24)
        assert choose_family("auto", CPU, torch.float32, SPEC, 6, 24).name == "torch"  # auto falls back (C++: D 24)
    else:
        with pytest.raises(ConfigError, match="Triton is not installed"):
            choose_family("triton", CPU, torch.float32, SPEC, 6, 64)


def test_the_module_runs_the_kernels_it_was_given(monkeypatch):
    """An NSA layer built with explicit kernels calls those (here the flash-attn stand-in for win)."""
    calls = []
    monkeypatch.setattr(kernels_module, "flash_attn_func",
                        lambda *a, **k: calls.append(k) or flash_attn_as_documented(*a, **k))
    cfg = Model(dim=48, n_heads=4, n_kv_groups=2, head_dim=16, cmp_block_size=8, cmp_stride=4, sel_block_size=16,
                sel_top_n=5, window_size=24)
    layer = NSAAttention(cfg, FAMILIES["flash"]())
    layer.init_weights(0.3, 0.3, torch.Generator().manual_seed(0))
    layer(torch.randn(1, 40, 48), rope_tables(Model(head_dim=16), 40))
    assert calls == [{"causal": True, "window_size": (23, 0)}]


def whole_and_parts(args: list[torch.Tensor], docs: Documents | None, cuts: list[int],
                    op: Kernels | Family = Kernels(), spec: NSASpec = SPEC
                    ) -> tuple[torch.Tensor, torch.Tensor, tuple, tuple]:
    """nsa_fast on the kernels `op` (or the family `op`) over all queries, and over the parts cut at `cuts`
    (multiples of l') against the whole keys, concatenated; and the gradients of every input under one random
    output gradient. (tests/test_gpu.py runs it on CUDA at the paper's sizes.)"""
    T = args[0].shape[1]
    attention = op if isinstance(op, Family) else functools.partial(nsa_fast, kernels=op)
    leaves = [x.detach().clone().requires_grad_() for x in args]
    whole = attention(*leaves[:8], spec, docs=docs)
    grad_out = torch.randn(whole.shape, generator=torch.Generator().manual_seed(3)).to(whole)
    expected = torch.autograd.grad(whole, leaves, grad_out)
    edges = [0, *cuts, T]
    parts = torch.cat([attention(leaves[0][:, a:b], *leaves[1:7], leaves[7][:, a:b], spec, docs=docs, q0=a)
                       for a, b in zip(edges, edges[1:])], 1)
    return whole, parts, expected, torch.autograd.grad(parts, leaves, grad_out)


def random_parts_inputs(T: int, with_docs: bool, dtype: torch.dtype = torch.float64
                        ) -> tuple[list[torch.Tensor], Documents | None]:
    """Inputs for `whole_and_parts` (B 2, H 12, G 2, D 16), with random documents when asked."""
    args = list(random_inputs(2, T, 12, 2, 16, SPEC, dtype=dtype, seed=T))
    docs = None
    if with_docs:
        ids = torch.cumsum(torch.rand(2, T, generator=torch.Generator().manual_seed(1)) < 0.03, 1)
        docs = Documents.of(ids, SPEC)
        args[1:3] = [torch.randn(2, T // SPEC.d, 2, 16, dtype=dtype) for _ in range(2)]  # cmp slots
    return args, docs


@pytest.mark.parametrize("with_docs", [False, True])
@pytest.mark.parametrize("T,cuts", [(160, [64, 96]), (203, [16, 112, 160])])
def test_queries_in_parts_equal_the_whole(small_chunks, cpu_path, with_docs, T, cuts):
    """Context parallelism's contract: each part of the queries (starting at a multiple of l'),
    against the keys of the whole sequence, gives the whole run's rows, and the parts' key
    gradients add up to the whole run's."""
    whole, parts, expected, got = whole_and_parts(*random_parts_inputs(T, with_docs), cuts)
    torch.testing.assert_close(parts, whole, rtol=1e-10, atol=1e-12)
    for name, g, e in zip(["q", "kc", "vc", "ks", "vs", "kw", "vw", "gates"], got, expected):
        torch.testing.assert_close(g, e, rtol=1e-9, atol=1e-11, msg=name)


@pytest.mark.parametrize("kernel", ["torch", "cpp"])
@pytest.mark.parametrize("with_docs", [False, True])
def test_return_selection_gives_the_blocks_sel_read(kernel, with_docs):
    """`return_selection` (the scores' gradient uses it, `routing.with_score_grad`): the same output, and
    the blocks the reference chooses, for all queries and for a part of them (q0 = 48)."""
    dtype = torch.float32 if kernel == "cpp" else torch.float64  # NSA's C++ kernel computes in fp32
    if kernel == "cpp" and (why := cpu_attention.problem(CPU, dtype, SPEC, 6, 16)):
        pytest.skip(why)
    args, docs = random_parts_inputs(160, with_docs, dtype)
    kernels = Kernels(kernel, kernel, kernel)
    plain = nsa_fast(*args, SPEC, kernels, docs=docs)
    ref, ref_idx, ref_valid = nsa_reference(*args, SPEC, docs=docs, return_selection=True)
    out, idx, valid = nsa_fast(*args, SPEC, kernels, docs=docs, return_selection=True)
    assert torch.equal(out, plain) and torch.equal(valid, ref_valid) and valid.any() and not valid.all()
    torch.testing.assert_close(out, ref, **({"rtol": 1e-4, "atol": 1e-5} if kernel == "cpp" else {}))
    assert torch.equal(idx[valid], ref_idx[ref_valid])
    part, part_idx, part_valid = nsa_fast(args[0][:, 48:], *args[1:7], args[7][:, 48:], SPEC, kernels, docs=docs, q0=48,
                                          return_selection=True)
    torch.testing.assert_close(part, plain[:, 48:], rtol=1e-5, atol=1e-6)  # chunked otherwise: rounded otherwise
    assert torch.equal(part_idx, idx[:, :, 48:]) and torch.equal(part_valid, valid[:, :, 48:])


def test_host_bounds_read_only_the_documents_keys(small_chunks, monkeypatch):
    """With the host bounds (document ids from the loader), each chunk reads only its documents' keys:
    the same outputs and gradients as the static ranges that ids on a device keep, with far fewer keys read by cmp and win and fewer sel tiles; and without documents the
    static tile count follows each query's own choices."""
    import dataclasses

    from nsa_titan.models.attention.families.pytorch import fast_sel, fast_shared

    read = {"keys": 0, "tiles": 0}
    probs, tiles = fast_shared._probs, fast_sel._tiles

    def counting_probs(q, k, mask):
        read["keys"] += q[0, 0].numel() // q.shape[-1] * k.shape[2]
        return probs(q, k, mask)

    def counting_tiles(kpos, use, t0, NT):
        read["tiles"] += NT
        return tiles(kpos, use, t0, NT)

    monkeypatch.setattr(fast_shared, "_probs", counting_probs)
    monkeypatch.setattr(fast_sel, "_tiles", counting_tiles)
    T = 400
    args = list(random_inputs(2, T, 12, 2, 16, SPEC, dtype=torch.float64, seed=5))
    ids = torch.stack([torch.arange(T) // 40, (torch.arange(T) + 17) // 50])  # documents of 40 and 50 tokens
    docs = Documents.of(ids, SPEC)
    args[1:3] = [torch.randn(2, T // SPEC.d, 2, 16, dtype=torch.float64) for _ in range(2)]  # cmp slots
    counts, results = {}, {}
    for name, d in (("bounds", docs), ("static", dataclasses.replace(docs, bounds=None)), ("none", None)):
        read.update(keys=0, tiles=0)
        leaves = [x.detach().clone().requires_grad_() for x in args]
        out = nsa_fast(*leaves, SPEC, docs=d)
        results[name] = (out, torch.autograd.grad(out.square().sum(), leaves))
        counts[name] = dict(read)
    out, grads = results["bounds"]
    torch.testing.assert_close(out, results["static"][0], rtol=1e-12, atol=1e-14)
    for g, e in zip(grads, results["static"][1]):
        torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-14)
    assert counts["bounds"]["keys"] < 0.6 * counts["static"]["keys"], counts
    assert counts["bounds"]["tiles"] < 0.6 * counts["static"]["tiles"], counts
    # without documents: fewer tiles than the bound that assumes per_query choices for every query
    # (the one the static ranges above take), since early queries have fewer blocks to choose from
    assert counts["none"]["tiles"] < 0.9 * counts["static"]["tiles"], counts


@pytest.mark.parametrize("with_docs", [False, True])
def test_queries_in_parts_through_flash_attn_equal_the_whole(monkeypatch, with_docs):
    """The same with the win branch through flash-attn (the stand-ins written from its documentation):
    a part's queries against the keys from its first window on, aligned at the bottom right, and with
    documents the varlen layout of each document's queries and keys (some with keys but no queries)."""
    from test_documents import flash_attn_varlen_as_documented

    monkeypatch.setattr(kernels_module, "flash_attn_func", flash_attn_as_documented)
    monkeypatch.setattr(kernels_module, "flash_attn_varlen_func", flash_attn_varlen_as_documented)
    kernels = Kernels(win="flash")
    args, docs = random_parts_inputs(203, with_docs)
    whole, parts, expected, got = whole_and_parts(args, docs, [16, 48, 112, 160], kernels)
    reference = nsa_fast(*args, SPEC, docs=docs)  # the torch kernels
    torch.testing.assert_close(whole, reference, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(parts, whole, rtol=1e-10, atol=1e-12)
    for name, g, e in zip(["q", "kc", "vc", "ks", "vs", "kw", "vw", "gates"], got, expected):
        torch.testing.assert_close(g, e, rtol=1e-9, atol=1e-11, msg=name)
