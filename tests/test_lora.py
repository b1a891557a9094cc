"""LoRA on the tensor-parallel layers (nxd_lc.layers.lora) and the ``model_alignment_strategy.peft`` schema.

A tiny Llama (vocab 64, 4 query heads, 2 or 1 KV heads, 2 layers) is built from one seed; with
``use_cpu_initialization`` every TP size holds slices of the same full weights, and ``apply_lora`` after a fixed
seed gives the same full ``A`` at any TP size. Nonzero full ``B`` tensors are loaded with
``load_lora_state_dict(full=True)``. The TP=1 reference (logits, loss, full adapter gradients, global grad norm,
logits after 3 SGD steps, merged logits) is computed in the test process; 2 gloo processes repeat it at TP=2 with
sequence parallelism (fused qkv; unfused qkv with kv_replicator=2) and without (separate q/k/v_proj).
"""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_distributed
from transformers import LlamaConfig

from nxd_lc.config.peft_schema import LORA_TARGET_MODULES, PeftConfig, peft_problems
from nxd_lc.distributed import collectives, grads, parallel_state
from nxd_lc.layers.lora import (
    LoraColumnParallelLinear,
    LoraGQAQKVColumnParallelLinear,
    LoraRowParallelLinear,
    apply_lora,
    load_lora_state_dict,
    lora_disabled,
    lora_dropout,
    lora_modules,
    lora_state_dict,
    merge_lora,
)
from nxd_lc.models.common.checkpointing import apply_activation_checkpointing
from nxd_lc.models.common.loss import causal_lm_loss
from nxd_lc.models.llama import LlamaForCausalLM

pytestmark = pytest.mark.compat  # torch-2.9 compatibility subset (lane 2; docs/testing.md)

VOCAB, B, S, STEPS, LR = 64, 2, 8, 3, 0.1
ALL = list(LORA_TARGET_MODULES)
close = torch.testing.assert_close
# (model kwargs, num_key_value_heads, kv_replicator at TP=2, target_modules)
CASES = [
    ({"sequence_parallel": True, "fuse_qkv": True}, 2, 1, ALL),
    ({"sequence_parallel": True, "fuse_qkv": False}, 1, 2, ALL),
    ({"sequence_parallel": False, "qkv_linear": False}, 2, 1, ["qkv_proj", "down_proj"]),
]


def _config(num_kv_heads: int = 2) -> LlamaConfig:
    return LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=num_kv_heads, max_position_embeddings=64,
                       rms_norm_eps=1e-5, initializer_range=0.1)


def _peft(targets: list[str], dropout: float = 0.0) -> PeftConfig:
    return PeftConfig(lora_rank=4, lora_alpha=8.0, lora_dropout=dropout, target_modules=list(targets))


def _build(kw: dict, nkv: int, kv_replicator: int, targets: list[str]) -> LlamaForCausalLM:
    torch.manual_seed(0)
    model = LlamaForCausalLM(_config(nkv), kv_replicator=kv_replicator, **kw)
    torch.manual_seed(1)
    apply_lora(model, _peft(targets))
    return model


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, VOCAB, (B, S), generator=gen)
    return ids, torch.cat([ids[:, 1:], torch.full((B, 1), -100)], dim=1)


def _full_logits(model: LlamaForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids).detach().contiguous()
    return collectives.all_gather(logits, -1, parallel_state.get_tensor_model_parallel_group())[..., :VOCAB]


