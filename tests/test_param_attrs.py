"""Device moves keep what the parallel layers attached to their parameters (DESIGN.md principle 17;
nxd_lc.layers.param_attrs).

On torch-xla and PrivateUse1 devices ``module.to(device)`` creates new Parameter objects without the attributes;
on CPU ``torch.__future__.set_overwrite_module_params_on_conversion(True)`` makes every conversion do the same, so
these tests reproduce the bug with the flag on (and show a plain ``.to()`` loses everything), then check the
production move paths: ``move_module``, ``NxDStrategy.model_to_device``, the training build + move
(``nxd_lc.app.run._build_and_move``) and the DPO frozen reference. The TP=2 test compares the global gradient norm
after the production move with the single-process reference norm (gloo, 2 processes); the ``xla`` test shows the
loss and the fix on a real XLA device (lane 2).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from dist_utils import run_distributed
from torch import nn
from transformers import LlamaConfig, MixtralConfig
from transformers import LlamaForCausalLM as HFLlama

from nxd_lc.config.peft_schema import PeftConfig
from nxd_lc.distributed import parallel_state
from nxd_lc.distributed.grads import (
    allreduce_kv_replica_gradients,
    allreduce_sequence_parallel_gradients,
    global_grad_norm,
)
from nxd_lc.layers.lora import apply_lora
from nxd_lc.layers.param_attrs import (
    PARALLEL_ATTRIBUTES,
    check_parallel_attributes,
    move_module,
    record_parallel_attributes,
    restore_parallel_attributes,
)
from nxd_lc.lightning.strategy import NxDStrategy
from nxd_lc.models.common.loss import causal_lm_loss
from nxd_lc.models.hf_config import build_llama_config
from nxd_lc.models.llama import LlamaForCausalLM, load_hf_weights
from nxd_lc.models.mixtral import MixtralForCausalLM

pytestmark = pytest.mark.compat  # torch-2.9 compatibility subset (lane 2; docs/testing.md)

VOCAB, B, S = 97, 2, 8


@pytest.fixture
def overwrite_params() -> Iterator[None]:
    """Conversions create new Parameter objects (as ``.to()`` does on XLA) for the test; the flag is restored."""
    old = torch.__future__.get_overwrite_module_params_on_conversion()
    torch.__future__.set_overwrite_module_params_on_conversion(True)
    try:
        yield
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(old)


def _llama_config(**kw: Any) -> LlamaConfig:
    args: dict[str, Any] = {
        "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
    }
    args.update(kw)
    return LlamaConfig(**args)


def _llama_sp_lora() -> nn.Module:
    model = LlamaForCausalLM(_llama_config(), sequence_parallel=True)
    apply_lora(model, PeftConfig(lora_rank=4, lora_alpha=8.0, lora_dropout=0.0,
                                 target_modules=["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]))
    return model


def _llama_tied() -> nn.Module:
    return LlamaForCausalLM(_llama_config(tie_word_embeddings=True), sequence_parallel=True)


def _llama_last_stage_tied_copy() -> nn.Module:
    """The last pipeline stage of a tied model: its lm head holds the embedding's copy (pipeline_tied_copy)."""
    return LlamaForCausalLM(_llama_config(tie_word_embeddings=True), keep_layers=[1], keep_embedding=False)


def _llama_first_stage_tied() -> nn.Module:
    return LlamaForCausalLM(_llama_config(tie_word_embeddings=True), keep_layers=[0], keep_head=False)


def _mixtral() -> nn.Module:
    config = MixtralConfig(vocab_size=96, hidden_size=32, intermediate_size=24, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                           max_position_embeddings=64, tie_word_embeddings=False)
    return MixtralForCausalLM(config, sequence_parallel=True)


#: builder -> the attributes its model must carry somewhere (so the comparison below covers every kind)
MODELS: dict[str, tuple[Callable[[], nn.Module], set[str]]] = {
    "llama_sp_lora": (_llama_sp_lora, {"tensor_model_parallel", "partition_dim", "partition_stride",
                                       "sequence_parallel_enabled"}),
    "llama_tied": (_llama_tied, {"tensor_model_parallel", "sequence_parallel_enabled"}),
    "pipeline_tied_copy": (_llama_last_stage_tied_copy, {"pipeline_tied", "pipeline_tied_copy"}),
    "pipeline_tied": (_llama_first_stage_tied, {"pipeline_tied"}),
    "mixtral": (_mixtral, {"expert_model_parallel", "keep_fp32", "sequence_parallel_enabled"}),
}


