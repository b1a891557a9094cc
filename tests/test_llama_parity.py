"""Logits and gradient parity of nxd_lc's Llama with transformers' LlamaForCausalLM (eager, fp32).

One tiny random HF model (vocab 97 -> padded at TP 2 and 4; 4 query heads, 2 KV heads) is saved
with save_pretrained and loaded with load_hf_weights at TP=1 (in process), TP=2 + sequence
parallel (2 gloo processes; plus the unfused and qkv_linear=False variants) and TP=4 with
kv_replicator=2 (4 gloo processes; fuse_qkv True and False).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from dist_utils import run_distributed
from transformers import LlamaConfig
from transformers import LlamaForCausalLM as HFLlama

from nxd_lc.context.attention import core_attention
from nxd_lc.distributed import collectives, parallel_state
from nxd_lc.distributed.grads import allreduce_kv_replica_gradients, allreduce_sequence_parallel_gradients
from nxd_lc.layers import merge_tensor_shards
from nxd_lc.models.common.loss import causal_lm_loss
from nxd_lc.models.common.rope import RotaryEmbedding, rope_spec_from_config
from nxd_lc.models.hf_config import build_llama_config
from nxd_lc.models.llama import LlamaForCausalLM, load_hf_weights

VOCAB, B, S = 97, 2, 8
ATOL = 2e-5
# HF parameter names whose gradients are compared (layer 0, plus embeddings and final norm).
GRAD_NAMES = [
    "model.embed_tokens.weight", "model.layers.0.input_layernorm.weight",
    "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
    "model.layers.0.self_attn.v_proj.weight", "model.layers.0.self_attn.o_proj.weight",
    "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight",
    "model.layers.0.mlp.down_proj.weight", "model.norm.weight", "lm_head.weight",
]


def _tiny_config(**kw: object) -> LlamaConfig:
    args: dict[str, object] = {
        "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    }
    args.update(kw)
    return LlamaConfig(**args)


def _reference(hf: HFLlama, ids: torch.Tensor, labels: torch.Tensor) -> dict[str, object]:
    """HF logits [B,S,V], mean loss over labelled tokens, and grads of GRAD_NAMES."""
    hf.zero_grad()
    logits = hf(ids).logits
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100)
    loss.backward()
    params = dict(hf.named_parameters())
    grads = {n: params[n].grad.detach().clone() for n in GRAD_NAMES}
    return {"logits": logits.detach(), "loss": loss.detach(), "grads": grads}


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    torch.manual_seed(0)
    hf = HFLlama._from_config(_tiny_config(), attn_implementation="eager").float()
    ckpt = tmp_path_factory.mktemp("hf_tiny")
    hf.save_pretrained(ckpt)
    ids = torch.randint(0, VOCAB, (B, S))
    labels = torch.cat([ids[:, 1:], torch.full((B, 1), -100)], dim=1)
    labels[0, :2] = -100  # a few ignored positions
    return {"ckpt": str(ckpt), "ids": ids, "labels": labels, **_reference(hf, ids, labels)}


def _our_grads_tp1(model: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    """Our TP=1 grads under HF names (qkv fused rows and gate/up halves split)."""
    layer = model.layers[0]
    q, k, v = layer.self_attn.qkv_proj.weight_qkv.grad.split([32, 16, 16])
    gate, up = layer.mlp.gate_up_proj.weight.grad.chunk(2)
    return {
        "model.embed_tokens.weight": model.embed_tokens.weight.grad,
        "model.layers.0.input_layernorm.weight": layer.input_layernorm.weight.grad,
        "model.layers.0.self_attn.q_proj.weight": q, "model.layers.0.self_attn.k_proj.weight": k,
        "model.layers.0.self_attn.v_proj.weight": v,
        "model.layers.0.self_attn.o_proj.weight": layer.self_attn.o_proj.weight.grad,
        "model.layers.0.mlp.gate_proj.weight": gate, "model.layers.0.mlp.up_proj.weight": up,
        "model.layers.0.mlp.down_proj.weight": layer.mlp.down_proj.weight.grad,
        "model.norm.weight": model.norm.weight.grad, "lm_head.weight": model.lm_head.weight.grad,
    }


@pytest.mark.compat
@pytest.mark.parametrize("flash_attention", [True, False])
def test_tp1_logits_and_grads_match_hf(setup: dict, flash_attention: bool) -> None:
    config = build_llama_config(str(Path(setup["ckpt"]) / "config.json"))
    model = LlamaForCausalLM(config, flash_attention=flash_attention)
    load_hf_weights(model, setup["ckpt"])
    logits = model(setup["ids"])
    assert logits.shape == (B, S, VOCAB)
    torch.testing.assert_close(logits, setup["logits"], atol=ATOL, rtol=0)
    loss_sum, num = causal_lm_loss(logits, setup["labels"])
    assert num.item() == (setup["labels"] != -100).sum().item()
    (loss_sum / num).backward()
    torch.testing.assert_close(loss_sum / num, setup["loss"], atol=1e-6, rtol=0)
    ours = _our_grads_tp1(model)
    for name in GRAD_NAMES:
        torch.testing.assert_close(ours[name], setup["grads"][name], atol=ATOL, rtol=0, msg=name)


@pytest.mark.compat
def test_position_ids_shift_invariance_and_attention_paths() -> None:
    """Explicit position_ids equal the default; eager and SDPA core attention agree with GQA."""
    torch.manual_seed(1)
    model = LlamaForCausalLM(_tiny_config())
    ids = torch.randint(0, VOCAB, (1, 6))
    pos = torch.arange(6).unsqueeze(0)
    torch.testing.assert_close(model(ids), model(ids, pos))
    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)
    torch.testing.assert_close(core_attention(q, k, v, flash_attention=True),
                               core_attention(q, k, v, flash_attention=False), atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        core_attention(q, k[:, :1].expand(2, 3, 5, 8), v[:, :1].expand(2, 3, 5, 8))


def test_llama3_and_linear_rope_match_hf() -> None:
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    pos = torch.tensor([[0, 1, 5, 100, 7000]])
    scalings = [
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 64},
        {"rope_type": "linear", "factor": 4.0},
    ]
    for scaling in scalings:
        cfg = _tiny_config(hidden_size=256, num_attention_heads=2, max_position_embeddings=8192,
                           rope_theta=500000.0, rope_scaling=scaling)
        cos, sin = RotaryEmbedding(rope_spec_from_config(cfg))(pos)
        ref_cos, ref_sin = LlamaRotaryEmbedding(cfg)(torch.zeros(1, dtype=torch.float32), pos)
        torch.testing.assert_close(cos, ref_cos, atol=1e-6, rtol=0)
        torch.testing.assert_close(sin, ref_sin, atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="rope_type: 'ntk' is not supported"):
        rope_spec_from_config(_tiny_config(rope_scaling={"rope_type": "ntk", "factor": 2.0}))


def _gather_logits(logits: torch.Tensor) -> torch.Tensor:
    return collectives.all_gather(logits.detach().contiguous(), -1, parallel_state.get_tensor_model_parallel_group())


def _gather_grad(param: torch.nn.Parameter) -> torch.Tensor:
    """Full gradient of a TP-sharded parameter (all-gather + stride- and order-aware merge: o_proj's columns follow
    the query blocks under the interleaved KV-replica layout)."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    dim, stride = param.partition_dim, param.partition_stride
    shards = collectives.all_gather(param.grad, dim, parallel_state.get_tensor_model_parallel_group()).chunk(tp, dim)
    return merge_tensor_shards(shards, dim, stride, getattr(param, "partition_order", None))


