"""LoRA's canonical place ``model_alignment_strategy.peft`` (``model.peft`` read as it), and the end-of-run adapter
files of :mod:`nxd_lc.alignment.lora_files` (NxD's ``merge_sharded_lora`` / ``save_lora_config_adapter``)."""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import pytest
import torch
from dist_utils import run_distributed
from transformers import LlamaConfig

from nxd_lc.alignment.lora_files import load_adapters, save_adapters
from nxd_lc.app.build import build_model
from nxd_lc.app.validation import load_config
from nxd_lc.config.access import peft_config
from nxd_lc.config.errors import ConfigError
from nxd_lc.config.peft_schema import PeftConfig
from nxd_lc.distributed import parallel_state
from nxd_lc.layers.lora import apply_lora, lora_modules, lora_state_dict
from nxd_lc.lightning.trainer import _backend_kwargs
from nxd_lc.models.llama.model import LlamaForCausalLM
from nxd_lc.runtime.device import RuntimeInfo

pytestmark = pytest.mark.compat  # torch-2.9 compatibility subset (lane 2; docs/testing.md)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_JSON = os.path.join(REPO, "conf", "tiny_llama_config.json")
LORA = {"lora_rank": 4, "lora_alpha": 8, "target_modules": ["qkv_proj", "down_proj"], "save_lora_base": False}


def _raw(**top: Any) -> dict[str, Any]:
    raw: dict[str, Any] = {"trainer": {"devices": 1}, "data": {"train_dir": "records.jsonl"},
                           "model": {"model_config": TINY_JSON, "encoder_seq_length": 64}}
    for key, value in top.items():
        raw[key] = {**raw.get(key, {}), **value}
    return raw


# ---- the canonical place and the old one --------------------------------------------------------------------

def test_canonical_place_builds_lora_and_sets_adapter_only_checkpoints() -> None:
    cfg = load_config(_raw(model_alignment_strategy={"sft": {}, "peft": LORA}))
    peft = peft_config(cfg)
    assert peft is cfg.model_alignment_strategy.peft and peft.lora_rank == 4 and peft.lora_alpha == 8
    _, model = build_model(cfg)
    assert sorted({n.rsplit(".", 1)[-1] for n in lora_modules(model)}) == ["down_proj", "qkv_proj"]
    assert {n.rsplit(".", 1)[-1] for n, p in model.named_parameters() if p.requires_grad} == {"lora_A", "lora_B"}
    runtime = RuntimeInfo("cpu", torch.device("cpu"), "gloo", 0, 0, 1)
    assert _backend_kwargs(cfg, runtime)["strategy"].lora_only  # save_lora_base: false, read at the new place
    full = load_config(_raw(model_alignment_strategy={"sft": {}}))
    assert peft_config(full) is None and not _backend_kwargs(full, runtime)["strategy"].lora_only


def test_build_model_logs_verbose_and_loads_saved_adapters(tmp_path: Any, caplog: Any) -> None:
    first = load_config(_raw(model_alignment_strategy={"sft": {}, "peft": {**LORA, "lora_verbose": True}}))
    with caplog.at_level(logging.INFO, logger="nxd_lc"):
        _, model = build_model(first)
    assert "LoRA adapters on: layers.0.self_attn.qkv_proj, layers.0.mlp.down_proj, layers.1" in caplog.text
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.normal_()
    path = save_adapters(model, peft_config(first), str(tmp_path / "lora"), is_rank0=True)
    again = {**LORA, "load_lora_from_ckpt": True, "lora_ckpt_path": path}
    _, loaded = build_model(load_config(_raw(model_alignment_strategy={"sft": {}, "peft": again})))
    for key, value in lora_state_dict(model).items():
        assert torch.equal(lora_state_dict(loaded)[key], value), key


def test_model_peft_is_read_as_the_canonical_key(caplog: Any) -> None:
    with caplog.at_level(logging.INFO, logger="nxd_lc"):
        cfg = load_config(_raw(model={"peft": LORA}, model_alignment_strategy={"sft": {}}))
    assert peft_config(cfg).target_modules == ["qkv_proj", "down_proj"]
    assert "'model.peft' is read as 'model_alignment_strategy.peft'" in caplog.text
    # an explicit null at the old place is "no LoRA", and does not turn a pretraining run into an alignment one
    pretrain = load_config({**_raw(model={"peft": None}), "data": {}})
    assert pretrain.model_alignment_strategy is None and peft_config(pretrain) is None


def test_both_places_is_one_error_naming_both() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(_raw(model={"peft": LORA}, model_alignment_strategy={"sft": {}, "peft": LORA}))
    assert info.value.problems == ["model.peft: also given as 'model_alignment_strategy.peft' (its canonical "
                                   "place); give only one of them"]


