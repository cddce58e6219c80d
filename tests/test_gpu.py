"""GPU-only checks (skipped without CUDA; `scripts/gpu_check.sh` runs them): the kernel families (Triton,
PyTorch, flash-attn's window) on a real device against the reference, the family choice there,
2-rank NCCL FSDP training, and bf16 + compile + activation checkpointing training."""

from __future__ import annotations

import os
import re
import subprocess

import pytest
import torch

from nsa_titan.models.attention import FAMILIES, NSASpec, choose_family, nsa_reference
from nsa_titan.models.attention.families.triton import triton_nsa
from nsa_titan.models.attention.families.pytorch import kernels as kernel_choice

from conftest import ROOT, TINY, torchrun
from test_nsa_reference import random_inputs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

SPEC = NSASpec(l=32, d=16, l_sel=64, n=16, w=512)  # the paper's sizes
SHAPES = [(1, 1000, 12, 2, 64), (2, 2048, 16, 1, 64), (1, 4097, 4, 4, 128)]  # (B, T, H, G, D)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().float() - b.detach().float()).norm() / b.detach().float().norm().clamp_min(1e-30))


def against_reference(family: str, dtype: torch.dtype, shape: tuple[int, ...]) -> dict[str, float]:
    """Relative errors of the kernel `family` in `dtype` against the fp32 reference on CUDA, on
    the same inputs (rounded to `dtype`: else the two pick other sel blocks where scores nearly tie)."""
    B, T, H, G, D = shape
    args = [a.to(dtype).float().cuda() for a in random_inputs(B, T, H, G, D, SPEC, dtype=torch.float32, seed=T)]
    full = [a.clone().requires_grad_(True) for a in args]
    ref = nsa_reference(*full, SPEC)
    grad_out = torch.randn_like(ref)
    ref_grads = torch.autograd.grad((ref * grad_out).sum(), full)
    low = [a.to(dtype).requires_grad_(True) for a in args]
    out = FAMILIES[family]()(*low, SPEC)
    grads = torch.autograd.grad((out.float() * grad_out).sum(), low)
    names = ("q", "k_cmp", "v_cmp", "k_sel", "v_sel", "k_win", "v_win", "gates")
    return {"out": rel(out, ref), **{n: rel(g, r) for n, g, r in zip(names, grads, ref_grads)}}


