"""DPO / ORPO LightningModule (issue 6, items 4-5): the step's loss against the formulas on full-vocab
log-probs, precomputed reference log-probs == frozen-copy reference (and the cache: written once, reused, keyed),
LoRA's base model as the reference, TP=2 / CP=2 / DP=2 against one process, the frozen copy outside state_dict.

A tiny Llama and a byte-level BPE trained here (no downloads); the data are real ``ModelAlignmentDataModule``
pairs from jsonl files.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from dist_utils import local_shard, run_distributed
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, PreTrainedTokenizerFast

from nxd_lc.alignment import NxDPreferenceModel
from nxd_lc.alignment.reference import reference_fingerprint, weights_checksum
from nxd_lc.config.alignment_schema import DPOConfig, ModelAlignmentStrategyConfig, ORPOConfig
from nxd_lc.config.peft_schema import PeftConfig
from nxd_lc.config.schema import DataConfig, NxdConfig
from nxd_lc.context import set_context_parallel_algo
from nxd_lc.data.alignment_datamodule import ModelAlignmentDataModule
from nxd_lc.distributed import collectives, parallel_state
from nxd_lc.layers.lora import apply_lora, lora_modules
from nxd_lc.models.llama import LlamaForCausalLM

pytestmark = pytest.mark.compat  # torch-2.9 compatibility subset (lane 2; docs/testing.md)

SEQ, MICRO, VOCAB, ATOL = 48, 2, 512, 1e-5
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


# ---- fixtures ------------------------------------------------------------------------------------------------
def _tokenizer() -> PreTrainedTokenizerFast:
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator(["the quick brown fox jumps over the lazy dog", "how are you today"] * 5,
                                trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", bos_token="<|im_start|>",
                                   pad_token="<|endoftext|>", chat_template=CHATML)


def _write_data(root: Path) -> tuple[str, str]:
    """train.jsonl (6 pairs) and val.jsonl (4 pairs) of string and chat records, different response lengths."""
    def rec(i: int) -> dict[str, Any]:
        if i % 2:
            return {"prompt": [{"role": "user", "content": f"how are you {i}"}],
                    "chosen": [{"role": "assistant", "content": "the quick fox" + " jumps" * (i % 3)}],
                    "rejected": [{"role": "assistant", "content": "lazy dog " * (1 + i % 4)}]}
        return {"prompt": f"how are you today {i}?", "chosen": "fox " * (1 + i % 3), "rejected": "the dog"}
    root.mkdir(parents=True, exist_ok=True)
    for name, ids in (("train.jsonl", range(6)), ("val.jsonl", range(10, 14))):
        (root / name).write_text("".join(json.dumps(rec(i)) + "\n" for i in ids))
    return str(root / "train.jsonl"), str(root / "val.jsonl")


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerFast:
    return _tokenizer()


@pytest.fixture()
def data(tmp_path: Path) -> tuple[str, str]:
    return _write_data(tmp_path / "data")


def _llama_config() -> LlamaConfig:
    return LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                       tie_word_embeddings=False)


def _cfg(data: tuple[str, str], algorithm: str = "dpo", **section: Any) -> NxdConfig:
    cfg = NxdConfig()
    cfg.data = DataConfig(micro_batch_size=MICRO, global_batch_size=MICRO, train_dir=data[0], val_dir=data[1])
    sub = DPOConfig(kl_beta=0.5, **section) if algorithm == "dpo" else ORPOConfig(beta=0.3, **section)
    cfg.model_alignment_strategy = ModelAlignmentStrategyConfig(**{algorithm: sub})
    return cfg


def _datamodule(cfg: NxdConfig, tok: PreTrainedTokenizerFast, seq: int = SEQ, dp: int = 1,
                dp_rank: int = 0) -> ModelAlignmentDataModule:
    dm = ModelAlignmentDataModule(cfg.data, cfg.model_alignment_strategy, seq_length=seq, seed=0,
                                  model_vocab_size=VOCAB, data_parallel_rank=dp_rank, data_parallel_size=dp,
                                  global_batch_size=MICRO * dp, tokenizer=tok)
    dm.setup()
    return dm


def _perturb(model: torch.nn.Module, seed: int = 1) -> None:
    """Move the policy away from the reference so the DPO margin is not zero."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))