def test_lora_without_an_alignment_algorithm_is_an_error() -> None:
    with pytest.raises(ConfigError, match=r"model_alignment_strategy\.peft: LoRA trains with an alignment "
                                          r"algorithm; set one of sft, dpo, orpo"):
        load_config(_raw(model={"peft": LORA}))


def test_nxd_lora_keys_are_typed() -> None:
    nxd = {**LORA, "lora_verbose": True, "save_lora_config_adapter": False, "merge_sharded_lora": False}
    peft = peft_config(load_config(_raw(model_alignment_strategy={"sft": {}, "peft": nxd})))
    assert (peft.lora_verbose, peft.save_lora_config_adapter, peft.merge_sharded_lora) == (True, False, False)
    with pytest.raises(ConfigError, match=r"model_alignment_strategy\.peft\.merge_sharded_lora: invalid value"):
        load_config(_raw(model_alignment_strategy={"sft": {}, "peft": {"merge_sharded_lora": "sometimes"}}))


# ---- adapter files ------------------------------------------------------------------------------------------

def _config() -> LlamaConfig:
    return LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


def _lora_model(peft: PeftConfig, seed: int) -> LlamaForCausalLM:
    torch.manual_seed(0)  # the same base weights every time
    model = LlamaForCausalLM(_config())
    torch.manual_seed(seed)
    apply_lora(model, peft)
    with torch.no_grad():  # B starts at zero: give it values so that a round trip shows
        for p in model.parameters():
            if p.requires_grad:
                p.normal_()
    return model


def _peft(**kw: Any) -> PeftConfig:
    return PeftConfig(lora_rank=4, lora_alpha=8.0, lora_dropout=0.1, target_modules=["qkv_proj", "down_proj"], **kw)


@pytest.mark.parametrize("with_config", [True, False])
def test_merged_adapter_file_round_trip_and_settings(tmp_path: Any, with_config: bool) -> None:
    peft = _peft(save_lora_config_adapter=with_config)
    source = _lora_model(peft, seed=1)
    path = save_adapters(source, peft, str(tmp_path / "lora"), is_rank0=True)
    assert path == str(tmp_path / "lora" / "adapters.pt")
    saved = torch.load(path, weights_only=True)
    expected_settings = {"lora_rank": 4, "lora_alpha": 8.0, "target_modules": ["down_proj", "qkv_proj"],
                         "lora_dropout": 0.1, "lora_bias": "none"}
    if with_config:
        assert saved.pop("lora_config") == expected_settings
        assert not (tmp_path / "lora" / "adapter_config.json").exists()
    else:
        assert "lora_config" not in saved
        assert json.loads((tmp_path / "lora" / "adapter_config.json").read_text()) == expected_settings
    assert set(saved) == set(lora_state_dict(source))
    target = _lora_model(peft, seed=2)
    load_adapters(target, peft, path)
    for key, value in lora_state_dict(source, full=True).items():
        assert torch.equal(lora_state_dict(target, full=True)[key], value), key
    other = _peft(save_lora_config_adapter=with_config)
    other.lora_alpha = 16.0  # same shapes, different scale: only the saved settings can catch it
    with pytest.raises(ValueError, match=r"model_alignment_strategy\.peft\.lora_alpha: 16\.0 but the adapters in "
                                         r".* were trained with 8\.0"):
        load_adapters(_lora_model(other, seed=2), other, path)


def _sharded_worker(rank: int, world_size: int, out_dir: str) -> None:
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    peft = _peft(merge_sharded_lora=False)
    source = _lora_model(peft, seed=1)
    assert save_adapters(source, peft, out_dir, is_rank0=rank == 0) == out_dir
    torch.distributed.barrier()
    assert sorted(os.listdir(out_dir)) == ["adapters_tp_rank_00_pp_rank_00.pt", "adapters_tp_rank_01_pp_rank_00.pt"]
    mine = torch.load(os.path.join(out_dir, f"adapters_tp_rank_{rank:02d}_pp_rank_00.pt"), weights_only=True)
    mine.pop("lora_config")
    for key, value in lora_state_dict(source).items():  # this rank's shard, not the gathered tensor
        assert torch.equal(mine[key], value), key
    target = _lora_model(peft, seed=2)
    load_adapters(target, peft, out_dir)
    for key, value in lora_state_dict(source, full=True).items():
        assert torch.equal(lora_state_dict(target, full=True)[key], value), key


@pytest.mark.distributed
def test_sharded_adapter_files_at_tp2(tmp_path: Any) -> None:
    run_distributed(_sharded_worker, 2, str(tmp_path / "lora"))
