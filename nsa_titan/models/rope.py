"""Rotary position embeddings (RoPE), plain or stretched past the pretraining length.

`[model] rope_scaling`: `linear` divides every frequency by the factor s (position interpolation);
`yarn` (arXiv 2309.00071) divides only the slow ones: a dimension that turns fewer than
`beta_slow` times over the original length L is interpolated, one that turns more than
`beta_fast` times is kept, a linear ramp between; cos and sin are then multiplied by the
attention factor (0.1 ln s + 1 unless set), which sharpens the softmax as the context grows.
The tables equal transformers' `rope_type` "linear" and "yarn" (`truncate` true) for the same
settings, and `hf_rope_parameters` / `rope_settings` translate between the two namings.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from ..config import ConfigError, Model as ModelConfig

SCALED = ("rope_scaling", "rope_factor", "rope_original_seq_len", "rope_beta_fast", "rope_beta_slow",
          "rope_attention_factor")
"""The `[model]` keys of a scaling (rope_theta is the table's base, shared by every scaling)."""


def attention_factor(m: ModelConfig) -> float:
    """The factor YaRN multiplies cos and sin by: rope_attention_factor, else 0.1 ln s + 1 (1 below s = 1)."""
    if m.rope_attention_factor:
        return m.rope_attention_factor
    return 0.1 * math.log(m.rope_factor) + 1.0 if m.rope_factor > 1 else 1.0


def inverse_frequencies(m: ModelConfig, device: torch.device | None = None) -> torch.Tensor:
    """(head_dim / 2,) float32: the angle per position of each rotated pair of dimensions."""
    D = m.head_dim
    powers = m.rope_theta ** (torch.arange(0, D, 2, device=device, dtype=torch.float32) / D)
    if m.rope_scaling == "none":
        return 1.0 / powers
    if m.rope_scaling == "linear":
        return 1.0 / powers / m.rope_factor

    def dim_of(turns: float) -> float:  # the dimension that turns `turns` times over the original length
        return D * math.log(m.rope_original_seq_len / (turns * 2 * math.pi)) / (2 * math.log(m.rope_theta))

    low, high = max(math.floor(dim_of(m.rope_beta_fast)), 0), min(math.ceil(dim_of(m.rope_beta_slow)), D - 1)
    ramp = ((torch.arange(D // 2, device=device, dtype=torch.float32) - low) / ((high - low) or 1e-3)).clamp(0, 1)
    keep = 1 - ramp  # 1: the fast frequencies, kept; 0: the slow ones, divided by s
    return 1.0 / (m.rope_factor * powers) * (1 - keep) + 1.0 / powers * keep


def rope_tables(m: ModelConfig, seq_len: int, device: torch.device | None = None) -> torch.Tensor:
    """(seq_len, head_dim) float32: cos in the first half, sin in the second, for model config `m`."""
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inverse_frequencies(m, device))
    scale = attention_factor(m) if m.rope_scaling == "yarn" else 1.0
    return torch.cat([angles.cos(), angles.sin()], dim=-1) * scale


def apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotate (x1, x2) halves of the last dim of x (B, T, N, D) by position: `rope` is the table
    from position 0 (>= T rows) or each token's own row (B, T, head_dim)."""
    T, D = x.shape[1], x.shape[-1]
    rope = rope[:T, None] if rope.dim() == 2 else rope[:, :, None]
    cos, sin = rope[..., : D // 2], rope[..., D // 2 :]
    x1, x2 = x.to(torch.promote_types(x.dtype, torch.float32)).chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)


def hf_rope_parameters(m: ModelConfig) -> dict[str, Any]:
    """transformers' `rope_parameters` (config.json) of model config `m`."""
    params: dict[str, Any] = {"rope_type": "default" if m.rope_scaling == "none" else m.rope_scaling,
                              "rope_theta": m.rope_theta}
    if m.rope_scaling != "none":
        params.update(factor=m.rope_factor, original_max_position_embeddings=m.rope_original_seq_len)
    if m.rope_scaling == "yarn":
        params.update(beta_fast=m.rope_beta_fast, beta_slow=m.rope_beta_slow, attention_factor=attention_factor(m),
                      truncate=True)
    return params


def rope_settings(config: dict[str, Any]) -> dict[str, Any]:
    """The `[model]` RoPE keys of a config.json (`rope_parameters`, or an older export's top-level `rope_theta`)."""
    params = config.get("rope_parameters") or {"rope_theta": config.get("rope_theta", ModelConfig.rope_theta)}
    kind = params.get("rope_type", "default")
    settings = {"rope_theta": params.get("rope_theta", ModelConfig.rope_theta),
                "rope_scaling": "none" if kind == "default" else kind}
    if kind != "default":
        settings.update(rope_factor=params.get("factor", 1.0),
                        rope_original_seq_len=params.get("original_max_position_embeddings", 0))
    if kind == "yarn":
        settings.update(rope_beta_fast=params.get("beta_fast", ModelConfig.rope_beta_fast),
                        rope_beta_slow=params.get("beta_slow", ModelConfig.rope_beta_slow),
                        rope_attention_factor=params.get("attention_factor", 0.0))
    return settings


def rope_of(settings: Mapping[str, Any]) -> ModelConfig:
    """A model config with just the RoPE keys of `settings` (`[model]` names; the others at their defaults)."""
    return ModelConfig(**{k: settings[k] for k in ("rope_theta", *SCALED) if k in settings})


def describe(m: ModelConfig) -> str:
    """One phrase for a model's RoPE: 'none', or e.g. 'yarn x4 from 1,024'."""
    return "none" if m.rope_scaling == "none" else \
        f"{m.rope_scaling} x{m.rope_factor:g} from {m.rope_original_seq_len:,}"


def check_source(source: Mapping[str, Any], source_len: int, m: ModelConfig, path: str) -> None:
    """A ConfigError unless a model trained with RoPE settings `source` at `source_len` tokens can start a
    run of model config `m`: the same RoPE, or an unscaled one that `m` scales from its training length."""
    ours, theirs = hf_rope_parameters(m), hf_rope_parameters(rope_of(source))
    if ours == theirs:
        return
    if theirs["rope_theta"] != ours["rope_theta"]:
        raise ConfigError(f"[model] rope_theta = {m.rope_theta:g}, but {path} was trained with rope_theta = "
                          f"{theirs['rope_theta']:g}: a scaling stretches the source's RoPE, it cannot change its base; "
                          f"set rope_theta = {theirs['rope_theta']:g}")
    if theirs["rope_type"] != "default":
        raise ConfigError(f"[model] rope_scaling: {path} was trained with RoPE {describe(rope_of(source))}, and this run "
                          f"asks for {describe(m)}: continue with the source's settings (its config's rope_* keys), "
                          f"or adapt from the unscaled model it came from")
    if m.rope_original_seq_len != source_len:
        raise ConfigError(f"[model] rope_original_seq_len = {m.rope_original_seq_len}, but {path} was trained at "
                          f"seq_len {source_len:,}: the scaling starts from the source's length; set "
                          f"rope_original_seq_len = {source_len}")