def _full_log_probs(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """By hand: log_softmax over the whole vocab (TP=1) in float64, gathered at the labels, summed per row."""
    logits = model(batch["input_ids"], batch["position_ids"], segment_ids=batch["segment_ids"]).double()
    labels = batch["labels"]
    valid = labels != -100
    token = torch.log_softmax(logits, -1).gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (token * valid).sum(1), valid.sum(1).double()


# ---- 1. the DPO step is the formula on full-vocab log-probs ---------------------------------------------------
@pytest.mark.parametrize("loss_type", [["sigmoid", "sft"], "hinge", "ipo"])
def test_dpo_step_matches_formula(tok: PreTrainedTokenizerFast, data: tuple[str, str], loss_type: Any) -> None:
    cfg = _cfg(data, precompute_ref_log_probs=False, loss_type=loss_type,
               sft_loss_weight=0.3 if isinstance(loss_type, list) else None)
    torch.manual_seed(0)
    model = LlamaForCausalLM(_llama_config())
    reference = copy.deepcopy(model)
    module = NxDPreferenceModel(cfg, model)
    module.prepare_reference()
    assert module.reference_source == "frozen_copy"
    _perturb(model)
    batches = list(_datamodule(cfg, tok).train_dataloader())[:2]
    losses, accs = [], []
    for i, batch in enumerate(batches):
        loss = module.training_step(batch, i)
        loss.backward()
        with torch.no_grad():
            pol, n = _full_log_probs(model, batch)
            ref, _ = _full_log_probs(reference, batch)
        if loss_type == "ipo":
            pol, ref = pol / n, ref / n
        pc, pr, rc, rr = pol[:MICRO], pol[MICRO:], ref[:MICRO], ref[MICRO:]
        h = (pc - rc) - (pr - rr)
        if loss_type == "hinge":
            want = torch.relu(1 - 0.5 * h).mean()
        elif loss_type == "ipo":
            want = ((h - 1 / (2 * 0.5)) ** 2).mean()
        else:
            want = -F.logsigmoid(0.5 * h).mean() + 0.3 * (-pc / n[:MICRO]).mean()
        assert abs(loss.item() - want.item()) < ATOL, (loss_type, loss.item(), want.item())
        losses.append(loss.item())
        accs.append((0.5 * (pc - rc) > 0.5 * (pr - rr)).double().mean().item())
    assert all(p.grad is not None for p in model.parameters())
    assert all(p.grad is None and not p.requires_grad for p in module._frozen.model.parameters())
    metrics = module.reduced_step_metrics()  # mean over the two micro-batches (DP = 1)
    assert {"rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins"} <= set(metrics)
    assert abs(metrics["rewards/accuracies"].item() - sum(accs) / 2) < 1e-6
    assert abs((module._loss_acc / module._loss_count).item() - sum(losses) / 2) < 1e-6  # reduced_train_loss
    assert module.reduced_step_metrics() == {}  # reset after reading


# ---- 2. precomputed reference == frozen copy; the cache ---------------------------------------------------------
def test_precomputed_reference_equals_frozen_copy_and_is_cached(tok: PreTrainedTokenizerFast,
                                                                data: tuple[str, str]) -> None:
    torch.manual_seed(0)
    base = LlamaForCausalLM(_llama_config())
    pre = NxDPreferenceModel(_cfg(data, precompute_ref_log_probs=True), copy.deepcopy(base))
    dm = _datamodule(pre.cfg, tok)
    pre.prepare_reference(dm)
    path = pre.reference_cache_file
    assert pre.reference_source == "computed" and os.path.isfile(path)
    assert os.path.dirname(path) == os.path.dirname(data[0]) and "train.jsonl.ref_logps-" in path
    frozen = NxDPreferenceModel(_cfg(data, precompute_ref_log_probs=False), copy.deepcopy(base))
    frozen.prepare_reference(dm)
    for split, loader in (("train", dm.train_dataloader()), ("val", dm.val_dataloader())):
        for batch in loader:
            (ps_, pc_), (fs, fc) = pre._reference_log_probs(batch, split), frozen._reference_log_probs(batch, split)
            torch.testing.assert_close(ps_, fs, atol=ATOL, rtol=0)
            assert torch.equal(pc_, fc) and (pc_ > 0).all()
    _perturb(pre.model)  # training moves the policy; the table stays that of the initial policy
    _perturb(frozen.model)
    batch = next(iter(dm.train_dataloader()))
    torch.testing.assert_close(pre._reference_log_probs(batch, "train")[0],
                               frozen._reference_log_probs(batch, "train")[0], atol=ATOL, rtol=0)
    step = pre.training_step(batch, 0)
    torch.testing.assert_close(step, frozen.training_step(batch, 0), atol=ATOL, rtol=0)
    assert abs(step.item() - 0.6931) > 1e-3  # the policy moved: not the log(2) of policy == reference
    mtime = os.stat(path).st_mtime_ns
    again = NxDPreferenceModel(_cfg(data, precompute_ref_log_probs=True), copy.deepcopy(base))
    again.prepare_reference(_datamodule(again.cfg, tok))
    assert again.reference_source == "cache" and again.reference_cache_file == path
    assert os.stat(path).st_mtime_ns == mtime
    assert all(torch.equal(again._ref_tables[k], pre._ref_tables[k]) for k in ("train", "val"))
    longer = NxDPreferenceModel(_cfg(data, precompute_ref_log_probs=True), copy.deepcopy(base))
    longer.prepare_reference(_datamodule(longer.cfg, tok, seq=64))  # seq_length is part of the key
    assert longer.reference_source == "computed" and longer.reference_cache_file != path
    assert weights_checksum(pre.model) != weights_checksum(base)  # the weights are part of the key
    key = reference_fingerprint(dm, base, hf_weights_dir=None, precision={"p": "fp32"})
    assert key != reference_fingerprint(dm, base, hf_weights_dir=None, precision={"p": "bf16"})


def test_lora_reference_is_the_base_model(tok: PreTrainedTokenizerFast, data: tuple[str, str]) -> None:
    torch.manual_seed(0)
    base = LlamaForCausalLM(_llama_config())
    pre = NxDPreferenceModel(_cfg(data, precompute_ref_log_probs=True), copy.deepcopy(base))
    dm = _datamodule(pre.cfg, tok)
    pre.prepare_reference(dm, cache_dir=str(Path(data[0]).parent / "cache"))
    lora_model = copy.deepcopy(base)
    apply_lora(lora_model, PeftConfig(lora_rank=4, lora_dropout=0.1, target_modules=["qkv_proj", "down_proj"]))
    with torch.no_grad():
        for m in lora_modules(lora_model).values():
            m.lora_B.normal_(0.0, 0.5)  # adapters that change the output
    module = NxDPreferenceModel(_cfg(data, precompute_ref_log_probs=False), lora_model)
    module.prepare_reference(dm)
    assert module.reference_source == "lora_base" and module._frozen is None
    batch = next(iter(dm.train_dataloader()))
    ref, _ = module._reference_log_probs(batch, "train")
    torch.testing.assert_close(ref, pre._reference_log_probs(batch, "train")[0], atol=ATOL, rtol=0)
    assert lora_model.training and all(m.lora_scale > 0 for m in lora_modules(lora_model).values())
    policy = module._sequence_log_probs(lora_model, batch)[0]
    assert (policy - ref).abs().max() > 1e-3
    loss = module.training_step(batch, 0)
    loss.backward()
    assert all((p.grad is not None) == ("lora_" in n) for n, p in lora_model.named_parameters())


# ---- 4. ORPO, and the validation metrics ---------------------------------------------------------------------
def test_orpo_step_matches_formula_and_validation_metrics(tok: PreTrainedTokenizerFast,
                                                          data: tuple[str, str]) -> None:
    cfg = _cfg(data, "orpo")
    torch.manual_seed(0)
    module = NxDPreferenceModel(cfg, LlamaForCausalLM(_llama_config()))
    module.prepare_reference()  # no reference for ORPO
    assert module.reference_source is None
    dm = _datamodule(cfg, tok)
    batch = next(iter(dm.train_dataloader()))
    loss = module.training_step(batch, 0)
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in module.model.parameters())
    with torch.no_grad():
        sums, n = _full_log_probs(module.model, batch)
    m = sums / n
    odds = (m - torch.log1p(-torch.exp(m)))
    want = (-m[:MICRO]).mean() - 0.3 * F.logsigmoid(odds[:MICRO] - odds[MICRO:]).mean()
    assert abs(loss.item() - want.item()) < ATOL
    module.on_validation_epoch_start()
    pair_losses, pair_acc = [], []
    with torch.no_grad():
        for i, vb in enumerate(dm.val_dataloader()):
            module.validation_step(vb, i)
            s, c = _full_log_probs(module.model, vb)
            mv = s / c
            o = mv - torch.log1p(-torch.exp(mv))
            pair_losses.append(((-mv[:MICRO]) - 0.3 * F.logsigmoid(o[:MICRO] - o[MICRO:])).mean().item())
            pair_acc.append((mv[:MICRO] > mv[MICRO:]).double().mean().item())
    val = module.validation_metrics()
    assert abs(val["val_loss"].item() - sum(pair_losses) / len(pair_losses)) < ATOL  # equal-size batches
    assert abs(val["val_rewards/accuracies"].item() - sum(pair_acc) / len(pair_acc)) < 1e-6


