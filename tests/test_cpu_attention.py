"""NSA's C++ kernels for CPUs (`cpu_attention.py`, `csrc/cpu_attention.cpp`), cmp, sel and win, against
the PyTorch kernels and the reference: outputs, logsumexps and every gradient, with documents and parts
of the queries, both sel backwards; and how the kernel choice takes them or falls back."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from nsa_titan.system import hostcpu
from nsa_titan.config import ConfigError
from nsa_titan.models.attention.common import block_readers
from nsa_titan.models.attention import Documents, Kernels, NSASpec, choose_family
from nsa_titan.models.attention.families.cpp import cpu_attention
from nsa_titan.models.attention.families.pytorch import fast_sel, fast_shared, ops
from nsa_titan.models.attention.families.pytorch import fused_attention
from nsa_titan.models.attention import nsa_fast, nsa_reference
from nsa_titan.models.attention import common, routing
from nsa_titan.models.attention.common import forced_blocks, query_positions
from nsa_titan.models.attention.routing import explore_blocks, score_grad

from test_nsa_fast import SPEC, random_parts_inputs, whole_and_parts
from test_nsa_reference import random_inputs

CPU = torch.device("cpu")
M7C = NSASpec(l=32, d=16, l_sel=64, n=16, w=512)


def test_the_kernels_build_on_this_machine():
    """CI's machines have a C++ compiler: the kernels must build there (else `auto` silently falls back)."""
    assert cpu_attention.problem(CPU, torch.float32, M7C, 6, 64) is None
    assert cpu_attention._build()[0].openmp  # else at::parallel_for runs every kernel on one thread


def test_each_checkout_and_each_change_of_the_sources_has_its_own_build(tmp_path, monkeypatch):
    """The build's name tags the sources' text and their path: a second checkout (a worktree to compare
    against) keeps its own build instead of rebuilding the shared one at every switch, and an edited
    header, which torch's own check does not read, is rebuilt."""
    here = cpu_attention._build_tag()
    copies = tuple(tmp_path / "csrc" / p.name for p in cpu_attention.SOURCES)
    copies[0].parent.mkdir()
    for src, dst in zip(cpu_attention.SOURCES, copies):
        shutil.copy(src, dst)
    monkeypatch.setattr(cpu_attention, "SOURCES", copies)
    there = cpu_attention._build_tag()
    assert there != here and cpu_attention._build_tag() == there
    copies[1].write_text(copies[1].read_text() + "\n// edited\n")
    assert cpu_attention._build_tag() not in (here, there)


def fake_ninja(folder: Path, version: str) -> Path:
    """A `ninja` in `folder` that reports `version` and fails every build, logging each call (where, what) to
    folder/calls."""
    folder.mkdir(parents=True, exist_ok=True)
    ninja = folder / "ninja"
    ninja.write_text(f'#!/bin/sh\necho "$(pwd) $@" >> {folder / "calls"}\n'
                     f'[ "$1" = "--version" ] && {{ echo {version}; exit 0; }}\nexit 1\n')
    ninja.chmod(0o755)
    return folder


def test_each_ninja_has_its_own_build(tmp_path, monkeypatch):
    """Two ninja versions read each other's build log as changed commands and rebuild: the build's name tags the
    version of the ninja on PATH, so that each builds once, in a folder of its own."""
    here = cpu_attention._build_tag()
    real = cpu_attention.tool_version("ninja")
    assert real
    monkeypatch.setenv("PATH", f"{fake_ninja(tmp_path / 'other', '1.11.1')}:{os.environ['PATH']}")
    assert cpu_attention.tool_version("ninja") == "1.11.1" and cpu_attention._build_tag() != here
    monkeypatch.setenv("PATH", f"{fake_ninja(tmp_path / 'same', real)}:{os.environ['PATH']}")
    assert cpu_attention._build_tag() == here


@pytest.mark.multiprocess
def test_a_process_with_another_ninja_leaves_the_build_alone(tmp_path):
    """A process of this interpreter with another ninja first on PATH builds in its own folder (here its ninja
    fails, so it says the kernels did not build) and leaves this environment's build as it was: the next process
    with this environment's ninja loads it without building."""
    assert cpu_attention.problem(CPU, torch.float32, M7C, 6, 64) is None
    from torch.utils.cpp_extension import _get_build_directory

    built = Path(_get_build_directory(f"nsa_titan_cpu_attention_{cpu_attention._build_tag()}", verbose=False))
    library = next(built.glob("*.so"))
    before = library.stat().st_mtime_ns
    probe = ("import torch; from nsa_titan.models.attention.families.cpp import cpu_attention as c; "
             "from nsa_titan.models.attention import NSASpec; "
             "print(c.problem(torch.device('cpu'), torch.float32, NSASpec(), 6, 64))")
    other = fake_ninja(tmp_path / "other", "1.11.1")
    env = {**os.environ, "PATH": f"{other}:{os.environ['PATH']}"}
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=600)
    assert "did not build" in done.stdout, done.stdout + done.stderr
    builds = [line.split()[0] for line in (other / "calls").read_text().splitlines() if line.split()[1:2] == ["-v"]]
    assert builds and str(built) not in builds  # it tried, in a folder of its own
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=600)
    assert done.stdout.strip() == "None", done.stdout + done.stderr
    assert library.stat().st_mtime_ns == before


