"""Core (score/softmax/value) attention with a single dispatch point.

Shapes (batch-first heads-major, as in HF transformers and torch SDPA):
    q       [B, Hq, S, D]
    k, v    [B, Hkv, S, D]    Hq % Hkv == 0 (grouped-query attention, Ainslie et al. 2023, arXiv:2305.13245)
    output  [B, Hq, S, D]     same dtype as q

Query head ``h`` attends with KV head ``h // (Hq / Hkv)`` (HF ``repeat_kv`` order); the KV heads are
expanded locally, i.e. on the heads this rank holds, so no communication is involved.

``flash_attention=True`` calls :func:`torch.nn.functional.scaled_dot_product_attention` with
``is_causal=True`` (no S x S mask is built; torch picks a flash / memory-efficient kernel where one
exists). ``flash_attention=False`` is the explicit reference: ``softmax(Q K^T * scale + mask) V``
(Vaswani et al. 2017) with the softmax in float32, as HF's ``eager_attention_forward``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["CoreAttention", "core_attention", "repeat_kv"]


def repeat_kv(x: torch.Tensor, num_rep: int) -> torch.Tensor:
    """[B, Hkv, S, D] -> [B, Hkv * num_rep, S, D], each KV head repeated ``num_rep`` times in place order."""
    if num_rep == 1:
        return x
    b, h, s, d = x.shape
    return x[:, :, None].expand(b, h, num_rep, s, d).reshape(b, h * num_rep, s, d)


def _check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> int:
    """Validate q/k/v shapes; return the GQA group size Hq // Hkv."""
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4:
        raise ValueError(
            f"core_attention expects q [B,Hq,S,D], k and v [B,Hkv,S,D]; got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} disagree on batch, sequence or head_dim")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of KV heads ({k.shape[1]})")
    return q.shape[1] // k.shape[1]


def _eager_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool) -> torch.Tensor:
    """Reference path: materialises the [B, Hq, S, S] scores; fp32 softmax, causal mask of -inf."""
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale
    if causal:
        s = q.shape[2]
        mask = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)


def core_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    flash_attention: bool = True,
    causal: bool = True,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention over q [B,Hq,S,D], k/v [B,Hkv,S,D] -> [B,Hq,S,D].

    Args:
        flash_attention: True -> torch SDPA (fused kernel, no mask tensor); False -> eager reference.
        causal: apply the causal (lower-triangular) mask; position t attends to positions <= t.
        scale: score scale, default ``1 / sqrt(D)``.

    Raises:
        ValueError: on inconsistent shapes or Hq not a multiple of Hkv.
    """
    num_rep = _check_shapes(q, k, v)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    k, v = repeat_kv(k, num_rep), repeat_kv(v, num_rep)
    if flash_attention:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    return _eager_attention(q, k, v, scale, causal)


class CoreAttention(nn.Module):
    """Module wrapper of :func:`core_attention` (no parameters).

    Named after NxDT's ``activations_checkpoint_recompute: [CoreAttention]`` so selective activation
    checkpointing can target it by class name. ``forward(q, k, v) -> [B, Hq, S, D]``.
    """

    def __init__(self, flash_attention: bool = True, causal: bool = True, scale: float | None = None) -> None:
        super().__init__()
        self.flash_attention = flash_attention
        self.causal = causal
        self.scale = scale

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """See :func:`core_attention`."""
        return core_attention(
            q, k, v, flash_attention=self.flash_attention, causal=self.causal, scale=self.scale
        )

    def extra_repr(self) -> str:
        return f"flash_attention={self.flash_attention}, causal={self.causal}"
