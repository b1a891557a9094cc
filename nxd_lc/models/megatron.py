"""``model_source: megatron``: the decoder described by NxDT's / NeMo's ``model:`` YAML keys instead of an HF
config.json.

The keys become a transformers config of the matching family (``llama``; ``mistral`` with
``sliding_window_size``; ``mixtral`` with ``model.moe``) whose architecture fields they set, plus the Megatron parts
transformers' class lacks, stored as ``config.nxd_decoder`` (a dict of
:class:`~nxd_lc.models.common.family.DecoderOptions` fields) and built by the same decoder as every HF family:

=====================================  ==================================================================
YAML key (NeMo default when null)      effect
=====================================  ==================================================================
num_layers, hidden_size                decoder layers, hidden size H (required)
ffn_hidden_size                        MLP intermediate size (required)
num_attention_heads                    query heads (required)
num_kv_heads (= num_attention_heads)   key / value heads (GQA; ``kv_replicator`` as for HF models)
kv_channels (H / heads)                per-head size
encoder_seq_length                     training length (required); max_position_embeddings defaults to it
max_position_embeddings                size of the learned position table / RoPE's reference length
normalization (layernorm)              ``layernorm`` (weight + bias) or ``rmsnorm``
layernorm_epsilon (1e-5)               epsilon of every norm
activation (gelu)                      ``gelu`` (exact erf GeLU MLP) or ``swiglu`` (gate/up MLP)
has_bias (true)                        biases in q/k/v, o, and both MLP projections
position_embedding_type                ``learned_absolute`` (a trained table added to the token embedding) or
(learned_absolute)                     ``rope`` (``rope_theta``, default 10000)
rotary_percentage (1.0)                share of each head's dims RoPE rotates (the first ones)
share_embeddings_and_output_weights    lm head tied to the token embedding
(true)
make_vocab_size_divisible_by (128)     vocabulary rows padded to a multiple of this x TP (Megatron's
                                       ``_vocab_size_with_padding``); the padded logits are masked, so they
                                       never take probability mass (Megatron trains them as real rows)
init_method_std (0.02)                 normal init of every weight matrix and embedding
use_scaled_init_method (true)          o_proj / down_proj init std / sqrt(2 num_layers) (Megatron-LM
                                       ``scaled_init_method_normal``)
hidden_dropout (0.1)                   dropout on the embedding output and each residual branch
attention_dropout (0.1)                dropout on the attention probabilities
ffn_dropout (0.0)                      dropout on the MLP activation
sliding_window_size (null)             sliding-window attention over that many keys (Mistral)
transformer_block_type (pre_ln)        only ``pre_ln``; post_ln / normformer / gpt_j: not supported yet
apply_query_key_layer_scaling (true)   Megatron divides the scores by the layer number and multiplies it back
                                       inside an fp32 softmax, a guard against fp16 overflow: the result is
                                       the same, and nxd_lc's softmax is fp32 already. Accepted, no effect.
persist_layer_norm (false)             Apex's persistent LayerNorm CUDA kernel: no meaning here. Accepted,
                                       no effect.
=====================================  ==================================================================

The vocabulary size is the tokenizer's (``data.tokenizer``, counted as NeMo does), as in NeMo. The defaults are
NeMo's ``megatron_gpt_config.yaml``'s. Dropout needs PP 1 and CP 1 (not supported yet otherwise: each pipeline
stage / CP rank would draw from the same random stream).
"""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig

from nxd_lc.config.schema import ModelConfig
from nxd_lc.models.common.family import scaled_init_std

__all__ = ["MEGATRON_KEYS", "build_megatron_config", "gpt2_state_dict_to_nxd_names", "megatron_config_dict",
           "megatron_problems"]

