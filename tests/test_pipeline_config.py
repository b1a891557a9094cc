"""Pipeline-parallel config rules (validated before anything is built), each naming its key."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from nxd_lc.app.validation import load_config, unsupported_features
from nxd_lc.config.errors import ConfigError

pytestmark = pytest.mark.compat  # torch-2.9 compatibility subset (lane 2; docs/testing.md)

REPO = Path(__file__).resolve().parents[1]
TINY_JSON = str(REPO / "conf" / "tiny_llama_config.json")  # 4 layers


def _cfg(pp: int = 2, vpp: int = 1, devices: int = 2, gbs: int = 4, **model: Any) -> dict[str, Any]:
    return {"trainer": {"devices": devices, "num_nodes": 1, "max_steps": 10, "accelerator": "cpu"},
            "distributed_strategy": {"pipeline_model_parallel_size": pp,
                                     "virtual_pipeline_model_parallel_size": vpp},
            "data": {"micro_batch_size": 1, "global_batch_size": gbs},
            "model": {"model_config": TINY_JSON, "encoder_seq_length": 64, **model}}


def _problems(raw: dict[str, Any]) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(raw, world_size=None, check_paths=False)
    return info.value.problems


def test_valid_pipeline_configs_load() -> None:
    assert load_config(_cfg(), check_paths=False).distributed_strategy.pipeline_model_parallel_size == 2
    cfg = load_config(_cfg(vpp=2), check_paths=False)  # 4 layers over 4 stages; 4 micro-batches % PP 2 == 0
    assert cfg.distributed_strategy.virtual_pipeline_model_parallel_size == 2
    assert load_config(_cfg(pipeline_cuts=["model.layers.0"]), check_paths=False).model.pipeline_cuts == [
        "model.layers.0"]


def test_interleaving_needs_microbatches_divisible_by_pp() -> None:
    (p,) = _problems(_cfg(vpp=2, gbs=3, devices=2))
    assert p.startswith("data.global_batch_size: interleaved pipeline") and "num_microbatches" in p and "= 3" in p


def test_virtual_pipeline_needs_pp() -> None:
    problems = _problems(_cfg(pp=1, vpp=2, devices=1))
    assert any(p.startswith("distributed_strategy.virtual_pipeline_model_parallel_size: 2 needs") for p in problems)


@pytest.mark.parametrize("cuts,expected", [
    (["model.layers.9"], "names no decoder layer"),
    (["model.layers.1", "model.layers.2"], "2 cut(s) given for 2 pipeline stages"),
    (["model.layers.3"], "out of order or leave pipeline stage 1 empty"),
    (["block.1"], "names no decoder layer"),
])
def test_bad_pipeline_cuts_are_named(cuts: list[str], expected: str) -> None:
    (p,) = _problems(_cfg(pipeline_cuts=cuts))
    assert p.startswith("model.pipeline_cuts: ") and expected in p, p


def test_more_stages_than_layers() -> None:
    (p,) = _problems(_cfg(pp=2, vpp=4, gbs=8))
    assert "model.num_layers (4) is smaller than the number of pipeline stages" in p


def test_cuts_without_pipeline() -> None:
    (p,) = _problems(_cfg(pp=1, devices=1, pipeline_cuts=["model.layers.1"]))
    assert p.startswith("model.pipeline_cuts: set without pipeline parallelism")


@pytest.mark.parametrize("accelerator", ["xla", "neuron"])
def test_pipeline_validates_on_xla(accelerator: str) -> None:
    """PP runs on torch-xla through the lockstep schedule (collective permutes): no refusal, as on CPU."""
    raw = _cfg()
    raw["trainer"]["accelerator"] = accelerator
    cfg = load_config(raw, check_paths=False)
    assert cfg.distributed_strategy.pipeline_model_parallel_size == 2
    assert unsupported_features(cfg) == []


def test_sequential_move_factor_validated() -> None:
    raw = _cfg()
    raw["trainer"]["sequential_move_factor"] = 0
    (p,) = _problems(raw)
    assert p.startswith("trainer.sequential_move_factor: must be >= 1")
    raw["trainer"]["sequential_move_factor"] = 1
    assert unsupported_features(load_config(raw, check_paths=False)) == []


def test_preference_training_with_pipeline_accepts_either_reference() -> None:
    """DPO / ORPO train under PP; DPO's reference is the precomputed table or a live forward-only pipeline pass
    of the frozen copy (or the LoRA base) each step (issue 39)."""
    raw = _cfg()
    raw["model_alignment_strategy"] = {"dpo": {}}
    raw["data"].update(tokenizer={"type": "bytelevel_bpe"}, train_dir="prefs.jsonl")
    cfg = load_config(raw, check_paths=False)  # precompute_ref_log_probs defaults to true
    assert unsupported_features(cfg) == []
    raw["model_alignment_strategy"] = {"orpo": {}}
    assert unsupported_features(load_config(raw, check_paths=False)) == []
    raw["model_alignment_strategy"] = {"dpo": {"precompute_ref_log_probs": False}}
    assert unsupported_features(load_config(raw, check_paths=False)) == []


@pytest.mark.parametrize("key,extra", [
    ("activations_checkpoint_save_attention", {"activations_checkpoint_granularity": "full"}),
    ("activations_offload", {"activations_checkpoint_granularity": "full"}),
])
def test_checkpoint_variants_without_a_torch_xla_form_are_refused_on_xla(key: str, extra: dict[str, Any]) -> None:
    """torch-xla's activation checkpoint recomputes whole modules (reentrant): save-attention and offload are
    refused on xla, naming the key, and accepted on CPU."""
    raw = _cfg(pp=1, devices=1, **{key: True, **extra})
    assert unsupported_features(load_config(raw, check_paths=False)) == []  # CPU
    raw["trainer"]["accelerator"] = "xla"
    problems = _problems(raw)
    assert any(p.startswith(f"not supported yet: model.{key}: true on trainer.accelerator xla") for p in problems), \
        problems
