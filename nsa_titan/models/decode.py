"""Incremental decoding with per-branch KV caches: what each new token reads follows NSA's count.

Per layer the cache holds sel's keys and values for every position (any later token may choose any
block), the compressed blocks, and rings of what only the end is read of: the window's last w keys
and the cmp branch's last l raw keys; a new compressed block is formed every d tokens, once its l keys
exist. Every buffer is allocated once, for the model's declared maximum context (no growth copies).
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
document (fresh caches, position 0). Rows decode at positions of their own: prompts of different
lengths (left padding is a document of its own) and last documents starting anywhere. All equal the
packed forward pass, and each row decoded alone.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from ..config import ConfigError
from .attention import masked_attention, mix_branches, select_blocks
from .attention.families.cpp import cpu_attention
from .attention.families.reference import Reference
from .attention.families.triton import triton_decode
from .transformer import DenseAttention, NSAAttention, Transformer, previous_tokens


TRANSPOSED = {"kc", "k_sel", "k_win"}
"""The keys the C++ kernels read, kept transposed: 16 consecutive keys of one dimension are one vector."""


def _rows(buf: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Entries `index` (B, K) of each row of `buf` (B, S, ...): (B, K, ...)."""
    return buf.gather(1, index.view(*index.shape, *[1] * (buf.dim() - 2)).expand(-1, -1, *buf.shape[2:]))


class LayerCache:
    """One layer's keys and values per name for B rows of G KV groups, in the layout NSA's C++ kernels read:
    the keys they read transposed (B G, D, size + pad; `TRANSPOSED`), the others and the values as rows
    (B G, size + pad, D) (dense's too: SDPA's layout), `pads[name]` slots past the end of what a kernel reads
    (16 keys, or a block, at a time; finite, read masked). Each buffer is allocated once, at its first write, for
    the model's declared maximum context (no growth copies): a ring (`size` below that context) holds position
    p at slot p % size; `n_cmp` (B,) counts each row's compressed blocks (kept by the C++ and PyTorch steps; the
    Triton kernels derive it from the position). `get` shows a buffer as (B, S, G, D)."""

    def __init__(self, sizes: dict[str, int], pads: dict[str, int] | None = None):
        self.sizes, self.pads = sizes, pads or {}
        self.buffers: dict[str, torch.Tensor] = {}
        self.shape: tuple[int, int, int] = (0, 0, 0)  # B, G, D
        self.n_cmp: torch.Tensor | None = None
        self.arrivals: torch.Tensor | None = None  # (B G, 2) int32 zeros: the Triton step's counts of a row's
        # programs, one a launch

    def allocate(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """The buffer of `name`, made for entries like (B, S, G, D) (zeros: unwritten slots are read masked)."""
        if name not in self.buffers:
            B, _, G, D = like.shape
            self.shape = (B, G, D)
            slots = self.sizes[name] + self.pads.get(name, 0)
            self.buffers[name] = like.new_zeros((B * G, D, slots) if name in TRANSPOSED else (B * G, slots, D))
            if self.arrivals is None:
                self.arrivals = torch.zeros(B * G, 2, dtype=torch.int32, device=like.device)
        return self.get(name)

    def put(self, name: str, x: torch.Tensor, length: torch.Tensor) -> None:
        """A prefill's entries x (B, S, G, D): row b's positions 0 .. length[b] - 1 (a ring keeps the last)."""
        buf, size, S = self.allocate(name, x), self.sizes[name], x.shape[1]
        if S <= size:
            buf[:, :S] = x
            return
        slot = torch.arange(size, device=x.device)
        last = slot + size * torch.div((length[:, None] - 1 - slot).clamp(min=0), size, rounding_mode="floor")
        buf.copy_(_rows(x, last.clamp(max=S - 1)))  # slot s: the last position p < length with p % size == s

    def write(self, name: str, at: torch.Tensor, x: torch.Tensor) -> None:
        """Each row's entry x (B, 1, G, D) at its position `at` (B,)."""
        rows = torch.arange(x.shape[0], device=x.device)
        self.allocate(name, x)[rows, at % self.sizes[name]] = x[:, 0]

    def compressed(self, kc: torch.Tensor, vc: torch.Tensor, complete: torch.Tensor) -> None:
        """Each row's new compressed key and value (B, 1, G, D) at its slot n_cmp, counted where its block is
        `complete` (B,); the other rows write the slot after their last, which is read only once rewritten (a
        row with every block may write a pad slot: finite values, never read)."""
        rows = torch.arange(kc.shape[0], device=kc.device)
        for name, x in (("kc", kc), ("vc", vc)):
            self.allocate(name, x)
            self.get(name, self.sizes[name] + self.pads.get(name, 0))[rows, self.n_cmp] = x[:, 0]
        self.n_cmp = self.n_cmp + complete

    def get(self, name: str, width: int | None = None) -> torch.Tensor | None:
        """The buffer of `name` as (B, S, G, D) (a view), its first `width` slots (default: all), or None."""
        raw = self.buffers.get(name)
        if raw is None:
            return None
        (B, G, D), S = self.shape, self.sizes[name] if width is None else width
        if name in TRANSPOSED:
            return raw.view(B, G, D, -1)[..., :S].permute(0, 3, 1, 2)
        return raw.view(B, G, -1, D)[:, :, :S].transpose(1, 2)

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())


