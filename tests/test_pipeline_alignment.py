"""DPO and ORPO under pipeline parallelism (PP=2, gloo, 2 processes) against transformers in one process.

A tiny random HF Llama (4 layers, tied embeddings) is saved twice with save_pretrained: the initial weights (the
DPO reference) and perturbed weights (the policy). The data are real ``ModelAlignmentDataModule`` pairs (the
jsonl files and byte-level BPE of ``test_alignment_module``); at PP=2 the training batch groups the step's 2
micro-batches of 1 pair (rows: chosen 0, chosen 1, rejected 0, rejected 1).

Reference (plain PyTorch on transformers' logits): sequence log-probs = sum of the labelled tokens'
log-softmax; per pair the DPO sigmoid loss ``-log sigmoid(beta ((pc - rc) - (pr - rr)))`` or ORPO's
``-mean_c - lambda log sigmoid(log_odds(mean_c) - log_odds(mean_r))`` with ``log_odds(m) = m - log(1 - e^m)``;
the step's loss is the mean over the 2 micro-batches and the gradients are those of that mean.

nxd_lc: ``NxDPreferenceModel`` at PP=2 -- the reference table computed through the pipeline (forward only) by
``prepare_reference``, one ``training_step`` (the 1F1B schedule with the preference loss on the last stage), the
module's gradient reductions, its step metrics, and one ``validation_step``. The loss, every parameter's gradient
(gathered over the stages, the tied embedding summed), the reward metrics, the reference table and the
validation metrics must match, on both ranks; the reference cache file has the one-process run's key.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from dist_utils import grads_in_hf_layout, run_distributed
from test_alignment_module import _tokenizer, _write_data
from transformers import LlamaConfig
from transformers import LlamaForCausalLM as HFLlama

from nxd_lc.alignment import NxDPreferenceModel
from nxd_lc.config.alignment_schema import DPOConfig, ModelAlignmentStrategyConfig, ORPOConfig
from nxd_lc.config.schema import DataConfig, NxdConfig
from nxd_lc.data.alignment_datamodule import ModelAlignmentDataModule, collate_pairs
from nxd_lc.distributed import parallel_state as ps
from nxd_lc.models.hf_config import build_llama_config
from nxd_lc.models.llama import LlamaForCausalLM, load_hf_weights
from nxd_lc.pipeline import stage_layer_ranges

SEQ, VOCAB, LAYERS, N_MB, KL_BETA, ORPO_BETA = 48, 512, 4, 2, 0.5, 0.3
ATOL = 2e-5
REWARDS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins")


def _cfg(data: tuple[str, str], algorithm: str, pp: int, live: bool = False) -> NxdConfig:
    cfg = NxdConfig()
    cfg.data = DataConfig(micro_batch_size=1, global_batch_size=N_MB, train_dir=data[0], val_dir=data[1])
    cfg.distributed_strategy.pipeline_model_parallel_size = pp
    sub = DPOConfig(kl_beta=KL_BETA, precompute_ref_log_probs=not live) if algorithm == "dpo" \
        else ORPOConfig(beta=ORPO_BETA)
    cfg.model_alignment_strategy = ModelAlignmentStrategyConfig(**{algorithm: sub})
    return cfg


def _datamodule(cfg: NxdConfig, micro_batches_per_batch: int) -> ModelAlignmentDataModule:
    dm = ModelAlignmentDataModule(cfg.data, cfg.model_alignment_strategy, seq_length=SEQ, seed=0,
                                  model_vocab_size=VOCAB, data_parallel_rank=0, data_parallel_size=1,
                                  global_batch_size=N_MB, tokenizer=_tokenizer())
    dm.micro_batches_per_batch = micro_batches_per_batch
    dm.setup()
    return dm


# ---- the single-process reference (transformers) ----------------------------------------------------------------
def _hf_log_probs(hf: HFLlama, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row (sum of labelled-token log-softmax [R] fp32, labelled-token count [R] fp32)."""
    logits = hf(batch["input_ids"], position_ids=batch["position_ids"]).logits.float()
    labels = batch["labels"]
    valid = labels != -100
    token = torch.log_softmax(logits, -1).gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (token * valid).sum(1), valid.sum(1).float()


def _log_odds(m: torch.Tensor) -> torch.Tensor:
    return m - torch.log(-torch.expm1(m))


