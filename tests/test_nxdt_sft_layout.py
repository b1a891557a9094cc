"""NxDT's older SFT layout (issue 25, part 4): ``data.use_sft_style_data_module`` / ``data.packing`` on a
``model_source: megatron`` model, without ``model_alignment_strategy``, as in NxDT's
``examples/conf/megatron_llama2_7B_SFT_config.yaml``, are read as ``model_alignment_strategy.sft``
(:mod:`nxd_lc.config.sft_style_layout`).

The YAML written here has that file's keys, in its sections, with the sizes shrunk (2 layers, hidden 64, 4 heads,
sequence 64, one CPU process), the data and run paths replaced, 2 steps, and no checkpoint to start from
(``resume_from_checkpoint: null``, ``weight_init_only: false``: the weights start from the seed). The records are
NxDT's SFT ``{"input", "output"}`` jsonl; the tokenizer is the small byte-level BPE the alignment tests build.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from omegaconf import OmegaConf
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from nxd_lc.app.validation import cross_field_problems, load_config
from nxd_lc.config.alignment_schema import ModelAlignmentStrategyConfig, SFTConfig
from nxd_lc.config.errors import ConfigError
from nxd_lc.config.schema import MEGATRON_DATA_KEY_DEFAULTS, NxdConfig

SEQ = 64
NUM_TRAIN, CHOSEN = 16, 12  # records written, and data.dev_choose_samples
#: the Megatron indexed-data keys NxDT's file keeps from its pretraining template (none is read by SFT)
MEGATRON_LEFTOVERS = {"index_mapping_dir": None, "data_impl": "mmap", "skip_warmup": True, "dataloader_type": "single",
                      "reset_position_ids": False, "reset_attention_mask": False, "eod_mask_loss": False,
                      "validation_drop_last": True, "no_seqlen_plus_one_input_tokens": False,
                      "pad_samples_to_global_batch_size": False}


def _prompt(i: int) -> str:
    return f"how are you today, question {i}?"


def _answer(i: int) -> str:
    return f"the quick brown fox {i}" + " jumps" * (i % 3)


def _write_tokenizer(path: Path) -> Path:
    """The alignment tests' byte-level BPE (tests/test_alignment_data.py), saved as an HF tokenizer directory."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    texts = [_prompt(i) + " " + _answer(i) for i in range(NUM_TRAIN)]
    backend.train_from_iterator(texts * 5, trainer=trainer)
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", bos_token="<|im_start|>",
                            pad_token="<|endoftext|>").save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("nxdt_sft_layout")
    out = {"tokenizer": _write_tokenizer(root / "tokenizer"), "train": root / "training.jsonl",
           "val": root / "validation.jsonl"}
    for key, ids in (("train", range(NUM_TRAIN)), ("val", range(100, 104))):
        out[key].write_text("".join(json.dumps({"input": _prompt(i), "output": _answer(i)}) + "\n" for i in ids))
    return out


