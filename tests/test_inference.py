"""Using a trained model: incremental decoding == full forward, evaluate == validation, generate."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from nsa_titan import generate as generate_cli
from nsa_titan.config import Model
from nsa_titan.evaluate import evaluate
from nsa_titan.checkpoint.inference import load_model
from nsa_titan.data.batch import document_ids
from nsa_titan.models import decode
from nsa_titan.models.attention import FAMILIES, Family
from nsa_titan.models.decode import Decoder
from nsa_titan.models.decode_cache import cache_sizes
from nsa_titan.models.transformer import Transformer

from conftest import ROOT, interpreted, interpreted_commands, tb_run, torchrun
from test_families import M7C_INTERPRETED

# Small blocks so that 70 tokens cross many window, compression and selection boundaries.
SMALL = dict(dim=64, n_layers=2, n_heads=4, n_kv_groups=2, head_dim=16, vocab_size=97, cmp_block_size=8,
             cmp_stride=4, sel_block_size=8, sel_top_n=3, window_size=12)


def small_model(attention: str, family: Family | None = None, **sizes: int) -> Transformer:
    """SMALL (`sizes` changed) as NSA, dense, or NSA with `smear` (its matrix drawn at random by `init_weights`)."""
    cfg = Model(**{**SMALL, **sizes}, attention=attention.removesuffix("+smear"), smear=attention.endswith("smear"))
    model = Transformer(cfg, 128, family)
    model.init_weights(0)
    return model


@pytest.fixture(params=["cpp", "pytorch"])
def step_path(request, monkeypatch) -> str:
    """A decoding step's NSA attention by NSA's C++ kernels (asserted taken), or in PyTorch."""
    if request.param == "pytorch":
        monkeypatch.setattr(decode, "DECODE_KERNELS", ("torch",))  # what `auto` takes
        yield request.param
        return
    calls = []
    real = decode.STEPS["cpp"]
    monkeypatch.setitem(decode.STEPS, "cpp", lambda *a: calls.append(1) or real(*a))
    yield request.param
    if "nsa" in request.node.callspec.params.get("attention", ""):
        assert calls, "the C++ step did not run"


@pytest.mark.parametrize("attention", ["nsa", "dense", "nsa+smear"])
@pytest.mark.parametrize("prompt", [1, 7, 8, 11, 30])
def test_incremental_decoding_equals_the_full_forward_at_every_position(attention, prompt, step_path):
    model = small_model(attention)
    tokens = torch.randint(0, 97, (2, 70), generator=torch.Generator().manual_seed(prompt))
    with torch.no_grad():
        full = model(tokens)
    decoder = Decoder(model)
    steps = [decoder.prefill(tokens[:, :prompt])] + [decoder.step(tokens[:, t:t + 1]) for t in range(prompt, 70)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("attention", ["nsa", "dense", "nsa+smear"])
@pytest.mark.parametrize("prompt", [40, 47, 58])
def test_decoding_with_documents_equals_the_packed_forward(attention, prompt, step_path):
    """Rows [20 | 5 | 45 | 30] and [3 | 22 | 45 | 30] (same last two starts, other slots before them):
    the prompt ends inside the third document, steps continue it, `reset` starts the fourth."""
    model = small_model(attention)
    tokens = torch.randint(0, 97, (2, 100), generator=torch.Generator().manual_seed(prompt))
    ids = torch.tensor([[0] * 20 + [1] * 5 + [2] * 45 + [3] * 30, [0] * 3 + [1] * 22 + [2] * 45 + [3] * 30])
    with torch.no_grad():
        full = model(tokens, ids)
    decoder = Decoder(model)
    steps = [decoder.prefill(tokens[:, :prompt], ids[:, :prompt])]
    for t in range(prompt, 100):
        if t == 70:
            decoder.reset()  # the fourth document
        steps.append(decoder.step(tokens[:, t:t + 1]))
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)
    assert decoder.t.tolist() == [30, 30]


def beyond_1e5(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest |a - b| over 1e-5 (1 + |b|): above 1, `assert_close(a, b, rtol=1e-5, atol=1e-5)` fails."""
    return float(((a - b).abs() / (1e-5 + 1e-5 * b.abs())).max())