#: the ``model:`` keys read only with ``model_source: megatron`` -> NeMo's default (None: required / derived)
MEGATRON_KEYS: dict[str, Any] = {
    "ffn_hidden_size": None, "num_attention_heads": None, "num_kv_heads": None, "kv_channels": None,
    "init_method_std": 0.02, "use_scaled_init_method": True, "hidden_dropout": 0.1, "attention_dropout": 0.1,
    "ffn_dropout": 0.0, "apply_query_key_layer_scaling": True, "normalization": "layernorm",
    "layernorm_epsilon": 1e-5, "make_vocab_size_divisible_by": 128, "persist_layer_norm": False,
    "share_embeddings_and_output_weights": True, "position_embedding_type": "learned_absolute",
    "rotary_percentage": 1.0, "activation": "gelu", "transformer_block_type": "pre_ln", "has_bias": True,
    "sliding_window_size": None,
}
_CHOICES = {"normalization": ("layernorm", "rmsnorm"), "position_embedding_type": ("learned_absolute", "rope"),
            "activation": ("gelu", "swiglu")}
_REQUIRED = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "encoder_seq_length")


def _value(m: ModelConfig, key: str) -> Any:
    """The key's value, NeMo's default when null."""
    value = getattr(m, key)
    return MEGATRON_KEYS[key] if value is None else value


def megatron_problems(m: ModelConfig, model_source: str) -> list[str]:
    """Problems of the Megatron architecture keys (each names the key and the fix); with ``model_source: hf``,
    every Megatron key that is set (the architecture comes from ``model.model_config`` there)."""
    if model_source != "megatron":
        return [f"model.{k}: read only with model_source: megatron (with hf the architecture comes from "
                "model.model_config); remove it or set model_source: megatron" for k in MEGATRON_KEYS
                if getattr(m, k) is not None]
    p = [f"model.{k}: required with model_source: megatron; set it (a positive integer)" for k in _REQUIRED
         if getattr(m, k) is None]
    for key in ("model_config", "hf_weights_dir", "hf_config_overrides"):
        if getattr(m, key):
            p.append(f"model.{key}: not used with model_source: megatron (the architecture is the model: keys); "
                     "remove it, or set model_source: hf")
    for key, allowed in _CHOICES.items():
        if _value(m, key) not in allowed:
            p.append(f"model.{key}: {_value(m, key)!r} is not one of {', '.join(allowed)}")
    if _value(m, "transformer_block_type") != "pre_ln":
        p.append(f"not supported yet: model.transformer_block_type={_value(m, 'transformer_block_type')!r} "
                 "(only pre_ln)")
    for key in ("hidden_dropout", "attention_dropout", "ffn_dropout"):
        if not 0.0 <= float(_value(m, key)) < 1.0:
            p.append(f"model.{key}: {_value(m, key)} must be in [0, 1)")
    rp = float(_value(m, "rotary_percentage"))
    if not 0.0 < rp <= 1.0:
        p.append(f"model.rotary_percentage: {rp} must be in (0, 1]")
    for key in ("num_kv_heads", "kv_channels", "make_vocab_size_divisible_by", "sliding_window_size"):
        value = getattr(m, key)
        if value is not None and (not isinstance(value, int) or value < 1):
            p.append(f"model.{key}: {value!r} must be a positive integer (or null)")
    if m.moe is not None:
        p += _moe_problems(m)
    if m.tiled_mlp_chunk_size is not None and (_value(m, "activation") == "gelu" or _value(m, "ffn_dropout") > 0):
        p.append("not supported yet: model.tiled_mlp_chunk_size with model.activation gelu or model.ffn_dropout > 0 "
                 "(the tiled MLP is SwiGLU's, without dropout); set it to null")
    if p:
        return p
    heads, kv = m.num_attention_heads, _value(m, "num_kv_heads") or m.num_attention_heads
    if heads % kv:
        p.append(f"model.num_kv_heads: {kv} must divide num_attention_heads ({heads})")
    if m.kv_channels is None and m.hidden_size % heads:
        p.append(f"model.hidden_size: {m.hidden_size} is not divisible by num_attention_heads ({heads}); set "
                 "model.kv_channels")
    head_dim = m.kv_channels or m.hidden_size // heads
    if _value(m, "position_embedding_type") == "rope" and int(head_dim * rp) % 2:
        p.append(f"model.rotary_percentage: {rp} x head size {head_dim} = {head_dim * rp:g} rotary dims must be "
                 "an even integer")
    max_pos = m.max_position_embeddings or m.encoder_seq_length
    if m.encoder_seq_length > max_pos:
        p.append(f"model.encoder_seq_length ({m.encoder_seq_length}) exceeds model.max_position_embeddings "
                 f"({max_pos}); raise max_position_embeddings")
    return p


