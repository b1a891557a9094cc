"""Mixtral (sparse mixture-of-experts Llama): :class:`MixtralForCausalLM`."""

from nxd_lc.models.mixtral.model import MixtralForCausalLM, MoEOptions

__all__ = ["MixtralForCausalLM", "MoEOptions"]