def batched_against_alone(model: Transformer, documents: bool, new: int = 40) -> dict[str, float]:
    """4 prompts of 5, 19, 33 and 48 tokens, left-padded into one batch (the padding a document of its own,
    as transformers pads for `generate`; with `documents`, an end-of-text token inside some prompts, so
    that rows' last documents start at different places), greedily extended by `new` tokens: how far (`beyond_1e5`)
    each row's logits are from that prompt decoded alone and from the full forward of that row's tokens."""
    eos = 96
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 96, (n,), generator=gen) for n in (5, 19, 33, 48)]
    if documents:
        prompts[1][6], prompts[3][30] = eos, eos
    T = max(len(p) for p in prompts)
    tokens = torch.stack([torch.cat([torch.zeros(T - len(p), dtype=torch.long), p]) for p in prompts])
    mask = torch.stack([torch.arange(T) >= T - len(p) for p in prompts]).long()
    batched = Decoder(model)
    logits = [batched.prefill(tokens, document_ids(tokens, mask, eos))[:, -1:]]
    for _ in range(new):
        logits.append(batched.step(logits[-1].argmax(-1)))
    logits = torch.cat(logits, 1)  # (4, new + 1, V): each row's next-token logits
    chosen = logits.argmax(-1)[:, :-1]
    found = {"alone": 0.0, "full": 0.0}
    for b, p in enumerate(prompts):
        alone = Decoder(model)
        ids = p[None]
        row = [alone.prefill(ids, document_ids(ids, None, eos))[:, -1:]] + \
            [alone.step(chosen[b:b + 1, k:k + 1]) for k in range(new)]
        found["alone"] = max(found["alone"], beyond_1e5(logits[b:b + 1], torch.cat(row, 1)))
        whole = torch.cat([p, chosen[b]])[None]
        with torch.no_grad():
            full = model(whole, document_ids(whole, None, eos))[:, len(p) - 1:]
        found["full"] = max(found["full"], beyond_1e5(logits[b:b + 1], full))
    return found


@pytest.mark.parametrize("attention", ["nsa", "dense", "nsa+smear"])
@pytest.mark.parametrize("documents", [False, True], ids=["one-document", "documents"])
def test_batched_decoding_of_prompts_of_different_lengths_equals_each_alone(attention, documents, step_path):
    """`batched_against_alone`, 40 new tokens: each row equals its prompt alone and the full forward (fp32, 1e-5)."""
    found = batched_against_alone(small_model(attention), documents)
    assert max(found.values()) <= 1, found

def m7c_prompt(family: Family | None = None, groups: int = 2) -> tuple[Transformer, torch.Tensor, torch.Tensor]:
    """One layer of M7C's shape (12 heads, 2 KV groups, head dim 64; l=32, d=16, l'=64, n=16, w=512; `groups` 1:
    6 heads, M7C's group) and two 1,300-token rows whose last documents start at 100 and 0: past w, and past n
    blocks (the top-n chooses)."""
    model = Transformer(Model(attention="nsa", dim=64 * 6 * groups, n_layers=1, n_heads=6 * groups,
                              n_kv_groups=groups, head_dim=64, vocab_size=97), 1400, family)
    model.init_weights(0)
    tokens = torch.randint(0, 97, (2, 1340), generator=torch.Generator().manual_seed(3))
    ids = torch.tensor([[0] * 100 + [1] * 1240, [0] * 1340])
    return model, tokens, ids


@pytest.mark.slow
def test_the_decode_kernel_equals_the_reference_step_at_m7c_shapes():
    """40 steps past a 1,300-token prompt (two compressions and more): the C++ step's logits equal the PyTorch
    step's (the reference), fp32, to 1e-5, rows at different positions in their documents."""
    model, tokens, ids = m7c_prompt()
    calls, real = [], decode.STEPS["cpp"]
    logits = {}
    for path in ("cpp", "torch"):
        decoder = Decoder(model, path)
        decoder.prefill(tokens[:, :1300], ids[:, :1300])
        with pytest.MonkeyPatch.context() as mp:
            mp.setitem(decode.STEPS, "cpp", lambda *a: calls.append(path) or real(*a))
            logits[path] = torch.cat([decoder.step(tokens[:, t:t + 1]) for t in range(1300, 1340)], 1)
    assert calls == ["cpp"] * 40
    torch.testing.assert_close(logits["cpp"], logits["torch"], rtol=1e-5, atol=1e-5)



