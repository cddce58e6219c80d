"""Incremental decoding with per-branch KV caches: what each new token reads follows NSA's count.

Per layer the cache holds sel's keys and values for every position (any later token may choose any
block), the compressed blocks, and rings of what only the end is read of: the window's last w keys
and the cmp branch's last l raw keys; a new compressed block is formed every d tokens, once its l keys
exist. The buffers are sized to the request (`request_context`: its longest prompt and new tokens, rounded up to
what the kernels read), allocated once a request, and handed to the next request of the same sizes, cleared (a
NaN an earlier request left would otherwise reach every output: `LayerCache.allocate`); stepping past them grows them (copies, as a dynamic cache).
A decoding step for the token at position t reads:
  cmp: the Nc(t) compressed keys; sel: the n chosen blocks of l' keys; win: the last w keys;
  dense: all t + 1 keys.
`prefill` runs the training forward over the prompt (its logits), which hands the caches its
projections; `step` then extends one token at a time through the same layer pieces (projections,
compression, gates, the branch mix, the block's residuals). Both equal a full forward pass. A step's three
branches and their mix run by one of three kernels, chosen once (`decode_kernel`; `[model] decode_kernels`): on
CUDA two launches of the Triton decode step (`_attend_last_triton`), on CPUs (float32 or bfloat16) one call of
NSA's C++ kernels over the caches as they lie (`_attend_last_cpp`), else PyTorch's ops; all give the same logits.

With documents (a prompt packed from several, `document_ids`), the caches hold each row's last
document only, at positions from its start, so that new tokens continue it; `reset` starts a new
document (position 0, the buffers reused). Rows decode at positions of their own: prompts of different
lengths (left padding is a document of its own) and last documents starting anywhere. All equal the
packed forward pass, and each row decoded alone.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from ..config import ConfigError
from .attention import masked_attention, mix_branches, select_blocks
from .attention.families.cpp import cpu_attention
from .attention.families.reference import Reference
from .attention.families.triton import triton_decode
from .decode_cache import LayerCache, layer_sizes, request_context, take_rows
from .transformer import DenseAttention, NSAAttention, Transformer, previous_tokens


Step = Callable[..., torch.Tensor]
"""A kernel's decoding step (`_attend_last_cpp`, `_attend_last_triton`)."""
DECODE_KERNELS = ("triton", "cpp", "torch")
"""A decoding step's kernels, in the order `auto` tries them: the first that can run here takes every step."""