def _build(name: str) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[name][0]()


def _ids(module: nn.Module) -> dict[str, int]:
    return {n: id(p) for n, p in module.named_parameters(remove_duplicate=False)}


def _assert_replaced_and_kept(module: nn.Module, before_ids: dict[str, int],
                              before: dict[str, dict[str, Any]]) -> None:
    """Every Parameter object is new, and every parameter carries exactly its recorded attributes."""
    after_ids = _ids(module)
    assert after_ids.keys() == before_ids.keys()
    kept = [n for n in after_ids if after_ids[n] == before_ids[n]]
    assert not kept, f"the move kept these Parameter objects, so it proves nothing: {kept}"
    assert record_parallel_attributes(module) == before
    check_parallel_attributes(module)
    check_parallel_attributes(module, expected=before)


def test_the_list_names_every_attribute_the_layers_set() -> None:
    seen: set[str] = set()
    for name in MODELS:
        model = _build(name)
        attrs = {a for d in record_parallel_attributes(model).values() for a in d}
        assert MODELS[name][1] <= attrs, name
        seen |= attrs
        # nothing else the layers hang on parameters (besides the optimizer's main_grad buffer, a tensor)
        extra = {a for p in model.parameters() for a in vars(p)} - set(PARALLEL_ATTRIBUTES)
        assert not extra, f"{name}: parameter attributes missing from PARALLEL_ATTRIBUTES: {sorted(extra)}"
    # kv_replicated* need TP > 1 (below); partition_order TP 4 with 2 KV heads interleaved (test_nxd_checkpoints)
    assert seen == set(PARALLEL_ATTRIBUTES) - {"kv_replicated", "kv_replicated_rows", "partition_order"}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_plain_to_loses_the_attributes_move_module_keeps_them(name: str, overwrite_params: None) -> None:
    plain = _build(name)
    before = record_parallel_attributes(plain)
    assert all(before.values()), "every parameter of a freshly built model carries parallel attributes"
    plain.to(torch.float64)  # the bug: new Parameter objects, no attributes
    assert all(not attrs for attrs in record_parallel_attributes(plain).values())
    first = next(iter(before))
    with pytest.raises(RuntimeError, match=rf"parameter '{first}' carries neither"):
        check_parallel_attributes(plain)
    with pytest.raises(RuntimeError, match=rf"parameter '{first}' lost its parallel attribute"):
        check_parallel_attributes(plain, expected=before)

    model = _build(name)
    assert record_parallel_attributes(model) == before
    ties = {n for n, p in model.named_parameters(remove_duplicate=False)} - {n for n, _ in model.named_parameters()}
    ids = _ids(model)
    assert move_module(model, dtype=torch.float64) is model
    _assert_replaced_and_kept(model, ids, before)
    assert all(p.dtype == torch.float64 for p in model.parameters())
    if ties:  # the tied lm head is still the embedding's Parameter (a plain move unties them)
        assert model.lm_head.weight is model.embed_tokens.weight
        assert plain.lm_head.weight is not plain.embed_tokens.weight


