"""Incremental decoding with per-branch KV caches: what each new token reads follows NSA's count.

Per layer the cache holds the keys and values of every branch for the positions so far, and
the compressed blocks; a new compressed block is formed every d tokens, once its l keys exist.
A decoding step for the token at position t reads:
  cmp: the Nc(t) compressed keys; sel: the n chosen blocks of l' keys; win: the last w keys;
  dense: all t + 1 keys.
`prefill` runs the training forward over the prompt (its logits), which hands the caches its
projections; `step` then extends one token at a time through the same layer pieces (projections,
compression, gates, the branch mix, the block's residuals). Both equal a full forward pass.

With documents (a prompt packed from several, `document_ids`), the caches hold the last document
only, at positions from its start, so that new tokens continue it; `reset` starts a new document
(fresh caches, position 0). Both equal the packed forward pass.
"""

from __future__ import annotations

import torch

from ..data.batch import document_ids
from .attention import Documents, masked_attention, mix_branches, select_blocks
from .attention.common import selected_keys
from .transformer import DenseAttention, NSAAttention, Transformer, previous_tokens


class LayerCache:
    """Keys/values (B, S, G, D) per name, in buffers that grow by doubling: appending a token
    writes in place, reading returns a view of the filled part."""

    def __init__(self) -> None:
        self.buffers: dict[str, torch.Tensor] = {}
        self.length: dict[str, int] = {}

    def append(self, name: str, x: torch.Tensor) -> torch.Tensor:
        n = self.length.get(name, 0)
        need = n + x.shape[1]
        buf = self.buffers.get(name)
        if buf is None or buf.shape[1] < need:
            grown = x.new_empty(x.shape[0], max(need, 2 * n, 16), *x.shape[2:])
            if buf is not None:
                grown[:, :n] = buf[:, :n]
            self.buffers[name] = buf = grown
        buf[:, n:need] = x
        self.length[name] = need
        return buf[:, :need]

    def get(self, name: str) -> torch.Tensor | None:
        return self.buffers[name][:, :self.length[name]] if name in self.buffers else None


def _attend_last(attn: NSAAttention | DenseAttention, x: torch.Tensor, cache: LayerCache, t: int,
                 rope_t: torch.Tensor) -> torch.Tensor:
    """Attention output of the one new token at position t (x: (B, 1, dim)), extending `cache`."""
    B = x.shape[0]
    q, kv = attn.project(x, rope_t)  # q (B, 1, H, D)
    for name, value in kv.items():
        cache.append(name, value)
    every = lambda k: torch.ones(1, k.shape[1], dtype=torch.bool, device=x.device)  # noqa: E731
    if isinstance(attn, DenseAttention):
        k, v = cache.get("k"), cache.get("v")
        return attn.wo(masked_attention(q, k, v, every(k))[0].reshape(B, 1, -1))
    spec = attn.spec
    if t >= spec.l - 1 and (t - spec.l + 1) % spec.d == 0:  # block i = (t - l + 1) / d is complete now
        start = t - spec.l + 1
        kc, vc = attn.compress(cache.get("k_cmp")[:, start:t + 1], cache.get("v_cmp")[:, start:t + 1])
        cache.append("kc", kc)
        cache.append("vc", vc)
    kc, vc = cache.get("kc"), cache.get("vc")
    if kc is None:  # no complete compression block yet
        kc = vc = q.new_zeros(B, 0, attn.n_groups, attn.head_dim)
    o_cmp, p_cmp = masked_attention(q, kc, vc, every(kc))
    idx, valid = select_blocks(p_cmp, spec, attn.n_groups, t0=t, T=t + 1)
    pos, ok = selected_keys(idx, valid, spec, torch.tensor([t], device=x.device))  # (B, G, 1, S)
    pos = pos.clamp(max=t)[:, :, 0]  # (B, G, S): only the selected keys are read
    gather = lambda y: y.transpose(1, 2).gather(2, pos[..., None].expand(-1, -1, -1, y.shape[-1])).transpose(1, 2)  # noqa: E731
    o_sel, _ = masked_attention(q, gather(cache.get("k_sel")), gather(cache.get("v_sel")), ok[:, :, None])
    lo = max(0, t - spec.w + 1)
    kw, vw = cache.get("k_win")[:, lo:], cache.get("v_win")[:, lo:]
    o_win, _ = masked_attention(q, kw, vw, every(kw))
    o = mix_branches(attn.gates(x).to(q.dtype), o_cmp, o_sel, o_win)
    return attn.wo(o.reshape(B, 1, -1))