# ---- 5. the frozen copy is not part of the module ------------------------------------------------------------
def test_frozen_reference_not_in_state_dict_or_optimizer(data: tuple[str, str]) -> None:
    torch.manual_seed(0)
    model = LlamaForCausalLM(_llama_config())
    module = NxDPreferenceModel(_cfg(data, precompute_ref_log_probs=False), model)
    module.prepare_reference()
    assert module._frozen is not None and module._frozen.num_bytes > 0
    assert set(module.state_dict()) == {f"model.{k}" for k in model.state_dict()}
    assert len(list(module.parameters())) == len(list(model.parameters()))
    opt = module.configure_optimizers()["optimizer"]
    in_opt = {id(p) for g in opt.param_groups for p in g["params"]}
    assert not in_opt & {id(p) for p in module._frozen.model.parameters()}
    with pytest.raises(RuntimeError, match="prepare_reference"):
        NxDPreferenceModel(_cfg(data), LlamaForCausalLM(_llama_config()))._reference_log_probs({}, "train")
    with pytest.raises(ValueError, match="dpo.loss_type"):
        NxDPreferenceModel(_cfg(data, loss_type="kto"), model)
    with pytest.raises(ValueError, match="precompute_ref_log_probs"):
        NxDPreferenceModel(_cfg(data), LlamaForCausalLM(_llama_config())).prepare_reference()