HEADS_AND_DIMS = [(r, 16 * dv) for r in cpu_attention.HEADS for dv in (1, 2, 4, 8)]  # the driver's order


HALVES = [(3, 8), (20, 5), (41, 8), (3, 0), (50, 1), (7, 8)]
"""`cpu_tiles_check.cpp`'s runs of at most 8 keys, two to a vector: (first key, keys)."""


def tiles_reference(x: torch.Tensor) -> torch.Tensor:
    """What `tests/cpu_tiles_check.cpp` computes from its input `x`, in float64."""
    x, P = x.double(), 64
    rest = iter(x[256:].split(1))
    take = lambda *shape: torch.cat([next(rest) for _ in range(torch.Size(shape).numel())]).view(shape)  # noqa: E731
    bf16 = (x[:256].float().view(torch.int32) & -65536).view(torch.float32).double()  # the top 16 bits
    out = [x[:256].exp(), bf16, bf16[3:11], bf16[100:108]]
    for r, D in HEADS_AND_DIMS:
        a, bt, c, rows = take(r, D), take(D, P), take(r, P), take(P, D)
        dst = torch.zeros(P, D, dtype=torch.float64)
        dst[5:34] = c[:, :29].T @ a
        scores = a @ bt[:, :48]
        scores[:, 45:] = float("-inf")
        halves = torch.cat([a @ bt[:, p:p + 8] for p, _ in HALVES], 1)  # (r, 48)
        masked = halves.clone()
        for i, (_, n) in enumerate(HALVES):
            masked[:, 8 * i + n:8 * i + 8] = float("-inf")
        out += [scores.flatten(), masked.flatten(), halves.flatten(), (c[:, :37] @ rows[3:40]).flatten(), dst.flatten()]
    return torch.cat(out)


@pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler")
@pytest.mark.multiprocess
def test_the_vector_layer_is_exact_with_avx2_halves_and_avx512_registers(tmp_path):
    """`csrc/tiles.h` built for each instruction set alone (AVX2: 16 lanes as two 8-lane registers;
    AVX-512: one register), run where the CPU has it: e^x (subnormal results, 0 below e^-104), bf16 loads, and the
    register tiles (scores of runs of 16 and of runs of 8 two to a vector, masked past their keys), every
    head count and head dim the kernel takes, equal the float64 products."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(300_000, generator=gen)
    x[:256] = torch.linspace(-110.0, 88.0, 256)
    (tmp_path / "in.bin").write_bytes(x.numpy().tobytes())
    want = tiles_reference(x)
    flags = hostcpu.cpu_flags()
    targets = {"x86-64-v3": "avx2" in flags, "x86-64-v4": "avx512f" in flags} if platform.machine() == "x86_64" \
        else {"native": True}
    for march, runs in targets.items():
        exe = tmp_path / march
        subprocess.run(["g++", "-O3", "-std=c++17", "-ffp-contract=fast", f"-march={march}", "-Wall", "-Werror",
                        "-Wno-psabi", f"-I{Path(cpu_attention.SOURCES[1]).parent}",
                        str(Path(__file__).parent / "cpu_tiles_check.cpp"), "-o", str(exe)], check=True)
        if not runs:  # this CPU lacks it: built (so it compiles), not run
            continue
        subprocess.run([str(exe), str(tmp_path / "in.bin"), str(tmp_path / "out.bin")], check=True)
        got = torch.frombuffer(bytearray((tmp_path / "out.bin").read_bytes()), dtype=torch.float32).double()
        assert got.shape == want.shape, march
        e, e_want = got[:256], want[:256]
        normal = e_want >= torch.finfo(torch.float32).tiny
        assert ((e - e_want).abs() <= 1e-6 * e_want)[normal].all(), march
        assert ((e - e_want).abs() <= 2**-149)[~normal].all(), march  # one subnormal step at most
        assert (e[x[:256] < -104] == 0).all() and (e[(x[:256] > -103) & ~normal] > 0).all(), march
        torch.testing.assert_close(got[256:], want[256:], rtol=1e-5, atol=1e-5, msg=march)


def sel_inputs(B: int, G: int, T: int, r: int, D: int, spec: NSASpec, docs: bool, seed: int):
    """q (B, G, T, r, D), sel keys and values, the blocks chosen by the cmp branch, the documents' starts."""
    gen = torch.Generator().manual_seed(seed)
    q, ks, vs = (torch.randn(B, G, n, *s, generator=gen) for n, s in ((T, (r, D)), (T, (D,)), (T, (D,))))
    documents = None
    if docs:
        documents = Documents.of(torch.cumsum(torch.rand(B, T, generator=gen) < 4 / T, 1), spec)
        kc, vc = (torch.randn(B, G, T // spec.d, D, generator=gen) for _ in range(2))  # cmp slots
    else:
        kc, vc = (torch.randn(B, G, spec.num_cmp_blocks(T), D, generator=gen) for _ in range(2))
    _, _, idx, valid = fast_shared.shared_forward(q, kc, vc, "cmp", spec, T, 0, documents, None)
    return q, ks, vs, idx, valid, None if documents is None else documents.start


SHAPES = [  # (B, G, T, r, D, spec): T not a multiple of l'; every r and D the kernel takes
    (1, 2, 700, 6, 64, M7C),
    (2, 1, 203, 6, 16, SPEC),
    (1, 3, 150, 1, 128, SPEC),
    (1, 2, 97, 2, 32, SPEC),
    (2, 2, 130, 3, 16, SPEC),
    (1, 1, 90, 4, 32, SPEC),
    (1, 2, 120, 8, 16, SPEC),
    (2, 2, 203, 2, 32, NSASpec(l=4, d=2, l_sel=8, n=16, w=64)),  # recall.toml's: l' = 8, half a vector
]


@pytest.fixture(autouse=True)
def own_backward(monkeypatch) -> None:
    """The kernel's own backward for every run length (long ones go to ATen's fused attention in
    training: `test_long_runs_go_backward_through_atens_fused_attention`)."""
    monkeypatch.setattr(cpu_attention, "FUSED_BACKWARD_KEYS", (1 << 30, 1 << 30))


@pytest.fixture(params=["rows", "blocks", "blocks-chunked"])
def sel_path(request, monkeypatch) -> str:
    """Both ways of the sel kernel, forward and backward: query by query (short sequences), block by block
    (long ones), the latter with the queries in one chunk or in chunks of a few queries each."""
    for name in ("ROWS_MAX_KEYS", "FORWARD_ROWS_MAX_KEYS"):
        monkeypatch.setattr(cpu_attention, name, 1 << 30 if request.param == "rows" else 0)
    monkeypatch.setattr(cpu_attention, "CHUNK_BYTES", 4096 if request.param == "blocks-chunked" else 1 << 40)
    return request.param


@pytest.mark.parametrize("docs", [False, True])
@pytest.mark.parametrize("B,G,T,r,D,spec", SHAPES, ids=[f"B{s[0]}-G{s[1]}-T{s[2]}-r{s[3]}-D{s[4]}" for s in SHAPES])
def test_the_sel_kernel_equals_the_pytorch_tiles(B, G, T, r, D, spec, docs, sel_path):
    q, ks, vs, idx, valid, start = sel_inputs(B, G, T, r, D, spec, docs, seed=T + r)
    out, lse = fast_sel.selected_forward(q, ks, vs, idx, valid, spec, start, 0, None)
    got_out, got_lse = cpu_attention.sel_forward(q, ks, vs, idx, valid, spec, start, 0)
    torch.testing.assert_close(got_out, out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_lse, lse, rtol=1e-5, atol=1e-5)
    d_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(1))
    expected = fast_sel.selected_backward(d_out, q, ks, vs, idx, valid, out, lse, spec, start, 0, None)
    got = cpu_attention.sel_backward(d_out, q, ks, vs, idx, valid, out, lse, spec, start, 0)
    for name, g, e in zip(("dq", "dk", "dv"), got, expected):
        assert float((g - e).norm() / e.norm()) < 1e-5, name


@pytest.mark.parametrize("docs", [False, True])
@pytest.mark.parametrize("B,G,T,r,D,spec", SHAPES, ids=[f"B{s[0]}-G{s[1]}-T{s[2]}-r{s[3]}-D{s[4]}" for s in SHAPES])
def test_the_weight_gradient_kernel_equals_score_grad(B, G, T, r, D, spec, docs):
    """`sel_weight_grad` (the block scores' straight-through gradient, query by query) against `routing.score_grad`
    in fp64: the chosen blocks and 3 explored ones per query, for all queries and for those from q0 = 2 l' on."""
    q, ks, vs, idx, valid, start = sel_inputs(B, G, T, r, D, spec, docs, seed=T + r)
    geometry = None if start is None else SimpleNamespace(start=start)  # all that score_grad reads of the documents
    extra, ok = explore_blocks(idx, query_positions(0, T, CPU, geometry), spec.num_sel_blocks(T), spec, 3, seed=2)
    n = idx.shape[-1]
    idx, valid = torch.cat([idx, extra], -1), torch.cat([valid, ok], -1)
    d_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(1))
    for q0 in (0, 2 * spec.l_sel):
        rows = slice(q0, T)
        got = cpu_attention.sel_weight_grad(d_out[:, :, rows], q[:, :, rows], ks, vs, idx[:, :, rows], valid[:, :, rows],
                                            n, spec, None if start is None else start[:, rows], q0)
        want = score_grad(d_out[:, :, rows].transpose(1, 2).flatten(2, 3).double(), q[:, :, rows].double(),
                          ks.transpose(1, 2).double(), vs.transpose(1, 2).double(), torch.ones(B, T - q0, G * r).double(),
                          idx[:, :, rows], valid[:, :, rows], spec, geometry, q0, n)
        explored = bool(ok[:, :, rows].any())  # none at T = 700 and M7C's l' (11 blocks, all chosen)
        assert float(want[..., :n].abs().sum()) > 1.0 and (not explored or float(want[..., n:].abs().sum()) > 0.1)
        assert float((got - want).norm() / want.norm()) < 1e-5


