"""The decoding caches' buffers (models/decode.py reads and writes them): per layer, each branch's keys and
values in the layout NSA's C++ kernels read, sized to a request (`request_context`, `layer_sizes`),
reused by the next request of the same sizes, grown past them, and reordered for beam search."""

from __future__ import annotations

import torch

from .transformer import DenseAttention, NSAAttention, Transformer


TRANSPOSED = {"kc", "k_sel", "k_win"}
"""The keys the C++ kernels read, kept transposed: 16 consecutive keys of one dimension are one vector."""


def take_rows(buf: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Entries `index` (B, K) of each row of `buf` (B, S, ...): (B, K, ...)."""
    return buf.gather(1, index.view(*index.shape, *[1] * (buf.dim() - 2)).expand(-1, -1, *buf.shape[2:]))


class LayerCache:
    """One layer's keys and values per name for B rows of G KV groups, in the layout NSA's C++ kernels read:
    the keys they read transposed (B G, D, size + pad; `TRANSPOSED`), the others and the values as rows
    (B G, size + pad, D) (dense's too: SDPA's layout), `pads[name]` slots past the end of what a kernel reads
    (16 keys, or a block, at a time; zeros, read masked). Each buffer is allocated at its first write, taken from
    `spare` (a finished request's buffers, by name, cleared) where one has its shape, else zeros; a ring (`size` below the
    context) holds position p at slot p % size; `n_cmp` (B,) counts each row's compressed blocks (kept by the C++
    and PyTorch steps; the Triton kernels derive it from the position). `get` shows a buffer as (B, S, G, D)."""

    def __init__(self, sizes: dict[str, int], pads: dict[str, int], spare: dict[str, torch.Tensor] | None = None):
        self.sizes, self.pads, self.spare = sizes, pads, dict(spare or {})
        self.buffers: dict[str, torch.Tensor] = {}
        self.shape: tuple[int, int, int] = (0, 0, 0)  # B, G, D
        self.n_cmp: torch.Tensor | None = None
        self.arrivals: torch.Tensor | None = None  # (B G, 2) int32 zeros: the Triton step's counts of a row's
        # programs, one a launch

    def _shape(self, name: str, rows: int, D: int) -> tuple[int, int, int]:
        slots = self.sizes[name] + self.pads.get(name, 0)
        return (rows, D, slots) if name in TRANSPOSED else (rows, slots, D)

    def allocate(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """The buffer of `name`, made for entries like (B, S, G, D): a spare one of its shape, cleared, else zeros.
        A kernel reads slots not yet written (past a row's last compressed block, past t in its last sel block, the
        window's ring before it fills, the pads) masked, but the PyTorch and C++ steps weigh them by 0: a NaN or Inf
        an earlier request left there (an fp16 overflow) would make every output NaN. A memset, once a request."""
        if name not in self.buffers:
            B, _, G, D = like.shape
            self.shape, shape = (B, G, D), self._shape(name, B * G, D)
            old = self.spare.pop(name, None)
            if old is None or old.shape != shape or old.dtype != like.dtype or old.device != like.device:
                self.spare.clear()  # another size: freed before the new buffers are made
                old = like.new_zeros(shape)
            else:
                old.zero_()
            self.buffers[name] = old
            if self.arrivals is None:
                self.arrivals = torch.zeros(B * G, 2, dtype=torch.int32, device=like.device)
        return self.get(name)

    def grow(self, sizes: dict[str, int], pads: dict[str, int]) -> None:
        """Room for a longer context: each buffer copied into one of `sizes` + `pads` slots (a ring below its full
        size never wrapped: it held every position at its own slot)."""
        self.sizes, self.pads, self.spare = sizes, pads, {}
        (B, G, D) = self.shape
        for name, old in self.buffers.items():
            if (shape := self._shape(name, B * G, D)) == old.shape:
                continue
            new = old.new_zeros(shape)
            dim = 2 if name in TRANSPOSED else 1
            new.narrow(dim, 0, old.shape[dim]).copy_(old)
            self.buffers[name] = new

    def select(self, rows: torch.Tensor) -> None:
        """Row b takes what row rows[b] holds (beam search's reordering), in place."""
        for buf in self.buffers.values():
            buf.copy_(buf.view(self.shape[0], -1)[rows].view_as(buf))
        self.n_cmp = None if self.n_cmp is None else self.n_cmp[rows]

    def put(self, name: str, x: torch.Tensor, length: torch.Tensor) -> None:
        """A prefill's entries x (B, S, G, D): row b's positions 0 .. length[b] - 1 (a ring keeps the last)."""
        buf, size, S = self.allocate(name, x), self.sizes[name], x.shape[1]
        if S <= size:
            buf[:, :S] = x
            return
        slot = torch.arange(size, device=x.device)
        last = slot + size * torch.div((length[:, None] - 1 - slot).clamp(min=0), size, rounding_mode="floor")
        buf.copy_(take_rows(x, last.clamp(max=S - 1)))  # slot s: the last position p < length with p % size == s

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


def _round_up(n: int, unit: int) -> int:
    return -(-n // unit) * unit


def request_context(model: Transformer, positions: int) -> int:
    """The positions a request's caches hold for `positions` a row (its longest prompt and new tokens): rounded up
    to whole sel blocks (NSA's l'; dense: 16), within the model's declared maximum; more is a ValueError."""
    model.check_length(positions)
    attn = next(iter(model.layers.values())).attention
    unit = attn.spec.l_sel if isinstance(attn, NSAAttention) else 16
    return min(_round_up(max(positions, 1), unit), model.max_seq_len)


def cache_sizes(attn: NSAAttention | DenseAttention, context: int) -> dict[str, int]:
    """Slots per name for a context of `context` positions: every position of the keys that any later token may
    read (sel's, dense's), the compressed blocks, and rings for what only the last positions need (the window's
    w keys; the cmp branch's l raw keys, until their block is compressed)."""
    if isinstance(attn, DenseAttention):
        return {"k": context, "v": context}
    spec, full = attn.spec, max(1, attn.spec.num_cmp_blocks(context))
    return {"k_sel": context, "v_sel": context, "kc": full, "vc": full, "k_win": min(spec.w, context),
            "v_win": min(spec.w, context), "k_cmp": min(spec.l, context), "v_cmp": min(spec.l, context)}


def cache_pads(attn: NSAAttention | DenseAttention, sizes: dict[str, int]) -> dict[str, int]:
    """Slots past `sizes` that the C++ kernels may read (masked): whole groups of 16 keys; sel's 16 past its last
    block's end; the compressed blocks' one more, which a row with every block writes (never read)."""
    if isinstance(attn, DenseAttention):
        return {}
    sel = _round_up(sizes["k_sel"], attn.spec.l_sel) + 16 - sizes["k_sel"]
    kc, win = _round_up(sizes["kc"] + 1, 16) - sizes["kc"], _round_up(sizes["k_win"], 16) - sizes["k_win"]
    return {"kc": kc, "vc": kc, "k_win": win, "v_win": win, "k_sel": sel, "v_sel": sel}


def layer_sizes(attn: NSAAttention | DenseAttention, context: int) -> tuple[dict[str, int], dict[str, int]]:
    """A layer's `cache_sizes` and `cache_pads` for `context` positions (a LayerCache's, or its `grow`'s)."""
    sizes = cache_sizes(attn, context)
    return sizes, cache_pads(attn, sizes)