def _old_layout(files: dict[str, Path], run_dir: Path) -> dict[str, Any]:
    """NxDT's megatron_llama2_7B_SFT_config.yaml, key for key in its sections, shrunk (module docstring)."""
    return {
        "name": "megatron_llama", "model_source": "megatron", "seed": 1234,
        "trainer": {"devices": 1, "num_nodes": 1, "max_epochs": -1, "max_steps": 2, "log_every_n_steps": 1,
                    "val_check_interval": 2, "check_val_every_n_epoch": None, "num_sanity_val_steps": 0,
                    "limit_val_batches": 1, "limit_test_batches": 1, "gradient_clip_val": 1.0,
                    "enable_progress_bar": False},
        "exp_manager": {
            "log_local_rank_0_only": True, "create_tensorboard_logger": True, "explicit_log_dir": str(run_dir),
            "exp_dir": None, "name": "megatron_llama", "resume_if_exists": True, "resume_ignore_no_checkpoint": True,
            "create_checkpoint_callback": True,
            "checkpoint_callback_params": {
                "monitor": "step", "save_top_k": 1, "mode": "max", "save_last": False,
                "filename": "megatron_llama--{step}-{consumed_samples}",
                "model_parallel_size": "${multiply:${distributed_strategy.tensor_model_parallel_size}, "
                                       "${distributed_strategy.pipeline_model_parallel_size}}",
                "every_n_train_steps": 200, "use_master_weights_in_ckpt": False},
            "log_parameter_norm": True, "log_gradient_norm": True, "enable_recovery_time_instrumentation": False,
            "save_xser": True, "load_xser": True, "save_bf16": False, "async_checkpointing": False,
            "resume_from_checkpoint": None},
        "distributed_strategy": {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1,
                                 "virtual_pipeline_model_parallel_size": 1, "zero1": True, "sequence_parallel": True},
        "data": {
            "micro_batch_size": 1, "global_batch_size": 2, **MEGATRON_LEFTOVERS,
            "seq_length": "${model.encoder_seq_length}", "num_workers": 1, "packing": True,
            "use_sft_style_data_module": True, "train_dir": str(files["train"]), "val_dir": str(files["val"]),
            "dev_choose_samples": CHOSEN,
            "tokenizer": {"library": "huggingface", "type": str(files["tokenizer"]), "model": None,
                          "vocab_file": None, "merge_file": None, "delimiter": None, "sentencepiece_legacy": False,
                          "use_fast": False}},
        "model": {
            "encoder_seq_length": SEQ, "max_position_embeddings": "${.encoder_seq_length}", "num_layers": 2,
            "hidden_size": 64, "ffn_hidden_size": 128, "num_attention_heads": 4, "num_kv_heads": 4,
            "init_method_std": 0.021, "use_scaled_init_method": True, "hidden_dropout": 0, "attention_dropout": 0,
            "ffn_dropout": 0, "kv_channels": None, "apply_query_key_layer_scaling": True, "normalization": "rmsnorm",
            "layernorm_epsilon": 1e-5, "do_layer_norm_weight_decay": False, "make_vocab_size_divisible_by": 8,
            "persist_layer_norm": True, "share_embeddings_and_output_weights": False,
            "position_embedding_type": "rope", "rotary_percentage": 1, "activation": "swiglu",
            "transformer_block_type": "pre_ln", "has_bias": False, "use_cpu_initialization": True,
            "weight_init_only": False, "activations_checkpoint_granularity": "selective",
            "activations_checkpoint_recompute": ["CoreAttention"],
            "fusions": {"softmax": True, "flash_attention": False},
            "optim": {"name": "adamw", "lr": 3e-4, "weight_decay": 0.1, "capturable": True, "betas": [0.9, 0.95],
                      "sched": {"name": "CosineAnnealing", "warmup_steps": 1, "constant_steps": 0,
                                "min_lr": 3.0e-5}}},
        "precision": {"type": "mixed_precision", "master_weights": False, "fp32_grad_acc": False,
                      "xla_use_bf16": "0", "xla_downcast_bf16": "0", "neuron_rt_stochastic_rounding_en": "0"},
        "compiler_flags": "--model-type transformer", "compiler_cache_url": str(run_dir / "compile_cache"),
        "aync_exec_max_inflight_requests": 5, "bucket_size_collectives": 1024, "neuron_rt_exec_timeout": 100,
        "neuron_experimental_compress_rg": False,
    }


def _current_layout(old: dict[str, Any], packing: bool = True) -> dict[str, Any]:
    """The same run in NxDT's current spelling: ``model_alignment_strategy.sft.packing``, no old data keys."""
    new = copy.deepcopy(old)
    for key in ("use_sft_style_data_module", "packing", *MEGATRON_LEFTOVERS):
        new["data"].pop(key)
    new["model_alignment_strategy"] = {"sft": {"packing": packing}}
    return new


def _load(tree: dict[str, Any], tmp_path: Path, name: str = "config.yaml") -> NxdConfig:
    """Write ``tree`` as a YAML file and load it as train.py would (interpolations included)."""
    path = tmp_path / name
    path.write_text(yaml.safe_dump(tree, sort_keys=False))
    return load_config(OmegaConf.load(path), world_size=1)