def _check_sharded_grads(model: LlamaForCausalLM, ref: dict[str, torch.Tensor]) -> None:
    layer = model.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    pairs = {
        "model.embed_tokens.weight": _gather_grad(model.embed_tokens.weight)[:VOCAB],
        "lm_head.weight": _gather_grad(model.lm_head.weight)[:VOCAB],
        "model.layers.0.input_layernorm.weight": layer.input_layernorm.weight.grad,
        "model.norm.weight": model.norm.weight.grad,
        "model.layers.0.self_attn.o_proj.weight": _gather_grad(attn.o_proj.weight),
        "model.layers.0.mlp.down_proj.weight": _gather_grad(mlp.down_proj.weight),
    }
    gate, up = _gather_grad(mlp.gate_up_proj.weight).chunk(2)
    pairs.update({"model.layers.0.mlp.gate_proj.weight": gate, "model.layers.0.mlp.up_proj.weight": up})
    for name, grad in pairs.items():
        torch.testing.assert_close(grad, ref[name], atol=ATOL, rtol=0, msg=name)
    q_ref, k_ref, v_ref = (ref[f"model.layers.0.self_attn.{n}_proj.weight"] for n in "qkv")
    if attn.qkv_linear:  # local grads vs the local shard of the HF grads (replicas summed)
        qkv = attn.qkv_proj
        expected = qkv.shard_qkv_weights(q_ref, k_ref, v_ref)
        for name, value in expected.items():
            torch.testing.assert_close(getattr(qkv, name).grad, value, atol=ATOL, rtol=0, msg=name)
    else:
        for n, r in zip("qkv", (q_ref, k_ref, v_ref)):
            torch.testing.assert_close(_gather_grad(getattr(attn, f"{n}_proj").weight), r, atol=ATOL, rtol=0)


