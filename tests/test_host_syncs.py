"""No host syncs in NSA's step: on a GPU, a device-to-host read (`.item()`, `.tolist()`, `bool(t)`,
`nonzero`, a boolean index) stalls the host until the device has finished all queued work, and so does
a copy of host data in (`torch.tensor([...])`: a pageable copy that waits for the stream). The GPU
families (Triton, PyTorch) are checked here without a GPU: every op and tensor method the forward and
backward call is watched for one that would read the device or copy host data in, the Triton kernels
recorded and not run (`benchmarks/gpu/triton_work.py`, which also counts the Triton family's launches). `tests/test_gpu.py` checks the same on CUDA with
`torch.cuda.set_sync_debug_mode("error")`."""

from __future__ import annotations

import collections
import sys
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import nsa_titan
from nsa_titan.config import load_config
from nsa_titan.models.loss import cross_entropy_loss
from nsa_titan.models.attention import FAMILIES, Family
from nsa_titan.models.attention.families.pytorch import fast_shared
from nsa_titan.models.attention.families.triton import triton_nsa
from nsa_titan.models.transformer import Transformer

from conftest import ROOT

sys.path.insert(0, str(ROOT))
from benchmarks.gpu import triton_work  # noqa: E402  (records the Triton launches)

needs_triton = pytest.mark.skipif(triton_nsa.triton is None, reason="triton is not installed")

READS = {"tolist", "item", "__bool__", "__int__", "__float__", "__index__", "numpy", "cpu"}
"""Tensor methods that bring a value to the host."""
COPIES = {"tensor", "new_tensor", "as_tensor"}
"""Functions that copy host data (not a tensor) into a tensor: to a GPU, a copy that waits for the stream."""
SYNC_OPS = {"_local_scalar_dense", "nonzero", "masked_select", "_unique2", "unique_dim", "unique_consecutive",
            "repeat_interleave", "bincount", "equal", "is_nonzero"}
"""ATen ops whose result (or its size) a CUDA kernel must hand back to the host before they return."""


PACKAGE = str(Path(nsa_titan.__file__).parent)


def _caller() -> str:
    """The package's innermost line on the stack (file:line: code)."""
    ours = [f for f in traceback.extract_stack() if f.filename.startswith(PACKAGE)] or traceback.extract_stack()[-3:-2]
    return f"{ours[-1].filename}:{ours[-1].lineno}: {ours[-1].line}"


class _Methods(TorchFunctionMode):
    def __init__(self, seen: dict[str, str]):
        super().__init__()
        self.seen = seen

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        data = args[1] if name == "new_tensor" else args[0] if args else None
        if name in READS or (name in COPIES and not isinstance(data, torch.Tensor)):
            self.seen.setdefault(f"Tensor.{name}" if name in READS else f"{name} of host data", _caller())
        return func(*args, **(kwargs or {}))


class _Ops(TorchDispatchMode):
    def __init__(self, seen: dict[str, str]):
        super().__init__()
        self.seen = seen

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        index = args[1] if name in ("index", "index_put", "index_put_") and len(args) > 1 else ()
        if name in SYNC_OPS or any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in index):
            self.seen.setdefault(func.__name__, _caller())
        return func(*args, **(kwargs or {}))


@contextmanager
def host_syncs() -> Iterator[dict[str, str]]:
    """{what: where it was first called} for each host sync inside."""
    seen: dict[str, str] = collections.OrderedDict()
    with _Methods(seen), _Ops(seen):
        yield seen


def report(seen: dict[str, str]) -> str:
    return "host syncs: " + "; ".join(f"{what} at {where}" for what, where in seen.items())


def m7c_step(family: Family, routing: Sequence[str] = (), device: str = "cpu", dtype: torch.dtype = torch.float32,
             docs: bool = True) -> Callable[[], None]:
    """One forward and backward of two M7C layers (`m7c.toml`'s model, `routing` overrides, vocabulary 256)
    by `family` over a row of 2,048 tokens in ~4 documents (`docs`; ids on `device`); also `tests/test_gpu.py`'s."""
    cfg, _ = load_config(["--config", str(ROOT / "train_configs" / "m7c.toml"), "--model.n_layers", "2",
                          "--model.vocab_size", "256", *routing])
    model = Transformer(cfg.model, 2048, family).to(device)
    model.init_weights(0)
    model.to(dtype)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (1, 2049), generator=gen).to(device)
    ids = torch.cumsum(torch.rand(1, 2048, generator=gen) < 4 / 2048, 1).to(device) if docs else None
    return lambda: cross_entropy_loss(model(tokens[:, :-1], ids), tokens[:, 1:]).backward()


def test_each_kind_of_host_sync_is_seen():
    """The watch itself: every kind it looks for is caught (so a clean run below means something)."""
    x = torch.arange(6.0)
    checks = {"Tensor.tolist": lambda: x.tolist(), "Tensor.item": lambda: x[0].item(),
              "Tensor.__bool__": lambda: bool(x[1] > 0), "Tensor.__int__": lambda: int(x[2]),
              "tensor of host data": lambda: torch.tensor([1.0]),
              "new_tensor of host data": lambda: x.new_tensor([0.5, 1]),
              "nonzero.default": lambda: torch.nonzero(x), "index.Tensor": lambda: x[x > 2],
              "masked_select.default": lambda: x.masked_select(x > 2),
              "repeat_interleave.Tensor": lambda: torch.repeat_interleave(torch.tensor([1, 2]))}
    for what, call in checks.items():
        with host_syncs() as seen:
            call()
        assert what in seen, (what, list(seen))
    with host_syncs() as seen:
        torch.topk(x, 2), x.cumsum(0), x[torch.arange(2)], torch.where(x > 2, x, 0), torch.as_tensor(x), x * 0.5
    assert not seen, report(seen)


