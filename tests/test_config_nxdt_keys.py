"""NxDT keys and rules of issue 10 (part 2), at the config level: ``model.fusions.ring_attention``; ring context
parallelism on XLA/Neuron; ``data.seq_length <= model.encoder_seq_length``; precision keys a non-manual type
overrides; alignment-only / pretraining-only ``data`` keys; and every NxDT Llama example config loading."""

from __future__ import annotations

import copy
import json
import os
from typing import Any

import pytest

from nxd_lc.app.validation import load_config
from nxd_lc.config.errors import ConfigError

pytestmark = pytest.mark.compat  # torch-2.9 compatibility subset (lane 2; docs/testing.md)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_JSON = os.path.join(REPO, "conf", "tiny_llama_config.json")  # 8 heads, 4 KV heads, 4096 positions


def _raw(**sections: dict[str, Any]) -> dict[str, Any]:
    """A small valid pretraining config (world 2 = CP 2 x TP 1) with ``sections`` merged one level deep."""
    raw: dict[str, Any] = {
        "trainer": {"devices": 2, "max_steps": 10},
        "distributed_strategy": {"context_parallel_size": 2},
        "data": {"micro_batch_size": 1, "global_batch_size": 1},
        "model": {"model_config": TINY_JSON, "encoder_seq_length": 64},
    }
    for key, value in sections.items():
        raw.setdefault(key, {}).update(copy.deepcopy(value))
    return raw


def _problems(raw: dict[str, Any]) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(raw)
    return info.value.problems


# ---- model.fusions.ring_attention ---------------------------------------------------------------------------

def test_ring_attention_true_is_ring_context_parallelism() -> None:
    cfg = load_config(_raw(model={"fusions": {"ring_attention": True, "flash_attention": False}}))
    assert cfg.model.fusions.ring_attention is True and cfg.distributed_strategy.context_parallel_algo == "ring"


def test_ring_attention_contradicting_ulysses_names_both_keys() -> None:
    problems = _problems(_raw(model={"fusions": {"ring_attention": True}},
                              distributed_strategy={"context_parallel_algo": "ulysses"}))
    assert len(problems) == 1
    assert "model.fusions.ring_attention" in problems[0] and "distributed_strategy.context_parallel_algo" in problems[0]


def test_ring_attention_false_with_context_parallelism_needs_ulysses() -> None:
    problems = _problems(_raw(model={"fusions": {"ring_attention": False}}))
    assert len(problems) == 1 and problems[0].startswith("model.fusions.ring_attention: false")
    assert "context_parallel_algo: ulysses" in problems[0]
    cfg = load_config(_raw(model={"fusions": {"ring_attention": False}},
                           distributed_strategy={"context_parallel_algo": "ulysses"}))
    assert cfg.distributed_strategy.context_parallel_algo == "ulysses"


def test_ring_attention_without_context_parallelism_is_accepted() -> None:
    for value in (True, False):  # one CP rank: ring attention over one rank is local attention
        load_config(_raw(distributed_strategy={"context_parallel_size": 1}, trainer={"devices": 1},
                         model={"fusions": {"ring_attention": value}}))


# ---- ring context parallelism on XLA / Neuron ----------------------------------------------------------------

@pytest.mark.parametrize("accelerator", ["xla", "neuron", "cpu"])
def test_ring_context_parallelism_is_valid_on_every_accelerator(accelerator: str) -> None:
    """Ring CP runs on torch-xla through a collective permute (``collectives.ring_exchange``): no refusal there."""
    cfg = load_config(_raw(trainer={"accelerator": accelerator}))
    assert cfg.distributed_strategy.context_parallel_algo == "ring"
    assert cfg.distributed_strategy.context_parallel_size == 2


@pytest.mark.parametrize("neuron_host", [True, False])
def test_auto_accelerator_accepts_ring_on_a_neuron_host(monkeypatch: pytest.MonkeyPatch, neuron_host: bool) -> None:
    from nxd_lc.app.validation import unsupported_features
    from nxd_lc.runtime import xla

    monkeypatch.setattr(xla, "neuron_available", lambda: neuron_host)
    assert [p for p in unsupported_features(load_config(_raw())) if "context_parallel" in p] == []


# ---- precision keys a non-manual precision.type overrides ----------------------------------------------------

NXDT_PRECISION_KEYS = {"xla_use_bf16": "0", "xla_downcast_bf16": "0", "neuron_rt_stochastic_rounding_en": "0"}


def _cp1(**sections: dict[str, Any]) -> dict[str, Any]:
    return _raw(distributed_strategy={"context_parallel_size": 1}, trainer={"devices": 1}, **sections)