def cache_sizes(attn: NSAAttention | DenseAttention, context: int) -> dict[str, int]:
    """Slots per name for a context of `context` positions: every position of the keys that any later token may
    read (sel's, dense's), the compressed blocks, and rings for what only the last positions need (the window's
    w keys; the cmp branch's l raw keys, until their block is compressed)."""
    if isinstance(attn, DenseAttention):
        return {"k": context, "v": context}
    spec, full = attn.spec, max(1, attn.spec.num_cmp_blocks(context))
    return {"k_sel": context, "v_sel": context, "kc": full, "vc": full, "k_win": min(spec.w, context),
            "v_win": min(spec.w, context), "k_cmp": min(spec.l, context), "v_cmp": min(spec.l, context)}


def _pads(attn: NSAAttention | DenseAttention) -> dict[str, int]:
    """Zero slots past the end of the buffers the C++ kernels read: 16 keys at a time, sel's from a block's start."""
    if isinstance(attn, DenseAttention):
        return {}
    return {"kc": 16, "vc": 16, "k_win": 16, "v_win": 16, "k_sel": 16 + attn.spec.l_sel, "v_sel": 16 + attn.spec.l_sel}


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
        cache.compressed(*attn.compress(_rows(cache.get("k_cmp"), ring), _rows(cache.get("v_cmp"), ring)), complete)
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
    (`[model] decode_kernels`: auto, triton, cpp, torch), chosen here, once (`kernel`)."""

    def __init__(self, model: Transformer, kernels: str = "auto"):
        self.model = model
        self.kernel = decode_kernel(model, kernels)
        self.steps = STEPS
        self.t: torch.Tensor | None = None  # (B,) each row's next position (in its document), once prefilled
        self.reset()

    def reset(self) -> None:
        """Start new documents: the next token of every row is at position 0 and reads nothing before it."""
        self.caches = [LayerCache(cache_sizes(block.attention, self.model.max_seq_len), _pads(block.attention))
                       for block in self.model.layers.values()]
        self.t = None if self.t is None else torch.zeros_like(self.t)
        self.at = [0] * len(self.t) if self.t is not None else []  # the same on the host
        self.last: torch.Tensor | None = None  # the last token (B, 1) given, read by `smear`

    @torch.no_grad()
    def prefill(self, tokens: torch.Tensor, document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (B, T, V) of the prompt by the training forward, which also hands each layer's keys
        and values (per branch, and compressed) to its cache. With `document_ids` (B, T) the forward
        masks documents and the caches keep each row's last one, from its start."""
        m, (B, T) = self.model, tokens.shape
        m.check_length(T)
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
                    cache.put(name, value if docs is None else _rows(value, own), length)
                else:
                    spec = block.attention.spec
                    cache.n_cmp = _num_cmp_blocks(spec, length)
                    if docs is not None:  # each row's own slots, from its last document's first
                        first = docs.first_slot.gather(1, start[:, None])
                        slots = first + torch.arange(spec.num_cmp_blocks(longest), device=device)
                        value = _rows(value, slots.clamp(max=max(value.shape[1] - 1, 0)))
                    cache.put(name, value, cache.n_cmp)
        self.t, self.last = length, tokens[:, -1:]
        return m.output(m.norm(h))

    @torch.no_grad()
    def step(self, token: torch.Tensor) -> torch.Tensor:
        """Logits (B, 1, V) after appending `token` (B, 1) at each row's next position."""
        m, t = self.model, self.t
        m.check_length(max(self.at) + 1)
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
    `forward` prefills, each later one appends its tokens one at a time, reading only what NSA reads."""

    is_compileable = False
    is_croppable = False

    def __init__(self, model: Transformer, kernels: str = "auto"):
        self.decoder = Decoder(model, kernels)
        self.seen = 0  # tokens given so far

    @property
    def is_linear(self) -> list[bool]:
        return [False] * len(self.decoder.caches)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen

    def forward(self, tokens: torch.Tensor, document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (B, S, V) of the new tokens (B, S): the prompt's by the training forward the first time
        (its `document_ids`, as the model takes them: a change starts a document), then one incremental step
        per token."""
        if self.seen == 0:
            logits = self.decoder.prefill(tokens, document_ids)
        else:
            logits = torch.cat([self.decoder.step(tokens[:, i:i + 1]) for i in range(tokens.shape[1])], 1)
        self.seen += tokens.shape[1]
        return logits