class _Holder(pl.LightningModule):
    """The LightningModule the strategy moves (the model under ``model.``)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model


def _strategy_move(module: pl.LightningModule) -> None:
    """The production device move of training: ``NxDStrategy.model_to_device`` (root device: this CPU), on the
    LightningModule connected as the Trainer does."""
    strategy = NxDStrategy(parallel_devices=[torch.device("cpu")])
    strategy.connect(module)
    strategy.model_to_device()
    assert strategy.model is module


@pytest.mark.parametrize("name", ["llama_sp_lora", "llama_tied", "mixtral"])
def test_strategy_model_to_device_keeps_every_attribute(name: str, overwrite_params: None) -> None:
    holder = _Holder(_build(name))
    before, ids = record_parallel_attributes(holder), _ids(holder)
    assert all(n.startswith("model.") for n in before)
    _strategy_move(holder)
    _assert_replaced_and_kept(holder, ids, before)


def test_strategy_fails_fast_on_a_model_that_lost_its_attributes_before(overwrite_params: None) -> None:
    """A model stripped before the strategy's move (a plain ``.to()`` elsewhere) fails there, naming the first
    parameter, instead of training with a wrong gradient norm."""
    holder = _Holder(_build("llama_sp_lora"))
    holder.to(torch.float64)
    with pytest.raises(RuntimeError, match=r"parameter 'embed_tokens\.weight' carries neither tensor_model_parallel"):
        _strategy_move(holder)
    _strategy_move(_Holder(nn.Linear(2, 2)))  # not an nxd_lc model: moved, no layer rule to check


def test_xla_strategy_moves_through_the_same_method() -> None:
    """NxDXLAStrategy inherits NxDStrategy's move (before XLAStrategy's plain ``.to()`` in the MRO)."""
    from nxd_lc.lightning.xla import NxDXLAStrategy

    assert NxDXLAStrategy.model_to_device is NxDStrategy.model_to_device


def test_training_build_and_move_keeps_the_attributes(overwrite_params: None) -> None:
    """``train.py``'s build + device move (nxd_lc.app.run._build_and_move) on the tiny CPU config."""
    from omegaconf import OmegaConf

    from nxd_lc.app.run import _build_and_move
    from nxd_lc.app.validation import load_config
    from nxd_lc.config.resolvers import register_resolvers

    register_resolvers()
    raw = OmegaConf.load("conf/cpu_tiny_llama_config.yaml")
    raw.trainer.devices = 1
    raw.distributed_strategy.tensor_model_parallel_size = 1
    raw.distributed_strategy.context_parallel_size = 1
    raw.model.hf_weights_dir = None
    cfg = load_config(raw)
    _, model = _build_and_move(cfg, SimpleNamespace(accelerator="cpu", device=torch.device("cpu"), local_rank=0))
    attrs = record_parallel_attributes(model)
    assert attrs and all(attrs.values())
    check_parallel_attributes(model)


def test_check_names_the_parameter_that_lost_an_attribute() -> None:
    model = _build("llama_sp_lora")
    before = record_parallel_attributes(model)
    check_parallel_attributes(model)
    check_parallel_attributes(model, expected=before)

    down = model.layers[1].mlp.down_proj.weight
    del down.partition_stride
    with pytest.raises(RuntimeError, match=r"parameter 'layers\.1\.mlp\.down_proj\.weight' lost its parallel "
                                           r"attribute 'partition_stride'"):
        check_parallel_attributes(model, expected=before)
    check_parallel_attributes(model)  # the layers' rule only asks for one of the layout flags
    del down.tensor_model_parallel, down.partition_dim
    with pytest.raises(RuntimeError, match=r"parameter 'layers\.1\.mlp\.down_proj\.weight' carries neither "
                                           r"tensor_model_parallel nor sequence_parallel_enabled"):
        check_parallel_attributes(model)
    restore_parallel_attributes(model, before)
    check_parallel_attributes(model, expected=before)

    norm = model.layers[0].input_layernorm.weight
    del norm.sequence_parallel_enabled
    with pytest.raises(RuntimeError, match=r"parameter 'layers\.0\.input_layernorm\.weight' carries neither"):
        check_parallel_attributes(model)
    norm.sequence_parallel_enabled = False  # recorded True (sequence parallel): another value fails too
    with pytest.raises(RuntimeError, match=r"'layers\.0\.input_layernorm\.weight': parallel attribute "
                                           r"'sequence_parallel_enabled' is False, recorded True"):
        check_parallel_attributes(model, expected=before)
    norm.sequence_parallel_enabled = True
    with pytest.raises(RuntimeError, match=r"parameter 'no\.such\.weight' was recorded"):
        check_parallel_attributes(model, expected={**before, "no.such.weight": {"tensor_model_parallel": True}})
    with pytest.raises(KeyError, match="no.such.weight"):
        restore_parallel_attributes(model, {"no.such.weight": {"tensor_model_parallel": True}})


def test_only_plain_metadata_is_recorded() -> None:
    model = _build("llama_tied")
    p = model.norm.weight
    p.main_grad = torch.zeros_like(p)  # the optimizer's buffer: device state, not a parallel attribute
    assert "main_grad" not in record_parallel_attributes(model)["norm.weight"]
    p.partition_dim = torch.tensor(0)
    with pytest.raises(TypeError, match=r"parameter 'norm\.weight': attribute 'partition_dim' is Tensor"):
        record_parallel_attributes(model)