@pytest.mark.parametrize("with_docs", [False, True])
def test_parts_of_the_queries_equal_the_whole(with_docs, sel_path):
    """Context parallelism's contract through the kernels (q0 > 0), and nsa_fast with them equals the
    reference in fp32."""
    args, docs = random_parts_inputs(203, with_docs, torch.float32)
    whole, parts, expected, got = whole_and_parts(args, docs, [16, 112, 160], Kernels("cpp", "cpp", "cpp"))
    torch.testing.assert_close(parts, whole, rtol=1e-5, atol=1e-6)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-5)
    ref = nsa_reference(*args, SPEC, docs)
    assert float((whole - ref).detach().norm() / ref.norm()) < 2e-5


WINDOWS = [(1, 2, 203, 6, 16, 24), (2, 1, 150, 4, 32, 16), (1, 2, 700, 6, 64, 512), (1, 1, 90, 1, 128, 100)]


@pytest.mark.parametrize("docs", [False, True])
@pytest.mark.parametrize("B,G,T,r,D,w", WINDOWS, ids=[f"T{s[2]}-r{s[3]}-D{s[4]}-w{s[5]}" for s in WINDOWS])
def test_the_window_kernel_equals_the_pytorch_chunks(B, G, T, r, D, w, docs):
    spec = NSASpec(l=8, d=4, l_sel=16, n=5, w=w)
    gen = torch.Generator().manual_seed(T)
    q, k, v = torch.randn(B, G, T, r, D, generator=gen), torch.randn(B, G, T, D, generator=gen), torch.randn(B, G, T, D, generator=gen)
    documents = Documents.of(torch.cumsum(torch.rand(B, T, generator=gen) < 4 / T, 1), spec) if docs else None
    d_out = torch.randn(q.shape, generator=gen)
    for q0 in (0, 48):  # the whole sequence, and the queries from 48 on (context parallelism)
        part = q[:, :, q0:]
        out, lse, _, _ = fast_shared.shared_forward(part, k, v, "win", spec, T, q0, documents, None)
        got_out, got_lse, _, _ = fast_shared.shared_forward(part, k, v, "win", spec, T, q0, documents, None, "cpp")
        torch.testing.assert_close(got_out, out, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got_lse, lse, rtol=1e-5, atol=1e-5)
        expected = fast_shared.shared_backward(d_out[:, :, q0:], part, k, v, out, lse, "win", spec, q0, documents, None)
        got = fast_shared.shared_backward(d_out[:, :, q0:], part, k, v, out, lse, "win", spec, q0, documents, None, "cpp")
        for name, g, e in zip(("dq", "dk", "dv"), got, expected):
            assert float((g - e).norm() / e.norm()) < 1e-5, name


CMP = [(1, 2, 203, 6, 16, False, 0), (2, 2, 203, 6, 16, True, 0), (2, 2, 203, 6, 16, True, 48),
       (2, 1, 40, 4, 32, True, 0), (1, 2, 300, 2, 64, False, 96), (1, 1, 7, 6, 16, False, 0)]