def test_the_decode_kernel_leaves_subnormal_arithmetic_as_it_was():
    """The C++ step computes with subnormals flushed (a peaked softmax's tiny probabilities would take the slow
    path) and restores each thread's mode after: subnormal results survive in ops after a step, on every thread."""
    model, tokens, ids = m7c_prompt()
    decoder = Decoder(model)
    decoder.prefill(tokens[:, :1300], ids[:, :1300])
    calls, real = [], decode.STEPS["cpp"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(decode.STEPS, "cpp", lambda *a: calls.append(1) or real(*a))
        decoder.step(tokens[:, 1300:1301])
    assert calls
    tiny = torch.full((1 << 20,), 1e-39) * 0.5  # split among the intra-op threads
    assert (tiny > 0).all() and float(torch.tensor(1e-39) * 0.5) > 0

@pytest.mark.slow
def test_the_decode_kernel_reads_bf16_caches_as_their_float_values():
    """A bf16 model's step (M7C shapes) by the C++ kernel: bf16 caches read as floats, fp32 arithmetic. Each
    layer's output equals the kernel's over the same caches widened to float32, bit for bit, and the step's
    logits stay within bf16's rounding of the fp32 model's."""
    model, tokens, ids = m7c_prompt()
    with torch.no_grad():
        full = model(tokens, ids)[:, 1300:].float()
    model = model.to(torch.bfloat16)
    checked, real = [], decode.STEPS["cpp"]

    def widened(attn, q, gates, cache, *rest):
        out = real(attn, q, gates, cache, *rest)
        assert {b.dtype for b in cache.buffers.values()} == {torch.bfloat16} and out.dtype == torch.bfloat16
        wide = decode.LayerCache(cache.sizes, cache.pads)
        wide.buffers = {name: buf.float() for name, buf in cache.buffers.items()}
        wide.shape, wide.n_cmp = cache.shape, cache.n_cmp
        torch.testing.assert_close(out, real(attn, q.float(), gates, wide, *rest).to(out.dtype), rtol=0, atol=0)
        checked.append(1)
        return out

    decoder = Decoder(model)
    decoder.prefill(tokens[:, :1300], ids[:, :1300])
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(decode.STEPS, "cpp", widened)
        logits = torch.cat([decoder.step(tokens[:, t:t + 1]) for t in range(1300, 1340)], 1).float()
    assert len(checked) == 40
    assert (logits - full).abs().max() < 0.02 * full.abs().max()  # 0.4% here


def triton_decode_case(case: str) -> dict[str, float]:
    """One check of the Triton decode step, interpreted (run in a fresh process under TRITON_INTERPRET=1: Triton
    decides at definition), the Triton step `auto`'s first there, the prompts by the C++ family: `m7c`, 20 steps at M7C's shapes
    against the PyTorch step (`beyond_1e5`), the compressed slots cut into several parts (`group6`: 6 steps of M7C's
    group of 6 heads, what runs by default); `reset`, the same at SMALL's sizes (l' = 16, tl.dot's least) across
    a new document started by `reset`; `one-document` and `documents`, `batched_against_alone` with 12 new tokens
    at those sizes; with the Triton step's calls."""
    if case == "compression":
        return triton_compression()
    calls, real = [], decode.STEPS["triton"]
    decode.STEPS["triton"] = lambda *a: calls.append(1) or real(*a)
    if case == "poisoned":  # 12 steps on caches left with NaN in every slot, against fresh ones: 0 means equal
        fresh, poisoned, reused = poisoned_against_fresh(small_model("nsa", FAMILIES["cpp"](), sel_block_size=16),
                                                         "triton", 12)
        return {"unequal": float((poisoned != fresh).sum()) + (not reused), "calls": len(calls)}
    if case in ("m7c", "group6", "documents"):  # the compressed slots in parts of 16 (6 at M7C here) or 4, 4 or 2
        decode.triton_decode.CMP_PART, decode.triton_decode.COMBINE = (4, 2) if case == "documents" else (16, 4)
    cpp = FAMILIES["cpp"]()
    if case in ("one-document", "documents"):
        return {**batched_against_alone(small_model("nsa", cpp, sel_block_size=16), case == "documents", 12),
                "calls": len(calls)}
    if case == "m7c":
        (model, tokens, ids), prompt, steps = m7c_prompt(cpp), 1300, range(1300, 1320)
    elif case == "group6":  # M7C's group of 6 heads and its sizes, 6 steps
        (model, tokens, ids), prompt, steps = m7c_prompt(cpp, groups=1), 1300, range(1300, 1306)
    else:  # "reset": 20 steps past a 20-token prompt, then a new document's first 30 (the caches made by a step)
        model, tokens, ids = small_model("nsa", cpp, sel_block_size=16), torch.randint(0, 97, (2, 70)), None
        prompt, steps = 20, range(20, 70)
    logits = []
    for kernel in ("triton", "torch"):
        decoder, rows = Decoder(model, kernel), []
        decoder.prefill(tokens[:, :prompt], None if ids is None else ids[:, :prompt])
        for t in steps:
            if t == 40 and case == "reset":
                decoder.reset()
            rows.append(decoder.step(tokens[:, t:t + 1]))
        logits.append(torch.cat(rows, 1))
    return {"reference": beyond_1e5(*logits), "calls": len(calls)}


def triton_compression() -> dict[str, float]:
    """The Triton compression step (`compress_step`) at M7C's sizes (l 32, d 16, head dim 64, 2 groups; the MLP
    phi of 256 hidden units, and the mean) for 3 rows at positions whose block completes (the first block, the
    81st) and does not: `beyond_1e5` of the written slots against the Compressor of each block's 32 keys, and
    the written bytes elsewhere (must be 0)."""
    from nsa_titan.models.attention.families.triton.triton_decode import compress_step

    found, gen = {}, torch.Generator().manual_seed(0)
    for phi in ("mlp", "mean"):
        cfg = Model(attention="nsa", dim=768, n_layers=1, n_heads=12, n_kv_groups=2, head_dim=64, vocab_size=64,
                    cmp_phi=phi)
        model = Transformer(cfg, 2048)
        model.init_weights(0)
        attn, (B, G, D, L, d, Pc) = model.layers["0"].attention, (3, 2, 64, 32, 16, 128)
        t = torch.tensor([L - 1, L - 1 + 80 * d, L + 3])  # rows 0 and 1 complete a block, row 2 does not
        keys = [torch.randn(B, 1400, G, D, generator=gen) for _ in range(2)]  # each row's k_cmp, v_cmp
        rings = [torch.zeros(B * G, L, D) for _ in range(2)]
        for ring, x in zip(rings, keys):
            for b in range(B):
                p = torch.arange(max(0, int(t[b]) - L + 1), int(t[b]))  # the ring holds the positions before t
                ring.view(B, G, L, D)[b, :, p % L] = x[b, p].transpose(0, 1)
        kc, vc = torch.zeros(B * G, D, Pc), torch.zeros(B * G, Pc, D)
        with torch.no_grad():
            compress_step(attn.compress_k, attn.compress_v, tuple(rings),
                          tuple(x[torch.arange(B), t][:, None] for x in keys), t, kc, vc, G)
            for b, slot in ((0, 0), (1, 80)):
                first = int(t[b]) - L + 1
                want_k, want_v = attn.compress(keys[0][b:b + 1, first:first + L], keys[1][b:b + 1, first:first + L])
                got_k, got_v = kc.view(B, G, D, Pc)[b, :, :, slot], vc.view(B, G, Pc, D)[b, :, slot]
                found[f"{phi} row {b}"] = max(beyond_1e5(got_k, want_k[0, 0]), beyond_1e5(got_v, want_v[0, 0]))
                kc.view(B, G, D, Pc)[b, :, :, slot], vc.view(B, G, Pc, D)[b, :, slot] = 0, 0
        found[f"{phi} elsewhere"] = float(kc.abs().sum() + vc.abs().sum())
    return found


TRITON_CASES = ("m7c", "group6", "reset", "one-document", "documents", "compression", "poisoned")


BACKGROUND = interpreted_commands(__file__, [c for c in TRITON_CASES if c != "m7c" or M7C_INTERPRETED])
"""The cases interpreted; M7C's sizes opt-in, as test_families' (`M7C_INTERPRETED`)."""


@pytest.fixture(scope="module")
def triton_decode() -> dict[str, dict]:
    return interpreted(BACKGROUND)


@pytest.mark.multiprocess
@pytest.mark.background
@pytest.mark.parametrize("case", TRITON_CASES)
def test_the_triton_decode_step_interpreted_equals_the_reference(triton_decode, case):
    """The Triton decode step (two launches a layer) equals the PyTorch step (fp32, 1e-5) at M7C's shapes and across
    a `reset`; 4 prompts of different lengths batched (with and without documents) equal each decoded alone and
    the full forward; its compression (two launches where a block completes) equals the Compressor (fp32, 1e-5)."""
    if case not in triton_decode:
        pytest.skip("M7C's sizes interpreted: opt-in with NSA_TITAN_INTERPRET_M7C=1 (tests/README.md, 'Interpreted Triton')")
    found = triton_decode[case]
    if case == "compression":  # the compressed key and value where a block completes, nothing elsewhere
        assert len(found) == 6 and found["mlp elsewhere"] == found["mean elsewhere"] == 0, found
        assert max(found.values()) <= 1, found
        return
    assert found.pop("calls") >= {"m7c": 20, "group6": 6, "reset": 80}.get(case, 24), found
    if case == "poisoned":  # a NaN-filled reused cache: the same logits as a fresh one's, bit for bit
        assert found == {"unequal": 0.0}, found
        return
    assert max(found.values()) <= 1, found


def test_the_cache_is_allocated_once_a_request_and_holds_little_more_than_dense_s():
    """Every buffer is allocated at the prefill for the request (its prompt and new tokens, rounded up to whole sel
    blocks) and never again (the steps write in place); stepping past it grows the buffers, equal to a full forward.
    At M7C's paper sizes and 64k the NSA cache holds 1.07x dense's slots (sel's keys, the compressed blocks, and
    rings of w and l positions), not 3x."""
    model = small_model("nsa")
    ids = torch.randint(0, 97, (2, 80), generator=torch.Generator().manual_seed(0))
    decoder = Decoder(model, context=70)
    decoder.prefill(ids[:, :30])
    before = {name: buf.data_ptr() for c in decoder.caches for name, buf in c.buffers.items()}
    for i in range(30, 70):
        decoder.step(ids[:, i:i + 1])
    assert {name: buf.data_ptr() for c in decoder.caches for name, buf in c.buffers.items()} == before
    assert {name: decoder.caches[0].get(name).shape[1] for name in decoder.caches[0].buffers} == \
        {"k_sel": 72, "v_sel": 72, "kc": 17, "vc": 17, "k_win": 12, "v_win": 12, "k_cmp": 8, "v_cmp": 8}
    for i in range(70, 80):  # past the request: the buffers grow, the logits stay a full forward's
        last = decoder.step(ids[:, i:i + 1])
    assert decoder.caches[0].get("k_sel").shape[1] == 128  # twice 72, within the declared 128
    with torch.no_grad():
        torch.testing.assert_close(last, model(ids)[:, -1:], rtol=1e-5, atol=1e-5)
    paper = Transformer(Model(attention="nsa", dim=64, n_heads=4, n_kv_groups=2, head_dim=16, vocab_size=97), 64)
    dense = Transformer(Model(attention="dense", dim=64, n_heads=4, n_kv_groups=2, head_dim=16, vocab_size=97), 64)
    layer = lambda m: next(iter(m.layers.values())).attention  # noqa: E731
    slots = [sum(cache_sizes(layer(m), 65536).values()) for m in (paper, dense)]
    assert slots == [2 * 65536 + 2 * 4095 + 2 * 512 + 2 * 32, 2 * 65536] and slots[0] / slots[1] < 1.1


def poisoned_against_fresh(model: Transformer, kernel: str, steps: int) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """A 5-token prompt and `steps` steps on fresh caches, and again on caches an earlier request left NaN in every
    slot of (the buffers reused): both logits, and whether every buffer was reused."""
    ids = torch.randint(0, 97, (2, 5 + steps), generator=torch.Generator().manual_seed(3))

    def request(decoder: Decoder) -> torch.Tensor:
        logits = [decoder.prefill(ids[:, :5])]
        logits += [decoder.step(ids[:, i:i + 1]) for i in range(5, 5 + steps)]
        return torch.cat(logits, 1)

    fresh = request(Decoder(model, kernel, context=5 + steps))
    decoder = Decoder(model, kernel, context=5 + steps)
    request(decoder)
    for cache in decoder.caches:
        for buffer in cache.buffers.values():
            buffer.fill_(float("nan"))
    pointers = [b.data_ptr() for c in decoder.caches for b in c.buffers.values()]
    poisoned = request(decoder)
    return fresh, poisoned, pointers == [b.data_ptr() for c in decoder.caches for b in c.buffers.values()]


@pytest.mark.parametrize("kernel", ["torch", "cpp"])
def test_a_cache_left_with_nan_in_every_slot_decodes_as_a_fresh_one(kernel):
    """The next request reuses the buffers; the PyTorch and C++ steps weigh unwritten slots by 0, and 0 x NaN is
    NaN: every logit of the request was NaN. (The Triton step: `test_the_triton_decode_step_interpreted...`.)"""
    fresh, poisoned, reused = poisoned_against_fresh(small_model("nsa"), kernel, 40)
    assert reused and not fresh.isnan().any()
    assert torch.equal(poisoned, fresh)


def test_decoding_reads_the_papers_key_count():
    model = Transformer(Model(attention="nsa", dim=64, n_heads=4, n_kv_groups=2, head_dim=16, vocab_size=97), 64)
    reads = Decoder(model).keys_read(65535)  # paper sizes: l=32, d=16, l'=64, n=16, w=512
    assert reads == {"cmp": (65536 - 32) // 16 + 1, "sel": 16 * 64, "win": 512}
    assert sum(reads.values()) == 5631  # the paper's ~5.6k keys at 64k context, against 65,536
    dense = Transformer(Model(attention="dense", dim=64, n_heads=4, n_kv_groups=2, head_dim=16, vocab_size=97), 64)
    assert Decoder(dense).keys_read(65535) == {"dense": 65536}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny model trained 6 steps on the embedded corpus, validated and checkpointed at step 6."""
    dump = tmp_path_factory.mktemp("trained")
    args = ["--model.dim", "64", "--model.n_layers", "2", "--model.n_heads", "4", "--model.n_kv_groups", "2",
            "--model.head_dim", "16", "--training.seq_len", "64", "--training.local_batch_size", "4",
            "--training.steps", "6", "--validation.freq", "6", "--validation.steps", "5", "--checkpoint.enable",
            "true", "--checkpoint.interval", "6", "--checkpoint.export_at_end", "true", "--checkpoint.export_dtype",
            "float32", "--training.mixed_precision_param", "float32", "--data.num_workers", "0",
            "--job.dump_folder", str(dump)]
    proc = torchrun(["-m", "nsa_titan.train", *args], nproc=1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dump


@pytest.mark.multiprocess
def test_evaluate_reports_the_trainers_validation_loss(trained):
    events = EventAccumulator(tb_run(trained / "tb"))
    events.Reload()
    validation = events.Scalars("validation/loss")[-1]
    assert validation.step == 6
    result = evaluate(str(trained / "checkpoint" / "step-6"), "validation", batches=5)
    assert result["batches"] == 5
    assert result["loss"] == pytest.approx(validation.value, rel=1e-5)
    assert result["bits_per_byte"] > 0 and result["perplexity"] == pytest.approx(2.718281828 ** result["loss"])
    exported = evaluate(str(trained / "checkpoint" / "model-step-6.pt"), "validation", batches=5)
    assert exported["loss"] == pytest.approx(result["loss"], rel=1e-6)


@pytest.mark.multiprocess
def test_generate_is_reproducible_with_a_seed(trained, capsys, caplog, monkeypatch, tmp_path):
    """The same seed, the same text; the CLI's decoding step chosen by timing on the request's context (the prompt and
    25 new tokens: position 1,024), once (a machine with nothing kept): the later requests read the kept timings."""
    ckpt = str(trained / "checkpoint" / "step-6")
    runs = []
    monkeypatch.setenv("NSA_TITAN_CACHE", str(tmp_path / "cache"))
    caplog.set_level(logging.INFO, logger="nsa_titan")
    for seed in (3, 3, 4):
        assert generate_cli.main([ckpt, "--prompt", "def ", "--max_new_tokens", "25", "--seed", str(seed)]) == 0
        runs.append(capsys.readouterr().out)
    assert runs[0] == runs[1] and runs[0].startswith("def ")
    assert runs[0] != runs[2]
    lines = re.findall(r"NSA decoding here: .* a step \(one layer and row at position 1024(.*)\): decode_kernels = "
                       r"'auto' takes the (cpp|torch) step", caplog.text)
    assert [kept for kept, _ in lines] == ["", ", kept from an earlier run", ", kept from an earlier run"], caplog.text
    model, tokenizer, _ = load_model(ckpt)
    greedy = [list(generate_cli.generate(model, tokenizer, "import", 10, temperature=0)) for _ in range(2)]
    assert greedy[0] == greedy[1]


@pytest.mark.multiprocess
@pytest.mark.parametrize("temperature", [0.0, 0.9], ids=["greedy", "sampled"])
def test_generate_in_batches_gives_each_prompt_its_text_alone(trained, capsys, tmp_path, temperature):
    """5 prompts of different lengths in batches of 4 (so also a batch of 1): each prompt's text is the one
    `generate` gives it alone with seed + its index; the CLI prints them `[i] prompt text`."""
    ckpt = str(trained / "checkpoint" / "step-6")
    model, tokenizer, cfg = load_model(ckpt)
    prompts = ["def ", "The with statement", "import", "x", "Raised when an operation"]
    rows = generate_cli.generate_batch(model, tokenizer, prompts, 20, temperature, seed=7, batch_size=4,
                                       document_masking=cfg.training.document_masking)
    for i, (prompt, row) in enumerate(zip(prompts, rows)):
        assert row == list(generate_cli.generate(model, tokenizer, prompt, 20, temperature, seed=7 + i,
                                                 document_masking=cfg.training.document_masking))
    assert sum(map(len, rows)) > 20
    (tmp_path / "prompts.txt").write_text("\n".join(prompts[2:]) + "\n")
    argv = [ckpt, "--prompt", prompts[0], "--prompt", prompts[1], "--prompts_file", str(tmp_path / "prompts.txt"),
            "--max_new_tokens", "20", "--temperature", str(temperature), "--seed", "7", "--batch_size", "4"]
    assert generate_cli.main(argv) == 0
    expected = "".join(f"[{i}] {p}{tokenizer.decode(r)}\n" for i, (p, r) in enumerate(zip(prompts, rows)))
    assert capsys.readouterr().out == expected


@pytest.mark.multiprocess
def test_bad_checkpoint_or_config_is_a_clear_error(trained, tmp_path):
    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "nsa_titan.generate", *args], cwd=ROOT, capture_output=True,
                              text=True, timeout=120)

    missing = run(str(tmp_path / "nope"), "--prompt", "x")
    assert missing.returncode == 2 and "not found: give a step-N folder, an exported .pt file" in missing.stderr
    other = tmp_path / "other.toml"
    other.write_text((trained / "config.toml").read_text().replace("dim = 64", "dim = 96"))
    mismatch = run(str(trained / "checkpoint" / "step-6"), "--config", str(other))
    assert mismatch.returncode == 2
    assert re.search(r"does not fit this model \(shapes differ: .* in the checkpoint, .* here", mismatch.stderr)


@pytest.mark.multiprocess
def test_evaluate_under_torchrun_shards_the_split(trained):
    proc = torchrun(["-m", "nsa_titan.evaluate", str(trained / "checkpoint" / "step-6"), "--batches", "2"], nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = re.search(r"validation: loss ([\d.]+) \| perplexity [\d.]+ \| bits/byte [\d.]+ \| 2 batches, ([\d,]+) tokens",
                     proc.stdout)
    assert line and int(line.group(2).replace(",", "")) == 2 * 2 * 4 * 64  # 2 ranks x 2 batches x 4 x 64 tokens


if __name__ == "__main__":  # one interpreted check: python tests/test_inference.py triton <case>
    print(json.dumps(triton_decode_case(sys.argv[2])))
