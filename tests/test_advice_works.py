"""The advice of an error works (issue 50, item 7): the run refused with a too-small validation set is run again
with the change its message advises, and trains. The SFT message advised ``data.val_fraction: 0``, which SFT then
refused as a pretraining key. And what a run writes goes under its run directory: the DPO reference cache was
written next to the user's data file."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from nxd_lc.app.convert import compose_run_config
from nxd_lc.config.errors import ConfigError
from tests.test_export_from_run import REPO, _overrides
from tests.test_export_from_run import run_demo_config as _run


def _apply(advice: str, overrides: list[str]) -> list[str]:
    """The overrides with the message's advice applied: ``remove <key>`` -> ``~<key>``, ``set <key>: <value>`` ->
    ``<key>=<value>``; the advice must be one of those shapes (the test fails on any other)."""
    removed = re.search(r"remove (data\.\w+)", advice) or re.match(r"(data\.\w+): .*\bremove it\b", advice)
    if removed:  # drop the overrides that set it; delete it from the base config when it came from there
        key = removed.group(1)
        setting = [o for o in overrides if o.lstrip("+").startswith(key + "=")]
        kept = [o for o in overrides if o not in setting]
        return kept if any(o.startswith("+") for o in setting) else [*kept, f"~{key}"]
    set_ = re.search(r"set (data\.\w+): (\S+?)\b", advice)
    assert set_ is not None, advice
    return [*overrides, f"++{set_.group(1)}={set_.group(2)}"]


def test_sft_with_a_tiny_validation_set_follows_its_own_advice(tmp_path: Path) -> None:
    val = tmp_path / "val.jsonl"
    val.write_text(json.dumps({"input": "one", "output": "1"}) + "\n")  # 1 packed row < micro batch 2
    overrides = [*_overrides(tmp_path), f"+data.val_dir={val}", "data.micro_batch_size=2", "data.global_batch_size=2",
                 "trainer.max_steps=1", "exp_manager.checkpoint_callback_params.every_n_train_steps=100"]
    with pytest.raises(ValueError, match=r"data\.val_dir: validation gives 1 samples") as info:
        _run(overrides)
    assert "val_fraction" not in str(info.value)  # a pretraining key: SFT refuses it
    _run(_apply(str(info.value), overrides))
    assert (tmp_path / "run" / "tokenizer").is_dir()


def test_pretraining_with_a_tiny_held_out_share_follows_its_own_advice(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(4):
        (corpus / f"d{i}.txt").write_text(f"document {i} " * 200)
    overrides = ["~data.builtin_corpus", f"+data.train_dir={corpus}", "+data.file_glob=*.txt",
                 "data.val_fraction=0.25", "data.tokenizer.vocab_size=300", f"+data.tokenizer.cache_dir={tmp_path}",
                 "trainer.max_steps=1", "+exp_manager.preemption_signals=[]", "data.micro_batch_size=32",
                 "data.global_batch_size=32", "model.encoder_seq_length=32", "+model.num_layers=1",
                 "+model.hidden_size=64", "trainer.val_check_interval=1",
                 f"exp_manager.explicit_log_dir={tmp_path / 'r'}",
                 "exp_manager.create_tensorboard_logger=false", "+trainer.enable_progress_bar=false",
                 "exp_manager.checkpoint_callback_params.every_n_train_steps=100", "trainer.devices=1",
                 "distributed_strategy.tensor_model_parallel_size=1", "distributed_strategy.sequence_parallel=false"]
    with pytest.raises(ValueError, match=r"data\.val_fraction: validation gives \d+ samples, fewer than "
                                         r"micro_batch_size x DP = 32") as info:
        _run(overrides)
    assert "set data.val_fraction: 0" in str(info.value)
    _run(_apply(str(info.value), overrides))


def test_the_dpo_reference_cache_goes_under_the_run_directory(tmp_path: Path) -> None:
    """``train.py``'s DPO with precomputed reference log-probs: the cache is written under ``<log_dir>/ref_logps``;
    the data's directory holds only the user's files."""
    data = tmp_path / "data"
    data.mkdir()
    rows = [{"prompt": f"what is {i} plus {i}?", "chosen": f"{2 * i}", "rejected": f"{2 * i + 1}"} for i in range(8)]
    (data / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    overrides = [o for o in _overrides(tmp_path) if not o.startswith(("+data.train_dir=", "+model_alignment"))]
    _run([*overrides, f"+data.train_dir={data / 'pairs.jsonl'}", "trainer.max_steps=1",
          "+model_alignment_strategy={dpo:{precompute_ref_log_probs:true}}",
          "exp_manager.checkpoint_callback_params.every_n_train_steps=100"])
    assert sorted(p.name for p in data.iterdir()) == ["pairs.jsonl"]
    (cache,) = (tmp_path / "run" / "ref_logps").iterdir()
    assert cache.name.startswith("pairs.jsonl.ref_logps-") and cache.suffix == ".pt"


def _refusal_for(overrides: list[str], key: str) -> str:
    with pytest.raises(ConfigError) as info:
        compose_run_config("cpu_tiny_llama_config", str(REPO / "conf"), overrides)
    problems = [p for p in info.value.problems if p.startswith(key + ":")]
    assert problems, info.value.problems
    return problems[0]


def _data_key_cases() -> list[tuple[str, str, str]]:
    """(mode, key, value): each data key one kind of run refuses because only the other kind reads it."""
    from nxd_lc.config.alignment_schema import ALIGNMENT_ONLY_DATA_KEYS, PRETRAINING_ONLY_DATA_KEYS

    values = {"builtin_corpus": "python_stdlib", "val_fraction": "0.1", "text_key": "body",
              "cross_document_attention": "true",
              "mixture": "[{name:a,weight:1.0,train_dir:/x}]", "length_upsampling": "{min_length:8,factor:2}",
              "curriculum": "[{seq_length:32}]", "input_key": "q", "output_key": "a", "dev_choose_samples": "4"}
    return ([("sft", k, values[k]) for k in PRETRAINING_ONLY_DATA_KEYS]
            + [("pretraining", k, values[k]) for k in ALIGNMENT_ONLY_DATA_KEYS])


@pytest.mark.parametrize(("mode", "key", "value"), _data_key_cases())
def test_every_wrong_kind_data_key_is_refused_with_advice_that_works(mode: str, key: str, value: str,
                                                                     tmp_path: Path) -> None:
    """A data key the run's kind does not read is refused with "remove it"; the config with the key removed (as
    the advice says: the override deleted, ``~data.<key>`` for a key of the config file) validates."""
    sft = [f"+data.train_dir={tmp_path / 'x.jsonl'}", "~data.builtin_corpus", "~data.val_fraction",
           "+model_alignment_strategy={sft:{}}"] if mode == "sft" else []
    if mode == "sft" and key in ("builtin_corpus", "val_fraction"):
        overrides = [o for o in sft if o != f"~data.{key}"] + [f"data.{key}={value}"]
    else:
        overrides = [*sft, f"++data.{key}={value}"]
    problem = _refusal_for(overrides, f"data.{key}")
    assert "remove it" in problem, problem
    fixed = _apply(problem, overrides)
    cfg = compose_run_config("cpu_tiny_llama_config", str(REPO / "conf"), fixed)
    assert (cfg.model_alignment_strategy is None) == (mode == "pretraining")
