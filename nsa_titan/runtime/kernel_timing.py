"""`[model] kernels = auto` by measurement: every family that passed its check (`kernel_check`) is timed, forward
and backward, on the run's shapes (one sequence of the run's length, the model's heads, group and head dim, the
compute dtype, documents where the run masks them), beside the dense attention a dense model would run on the same
shapes (`dense.dense_causal`: SDPA, FlexAttention with documents on a GPU); the fastest family is taken, and the
startup log says how fast NSA attention is against dense here.

A timing is kept beside the verdicts (`verdicts`: the family's key and the length timed), so a machine times each
shape once, and again when a family's source changes. Every rank of a job times (or reads) and the slowest rank's
time of each family decides, so that all ranks take the same family; one that failed its check on any rank is out.

`[model] decode_kernels = auto` the same way, where a request says how far it will decode (`generate`, the HF
model's `generate`): every step kernel that passed its check is timed on one layer's caches of one row filled to the
request's context (rounded up to a power of two: requests of like lengths share a timing).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from ..config import Model
from ..models.attention import Documents, Family, dense_causal
from ..models.attention.dense import with_block_masks
from ..models.decode import Decoder
from ..models.transformer import Transformer, nsa_spec
from . import verdicts

logger = logging.getLogger(__name__)

DENSE = "dense"

ROUNDS, MIN_S, LONG_S = 5, 0.05, 1.0
"""Timings: a warm-up call of each, then up to ROUNDS rounds of one call of each in turn (the machine's load shared
alike), stopping once every one has had MIN_S; each the fastest of its calls. On a CPU, a warm-up that took LONG_S or
more is that one's timing (nothing is compiled there; its one-off costs are small against it)."""


@dataclasses.dataclass(frozen=True)
class Speed:
    """What `auto`'s measurement found: each timed family's and dense attention's milliseconds (forward and backward
    of one layer over one sequence of `seq_len`), whether they were measured now or kept, and the family taken: the
    fastest, or the one the checkpoint a run resumes trained with (`kernel_check.verified_family`)."""

    seq_len: int
    families: dict[str, float]
    dense: float
    taken: str
    kept: bool

    @property
    def ratio(self) -> float:
        """Dense attention's time over the taken family's: above 1, NSA is faster."""
        return self.dense / self.families[self.taken]

    @property
    def fastest(self) -> str:
        """The fastest family timed."""
        return min(self.families, key=self.families.__getitem__)

    def line(self) -> str:
        """The startup log's line."""
        times = _fastest_first(self.families)
        kept = ", kept from an earlier run" if self.kept else ""
        taken = f"takes the {self.taken} family" if self.taken == self.fastest else (
            f"keeps the {self.taken} family, the resumed checkpoint's, for an exact resume (a fresh run takes the "
            f"fastest: {self.fastest})")
        return (f"NSA attention here: {self.ratio:.3g}x dense at seq {self.seq_len} ({times}; dense {_ms(self.dense)}; "
                f"forward and backward of one layer over one sequence{kept}): kernels = 'auto' {taken}")


def _ms(ms: float) -> str:
    return f"{ms:.3g} ms" if ms < 1000 else f"{ms / 1000:.3g} s"


def _fastest_first(times: dict[str, float]) -> str:
    """`name time, ...`, the fastest first."""
    return ", ".join(f"{name} {_ms(ms)}" for name, ms in sorted(times.items(), key=lambda kv: kv[1]))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_ms(runs: dict[str, Callable[[], None]], device: torch.device) -> dict[str, float]:
    """Milliseconds of each of `runs`, timed in turn (`ROUNDS`), the device synchronised after each call."""
    def once(run: Callable[[], None]) -> float:
        start = time.perf_counter()
        run()
        _sync(device)
        return time.perf_counter() - start

    best = {name: once(run) for name, run in runs.items()}  # the warm-ups
    going = {name: run for name, run in runs.items() if device.type != "cpu" or best[name] < LONG_S}
    spent = {name: 0.0 for name in going}
    best.update({name: math.inf for name in going})
    for _ in range(ROUNDS):
        for name, run in going.items():
            took = once(run)
            best[name], spent[name] = min(best[name], took), spent[name] + took
        if all(t >= MIN_S for t in spent.values()):
            break
    return {name: t * 1e3 for name, t in best.items()}


