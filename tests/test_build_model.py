"""train.build_model: a YaRN ``hf_config_overrides`` at seq_length <= original_max_position_embeddings is a no-op
and dropped (with a warning), including a ${div:...} factor below 1; above the original length YaRN is applied. A
config.json's own rope_scaling is always applied (transformers applies it at every length)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from omegaconf import OmegaConf
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from nxd_lc.app.build import build_model
from nxd_lc.app.validation import load_config
from nxd_lc.config.access import seq_length
from nxd_lc.config.resolvers import register_resolvers

pytestmark = pytest.mark.compat  # torch-2.9 compatibility subset (lane 2; docs/testing.md)


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
    assert "the yarn override is a no-op" in caplog.text and "is dropped" in caplog.text


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


def _config_json(tmp_path: Path, rope_scaling: dict[str, Any] | None) -> str:
    raw = json.loads(Path("conf/tiny_llama_config.json").read_text())
    raw.update(max_position_embeddings=8192, rope_scaling=rope_scaling)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    return str(path)


def _plain_cfg(model_config: str, seq: int, **model: Any):
    return load_config({"trainer": {"devices": 1}, "data": {"builtin_corpus": "python_stdlib"},
                        "model": {"model_config": model_config, "encoder_seq_length": seq, **model}})


OWN_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048}


@pytest.mark.parametrize("seq", [1024, 8192])
def test_checkpoint_own_yarn_is_applied_at_every_length(tmp_path: Path, seq: int, caplog) -> None:
    cfg = _plain_cfg(_config_json(tmp_path, OWN_YARN), seq)
    with caplog.at_level(logging.WARNING, logger="nxd_lc"):
        hf_config, model = build_model(cfg)
    reference = LlamaRotaryEmbedding(config=hf_config)  # what transformers runs for this pretrained model
    assert model.rotary_emb.spec.rope_type == "yarn"
    torch.testing.assert_close(model.rotary_emb.inv_freq, reference.inv_freq, rtol=1e-6, atol=0)
    ids = torch.arange(seq).unsqueeze(0)
    cos, sin = model.rotary_emb(ids)
    ref_cos, ref_sin = reference(torch.zeros(1, seq, 1), ids)  # cos/sin include YaRN's attention factor
    torch.testing.assert_close(cos, ref_cos.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sin, ref_sin.float(), rtol=1e-5, atol=1e-5)
    assert ("yarn is a no-op" in caplog.text) == (seq <= 2048)  # warned, not removed
    assert "is dropped" not in caplog.text


def test_override_drop_keeps_the_checkpoint_own_scaling(tmp_path: Path) -> None:
    """A short-length YaRN override over a config.json with its own llama3 scaling: the override goes, the
    checkpoint's llama3 scaling stays (not unscaled RoPE)."""
    own = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 1024}
    override = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0, "original_max_position_embeddings": 4096,
                "truncate": True, "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.0}
    cfg = _plain_cfg(_config_json(tmp_path, own), 2048, hf_config_overrides={"rope_scaling": override})
    hf_config, model = build_model(cfg)
    assert model.rotary_emb.spec.rope_type == "llama3" and float(model.rotary_emb.spec.params["factor"]) == 8.0
    torch.testing.assert_close(model.rotary_emb.inv_freq, LlamaRotaryEmbedding(config=hf_config).inv_freq,
                               rtol=1e-6, atol=0)