def kernel_problem(kernel: str, attn: NSAAttention, device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the step kernel `kernel` cannot decode the NSA layer `attn` on `device` in `dtype`, or None."""
    if kernel == "torch":
        return None
    if isinstance(attn.family, Reference):
        return "the model runs the reference family, whose steps are PyTorch's"
    r = attn.n_heads // attn.n_groups
    if kernel == "triton":
        return triton_decode.problem(device, dtype, attn.spec, r, attn.head_dim)
    if not attn.spec.strided_members():
        return "NSA's C++ decode step needs l and l' multiples of d"
    dtype = torch.float32 if dtype == torch.bfloat16 else dtype  # the C++ step reads bf16 caches as float
    return cpu_attention.problem(device, dtype, attn.spec, r, attn.head_dim)


def decode_kernel(model: Transformer, choice: str = "auto") -> str:
    """The step kernel that decodes `model` where its weights are (`[model] decode_kernels`): `auto`, the first of
    `DECODE_KERNELS` that can run; a named one that cannot is a ConfigError saying why."""
    attn = next(iter(model.layers.values())).attention
    if not isinstance(attn, NSAAttention):
        return "torch"  # dense: SDPA over the cache
    weight = attn.wq.weight
    if choice != "auto":
        why = kernel_problem(choice, attn, weight.device, weight.dtype)
        if why:
            raise ConfigError(f"[model] decode_kernels = '{choice}' cannot run: {why}; use decode_kernels = 'auto' "
                              "(the fastest that runs) or 'torch'")
        return choice
    return next(k for k in DECODE_KERNELS if kernel_problem(k, attn, weight.device, weight.dtype) is None)


def _attend_last_cpp(attn: NSAAttention, q: torch.Tensor, gates: torch.Tensor, cache: LayerCache, t: torch.Tensor,
                     width: int, t_max: int) -> torch.Tensor:
    """`_attention`'s three branches and their mix in one C++ call over the caches as they lie, a (batch x group)
    row per task: cmp over the row's compressed blocks (with the group-summed probabilities), the top-n, sel over
    the chosen blocks, win over the ring, the gated sum; in float32, of float32 or bfloat16 caches.
    q (B, 1, H, D), gates (B, 1, H, 3) -> (B, 1, H, D) in q's dtype."""
    spec, b, Ns = attn.spec, cache.buffers, attn.spec.num_sel_blocks(t_max + 1)
    caches = [b[name] for name in ("kc", "vc", "k_sel", "v_sel", "k_win", "v_win")]
    return cpu_attention.kernels().decode_step(q.float().contiguous(), gates.float().contiguous(), *caches, cache.n_cmp, t,
                               attn.n_groups, width, cache.sizes["k_win"], spec.l, spec.d, spec.l_sel, Ns,
                               min(spec.n, Ns), attn.head_dim ** -0.5).to(q.dtype)


def _attend_last_triton(attn: NSAAttention, q: torch.Tensor, gates: torch.Tensor, cache: LayerCache,
                        new: dict[str, torch.Tensor], t: torch.Tensor, width: int, t_max: int) -> torch.Tensor:
    """`_attend_last_cpp` as two launches of the Triton decode step (`triton_decode`), the first of which appends the
    new token's keys and values (`new`, by name) to the caches."""
    spec, b, Ns = attn.spec, cache.buffers, attn.spec.num_sel_blocks(t_max + 1)
    names = ("kc", "vc", "k_sel", "v_sel", "k_win", "v_win", "k_cmp", "v_cmp")
    return triton_decode.decode_step(q, gates, [b[name] for name in names], [new[name] for name in names[2:]], t,
                                     cache.arrivals, attn.n_groups, width, cache.sizes["k_win"], cache.sizes["k_cmp"],
                                     spec, Ns, min(spec.n, Ns))


def _num_cmp_blocks(spec, length: torch.Tensor) -> torch.Tensor:
    """`spec.num_cmp_blocks` of each row's length (B,)."""
    return torch.where(length >= spec.l, torch.div(length - spec.l, spec.d, rounding_mode="floor") + 1, 0)


def _attend_last(attn: NSAAttention | DenseAttention, x: torch.Tensor, cache: LayerCache, t: torch.Tensor,
                 at: list[int], rope_t: torch.Tensor, kernel: str, steps: dict[str, Step]) -> torch.Tensor:
    """Attention output of each row's new token at its position t (B,) (x: (B, 1, dim)), extending `cache`;
    `at`: the same positions on the host; `kernel`: the step's (`decode_kernel`), run by `steps[kernel]`. The
    projections of x (q, the keys and values, NSA's gates) come first."""
    q, kv = attn.project(x, rope_t)  # q (B, 1, H, D)
    new = kv if isinstance(attn, NSAAttention) and kernel == "triton" else None  # the kernel appends them
    if new is None:
        for name, value in kv.items():
            cache.write(name, t, value)
    else:  # the buffers the kernel writes, made if a step comes first (after `reset`)
        for name, value in (*kv.items(), ("kc", kv["k_cmp"]), ("vc", kv["v_cmp"])):
            cache.allocate(name, value)
    gates = attn.gates(x) if isinstance(attn, NSAAttention) else None  # (B, 1, H, 3), fp32
    return attn.wo(_attention(attn, q, gates, cache, t, at, kernel, steps, new).reshape(x.shape[0], 1, -1))


def _attention(attn: NSAAttention | DenseAttention, q: torch.Tensor, gates: torch.Tensor | None, cache: LayerCache,
               t: torch.Tensor, at: list[int], kernel: str, steps: dict[str, Step],
               new: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    """The attention (B, 1, H, D) of each row's new token, whose keys `cache` holds (or, with `new`, the Triton
    decode step appends: its keys and values by name): dense's over all of them; NSA's compresses a block where
    one completes, then runs the branches and their mix by `gates`, by `kernel`'s step."""
    B, device, t_max = q.shape[0], q.device, max(at)
    if isinstance(attn, DenseAttention):  # SDPA over the cache as it lies, (B, G, S, D); the r heads of a group as rows
        G, D = cache.shape[1:]
        k, v = (cache.buffers[name].view(B, G, -1, D)[:, :, :t_max + 1] for name in ("k", "v"))
        seen = None if min(at) == t_max else (torch.arange(t_max + 1, device=device) <= t[:, None])[:, None, None]
        o = F.scaled_dot_product_attention(q.view(B, G, -1, D), k, v, attn_mask=seen)
        return o.reshape(B, 1, -1, D)
    spec, width = attn.spec, attn.spec.num_cmp_blocks(t_max + 1)
    # A row's compression block (t - l + 1) / d is complete at this token: compress its l keys (the ring's).
    completes = any(p >= spec.l - 1 and (p - spec.l + 1) % spec.d == 0 for p in at)
    if new is not None:  # the Triton step: the ring's keys and the new ones into the slot t gives, then the branches
        if completes:
            triton_decode.compress_step(attn.compress_k, attn.compress_v, (cache.buffers["k_cmp"],
                                        cache.buffers["v_cmp"]), (new["k_cmp"], new["v_cmp"]), t, cache.buffers["kc"],
                                        cache.buffers["vc"], attn.n_groups)
        return steps["triton"](attn, q, gates, cache, new, t, width, t_max)
    if cache.n_cmp is None:
        cache.n_cmp = torch.zeros_like(t)
    if completes:
        first = t - spec.l + 1
        complete = (first >= 0) & (first % spec.d == 0)
        ring = (first[:, None] + torch.arange(spec.l, device=device)) % cache.sizes["k_cmp"]  # (B, l) in order
        keys = (take_rows(cache.get(name), ring) for name in ("k_cmp", "v_cmp"))
        cache.compressed(*attn.compress(*keys), complete)
    n_cmp = cache.n_cmp
    if width > 0 and "kc" in cache.buffers and kernel == "cpp":
        return steps["cpp"](attn, q, gates, cache, t, width, t_max)
    if width == 0 or "kc" not in cache.buffers:  # no complete compression block in any row yet
        kc = vc = q.new_zeros(B, 0, attn.n_groups, attn.head_dim)
    else:
        kc, vc = cache.get("kc", width), cache.get("vc", width)
    visible = torch.arange(kc.shape[1], device=device) < n_cmp[:, None]  # (B, Nc)
    o_cmp, p_cmp = masked_attention(q, kc, vc, visible[:, None, None, None])
    idx, valid = select_blocks(p_cmp, spec, attn.n_groups, T=t_max + 1, positions=t[:, None])
    here = t.view(B, 1, 1, 1)
    pos = (idx[..., None] * spec.l_sel + torch.arange(spec.l_sel, device=device)).flatten(-2)  # (B, G, 1, S)
    ok = valid.repeat_interleave(spec.l_sel, dim=-1) & (pos <= here)  # causal inside the current block
    pos = torch.minimum(pos, here)[:, :, 0]  # (B, G, S): only the selected keys are read
    ks, vs = (y.transpose(1, 2).gather(2, pos[..., None].expand(-1, -1, -1, y.shape[-1])).transpose(1, 2)
              for y in (cache.get("k_sel"), cache.get("v_sel")))
    o_sel, _ = masked_attention(q, ks, vs, ok[:, :, None])
    kw, vw = cache.get("k_win"), cache.get("v_win")  # the ring of the last w positions, in any order
    seen = (torch.arange(kw.shape[1], device=device) <= t[:, None])[:, None, None, None]
    o_win, _ = masked_attention(q, kw, vw, seen)
    return mix_branches(gates.to(q.dtype), o_cmp, o_sel, o_win)


STEPS: dict[str, Step] = {"cpp": _attend_last_cpp, "triton": _attend_last_triton}
"""The kernels' steps by name (PyTorch's is `_attention`'s own ops); a decoder's `steps` are these."""


class Decoder:
    """Caches for one batch of sequences; `prefill(prompt)` then `step(token)`, each -> logits. Each row
    decodes at its own position: prompts of different lengths (left padding, a mask's change starting a
    document) and rows whose last documents start at different places. `kernels`: the step's
    (`[model] decode_kernels`: auto, triton, cpp, torch), chosen here, once (`kernel`). `context`: the positions
    a row will reach (the request's longest prompt and new tokens; `reserve`), at least the prompt's; `spare`:
    a finished request's caches, whose buffers of the same sizes are reused."""

    def __init__(self, model: Transformer, kernels: str = "auto", context: int = 0,
                 spare: list[LayerCache] | None = None):
        self.model = model
        self.kernel = decode_kernel(model, kernels)
        self.steps = STEPS
        self.context = request_context(model, context) if context else 0
        self.t: torch.Tensor | None = None  # (B,) each row's next position (in its document), once prefilled
        self.caches = spare or []
        self.reset()

    def reset(self) -> None:
        """Start new documents: the next token of every row is at position 0 and reads nothing before it (the
        buffers are kept for them)."""
        self.caches = [LayerCache(*layer_sizes(block.attention, self.context),
                                  {**old.spare, **old.buffers} if old else None)
                       for block, old in itertools.zip_longest(self.model.layers.values(), self.caches)]
        self.t = None if self.t is None else torch.zeros_like(self.t)
        self.at = [0] * len(self.t) if self.t is not None else []  # the same on the host
        self.last: torch.Tensor | None = None  # the last token (B, 1) given, read by `smear`

    def restart(self, rows: torch.Tensor) -> None:
        """Rows `rows` (B,) bool start a new document at their next token (a follow-up turn's padding or end-of-text):
        position 0, nothing before it read; the other rows go on, every buffer kept."""
        self.t = torch.where(rows, 0, self.t)
        self.at = [0 if new else p for new, p in zip(rows.tolist(), self.at)]
        for cache in self.caches:
            if cache.n_cmp is not None:
                cache.n_cmp = torch.where(rows, 0, cache.n_cmp)

    def reserve(self, positions: int) -> None:
        """Room for `positions` a row (`request_context`), what the caches hold kept (a follow-up request)."""
        if (context := request_context(self.model, positions)) > self.context:
            self.context = context
            for block, cache in zip(self.model.layers.values(), self.caches):
                cache.grow(*layer_sizes(block.attention, context))

    def select(self, rows: torch.Tensor) -> None:
        """Row b continues what row rows[b] (B,) held: beam search's reordering of its beams."""
        for cache in self.caches:
            cache.select(rows)
        self.t, self.last = self.t[rows], self.last[rows]
        self.at = [self.at[i] for i in rows.tolist()]

    def nbytes(self) -> int:
        """The bytes the caches hold."""
        return sum(cache.nbytes() for cache in self.caches)

    @torch.no_grad()
    def prefill(self, tokens: torch.Tensor, document_ids: torch.Tensor | None = None, keep: int = 0) -> torch.Tensor:
        """Logits (B, T, V) of the prompt by the training forward, which also hands each layer's keys
        and values (per branch, and compressed) to its cache; with `keep`, of its last `keep` positions only
        (generate()'s logits_to_keep: no B x T x V logits). With `document_ids` (B, T) the forward
        masks documents and the caches keep each row's last one, from its start."""
        m, (B, T) = self.model, tokens.shape
        self.context = max(self.context, request_context(m, T))
        self.reset()
        docs, rope = m.positions(document_ids)
        device = tokens.device
        start = torch.zeros(B, dtype=torch.long, device=device) if docs is None else docs.start[:, -1]
        length = T - start  # (B,) each row's last document so far
        self.at = length.tolist()
        longest = max(self.at)
        own = (start[:, None] + torch.arange(longest, device=device)).clamp(max=T - 1)  # (B, longest)
        h = m.embed(tokens, previous_tokens(tokens, docs))
        for block, cache in zip(m.layers.values(), self.caches):
            kv: dict[str, torch.Tensor] = {}
            h = block(h, rope, kv_out=kv, docs=docs)
            for name, value in kv.items():
                if name not in ("kc", "vc"):
                    cache.put(name, value if docs is None else take_rows(value, own), length)
                else:
                    spec = block.attention.spec
                    cache.n_cmp = _num_cmp_blocks(spec, length)
                    if docs is not None:  # each row's own slots, from its last document's first
                        first = docs.first_slot.gather(1, start[:, None])
                        slots = first + torch.arange(spec.num_cmp_blocks(longest), device=device)
                        value = take_rows(value, slots.clamp(max=max(value.shape[1] - 1, 0)))
                    cache.put(name, value, cache.n_cmp)
        self.t, self.last = length, tokens[:, -1:]
        return m.output(m.norm(h[:, -keep:] if keep else h))

    @torch.no_grad()
    def step(self, token: torch.Tensor, starts: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (B, 1, V) after appending `token` (B, 1) at each row's next position; `starts` (B,) bool: the rows
        where it begins a new document (`restart`)."""
        if starts is not None and bool(starts.any()):
            self.restart(starts)
        m, t = self.model, self.t
        if (end := max(self.at) + 1) > self.context:  # past the request's room: grow (twice, within the maximum)
            self.reserve(max(end, min(2 * self.context, m.max_seq_len)))
        prev = torch.full_like(token, -1) if self.last is None else torch.where(t[:, None] > 0, self.last, -1)
        h = m.embed(token, prev)
        rope = m.rope[t][:, None]  # (B, 1, head_dim): each row's own position
        for block, cache in zip(m.layers.values(), self.caches):
            h = block.residual(h, _attend_last(block.attention, block.attention_norm(h), cache, t, self.at, rope,
                                               self.kernel, self.steps))
        self.t, self.at, self.last = t + 1, [p + 1 for p in self.at], token
        return m.output(m.norm(h))

    def keys_read(self, t: int) -> dict[str, int]:
        """Keys one decoding step at position t reads per KV group, by branch (NSA or dense)."""
        attn = next(iter(self.model.layers.values())).attention
        if isinstance(attn, DenseAttention):
            return {"dense": t + 1}
        return {b: int(n) for b, n in attn.spec.keys_per_query(torch.tensor(t)).items()}


class DecodeCache:
    """A Decoder behind a library's cache argument (transformers' `generate`, nsa_titan/hf): the first
    `forward` prefills, each later one appends its tokens one at a time, reading only what NSA reads.
    `context`, `spare`: the Decoder's (the request's positions a row; a finished request's caches)."""

    is_compileable = False
    is_croppable = False

    def __init__(self, model: Transformer, kernels: str = "auto", context: int = 0,
                 spare: list[LayerCache] | None = None):
        self.decoder = Decoder(model, kernels, context, spare)
        self.seen = 0  # tokens given so far
        self.beams = False  # reordered by beam search: its rows are the last step's beams

    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        """Beam search's step: row b goes on from row beam_idx[b]."""
        self.decoder.select(beam_idx)
        self.beams = True

    @property
    def is_linear(self) -> list[bool]:
        return [False] * len(self.decoder.caches)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen

    def forward(self, tokens: torch.Tensor, document_ids: torch.Tensor | None = None, keep: int = 0,
                starts: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (B, S, V) of the new tokens (B, S) (with `keep`, of the last `keep`): the prompt's by the training
        forward the first time (its `document_ids`, as the model takes them: a change starts a document), then
        one incremental step per token (`starts` (B, S): where a token begins a new document)."""
        if self.seen == 0:
            logits = self.decoder.prefill(tokens, document_ids, keep)
        else:
            steps = [self.decoder.step(tokens[:, i:i + 1], None if starts is None else starts[:, i])
                     for i in range(tokens.shape[1])]
            logits = torch.cat(steps[-keep:] if keep else steps, 1)
        self.seen += tokens.shape[1]
        return logits