def sequence_inputs(m: Model, seq_len: int, documents: int, seed: int = 0
                    ) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """One random sequence of the model's shapes in fp32 on the CPU, as the attention op gets it: q (1, T, H, D), the
    compressed keys and values (a slot per stride with documents), sel and win keys and values (1, T, G, D), gates
    (1, T, H, 3); and document ids, `documents` of them on average (0: none, and None)."""
    spec, gen = nsa_spec(m), torch.Generator().manual_seed(seed)
    T, H, G, D = seq_len, m.n_heads, m.n_kv_groups, m.head_dim
    slots = T // spec.d if documents else spec.num_cmp_blocks(T)
    shapes = [(1, T, H, D), (1, slots, G, D), (1, slots, G, D), *[(1, T, G, D)] * 4]
    tensors = [torch.randn(s, generator=gen) for s in shapes]
    gates = torch.rand(1, T, H, 3, generator=gen)
    ids = torch.cumsum(torch.rand(1, T, generator=gen) < documents / T, 1) if documents else None
    return [*tensors, gates], ids


def run_inputs(m: Model, seq_len: int, device: torch.device, dtype: torch.dtype, documents: bool
               ) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """`sequence_inputs` of the run's shapes on `device`, all but the gates in `dtype`; with `documents`, documents
    of a quarter of the sequence on average."""
    args, ids = sequence_inputs(m, seq_len, 4 if documents else 0)
    return [*(a.to(device, dtype) for a in args[:7]), args[7].to(device)], ids


def _backward(out: torch.Tensor, leaves: list[torch.Tensor]) -> None:
    torch.autograd.grad(out, leaves, torch.ones_like(out))


def family_run(family: Family, m: Model, seq_len: int, device: torch.device, dtype: torch.dtype,
               documents: bool) -> Callable[[], None]:
    """`family`'s forward and backward over one sequence of the run's shapes."""
    spec = nsa_spec(m)
    args, ids = run_inputs(m, seq_len, device, dtype, documents)
    leaves = [a.requires_grad_(True) for a in args]
    varlen = [(0, 0, seq_len)] if family.win_flash else []
    docs = Documents.of(ids, spec, varlen).to(device) if ids is not None else None
    score = {"score_grad": m.sel_score_grad} if m.sel_score_grad else {}
    return lambda: _backward(family(*leaves, spec, docs=docs, **score), leaves)


def dense_run(m: Model, seq_len: int, device: torch.device, dtype: torch.dtype, documents: bool
              ) -> Callable[[], None]:
    """Dense causal attention's forward and backward over the same sequence (a dense model's path on this device,
    its document masks built before, as a run builds them once a batch)."""
    args, ids = run_inputs(m, seq_len, device, dtype, documents)
    q, k, v = (args[i].requires_grad_(True) for i in (0, 5, 6))
    docs = with_block_masks(Documents.of(ids).to(device), [(0, seq_len)]) if ids is not None else None
    return lambda: _backward(dense_causal(q, k, v, docs), [q, k, v])


def kept_or_timed(timing_keys: dict[str, dict], runs_of: Callable[[list[str]], dict[str, Callable[[], None]]],
                  device: torch.device) -> tuple[dict[str, float], bool]:
    """Each name's milliseconds, kept beside the verdicts under its key or, for those not kept, timed now (`timed_ms`
    over `runs_of(missing)`) and kept (a later start reads the same numbers); and whether all were kept."""
    kept = {name: verdicts.get(key) for name, key in timing_keys.items()}
    found = {name: float(entry["ms"]) for name, entry in kept.items() if entry is not None and "ms" in entry}
    missing = [name for name in timing_keys if name not in found]
    if missing:
        measured = {name: round(ms, 4) for name, ms in timed_ms(runs_of(missing), device).items()}
        for name, ms in measured.items():
            verdicts.put(timing_keys[name], {"passed": True, "ms": ms})
        found.update(measured)
    return found, not missing