def _pair_loss(algorithm: str, pol: torch.Tensor, n: torch.Tensor, ref: torch.Tensor | None, c: int, r: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, chosen reward, rejected reward) of the pair with chosen row c and rejected row r."""
    if algorithm == "dpo":
        assert ref is not None
        chosen, rejected = KL_BETA * (pol[c] - ref[c]), KL_BETA * (pol[r] - ref[r])
        return -F.logsigmoid(chosen - rejected), chosen, rejected
    mc, mr = pol[c] / n[c], pol[r] / n[r]
    return -mc - ORPO_BETA * F.logsigmoid(_log_odds(mc) - _log_odds(mr)), ORPO_BETA * mc, ORPO_BETA * mr


def _reference(algorithm: str, initial: str, policy: str, train: dict[str, torch.Tensor],
               val: dict[str, torch.Tensor], dm: ModelAlignmentDataModule) -> dict[str, Any]:
    ref_model = HFLlama.from_pretrained(initial, attn_implementation="eager").float()
    with torch.no_grad():
        tables = {}
        for split, ds in (("train", dm.train_dataset), ("val", dm.val_dataset)):
            rows = []
            for i in range(len(ds)):
                s, n = _hf_log_probs(ref_model, collate_pairs([ds[i]]))
                rows.append(torch.stack([s[0], n[0], s[1], n[1]]))
            tables[split] = torch.stack(rows)
        ref_train, ref_val = _hf_log_probs(ref_model, train)[0], _hf_log_probs(ref_model, val)[0]
    hf = HFLlama.from_pretrained(policy, attn_implementation="eager").float()
    pol, n = _hf_log_probs(hf, train)
    pairs = [_pair_loss(algorithm, pol, n, ref_train, m, N_MB + m) for m in range(N_MB)]
    loss = torch.stack([p[0] for p in pairs]).mean()  # mean over the 2 micro-batches of 1 pair
    loss.backward()
    chosen, rejected = torch.stack([p[1] for p in pairs]).detach(), torch.stack([p[2] for p in pairs]).detach()
    metrics = {"rewards/chosen": chosen.mean(), "rewards/rejected": rejected.mean(),
               "rewards/accuracies": (chosen > rejected).float().mean(), "rewards/margins": (chosen - rejected).mean()}
    with torch.no_grad():
        vpol, vn = _hf_log_probs(hf, val)
        vloss, vc, vr = _pair_loss(algorithm, vpol, vn, ref_val, 0, 1)
    return {"loss": loss.detach(), "grads": {k: p.grad.clone() for k, p in hf.named_parameters()},
            "metrics": metrics, "tables": tables,
            "val": {"val_loss": vloss, "val_rewards/accuracies": (vc > vr).float(), "val_rewards/margins": vc - vr}}


# ---- the pipeline-parallel run ----------------------------------------------------------------------------------
def _rank_model(ckpt: str) -> LlamaForCausalLM:
    pp, rank = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    ranges = stage_layer_ranges(LAYERS, pp, 1)
    model = LlamaForCausalLM(build_llama_config(ckpt), keep_layers=set(ranges[rank]), keep_embedding=rank == 0,
                             keep_head=rank == pp - 1)
    load_hf_weights(model, ckpt)
    return model


def _worker(rank: int, world: int, algorithm: str, data: tuple[str, str], initial: str, policy: str,
            train: dict[str, torch.Tensor], val: dict[str, torch.Tensor], ref: dict[str, Any], cache: str) -> None:
    ps.initialize_model_parallel(pipeline_model_parallel_size=world)
    live = algorithm == "dpo_live"
    algorithm = "dpo" if live else algorithm
    cfg = _cfg(data, algorithm, world, live=live)
    model = _rank_model(initial)
    module = NxDPreferenceModel(cfg, model)
    assert module.pipeline is not None
    if live:  # a frozen copy of the initial weights, run through its own forward-only pipeline every step
        module.prepare_reference()
        assert module.reference_source == "frozen_copy" and module._frozen_pipeline is not None
    elif algorithm == "dpo":  # the reference table through the pipeline, forward only, on every rank
        module.prepare_reference(_datamodule(cfg, N_MB), cache_dir=cache)
        assert module.reference_source == "computed"
        # the cache key leaves the pipeline layout out: the same file name as the one-process run's
        assert os.path.basename(module.reference_cache_file or "") == ref["cache_name"]
        for split, table in ref["tables"].items():
            torch.testing.assert_close(module._ref_tables[split], table, atol=ATOL, rtol=0, msg=split)
    load_hf_weights(model, policy)
    loss = module.training_step(train, 0)
    torch.testing.assert_close(loss, ref["loss"], atol=ATOL, rtol=0)  # CP 1: the pairs' loss, on every rank
    module.on_before_optimizer_step(None)  # tied-embedding (first + last stage) and DP reductions
    grads = grads_in_hf_layout(model)
    assert set(grads) == set(ref["grads"])
    for name, g in grads.items():
        torch.testing.assert_close(g, ref["grads"][name], atol=ATOL, rtol=0, msg=lambda m, n=name: f"{n}: {m}")
    metrics = module.reduced_step_metrics()
    for name in REWARDS:
        torch.testing.assert_close(metrics[name], ref["metrics"][name], atol=ATOL, rtol=0, msg=name)
    module.on_validation_epoch_start()
    with torch.no_grad():
        module.validation_step(val, 0)
    for name, value in module.validation_metrics().items():
        torch.testing.assert_close(value, ref["val"][name].reshape(()), atol=ATOL, rtol=0, msg=name)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """(initial, policy) HF checkpoint directories: tied embeddings, the policy perturbed from the initial."""
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=LAYERS,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True)
    torch.manual_seed(0)
    hf = HFLlama._from_config(config, attn_implementation="eager").float()
    root = tmp_path_factory.mktemp("pp_align")
    hf.save_pretrained(root / "initial")
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    hf.save_pretrained(root / "policy")
    return str(root / "initial"), str(root / "policy")


@pytest.mark.compat
@pytest.mark.distributed
@pytest.mark.parametrize("algorithm", ["dpo", "dpo_live", "orpo"])
def test_preference_pp2_matches_transformers(checkpoints: tuple[str, str], tmp_path: Path, algorithm: str) -> None:
    """``dpo_live``: DPO with ``precompute_ref_log_probs: false`` (the frozen copy's forward-only pipeline pass
    in every step and validation step), against the same transformers reference as the precomputed table."""
    data = _write_data(tmp_path / "data")
    initial, policy = checkpoints
    base = "dpo" if algorithm == "dpo_live" else algorithm
    dm = _datamodule(_cfg(data, base, 2), N_MB)
    train = next(iter(dm.train_dataloader()))  # the step's 2 micro-batches of 1 pair: [4, S], chosen rows first
    assert train["input_ids"].shape[0] == 2 * N_MB and train["sample_index"].shape == (N_MB,)
    val = next(iter(dm.val_dataloader()))  # one pair
    ref = _reference(base, initial, policy, train, val, dm)
    if algorithm == "dpo":  # the one-process (PP=1) table's cache file
        single = NxDPreferenceModel(_cfg(data, algorithm, 1), _rank_model(initial))
        single.prepare_reference(_datamodule(_cfg(data, algorithm, 1), 1), cache_dir=os.fspath(tmp_path / "pp1"))
        ref["cache_name"] = os.path.basename(single.reference_cache_file or "")
    run_distributed(_worker, 2, algorithm, data, initial, policy, train, val, ref, os.fspath(tmp_path / "cache"))


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.lane1_only
def test_smollm2_dpo_with_pipeline_parallelism(tmp_path: Path) -> None:
    """``cpu_smollm2_dpo_config`` (DPO + LoRA, precomputed reference log-probs) through ``train.py`` at PP=2 (one
    SmolLM2 layer per stage, 2 micro-batches per step): the reference table is computed through the pipeline,
    2 steps train and log the reward metrics, validation logs its preference metrics."""
    smollm2 = pytest.importorskip("test_smollm2_e2e")  # skips without the gguf package
    model = smollm2._model_dir()
    data = smollm2._write_data(tmp_path / "data")
    log = tmp_path / "dpo_pp"
    text = smollm2._run("cpu_smollm2_dpo_config", model, data, log, model, [
        "distributed_strategy.context_parallel_size=1", "distributed_strategy.pipeline_model_parallel_size=2",
        "model_alignment_strategy.dpo.max_prompt_length=128"])
    assert "LoRA rank 16" in text and "rewards/accuracies" in text and "val_rewards/accuracies" in text, text[-4000:]
    assert list((log / "ref_logps").glob("dpo_train.jsonl.ref_logps-*.pt")), "the reference table was not cached"
    assert not list(data.glob("*.ref_logps-*")), "written next to the user's data"
    assert (log / "lora" / "adapters.pt").is_file() and (log / "hf_merged" / "model.safetensors").is_file()
