"""config.json ``model_type`` -> the transformers config class it is read into (:data:`CONFIG_CLASSES`).

A module of its own so that both the HF reader (:mod:`nxd_lc.models.hf_config`) and the Megatron-key builder
(:mod:`nxd_lc.models.megatron`) use it without importing each other (the config.json reader imports the latter).
"""

from __future__ import annotations

from transformers import LlamaConfig, MistralConfig, MixtralConfig, PretrainedConfig, Qwen2Config, Qwen3Config

__all__ = ["CONFIG_CLASSES"]

#: config.json ``model_type`` -> the transformers config class it is read into (the decoder families of
#: :mod:`nxd_lc.models.common.family`; Mixtral swaps the MLP for mixture-of-experts blocks).
CONFIG_CLASSES: dict[str, type[PretrainedConfig]] = {"llama": LlamaConfig, "mistral": MistralConfig,
                                                     "mixtral": MixtralConfig, "qwen2": Qwen2Config,
                                                     "qwen3": Qwen3Config}