def _flat(obj: Any, prefix: str = "") -> dict[str, Any]:
    if not dataclasses.is_dataclass(obj):
        return {prefix: obj}
    out: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        out.update(_flat(getattr(obj, f.name), f"{prefix}.{f.name}" if prefix else f.name))
    return out


def _problems(tree: dict[str, Any], tmp_path: Path) -> str:
    with pytest.raises(ConfigError) as info:
        _load(tree, tmp_path, "conflict.yaml")
    return "\n".join(info.value.problems)


# ---- (a) the old layout loads as the current one ----------------------------------------------------------------
@pytest.mark.parametrize("packing", [True, False])
def test_old_layout_loads_as_model_alignment_strategy_sft(files: dict[str, Path], tmp_path: Path,
                                                         packing: bool, caplog: pytest.LogCaptureFixture) -> None:
    old = _old_layout(files, tmp_path / "run")
    old["data"]["packing"] = packing
    with caplog.at_level("INFO", logger="nxd_lc.config.sft_style_layout"):
        mapped = _load(old, tmp_path, "old.yaml")
    current = _load(_current_layout(old, packing), tmp_path, "current.yaml")
    assert mapped.model_alignment_strategy == ModelAlignmentStrategyConfig(sft=SFTConfig(packing=packing))
    assert mapped.model_alignment_strategy.algorithm == "sft"
    mine, theirs = _flat(mapped), _flat(current)
    assert set(mine) == set(theirs)
    differing = {k: (mine[k], theirs[k]) for k in mine if mine[k] != theirs[k]}
    assert not differing, differing
    assert mapped == current
    # the rest of nxd_lc sees an ordinary SFT config: the old keys are consumed, the Megatron leftovers dropped
    assert mapped.data.use_sft_style_data_module is None and mapped.data.packing is None
    assert all(getattr(mapped.data, k) is None for k in MEGATRON_DATA_KEY_DEFAULTS)
    assert mapped.data.dev_choose_samples == CHOSEN and mapped.data.seq_length == SEQ
    text = caplog.text
    assert "'data.use_sft_style_data_module: true'" in text and f"(packing: {str(packing).lower()})" in text
    assert "data.data_impl" in text and "dropped" in text