def test_nxdt_zeros_beside_mixed_precision_are_overridden_and_logged_once(caplog: Any,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    with caplog.at_level("INFO", logger="nxd_lc"):
        load_config(_cp1(precision={"type": "mixed_precision", **NXDT_PRECISION_KEYS}))
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("config: precision.")]
    # NxDT's mixed_precision runs with XLA_DOWNCAST_BF16=1: only that key differs from the YAML's '0'; the line says
    # what the environment table sets (0: nxd_lc casts explicitly), not NxDT's 1
    assert lines == ["config: precision.xla_downcast_bf16 '0' is not read: precision.type mixed_precision decides the "
                     "dtypes (NxDT sets XLA_DOWNCAST_BF16=1 for it; nxd_lc casts explicitly and sets "
                     "XLA_DOWNCAST_BF16=0, as its environment table shows; these keys are read only with "
                     "precision.type manual)"]
    from nxd_lc.runtime.env import desired_env

    table = {var: value for _, var, value in desired_env(load_config(_cp1(precision={"type": "mixed_precision"})))}
    assert table["XLA_DOWNCAST_BF16"] == "0" and "XLA_DOWNCAST_BF16=0, as its environment table shows" in lines[0]


def test_stochastic_rounding_override_names_the_variable_the_table_sets(caplog: Any,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """mixed_precisionSR sets NEURON_RT_STOCHASTIC_ROUNDING_EN=1 in the environment table: the override line of the
    YAML's '0' says that value."""
    from nxd_lc.runtime.env import desired_env

    monkeypatch.delenv("RANK", raising=False)
    with caplog.at_level("INFO", logger="nxd_lc"):
        cfg = load_config(_cp1(precision={"type": "mixed_precisionSR", **NXDT_PRECISION_KEYS}))
    table = {var: value for _, var, value in desired_env(cfg)}
    line = next(r.getMessage() for r in caplog.records if "neuron_rt_stochastic_rounding_en" in r.getMessage())
    assert table["NEURON_RT_STOCHASTIC_ROUNDING_EN"] == "1"
    assert "overridden by precision.type mixed_precisionSR, which sets NEURON_RT_STOCHASTIC_ROUNDING_EN=1" in line


def test_override_is_logged_by_rank_zero_only(caplog: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "1")
    with caplog.at_level("INFO", logger="nxd_lc"):
        load_config(_cp1(precision={"type": "mixed_precision", **NXDT_PRECISION_KEYS}))
    assert "precision.xla_downcast_bf16" not in caplog.text


@pytest.mark.parametrize("precision_type,key", [
    ("fp32", "xla_use_bf16"),
    ("fp32", "xla_downcast_bf16"),
    ("fp32", "neuron_rt_stochastic_rounding_en"),  # fp32 leaves stochastic rounding off
    ("mixed_precision", "xla_use_bf16"),
    ("mixed_precision", "neuron_rt_stochastic_rounding_en"),  # mixed_precisionSR is the SR mode
    ("autocast", "xla_downcast_bf16"),
])
def test_a_one_the_type_turns_off_is_an_error(precision_type: str, key: str) -> None:
    problems = _problems(_cp1(precision={"type": precision_type, key: "1"}))
    assert len(problems) == 1
    assert problems[0].startswith(f"precision.{key}: '1' contradicts precision.type {precision_type}, which uses '0'")


def test_values_the_type_agrees_with_or_manual_are_fine(caplog: Any) -> None:
    with caplog.at_level("INFO", logger="nxd_lc"):
        load_config(_cp1(precision={"type": "bf16SR", "xla_use_bf16": "1", "neuron_rt_stochastic_rounding_en": "1"}))
        load_config(_cp1(precision={"type": "mixed_precisionSR", "xla_downcast_bf16": "1",
                                    "neuron_rt_stochastic_rounding_en": "1"}))
        load_config(_cp1(precision={"type": "manual", "xla_use_bf16": "1", "xla_downcast_bf16": "1",
                                    "neuron_rt_stochastic_rounding_en": "1"}))
    assert "is overridden" not in caplog.text


# ---- alignment-only and pretraining-only data keys -----------------------------------------------------------

ALIGNMENT = {"model_alignment_strategy": {"sft": {}}, "data": {"train_dir": "records.jsonl"}}


@pytest.mark.parametrize("data,key", [
    ({"input_key": "question"}, "data.input_key"),
    ({"output_key": "input"}, "data.output_key"),  # even the value an alignment run would use by default
    ({"dev_choose_samples": 100}, "data.dev_choose_samples"),
    ({"tokenizer": {"chat_template": None}}, "data.tokenizer.chat_template"),
    ({"tokenizer": {"chat_template": "{{ messages }}"}}, "data.tokenizer.chat_template"),
])
def test_alignment_key_in_a_pretraining_run_is_an_error(data: dict[str, Any], key: str) -> None:
    problems = _problems(_cp1(data=data))
    assert len(problems) == 1 and problems[0].startswith(f"{key}: an alignment key"), problems
    assert "model_alignment_strategy" in problems[0]


@pytest.mark.parametrize("data,key", [
    ({"val_fraction": 0.05}, "data.val_fraction"),  # set explicitly, even to the pretraining default
    ({"text_key": "text"}, "data.text_key"),
    ({"cross_document_attention": False}, "data.cross_document_attention"),
    ({"builtin_corpus": "python_stdlib"}, "data.builtin_corpus"),
])
def test_pretraining_key_in_an_alignment_run_is_an_error(data: dict[str, Any], key: str) -> None:
    raw = _cp1(**ALIGNMENT)
    raw["data"].update(data)
    problems = _problems(raw)
    assert len(problems) == 1 and problems[0].startswith(f"{key}: a pretraining"), problems


def test_each_kind_of_run_takes_its_own_keys_and_the_shared_ones() -> None:
    pretrain = load_config(_cp1(data={"val_fraction": 0.1, "text_key": "body", "cross_document_attention": True,
                                      "file_glob": "*.txt", "tokenizer": {"chat_template": "default"}}))
    assert pretrain.data.resolved().val_fraction == 0.1 and pretrain.data.file_glob == "*.txt"
    raw = _cp1(**ALIGNMENT)
    raw["data"].update({"input_key": "q", "output_key": "a", "dev_choose_samples": 8, "file_glob": "*.jsonl",
                        "tokenizer": {"chat_template": None}})
    aligned = load_config(raw)
    assert (aligned.data.input_key, aligned.data.dev_choose_samples) == ("q", 8)
    assert aligned.data.tokenizer.chat_template is None  # null: concatenate the messages


# ---- NxDT's Llama example configs, and conf/'s copies of them -------------------------------------------------

REF = os.path.join(os.path.dirname(REPO), "shared", "reference", "nxdt_examples")
NXDT_LLAMA = sorted(n[:-5] for n in os.listdir(REF) if n.startswith("hf_llama") and n.endswith(".yaml")) \
    if os.path.isdir(REF) else []
needs_reference = pytest.mark.skipif(not NXDT_LLAMA, reason="NxDT's example configs are not in ../shared/reference")


def _ours(name: str) -> Any:
    from omegaconf import OmegaConf

    return OmegaConf.load(os.path.join(REPO, "conf", f"{name}.yaml"))


@needs_reference
@pytest.mark.parametrize("name", NXDT_LLAMA)
def test_nxdt_llama_example_validates(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """NxDT's own file, unchanged but for model.model_config (its /home/ubuntu/config.json), validates for its own
    world size and needs no feature that is not supported yet (off Trainium)."""
    from omegaconf import OmegaConf

    from nxd_lc.app.validation import unsupported_features
    from nxd_lc.runtime import xla

    monkeypatch.chdir(REPO)
    monkeypatch.setattr(xla, "neuron_available", lambda: False)
    raw = OmegaConf.load(os.path.join(REF, f"{name}.yaml"))
    raw.model.model_config = _ours(name).model.model_config
    cfg = load_config(raw)
    assert unsupported_features(cfg) == []
    if cfg.model_alignment_strategy is not None:  # NxDT's SFT / DPO / ORPO: 4096-token data on the 8B model
        assert cfg.data.seq_length <= cfg.model.encoder_seq_length
        assert cfg.exp_manager.ckpt_ptl_version == "1.8.6"
    if "lora" in name:
        assert cfg.model_alignment_strategy.peft.lora_rank == 16 and cfg.model_alignment_strategy.sft.packing
    if "_CP_" in name:
        assert cfg.model.fusions.ring_attention and cfg.distributed_strategy.context_parallel_algo == "ring"


@needs_reference
@pytest.mark.parametrize("name", NXDT_LLAMA)
def test_conf_copy_is_nxdt_key_for_key(name: str) -> None:
    """conf/<name>.yaml has NxDT's keys, structure and values; only model.model_config points at a shipped file."""
    from omegaconf import OmegaConf

    ours = OmegaConf.to_container(_ours(name))
    theirs = OmegaConf.to_container(OmegaConf.load(os.path.join(REF, f"{name}.yaml")))
    shipped = ours["model"].pop("model_config")
    assert theirs["model"].pop("model_config").startswith("/home/ubuntu/")
    assert ours == theirs
    assert shipped.startswith("conf/") and os.path.isfile(os.path.join(REPO, shipped))
    with open(os.path.join(REPO, shipped)) as f:  # the shipped architecture agrees with NxDT's YAML overrides
        arch = json.load(f)
    model = ours["model"]
    assert (arch["hidden_size"], arch["num_hidden_layers"]) == (model["hidden_size"], model["num_layers"])
    assert arch["rope_theta"] == model["rope_theta"] and arch["max_position_embeddings"] >= model["encoder_seq_length"]
    assert ("3.1" in name) == (arch["rope_scaling"] is not None)  # Llama 3.1 ships llama3 RoPE scaling