@pytest.mark.parametrize("B,G,T,r,D,docs,q0", CMP, ids=[f"T{c[2]}-r{c[3]}-D{c[4]}-docs{c[5]}-q0{c[6]}" for c in CMP])
def test_the_cmp_kernel_equals_the_pytorch_chunks(B, G, T, r, D, docs, q0):
    """Outputs, logsumexps, the sel blocks chosen from the group scores it returns, and every gradient;
    T = 7 < l: no slot visible, output 0."""
    gen = torch.Generator().manual_seed(T + q0)
    documents = Documents.of(torch.cumsum(torch.rand(B, T, generator=gen) < 4 / T, 1), SPEC) if docs else None
    S = T // SPEC.d if docs else SPEC.num_cmp_blocks(T)
    q, k, v = (torch.randn(B, G, *shape, generator=gen) for shape in ((T - q0, r, D), (S, D), (S, D)))
    d_out = torch.randn(q.shape, generator=gen)
    expected, got = (fast_shared.shared_forward(q, k, v, "cmp", SPEC, T, q0, documents, None, kernel)
                     for kernel in ("torch", "cpp"))
    for name, g, e in zip(("out", "lse"), got, expected):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5, msg=name)
    assert torch.equal(got[2], expected[2]) and torch.equal(got[3], expected[3])  # the same sel blocks
    grads = [fast_shared.shared_backward(d_out, q, k, v, *expected[:2], "cmp", SPEC, q0, documents, None, kernel)
             for kernel in ("torch", "cpp")]
    for name, e, g in zip(("dq", "dk", "dv"), *grads):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-5, msg=name)


def test_the_cmp_scores_are_the_probabilities_down_to_subnormals():
    """The scores the sel blocks are picked from are the probabilities summed over a group's heads,
    to fp32 rounding also where they are tiny: peaked softmaxes (as a trained model's) leave most
    blocks with scores of 1e-20 .. 1e-44, and the choice among those must not change with the exp."""
    gen = torch.Generator().manual_seed(0)
    B, G, T, r, D = 1, 2, 400, 2, 16
    S = SPEC.num_cmp_blocks(T)
    q, k, v = 4 * torch.randn(B, G, T, r, D, generator=gen), 4 * torch.randn(B, G, S, D, generator=gen), torch.randn(B, G, S, D, generator=gen)
    out, lse = torch.empty_like(q), q.new_empty(B, G, T, r)
    scores = cpu_attention.cmp_forward(q, cpu_attention.cmp_keys(k, v), out, lse, 0, T, 0, SPEC, None)
    visible = torch.arange(S) * SPEC.d + SPEC.l - 1 <= torch.arange(T)[:, None]
    s = (torch.einsum("bgtrd,bgsd->bgtrs", q.double(), k.double()) * D**-0.5).masked_fill(~visible[:, None], float("-inf"))
    expected = torch.softmax(s, -1).nan_to_num(0).sum(3).float()  # exact, then rounded once
    assert expected[expected > 0].min() < 1e-38  # subnormal probabilities are there
    torch.testing.assert_close(scores, expected, rtol=1e-4, atol=3e-45)  # fp32 scores of up to ~100: 1e-5 relative


CHOICES = [(NSASpec(l=4, d=2, l_sel=8, n=16, w=64), 1024, 768, 256), (M7C, 1000, 0, 1000), (SPEC, 203, 48, 155),
           (NSASpec(l=8, d=4, l_sel=8, n=5, w=8), 90, 0, 90), (M7C, 4096, 1024, 512),
           (NSASpec(l=8, d=4, l_sel=16, n=16, w=24), 100, 0, 100)]
"""(spec, T, t0, C) of the choice's checks (here and for the Triton kernel's): fewer candidates than n at the start,
a partial last block, the paper's blocks, a chunk inside the sequence, n above the 7 blocks there are."""