@pytest.mark.parametrize("family", ["triton", "torch"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES, ids=["B{}-T{}-H{}-G{}-D{}".format(*s) for s in SHAPES])
def test_gpu_families_equal_the_reference(family, dtype, shape):
    """The Triton op, or the PyTorch family's chunks and tiles through the fused CUDA kernel."""
    if family == "triton" and triton_nsa.triton is None:
        pytest.skip("triton is not installed")
    errors = against_reference(family, dtype, shape)
    assert max(errors.values()) < (3e-2 if dtype == torch.bfloat16 else 5e-3), errors


@pytest.mark.parametrize("shape", SHAPES, ids=["B{}-T{}-H{}-G{}-D{}".format(*s) for s in SHAPES])
def test_fused_cuda_kernels_equal_the_reference_in_fp32(shape):
    """In fp32 (the PyTorch kernels: every chunk and tile through the fused CUDA kernel), as close
    to the fp32 reference as the CPU's fused kernels are (tests/test_nsa_fast.py)."""
    errors = against_reference("torch", torch.float32, shape)
    assert max(errors.values()) < 2e-4, errors


@pytest.mark.skipif(kernel_choice.flash_attn_func is None, reason="flash-attn is not installed")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_flash_window_on_cuda_equals_the_reference(dtype):
    errors = against_reference("flash", dtype, SHAPES[0])
    assert max(errors.values()) < (3e-2 if dtype == torch.bfloat16 else 5e-3), errors


@pytest.mark.parametrize("win", ["flash", "triton", "torch"])
def test_gpu_kernels_with_documents_equal_separate_runs(win):
    """Document masking on CUDA in bf16 by the flash, triton and torch families: a packed batch against its
    documents run one by one."""
    from test_documents import build, packed_and_separate

    if win == "flash" and kernel_choice.flash_attn_func is None:
        pytest.skip("flash-attn is not installed")
    if win == "triton" and triton_nsa.triton is None:
        pytest.skip("triton is not installed")
    model = build(torch.bfloat16, FAMILIES[win](), attn_impl="fast", head_dim=64,
                  cmp_block_size=32, cmp_stride=16, sel_block_size=64, sel_top_n=16, window_size=512).cuda()
    layouts = [[700, 20, 1300, 28], [2048]]
    tokens = torch.randint(0, 61, (2, 2048), generator=torch.Generator().manual_seed(0)).cuda()
    grad_out = torch.randn(2, 2048, 61, generator=torch.Generator().manual_seed(1)).cuda().bfloat16()
    packed, g_packed, separate, g_separate = packed_and_separate(model, tokens, layouts, grad_out)
    assert rel(packed, separate) < 3e-2
    flat = lambda g: torch.cat([x.float().flatten() for x in g.values()])  # noqa: E731
    assert rel(flat(g_packed), flat(g_separate)) < 3e-2


@pytest.mark.parametrize("with_docs", [False, True])
def test_gpu_kernels_on_parts_of_the_queries_equal_the_whole(with_docs):
    """Context parallelism's contract on CUDA with the kernels `auto` takes, in fp16: the queries cut
    at multiples of l' against the whole keys give the whole run (outputs and every gradient)."""
    from nsa_titan.models.attention import Documents
    from test_nsa_fast import whole_and_parts

    B, T, H, G, D = 1, 3000, 12, 2, 64
    args = [a.cuda().half() for a in random_inputs(B, T, H, G, D, SPEC, dtype=torch.float32, seed=5)]
    docs = None
    if with_docs:  # ids on the host, as the loader gives them
        ids = torch.cumsum(torch.rand(B, T, generator=torch.Generator().manual_seed(1)) < 2e-3, 1)
        docs = Documents.of(ids, SPEC).to(torch.device("cuda"))
        args[1:3] = [torch.randn(B, T // SPEC.d, G, D, device="cuda").half() for _ in range(2)]  # cmp slots
    family = choose_family("auto", torch.device("cuda"), torch.float16, SPEC, 6, D)
    whole, parts, expected, got = whole_and_parts(args, docs, [640, 1536, 2304], family, SPEC)
    assert rel(parts, whole) < 5e-3
    for g, e in zip(got, expected):
        assert rel(g, e) < 5e-3


def test_dense_baseline_flex_with_documents_equals_the_boolean_mask_with_gradients():
    """On a GPU the dense model with documents runs FlexAttention's block mask (built once a batch by
    Transformer.documents); output and gradients equal SDPA with the T x T boolean mask."""
    from nsa_titan.models.attention import Documents
    from nsa_titan.models.attention.dense import dense_causal, with_block_masks

    ids = torch.tensor([[0] * 1000 + [1] * 3000 + [2] * 96, [0] * 4096]).cuda()
    plain = Documents.of(ids)
    flex = with_block_masks(plain, [(0, 4096)])
    assert set(flex.block_masks) == {(0, 4096)}
    gen = torch.Generator().manual_seed(0)
    inputs = [torch.randn(2, 4096, h, 64, generator=gen).cuda().bfloat16() for h in (12, 2, 2)]
    results = []
    for docs in (flex, plain):
        leaves = [x.clone().requires_grad_(True) for x in inputs]
        out = dense_causal(*leaves, docs)
        results.append([out, *torch.autograd.grad(out.float().square().sum(), leaves)])
    for a, b in zip(*results):
        assert rel(a, b) < 2e-2


@pytest.mark.parametrize("docs", [False, True], ids=["causal", "documents"])
def test_model_step_makes_no_host_sync(docs):
    """Two M7C layers in bf16 with the family `auto` takes (Triton where installed), forward and
    backward under `torch.cuda.set_sync_debug_mode("error")`: nothing waits for the device. The ids are on
    the device here; the trainer's host ids are measured on the host and copied over before the layers."""
    from test_host_syncs import m7c_step

    family = choose_family("auto", torch.device("cuda"), torch.bfloat16, SPEC, 6, 64)
    step = m7c_step(family, device="cuda", dtype=torch.bfloat16, docs=docs)
    step()  # compiles the Triton kernels
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def test_auto_takes_the_gpu_kernels_that_are_installed():
    family = choose_family("auto", torch.device("cuda"), torch.bfloat16, SPEC, 6, 64)
    flash = "flash" if kernel_choice.flash_attn_func is not None else "torch"
    assert family.name == ("triton" if triton_nsa.triton is not None else flash)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_rank_nccl_fsdp_training(tmp_path):
    proc = torchrun(["-m", "nsa_titan.train", *TINY, "--training.steps", "10", "--job.dump_folder", str(tmp_path)],
                    nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "FSDP mesh {'dp_shard': 2}" in proc.stdout


def test_m7c_blocks_train_in_bf16_with_compile_and_activation_checkpointing(tmp_path):
    """Two M7C blocks at seq 2048 (the shipped config's bf16, compile, AC full) on one GPU."""
    env = {**os.environ, "NGPU": "1"}
    proc = subprocess.run([str(ROOT / "run_train.sh"), "--config", str(ROOT / "train_configs" / "m7c.toml"),
                           "--model.n_layers", "2", "--training.steps", "8", "--training.local_batch_size", "2",
                           "--metrics.log_freq", "4", "--data.path", "data/python_docs", "--data.name=",
                           "--data.tokenizer", "sentencepiece", "--data.tokenizer_path", "data/python_docs/tokenizer.model",
                           "--validation.enable", "false", "--checkpoint.enable", "false", "--job.dump_folder", str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"step +\d+/8 \| loss +([\d.]+)", proc.stdout)]
    assert len(losses) == 3 and losses[-1] < losses[0], losses
    assert "compile inductor" in proc.stdout and "AC on blocks 0-1" in proc.stdout
