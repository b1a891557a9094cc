"""Precision modes (:mod:`~nxd_lc.precision.policy`) and software stochastic rounding fp32 -> bf16."""

from nxd_lc.precision.policy import PrecisionPolicy, apply_precision, reduce_dtype, resolve_precision
from nxd_lc.precision.stochastic_rounding import sr_add_, stochastic_round_to_bf16

__all__ = ["PrecisionPolicy", "apply_precision", "reduce_dtype", "resolve_precision", "sr_add_",
           "stochastic_round_to_bf16"]
