"""Model building blocks shared by decoder families: RoPE, core attention, MLP, norms."""

from nxd_lc.models.common.attention import CoreAttention, core_attention
from nxd_lc.models.common.mlp import LlamaMLP
from nxd_lc.models.common.norm import RMSNorm
from nxd_lc.models.common.rope import RopeSpec, RotaryEmbedding, apply_rotary_pos_emb, rope_spec_from_config

__all__ = [
    "CoreAttention",
    "LlamaMLP",
    "RMSNorm",
    "RopeSpec",
    "RotaryEmbedding",
    "apply_rotary_pos_emb",
    "core_attention",
    "rope_spec_from_config",
]
