"""Rotary position embedding (RoPE) with a registry of scaling types.

Shapes (batch-first, see DESIGN.md):
    position_ids  [B, S]            int64 absolute positions (CP-split positions are fine: any values)
    cos, sin      [B, S, head_dim]  always float32
    q, k          [B, heads, S, head_dim]

Formula (Su et al. 2021, "RoFormer", arXiv:2104.09864; layout of HF transformers
``modeling_llama.py``): ``inv_freq[i] = 1 / theta ** (2i / head_dim)``, ``freqs = pos * inv_freq``,
``emb = cat(freqs, freqs)``, and ``x' = x * cos(emb) + rotate_half(x) * sin(emb)`` where
``rotate_half([x1, x2]) = [-x2, x1]`` (the "half split", not interleaved pairs).

Scaling types are functions ``RopeSpec -> (inv_freq [head_dim/2] fp32, attention_scaling)`` registered
in :data:`ROPE_INV_FREQ_FNS`. Supported now: ``default``, ``linear``, ``llama3``. To add ``dynamic``,
``yarn`` or ``longrope`` (reference: transformers ``modeling_rope_utils.py``), write one function and
register it; ``attention_scaling`` (yarn/longrope's mscale) is already applied to cos/sin.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = [
    "ROPE_INV_FREQ_FNS",
    "RopeSpec",
    "RotaryEmbedding",
    "apply_rotary_pos_emb",
    "rope_spec_from_config",
    "rotate_half",
]


@dataclass(frozen=True)
class RopeSpec:
    """Everything RoPE needs from a model config, independent of the transformers version.

    Attributes:
        head_dim: per-head size D (even).
        rope_theta: base wavelength theta.
        rope_type: one of :data:`ROPE_INV_FREQ_FNS`' keys.
        max_position_embeddings: the model's (possibly extended) maximum length.
        params: the remaining scaling fields of ``rope_scaling`` / ``rope_parameters``
            (e.g. ``factor``, ``low_freq_factor``), without ``rope_type`` / ``rope_theta``.
    """

    head_dim: int
    rope_theta: float
    rope_type: str = "default"
    max_position_embeddings: int = 2048
    params: Mapping[str, Any] = field(default_factory=dict)

    def require(self, key: str) -> Any:
        """Return ``params[key]``; raise ValueError naming the key when it is missing."""
        if key not in self.params or self.params[key] is None:
            raise ValueError(
                f"rope_scaling.rope_type={self.rope_type} requires rope_scaling.{key} in the model "
                f"config.json; add it (see transformers modeling_rope_utils.py for its meaning)"
            )
        return self.params[key]


def _base_inv_freq(spec: RopeSpec) -> torch.Tensor:
    """``1 / theta ** (arange(0, D, 2) / D)`` as fp32 [D/2] (RoFormer eq. 15)."""
    exponent = torch.arange(0, spec.head_dim, 2, dtype=torch.int64).to(torch.float32) / spec.head_dim
    return 1.0 / (spec.rope_theta**exponent)


def _default_inv_freq(spec: RopeSpec) -> tuple[torch.Tensor, float]:
    """Unscaled RoPE: returns (inv_freq [D/2] fp32, attention_scaling=1.0)."""
    return _base_inv_freq(spec), 1.0


def _linear_inv_freq(spec: RopeSpec) -> tuple[torch.Tensor, float]:
    """Position interpolation (Chen et al. 2023, arXiv:2306.15595): inv_freq / factor."""
    factor = float(spec.require("factor"))
    if factor <= 0:
        raise ValueError(f"rope_scaling.factor must be > 0 for rope_type=linear, got {factor}")
    return _base_inv_freq(spec) / factor, 1.0


def _llama3_inv_freq(spec: RopeSpec) -> tuple[torch.Tensor, float]:
    """Llama 3.1 frequency-dependent scaling (Meta's reference ``apply_scaling``; HF ``_compute_llama3_parameters``).

    Wavelengths shorter than ``orig/high_freq_factor`` are kept, longer than ``orig/low_freq_factor``
    are divided by ``factor``, and those in between are blended with
    ``s = (orig / wavelen - low) / (high - low)``: ``(1 - s) * f / factor + s * f``.
    """
    factor = float(spec.require("factor"))
    low = float(spec.require("low_freq_factor"))
    high = float(spec.require("high_freq_factor"))
    orig = float(spec.require("original_max_position_embeddings"))
    if high <= low:
        raise ValueError(f"rope_scaling.high_freq_factor ({high}) must exceed low_freq_factor ({low})")
    inv_freq = _base_inv_freq(spec)
    wavelen = 2 * math.pi / inv_freq
    low_freq_wavelen, high_freq_wavelen = orig / low, orig / high
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (orig / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled), 1.0


ROPE_INV_FREQ_FNS: dict[str, Callable[[RopeSpec], tuple[torch.Tensor, float]]] = {
    "default": _default_inv_freq,
    "linear": _linear_inv_freq,
    "llama3": _llama3_inv_freq,
}


def _raw_rope_dict(config: Any) -> dict[str, Any]:
    """Merge transformers 5.x ``rope_parameters`` or 4.x ``rope_theta`` + ``rope_scaling`` into one dict."""
    params = getattr(config, "rope_parameters", None)
    if params is None:  # transformers 4.x
        params = dict(getattr(config, "rope_scaling", None) or {})
        if getattr(config, "rope_theta", None) is not None:
            params.setdefault("rope_theta", config.rope_theta)
    params = dict(params)
    if any(isinstance(v, Mapping) for v in params.values()):
        raise ValueError("not supported yet: per-layer-type rope_parameters (nested dict) in the model config")
    return params


def rope_spec_from_config(config: Any) -> RopeSpec:
    """Build a :class:`RopeSpec` from an HF ``LlamaConfig`` (transformers 4.45+ or 5.x).

    Raises:
        ValueError: ``not supported yet: rope_scaling.rope_type=<x>`` for a type without an entry in
            :data:`ROPE_INV_FREQ_FNS`; for ``partial_rotary_factor`` != 1; for an odd head_dim.
    """
    raw = _raw_rope_dict(config)
    rope_type = raw.pop("rope_type", None) or raw.pop("type", None) or "default"
    raw.pop("type", None)
    if rope_type not in ROPE_INV_FREQ_FNS:
        raise ValueError(
            f"not supported yet: rope_scaling.rope_type={rope_type} (supported: {sorted(ROPE_INV_FREQ_FNS)})"
        )
    theta = raw.pop("rope_theta", None)
    if theta is None:
        theta = 10000.0
    partial = raw.pop("partial_rotary_factor", None)
    if partial is not None and float(partial) != 1.0:
        raise ValueError(f"not supported yet: partial_rotary_factor={partial} (Llama rotates the whole head)")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if head_dim % 2:
        raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
    return RopeSpec(
        head_dim=int(head_dim), rope_theta=float(theta), rope_type=rope_type,
        max_position_embeddings=int(config.max_position_embeddings), params=raw,
    )


class RotaryEmbedding(nn.Module):
    """Computes fp32 ``cos, sin`` [B, S, D] for ``position_ids`` [B, S].

    ``inv_freq`` is a non-persistent buffer (not in state dicts), computed once at construction on
    CPU in fp32 and moved with the module.
    """

    def __init__(self, spec: RopeSpec) -> None:
        super().__init__()
        self.spec = spec
        inv_freq, attention_scaling = ROPE_INV_FREQ_FNS[spec.rope_type](spec)
        self.attention_scaling = float(attention_scaling)
        self.register_buffer("inv_freq", inv_freq.to(torch.float32), persistent=False)

    @torch.no_grad()
    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """position_ids [B, S] -> (cos, sin), each [B, S, D] float32 (no gradient)."""
        if position_ids.dim() != 2:
            raise ValueError(f"position_ids must be [B, S], got shape {tuple(position_ids.shape)}")
        inv_freq = self.inv_freq.to(device=position_ids.device, dtype=torch.float32)
        freqs = position_ids.to(torch.float32)[..., None] * inv_freq  # [B, S, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling

    def extra_repr(self) -> str:
        return f"rope_type={self.spec.rope_type}, theta={self.spec.rope_theta}, head_dim={self.spec.head_dim}"


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[..., D] -> [..., D]: ``[x1, x2] -> [-x2, x1]`` with x1, x2 the two halves of the last dim."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [B, Hq, S, D] and k [B, Hkv, S, D] by fp32 cos/sin [B, S, D].

    The rotation is computed in float32 and the result cast back to q's / k's dtype.
    """
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    q32, k32 = q.float(), k.float()
    q_out = q32 * cos + rotate_half(q32) * sin
    k_out = k32 * cos + rotate_half(k32) * sin
    return q_out.to(q.dtype), k_out.to(k.dtype)
