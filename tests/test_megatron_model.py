"""``model_source: megatron``: the decoder built from NxDT's ``model:`` architecture keys.

* Megatron-form Llama (rmsnorm, swiglu, rope, no biases, untied) equals transformers' ``LlamaForCausalLM`` with the
  same weights (logits, loss, every gradient), and exports as an HF Llama.
* Megatron GPT (layernorm, gelu, learned_absolute, has_bias, tied embeddings) equals transformers'
  ``GPT2LMHeadModel`` (``activation_function: gelu``) through the documented weight mapping
  (:func:`nxd_lc.models.megatron.gpt2_state_dict_to_nxd_names`) at TP 1 and at TP 2 + SP (logits and every
  gradient).
* Partial rotary (``rotary_percentage``) against the formula (the first Dr dims rotated by RoPE over Dr dims, the
  rest unchanged).
* Dropouts: identity in eval; in training the same result at TP 1 and TP 2 + SP (masks independent of the
  layout); the kept fraction of hidden dropout near 1 - p.
* Initialisation (init_method_std, scaled output init, zero biases), vocab padding (make_vocab_size_divisible_by x
  TP), and the config errors.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from dist_utils import run_distributed
from hf_parity import grads_as_hf, hf_reference
from safetensors.torch import save_file
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig
from transformers import LlamaForCausalLM as HFLlama

from nxd_lc.config.schema import ModelConfig
from nxd_lc.distributed import collectives, parallel_state
from nxd_lc.distributed.grads import allreduce_sequence_parallel_gradients
from nxd_lc.models.common.loss import causal_lm_loss
from nxd_lc.models.llama import LlamaForCausalLM, load_hf_weights
from nxd_lc.models.llama.hf_adapter import export_hf_state_dict
from nxd_lc.models.megatron import build_megatron_config, gpt2_state_dict_to_nxd_names, megatron_problems

VOCAB, B, S = 97, 2, 8
ATOL = 3e-5

GPT_KEYS = {"num_layers": 2, "hidden_size": 32, "ffn_hidden_size": 128, "num_attention_heads": 4,
            "encoder_seq_length": 16, "normalization": "layernorm", "layernorm_epsilon": 1e-5,
            "position_embedding_type": "learned_absolute", "activation": "gelu", "has_bias": True,
            "share_embeddings_and_output_weights": True, "hidden_dropout": 0.0, "attention_dropout": 0.0,
            "make_vocab_size_divisible_by": 8}
LLAMA_KEYS = {"num_layers": 2, "hidden_size": 32, "ffn_hidden_size": 48, "num_attention_heads": 4, "num_kv_heads": 2,
              "encoder_seq_length": 16, "max_position_embeddings": 64, "normalization": "rmsnorm",
              "layernorm_epsilon": 1e-5, "position_embedding_type": "rope", "activation": "swiglu",
              "has_bias": False, "share_embeddings_and_output_weights": False, "hidden_dropout": 0.0,
              "attention_dropout": 0.0, "make_vocab_size_divisible_by": 8}


def _model_cfg(**keys: Any) -> ModelConfig:
    return ModelConfig(**keys)


def _labels(ids: torch.Tensor) -> torch.Tensor:
    labels = torch.cat([ids[:, 1:], torch.full((ids.shape[0], 1), -100)], dim=1)
    labels[0, :2] = -100
    return labels


def _run(model: LlamaForCausalLM, ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logits = model(ids)
    full = collectives.all_gather(logits.detach().contiguous(), -1, parallel_state.get_tensor_model_parallel_group())
    loss_sum, num = causal_lm_loss(logits, labels)
    (loss_sum / num).backward()
    allreduce_sequence_parallel_gradients(model)
    return full, (loss_sum / num).detach()


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=2, n_head=4,
                                    activation_function="gelu", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                    layer_norm_epsilon=1e-5)).float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "ln_" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    ids = torch.randint(0, VOCAB, (B, S))
    labels = _labels(ids)
    ref = hf_reference(hf, ids, labels)
    mapped = gpt2_state_dict_to_nxd_names(hf.state_dict(), 2)
    grads = gpt2_state_dict_to_nxd_names(ref["grads"], 2)
    path = tmp_path_factory.mktemp("gpt2") / "model.safetensors"
    save_file({k: v.contiguous() for k, v in mapped.items()}, str(path))
    return {"ckpt": str(path), "ids": ids, "labels": labels, "logits": ref["logits"], "loss": ref["loss"],
            "grads": grads}


def _check_gpt(gpt2: dict[str, Any], **model_kw: Any) -> None:
    model = LlamaForCausalLM(build_megatron_config(_model_cfg(**GPT_KEYS), VOCAB), **model_kw)
    load_hf_weights(model, gpt2["ckpt"])
    logits, loss = _run(model, gpt2["ids"], gpt2["labels"])
    torch.testing.assert_close(logits[..., :VOCAB], gpt2["logits"], atol=ATOL, rtol=0)
    torch.testing.assert_close(loss, gpt2["loss"], atol=1e-6, rtol=0)
    ours = grads_as_hf(model)
    assert set(ours) == set(gpt2["grads"]), sorted(set(ours) ^ set(gpt2["grads"]))
    for name, grad in gpt2["grads"].items():
        torch.testing.assert_close(ours[name], grad, atol=ATOL, rtol=0, msg=name)


@pytest.mark.compat
@pytest.mark.parametrize("flash_attention", [True, False])
def test_megatron_gpt_equals_transformers_gpt2(gpt2: dict[str, Any], flash_attention: bool) -> None:
    _check_gpt(gpt2, flash_attention=flash_attention)


def _gpt_tp2_worker(rank: int, world: int, gpt2: dict[str, Any]) -> None:
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    _check_gpt(gpt2, sequence_parallel=True)


@pytest.mark.distributed
def test_megatron_gpt_tp2_sequence_parallel_equals_gpt2(gpt2: dict[str, Any]) -> None:
    run_distributed(_gpt_tp2_worker, 2, gpt2)


@pytest.mark.compat
def test_megatron_llama_equals_hf_llama_with_the_same_weights(tmp_path: Any) -> None:
    torch.manual_seed(0)
    hf_config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                            rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)
    hf = HFLlama._from_config(hf_config, attn_implementation="eager").float()
    hf.save_pretrained(tmp_path / "hf")
    ids = torch.randint(0, VOCAB, (B, S))
    labels = _labels(ids)
    ref = hf_reference(hf, ids, labels)
    config = build_megatron_config(_model_cfg(**LLAMA_KEYS), VOCAB)
    assert config.model_type == "llama"
    model = LlamaForCausalLM(config)
    assert model.padded_vocab_size == 104  # ceil(97 / 8) * 8
    load_hf_weights(model, tmp_path / "hf")
    logits, loss = _run(model, ids, labels)
    torch.testing.assert_close(logits[..., :VOCAB], ref["logits"], atol=ATOL, rtol=0)
    torch.testing.assert_close(loss, ref["loss"], atol=1e-6, rtol=0)
    ours = grads_as_hf(model)
    for name, grad in ref["grads"].items():
        torch.testing.assert_close(ours[name], grad, atol=ATOL, rtol=0, msg=name)


def test_partial_rotary_rotates_only_the_first_dims() -> None:
    """rotary_percentage 0.5: q/k dims [0, D/2) rotated by RoPE over D/2 dims, [D/2, D) passed through (formula)."""
    from nxd_lc.models.llama.model import _rotate

    torch.manual_seed(0)
    config = build_megatron_config(_model_cfg(**{**LLAMA_KEYS, "rotary_percentage": 0.5}), VOCAB)
    model = LlamaForCausalLM(config)
    positions = torch.arange(S)[None]
    cos, sin = model.position_encoding(positions)
    d, dr = 8, 4
    assert cos.shape[-1] == dr
    q, k = torch.randn(1, 4, S, d), torch.randn(1, 2, S, d)
    q2, k2 = _rotate(q, k, cos, sin)
    inv = 1.0 / 10000.0 ** (torch.arange(0, dr, 2).float() / dr)
    angles = positions[0, :, None].float() * inv  # [S, dr/2]
    c, s_ = angles.cos(), angles.sin()
    for x, y in ((q, q2), (k, k2)):
        x1, x2 = x[..., : dr // 2], x[..., dr // 2: dr]
        expected = torch.cat([x1 * c - x2 * s_, x2 * c + x1 * s_, x[..., dr:]], dim=-1)
        torch.testing.assert_close(y, expected, atol=1e-6, rtol=0)


def test_initialisation_follows_init_method_std_and_scaled_init() -> None:
    torch.manual_seed(0)
    keys = {**GPT_KEYS, "hidden_size": 256, "ffn_hidden_size": 512, "num_layers": 8, "init_method_std": 0.05,
            "use_scaled_init_method": True, "encoder_seq_length": 64}
    model = LlamaForCausalLM(build_megatron_config(_model_cfg(**keys), VOCAB))
    layer = model.layers[3]
    scaled = 0.05 / math.sqrt(2 * 8)
    for w, std in ((layer.self_attn.qkv_proj.weight_qkv, 0.05), (layer.mlp.up_proj.weight, 0.05),
                   (layer.self_attn.o_proj.weight, scaled), (layer.mlp.down_proj.weight, scaled),
                   (model.embed_positions.weight, 0.05)):
        assert abs(w.std().item() - std) < 0.08 * std, (w.shape, w.std().item(), std)
    assert torch.all(layer.mlp.up_proj.bias == 0) and torch.all(layer.self_attn.o_proj.bias == 0)
    assert torch.all(layer.input_layernorm.weight == 1) and torch.all(layer.input_layernorm.bias == 0)
    assert model.lm_head.weight is model.embed_tokens.weight
    unscaled = LlamaForCausalLM(build_megatron_config(_model_cfg(**{**keys, "use_scaled_init_method": False}), VOCAB))
    assert abs(unscaled.layers[3].self_attn.o_proj.weight.std().item() - 0.05) < 0.004


def test_dropout_is_identity_in_eval_and_keeps_one_minus_p_in_training() -> None:
    torch.manual_seed(0)
    keys = {**GPT_KEYS, "hidden_dropout": 0.3, "attention_dropout": 0.2, "ffn_dropout": 0.1}
    model = LlamaForCausalLM(build_megatron_config(_model_cfg(**keys), VOCAB))
    plain = LlamaForCausalLM(build_megatron_config(_model_cfg(**GPT_KEYS), VOCAB))
    plain.load_state_dict(model.state_dict())
    ids = torch.randint(0, VOCAB, (B, S))
    model.eval()
    plain.eval()
    torch.testing.assert_close(model(ids), plain(ids), atol=0, rtol=0)
    model.train()
    torch.manual_seed(1)
    a = model(ids)
    torch.manual_seed(1)
    torch.testing.assert_close(model(ids), a, atol=0, rtol=0)  # the masks come from the seeded stream
    assert (a - plain(ids)).abs().max() > 1e-3
    model.embed_tokens.weight.data.zero_()  # the embedding output is then the position rows only
    kept = model.embed(torch.zeros(4, 256, dtype=torch.long), torch.arange(256).expand(4, 256) % 16)
    frac = (kept != 0).float().mean().item()
    assert abs(frac - 0.7) < 0.02, frac


def _dropout_worker(rank: int, world: int, ref: dict[str, Any]) -> None:
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    model = LlamaForCausalLM(build_megatron_config(_model_cfg(**ref["keys"]), VOCAB), sequence_parallel=True)
    load_hf_weights(model, ref["ckpt"])  # the TP 1 model's weights (a seeded init depends on the padded vocab)
    model.train()
    torch.manual_seed(7)
    logits, loss = _run(model, ref["ids"], ref["labels"])
    torch.testing.assert_close(logits[..., :VOCAB], ref["logits"], atol=ATOL, rtol=0)
    ours = grads_as_hf(model)
    for name, grad in ref["grads"].items():
        torch.testing.assert_close(ours[name], grad, atol=ATOL, rtol=0, msg=name)


@pytest.mark.distributed
def test_hidden_and_ffn_dropout_masks_do_not_depend_on_the_tp_layout(tmp_path: Any) -> None:
    """TP 2 + SP with hidden and ffn dropout in training mode equals TP 1 (same weights, same seed before the
    step): the masks are drawn for the full tensors and sliced (nxd_lc.layers.dropout)."""
    keys = {**GPT_KEYS, "hidden_dropout": 0.2, "ffn_dropout": 0.3, "attention_dropout": 0.0}
    torch.manual_seed(5)
    model = LlamaForCausalLM(build_megatron_config(_model_cfg(**keys), VOCAB))
    ckpt = tmp_path / "model.safetensors"
    save_file(export_hf_state_dict(model), str(ckpt))
    model.train()
    ids = torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(3))
    labels = _labels(ids)
    torch.manual_seed(7)
    logits, _ = _run(model, ids, labels)
    grads = grads_as_hf(model)
    run_distributed(_dropout_worker, 2, {"keys": keys, "ids": ids, "labels": labels, "logits": logits[..., :VOCAB],
                                         "grads": grads, "ckpt": str(ckpt)})


def test_config_errors_name_the_key() -> None:
    assert megatron_problems(_model_cfg(ffn_hidden_size=64), "hf")[0].startswith("model.ffn_hidden_size: read only "
                                                                                  "with model_source: megatron")
    problems = megatron_problems(_model_cfg(num_layers=2, hidden_size=32), "megatron")
    assert {p.split(":")[0] for p in problems} == {"model.ffn_hidden_size", "model.num_attention_heads",
                                                   "model.encoder_seq_length"}
    bad = dataclasses.replace(_model_cfg(**GPT_KEYS), normalization="batchnorm", transformer_block_type="post_ln",
                              rotary_percentage=1.5, hidden_dropout=1.0)
    text = "\n".join(megatron_problems(bad, "megatron"))
    for needle in ("model.normalization: 'batchnorm'", "not supported yet: model.transformer_block_type='post_ln'",
                   "model.rotary_percentage: 1.5", "model.hidden_dropout: 1.0"):
        assert needle in text
    gqa = dataclasses.replace(_model_cfg(**LLAMA_KEYS), num_kv_heads=3)
    assert megatron_problems(gqa, "megatron") == ["model.num_kv_heads: 3 must divide num_attention_heads (4)"]
    with pytest.raises(ValueError, match="not supported yet: HF export"):
        from nxd_lc.models.common.family import hf_export_config

        hf_export_config(build_megatron_config(_model_cfg(**GPT_KEYS), VOCAB))


def test_attention_dropout_uses_one_shared_draw_and_its_own_stream() -> None:
    """CoreAttention's dropout seeds a forked stream from ONE draw of the shared host generator (so what is drawn
    after it does not depend on the number of local heads, i.e. on TP), is reproducible from the seed, and is the
    identity in eval."""
    from nxd_lc.models.common.attention import CoreAttention

    attn = CoreAttention(dropout=0.5).train()
    q = torch.randn(1, 4, 8, 4)
    for heads in (4, 2):
        torch.manual_seed(0)
        out = attn(q[:, :heads], q[:, :heads], q[:, :heads])
        after = torch.get_rng_state()
        torch.manual_seed(0)
        torch.randint(0, 2**62, (1,))
        assert torch.equal(after, torch.get_rng_state())
        torch.manual_seed(0)
        torch.testing.assert_close(attn(q[:, :heads], q[:, :heads], q[:, :heads]), out, atol=0, rtol=0)
    plain = F.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert not torch.allclose(out, plain[:, :2])
    torch.testing.assert_close(attn.eval()(q, q, q), plain, atol=0, rtol=0)


def test_megatron_llama_exports_as_hf_llama() -> None:
    from nxd_lc.models.common.family import hf_export_config

    config = hf_export_config(build_megatron_config(_model_cfg(**LLAMA_KEYS), VOCAB))
    assert config.model_type == "llama" and not hasattr(config, "nxd_decoder")


def test_megatron_moe_keys_the_experts_cannot_take_are_refused() -> None:
    from nxd_lc.config.schema import MoEConfig

    moe = MoEConfig(num_experts=None, top_k=2)
    keys = {**LLAMA_KEYS, "moe": moe, "has_bias": True, "ffn_dropout": 0.1, "sliding_window_size": 8}
    text = "\n".join(megatron_problems(_model_cfg(**keys), "megatron"))
    for needle in ("model.moe.num_experts: required", "not supported yet: model.has_bias=True with model.moe",
                   "not supported yet: model.ffn_dropout=0.1 with model.moe",
                   "not supported yet: model.sliding_window_size=8 with model.moe"):
        assert needle in text, text


def test_learned_positions_go_to_the_first_pipeline_stage_in_converted_checkpoints() -> None:
    from nxd_lc.checkpoint.model_shards import stage_state

    state = {"model.embed_tokens.weight": 0, "model.embed_positions.weight": 1, "model.layers.0.x": 2,
             "model.layers.1.x": 3, "model.norm.weight": 4, "model.lm_head.weight": 5}
    first = stage_state(state, {"keep_layers": [0], "keep_embedding": True, "keep_head": False})
    last = stage_state(state, {"keep_layers": [1], "keep_embedding": False, "keep_head": True})
    assert set(first) == {"model.embed_tokens.weight", "model.embed_positions.weight", "model.layers.0.x"}
    assert set(last) == {"model.layers.1.x", "model.norm.weight", "model.lm_head.weight"}


def test_megatron_run_config_errors_name_the_keys() -> None:
    from nxd_lc.app.validation import load_config
    from nxd_lc.config.errors import ConfigError

    model = {**GPT_KEYS, "hidden_dropout": 0.1}
    raw = {"model_source": "megatron", "trainer": {"devices": 2}, "model": model,
           "distributed_strategy": {"pipeline_model_parallel_size": 2},
           "data": {"micro_batch_size": 1, "global_batch_size": 2, "tokenizer": {"type": "bytelevel_bpe"},
                    "curriculum": [{"until_step": 5, "seq_length": 16, "rope_scaling": {"rope_type": "linear",
                                                                                         "factor": 2.0}}]}}
    with pytest.raises(ConfigError) as info:
        load_config(raw)
    text = "\n".join(info.value.problems)
    for needle in ("not supported yet: model.hidden_dropout > 0 with pipeline_model_parallel_size > 1",
                   "data.curriculum[0].rope_scaling: the model has learned absolute positions",
                   "data.tokenizer.type: bytelevel_bpe is trained from the corpus"):
        assert needle in text, text