def test_frozen_reference_keeps_the_attributes(overwrite_params: None) -> None:
    """The DPO reference: a deep copy (which drops Parameter attributes) moved every step."""
    from nxd_lc.alignment.reference import FrozenReference

    model = _build("llama_tied")
    before = record_parallel_attributes(model)
    ref = FrozenReference(model)
    assert record_parallel_attributes(ref.model) == before
    assert ref.model.lm_head.weight is ref.model.embed_tokens.weight
    ids = _ids(ref.model)
    ref.to(torch.device("cpu"))
    _assert_replaced_and_kept(ref.model, ids, before)
    assert ref.model.lm_head.weight is ref.model.embed_tokens.weight
    assert not any(p.requires_grad for p in ref.model.parameters())


# ---- TP=2 over gloo: the global gradient norm after the production move equals the TP=1 norm ----------------
@pytest.fixture(scope="module")
def hf_ckpt(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A tiny HF Llama with ONE KV head (replicated twice at TP=2: kv_replicated parameters too), a batch, and
    the single-process TP=1 reference gradient norm (plain model, no move)."""
    torch.manual_seed(0)
    hf = HFLlama._from_config(_llama_config(num_key_value_heads=1), attn_implementation="eager").float()
    path = tmp_path_factory.mktemp("hf_tiny_kv1")
    hf.save_pretrained(path)
    ids = torch.randint(0, VOCAB, (B, S))
    labels = torch.cat([ids[:, 1:], torch.full((B, 1), -100)], dim=1)
    model = LlamaForCausalLM(build_llama_config(str(Path(path) / "config.json")))
    load_hf_weights(model, str(path))
    loss_sum, num = causal_lm_loss(model(ids), labels)
    (loss_sum / num).backward()
    ref = float(global_grad_norm(model.parameters()))
    return {"ckpt": str(path), "ids": ids, "labels": labels, "ref_norm": ref}


def _tp2_norm_worker(rank: int, world: int, setup: dict[str, Any]) -> None:
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world, kv_replicator=2)
    torch.manual_seed(123)
    model = LlamaForCausalLM(build_llama_config(setup["ckpt"]), sequence_parallel=True, kv_replicator=2)
    load_hf_weights(model, setup["ckpt"])
    holder = _Holder(model)
    before, ids = record_parallel_attributes(holder), _ids(holder)
    kinds = {a for d in before.values() for a in d}
    assert {"kv_replicated", "kv_replicated_rows", "sequence_parallel_enabled"} <= kinds, kinds
    old = torch.__future__.get_overwrite_module_params_on_conversion()
    torch.__future__.set_overwrite_module_params_on_conversion(True)
    try:
        _strategy_move(holder)  # the production move path of training
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(old)
    loss_sum, num = causal_lm_loss(model(setup["ids"]), setup["labels"])
    (loss_sum / num).backward()
    allreduce_sequence_parallel_gradients(model)  # as the LightningModule's on_before_optimizer_step
    allreduce_kv_replica_gradients(model)
    norm, ref = float(global_grad_norm(model.parameters())), setup["ref_norm"]
    assert math.isclose(norm, ref, rel_tol=1e-5), f"rank {rank}: TP=2 grad norm {norm:.6f} vs TP=1 {ref:.6f}"
    _assert_replaced_and_kept(holder, ids, before)


@pytest.mark.distributed
def test_tp2_grad_norm_after_the_production_move_equals_tp1(hf_ckpt: dict[str, Any]) -> None:
    run_distributed(_tp2_norm_worker, 2, hf_ckpt)


# ---- lane 2: a real XLA device -------------------------------------------------------------------------------
@pytest.mark.xla
def test_xla_move_module_keeps_what_plain_to_drops() -> None:
    pytest.importorskip("torch_xla")
    from nxd_lc.runtime import xla as xla_runtime

    device = xla_runtime.xla_device()
    plain = _build("llama_tied")
    before = record_parallel_attributes(plain)
    plain.to(device)  # the bug on XLA: new Parameter objects without attributes, ties broken
    assert all(p.device.type == "xla" for p in plain.parameters())
    assert all(not attrs for attrs in record_parallel_attributes(plain).values())
    assert plain.lm_head.weight is not plain.embed_tokens.weight
    with pytest.raises(RuntimeError, match="carries neither"):
        check_parallel_attributes(plain)

    model = _build("llama_tied")
    ids = _ids(model)
    move_module(model, device)
    assert all(p.device.type == "xla" for p in model.parameters())
    _assert_replaced_and_kept(model, ids, before)
    assert model.lm_head.weight is model.embed_tokens.weight