def _parity_worker(rank: int, world: int, setup: dict, kv_replicator: int, variants: list[dict]) -> None:
    config = build_llama_config(setup["ckpt"])
    for variant in variants:
        layout = variant.pop("kv_replica_layout", "interleaved")
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=world, kv_replicator=kv_replicator,
                                                 kv_replica_layout=layout)
        torch.manual_seed(123)
        model = LlamaForCausalLM(config, kv_replicator=kv_replicator, **variant)
        load_hf_weights(model, setup["ckpt"])
        logits = model(setup["ids"])
        full = _gather_logits(logits)
        assert full.shape[-1] == model.padded_vocab_size > VOCAB
        torch.testing.assert_close(full[..., :VOCAB], setup["logits"], atol=ATOL, rtol=0, msg=str(variant))
        assert torch.all(full[..., VOCAB:] == torch.finfo(full.dtype).min)
        loss_sum, num = causal_lm_loss(logits, setup["labels"])
        (loss_sum / num).backward()
        torch.testing.assert_close(loss_sum / num, setup["loss"], atol=1e-6, rtol=0)
        allreduce_sequence_parallel_gradients(model)
        allreduce_kv_replica_gradients(model)
        _check_sharded_grads(model, setup["grads"])


@pytest.mark.compat
@pytest.mark.distributed
def test_tp2_sequence_parallel_parity(setup: dict) -> None:
    variants = [
        {"sequence_parallel": True, "fuse_qkv": True, "flash_attention": True},
        {"sequence_parallel": True, "fuse_qkv": False, "flash_attention": False},
        {"sequence_parallel": False, "qkv_linear": False},
    ]
    run_distributed(_parity_worker, 2, setup, 1, variants)


@pytest.mark.distributed
@pytest.mark.slow
def test_tp4_kv_replicator_parity(setup: dict) -> None:
    """2 KV heads at TP=4: each KV head replicated on 2 ranks (kv_replicator=2), in NxD's Trn1 (interleaved: KV
    groups {0, 2} {1, 3}, query heads reordered) and Trn2 (adjacent) layouts."""
    variants = [
        {"sequence_parallel": True, "fuse_qkv": True},
        {"sequence_parallel": False, "fuse_qkv": False, "kv_replica_layout": "adjacent"},
    ]
    run_distributed(_parity_worker, 4, setup, 2, variants)
