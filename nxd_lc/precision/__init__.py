"""Precision support: software stochastic rounding fp32 -> bf16 (NxDT ``bf16SR`` semantics)."""

from nxd_lc.precision.stochastic_rounding import sr_add_, stochastic_round_to_bf16

__all__ = ["sr_add_", "stochastic_round_to_bf16"]