# ---- 3. TP=2, CP=2 and DP=2 against one process --------------------------------------------------------------
def _load(model: LlamaForCausalLM, weights: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(local_shard(model, name, weights[name]))


def _dpo_step(model: LlamaForCausalLM, cfg: NxdConfig, initial: dict, policy: dict,
              batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Frozen reference from ``initial``, policy ``policy``, one step + the module's gradient reductions;
    returns the DP x CP mean of the returned (cp-scaled) loss divided by cp: the pairs' loss."""
    _load(model, initial)
    module = NxDPreferenceModel(cfg, model)
    module.prepare_reference()
    _load(model, policy)
    model.zero_grad()
    loss = module.training_step(batch, 0)
    loss.backward()
    module.on_before_optimizer_step(None)
    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    cp = parallel_state.get_context_parallel_world_size()
    return collectives.all_reduce(loss.detach().clone(), group, op="avg") / cp


def _table(model: LlamaForCausalLM, cfg: NxdConfig, dm: ModelAlignmentDataModule, weights: dict,
           cache_dir: str) -> dict[str, torch.Tensor]:
    _load(model, weights)
    module = NxDPreferenceModel(cfg, model)
    module.prepare_reference(dm, cache_dir=cache_dir)
    assert module.reference_source == "computed"
    return module._ref_tables


def _reference(data: tuple[str, str], tok: PreTrainedTokenizerFast, cache: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model = LlamaForCausalLM(_llama_config())
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    _perturb(model)
    policy = {n: p.detach().clone() for n, p in model.named_parameters()}
    cfg = _cfg(data, precompute_ref_log_probs=False, loss_type=["sigmoid", "sft"], sft_loss_weight=0.3)
    dm = _datamodule(cfg, tok)
    batch = next(iter(dm.train_dataloader()))
    loss = _dpo_step(model, cfg, initial, policy, batch)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    table = _table(LlamaForCausalLM(_llama_config()), _cfg(data), dm, initial, os.path.join(cache, "tp1"))
    return {"initial": initial, "policy": policy, "batch": batch, "loss": loss, "grads": grads, "table": table}


def _check_layout(tag: str, tp: int, data: tuple[str, str], tok: PreTrainedTokenizerFast, ref: dict,
                  cache: str) -> None:
    cfg = _cfg(data, precompute_ref_log_probs=False, loss_type=["sigmoid", "sft"], sft_loss_weight=0.3)
    model = LlamaForCausalLM(_llama_config(), sequence_parallel=tp > 1)
    loss = _dpo_step(model, cfg, ref["initial"], ref["policy"], ref["batch"])
    torch.testing.assert_close(loss, ref["loss"], atol=ATOL, rtol=0, msg=f"{tag} loss")
    for name, param in model.named_parameters():
        want = local_shard(model, name, ref["grads"][name])
        torch.testing.assert_close(param.grad, want, atol=ATOL, rtol=0, msg=f"{tag} grad {name}")
    dp, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    dm = _datamodule(_cfg(data), tok, dp=dp, dp_rank=dp_rank)
    table = _table(LlamaForCausalLM(_llama_config(), sequence_parallel=tp > 1), _cfg(data), dm, ref["initial"],
                   os.path.join(cache, tag))
    for split in ("train", "val"):
        torch.testing.assert_close(table[split], ref["table"][split], atol=ATOL, rtol=0, msg=f"{tag} {split}")
    if collectives.get_global_rank() == 0:
        # one file, written by global rank 0, under the same (TP/CP/DP-independent) key as the one-process run
        assert os.listdir(os.path.join(cache, tag)) == os.listdir(os.path.join(cache, "tp1"))


def _worker(rank: int, world: int, data: tuple[str, str], tok: PreTrainedTokenizerFast, ref: dict,
            cache: str) -> None:
    set_context_parallel_algo("ring")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    _check_layout("tp2", 2, data, tok, ref, cache)
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(context_parallel_size=2)
    _check_layout("cp2", 1, data, tok, ref, cache)
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel()  # DP = 2: the table is split over DP and all-gathered
    _check_layout("dp2", 1, data, tok, ref, cache)


@pytest.mark.distributed
@pytest.mark.slow
def test_tp2_cp2_dp2_dpo_step_and_reference_table_match_single_process(tok: PreTrainedTokenizerFast,
                                                                       data: tuple[str, str],
                                                                       tmp_path: Path) -> None:
    cache = str(tmp_path / "cache")
    ref = _reference(data, tok, cache)
    run_distributed(_worker, 2, data, tok, ref, cache)