def _moe_problems(m: ModelConfig) -> list[str]:
    """What the mixture-of-experts blocks do not take from the Megatron keys (their experts are bias-free SwiGLU
    without dropout, and the MoE decoder has no sliding window)."""
    p = []
    if m.moe.num_experts is None:
        p.append("model.moe.num_experts: required with model_source: megatron (no config.json to take it from)")
    for key, bad, what in (("activation", _value(m, "activation") != "swiglu", "the experts are SwiGLU"),
                           ("has_bias", bool(_value(m, "has_bias")), "the experts have no biases"),
                           ("ffn_dropout", float(_value(m, "ffn_dropout")) > 0, "the experts have no dropout"),
                           ("sliding_window_size", m.sliding_window_size is not None, "no sliding window with MoE")):
        if bad:
            p.append(f"not supported yet: model.{key}={_value(m, key)!r} with model.moe ({what})")
    return p


def megatron_config_dict(m: ModelConfig, vocab_size: int | None = None) -> dict[str, Any]:
    """An HF config.json-like dict of the Megatron keys (validated by :func:`megatron_problems`): ``model_type``
    llama / mistral / mixtral, the architecture fields, and ``nxd_decoder`` (module docstring). ``vocab_size``:
    the tokenizer's (None while validating: left out)."""
    heads = m.num_attention_heads
    kv = _value(m, "num_kv_heads") or heads
    head_dim = m.kv_channels or m.hidden_size // heads
    std = float(_value(m, "init_method_std"))
    window = m.sliding_window_size
    rope = _value(m, "position_embedding_type") == "rope"
    bias = bool(_value(m, "has_bias"))
    out: dict[str, Any] = {
        "model_type": "mixtral" if m.moe is not None else "mistral" if window else "llama",
        "hidden_size": m.hidden_size, "intermediate_size": m.ffn_hidden_size, "num_hidden_layers": m.num_layers,
        "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": head_dim,
        "max_position_embeddings": m.max_position_embeddings or m.encoder_seq_length,
        "rms_norm_eps": float(_value(m, "layernorm_epsilon")), "rope_theta": float(m.rope_theta or 10000.0),
        "tie_word_embeddings": bool(_value(m, "share_embeddings_and_output_weights")),
        "initializer_range": std, "hidden_act": "silu", "attention_bias": bias, "mlp_bias": bias,
        "attention_dropout": float(_value(m, "attention_dropout")), "sliding_window": window,
        "nxd_decoder": {
            "norm": _value(m, "normalization"), "activation": "gelu" if _value(m, "activation") == "gelu" else "swiglu",
            "qkv_bias": bias, "o_bias": bias, "mlp_bias": bias,
            "position_embedding": "rope" if rope else "learned_absolute",
            "rotary_percentage": float(_value(m, "rotary_percentage")),
            "hidden_dropout": float(_value(m, "hidden_dropout")),
            "attention_dropout": float(_value(m, "attention_dropout")),
            "ffn_dropout": float(_value(m, "ffn_dropout")), "init_std": std,
            "output_init_std": scaled_init_std(std, m.num_layers) if _value(m, "use_scaled_init_method") else std,
            "make_vocab_size_divisible_by": int(_value(m, "make_vocab_size_divisible_by")),
        },
    }
    if m.moe is not None:  # the expert fields: model.moe's non-null keys over these defaults (as for an HF Mixtral)
        from nxd_lc.moe.config import moe_hf_overrides

        out.update({"num_experts_per_tok": 2, "router_aux_loss_coef": 0.0, "output_router_logits": False,
                    **moe_hf_overrides(m.moe)})
    if vocab_size is not None:
        out["vocab_size"] = vocab_size
    return out


