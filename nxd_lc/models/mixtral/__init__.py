"""Mixtral (sparse mixture-of-experts Llama): :class:`MixtralForCausalLM`."""

from nxd_lc.models.mixtral.model import MixtralForCausalLM

__all__ = ["MixtralForCausalLM"]