@contextmanager
def gpu_chunks() -> Iterator[None]:
    """The PyTorch family's chunk sizes on a GPU, inside."""
    sizes = fast_shared.CHUNK_CMP, fast_shared.CHUNK_WIN
    try:
        fast_shared.CHUNK_CMP, fast_shared.CHUNK_WIN = fast_shared.GPU_CHUNK_CMP, fast_shared.GPU_CHUNK_WIN
        yield
    finally:
        fast_shared.CHUNK_CMP, fast_shared.CHUNK_WIN = sizes


@needs_triton
@pytest.mark.parametrize("docs", [False, True], ids=["causal", "documents"])
def test_triton_family_forward_and_backward_have_no_host_sync(docs):
    """The Triton family (recorded), M7C shape at T = 2,048, bf16."""
    step = triton_work.attention_step(2048, docs)
    with host_syncs() as seen:
        triton_work.recorded(step)
    assert not seen, report(seen)


LAUNCHES = 12
"""The most kernels one NSA attention forward + backward may launch on the Triton family (paper settings)."""


@needs_triton
@pytest.mark.parametrize("docs", [False, True], ids=["causal", "documents"])
def test_triton_family_launches_a_handful_of_kernels_at_any_t(docs):
    """Triton kernels and the ATen ops that would launch a GPU kernel, counted as `benchmarks/gpu/triton_work.py`
    counts them: the same few at T = 512 and at 65,536 (no chunk loop), at most 12."""
    counts = {T: triton_work.launches(T, docs) for T in (512, 65536)}
    (small, small_ops), (large, large_ops) = counts[512], counts[65536]
    assert small == large and small_ops == large_ops
    assert sum(small.values()) + len(small_ops) <= LAUNCHES, (small, small_ops)
    assert dict(small) == {"_fwd_cmp": 1, "_fwd_win": 1, "_fwd_sel": 1, "_fwd_mix": 1, "_bwd_q": 1, "_bwd_sel_kv": 1,
                           "_bwd_kv": 2}
    # the inverse index's counts (a fill, their cumulative sum), the key gradients' buffer (a fill, a cast to bf16)
    assert sorted(small_ops) == ["_to_copy", "cumsum", "zeros", "zeros"]


@needs_triton
@pytest.mark.parametrize("docs", [False, True], ids=["causal", "documents"])
def test_the_flex_familys_sel_launches_a_handful_of_kernels_at_any_t_without_a_host_sync(docs):
    """The flex family's sel by the Triton kernels (given Flex's cmp log-sum-exp; recorded), counted as the Triton
    family's: the same at T = 512 and at 65,536, at most 12 launches, no host sync."""
    with host_syncs() as seen:
        counts = {T: triton_work.launches(T, docs, sel_only=True) for T in (512, 65536)}
    assert not seen, report(seen)
    (small, small_ops), (large, large_ops) = counts[512], counts[65536]
    assert small == large and small_ops == large_ops
    assert sum(small.values()) + len(small_ops) <= LAUNCHES, (small, small_ops)
    assert dict(small) == {"_fwd_cmp": 1, "_fwd_win": 1, "_fwd_sel": 1, "_fwd_mix": 1, "_bwd_q": 1, "_bwd_sel_kv": 1}
    # the inverse index's fill and cumulative sum, the branch outputs' and logsumexps' fills (cmp's and win's
    # parts unwritten), the key gradients' buffer (a fill, a cast to bf16)
    assert sorted(small_ops) == ["_to_copy", "cumsum", "zeros", "zeros", "zeros", "zeros"]


@needs_triton
@pytest.mark.slow
def test_decoding_by_the_triton_kernel_never_syncs_and_launches_at_most_3_kernels_a_layer_and_step():
    """16 decoding steps of two M7C layers (bf16) through the Triton decode step (recorded), from 8,192 and from
    65,536 cached positions: no host sync, and per layer and step at most 3 launches on average (the step's two,
    the first of which appends the new keys, and on the one step a block completes the compression's two), no ATen
    op besides: 2.125."""
    for context in (8192, 65536):
        decoder, token = triton_work.decode_state(context)
        with host_syncs() as seen:
            counts, ops = triton_work.decode_launches(decoder, token, 16)
        assert not seen, report(seen)
        assert dict(counts) == {"_decode": 2 * 16, "_decode_sel_win": 2 * 16, "_cmp_hidden": 2, "_cmp_out": 2}, counts
        assert ops == [] and sum(counts.values()) / (2 * 16) == 2.125 <= 3, ops


@pytest.mark.parametrize("docs", [False, True], ids=["causal", "documents"])
def test_pytorch_family_forward_and_backward_have_no_host_sync(docs):
    """The PyTorch family (what a GPU without Triton runs), run for real at T = 1,024, the GPU's chunk sizes."""
    step = triton_work.attention_step(1024, docs, family="torch", dtype=torch.float32)
    with gpu_chunks(), host_syncs() as seen:
        step()
    assert not seen, report(seen)


@needs_triton
@pytest.mark.parametrize("routing", [[], ["--model.sel_score_grad", "1", "--model.sel_score_explore", "8"],
                                     ["--model.nsa_branch", "sel"]], ids=["m7c", "score-gradient", "one-branch"])
@pytest.mark.slow
def test_model_step_has_no_host_sync(routing):
    """Two M7C layers (`m7c.toml`'s model), forward and backward with document masking (the documents'
    geometry included), by the Triton family (recorded); also with the block scores' gradient, and with
    one branch alone (the others' gates times 0)."""
    step = m7c_step(FAMILIES["triton"](), routing)
    with host_syncs() as seen:
        triton_work.recorded(step)
    assert not seen, report(seen)

