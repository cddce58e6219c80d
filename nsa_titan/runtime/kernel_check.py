"""Every kernel checked where it runs, before it trains or decodes: a kernel that is wrong on this machine (a new
GPU, driver or Triton release; a miscompiled build) refuses to start, naming itself, instead of training on wrong
gradients or generating wrong text.

The family check: the family's op on the run's device and compute dtype against the reference family (fp32, the
same device), on a small problem of the model's spec, group size and head dim: at least 3 query tiles of 64,
more sel blocks than n (the top-n chooses), a window shorter than the sequence; packed documents where the run
masks them, the queries in two parts (q0 > 0) where it runs context parallel, the block scores' gradient where it
has one. The output and all 8 gradients, each as a relative error (norm) against `TOLERANCES`.

The decode check: the decoding step's kernel over the prefill of one layer of
the model, against the model's forward over the whole sequence (which every step must equal, as PyTorch's step
does): `DECODE_STEPS` steps of 2 rows at different positions past a prompt (`prompt_length`) whose compressed
blocks fill `DECODE_PARTS` of the Triton step's parts; each step's logits' largest difference relative to the
largest logit.

A pass is kept (`verdicts`) by the machine (device, driver, compiler, library versions) and the problem (the
sources the check runs and its own, the model's settings, the dtype), so that a machine checks once; a failure is
not kept, and is checked again at the next start.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

import torch

from ..config import DTYPES, ConfigError, JobConfig, Model
from ..models.attention import FAMILIES, Documents, Family, NSASpec, choose_family
from ..models.attention.families.choose import AUTO_ORDER
from ..models.attention.families.triton import triton_decode
from ..models.decode import DECODE_KERNELS, Decoder, kernel_problem
from ..models.transformer import Transformer, nsa_spec
from . import verdicts
from .kernel_timing import Speed, fastest, fastest_decode, sequence_inputs

logger = logging.getLogger(__name__)

TOLERANCES = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 4e-2}
"""The relative error (norm) allowed against the fp32 reference by compute dtype: fp32 sums in other orders;
fp16 and bf16 round every product's inputs (10 and 7 bits). Measured far below: 1e-6 in fp32, 2.4e-3 in bf16."""
DECODE_TOLERANCES = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 4e-2}
"""A step's logits' largest difference from the forward's, relative to the largest logit, by the model's dtype."""
INPUTS = ("q", "k_cmp", "v_cmp", "k_sel", "v_sel", "k_win", "v_win", "gates")
TILES, TILE = 3, 64
"""The family check's queries span at least this many query tiles of this many rows."""
DECODE_STEPS, DECODE_PARTS = 256, 3
"""The decode check's steps, past a prompt whose compressed blocks fill this many of the Triton step's parts."""
DECODE_TIES = 0.01
"""The share of the decode check's row-steps that may be off (near-ties of the block scores: `decode_line`)."""
DECODE_VOCAB = 64
Wrap = Callable[[Family], Family]
"""What a family is run through before its check and its use (`fault_injection.kernel_fault`; None: as it is);
its `label` names it in the verdict's key."""
DecoderWrap = Callable[[Decoder], None]
"""What is done to the decoder of the kernel checked (`fault_injection.kernel_fault`), likewise."""


