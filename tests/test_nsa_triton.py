"""The Triton sel kernels (forward and backward) against the reference, on CPU under TRITON_INTERPRET=1.

Triton picks interpreted or compiled kernels when they are defined, so the checks run in fresh
processes with the variable set (this file run as a script, one part of the report each, as many at
a time as there are cores: the interpreter runs on one); the tests read the merged report.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from nsa_titan.models.attention import NSASpec, choose_family, nsa_fast, nsa_reference  # noqa: E402
from nsa_titan.models.attention.common import block_readers  # noqa: E402
from test_cpu_attention import CHOICES, choice_inputs  # noqa: E402

pytestmark = pytest.mark.multiprocess

SPEC = NSASpec(l=8, d=4, l_sel=16, n=5, w=24)
CASES = [  # (batch, T, H, G, D): T < l'; T not a multiple of l, d or l'; GQA 6, 16, 1; D 16..128
    (2, 13, 6, 1, 32),
    (1, 37, 16, 1, 16),
    (2, 61, 12, 2, 64),
    (1, 45, 4, 4, 128),
]
NAMES = ("q", "k_cmp", "v_cmp", "k_sel", "v_sel", "k_win", "v_win", "gates")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def run_part(part: str) -> dict:
    """In an interpreted process, one part of the report: `case<i>` (fast with the Triton kernels vs
    reference: outputs, gradients), `half`, `documents`, `parts`, `opcheck`, `shared` or `causal`."""
    from test_nsa_reference import random_inputs

    report = {"cases": []}
    for B, T, H, G, D in [CASES[int(part.removeprefix("case"))]] if part.startswith("case") else []:
        args = random_inputs(B, T, H, G, D, SPEC, dtype=torch.float32, seed=T)
        for a in args:
            a.requires_grad_(True)
        chosen = choose_family("auto", torch.device("cpu"), torch.float32, SPEC, 6, D).kernels
        used = f"{chosen.cmp} {chosen.sel} {chosen.win}"
        ref = nsa_reference(*args, SPEC)
        grad_out = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1))
        grads_ref = torch.autograd.grad((ref * grad_out).sum(), args)
        out = nsa_fast(*args, SPEC)
        grads = torch.autograd.grad((out * grad_out).sum(), args)
        report["cases"].append({"shape": [B, T, H, G, D], "used": used, "out": rel(out.detach(), ref.detach()),
                                "grads": {n: rel(a, b) for n, a, b in zip(NAMES, grads, grads_ref)}})
    sections = {"half": half_precision, "documents": documents, "parts": query_parts, "opcheck": opcheck,
                "shared": shared_kernels, "causal": causal, "choose": choose}
    if part in sections:
        report[part] = sections[part]()
    return report


def half_precision() -> dict:
    """The kernels' fp16 path (bf16 takes the same code on GPUs; the interpreter mis-computes bf16
    even for a bare tl.dot) against the fp32 reference."""
    from test_nsa_reference import random_inputs
    args = random_inputs(1, 61, 12, 2, 32, SPEC, dtype=torch.float32, seed=9)
    half = [a.half().requires_grad_(True) for a in args]
    out = nsa_fast(*half, SPEC)
    grads = torch.autograd.grad(out.float().square().sum(), half)
    full = [a.requires_grad_(True) for a in args]
    ref = nsa_reference(*full, SPEC)
    grads_ref = torch.autograd.grad(ref.square().sum(), full)
    return {"dtype": str(out.dtype), "out": rel(out.detach().float(), ref.detach()),
            "grads": {n: rel(a.float(), b) for n, a, b in zip(NAMES, grads, grads_ref)}}


def documents() -> dict:
    """A packed window equals its documents run one by one (the model, 1 layer)."""
    from test_documents import build, packed_and_separate
    model = build(torch.float32, attn_impl="fast", n_layers=1)
    layouts = [[5, 70, 16, 29], [13, 32, 75]]
    tokens = torch.randint(0, 61, (2, 120), generator=torch.Generator().manual_seed(5))
    grad_out = torch.randn(2, 120, 61, generator=torch.Generator().manual_seed(6))
    packed, g_packed, separate, g_separate = packed_and_separate(model, tokens, layouts, grad_out)
    flat = lambda g: torch.cat([x.flatten() for x in g.values()])  # noqa: E731
    return {"used": model.layers["0"].attention.family.name == "auto" and
            choose_family("auto", torch.device("cpu"), torch.float32, SPEC, 6, 16).name,
            "out": rel(packed, separate), "grads": rel(flat(g_packed), flat(g_separate))}


def query_parts() -> list:
    """Context parallelism: parts of the queries against the whole keys equal the whole run."""
    from test_nsa_fast import random_parts_inputs, whole_and_parts
    report = []
    for with_docs in (False, True):
        args, docs = random_parts_inputs(203, with_docs, torch.float32)
        whole, parts, expected, got = whole_and_parts(args, docs, [16, 48, 112, 160], choose_family(
            "triton", torch.device("cpu"), torch.float32, SPEC, 6, 16).kernels)
        report.append({"docs": with_docs, "out": rel(parts.detach(), whole.detach()),
                       "grads": {n: rel(a, b) for n, a, b in zip(NAMES, got, expected)}})
    return report


def opcheck() -> list:
    """The custom ops (one node under compile): schema, fake implementation, registered backward."""
    from nsa_titan.models.attention import Documents, ops
    q = torch.randn(2, 2, 70, 2, 16).requires_grad_(True)  # (B, G, T, r, D)
    ks, vs = (torch.randn(2, 2, 70, 16).requires_grad_(True) for _ in range(2))
    kc = torch.randn(2, 2, 70 // SPEC.d, 16)
    docs = Documents.of(torch.stack([torch.arange(70) // 30, torch.arange(70) // 50]), SPEC)
    report = []
    for q0, with_docs, dtype in ((0, False, torch.float32), (32, True, torch.float32), (0, False, torch.float16)):
        part = q[:, :, q0:].detach().to(dtype).requires_grad_(True)
        ks, vs = (x.detach().to(dtype).requires_grad_(True) for x in (ks, vs))
        d = docs if with_docs else None
        fields = (None,) * 5 if d is None else (d.start, d.end, d.cmp_start, d.first_slot, None)
        spec = [SPEC.l, SPEC.d, SPEC.l_sel, SPEC.n, SPEC.w]
        kcd = kc.to(dtype).requires_grad_(True)
        _, _, idx, valid = ops._shared_op(part.detach().float(), kc, kc, "cmp", spec, 70, q0, *fields, "torch")
        start = None if d is None else d.start[:, q0:]
        try:
            torch.library.opcheck(ops._selected_kernel_op, (part, ks, vs, idx, valid, spec, q0, start, "triton"))
            torch.library.opcheck(ops._shared_op, (part, kcd, kcd, "cmp", spec, 70, q0, *fields, "triton"))
            torch.library.opcheck(ops._shared_op, (part, ks, vs, "win", spec, 70, q0, *fields, "triton"))
            report.append("ok")
        except Exception as e:  # noqa: BLE001 (reported to the test)
            report.append(f"{type(e).__name__}: {e}"[:500])
    return report


def shared_kernels() -> list:
    """The Triton cmp and win kernels against the PyTorch chunks, op by op: output, logsumexp, the
    chosen blocks and every gradient, over several chunks and key tiles (the cmp dK, dV over several
    segments of the queries, each of 3 steps), with and without documents; and a chunk's cmp scores
    against the PyTorch probabilities summed over the group's heads."""
    from nsa_titan.models.attention import Documents, fast_shared, triton_shared
    fast_shared.CHUNK_CMP, triton_shared.BLOCK_N, triton_shared.ROWS, T = 48, 16, 16, 150  # many tiles
    triton_shared.DKV_ROWS, triton_shared.DKV_SEGMENT = 16, 32  # cmp dK, dV: 4 segments of 3 steps
    docs = Documents.of(torch.stack([torch.arange(T) // 70, torch.arange(T) // 40]), SPEC)
    report = []
    for kind, with_docs, q0, dtype in (("cmp", False, 0, torch.float32), ("cmp", True, 0, torch.float32),
                                       ("cmp", True, 0, torch.float16), ("cmp", True, 64, torch.float32),
                                       ("win", False, 0, torch.float32), ("win", True, 0, torch.float32),
                                       ("win", True, 64, torch.float16)):
        gen = torch.Generator().manual_seed(len(report))
        S = T // SPEC.d if kind == "cmp" else T
        q = torch.randn(2, 2, T - q0, 3, 16, generator=gen).to(dtype)  # (B, G, Tq, r, D)
        k, v = (torch.randn(2, 2, S, 16, generator=gen).to(dtype) for _ in range(2))
        d_out = torch.randn(q.shape, generator=gen).to(dtype)
        d = docs if with_docs else None
        got, want = (fast_shared.shared_forward(q, k, v, kind, SPEC, T, q0, d, d and d.bounds, kernel)
                     for kernel in ("triton", "torch"))
        grads = [fast_shared.shared_backward(d_out, q, k, v, *fwd[:2], kind, SPEC, q0, d, d and d.bounds, kernel)
                 for kernel, fwd in (("triton", got), ("torch", want))]
        case = {"kind": kind, "docs": with_docs, "q0": q0, "dtype": str(dtype),
                "out": rel(got[0].float(), want[0].float()), "lse": rel(got[1], want[1]),
                "blocks": kind == "win" or bool(torch.equal(got[2], want[2]) and torch.equal(got[3], want[3])),
                "grads": [rel(a.float(), b.float()) for a, b in zip(*grads)]}
        if kind == "cmp" and q0 == 0:
            a, b = 96, 144  # the third chunk
            lo, hi, mask = fast_shared._key_range("cmp", SPEC, a, b, S, q.device, d, d.bounds.cmp_slots([(a, b)])[0]
                                                  if d else None)
            p, _ = fast_shared._probs(q[:, :, a:b].float(), k[:, :, lo:hi].float(), mask)
            scores = triton_shared.forward(q, k, v, torch.zeros_like(q), torch.zeros(q.shape[:4]), kind, a, b, 0,
                                           SPEC, d)
            case.update(lo=lo, scores=rel(scores[..., lo:hi], p.sum(3)),
                        outside=float(scores[..., :lo].abs().sum() + scores[..., hi:].abs().sum()))
        report.append(case)
    return report


def choose() -> list:
    """The choice of sel blocks in one launch (`triton_shared.choose_blocks`) against `common.choose_blocks`
    on test_cpu_attention's cases: scores in quarters and zeros (ties go to the lower block), with and
    without documents (their starts inside the chunk)."""
    from nsa_titan.models.attention import common, triton_shared
    report = []
    for spec, T, t0, C in CHOICES:
        group, documents = choice_inputs(spec, T, C)
        for docs in (None, documents):
            want = common.choose_blocks(group, spec, t0, T, docs)
            got = triton_shared.choose_blocks(group, spec, t0, T, docs)
            report.append({"T": T, "docs": docs is not None, "idx": bool(torch.equal(got[0], want[0])),
                           "valid": bool(torch.equal(got[1], want[1])), "fewer": bool((~want[1]).any())})
    return report


def causal() -> list:
    """Changing the inputs at position s leaves every earlier output unchanged."""
    from test_nsa_reference import random_inputs
    with torch.no_grad():
        args = random_inputs(1, 50, 12, 2, 16, SPEC, dtype=torch.float32, seed=3)
        base = nsa_fast(*args, SPEC)
        report = []
        for s in (0, 15, 16, 33, 49):
            changed = [a.clone() for a in args]
            for i, a in enumerate(changed):
                if i not in (1, 2):  # raw per-position inputs (compressed blocks stay as they are)
                    a[:, s] += 1.0
            out = nsa_fast(*changed, SPEC)
            report.append([s, bool(torch.equal(out[:, :s], base[:, :s])), bool(not torch.equal(out[:, s], base[:, s]))])
    return report


PARTS = [f"case{i}" for i in range(len(CASES))] + ["half", "documents", "parts", "opcheck", "shared", "causal",
                                                  "choose"]


@pytest.fixture(scope="module")
def report() -> dict:
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed (pip install -e '.[test]' installs it)")
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}

    def run(part: str) -> dict:
        done = subprocess.run([sys.executable, __file__, part], env=env, capture_output=True, text=True, timeout=1800)
        assert done.returncode == 0, f"part {part}: {done.stderr[-3000:]}"
        return json.loads(done.stdout.strip().splitlines()[-1])

    merged: dict = {"cases": []}
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        for part in pool.map(run, PARTS):
            merged["cases"] += part.pop("cases")
            merged.update(part)
    return merged


def test_triton_kernels_are_what_runs_under_the_interpreter(report):
    assert [c["used"] for c in report["cases"]] == ["triton triton triton"] * len(CASES)  # cmp, sel, win


def test_triton_cmp_and_win_kernels_equal_the_pytorch_chunks(report):
    """The cmp and win kernels: the same output, logsumexp, chosen sel blocks and gradients as the
    PyTorch chunks (with and without documents, a part of the queries, fp32 and fp16), and a chunk's
    cmp scores equal to the PyTorch probabilities summed over the group's heads, 0 for slots the
    chunk cannot see (the probabilities themselves are never written)."""
    cases = report["shared"]
    assert [(c["kind"], c["docs"], c["q0"]) for c in cases] == [
        ("cmp", False, 0), ("cmp", True, 0), ("cmp", True, 0), ("cmp", True, 64), ("win", False, 0), ("win", True, 0),
        ("win", True, 64)]
    assert cases[1]["lo"] > 0
    for c in cases:
        tol = 1e-6 if c["dtype"] == "torch.float32" else 2e-3
        assert c["blocks"] and c["out"] < tol and c["lse"] < tol and max(c["grads"]) < max(tol, 2e-6), c
        assert "scores" not in c or (c["scores"] < 1e-6 and c["outside"] == 0), c


def test_triton_choice_of_sel_blocks_equals_pytorchs(report):
    """One launch per chunk picks the blocks `common.choose_blocks` picks, in the same order, with and
    without documents, where a query has fewer candidates than n and where it has more."""
    cases = report["choose"]
    assert len(cases) == 2 * len(CHOICES) and {c["docs"] for c in cases} == {False, True}
    assert {c["fewer"] for c in cases} == {False, True}
    assert all(c["idx"] and c["valid"] for c in cases), cases


@pytest.mark.parametrize("i", range(len(CASES)), ids=["B{}-T{}-H{}-G{}-D{}".format(*c) for c in CASES])
def test_triton_sel_equals_reference_output_and_gradients(report, i):
    case = report["cases"][i]
    assert case["out"] < 1e-5
    for name, err in case["grads"].items():
        assert err < 1e-5, (name, err)


def test_triton_sel_in_half_precision_tracks_the_fp32_reference(report):
    half = report["half"]
    assert half["dtype"] == "torch.float16" and half["out"] < 5e-3
    for name, err in half["grads"].items():
        assert err < 5e-3, (name, err)


def test_triton_sel_op_passes_opcheck(report):
    """The Triton sel kernels as a custom op (so compiled blocks keep them as one node, as on the
    first GPU run): schema, fake implementation (an fp32 logsumexp for fp16 queries too),
    registered backward; a part of the queries with documents included."""
    assert report["opcheck"] == ["ok", "ok", "ok"], report["opcheck"]


def test_triton_sel_packed_documents_equal_separate_runs(report):
    docs = report["documents"]
    assert docs["used"] == "triton"
    assert docs["out"] < 1e-5 and docs["grads"] < 1e-5, docs


def test_triton_sel_queries_in_parts_equal_the_whole(report):
    """Context parallelism on the Triton kernels: each part of the queries against the whole keys."""
    assert [p["docs"] for p in report["parts"]] == [False, True]
    for part in report["parts"]:
        assert part["out"] < 1e-6, part
        for name, err in part["grads"].items():
            assert err < 1e-6, (part["docs"], name, err)


def test_triton_sel_is_causal(report):
    for s, before_unchanged, at_changed in report["causal"]:
        assert before_unchanged, f"output before {s} changed"
        assert at_changed, s


def test_sel_backward_reverse_index_lists_each_blocks_readers():
    """The block-centric backward's reverse index (plain tensor ops, checked without Triton): for each
    (batch x group, first key of a block), exactly the query rows that chose it, in row order; a
    block starts at its query's document start + j * l'."""
    from nsa_titan.models.attention import triton_sel

    B, G, Tq, N, L, Tk = 2, 3, 40, 4, 8, 50
    gen = torch.Generator().manual_seed(0)
    start = torch.stack([torch.arange(Tq) // 17 * 17, torch.zeros(Tq, dtype=torch.long)])  # (B, Tq)
    idx = torch.stack([torch.randperm(5, generator=gen)[:N] for _ in range(B * G * Tq)]).view(B, G, Tq, N)
    t = torch.arange(Tq)[None, None, :, None]
    valid = (torch.rand(B, G, Tq, N, generator=gen) < 0.7) & (start[:, None, :, None] + idx * L <= t)  # causal
    idx32, start32 = triton_sel._prepared(idx, valid, start, B, Tq)
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


if __name__ == "__main__":
    print(json.dumps(run_part(sys.argv[1])))