class Decoder:
    """Caches for one batch of sequences; `prefill(prompt)` then `step(token)`, each -> logits."""

    def __init__(self, model: Transformer):
        self.model = model
        self.caches = [LayerCache() for _ in model.layers]
        self.t = 0  # the next position (in the current document)
        self.last: torch.Tensor | None = None  # the last token (B, 1) given, read by `smear`

    def reset(self) -> None:
        """Start a new document: the next token is at position 0 and reads nothing before it."""
        self.caches = [LayerCache() for _ in self.model.layers]
        self.t = 0
        self.last = None

    @torch.no_grad()
    def prefill(self, tokens: torch.Tensor, document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (B, T, V) of the prompt by the training forward, which also hands each layer's keys
        and values (per branch, and compressed) to its cache. With `document_ids` (B, T) the forward
        masks documents and the caches keep the last one, which must start at the same position in
        every row."""
        m, T = self.model, tokens.shape[1]
        m.check_length(T)
        self.reset()
        docs, rope = m.positions(document_ids)
        s = 0
        if docs is not None:
            starts = docs.start[:, -1]
            s = int(starts[0])
            if not bool((starts == s).all()):
                raise ValueError(f"the prompts' last documents start at positions {starts.tolist()}: decoding "
                                 f"continues one document per row from a common position; decode rows whose "
                                 f"last documents start elsewhere separately")
        h = m.embed(tokens, previous_tokens(tokens, docs))
        for block, cache in zip(m.layers.values(), self.caches):
            kv: dict[str, torch.Tensor] = {}
            h = block(h, rope, kv_out=kv, docs=docs)
            for name, value in kv.items():
                cache.append(name, value if docs is None else self._last_document(name, value, docs, s))
        self.t, self.last = T - s, tokens[:, -1:]
        return m.output(m.norm(h))

    def _last_document(self, name: str, x: torch.Tensor, docs: Documents, s: int) -> torch.Tensor:
        """The part of a layer's keys / values (B, T, G, D), or compressed slots (B, Nc, G, D), that
        belongs to the document starting at s (each row's own slots)."""
        if name not in ("kc", "vc"):
            return x[:, s:]
        n = next(iter(self.model.layers.values())).attention.spec.num_cmp_blocks(docs.start.shape[1] - s)
        slots = docs.first_slot[:, s, None] + torch.arange(n, device=x.device)  # (B, n)
        return x.gather(1, slots[:, :, None, None].expand(-1, -1, *x.shape[2:]))

    @torch.no_grad()
    def step(self, token: torch.Tensor) -> torch.Tensor:
        """Logits (B, 1, V) after appending `token` (B, 1) at the next position."""
        m, t = self.model, self.t
        m.check_length(t + 1)
        h = m.embed(token, self.last if t else torch.full_like(token, -1))
        for block, cache in zip(m.layers.values(), self.caches):
            h = block.residual(h, _attend_last(block.attention, block.attention_norm(h), cache, t, m.rope[t:t + 1]))
        self.t, self.last = t + 1, token
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

    def __init__(self, model: Transformer):
        self.decoder = Decoder(model)
        self.seen = 0  # tokens given so far

    @property
    def is_linear(self) -> list[bool]:
        return [False] * len(self.decoder.caches)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen

    def forward(self, tokens: torch.Tensor, attention_mask: torch.Tensor | None = None, eos_id: int | None = None
                ) -> torch.Tensor:
        """Logits (B, S, V) of the new tokens (B, S): the prompt's by the training forward the first time
        (documents from the mask's padding and, given `eos_id`, its end-of-text tokens), then one
        incremental step per token."""
        if self.seen == 0:
            logits = self.decoder.prefill(tokens, document_ids(tokens, attention_mask, eos_id))
        else:
            logits = torch.cat([self.decoder.step(tokens[:, i:i + 1]) for i in range(tokens.shape[1])], 1)
        self.seen += tokens.shape[1]
        return logits