def fastest(passed: dict[str, Family], everyone: list[str], m: Model, seq_len: int, device: torch.device,
            dtype: torch.dtype, documents: bool, keys: dict[str, dict]) -> Speed | None:
    """Time each family of `passed` (its verdict's key in `keys`) and dense attention, or read their kept timings;
    across the ranks of a job, each family's slowest time (`everyone`: the families any rank may have passed, in
    one order; one not passed here counts as infinitely slow), and the fastest taken (None: none passed on every
    rank). Every rank calls it: its timings meet in one collective."""
    timing_keys = {name: {**keys[name], "timed_seq_len": seq_len} for name in passed}
    timing_keys[DENSE] = {**verdicts.dense_key(device, dtype, m, documents), "timed_seq_len": seq_len}
    found, kept = kept_or_timed(timing_keys, lambda missing: {
        name: dense_run(m, seq_len, device, dtype, documents) if name == DENSE else
        family_run(passed[name], m, seq_len, device, dtype, documents) for name in missing}, device)
    times = torch.tensor([found.get(name, math.inf) for name in [*everyone, DENSE]], dtype=torch.float64)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        on = times.to(device) if dist.get_backend() == "nccl" else times
        dist.all_reduce(on, op=dist.ReduceOp.MAX)
        times = on.cpu()
    families = {name: float(t) for name, t in zip(everyone, times[:-1].tolist()) if math.isfinite(t)}
    if not families:
        return None
    taken = min(families, key=families.__getitem__)
    return Speed(seq_len, families, float(times[-1]), taken, kept)


@dataclasses.dataclass(frozen=True)
class DecodeSpeed:
    """What `decode_kernels = auto`'s measurement found: each step kernel's milliseconds for one decoding step of one
    layer and one row at position `context`, whether measured now or kept, and the kernel taken."""

    context: int
    kernels: dict[str, float]
    taken: str
    kept: bool

    def line(self) -> str:
        """The log's line."""
        times = _fastest_first(self.kernels)
        kept = ", kept from an earlier run" if self.kept else ""
        return (f"NSA decoding here: {times} a step (one layer and row at position {self.context}{kept}): "
                f"decode_kernels = 'auto' takes the {self.taken} step")


def timed_context(context: int) -> int:
    """The position a request's decoding steps are timed at: its context rounded up to a power of two, at least
    1,024."""
    return max(1024, 1 << (context - 1).bit_length())


def decode_runs(model: Transformer, names: list[str], wrap: Callable[[Decoder], None] | None = None
                ) -> dict[str, Callable[[], None]]:
    """A decoding step of each kernel of `names` over one decoder's caches, filled by a prompt of random tokens of
    all but the steps' room of the model's length (every kernel reads the caches as they lie, each step one
    position on); `wrap` is given the decoder as each kernel's (fault injection)."""
    room = (1 + ROUNDS) * len(names)
    device = model.rope.device
    decoder = Decoder(model, names[0], model.max_seq_len)
    gen = torch.Generator().manual_seed(0)
    decoder.prefill(torch.randint(0, model.cfg.vocab_size, (1, model.max_seq_len - room), generator=gen).to(device))
    token = torch.zeros(1, 1, dtype=torch.long, device=device)
    for name in names:  # a wrap changes its kernel's step alone
        decoder.kernel = name
        if wrap is not None:
            wrap(decoder)

    def step(name: str) -> Callable[[], None]:
        def run() -> None:
            decoder.kernel = name
            decoder.step(token)
        return run

    return {name: step(name) for name in names}


def fastest_decode(names: list[str], keys: dict[str, dict], m: Model, device: torch.device, dtype: torch.dtype,
                   context: int, family: Family | None = None, wrap: Callable[[Decoder], None] | None = None
                   ) -> DecodeSpeed:
    """Time the step kernels `names` (each passed its check; its verdict's key in `keys`) on one layer of the model
    in `dtype`, one row at the request's `context` (`timed_context`), or read their kept timings; the fastest (ties:
    the first of `names`)."""
    at = timed_context(context)

    def runs_of(missing: list[str]) -> dict[str, Callable[[], None]]:  # one layer (the vocabulary: any)
        model = Transformer(dataclasses.replace(m, n_layers=1, vocab_size=64), at + (1 + ROUNDS) * len(missing),
                            family)
        model.init_weights(0)
        return decode_runs(model.to(device, dtype).eval(), missing, wrap)

    found, kept = kept_or_timed({name: {**keys[name], "timed_context": at} for name in names}, runs_of, device)
    return DecodeSpeed(at, found, min(names, key=found.__getitem__), kept)