def choice_inputs(spec: NSASpec, T: int, C: int) -> tuple[torch.Tensor, Documents]:
    """Group scores (3, 2, C, Nc) in quarters and zeros (ties), and documents of 300 and 77 tokens and one of T."""
    gen = torch.Generator().manual_seed(T)
    group = (torch.rand(3, 2, C, spec.num_cmp_blocks(T), generator=gen) * 4).floor() / 4
    group[..., ::7] = 0
    return group, Documents.of(torch.stack([torch.arange(T) // 300, torch.arange(T) // 77, torch.arange(T) * 0]), spec)


@pytest.mark.parametrize("spec,T,t0,C", CHOICES, ids=[f"T{c[1]}-t0{c[2]}-l{c[0].l_sel}" for c in CHOICES])
def test_the_kernel_chooses_and_explores_the_blocks_pytorch_does(spec, T, t0, C):
    """The sel blocks picked in the kernel (`cpu_attention.choose_blocks`) are `common.choose_blocks'`, in the
    same order: scores in quarters and zeros (ties go to the lower block), forced blocks first, fewer candidates
    than n near the start, with and without documents (their starts inside the chunk); and the kernel's draw of
    explored blocks is `routing.explore_blocks'` (where ok), with one position per query or per row and query
    (documents), for int and tensor seeds."""
    group, docs = choice_inputs(spec, T, C)
    want = common.choose_blocks(group, spec, t0, T, docs)
    got = cpu_attention.choose_blocks(group, spec, t0, T, docs)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and not want[1][1].all()  # row 1: short documents
    idx, valid = common.choose_blocks(group, spec, t0, T)
    got = cpu_attention.choose_blocks(group, spec, t0, T, None)
    assert torch.equal(got[0], idx) and torch.equal(got[1], valid)
    assert bool((~valid).any()) == (t0 < (spec.n - 1) * spec.l_sel)  # fewer candidates than n
    Ns = spec.num_sel_blocks(T)
    t = torch.arange(t0, t0 + C)[None]
    for positions in (t, (t - torch.tensor([[0], [5], [17]])).clamp(min=0)):
        for seed in (0, 7, torch.tensor(123456789)):
            want = explore_blocks(idx, positions, Ns, spec, 8, seed)
            extra, ok = ops.explore_blocks(idx, positions, Ns, spec, 8, seed)
            assert want[1].any() or Ns <= spec.n  # M7C at 1,000: 16 blocks, all chosen
            assert torch.equal(ok, want[1]) and torch.equal(extra[ok], want[0][want[1]])


SCORES = [(8, 2, 1024, 2, 32, NSASpec(l=4, d=2, l_sel=8, n=16, w=64), 0), (1, 2, 700, 6, 64, M7C, 0),
          (2, 2, 203, 3, 16, SPEC, 48), (2, 1, 150, 1, 128, NSASpec(l=8, d=4, l_sel=8, n=5, w=24), 0)]


@pytest.mark.parametrize("B,G,T,r,D,spec,q0", SCORES, ids=[f"T{c[2]}-r{c[3]}-D{c[4]}-q0{c[6]}" for c in SCORES])
def test_the_scores_gradient_kernel_equals_the_pytorch_chunks(B, G, T, r, D, spec, q0):
    """`routing.scores_backward` without documents takes the scores' gradient through the cmp probabilities in the
    kernel (`cmp_scores_backward`): dq and dkc as the PyTorch chunks give them in fp64, chosen and explored blocks."""
    gen = torch.Generator().manual_seed(T + q0)
    Nc = spec.num_cmp_blocks(T)
    q, kc, vc = (torch.randn(B, G, *shape, generator=gen) for shape in ((T - q0, r, D), (Nc, D), (Nc, D)))
    ks, vs = (torch.randn(B, T, G, D, generator=gen) for _ in range(2))
    _, _, idx, valid = fast_shared.shared_forward(q, kc, vc, "cmp", spec, T, q0, None, None)
    t = torch.arange(q0, T)[None]
    extra, ok = explore_blocks(idx, t, spec.num_sel_blocks(T), spec, 3, 5)
    free = torch.cat([valid & ~forced_blocks(idx, t[:, None], spec), ok], -1)
    idx, valid = torch.cat([idx, extra], -1), torch.cat([valid, ok], -1)
    qh, kch = q.transpose(1, 2).flatten(2, 3), kc.transpose(1, 2)
    g_sel, d_o = torch.rand(B, T - q0, G * r, generator=gen), torch.randn(qh.shape, generator=gen)
    n = extra.shape[-1]
    got = routing.scores_backward(d_o, qh, kch, ks, vs, g_sel, idx, valid, free, spec, None, q0, 0.7, n, "cpp")
    want = routing.scores_backward(*(x.double() for x in (d_o, qh, kch, ks, vs, g_sel)), idx, valid, free, spec, None,
                                   q0, 0.7, n, "torch")
    for name, g, e in zip(("dq", "dkc"), got, want):
        assert float(e.norm()) > 1.0 and float((g.double() - e).norm() / e.norm()) < 1e-5, name


def test_auto_runs_every_branch_through_the_kernels_on_cpus_in_fp32(monkeypatch):
    calls = []
    for name in ("cmp_forward", "cmp_backward", "sel_forward", "sel_backward", "window_forward", "window_backward"):
        def counted(*a, _fn=getattr(cpu_attention, name), _name=name):
            calls.append(_name)
            return _fn(*a)
        monkeypatch.setattr(cpu_attention, name, counted)
    args = [x.requires_grad_() for x in random_inputs(1, 100, 12, 2, 16, SPEC, dtype=torch.float32)]
    choose_family("auto", CPU, torch.float32, SPEC, 6, 16)(*args, SPEC).sum().backward()
    assert sorted(set(calls)) == ["cmp_backward", "cmp_forward", "sel_backward", "sel_forward", "window_backward",
                                  "window_forward"]
    count = len(calls)  # cmp forward: one call per chunk
    choose_family("auto", CPU, torch.float64, SPEC, 6, 16)(*[x.double() for x in args], SPEC)  # the PyTorch kernels
    nsa_fast(*args, SPEC)  # the branch-by-branch path alone: the PyTorch kernels, whatever runs here
    assert len(calls) == count


@pytest.mark.parametrize("with_docs", [False, True])
def test_long_runs_go_backward_through_atens_fused_attention(monkeypatch, with_docs):
    """cmp over at least FUSED_BACKWARD_KEYS keys: the kernel's forward, ATen's fused backward (faster
    there), and the gradients of the kernel's own backward; shorter runs and every win keep the kernel's."""
    monkeypatch.undo()  # the default FUSED_BACKWARD_KEYS
    assert cpu_attention.own_backward("win", 32768, 2) and not cpu_attention.own_backward("cmp", 2047, 6)
    assert cpu_attention.own_backward("cmp", 127, 2) and not cpu_attention.own_backward("cmp", 511, 2)
    assert cpu_attention.own_backward("cmp", 511, 6)  # M7C at 8k: the kernel's backward is the faster
    calls = []
    for module, name in ((cpu_attention, "cmp_backward"), (cpu_attention, "window_backward"),
                         (fused_attention, "attend_backward")):
        def counted(*a, _fn=getattr(module, name), _name=name):
            calls.append(_name)
            return _fn(*a)
        monkeypatch.setattr(module, name, counted)
    args, docs = random_parts_inputs(203, with_docs, torch.float32)
    grads = {}
    for keys in (1 << 30, 24):  # every run the kernel's own; from 24 compressed keys, ATen's for cmp
        monkeypatch.setattr(cpu_attention, "FUSED_BACKWARD_KEYS", (keys, keys))
        calls.clear()
        x = [a.detach().requires_grad_() for a in args]
        nsa_fast(*x, SPEC, Kernels("cpp", "cpp", "cpp"), docs).square().sum().backward()
        grads[keys] = [a.grad for a in x]
        assert "window_backward" in calls
        assert ("attend_backward" in calls) == (keys == 24)
        assert ("cmp_backward" in calls) == (keys != 24)
    for own, fused in zip(*grads.values()):
        torch.testing.assert_close(fused, own, rtol=1e-4, atol=1e-5)


def test_the_ops_pass_opcheck():
    q, ks, vs, idx, valid, start = sel_inputs(1, 2, 90, 6, 16, SPEC, True, seed=0)
    spec = [SPEC.l, SPEC.d, SPEC.l_sel, SPEC.n, SPEC.w]
    torch.library.opcheck(ops._selected_kernel_op, (q.requires_grad_(), ks, vs, idx, valid, spec, 0, start))
    d_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(1))
    torch.library.opcheck(ops._sel_weight_grad_op, (d_out, q.detach(), ks, vs, idx, valid, 3, spec, 0, start))


@pytest.mark.parametrize("which", [[0, 1, 2], [1, 2], [0, 2], [2]])
@pytest.mark.parametrize("r,D", [(1, 16), (2, 32), (6, 64)])
def test_the_branches_mix_in_one_pass(which, r, D):
    """The kernel's gated sum (`ops.mix`) of the branches computed, in the heads' layout, is `common.mix_branches`
    transposed, with the gradients of the gates (0 for a branch not computed) and of each branch's output."""
    gen = torch.Generator().manual_seed(r * D + len(which))
    B, G, Tq = 2, 2, 37
    gates = torch.rand(B, Tq, G * r, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    outs = [torch.randn(B, G, Tq, r, D, generator=gen, dtype=torch.float64, requires_grad=True) for _ in which]
    full = [None] * 3
    for i, o in zip(which, outs):
        full[i] = o
    want = common.mix_branches(gates.view(B, Tq, G, r, 3).transpose(1, 2), *full).transpose(1, 2).reshape(B, Tq, G * r, D)
    d_out = torch.randn(want.shape, generator=gen, dtype=torch.float64)
    want_grads = torch.autograd.grad(want, [gates, *outs], d_out)
    x = [t.detach().float().requires_grad_() for t in (gates, *outs)]
    got = ops.mix(x[0], x[1:], which)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    grads = torch.autograd.grad(got, x, d_out.float())
    for g, w in zip(grads, want_grads):
        torch.testing.assert_close(g.double(), w, rtol=1e-5, atol=1e-5)
    assert (grads[0][..., [i for i in range(3) if i not in which]] == 0).all()
    torch.library.opcheck(ops._mix_op, (x[0], x[1:], which))


def test_the_fast_path_mixes_in_the_kernel_where_a_branch_runs_there(monkeypatch):
    """nsa_fast sums the branches through `cpu_attention.mix` when a branch is the C++ kernel's, and in PyTorch
    (`common.mix_branches`) when every branch is."""
    calls = []
    monkeypatch.setattr(cpu_attention, "mix", lambda *a, _f=cpu_attention.mix: calls.append(1) or _f(*a))
    args, _ = random_parts_inputs(90, False, torch.float32)
    for kernels, mixed in ((Kernels("cpp", "cpp", "cpp"), True), (Kernels("torch", "torch", "cpp"), True), (Kernels(), False)):
        calls.clear()
        nsa_fast(*args, SPEC, kernels)
        assert bool(calls) == mixed, kernels


def test_the_choice_takes_the_kernel_where_it_runs_and_says_why_not(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert choose_family("auto", CPU, torch.float32, M7C, 6, 64).name == "cpp"
    assert choose_family("auto", CPU, torch.bfloat16, M7C, 6, 64).name == "cpp"
    assert choose_family("cpp", CPU, torch.float32, M7C, 6, 64).name == "cpp"
    assert choose_family("torch", CPU, torch.float32, M7C, 6, 64).name == "torch"
    assert choose_family("auto", CPU, torch.float32, NSASpec(l=4, d=2, l_sel=8), 2, 32).name == "cpp"
    for dtype, spec, r, D, why in [(torch.float64, M7C, 6, 64, "compute in float32, and the compute dtype is torch.float64"),
                                   (torch.float32, M7C, 12, 64, r"\(they are 12 and 64\)"),
                                   (torch.float32, M7C, 6, 48, r"\(they are 6 and 48\)"),
                                   (torch.float32, NSASpec(l=8, d=4, l_sel=8), 5, 64, r"\(they are 5 and 64\)")]:
        assert choose_family("auto", CPU, dtype, spec, r, D).name == "torch"  # auto falls back to the tiles
        with pytest.raises(ConfigError, match=f"kernels = 'cpp' cannot run: .*{why}"):
            choose_family("cpp", CPU, dtype, spec, r, D)
    monkeypatch.setattr(cpu_attention, "_build", lambda: (None, "NSA's C++ kernels did not build (no compiler)"))
    assert choose_family("auto", CPU, torch.float32, M7C, 6, 64).name == "torch"
    with pytest.raises(ConfigError, match="did not build \\(no compiler\\); use kernels = 'auto'"):
        choose_family("cpp", CPU, torch.float32, M7C, 6, 64)
    with pytest.raises(ConfigError, match="run on CPUs and this run is on meta"):
        choose_family("cpp", torch.device("meta"), torch.float32, M7C, 6, 64)


def test_sel_backward_reverse_index_lists_each_blocks_readers():
    """The block-by-block sel backward's reverse index (plain tensor ops): for each
    (batch x group, first key of a block), exactly the query rows that chose it, in row order; a
    block starts at its query's document start + j * l'."""
    B, G, Tq, N, L, Tk = 2, 3, 40, 4, 8, 50
    gen = torch.Generator().manual_seed(0)
    start = torch.stack([torch.arange(Tq) // 17 * 17, torch.zeros(Tq, dtype=torch.long)])  # (B, Tq)
    idx = torch.stack([torch.randperm(5, generator=gen)[:N] for _ in range(B * G * Tq)]).view(B, G, Tq, N)
    t = torch.arange(Tq)[None, None, :, None]
    valid = (torch.rand(B, G, Tq, N, generator=gen) < 0.7) & (start[:, None, :, None] + idx * L <= t)  # causal
    idx32, start32 = torch.where(valid, idx, -1).to(torch.int32), start.to(torch.int32)
    offsets, readers = block_readers(idx32, start32, L, Tk)
    expected: dict[tuple[int, int], list[int]] = {}
    for b, g, row, i in torch.nonzero(valid).tolist():
        expected.setdefault((b * G + g, int(start[b, row]) + int(idx[b, g, row, i]) * L), []).append(row)
    got = {}
    for key in range(B * G * Tk):
        lo, hi = offsets[key].item(), offsets[key + 1].item()
        if hi > lo:
            got[divmod(key, Tk)] = readers[lo:hi].tolist()
    assert got == expected
    assert offsets[-1] == valid.sum()


def test_a_build_waiting_on_torchs_lock_says_so(tmp_path, capsys):
    """torch waits on its build lock without a word (a build killed mid-way leaves it for good): past the limit,
    one line on stderr names the lock and the fix; nothing when the build ends in time or no lock is there."""
    lock = tmp_path / "lock"
    with cpu_attention.said_if_waiting(lock, 0.05):  # no lock
        time.sleep(0.3)
    lock.touch()
    with cpu_attention.said_if_waiting(lock, 5.0):  # done in time
        pass
    assert capsys.readouterr().err == ""
    with cpu_attention.said_if_waiting(lock, 0.05):
        time.sleep(0.3)
    err = capsys.readouterr().err
    assert str(lock) in err and "remove that file" in err and err.count("\n") == 1
