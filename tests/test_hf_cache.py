"""The HF -> NxD conversion cache (nxd_lc.models.llama.hf_cache): cached loads equal uncached ones, the key follows
what shapes the converted tensors, damaged entries and force_reconvert_from_hf rebuild it."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from omegaconf import OmegaConf
from transformers import LlamaConfig
from transformers import LlamaForCausalLM as HFLlama

from nxd_lc.app.build import build_model
from nxd_lc.app.validation import load_config
from nxd_lc.config.resolvers import register_resolvers
from nxd_lc.models.llama import hf_cache
from tests.dist_utils import run_distributed

pytestmark = pytest.mark.compat  # torch-2.9 compatibility subset (lane 2; docs/testing.md)

MODEL = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 97, "hidden_size": 32,
         "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu",
         "tie_word_embeddings": True}


def _hf_dir(tmp: Path) -> Path:
    torch.manual_seed(5)
    HFLlama(LlamaConfig(**MODEL)).save_pretrained(str(tmp / "hf"))
    return tmp / "hf"


def _cfg(tmp: Path, tp: int = 1, **model: Any) -> Any:
    register_resolvers()
    raw = OmegaConf.load("conf/cpu_tiny_llama_config.yaml")
    raw.trainer.devices = tp
    raw.distributed_strategy.tensor_model_parallel_size = tp
    raw.distributed_strategy.sequence_parallel = False
    raw.exp_manager.explicit_log_dir = str(tmp / "run")
    raw.exp_manager.checkpoint_callback_params.model_parallel_size = tp
    raw.model.model_config = str(tmp / "hf" / "config.json")
    raw.model.encoder_seq_length = 32
    raw.model.hf_weights_dir = str(tmp / "hf")
    for k, v in model.items():
        raw.model[k] = v
    return load_config(raw, check_paths=False)


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _entries(tmp: Path) -> list[Path]:
    return sorted((tmp / "run" / "hf_converted").glob("*/*.safetensors"))


def test_cached_load_equals_uncached_and_rebuilds_when_damaged(tmp_path: Path, caplog: Any) -> None:
    _hf_dir(tmp_path)
    _, plain = build_model(_cfg(tmp_path, hf_conversion_cache=False))
    reference = _params(plain)
    assert not _entries(tmp_path)
    caplog.set_level(logging.INFO, logger="nxd_lc.models.llama.hf_cache")
    _, first = build_model(_cfg(tmp_path, hf_conversion_cache=True))  # converts and writes the entry
    (entry,) = _entries(tmp_path)
    _, second = build_model(_cfg(tmp_path, hf_conversion_cache=True))  # loads it
    assert "loaded the converted HF weights from the cache" in caplog.text
    for model in (first, second):
        got = _params(model)
        assert sorted(got) == sorted(reference)
        assert all(torch.equal(got[k], reference[k]) for k in reference)
    assert second.lm_head.weight is second.embed_tokens.weight  # tied weights stay tied
    # a truncated entry is rebuilt, not loaded
    os.truncate(entry, os.path.getsize(entry) // 2)
    caplog.clear()
    _, third = build_model(_cfg(tmp_path, hf_conversion_cache=True))
    assert "is damaged" in caplog.text and all(torch.equal(_params(third)[k], reference[k]) for k in reference)
    # force_reconvert_from_hf rebuilds a valid entry
    before = os.stat(entry).st_mtime_ns
    caplog.clear()
    build_model(_cfg(tmp_path, hf_conversion_cache=True, force_reconvert_from_hf=True))
    assert "cached the converted HF weights" in caplog.text and os.stat(entry).st_mtime_ns != before


def test_key_follows_files_overrides_and_layout(tmp_path: Path) -> None:
    hf = _hf_dir(tmp_path)
    cfg = _cfg(tmp_path)
    key = hf_cache.cache_key(cfg, str(hf), 1, 1)
    assert hf_cache.cache_key(_cfg(tmp_path), str(hf), 1, 1) == key  # deterministic
    assert hf_cache.cache_key(cfg, str(hf), 2, 1) != key and hf_cache.cache_key(cfg, str(hf), 1, 2) != key
    assert hf_cache.cache_key(_cfg(tmp_path, fuse_qkv=False), str(hf), 1, 1) != key
    assert hf_cache.cache_key(_cfg(tmp_path, hf_config_overrides={"rms_norm_eps": 1e-6}), str(hf), 1, 1) != key
    st = os.stat(hf / "model.safetensors")
    os.utime(hf / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # replaced in place
    assert hf_cache.cache_key(cfg, str(hf), 1, 1) != key
    conf = json.loads((hf / "config.json").read_text())
    conf["rms_norm_eps"] = 1e-6
    (hf / "config.json").write_text(json.dumps(conf))
    assert hf_cache.cache_key(cfg, str(hf), 1, 1) != key


def _tp2_worker(rank: int, world: int, tmp: str) -> None:
    from nxd_lc.distributed import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    t = Path(tmp)
    _, plain = build_model(_cfg(t, tp=2, hf_conversion_cache=False))
    reference = _params(plain)
    for _ in range(2):  # write, then read the cache
        _, model = build_model(_cfg(t, tp=2, hf_conversion_cache=True))
        got = _params(model)
        assert all(torch.equal(got[k], reference[k]) for k in reference)
    torch.distributed.barrier()  # the cache issues no collective: wait until the other rank has written its entry
    assert len(_entries(t)) == 2  # one file per TP rank
    ps.destroy_model_parallel()


def test_tp2_cached_shards_equal_uncached(tmp_path: Path) -> None:
    _hf_dir(tmp_path)
    run_distributed(_tp2_worker, 2, str(tmp_path))


def _ep2_worker(rank: int, world: int, tmp: str) -> None:
    from transformers import MixtralConfig
    from transformers import MixtralForCausalLM as HFMixtral

    from nxd_lc.distributed import parallel_state as ps

    t = Path(tmp)
    if rank == 0:
        torch.manual_seed(5)
        HFMixtral(MixtralConfig(**{**MODEL, "model_type": "mixtral", "architectures": ["MixtralForCausalLM"],
                                   "num_local_experts": 4, "num_experts_per_tok": 2})).save_pretrained(str(t / "hf"))
    torch.distributed.barrier()
    ps.initialize_model_parallel(expert_model_parallel_size=2)

    def cfg(cache: bool) -> Any:
        c = _cfg(t, hf_conversion_cache=cache)
        c.trainer.devices = 2
        c.distributed_strategy.expert_model_parallel_size = 2
        return c

    _, plain = build_model(cfg(False))
    reference = _params(plain)
    for _ in range(2):  # write, then read the cache
        _, model = build_model(cfg(True))
        got = _params(model)
        assert all(torch.equal(got[k], reference[k]) for k in reference)
    torch.distributed.barrier()
    assert [p.name for p in _entries(t)] == ["ep00_tp00_pp00.safetensors", "ep01_tp00_pp00.safetensors"]
    ps.destroy_model_parallel()


def test_ep2_cache_keeps_each_ranks_experts(tmp_path: Path) -> None:
    """EP ranks of one (TP, PP) position hold different experts: each caches and reads its own entry."""
    run_distributed(_ep2_worker, 2, str(tmp_path))
