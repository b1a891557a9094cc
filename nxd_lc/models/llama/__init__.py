"""Llama decoder built from tensor-parallel layers, and its HF state-dict adapter."""

from nxd_lc.models.llama.hf_adapter import export_hf_state_dict, load_hf_weights, save_hf_weights
from nxd_lc.models.llama.model import LlamaForCausalLM, pad_vocab_size

__all__ = [
    "LlamaForCausalLM",
    "export_hf_state_dict",
    "load_hf_weights",
    "pad_vocab_size",
    "save_hf_weights",
]