def test_old_layout_validates_at_its_full_size(files: dict[str, Path], tmp_path: Path) -> None:
    """NxDT's sizes and layout as written (32 processes = TP 8 x DP 4, Llama-2 7B) pass validation."""
    full = _old_layout(files, tmp_path / "run")
    full["trainer"]["devices"] = 32
    full["distributed_strategy"]["tensor_model_parallel_size"] = 8
    full["data"]["global_batch_size"] = 64
    records = [line for line in files["train"].read_text().splitlines() if line.strip()]
    big = tmp_path / "training_64.jsonl"  # one global batch of records at least (validation counts them)
    big.write_text("\n".join(records * (64 // len(records) + 1)) + "\n")
    full["data"]["train_dir"] = str(big)
    full["model"].update(encoder_seq_length=4096, num_layers=32, hidden_size=4096, ffn_hidden_size=11008,
                         num_attention_heads=32, num_kv_heads=32)
    full["model"]["optim"]["sched"]["warmup_steps"] = 10
    full["trainer"]["max_steps"] = 5000
    path = tmp_path / "full.yaml"
    path.write_text(yaml.safe_dump(full, sort_keys=False))
    cfg = load_config(OmegaConf.load(path), world_size=32)
    assert cfg.model_alignment_strategy.sft.packing is True and cfg.data.seq_length == 4096


def test_packing_given_in_both_places_agreeing_is_read_once(files: dict[str, Path], tmp_path: Path) -> None:
    old = _old_layout(files, tmp_path / "run")
    old["model_alignment_strategy"] = {"sft": {"packing": True, "truncation_mode": "keep_end"}}
    cfg = _load(old, tmp_path)
    assert cfg.model_alignment_strategy.sft == SFTConfig(packing=True, truncation_mode="keep_end")
    # data.packing beside an SFT run chosen by model_alignment_strategy (no flag) is read the same way
    del old["data"]["use_sft_style_data_module"]
    old["model_alignment_strategy"] = {"sft": {"truncation_mode": "keep_end"}}
    for key in MEGATRON_LEFTOVERS:
        old["data"].pop(key)
    cfg = _load(old, tmp_path)
    assert cfg.model_alignment_strategy.sft == SFTConfig(packing=True, truncation_mode="keep_end")


def test_flag_beside_lora_adds_sft_to_it(files: dict[str, Path], tmp_path: Path) -> None:
    old = _old_layout(files, tmp_path / "run")
    old["model_alignment_strategy"] = {"peft": {"lora_rank": 4}}
    cfg = _load(old, tmp_path)
    assert cfg.model_alignment_strategy.algorithm == "sft" and cfg.model_alignment_strategy.sft.packing is True
    assert cfg.model_alignment_strategy.peft is not None and cfg.model_alignment_strategy.peft.lora_rank == 4


def test_flag_false_keeps_a_pretraining_run(files: dict[str, Path], tmp_path: Path) -> None:
    """``use_sft_style_data_module: false`` (without packing) is NxDT's default: the Megatron data module."""
    old = _old_layout(files, tmp_path / "run")
    old["data"].update(use_sft_style_data_module=False, data_prefix=[1.0, str(tmp_path / "corpus_text_document")])
    for key in ("packing", "train_dir", "val_dir", "dev_choose_samples"):
        old["data"].pop(key)
    cfg = _load(old, tmp_path)
    assert cfg.model_alignment_strategy is None and cfg.data.data_impl == "mmap"  # the Megatron keys stay


# ---- (c) conflicts ----------------------------------------------------------------------------------------------
def test_flag_with_another_algorithm_is_an_error(files: dict[str, Path], tmp_path: Path) -> None:
    old = _old_layout(files, tmp_path / "run")
    old["model_alignment_strategy"] = {"dpo": {"kl_beta": 0.1}}
    text = _problems(old, tmp_path)
    assert "data.use_sft_style_data_module: true selects SFT" in text and "sets dpo" in text, text
    assert "remove data.use_sft_style_data_module" in text, text


def test_packing_disagreeing_with_sft_packing_is_an_error(files: dict[str, Path], tmp_path: Path) -> None:
    old = _old_layout(files, tmp_path / "run")
    old["model_alignment_strategy"] = {"sft": {"packing": False}}
    text = _problems(old, tmp_path)
    assert "data.packing: true disagrees with model_alignment_strategy.sft.packing: false" in text, text


def test_packing_with_the_flag_off_is_an_error(files: dict[str, Path], tmp_path: Path) -> None:
    old = _old_layout(files, tmp_path / "run")
    old["data"]["use_sft_style_data_module"] = False
    text = _problems(old, tmp_path)
    assert "data.packing: true packs SFT records, but data.use_sft_style_data_module: false" in text, text
    assert "set data.use_sft_style_data_module: true" in text, text


def test_other_misuses_name_the_keys(files: dict[str, Path], tmp_path: Path) -> None:
    old = _old_layout(files, tmp_path / "run")
    flag_off_with_sft = copy.deepcopy(old)
    flag_off_with_sft["data"].update(use_sft_style_data_module=False)
    flag_off_with_sft["data"].pop("packing")
    flag_off_with_sft["model_alignment_strategy"] = {"sft": {}}
    assert "data.use_sft_style_data_module: false, but model_alignment_strategy.sft" in _problems(
        flag_off_with_sft, tmp_path)
    packing_in_pretraining = _current_layout(old)
    del packing_in_pretraining["model_alignment_strategy"]
    packing_in_pretraining["data"]["packing"] = False
    assert "data.packing: packs SFT records (NxDT's older SFT layout), but this run is pretraining" in _problems(
        packing_in_pretraining, tmp_path)
    not_bool = copy.deepcopy(old)
    not_bool["data"]["use_sft_style_data_module"] = "sometimes"
    assert "data.use_sft_style_data_module: invalid value 'sometimes'" in _problems(not_bool, tmp_path)
    not_a_section = copy.deepcopy(old)
    not_a_section["model_alignment_strategy"] = "sft"
    assert "model_alignment_strategy: must be a mapping" in _problems(not_a_section, tmp_path)
    # a Megatron data key NxDT's template leaves at a non-default value is not dropped: it would need data_prefix
    changed = copy.deepcopy(old)
    changed["data"]["reset_position_ids"] = True
    text = _problems(changed, tmp_path)
    assert "data.reset_position_ids: applies to Megatron indexed data only" in text and "data_impl" not in text, text


def test_typed_config_with_the_old_keys_set_is_refused(files: dict[str, Path], tmp_path: Path) -> None:
    """A typed config built in code does not pass the loader's mapping: the keys would be ignored, so they are
    refused by validation."""
    cfg = _load(_current_layout(_old_layout(files, tmp_path / "run")), tmp_path)
    assert cross_field_problems(cfg, world_size=1) == []
    cfg.data.packing = True
    problems = cross_field_problems(cfg, world_size=1)
    assert len(problems) == 1 and problems[0].startswith("data.packing: NxDT's older SFT layout"), problems


# ---- (b) it trains (about 2 s on CPU) ---------------------------------------------------------------------------
def test_old_layout_trains_two_steps_on_response_tokens_only(files: dict[str, Path], tmp_path: Path) -> None:
    from nxd_lc.app.run import _shutdown_distributed, run
    from nxd_lc.data.alignment_datamodule import ModelAlignmentDataModule
    from nxd_lc.data.alignment_packing import IGNORE_INDEX

    saved = dict(os.environ)  # the run sets RANK / WORLD_SIZE and the config's variables: restored after it
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(key, None)  # one process of its own
    path = tmp_path / "megatron_llama2_sft_shrunk.yaml"
    path.write_text(yaml.safe_dump(_old_layout(files, tmp_path / "run"), sort_keys=False))
    try:
        trainer = run(OmegaConf.load(path))
    finally:
        _shutdown_distributed()
        os.environ.clear()
        os.environ.update(saved)
    assert trainer.global_step == 2
    loss = trainer.callback_metrics["reduced_train_loss"]
    assert torch.isfinite(loss) and 0 < float(loss) < 20, loss
    assert torch.isfinite(trainer.callback_metrics["val_loss"])
    data = trainer.datamodule
    assert isinstance(data, ModelAlignmentDataModule) and data.algorithm == "sft"
    assert data.alignment_cfg.sft.packing is True
    assert data.train_stats.num_records == CHOSEN and data.train_stats.num_dropped == 0  # dev_choose_samples

    tok = AutoTokenizer.from_pretrained(files["tokenizer"])
    loader = data.train_dataloader()
    assert next(iter(loader))["labels"].shape == (1, SEQ)  # data.micro_batch_size rows of data.seq_length
    batch = loader.collate_fn([data.train_dataset[i] for i in range(len(data.train_dataset))])  # every row
    seen, most = [], 0
    for ids, labels, segments in zip(batch["input_ids"], batch["labels"], batch["segment_ids"], strict=True):
        in_row = 0
        for seg in segments.unique().tolist():
            where = segments == seg
            text = tok.decode(ids[where].tolist())
            if "question" not in text:
                assert bool((labels[where] == IGNORE_INDEX).all()), text  # padding trains nothing
                continue
            i = int(text.split("question ")[1].split("?")[0])
            targets = labels[where][labels[where] != IGNORE_INDEX].tolist()
            # labels are shifted (labels[t] = input_ids[t + 1]): exactly the response and its EOS are trained
            assert tok.decode(targets) == _answer(i) + tok.eos_token, (text, tok.decode(targets))
            seen.append(i)
            in_row += 1
        most = max(most, in_row)
    assert sorted(seen) == list(range(CHOSEN))  # the first data.dev_choose_samples records, each once
    assert most >= 2, "data.packing: true puts several records in a row"