def _loss_backward(model: LlamaForCausalLM, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean loss, backward, then the TP gradient reductions of nxd_lc.lightning.module (SP/partial, KV replicas)."""
    model.zero_grad(set_to_none=True)
    loss_sum, num = causal_lm_loss(model(ids), labels)
    loss = loss_sum / num
    loss.backward()
    grads.allreduce_sequence_parallel_gradients(model)
    grads.allreduce_kv_replica_gradients(model)
    return loss.detach()


def _full_grads(model: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    out = {}
    for name, m in lora_modules(model).items():
        out[f"{name}.lora_A"], out[f"{name}.lora_B"] = m.gather_full_lora(m.lora_A.grad, m.lora_B.grad)
    return out


def _run(model: LlamaForCausalLM, b_full: dict[str, torch.Tensor]) -> dict[str, object]:
    """Everything compared across TP sizes; the same code at TP=1 and TP=2."""
    ids, labels = _data()
    load_lora_state_dict(model, b_full, full=True)
    res: dict[str, object] = {"sd": lora_state_dict(model, full=True), "logits": _full_logits(model, ids)}
    res["loss"] = _loss_backward(model, ids, labels)
    res["grads"] = _full_grads(model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert {n for n, p in model.named_parameters() if p.requires_grad} == set(res["sd"])  # adapters only
    res["norm"] = grads.global_grad_norm(trainable)
    for _ in range(STEPS):
        with torch.no_grad():
            for p in trainable:
                p.sub_(LR * p.grad)
        _loss_backward(model, ids, labels)
    res["trained"] = _full_logits(model, ids)
    merge_lora(model)
    res["merged"] = _full_logits(model, ids)
    return res


def _b_full(model: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    """The model's full adapters with every B replaced by a fixed random [out, r] tensor."""
    gen = torch.Generator().manual_seed(7)
    sd = lora_state_dict(model, full=True)
    return {k: (0.2 * torch.randn(v.shape, generator=gen) if k.endswith("lora_B") else v) for k, v in sd.items()}


def _reference(case: tuple) -> tuple[dict[str, torch.Tensor], dict[str, object]]:
    kw, nkv, _, targets = case
    model = _build(kw, nkv, 1, targets)
    b_full = _b_full(model)
    return b_full, _run(model, b_full)


def _check(res: dict[str, object], ref: dict[str, object], what: str) -> None:
    for key in ("logits", "loss", "norm", "trained", "merged"):
        close(res[key], ref[key], atol=2e-5, rtol=0, msg=f"{what}: {key}")
    for group in ("sd", "grads"):
        assert res[group].keys() == ref[group].keys()
        for name, value in ref[group].items():
            close(res[group][name], value, atol=2e-5, rtol=0, msg=f"{what}: {group} {name}")
    close(res["merged"], res["trained"], atol=1e-5, rtol=0, msg=f"{what}: merged vs adapters")


# ---- TP = 1 ------------------------------------------------------------------------------------------------------
def test_apply_lora_wraps_freezes_and_starts_from_base() -> None:
    torch.manual_seed(0)
    model = LlamaForCausalLM(_config())
    ids, _ = _data()
    base = model(ids).detach()
    names = apply_lora(model, _peft(ALL))
    assert names == [f"layers.{i}.{m}" for i in range(2) for m in
                     ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")]
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {f"{n}.lora_{x}" for n in names for x in "AB"}
    close(model(ids), base, atol=0, rtol=0)  # B = 0: exactly the base model
    load_lora_state_dict(model, _b_full(model), full=True)
    adapted = model(ids).detach()
    assert (adapted - base).abs().max() > 1e-2
    with lora_disabled(model):
        close(model(ids), base, atol=0, rtol=0)  # adapters off: the base model again
    close(model(ids), adapted, atol=0, rtol=0)
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    assert isinstance(attn.qkv_proj, LoraGQAQKVColumnParallelLinear)
    assert isinstance(mlp.gate_up_proj, LoraColumnParallelLinear) and isinstance(mlp.down_proj, LoraRowParallelLinear)
    assert attn.qkv_proj.lora_A.shape == (4, 32) and attn.qkv_proj.lora_B.shape == (64, 4)
    assert mlp.gate_up_proj.lora_B.partition_stride == 2 and mlp.down_proj.lora_A.partition_dim == 1
    assert mlp.gate_up_proj.lora_A.sequence_parallel_enabled and mlp.down_proj.lora_B.sequence_parallel_enabled
    assert not mlp.gate_up_proj.lora_A.tensor_model_parallel and not mlp.down_proj.lora_B.tensor_model_parallel
    bound = 1 / 32 ** 0.5  # Kaiming-uniform(a=sqrt(5)) on the full fan-in
    assert 0.5 * bound < attn.qkv_proj.lora_A.abs().max() <= bound
    assert "layers.0.mlp.gate_up_proj.weight" in model.state_dict()  # base keys unchanged


def test_initial_adapters_do_not_depend_on_the_pipeline_split() -> None:
    """A pipeline stage holds only its layers (the others are placeholders), so it creates fewer adapters; each
    adapter's ``A`` must still start from the values it has when one device holds every layer (issue 39: LoRA at
    PP 2 started from other values, and trained to another gradient norm, 1.654 against 1.469)."""
    def adapters(keep_layers: set[int] | None) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        model = LlamaForCausalLM(_config(), keep_layers=keep_layers)
        torch.manual_seed(1)
        apply_lora(model, _peft(ALL))
        return {n: p.detach().clone() for n, p in model.named_parameters() if n.endswith("lora_A")}

    whole = adapters(None)
    second_stage = adapters({1})
    assert second_stage and set(second_stage) < set(whole)
    for name, a in second_stage.items():
        close(a, whole[name], atol=0, rtol=0)
    assert not torch.equal(whole["layers.0.self_attn.qkv_proj.lora_A"], whole["layers.1.self_attn.qkv_proj.lora_A"])


def test_bad_config_and_targets_raise() -> None:
    model = LlamaForCausalLM(_config())
    with pytest.raises(ValueError, match=r"model_alignment_strategy\.peft\.target_modules: unknown module name\(s\) "
                                         r"\['q_proj'\]; valid names: qkv_proj, o_proj, gate_up_proj, down_proj"):
        apply_lora(model, _peft(["q_proj"]))
    with pytest.raises(ValueError, match=r"model_alignment_strategy\.peft\.lora_rank: must be an integer >= 1"):
        apply_lora(model, PeftConfig(lora_rank=0))
    assert all(p.requires_grad for p in model.parameters())  # nothing changed by a rejected call
    apply_lora(model, _peft(["o_proj"]))
    with pytest.raises(ValueError, match="already has LoRA adapters"):
        apply_lora(model, _peft(["o_proj"]))
    problems = peft_problems(PeftConfig(lora_alpha=0, lora_dropout=1.0, lora_bias="all", target_modules=[],
                                        load_lora_from_ckpt=True))
    keys = [p.split(":")[0].removeprefix("model_alignment_strategy.peft.") for p in problems]
    assert keys == ["lora_alpha", "lora_dropout", "lora_bias", "target_modules", "lora_ckpt_path"]
    assert all(p.startswith("model_alignment_strategy.peft.") for p in problems)
    assert peft_problems(PeftConfig()) == [] and peft_problems(None) == []
    assert "listed more than once" in peft_problems(PeftConfig(target_modules=["o_proj", "o_proj"]))[0]


def test_tp1_training_then_merge_equals_adapters() -> None:
    _, ref = _reference(CASES[0])
    close(ref["merged"], ref["trained"], atol=1e-5, rtol=0)
    torch.manual_seed(0)
    base = LlamaForCausalLM(_config())(_data()[0]).detach()
    assert (ref["trained"] - base).abs().max() > 1e-2  # the adapters changed the model: not a vacuous check


def test_state_dict_round_trip_and_errors() -> None:
    model = _build({}, 2, 1, ALL)
    b_full = _b_full(model)
    load_lora_state_dict(model, b_full, full=True)
    ids, _ = _data()
    want = model(ids).detach()
    local = {k: v.clone() for k, v in lora_state_dict(model).items()}
    assert set(local) == {k for k in model.state_dict() if ".lora_" in k}
    fresh = _build({}, 2, 1, ALL)
    torch.manual_seed(3)
    load_lora_state_dict(fresh, local)
    close(fresh(ids), want, atol=0, rtol=0)
    close(lora_state_dict(fresh, full=True), b_full, atol=0, rtol=0)
    with pytest.raises(ValueError, match=r"missing keys \['layers.0.mlp.down_proj.lora_A'\]"):
        load_lora_state_dict(fresh, {k: v for k, v in local.items() if k != "layers.0.mlp.down_proj.lora_A"})
    bad = dict(local, **{"layers.0.mlp.down_proj.lora_B": torch.zeros(32, 3)})
    with pytest.raises(ValueError, match=r"layers\.0\.mlp\.down_proj\.lora_B has shape \(32, 3\)"):
        load_lora_state_dict(fresh, bad)
    with pytest.raises(ValueError, match="no LoRA adapters"):
        load_lora_state_dict(LlamaForCausalLM(_config()), local)


def test_dropout_and_activation_checkpointing() -> None:
    model = _build({}, 2, 1, ALL)
    load_lora_state_dict(model, _b_full(model), full=True)
    ids, labels = _data()
    eval_out = model(ids).detach()
    for m in lora_modules(model).values():
        m.lora_dropout_p = 0.5
    model.eval()
    close(model(ids), eval_out, atol=0, rtol=0)  # no dropout in eval mode
    model.train()
    assert (model(ids) - eval_out).abs().max() > 1e-3
    x = torch.ones(4000)
    kept = lora_dropout(x, 0.25, training=True, sharded=False)
    assert torch.all((kept == 0) | torch.isclose(kept, torch.tensor(4 / 3)))  # inverted dropout: x / (1 - p)
    assert abs((kept > 0).float().mean().item() - 0.75) < 0.05
    # activation checkpointing (applied after LoRA) replays the same dropout masks: same grads as without
    torch.manual_seed(11)
    _loss_backward(model, ids, labels)
    plain = {k: v.clone() for k, v in _full_grads(model).items()}
    apply_activation_checkpointing(model, "full")
    torch.manual_seed(11)
    _loss_backward(model, ids, labels)
    close(_full_grads(model), plain, atol=1e-6, rtol=0)


def test_tiled_mlp_is_rejected_until_merge() -> None:
    model = _build({}, 2, 1, ["gate_up_proj"])
    ids, _ = _data()
    model.layers[0].mlp.tiled_chunk_size = 4
    with pytest.raises(ValueError, match="model.tiled_mlp_chunk_size"):
        model(ids)
    merge_lora(model)
    model(ids)  # tiled MLP works again once the adapters are merged
    with pytest.raises(ValueError, match="model.tiled_mlp_chunk_size"):
        apply_lora(model, _peft(["down_proj"]))


# ---- TP = 2 (gloo) -----------------------------------------------------------------------------------------------
def _tp2_worker(rank: int, world: int, refs: list) -> None:
    torch.set_num_threads(1)
    for case, (b_full, ref) in zip(CASES, refs):
        kw, nkv, kv_replicator, targets = case
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=world, kv_replicator=kv_replicator)
        model = _build(kw, nkv, kv_replicator, targets)
        local = {k: v.clone() for k, v in lora_state_dict(model).items()}
        _check(_run(model, b_full), ref, f"TP=2 {kw} kv_replicator={kv_replicator}")
        load_lora_state_dict(_build(kw, nkv, kv_replicator, targets), local)  # per-rank shards load back
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    group = parallel_state.get_tensor_model_parallel_group()
    torch.manual_seed(3)  # same RNG state on both ranks: shared masks for replicated inputs, independent for shards
    masks = {s: lora_dropout(torch.ones(1, 2000), 0.5, True, sharded=s) for s in (False, True)}
    shared, sharded = (collectives.all_gather(masks[s], 0, group) for s in (False, True))
    assert torch.equal(shared[0], shared[1]) and not torch.equal(sharded[0], sharded[1])
    assert set(sharded.unique().tolist()) == {0.0, 2.0} and abs((sharded > 0).float().mean().item() - 0.5) < 0.05


@pytest.mark.distributed
def test_tp2_matches_tp1_with_sequence_parallel_and_kv_replicas() -> None:
    run_distributed(_tp2_worker, 2, [_reference(case) for case in CASES])
