"""Model building blocks shared by decoder families: RoPE, the attention module, MLP, norms
(the attention kernels themselves are :mod:`nxd_lc.context`)."""

from nxd_lc.models.common.attention import CoreAttention
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
    "rope_spec_from_config",
]
