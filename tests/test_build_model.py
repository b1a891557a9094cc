"""train.build_model: YaRN at seq_length <= original_max_position_embeddings is a no-op (unscaled RoPE + a
warning), including a ${div:...} factor below 1; above the original length YaRN is applied."""

from __future__ import annotations

import logging

import pytest
from omegaconf import OmegaConf

from nxd_lc.config.resolvers import register_resolvers
from nxd_lc.config.validate import load_config, seq_length
from nxd_lc.train import build_model


def _yarn_cfg(seq: int):
    register_resolvers()
    raw = OmegaConf.load("conf/cpu_tiny_llama_yarn_config.yaml")
    raw.trainer.devices = 1
    raw.distributed_strategy.context_parallel_size = 1
    raw.model.encoder_seq_length = seq
    raw.model.hf_weights_dir = None  # the converted demo checkpoint is not part of a clean checkout
    if "seq_length" in raw.data:
        raw.data.seq_length = seq
    return load_config(raw)


@pytest.mark.parametrize("seq", [1024, 2048])
def test_yarn_below_original_length_is_unscaled_with_warning(seq: int, caplog) -> None:
    cfg = _yarn_cfg(seq)
    with caplog.at_level(logging.WARNING, logger="nxd_lc.train"):
        _, model = build_model(cfg)
    assert model.rotary_emb.spec.rope_type == "default"
    assert "yarn is a no-op" in caplog.text


def test_yarn_above_original_length_is_applied() -> None:
    _, model = build_model(_yarn_cfg(8192))
    spec = model.rotary_emb.spec
    assert spec.rope_type == "yarn" and float(spec.params["factor"]) == 4.0


def test_shorter_training_data_keeps_the_model_length_rope() -> None:
    """data.seq_length < model.encoder_seq_length (NxDT's SFT layout): RoPE is judged at the model's length, so a
    YaRN override beyond the original context stays applied although the training sequences are shorter."""
    register_resolvers()
    raw = OmegaConf.load("conf/cpu_tiny_llama_yarn_config.yaml")
    raw.trainer.devices, raw.distributed_strategy.context_parallel_size = 1, 1
    raw.model.hf_weights_dir = None
    raw.model.encoder_seq_length = 8192
    raw.data.seq_length = 1024  # <= original_max_position_embeddings 2048
    raw.model.hf_config_overrides.rope_scaling.factor = 4.0
    cfg = load_config(raw)
    assert seq_length(cfg) == 1024
    _, model = build_model(cfg)
    spec = model.rotary_emb.spec
    assert spec.rope_type == "yarn" and float(spec.params["factor"]) == 4.0
