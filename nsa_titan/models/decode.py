"""Incremental decoding with per-branch KV caches: what each new token reads follows NSA's count.

Per layer the cache holds the keys and values of every branch for the positions so far, and
the compressed blocks; a new compressed block is formed every d tokens, once its l keys exist.
A decoding step for the token at position t reads:
  cmp: the Nc(t) compressed keys; sel: the n chosen blocks of l' keys; win: the last w keys;
  dense: all t + 1 keys.
`prefill` runs the training forward over the prompt (its logits) and fills the caches from the
same projections; `step` then extends one token at a time. Both equal a full forward pass.
"""

from __future__ import annotations

import torch

from .attention import cmp_visibility, masked_attention, select_blocks
from .attention.common import selected_keys
from .transformer import DenseAttention, NSAAttention, Transformer, apply_rope


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


def _project(attn: NSAAttention | DenseAttention, x: torch.Tensor, rope: torch.Tensor) -> dict[str, torch.Tensor]:
    """q and the per-branch keys/values of x (B, S, dim) at the positions `rope` covers."""
    B, S, _ = x.shape
    H, G, D = attn.n_heads, attn.n_groups, attn.head_dim
    out = {"q": apply_rope(attn.wq(x).view(B, S, H, D), rope)}
    projections = ({"": attn.wkv} if isinstance(attn, DenseAttention)
                   else {"cmp": attn.wkv_cmp, "sel": attn.wkv_sel, "win": attn.wkv_win})
    for name, proj in projections.items():
        k, v = proj(x).view(B, S, 2, G, D).unbind(2)
        out[f"k{name}"], out[f"v{name}"] = apply_rope(k, rope), v
    return out


def _attend_last(attn: NSAAttention | DenseAttention, x: torch.Tensor, cache: LayerCache, t: int,
                 rope_t: torch.Tensor) -> torch.Tensor:
    """Attention output of the one new token at position t (x: (B, 1, dim)), extending `cache`."""
    B = x.shape[0]
    p = _project(attn, x, rope_t)
    q = p["q"]  # (B, 1, H, D)
    if isinstance(attn, DenseAttention):
        k, v = cache.append("k", p["k"]), cache.append("v", p["v"])
        o, _ = masked_attention(q, k, v, torch.ones(1, k.shape[1], dtype=torch.bool, device=x.device))
        return attn.wo(o.reshape(B, 1, -1))
    spec = attn.spec
    for name in ("kcmp", "vcmp", "ksel", "vsel", "kwin", "vwin"):
        cache.append(name, p[name])
    if t >= spec.l - 1 and (t - spec.l + 1) % spec.d == 0:  # block i = (t - l + 1) / d is complete now
        start = t - spec.l + 1
        cache.append("kc", attn.compress_k(cache.get("kcmp")[:, start:t + 1]))
        cache.append("vc", attn.compress_v(cache.get("vcmp")[:, start:t + 1]))
    G = attn.n_groups
    empty = q.new_zeros(B, 0, G, attn.head_dim)
    kc, vc = cache.get("kc"), cache.get("vc")
    kc, vc = (empty, empty) if kc is None else (kc, vc)
    o_cmp, p_cmp = masked_attention(q, kc, vc, torch.ones(1, kc.shape[1], dtype=torch.bool, device=x.device))
    idx, valid = select_blocks(p_cmp, spec, G, t0=t, T=t + 1)
    ks, vs = cache.get("ksel"), cache.get("vsel")
    pos, ok = selected_keys(idx, valid, spec, torch.tensor([t], device=x.device))  # (B, G, 1, S)
    pos = pos.clamp(max=t)[:, :, 0]  # (B, G, S): only the selected keys are read
    gather = lambda x: x.transpose(1, 2).gather(2, pos[..., None].expand(-1, -1, -1, x.shape[-1])).transpose(1, 2)  # noqa: E731
    o_sel, _ = masked_attention(q, gather(ks), gather(vs), ok[:, :, None])
    lo = max(0, t - spec.w + 1)
    kw, vw = cache.get("kwin")[:, lo:], cache.get("vwin")[:, lo:]
    o_win, _ = masked_attention(q, kw, vw, torch.ones(1, kw.shape[1], dtype=torch.bool, device=x.device))
    gates = torch.sigmoid(attn.gate(x).to(torch.promote_types(x.dtype, torch.float32))).view(B, 1, attn.n_heads, 3)
    if attn.keep != (1.0, 1.0, 1.0):
        gates = gates * gates.new_tensor(attn.keep)
    g = gates.to(q.dtype)
    o = g[..., 0:1] * o_cmp + g[..., 1:2] * o_sel + g[..., 2:3] * o_win
    return attn.wo(o.reshape(B, 1, -1))


class Decoder:
    """Caches for one batch of sequences; `prefill(prompt)` then `step(token)`, each -> logits."""

    def __init__(self, model: Transformer):
        self.model = model
        self.caches = [LayerCache() for _ in model.layers]
        self.t = 0  # the next position

    @torch.no_grad()
    def prefill(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits (B, T, V) of the prompt by the training forward; the caches are filled alongside."""
        m, T = self.model, tokens.shape[1]
        rope = m.rope[:T]
        h = m.tok_embeddings(tokens)
        for block, cache in zip(m.layers.values(), self.caches):
            x = block.attention_norm(h)
            for name, value in _project(block.attention, x, rope).items():
                if name != "q":
                    cache.append(name, value)
            if isinstance(block.attention, NSAAttention):
                spec = block.attention.spec
                if T >= spec.l:
                    cache.append("kc", block.attention.compress_k(cache.get("kcmp")))
                    cache.append("vc", block.attention.compress_v(cache.get("vcmp")))
            h = block(h, m.rope)
        self.t = T
        return m.output(m.norm(h))

    @torch.no_grad()
    def step(self, token: torch.Tensor) -> torch.Tensor:
        """Logits (B, 1, V) after appending `token` (B, 1) at the next position."""
        m, t = self.model, self.t
        h = m.tok_embeddings(token)
        rope_t = m.rope[t:t + 1]
        for block, cache in zip(m.layers.values(), self.caches):
            h = h + _attend_last(block.attention, block.attention_norm(h), cache, t, rope_t)
            h = h + block.feed_forward(block.ffn_norm(h))
        self.t = t + 1
        return m.output(m.norm(h))

    def keys_read(self, t: int) -> dict[str, int]:
        """Keys one decoding step at position t reads per KV group, by branch (NSA or dense)."""
        attn = next(iter(self.model.layers.values())).attention
        if isinstance(attn, DenseAttention):
            return {"dense": t + 1}
        s = attn.spec
        return {"cmp": int(cmp_visibility(s, t + 1, torch.device("cpu"))[-1].sum()),
                "sel": (min(s.n, t // s.l_sel + 1) - 1) * s.l_sel + (t % s.l_sel + 1), "win": min(t + 1, s.w)}
