"""Config loading and validation messages (nxd_lc.config): the NxDT 8B YAML, "did you mean", cross-field rules."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from nxd_lc.app.validation import load_config, unsupported_features
from nxd_lc.config.access import data_parallel_size, model_seq_length, seq_length
from nxd_lc.config.errors import ConfigError
from nxd_lc.config.resolvers import div, multiply, register_resolvers
from nxd_lc.config.schema import NxdConfig, register_configs

pytestmark = pytest.mark.compat  # torch-2.9 compatibility subset (lane 2; docs/testing.md)

REPO = Path(__file__).resolve().parents[1]
CONF_DIR = REPO / "conf"
TINY_JSON = str(CONF_DIR / "tiny_llama_config.json")  # 8 heads, 4 KV heads, hidden 256


@pytest.fixture(autouse=True)
def _repo_cwd(monkeypatch: pytest.MonkeyPatch) -> None:
    """The 8B YAML names conf/llama3_8B_hf_config.json relative to the launch dir (the repo root)."""
    monkeypatch.chdir(REPO)


def _compose_8b(overrides: list[str] | None = None) -> Any:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return compose(config_name="hf_llama3_8B_config", overrides=overrides or [])


def _hf_json(tmp_path: Path, heads: int = 8, kv_heads: int = 2, hidden: int = 64) -> str:
    path = tmp_path / f"config_{heads}_{kv_heads}_{hidden}.json"
    path.write_text(json.dumps({"model_type": "llama", "hidden_size": hidden, "num_attention_heads": heads,
                                "num_key_value_heads": kv_heads, "num_hidden_layers": 2,
                                "intermediate_size": 128, "vocab_size": 256}))
    return str(path)


def _tiny(**sections: dict[str, Any]) -> dict[str, Any]:
    """A small valid config (world 2 = TP 2 x DP 1) with ``sections`` merged in one level deep."""
    cfg: dict[str, Any] = {
        "trainer": {"devices": 2, "num_nodes": 1, "max_steps": 10},
        "distributed_strategy": {"tensor_model_parallel_size": 2},
        "data": {"micro_batch_size": 1, "global_batch_size": 2},
        "model": {"model_config": TINY_JSON, "encoder_seq_length": 64},
    }
    for key, value in sections.items():
        if isinstance(value, dict):
            cfg.setdefault(key, {}).update(copy.deepcopy(value))
        else:
            cfg[key] = value
    return cfg


def _problems(raw: Any, **kwargs: Any) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(raw, **kwargs)
    assert str(info.value).startswith(f"invalid nxd_lc config ({len(info.value.problems)} problem(s))")
    return info.value.problems


def _one_problem(raw: Any, **kwargs: Any) -> str:
    problems = _problems(raw, **kwargs)
    assert len(problems) == 1, problems
    return problems[0]


# ------------------------------------------------------------------------------------------ the NxDT 8B file

def test_nxdt_8b_yaml_loads_via_hydra_compose() -> None:
    cfg = load_config(_compose_8b(), world_size=128)
    assert isinstance(cfg, NxdConfig)
    assert cfg.trainer.devices * cfg.trainer.num_nodes == 128
    assert cfg.distributed_strategy.tensor_model_parallel_size == 32 and data_parallel_size(cfg) == 4
    assert cfg.async_exec_max_inflight_requests == 5  # NxDT's 'aync_' spelling read as the canonical key
    assert cfg.exp_manager.checkpoint_callback_params.model_parallel_size == 32  # ${multiply:32, 1}
    assert cfg.model.optim.sched.max_steps == 10000  # ${trainer.max_steps}
    assert cfg.model.optim.name == "adamw_fp32OptState" and cfg.model.optim.betas == [0.9, 0.999]
    assert seq_length(cfg) == 8192 and cfg.distributed_strategy.kv_replicator == 4
    assert cfg.distributed_strategy.zero1 and cfg.precision.type == "mixed_precision"
    assert unsupported_features(cfg) == []  # zero1 and mixed precision are implemented (issue 5)


def test_alias_and_canonical_key_together_is_an_error() -> None:
    problems = _problems(_compose_8b(["+async_exec_max_inflight_requests=3"]))
    assert problems[0] == ("aync_exec_max_inflight_requests: NxDT alias of 'async_exec_max_inflight_requests'; "
                           "give only one of them")


def test_launched_world_size_mismatch() -> None:
    problem = _one_problem(_compose_8b(), world_size=8)
    assert problem.startswith("trainer.devices: launched world size is 8 but trainer.devices * "
                              "trainer.num_nodes = 32 * 4 = 128")


def test_model_parallel_size_mismatch() -> None:
    raw = _compose_8b(["exp_manager.checkpoint_callback_params.model_parallel_size=16"])
    problem = _one_problem(raw, world_size=128)
    assert problem.startswith("exp_manager.checkpoint_callback_params.model_parallel_size: 16 != TP * PP = 32")
    assert "${multiply:" in problem


def test_check_paths_names_missing_data_path() -> None:
    problems = _problems(_compose_8b(), world_size=128, check_paths=True)
    assert any(p.startswith("data.train_dir: no such file") and
               "/home/ubuntu/examples_datasets/wikicorpus_llama3_tokenized_8k" in p for p in problems), problems


def test_check_paths_passes_for_existing_paths(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("hello " * 20)  # enough bytes for the global batch (the text-size bound)
    tok = tmp_path / "tok"
    tok.mkdir()
    raw = _tiny(data={"train_dir": str(tmp_path / "a.txt"), "tokenizer": {"type": str(tok)}})
    assert load_config(raw, check_paths=True).data.train_dir == str(tmp_path / "a.txt")
    raw["data"]["val_dir"] = str(tmp_path / "missing_val")
    assert _one_problem(raw, check_paths=True) == f"data.val_dir: no such file, directory or glob match: " \
                                                  f"{tmp_path / 'missing_val'}"


# ------------------------------------------------------------------------------------ unknown keys, types

@pytest.mark.parametrize("override,expected", [
    ("+trainer.max_step=5", "trainer.max_step: unknown key; did you mean 'trainer.max_steps'?"),
    ("+model.hidden_sise=5", "model.hidden_sise: unknown key; did you mean 'model.hidden_size'?"),
    ("+distributed_strategy.tensor_parallel_size=4",
     ("distributed_strategy.tensor_parallel_size: unknown key; "
      "did you mean 'distributed_strategy.tensor_model_parallel_size'?")),
    ("+seeed=3", "seeed: unknown key; did you mean 'seed'?"),
    ("+model.optim.sched.warmup_step=3", ("model.optim.sched.warmup_step: unknown key; "
                                          "did you mean 'model.optim.sched.warmup_steps'?")),
    ("+tensor_model_parallel_size=4", ("tensor_model_parallel_size: unknown key; "
                                       "did you mean 'distributed_strategy.tensor_model_parallel_size'?")),
])
def test_unknown_key_did_you_mean(override: str, expected: str) -> None:
    assert _one_problem(_compose_8b([override]), world_size=128) == expected


def test_multiple_problems_reported_together() -> None:
    raw = _compose_8b(["+trainer.max_step=5", "+model.hidden_sise=5", "trainer.log_every_n_steps=abc"])
    problems = _problems(raw)
    assert len(problems) == 3
    assert problems[0].startswith("trainer.max_step: unknown key")
    assert problems[1].startswith("model.hidden_sise: unknown key")
    assert problems[2].startswith("trainer.log_every_n_steps: invalid value 'abc'")


def test_multiple_cross_field_problems_reported_together() -> None:
    raw = _tiny(trainer={"devices": 3}, data={"seq_length": 131}, distributed_strategy={"sequence_parallel": True})
    problems = _problems(raw, world_size=4)
    starts = [p.split(":")[0] for p in problems]
    assert starts == ["trainer.devices", "distributed_strategy.tensor_model_parallel_size", "data.seq_length",
                      "data.seq_length"], problems


@pytest.mark.parametrize("key,value,expected", [
    ("trainer.log_every_n_steps", "'many'", "trainer.log_every_n_steps: invalid value 'many' (expected int)"),
    ("data.micro_batch_size", "1.5", "data.micro_batch_size: invalid value 1.5 (expected int)"),
    ("distributed_strategy.sequence_parallel", "maybe",
     "distributed_strategy.sequence_parallel: invalid value 'maybe' (expected bool)"),
])
def test_bad_type_names_the_key(key: str, value: str, expected: str) -> None:
    assert _one_problem(_compose_8b([f"{key}={value}"])).startswith(expected)


def test_unknown_choice_value_suggests() -> None:
    problem = _one_problem(_compose_8b(["precision.type=mixed_precison"]), world_size=128)
    assert problem.startswith("precision.type: unknown value 'mixed_precison'; did you mean 'mixed_precision'?")


def test_precision_alias_mixed_precision_sr() -> None:
    cfg = load_config(_compose_8b(["precision.type=mixed_precision_SR"]), world_size=128)
    assert cfg.precision.type == "mixed_precisionSR"


# ---------------------------------------------------------------------------------------- cross-field rules

def test_tiny_base_config_is_valid() -> None:
    cfg = load_config(_tiny(), world_size=2)
    assert data_parallel_size(cfg) == 1 and seq_length(cfg) == 64


def test_world_not_divisible_by_model_parallel() -> None:
    problem = _one_problem(_tiny(trainer={"devices": 6}, distributed_strategy={"tensor_model_parallel_size": 4}))
    assert problem.startswith("distributed_strategy.tensor_model_parallel_size: world size 6 is not divisible "
                              "by TP * PP * CP = 4 * 1 * 1 = 4")


def test_global_batch_not_divisible() -> None:
    raw = _tiny(trainer={"devices": 4}, data={"global_batch_size": 3})  # DP = 4 / 2 = 2
    assert _one_problem(raw).startswith("data.global_batch_size: 3 is not divisible by micro_batch_size x DP "
                                        "= 1 x 2")


def test_sequence_parallel_seq_length_not_divisible_by_tp() -> None:
    raw = _tiny(distributed_strategy={"tensor_model_parallel_size": 4, "sequence_parallel": True},
                trainer={"devices": 4}, model={"encoder_seq_length": 30})
    assert _one_problem(raw) == ("data.seq_length: 30 must be divisible by tensor_model_parallel_size 4 when "
                                 "distributed_strategy.sequence_parallel is true")
    raw["distributed_strategy"]["sequence_parallel"] = False
    assert load_config(raw).model.encoder_seq_length == 30


def test_heads_not_divisible_by_tp(tmp_path: Path) -> None:
    raw = _tiny(trainer={"devices": 3}, distributed_strategy={"tensor_model_parallel_size": 3},
                model={"model_config": _hf_json(tmp_path, heads=8, kv_heads=8)})
    problems = _problems(raw)
    assert problems[0].startswith("distributed_strategy.tensor_model_parallel_size: 3 must divide "
                                  "num_attention_heads 8")


def test_kv_replicator_needed_for_two_kv_heads_at_tp4(tmp_path: Path) -> None:
    raw = _tiny(trainer={"devices": 4}, distributed_strategy={"tensor_model_parallel_size": 4},
                model={"model_config": _hf_json(tmp_path, heads=8, kv_heads=2)})
    assert _one_problem(raw) == ("distributed_strategy.kv_replicator: num_key_value_heads 2 x kv_replicator 1 "
                                 "must be divisible by tensor_model_parallel_size 4; use kv_replicator: 2")
    raw["distributed_strategy"]["kv_replicator"] = 3
    assert _one_problem(raw).endswith("kv_replicator 3 must be divisible by tensor_model_parallel_size 4; "
                                      "use kv_replicator: 2")
    raw["distributed_strategy"]["kv_replicator"] = 2
    assert load_config(raw).distributed_strategy.kv_replicator == 2


def test_kv_replicator_needless_and_invalid(tmp_path: Path) -> None:
    raw = _tiny(distributed_strategy={"kv_replicator": 2})  # 4 KV heads already divide TP 2
    assert _one_problem(raw).startswith("distributed_strategy.kv_replicator: 2 replicates KV heads needlessly")
    raw["distributed_strategy"]["kv_replicator"] = 0
    assert any(p == "distributed_strategy.kv_replicator: must be >= 1, got 0" for p in _problems(raw))


def test_qkv_linear_false_with_fewer_kv_heads_than_tp(tmp_path: Path) -> None:
    raw = _tiny(trainer={"devices": 4}, distributed_strategy={"tensor_model_parallel_size": 4},
                model={"model_config": _hf_json(tmp_path, heads=8, kv_heads=2), "qkv_linear": False})
    assert _one_problem(raw) == ("model.qkv_linear: false needs num_key_value_heads 2 divisible by TP 4; set "
                                 "model.qkv_linear: true and distributed_strategy.kv_replicator: 2")


def test_seq_length_at_most_encoder_seq_length() -> None:
    raw = _tiny(data={"seq_length": 128})
    assert _one_problem(raw).startswith("data.seq_length: 128 exceeds model.encoder_seq_length 64")
    for shorter in (64, 32):  # NxDT's SFT configs train 4096-token data on an 8192-token model
        raw["data"]["seq_length"] = shorter
        cfg = load_config(raw)
        assert seq_length(cfg) == shorter and model_seq_length(cfg) == 64
    del raw["model"]["encoder_seq_length"]
    assert model_seq_length(load_config(raw)) == 32  # no model length: the data's


def test_model_config_missing_file(tmp_path: Path) -> None:
    raw = _tiny(model={"model_config": str(tmp_path / "nope.json")})
    assert _one_problem(raw) == f"model.model_config: file not found: {tmp_path / 'nope.json'}"


def test_zero_tp_is_a_config_error() -> None:
    raw = _tiny(distributed_strategy={"tensor_model_parallel_size": 0, "sequence_parallel": True})
    assert any(p.startswith("distributed_strategy.tensor_model_parallel_size: must be >= 1")
               for p in _problems(raw))


def test_empty_section_is_not_a_crash() -> None:
    raw = _tiny()
    raw["exp_manager"] = None
    load_config(raw)


# ------------------------------------------------------------------------------------ resolvers, registry

def test_resolvers_multiply_and_div() -> None:
    assert multiply(4, 8) == 32 and isinstance(multiply(" 4", "8 "), int)
    assert multiply("0.5", 3) == 1.5
    assert div(8, 2) == 4 and isinstance(div(8, 2), int)
    assert div(3, 2) == 1.5
    with pytest.raises(ZeroDivisionError):
        div(1, 0)
    register_resolvers()
    register_resolvers()  # idempotent
    node = OmegaConf.create({"tp": 8, "pp": 2, "mp": "${multiply:${tp}, ${pp}}", "half": "${div:${tp}, 2}",
                             "frac": "${div:1, 4}"})
    assert (node.mp, node.half, node.frac) == (16, 4, 0.25)


def test_unresolvable_interpolation_names_the_key() -> None:
    raw = _tiny(model={"optim": {"sched": {"max_steps": "${trainer.max_stepz}"}}})
    problem = _one_problem(raw)
    assert problem.startswith("model.optim.sched.max_steps: cannot resolve interpolation")


def test_register_configs_puts_schema_in_config_store() -> None:
    register_configs()
    assert "nxd_lc_schema.yaml" in ConfigStore.instance().list("/")
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        schema = compose(config_name="nxd_lc_schema", overrides=["trainer.max_steps=7"])
    assert schema.trainer.max_steps == 7 and schema.model.optim.sched.name == "LinearAnnealingWithWarmUp"
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None), \
            pytest.raises(ConfigCompositionException, match="trainer.max_steps"):
        compose(config_name="nxd_lc_schema", overrides=["trainer.max_steps=many"])


# ------------------------------------------------------------------------------------------ raw crashes (issue 11)

@pytest.mark.parametrize("value", [0, -3, 0.0, 1.5, True])
def test_val_check_interval_must_be_positive_steps_or_a_fraction(value: Any) -> None:
    problem = _one_problem(_tiny(trainer={"val_check_interval": value}))
    assert problem.startswith(f"trainer.val_check_interval: {value!r} is not valid")


@pytest.mark.parametrize(("section", "key"), [("data", "seq_length"), ("model", "encoder_seq_length")])
@pytest.mark.parametrize("value", [0, -8])
def test_sequence_length_must_be_positive(section: str, key: str, value: int) -> None:
    problem = _one_problem(_tiny(**{section: {key: value}}))
    assert problem == f"{section}.{key}: must be >= 1 token, got {value}"


@pytest.mark.parametrize(("text", "expected"), [
    ('{"model_type": "llama",\n "hidden_size": 64,,}', r"is not valid JSON \(line 2, column 20"),
    ('[1, 2]', "must hold a JSON object .* got a JSON list"),
])
def test_malformed_model_config_json_names_the_file(tmp_path: Path, text: str, expected: str) -> None:
    bad = tmp_path / "config.json"
    bad.write_text(text)
    with pytest.raises(ConfigError, match=f"model.model_config: {bad} {expected}"):
        load_config(_tiny(model={"model_config": str(bad)}))


def test_retrieval_eval_settings_are_checked() -> None:
    raw = _tiny(exp_manager={"retrieval_eval": {"every_n_steps": 5, "tasks": ["passkey", "needle"],
                                                "scorings": ["greedy"], "depths": [0.5, 1.5], "num_samples": 0}})
    problems = _problems(raw)
    assert any("exp_manager.retrieval_eval.tasks: unknown ['needle']" in p for p in problems), problems
    assert any("exp_manager.retrieval_eval.scorings: unknown ['greedy']" in p for p in problems), problems
    assert any("exp_manager.retrieval_eval.depths: need numbers in [0, 1]" in p for p in problems), problems
    assert any("exp_manager.retrieval_eval.num_samples: must be >= 1" in p for p in problems), problems
    ok = _tiny(exp_manager={"retrieval_eval": {"every_n_steps": 5, "tasks": ["passkey", "niah_multikey"]}})
    assert load_config(ok).exp_manager.retrieval_eval.tasks == ["passkey", "niah_multikey"]


def test_mixture_and_upsampling_settings_are_checked() -> None:
    raw = _tiny(data={"mixture": [{"source": "corpus", "weight": 0}, {"source": "synthetic", "weight": 1,
                                                                        "tasks": ["passkey", "qa"], "min_len": 5},
                                  {"weight": 1}],
                      "length_upsampling": {"min_tokens": 0, "factor": 2}})
    problems = _problems(raw)
    for text in ("data.mixture[0].weight: must be a number > 0", "data.mixture[1]: unknown keys ['min_len']",
                 "data.mixture[1].tasks: unknown ['qa']", "data.mixture[2]: needs {source",
                 "data.length_upsampling: needs {min_tokens: int >= 1"):
        assert any(text in p for p in problems), (text, problems)
    ok = _tiny(data={"mixture": [{"source": "corpus", "weight": 0.7},
                                 {"source": "synthetic", "weight": 0.3, "tasks": ["passkey"], "num_samples": 64}],
                     "length_upsampling": {"min_tokens": 4096, "factor": 2.0}})
    cfg = load_config(ok)
    assert cfg.data.mixture[1]["num_samples"] == 64 and cfg.data.length_upsampling["factor"] == 2.0


def test_save_attention_without_checkpointing_is_a_config_error() -> None:
    raw = _tiny(model={"model_config": TINY_JSON, "activations_checkpoint_save_attention": True})
    assert _one_problem(raw).startswith("model.activations_checkpoint_save_attention: true keeps attention outputs "
                                        "inside checkpointed modules, but model.activations_checkpoint_granularity "
                                        "is null")
    raw = _tiny(model={"model_config": TINY_JSON, "activations_checkpoint_save_attention": True,
                       "activations_checkpoint_granularity": "full"})
    assert load_config(raw).model.activations_checkpoint_save_attention is True


def test_checkpoint_block_method_keys() -> None:
    """NeMo's activations_checkpoint_method / _num_layers: block needs num_layers and full granularity; a bad
    method names the choices; a valid block config loads."""
    def model(**kw: object) -> dict:
        return {"model_config": TINY_JSON, **kw}

    assert _one_problem(_tiny(model=model(activations_checkpoint_granularity="full",
                                          activations_checkpoint_method="block"))).startswith(
        "model.activations_checkpoint_num_layers: 'block' needs the number of decoder layers")
    assert _one_problem(_tiny(model=model(activations_checkpoint_method="block",
                                          activations_checkpoint_num_layers=2))).startswith(
        "model.activations_checkpoint_method: 'block' applies to model.activations_checkpoint_granularity full "
        "(it is None)")
    assert "model.activations_checkpoint_method" in _one_problem(
        _tiny(model=model(activations_checkpoint_granularity="full", activations_checkpoint_method="blok",
                          activations_checkpoint_num_layers=2)))
    cfg = load_config(_tiny(model=model(activations_checkpoint_granularity="full",
                                        activations_checkpoint_method="block", activations_checkpoint_num_layers=2)))
    assert (cfg.model.activations_checkpoint_method, cfg.model.activations_checkpoint_num_layers) == ("block", 2)


def test_demo_config_shorter_than_its_warmup_is_valid() -> None:
    """A new user's first try (issue 25): the demo config (warm-up 15) with trainer.max_steps=6 validates; the
    schedule warns at build time and trains the truncated warm-up (tests/test_optim.py) instead of refusing."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        raw = compose(config_name="cpu_tiny_llama_config", overrides=["trainer.max_steps=6"])
    cfg = load_config(raw)
    assert cfg.trainer.max_steps == 6 and cfg.model.optim.sched.warmup_steps == 15
    with pytest.raises(ConfigError, match="model.optim.sched.warmup_steps / constant_steps / hold_steps: must be"):
        load_config(_tiny(model={"optim": {"sched": {"warmup_steps": -1}}}))