def build_megatron_config(m: ModelConfig, vocab_size: int) -> PretrainedConfig:
    """The transformers config of a ``model_source: megatron`` model (module docstring); ``vocab_size`` is the
    tokenizer's, unpadded.

    Raises:
        ValueError: every problem of :func:`megatron_problems`, joined.
    """
    from nxd_lc.models.config_classes import CONFIG_CLASSES

    problems = megatron_problems(m, "megatron")
    if problems:
        raise ValueError("; ".join(problems))
    raw = megatron_config_dict(m, vocab_size)
    return CONFIG_CLASSES[raw["model_type"]].from_dict(raw)


def gpt2_state_dict_to_nxd_names(gpt2: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """transformers ``GPT2LMHeadModel`` weights -> the HF-style names the decoder's adapter reads
    (:func:`nxd_lc.models.llama.hf_adapter.load_hf_weights`), for a Megatron-source GPT (layernorm, gelu,
    learned_absolute, has_bias, tied embeddings; ``activation_function: gelu`` on the GPT-2 side, GPT-2 checkpoints'
    ``gelu_new`` is the tanh approximation). GPT-2's ``Conv1D`` weights are ``[in, out]``: transposed.

    ====================================  ==============================================================
    GPT-2                                 nxd_lc (HF-style name)
    ====================================  ==============================================================
    transformer.wte.weight [V, H]         model.embed_tokens.weight
    transformer.wpe.weight [P, H]         model.embed_positions.weight
    h.N.ln_1.{weight,bias}                model.layers.N.input_layernorm.{weight,bias}
    h.N.attn.c_attn.weight [H, 3H]        self_attn.{q,k,v}_proj.weight = columns [0:H], [H:2H], [2H:3H], ^T
    h.N.attn.c_attn.bias [3H]             self_attn.{q,k,v}_proj.bias (same thirds)
    h.N.attn.c_proj.{weight ^T, bias}     self_attn.o_proj.{weight,bias}
    h.N.ln_2.{weight,bias}                model.layers.N.post_attention_layernorm.{weight,bias}
    h.N.mlp.c_fc.{weight ^T, bias}        mlp.up_proj.{weight,bias}
    h.N.mlp.c_proj.{weight ^T, bias}      mlp.down_proj.{weight,bias}
    transformer.ln_f.{weight,bias}        model.norm.{weight,bias}
    ====================================  ==============================================================

    Args:
        gpt2: a ``GPT2LMHeadModel`` state dict (tensors).
        num_layers: its ``n_layer``.

    Raises:
        KeyError: a GPT-2 tensor is missing.
    """
    g = {k.removeprefix("transformer."): v for k, v in gpt2.items()}
    out = {"model.embed_tokens.weight": g["wte.weight"], "model.embed_positions.weight": g["wpe.weight"],
           "model.norm.weight": g["ln_f.weight"], "model.norm.bias": g["ln_f.bias"]}
    for i in range(num_layers):
        src, dst = f"h.{i}", f"model.layers.{i}"
        for a, b in (("ln_1", "input_layernorm"), ("ln_2", "post_attention_layernorm")):
            out[f"{dst}.{b}.weight"], out[f"{dst}.{b}.bias"] = g[f"{src}.{a}.weight"], g[f"{src}.{a}.bias"]
        weights = g[f"{src}.attn.c_attn.weight"].t().chunk(3, dim=0)  # [3H, H] -> q, k, v [H, H]
        biases = g[f"{src}.attn.c_attn.bias"].chunk(3)
        for name, w, b in zip("qkv", weights, biases):
            out[f"{dst}.self_attn.{name}_proj.weight"] = w.contiguous()
            out[f"{dst}.self_attn.{name}_proj.bias"] = b.contiguous()
        for a, b in (("attn.c_proj", "self_attn.o_proj"), ("mlp.c_fc", "mlp.up_proj"), ("mlp.c_proj", "mlp.down_proj")):
            out[f"{dst}.{b}.weight"] = g[f"{src}.{a}.weight"].t().contiguous()
            out[f"{dst}.{b}.bias"] = g[f"{src}.{a}.bias"]
    return out