def check_length(spec: NSASpec) -> int:
    """T of the family check: 3 query tiles, n + 2 sel blocks, a window and two blocks; a multiple of l'."""
    need = max(TILES * TILE, (spec.n + 2) * spec.l_sel, spec.w + 2 * spec.l_sel, spec.l + spec.d)
    return -(-need // spec.l_sel) * spec.l_sel


def family_inputs(m: Model, documents: bool, seed: int = 0) -> tuple[list[torch.Tensor], Documents | None]:
    """fp32 inputs of the family check on the CPU (`kernel_timing.sequence_inputs` at `check_length`), and with
    `documents` a few documents a row, of lengths a window and more."""
    spec = nsa_spec(m)
    args, ids = sequence_inputs(m, check_length(spec), 3 if documents else 0, seed)
    return args, Documents.of(ids, spec) if ids is not None else None


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def family_errors(family: Family, m: Model, device: torch.device, dtype: torch.dtype, documents: bool, parts: bool
                  ) -> dict[str, float]:
    """Relative errors of `family` in `dtype` against the reference in fp32 on `device`: the output and the gradient
    of each input (`d` + its name) for one random output gradient; with `parts`, the queries in two parts."""
    spec = nsa_spec(m)
    args, docs = family_inputs(m, documents)
    args = [a.to(dtype).float() for a in args[:7]] + args[7:]  # the same rounded inputs for both
    docs = docs.to(device) if docs is not None else None
    score = {"score_grad": m.sel_score_grad} if m.sel_score_grad else {}
    ref_leaves = [a.to(device).requires_grad_(True) for a in args]
    ref = FAMILIES["reference"]()(*ref_leaves, spec, docs=docs, **score)
    grad_out = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1)).to(device)
    ref_grads = torch.autograd.grad(ref, ref_leaves, grad_out)
    leaves = [a.to(device, dtype if i < 7 else torch.float32).requires_grad_(True) for i, a in enumerate(args)]
    T = args[0].shape[1]
    edges = [0, T // 2 // spec.l_sel * spec.l_sel, T] if parts else [0, T]
    out = torch.cat([family(leaves[0][:, a:b], *leaves[1:7], leaves[7][:, a:b], spec, docs=docs, q0=a, **score)
                     for a, b in zip(edges, edges[1:])], 1)
    grads = torch.autograd.grad(out, leaves, grad_out.to(out.dtype))
    return {"output": _rel(out.detach(), ref.detach()), **{f"d{n}": _rel(g, r) for n, g, r in
                                                              zip(INPUTS, grads, ref_grads)}}


def prompt_length(spec: NSASpec, kernel: str) -> int:
    """The decode check's prompt: for the Triton step, compressed blocks over `DECODE_PARTS` of its parts (its
    last-arriving program combines them); else n + 2 sel blocks and a window."""
    if kernel == "triton":
        return spec.l + DECODE_PARTS * triton_decode.CMP_PART * spec.d
    return (spec.n + 2) * spec.l_sel + spec.w


def check_model(m: Model, kernel: str, device: torch.device, dtype: torch.dtype, family: Family | None = None
                ) -> Transformer:
    """One layer of the model (a small vocabulary) on `device` in `dtype`, long enough for `kernel`'s decode check."""
    cfg = dataclasses.replace(m, n_layers=1, vocab_size=DECODE_VOCAB)
    model = Transformer(cfg, prompt_length(nsa_spec(cfg), kernel) + DECODE_STEPS + 1, family)
    model.init_weights(0)
    return model.to(device, dtype).eval()


def decode_errors(model: Transformer, kernel: str, wrap: DecoderWrap | None = None) -> torch.Tensor:
    """(2, DECODE_STEPS): each row's and step's largest logits difference of `kernel`'s decoding steps from the
    model's forward over the whole sequence (what every step must equal, and PyTorch's step does), relative to the
    forward's largest logit, the caches reused from a request that left NaN in every slot; `wrap` is given the
    kernel's decoder (fault injection)."""
    device = model.rope.device
    prompt = model.max_seq_len - DECODE_STEPS - 1
    gen = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, DECODE_VOCAB, (2, prompt + DECODE_STEPS), generator=gen).to(device)
    ids = torch.zeros_like(tokens)
    ids[1, prompt // 3:] = 1  # the second row's last document starts later: rows at different positions
    with torch.no_grad():
        full = model(tokens, ids)[:, prompt:].float()
    decoder = Decoder(model, kernel, model.max_seq_len)  # the prompt and every step
    if wrap is not None:
        wrap(decoder)
    decoder.prefill(tokens[:, :prompt], ids[:, :prompt])
    for cache in decoder.caches:  # what an earlier request may leave in the buffers the next one reuses
        for buffer in cache.buffers.values():
            buffer.fill_(float("nan"))
    decoder.prefill(tokens[:, :prompt], ids[:, :prompt])
    steps = torch.cat([decoder.step(tokens[:, t:t + 1]) for t in range(prompt, prompt + DECODE_STEPS)], 1).float()
    return (steps - full).abs().amax(dim=2) / full.abs().max().clamp_min(1e-30)


def decode_line(errors: torch.Tensor, kernel: str, device: torch.device, dtype: torch.dtype) -> str | None:
    """The decode check's failure line for `decode_errors`, or None if it passes: no NaN, and at most `DECODE_TIES` of
    the row-steps off by more than the tolerance (two correct kernels that sum in other orders pick other blocks where
    two block scores nearly tie: 1 of 512 row-steps at 5.6e-4 in fp32 at the debug model's sizes, the others below
    1e-6)."""
    tolerance = DECODE_TOLERANCES[dtype]
    off = errors.isnan() | (errors > tolerance)
    if int(off.sum()) <= DECODE_TIES * errors.numel() and not errors.isnan().any():  # a NaN is never a near-tie
        return None
    worst = float(errors.nan_to_num(float("inf")).max())
    step = int(errors.nan_to_num(float("inf")).amax(0).argmax()) + 1
    return (f"the {kernel} decoding step is wrong {_where(device, dtype)}: its logits are off the forward's "
            f"at {int(off.sum())} of {errors.numel()} row-steps, by up to {worst:.3g} (step {step}; relative to the "
            f"largest logit; tolerance {tolerance:g})")


def _where(device: torch.device, dtype: torch.dtype) -> str:
    return f"on {device.type} in {str(dtype).removeprefix('torch.')}"


def _checked(kind: str, name: str, key: dict, mode: str, run: Callable[[], str | None]) -> str | None:
    """The failure line of the check `run` (None: it passed), run or taken from the verdicts (mode `once`)."""
    if mode == "once" and verdicts.get(key) is not None:
        logger.info("kernel check: the %s %s passed its check here before (%s)", name, kind, verdicts.path())
        return None
    start = time.perf_counter()
    line = run()
    seconds = time.perf_counter() - start
    if line is None:
        verdicts.put(key, {"passed": True, "line": None, "seconds": round(seconds, 2)})
    logger.info("kernel check: the %s %s %s in %.1f s (%s)", name, kind, "passed" if line is None else "FAILED",
                seconds, f"kept in {verdicts.path()}" if line is None else "not kept: checked again at the next start")
    return line


def family_line(found: dict[str, float], name: str, device: torch.device, dtype: torch.dtype) -> str | None:
    """The family check's failure line for `family_errors` (the worst tensor, its error and tolerance), or None if it
    passes."""
    tensor, error = max(found.items(), key=lambda kv: kv[1] if kv[1] == kv[1] else float("inf"))  # NaN: worst
    tolerance = TOLERANCES[dtype]
    if error <= tolerance:
        return None
    what = "its output" if tensor == "output" else f"its gradient {tensor}"
    return (f"the {name} family is wrong {_where(device, dtype)}: {what} is off the reference by {error:.3g} "
            f"(relative; tolerance {tolerance:g})")


def verified_family(cfg: JobConfig, device: torch.device, wrap: Wrap | None = None, trained: str | None = None
                    ) -> tuple[Family, Speed | None]:
    """The NSA kernel family of the run (`[model] kernels`), checked on `device` in the compute dtype before use
    (`[model] verify_kernels`), and with `auto` what its measurement found (`kernel_timing`; None for a family named or
    taken unchecked): one named that fails is a ConfigError naming the tensor and the fix; `auto` checks every family
    that runs here and takes the fastest that passed (`verify_kernels = off`: the first that runs, untimed), or
    `trained`, the family the checkpoint the run resumes trained with, where it passed: another family's numbers
    differ from an uninterrupted run's by rounding (said in a warning where the run cannot keep it)."""
    m, dtype = cfg.model, DTYPES[cfg.training.mixed_precision_param]
    spec, r = nsa_spec(m), m.n_heads // m.n_kv_groups
    if m.attn_impl == "reference":
        return FAMILIES["reference"](), None
    names = [m.kernels] if m.kernels != "auto" else \
        [n for n in AUTO_ORDER if FAMILIES[n].problem(device, dtype, spec, r, m.head_dim) is None]
    if trained is not None and m.kernels != "auto" and trained != m.kernels:
        _not_kept(trained, f"[model] kernels = '{m.kernels}' names another")
    if m.verify_kernels == "off" and m.kernels == "auto" and trained is not None:  # untimed: the checkpoint's
        if trained in names:
            names.insert(0, names.pop(names.index(trained)))
        else:
            _not_kept(trained, _unrunnable(trained, device, dtype, m))
    documents, parts = cfg.training.document_masking, cfg.parallelism.context_parallel_degree > 1
    passed, keys, failed = {}, {}, []
    for name in names:
        family = choose_family(name, device, dtype, spec, r, m.head_dim)
        family = wrap(family) if wrap is not None else family
        if m.verify_kernels == "off":
            return family, None
        keys[name] = verdicts.family_key(name, device, dtype, m, documents, parts, getattr(wrap, "label", ""))
        line = _checked("family", name, keys[name], m.verify_kernels, lambda: family_line(
            family_errors(family, m, device, dtype, documents, parts), name, device, dtype))
        if line is None:
            if m.kernels != "auto":
                return family, None
            passed[name] = family
            continue
        if m.kernels != "auto":
            raise ConfigError(f"[model] kernels = '{name}' failed its check: {line}. Train with --model.kernels "
                              "torch (or 'auto': the fastest family that passes)")
        logger.warning("kernel check: %s; kernels = 'auto' leaves it out", line)
        failed.append(line)
    speed = fastest(passed, list(AUTO_ORDER), m, cfg.training.seq_len, device, dtype, documents, keys)
    if speed is None:
        raise ConfigError("[model] kernels = 'auto': no family that runs here passed its check on every rank ("
                          f"{'; '.join(failed) or 'each failed on another rank'}); report it with the startup log")
    if trained in speed.families:
        speed = dataclasses.replace(speed, taken=trained)
    elif trained is not None:
        _not_kept(trained, _unrunnable(trained, device, dtype, m) or "it did not pass its check on every rank")
    logger.info("%s", speed.line())
    return passed[speed.taken], speed


def _unrunnable(trained: str, device: torch.device, dtype: torch.dtype, m: Model) -> str | None:
    """Why `auto` cannot take the family `trained` on `device` in `dtype` for the model `m` (None: it can run)."""
    if trained not in AUTO_ORDER:
        return "kernels = 'auto' does not choose it"
    problem = FAMILIES[trained].problem(device, dtype, nsa_spec(m), m.n_heads // m.n_kv_groups, m.head_dim)
    return f"it cannot run here ({problem})" if problem else None


def _not_kept(trained: str, why: str) -> None:
    """The warning of a resume that does not keep the family its checkpoint trained with (`trained`), and `why`."""
    logger.warning("the checkpoint this run resumes trained with the %s kernel family and this run takes another: %s. "
                   "It goes on, but its numbers differ from an uninterrupted run's by rounding (an exact resume needs "
                   "the same family: [model] kernels = '%s' or 'auto', where it runs and passes its check)", trained,
                   why, trained)


def verified_decode(m: Model, device: torch.device, dtype: torch.dtype, family: Family | None = None,
                    wrap: DecoderWrap | None = None, context: int = 0) -> str:
    """The decoding step's kernel for the model `m` on `device` in `dtype` (`[model] decode_kernels`), checked against
    the model's forward before use (`[model] verify_kernels`): a named one that fails is a ConfigError naming it and
    the fix. `auto` with a request's `context` (its prompt and new tokens) times every step that passes there and
    takes the fastest (`kernel_timing.fastest_decode`, said in the log); without one, or with `verify_kernels = off`,
    it takes the first that passes (PyTorch's step, the last, is not checked: it is the reference's own ops, tested
    against the forward in the test suite)."""
    if m.attention != "nsa" or m.attn_impl == "reference":
        return "torch"
    with torch.device("meta"):
        attn = Transformer(dataclasses.replace(m, n_layers=1, vocab_size=DECODE_VOCAB), 1, family).layers["0"].attention
    names = [m.decode_kernels] if m.decode_kernels != "auto" else \
        [k for k in DECODE_KERNELS if kernel_problem(k, attn, device, dtype) is None]
    timing = m.decode_kernels == "auto" and context > 0 and m.verify_kernels != "off"
    passed, keys = [], {}
    for name in names:
        why = kernel_problem(name, attn, device, dtype)
        if why:
            raise ConfigError(f"[model] decode_kernels = '{name}' cannot run: {why}; use decode_kernels = 'auto' "
                              "(the fastest that runs) or 'torch'")
        keys[name] = verdicts.decode_key(name, device, dtype, m, getattr(wrap, "label", ""))
        if name != "torch" and m.verify_kernels != "off":
            def run(name: str = name) -> str | None:  # (a step made slow is right: checked as it is)
                faulty = None if getattr(wrap, "slow", False) else wrap
                return decode_line(decode_errors(check_model(m, name, device, dtype, family), name, faulty), name,
                                   device, dtype)

            line = _checked("decoding step", name, keys[name], m.verify_kernels, run)
            if line is not None:
                if m.decode_kernels != "auto":
                    raise ConfigError(f"[model] decode_kernels = '{name}' failed its check: {line}. Decode with "
                                      "--model.decode_kernels torch (or 'auto': the fastest step that passes)")
                logger.warning("kernel check: %s; decode_kernels = 'auto' moves on", line)
                continue
        if not timing:
            return name
        passed.append(name)
    if len(passed) < 2:
        return passed[0] if passed else "torch"
    speed = fastest_decode(passed, keys, m, device, dtype, context, family, wrap)
    logger.info("%s", speed.line())
    return speed.taken


def checked_kernels(cfg: JobConfig, device: torch.device, wrap: Wrap | None = None,
                    decoder_wrap: DecoderWrap | None = None, trained: str | None = None) -> tuple[Family, Speed | None]:
    """A run's NSA family, and the decoding step its model will take, each checked here before step 1
    (`verified_family`, `verified_decode`; `trained`: the family of the checkpoint it resumes): the family and `auto`'s
    measurement. The process's generators are left as they were: a run that checks draws the numbers of one that reads
    the verdicts (its saved RNG state too)."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        family, speed = verified_family(cfg, device, wrap, trained)
        verified_decode(cfg.model, device, DTYPES[cfg.training.mixed_precision_param], family, decoder_wrap)
    return family, speed
