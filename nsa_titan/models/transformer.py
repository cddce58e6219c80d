"""Decoder-only transformer with Native Sparse Attention (or dense attention as a baseline).

token embedding -> n_layers x [RMSNorm -> attention -> +, RMSNorm -> SwiGLU -> +] -> RMSNorm -> head

Built on the meta device, materialised by the trainer (`to_empty`), then `init_weights`.
Initialisation draws every parameter in full from one seeded generator, in model order,
so the values do not depend on how the parameters are later sharded.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, distribute_tensor

from ..config import Model as ModelConfig
from ..distributed.context_parallel import ContextSplit, attend_in_parts, gather_keys
from .attention import BRANCHES, Documents, Family, NSASpec, dense_causal
from .attention.dense import with_block_masks
from .attention.families.choose import Auto
from .attention.families.reference import Reference
from .nsa_stats import gate_stats, selection_stats
from .rope import apply_rope, rope_tables

FEW_ROWS = 16
"""Blocks compressed at once up to which the compression's first layer runs weight-major (a decoding step's)."""


def _init_trunc_normal(param: torch.Tensor, std: float, gen: torch.Generator) -> None:
    """Fill `param` (plain or DTensor shard) from a full-size draw of N(0, std) cut at 3 std."""
    full = torch.empty(param.shape, dtype=torch.float32)
    nn.init.trunc_normal_(full, mean=0.0, std=std, a=-3 * std, b=3 * std, generator=gen)
    with torch.no_grad():
        if isinstance(param, DTensor):
            full = distribute_tensor(full.to(param.device), param.device_mesh, param.placements, src_data_rank=None)
        param.copy_(full.to(dtype=param.dtype, device=param.device))


def nsa_spec(cfg: ModelConfig) -> NSASpec:
    """The NSA hyper-parameters of a model config."""
    return NSASpec(l=cfg.cmp_block_size, d=cfg.cmp_stride, l_sel=cfg.sel_block_size, n=cfg.sel_top_n, w=cfg.window_size)


def _unwrapped(block: nn.Module) -> "TransformerBlock":
    """A block inside its AC / compile wrappers."""
    while not isinstance(block, TransformerBlock):
        block = getattr(block, "_checkpoint_wrapped_module", None) or block._orig_mod
    return block


def previous_tokens(tokens: torch.Tensor, docs: Documents | None = None) -> torch.Tensor:
    """(B, T): the token before each one in its document; -1 at a row's or a document's first token."""
    prev = F.pad(tokens[:, :-1], (1, 0), value=-1)
    return prev if docs is None else prev.masked_fill(docs.positions == 0, -1)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def init_weights(self, std: float, out_std: float, gen: torch.Generator) -> None:
        _init_trunc_normal(self.w1.weight, std, gen)
        _init_trunc_normal(self.w3.weight, std, gen)
        _init_trunc_normal(self.w2.weight, out_std, gen)


class Compressor(nn.Module):
    """phi: a block of l keys -> one key, by the paper's MLP (plus a learned intra-block position
    table), or without `mlp` the block's mean (as fla's NSA). (B, T, G, D) -> (B, Nc, G, D), block i
    covering positions [i*d, i*d + l), or with `starts` (B, Nc) the positions [starts[b, i],
    starts[b, i] + l) (documents' slots; past T: unused)."""

    def __init__(self, l: int, d: int, head_dim: int, hidden: int, out_bias: bool, mlp: bool = True):
        super().__init__()
        self.l, self.d, self.mlp = l, d, mlp
        if mlp:
            self.pos = nn.Parameter(torch.empty(l, head_dim))  # intra-block position encoding
            self.fc1 = nn.Linear(l * head_dim, hidden)
            self.fc2 = nn.Linear(hidden, head_dim, bias=out_bias)

    def forward(self, x: torch.Tensor, starts: torch.Tensor | None = None) -> torch.Tensor:
        B, T, G, D = x.shape
        if T < self.l:  # no complete block yet
            return x.new_zeros(B, 0 if starts is None else starts.shape[1], G, D)
        if starts is None:
            blocks = x.unfold(1, self.l, self.d).transpose(-1, -2)  # (B, Nc, G, l, D)
        else:
            pos = (starts.clamp(max=T - self.l)[:, :, None] + torch.arange(self.l, device=x.device)).view(B, -1)
            blocks = x.gather(1, pos[:, :, None, None].expand(-1, -1, G, D)).view(B, -1, self.l, G, D).transpose(2, 3)
        if not self.mlp:
            return blocks.mean(-2)
        blocks = (blocks + self.pos.to(x.dtype)).flatten(-2)  # (B, Nc, G, l*D)
        if blocks.shape[:-1].numel() > FEW_ROWS or x.dtype != torch.float32:
            hidden = self.fc1(blocks)
        else:  # a decoding step's few float32 blocks: fc1 weight-major (rows as columns), which streams the weight
            # at full bandwidth (the CPU's float32 rows x weight.T runs at half for a few rows; bfloat16's does not)
            rows = blocks.reshape(-1, blocks.shape[-1])
            hidden = torch.addmm(self.fc1.bias[:, None], self.fc1.weight, rows.T).T.view(*blocks.shape[:-1], -1)
        return self.fc2(F.silu(hidden))

    def init_weights(self, std: float, gen: torch.Generator) -> None:
        if self.mlp:
            for weight in (self.pos, self.fc1.weight, self.fc2.weight):
                _init_trunc_normal(weight, std, gen)
            for bias in (self.fc1.bias, self.fc2.bias):
                if bias is not None:
                    nn.init.zeros_(bias)


class NSAAttention(nn.Module):
    """Native Sparse Attention: cmp + sel + win branches mixed by per-head sigmoid gates.

    One shared query projection; each branch has its own key and value projection (`wkv_cmp`,
    `wkv_sel`, `wkv_win`); compressed keys/values come from their own phi. The pieces
    (`project`, `compress`, `gates`) are what training and decoding share. With `record_stats`
    set, a forward also leaves gate and selection statistics in `stats`; with `record_selection`,
    the sel blocks each query's group chose in `selection`.
    """

    BRANCHES = BRANCHES

    def __init__(self, cfg: ModelConfig, family: Family | None = None):
        """`family`: the NSA kernel family (`attention.families`; None: `reference` for attn_impl = reference,
        else chosen per call, `auto`)."""
        super().__init__()
        self.n_heads, self.n_groups, self.head_dim = cfg.n_heads, cfg.n_kv_groups, cfg.head_dim
        self.spec = nsa_spec(cfg)
        self.family = family or (Reference() if cfg.attn_impl == "reference" else Auto())
        self.keep = tuple(float(cfg.nsa_branch in ("all", b)) for b in self.BRANCHES)  # nsa_branch: others x 0
        self.record_stats, self.stats_tokens = False, None  # stats_tokens (B, T): also their gates apart
        self.cp: ContextSplit | None = None  # set by parallel.apply_cp
        self.stats: dict[str, torch.Tensor] = {}
        self.score_grad = cfg.sel_score_grad * self.keep[1]  # the scores' straight-through gradient (0: none, sel off)
        self.explore = cfg.sel_score_explore  # ... also for this many unchosen blocks per query, drawn by the step:
        self.register_buffer("explore_step", torch.zeros((), dtype=torch.long), persistent=False)  # set_explore_step
        self.record_selection = False  # evaluation (no cp): keep the last forward's sel blocks
        self.selection: tuple[torch.Tensor, torch.Tensor] | None = None  # idx, valid (B, G, T, n')
        H, G, D = cfg.n_heads, cfg.n_kv_groups, cfg.head_dim
        hidden = cfg.cmp_mlp_hidden or 4 * D
        self.wq = nn.Linear(cfg.dim, H * D, bias=False)
        self.wkv_cmp = nn.Linear(cfg.dim, 2 * G * D, bias=False)
        self.wkv_sel = nn.Linear(cfg.dim, 2 * G * D, bias=False)
        self.wkv_win = nn.Linear(cfg.dim, 2 * G * D, bias=False)
        # A bias on the compressed keys would shift every score of a query equally: softmax
        # ignores it and its gradient is 0, so the key compressor has none.
        self.compress_k, self.compress_v = (Compressor(self.spec.l, self.spec.d, D, hidden, bias, cfg.cmp_phi == "mlp")
                                            for bias in (False, True))
        self.gate = nn.Linear(cfg.dim, 3 * H)  # g^cmp, g^sel, g^win per head
        self.wo = nn.Linear(H * D, cfg.dim, bias=False)

    def project(self, x: torch.Tensor, rope: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """q (B, S, H, D) and every branch's keys and values (B, S, G, D) of x (B, S, dim), RoPE on q
        and the keys at the positions `rope` starts with."""
        B, S, _ = x.shape
        H, G, D = self.n_heads, self.n_groups, self.head_dim
        kv = {}
        for b, proj in (("cmp", self.wkv_cmp), ("sel", self.wkv_sel), ("win", self.wkv_win)):
            k, v = proj(x).view(B, S, 2, G, D).unbind(2)
            kv[f"k_{b}"], kv[f"v_{b}"] = apply_rope(k, rope), v
        return apply_rope(self.wq(x).view(B, S, H, D), rope), kv

    def compress(self, k_cmp: torch.Tensor, v_cmp: torch.Tensor, docs: Documents | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """The compressed keys and values (B, Nc, G, D) of the cmp keys and values (B, S, G, D); with
        `docs`, of its documents' slots."""
        starts = None if docs is None else docs.cmp_start
        return self.compress_k(k_cmp, starts), self.compress_v(v_cmp, starts)

    def gates(self, x: torch.Tensor) -> torch.Tensor:
        """Sigmoid gates (B, S, H, 3) of x (B, S, dim), in fp32 (or fp64), order (cmp, sel, win)."""
        B, S, _ = x.shape
        gates = torch.sigmoid(self.gate(x).to(torch.promote_types(x.dtype, torch.float32))).view(B, S, self.n_heads, 3)
        if self.keep == (1.0, 1.0, 1.0):
            return gates
        return torch.stack([gates[..., i] * k for i, k in enumerate(self.keep)], -1)  # scalars: no copy to the device

    def forward(self, x: torch.Tensor, rope: torch.Tensor, kv_out: dict | None = None,
                docs: Documents | None = None) -> torch.Tensor:
        """x (B, T, dim) -> (B, T, dim), each token attending inside its document with `docs`.
        `kv_out`, when given, receives the keys and values of every branch and the compressed
        ones (`kc`, `vc`): what a decoding cache keeps."""
        B, T, _ = x.shape
        q, kv = self.project(x, rope)
        kv = gather_keys(self.cp, kv)  # under cp: this rank's tokens -> the keys of the whole sequence
        kc, vc = self.compress(kv["k_cmp"], kv["v_cmp"], docs)
        gates = self.gates(x)
        if kv_out is not None:
            kv_out.update(kv, kc=kc, vc=vc)
        keys, read = (kc, vc, kv["k_sel"], kv["v_sel"], kv["k_win"], kv["v_win"]), []  # read: each part's (idx, valid)
        score_grad = self.score_grad if self.training and torch.is_grad_enabled() else 0.0
        cmp, sel, win = (k != 0 for k in self.keep)  # gated off: not run; recording, the blocks are chosen all the same
        branches = (cmp or self.record_stats or self.record_selection, sel, win or not any(self.keep))  # (output unchanged)

        def attend(rows: slice, **q0: int) -> torch.Tensor:
            o, idx, valid = self.family(q[:, rows], *keys, gates[:, rows], self.spec, docs=docs, branches=branches,
                                        return_selection=True, score_grad=score_grad, explore=self.explore,
                                        seed=self.explore_step, **q0)
            read.append((idx, valid))
            return o
        o = attend_in_parts(self.cp, kv["k_sel"].shape[1], attend)
        if self.record_stats:
            self.stats = {**gate_stats(gates, self.stats_tokens), **selection_stats(*read[0], self.spec, docs)}
        if self.record_selection:  # (evaluation, without cp: one part, every query)
            self.selection = read[0]
        return self.wo(o.reshape(B, T, -1))

    def parts(self) -> list[tuple[str, nn.Module]]:
        """The modules by what they are (parameter accounting)."""
        return [("queries", self.wq), ("cmp K/V", self.wkv_cmp), ("cmp compression MLPs", self.compress_k),
                ("cmp compression MLPs", self.compress_v), ("sel K/V", self.wkv_sel), ("win K/V", self.wkv_win),
                ("gates", self.gate), ("attention output", self.wo)]

    def init_weights(self, std: float, out_std: float, gen: torch.Generator) -> None:
        _init_trunc_normal(self.wq.weight, std, gen)
        for wkv in (self.wkv_cmp, self.wkv_sel, self.wkv_win):
            _init_trunc_normal(wkv.weight, std, gen)
        for compressor in (self.compress_k, self.compress_v):
            compressor.init_weights(std, gen)
        _init_trunc_normal(self.gate.weight, std, gen)
        nn.init.zeros_(self.gate.bias)  # every branch starts at weight 0.5
        _init_trunc_normal(self.wo.weight, out_std, gen)
        self.explore_step.zero_()  # a buffer, materialised empty

class DenseAttention(nn.Module):
    """Plain causal GQA attention with the same q/k/v/o shapes: the baseline."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_groups, self.head_dim = cfg.n_heads, cfg.n_kv_groups, cfg.head_dim
        H, G, D = cfg.n_heads, cfg.n_kv_groups, cfg.head_dim
        self.wq = nn.Linear(cfg.dim, H * D, bias=False)
        self.wkv = nn.Linear(cfg.dim, 2 * G * D, bias=False)
        self.wo = nn.Linear(H * D, cfg.dim, bias=False)
        self.cp: ContextSplit | None = None  # set by parallel.apply_cp

    def project(self, x: torch.Tensor, rope: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """q (B, S, H, D) and {k, v} (B, S, G, D) of x (B, S, dim), RoPE on q and k."""
        B, S, _ = x.shape
        k, v = self.wkv(x).view(B, S, 2, self.n_groups, self.head_dim).unbind(2)
        return apply_rope(self.wq(x).view(B, S, self.n_heads, self.head_dim), rope), {"k": apply_rope(k, rope), "v": v}

    def forward(self, x: torch.Tensor, rope: torch.Tensor, kv_out: dict | None = None,
                docs: Documents | None = None) -> torch.Tensor:
        """x (B, T, dim) -> (B, T, dim); `kv_out` receives k and v (see NSAAttention.forward)."""
        B, T, _ = x.shape
        q, kv = self.project(x, rope)
        kv = gather_keys(self.cp, kv)
        if kv_out is not None:
            kv_out.update(kv)
        o = attend_in_parts(self.cp, kv["k"].shape[1], lambda rows, **q0: dense_causal(
            q[:, rows], kv["k"], kv["v"], docs, **q0))
        return self.wo(o.reshape(B, T, -1))

    def parts(self) -> list[tuple[str, nn.Module]]:
        """The modules by what they are (parameter accounting)."""
        return [("queries", self.wq), ("dense K/V", self.wkv), ("attention output", self.wo)]

    def init_weights(self, std: float, out_std: float, gen: torch.Generator) -> None:
        _init_trunc_normal(self.wq.weight, std, gen)
        _init_trunc_normal(self.wkv.weight, std, gen)
        _init_trunc_normal(self.wo.weight, out_std, gen)


class TransformerBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, family: Family | None = None):
        super().__init__()
        self.attention_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attention = NSAAttention(cfg, family) if cfg.attention == "nsa" else DenseAttention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        hidden = cfg.ffn_hidden_dim or 64 * math.ceil(8 * cfg.dim / 3 / 64)
        self.feed_forward = FeedForward(cfg.dim, hidden)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, kv_out: dict | None = None,
                docs: Documents | None = None) -> torch.Tensor:
        return self.residual(x, self.attention(self.attention_norm(x), rope, kv_out, docs))

    def residual(self, x: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """The block around its attention output: x + attn_out, then the MLP's residual."""
        x = x + attn_out
        return x + self.feed_forward(self.ffn_norm(x))

    def parts(self) -> list[tuple[str, nn.Module]]:
        return [("norms", self.attention_norm), ("norms", self.ffn_norm), ("MLP", self.feed_forward),
                *self.attention.parts()]

    def init_weights(self, std: float, out_std: float, gen: torch.Generator) -> None:
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attention.init_weights(std, out_std, gen)
        self.feed_forward.init_weights(std, out_std, gen)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, max_seq_len: int, family: Family | None = None):
        """`family`: the NSA kernel family (None: `reference` for attn_impl = reference, else chosen per call)."""
        super().__init__()
        self.cfg, self.max_seq_len, self.family = cfg, max_seq_len, family
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.smear = nn.Linear(cfg.dim, cfg.dim, bias=False) if cfg.smear else None  # maps the previous token in
        # A ModuleDict keyed "0".."L-1" keeps parameter names stable when blocks are wrapped.
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg, family) for i in range(cfg.n_layers)})
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.register_buffer("rope", rope_tables(cfg, max_seq_len), persistent=False)
        self.cp: ContextSplit | None = None  # set by parallel.apply_cp

    def check_length(self, end: int) -> None:
        """A clear error for positions past max_seq_len (the RoPE table's length: the declared maximum context)."""
        if end > self.max_seq_len:
            raise ValueError(f"{end} positions exceed the model's max_seq_len = {self.max_seq_len}, the context it is "
                             f"declared for: adapt it to a longer one (docs/long-context.md), or build it with a "
                             f"larger max_seq_len ([model] max_seq_len, training.seq_len)")

    @contextlib.contextmanager
    def branch_off(self, layer: int, branch: str) -> Iterator[None]:
        """Within the block, NSA branch `branch` (cmp, sel or win) of layer `layer` adds nothing (its
        gate times 0): which branch carries a skill (`evaluate --task recall --ablate`)."""
        attention = _unwrapped(self.layers[str(layer)]).attention
        if not isinstance(attention, NSAAttention) or branch not in attention.BRANCHES:
            raise ValueError(f"branch_off({layer}, {branch!r}): needs an NSA layer and one of {NSAAttention.BRANCHES}")
        keep = attention.keep
        attention.keep = tuple(k * (b != branch) for k, b in zip(keep, attention.BRANCHES))
        try:
            yield
        finally:
            attention.keep = keep

    def embed(self, tokens: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """(B, T, dim) embeddings of tokens (B, T); with `smear`, plus the embeddings of the previous
        tokens `prev` (B, T), -1 where there is none (`previous_tokens`), through the smear matrix."""
        h = self.tok_embeddings(tokens)
        if self.smear is None:
            return h
        return h + self.smear(self.tok_embeddings(prev.clamp_min(0))) * (prev >= 0)[..., None]

    def documents(self, document_ids: torch.Tensor) -> Documents:
        """The document geometry of `document_ids` (B, T) on the model's device, once a batch for every layer;
        ids on the host (the loader's) are measured there: host bounds for the chunks, no device wait."""
        attention = _unwrapped(next(iter(self.layers.values()))).attention
        nsa, T = isinstance(attention, NSAAttention), document_ids.shape[1]
        parts = [(0, T)] if self.cp is None else self.cp.chunks(T)  # the query parts attention takes
        varlen = []  # flash-attn's varlen layouts of the query parts
        if nsa and self.family is not None and self.family.win_flash:
            varlen = [(max(0, a - attention.spec.w + 1), a, b) for a, b in parts]
        docs = Documents.of(document_ids, attention.spec if nsa else None, varlen).to(self.rope.device)
        if not nsa:
            return with_block_masks(docs, parts)  # dense on a GPU: FlexAttention's masks
        return self.family.prepare(docs, attention.spec, parts) if self.family is not None else docs

    def positions(self, document_ids: torch.Tensor | None) -> tuple[Documents | None, torch.Tensor]:
        """The document geometry (None without ids) and the RoPE rows the blocks take: the table from
        position 0, or each token's row (B, T, head_dim), positions restarting per document."""
        if document_ids is None:
            return None, self.rope
        docs = self.documents(document_ids)
        return docs, self.rope[docs.positions]

    def forward(self, tokens: torch.Tensor, document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """tokens (B, T) long -> logits (B, T, vocab), T <= max_seq_len.

        document_ids (B, T) integer: a change of value between neighbours starts a new document,
        and every token's output is then what its document alone would give (positions from 0).
        Under context parallelism (`cp`) every rank passes the whole batch and gets the logits of its
        own tokens, (B, Tl, vocab) at `cp.positions` of the padded sequence.
        """
        if document_ids is not None and document_ids.shape != tokens.shape:
            raise ValueError(f"document_ids has shape {tuple(document_ids.shape)}, the tokens "
                             f"{tuple(tokens.shape)}: give one document index per token")
        if self.cp is not None:  # padded at the end: the padding is a document of its own
            T = tokens.shape[1]
            tokens = self.cp.pad(tokens, 0)
            if document_ids is not None:
                document_ids = torch.cat([document_ids, (document_ids[:, -1:] + 1).expand(-1, tokens.shape[1] - T)], 1)
        self.check_length(tokens.shape[1])
        docs, rope = self.positions(document_ids)
        prev = previous_tokens(tokens, docs)
        if self.cp is not None:
            local = self.cp.positions(tokens.shape[1], tokens.device)
            tokens, prev, rope = tokens[:, local], prev[:, local], rope[local] if rope.dim() == 2 else rope[:, local]
        h = self.embed(tokens, prev)
        for block in self.layers.values():
            h = block(h, rope, docs=docs)
        return self.output(self.norm(h))

    def parameter_parts(self) -> dict[str, int]:
        """Parameter counts by what the parameters are (embedding, queries, cmp K/V, MLP, ...), from
        the module structure (a tied output head counts as the embedding)."""
        parts = [("embedding", self.tok_embeddings), ("norms", self.norm)]
        counts: dict[str, int] = {"smear": self.smear.weight.numel()} if self.smear is not None else {}
        if not self.cfg.tie_embeddings:
            parts.append(("output head", self.output))
        for block in self.layers.values():
            parts += _unwrapped(block).parts()
        for name, module in parts:
            counts[name] = counts.get(name, 0) + sum(p.numel() for p in module.parameters())
        return counts

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (forward + backward = 3x forward, 2 FLOPs per multiply-add).

        Weight matmuls count every parameter but the embedding lookup (the tied head is a matmul);
        the compression MLPs run once per cmp block, i.e. every d tokens. Attention counts QK^T and
        PV over the keys a query really attends to: (t + 1) on average for dense causal attention,
        cmp blocks + selected keys + window for NSA (`NSASpec.mean_keys_per_query`).
        """
        n_matmul = sum(p.numel() for p in self.parameters()) - self.tok_embeddings.weight.numel()
        if self.cfg.tie_embeddings:
            n_matmul += self.output.weight.numel()
        n_cmp = sum(p.numel() for m in self.modules() if isinstance(m, Compressor) for p in m.parameters())
        attention = _unwrapped(next(iter(self.layers.values()))).attention
        keys = attention.spec.mean_keys_per_query(seq_len) if isinstance(attention, NSAAttention) else (seq_len + 1) / 2
        attn = self.cfg.n_layers * 4 * self.cfg.n_heads * self.cfg.head_dim * keys
        d = attention.spec.d if isinstance(attention, NSAAttention) else 1
        return 3 * (2 * (n_matmul - n_cmp + n_cmp / d) + attn)
    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Initialise every parameter and buffer (after `to_empty`), identically on every rank."""
        if self.cfg.tie_embeddings and self.output.weight is not self.tok_embeddings.weight:
            self.output.weight = self.tok_embeddings.weight  # plain `to_empty` unties them
        gen = torch.Generator().manual_seed(seed)
        self.rope.copy_(rope_tables(self.cfg, self.max_seq_len, self.rope.device))
        std, out_std = 0.02, 0.02 / math.sqrt(2 * self.cfg.n_layers)
        _init_trunc_normal(self.tok_embeddings.weight, std if self.cfg.tie_embeddings else 1.0, gen)
        if self.smear is not None:
            # A random map (about norm-preserving), not the identity: "my token" and "the token
            # before" then sit in different directions, so one attention layer can look up "the
            # position after an earlier occurrence of me" without also matching the occurrence itself.
            _init_trunc_normal(self.smear.weight, self.cfg.dim**-0.5, gen)
        for block in self.layers.values():
            block.init_weights(std, out_std, gen)
        self.norm.reset_parameters()
        if not self.cfg.tie_embeddings:
            _init_trunc_normal(self.output.weight, self.cfg.dim**-0.5, gen)
