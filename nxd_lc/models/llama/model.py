"""Llama decoder (Llama 2 / 3, HF ``LlamaForCausalLM`` architecture) built from tensor-parallel layers.

Shapes (batch-first): ``B`` micro batch, ``S`` sequence, ``H`` hidden, ``V`` vocabulary,
``Vp`` padded vocabulary (multiple of TP), ``tp`` TP size.

    input_ids, position_ids, labels  [B, S] int64
    hidden states                     [B, S, H], or [B, S/tp, H] under sequence parallelism
    logits_local                      [B, S, Vp/tp]  (this TP rank's vocab slice, full S)

Sequence parallelism (Korthikanti et al. 2022, arXiv:2205.05198): the embedding reduce-scatters its
output along S; norms and residual adds run on ``S/tp`` tokens; each column layer (qkv, gate_up,
lm_head) all-gathers its input and each row layer (o_proj, down_proj) reduce-scatters its output.
Norm weights are flagged ``sequence_parallel_enabled`` so their grads get all-reduced over TP.

Vocabulary padding: ``Vp = ceil(V / tp) * tp``. The padded embedding rows are zero-initialised and
never looked up by valid ids (< V). The padded lm_head columns are masked in :meth:`forward` to the
dtype's lowest finite value, so they add exp(...) = 0 to every softmax and get no gradient: they
cannot affect the loss. Labels must still be < V (or ``ignore_index``).

Module names follow NxDT's HF Llama: ``embed_tokens``, ``layers[i].{input_layernorm,
self_attn.{qkv_proj | q_proj,k_proj,v_proj, o_proj, core_attention}, post_attention_layernorm,
mlp.{gate_up_proj, down_proj}}``, ``norm``, ``lm_head``.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
from collections.abc import Collection, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn
from transformers import LlamaConfig, MistralConfig, MixtralConfig, PretrainedConfig, Qwen2Config, Qwen3Config

from nxd_lc.distributed import parallel_state
from nxd_lc.distributed.mappings import copy_to_tensor_model_parallel_region, gather_from_sequence_parallel_region
from nxd_lc.layers import (
    ColumnParallelLinear,
    GQAQKVColumnParallelLinear,
    ParallelEmbedding,
    RowParallelLinear,
    parallel_cross_entropy,
)
from nxd_lc.layers.dropout import sharded_dropout
from nxd_lc.layers.linear import InitMethod
from nxd_lc.layers.tiled import tiled_causal_lm_loss, vocab_parallel_logits
from nxd_lc.models.common.attention import CoreAttention, cached_attention
from nxd_lc.models.common.family import DecoderOptions, decoder_options
from nxd_lc.models.common.kv_cache import KVCache, LayerKVCache
from nxd_lc.models.common.mlp import GeluMLP, LlamaMLP
from nxd_lc.models.common.norm import RMSNorm, build_norm
from nxd_lc.models.common.rope import (
    RotaryEmbedding,
    apply_rotary_pos_emb,
    raise_on_problems,
    rope_scaling_problems,
    rope_spec_from_config,
)

__all__ = [
    "LlamaAttention",
    "LlamaDecoderLayer",
    "LlamaForCausalLM",
    "RemoteLayer",
    "build_llama_config",
    "causal_lm_loss",
    "causal_lm_loss_from_hidden",
    "pad_vocab_size",
]

# NxDT ``model:`` YAML keys that override the HF config.json, -> the LlamaConfig field they set.
_OVERRIDES = {
    "num_layers": "num_hidden_layers",
    "hidden_size": "hidden_size",
    "max_position_embeddings": "max_position_embeddings",
    "rope_theta": "rope_theta",
    "encoder_seq_length": None,  # validated against max_position_embeddings, not stored
}


#: config.json ``model_type`` -> the transformers config class it is read into (the decoder families of
#: :mod:`nxd_lc.models.common.family`; Mixtral swaps the MLP for mixture-of-experts blocks).
CONFIG_CLASSES: dict[str, type[PretrainedConfig]] = {"llama": LlamaConfig, "mistral": MistralConfig,
                                                     "mixtral": MixtralConfig, "qwen2": Qwen2Config,
                                                     "qwen3": Qwen3Config}


def _read_config_json(path: Path) -> dict[str, Any]:
    """Parse an HF config.json into a dict; FileNotFoundError / ValueError name the file."""
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"model.model_config: {path} does not exist; point it at an HF config.json or its directory"
        )
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"model.model_config: {path} is not valid JSON (line {e.lineno}: {e.msg})") from e
    if not isinstance(raw, dict):
        raise ValueError(f"model.model_config: {path} must hold a JSON object, got {type(raw).__name__}")  # noqa: TRY004
    if raw.get("model_type", "llama") not in CONFIG_CLASSES:
        raise ValueError(f"model.model_config: {path} has model_type={raw['model_type']!r}; supported: "
                         f"{', '.join(sorted(CONFIG_CLASSES))}")
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        if not isinstance(raw.get(key), int) or raw[key] <= 0:
            raise ValueError(f"model.model_config: {path} needs a positive integer {key!r}, got {raw.get(key)!r}")
    return raw


def _apply_overrides(raw: dict[str, Any], overrides: dict[str, Any]) -> None:
    """Write NxDT YAML overrides into the raw config dict (None or -1 mean "not set", as in NxDT)."""
    for key, value in overrides.items():
        if key not in _OVERRIDES:
            raise ValueError(f"model.{key} is not a model-config override; allowed: {sorted(_OVERRIDES)}")
        if value is None or value == -1 or _OVERRIDES[key] is None:
            continue
        if key == "rope_theta":
            if not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"model.rope_theta must be a positive number, got {value!r}")
            raw["rope_theta"] = float(value)
            for nested in ("rope_parameters", "rope_scaling"):  # transformers 5.x keeps theta in here
                if isinstance(raw.get(nested), dict) and "rope_theta" in raw[nested]:
                    raw[nested]["rope_theta"] = float(value)
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"model.{key} must be a positive integer, got {value!r}")
        if key == "hidden_size" and "head_dim" in raw and value != raw["hidden_size"]:
            raw.pop("head_dim")  # recomputed as hidden_size / num_attention_heads
        raw[_OVERRIDES[key]] = value


_HF_ROPE_KEY = "model.hf_config_overrides.rope_scaling"


def _plain(value: Any) -> Any:
    """Nested Mapping / list-like (also OmegaConf DictConfig / ListConfig) -> plain dict / list."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        return [_plain(v) for v in value]
    return value


def _pop_rope(raw: dict[str, Any]) -> dict[str, Any]:
    """Remove ``rope_scaling`` / ``rope_parameters`` / ``rope_theta`` from a config.json dict; return them as
    one dict with ``rope_type`` and ``rope_theta`` (transformers' priority: the nested dict's rope_theta,
    then the top-level one, then 10000; ``rope_scaling`` wins over ``rope_parameters``; legacy ``type``)."""
    scaling, params = raw.pop("rope_scaling", None), raw.pop("rope_parameters", None)
    theta = raw.pop("rope_theta", None)
    rope = dict(scaling or params or {})
    if "type" in rope:
        rope.setdefault("rope_type", rope.pop("type"))
        rope.pop("type", None)
    rope.setdefault("rope_type", "default")
    rope.setdefault("rope_theta", 10000.0 if theta is None else theta)
    return rope


def _merge_rope(base: dict[str, Any], override: Mapping[str, Any] | None) -> dict[str, Any]:
    """``override`` merged key-wise over ``base``. A null override means unscaled RoPE. When the override
    names a different rope_type, the base's scaling fields are dropped (only rope_theta is kept): fields of
    another type would otherwise be carried along unused."""
    if override is None:
        return {"rope_type": "default", "rope_theta": base["rope_theta"]}
    override = dict(override)
    if "type" in override:
        override.setdefault("rope_type", override.pop("type"))
        override.pop("type", None)
    if override.get("rope_type", base["rope_type"]) != base["rope_type"]:
        base = {"rope_theta": base["rope_theta"]}
    return {**base, **override}


def _store_rope(raw: dict[str, Any], rope: dict[str, Any]) -> None:
    """Write the merged rope dict back as ``rope_theta`` + ``rope_scaling`` (read by transformers 4.x and 5.x)."""
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    raw["rope_theta"] = rope["rope_theta"]
    raw["rope_scaling"] = None if scaling == {"rope_type": "default"} else scaling


def _check_no_conflict(overrides: dict[str, Any], name: str, hf_key: str, hf_value: Any) -> None:
    """Raise ValueError when NxDT's ``model.<name>`` and an hf_config_overrides value set one field differently."""
    value = overrides.get(name)
    if value not in (None, -1) and value != hf_value:
        raise ValueError(f"model.{name} ({value!r}) and {hf_key} ({hf_value!r}) set the same config field "
                         f"differently; set only one of them")


def _apply_hf_config_overrides(raw: dict[str, Any], hf_overrides: Mapping[str, Any] | None,
                               overrides: dict[str, Any]) -> bool:
    """Merge ``model.hf_config_overrides`` over the config.json dict (in place); True when it has rope_scaling.

    Top-level keys replace config.json's; ``rope_scaling`` (or ``rope_parameters``) merges key-wise over
    the config's (see :func:`_merge_rope`) after a strict :func:`rope_scaling_problems` check of the
    override itself; ``rope_theta`` (top level or inside rope_scaling) sets the config's rope_theta.
    """
    hf = _plain(hf_overrides or {})
    if not isinstance(hf, dict):
        raise ValueError(f"model.hf_config_overrides must be a mapping of config.json keys, got {type(hf).__name__}")
    config_class = CONFIG_CLASSES[raw.get("model_type", "llama")]
    known = set(config_class().to_dict()) | {"rope_scaling", "rope_parameters", "rope_theta"}
    for key in hf:
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"see the {config_class.__name__} fields"
            family = config_class.__name__.removesuffix("Config")
            raise ValueError(f"model.hf_config_overrides.{key}: not a {family} config.json key; {hint}")
    if "rope_scaling" in hf and "rope_parameters" in hf:
        raise ValueError("model.hf_config_overrides: set rope_scaling or rope_parameters, not both")
    rope = _pop_rope(raw)
    has_rope = "rope_scaling" in hf or "rope_parameters" in hf
    rope_override = hf.pop("rope_scaling", hf.pop("rope_parameters", None))
    if rope_override is not None:
        raise_on_problems(rope_scaling_problems(rope_override, _HF_ROPE_KEY), _HF_ROPE_KEY)
    if "rope_theta" in hf and isinstance(rope_override, Mapping) and \
            rope_override.get("rope_theta", hf["rope_theta"]) != hf["rope_theta"]:
        raise ValueError(f"model.hf_config_overrides.rope_theta ({hf['rope_theta']!r}) and {_HF_ROPE_KEY}.rope_theta "
                         f"({rope_override['rope_theta']!r}) disagree; set only one of them")
    if "rope_theta" in hf:
        rope["rope_theta"] = hf.pop("rope_theta")
        _check_no_conflict(overrides, "rope_theta", "model.hf_config_overrides.rope_theta", rope["rope_theta"])
    if has_rope:
        rope = _merge_rope(rope, rope_override)
        if rope_override and "rope_theta" in rope_override:
            _check_no_conflict(overrides, "rope_theta", f"{_HF_ROPE_KEY}.rope_theta", rope["rope_theta"])
    for key, value in hf.items():
        nxd = next((k for k, field in _OVERRIDES.items() if field == key), None)
        if nxd is not None:
            _check_no_conflict(overrides, nxd, f"model.hf_config_overrides.{key}", value)
        raw[key] = value
    _store_rope(raw, rope)
    return has_rope


def build_llama_config(model_config_path: str, overrides: dict[str, Any] | None = None,
                       hf_config_overrides: Mapping[str, Any] | None = None) -> PretrainedConfig:
    """Read an HF Llama-family ``config.json`` (``model_type`` of :data:`CONFIG_CLASSES`: llama -> LlamaConfig,
    mixtral -> MixtralConfig), apply NxDT's ``model:`` overrides and ``model.hf_config_overrides``.

    Args:
        model_config_path: a config.json file or a directory containing one (NxDT ``model.model_config``).
        overrides: NxDT keys ``num_layers`` (-> num_hidden_layers), ``hidden_size``,
            ``max_position_embeddings``, ``rope_theta`` and ``encoder_seq_length`` (checked to be
            <= max_position_embeddings). ``None`` or -1 leaves the config.json value.
        hf_config_overrides: config.json keys merged over the file (NeMo RL's ``hf_config_overrides``);
            ``rope_scaling`` merges key-wise over the file's rope_scaling / rope_parameters (a different
            rope_type replaces the file's scaling fields; null means unscaled RoPE) and its ``rope_theta``
            sets the config's rope_theta. With rope_type yarn every field of
            :data:`~nxd_lc.models.common.rope.YARN_REQUIRED_FIELDS` is required in the override.

    Raises:
        FileNotFoundError: the file does not exist.
        ValueError: invalid JSON, a model_type not in CONFIG_CLASSES, a bad override value or unknown override key,
            an hf_config_overrides key that is not a Llama config key or that contradicts an NxDT
            override, an invalid rope_scaling (every problem listed), encoder_seq_length >
            max_position_embeddings, or hidden_act other than silu.
    """
    overrides = dict(overrides or {})
    raw = _read_config_json(Path(model_config_path))
    _apply_overrides(raw, overrides)
    merged = _apply_hf_config_overrides(raw, hf_config_overrides, overrides)
    key = f"{_HF_ROPE_KEY} (merged over {model_config_path})" if merged else f"rope_scaling of {model_config_path}"
    if raw["rope_scaling"]:
        head_dim = raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
        raise_on_problems(rope_scaling_problems({**raw["rope_scaling"], "rope_theta": raw["rope_theta"]}, key,
                                                head_dim=head_dim, strict=False), key)
    config_class = CONFIG_CLASSES[raw.get("model_type", "llama")]
    try:
        config = config_class.from_dict(raw)
    except Exception as e:  # noqa: BLE001 - transformers raises strict-validation errors, KeyError, ...
        family = config_class.__name__.removesuffix("Config")
        raise ValueError(f"model.model_config: {model_config_path} is not a valid {family} config: {e}") from e
    seq = overrides.get("encoder_seq_length")
    if seq not in (None, -1) and seq > config.max_position_embeddings:
        raise ValueError(
            f"model.encoder_seq_length ({seq}) exceeds max_position_embeddings "
            f"({config.max_position_embeddings}); set model.max_position_embeddings >= {seq}"
        )
    if config.hidden_act != "silu":
        raise ValueError(f"model.model_config: hidden_act={config.hidden_act!r} is not supported (Llama uses 'silu')")
    rope_spec_from_config(config, key)  # fail now on an unsupported rope_scaling
    return config


def pad_vocab_size(vocab_size: int, tp: int) -> int:
    """Smallest multiple of ``tp`` >= ``vocab_size`` (so the vocab shards evenly over TP)."""
    return -(-vocab_size // tp) * tp


def _normal_init(std: float, tensor: torch.Tensor) -> object:
    return nn.init.normal_(tensor, 0.0, std)


class LlamaAttention(nn.Module):
    """Causal self-attention with GQA and RoPE; heads sharded over TP.

    ``forward(x [B, S(/tp), H], cos, sin [B, S, Dr]) -> [B, S(/tp), H]`` (``Dr`` the rotary dims, ``D`` with
    ``rotary_percentage`` 1; cos / sin None: no RoPE, learned absolute positions). With ``qkv_linear`` the
    projection is one :class:`GQAQKVColumnParallelLinear` ``qkv_proj`` (supports ``kv_replicator``,
    ``fuse_qkv``); otherwise three ColumnParallelLinear ``q_proj``/``k_proj``/``v_proj``, which need
    ``num_key_value_heads % tp == 0`` (``fuse_qkv`` then has no effect).

    Family parts (:class:`~nxd_lc.models.common.family.DecoderOptions`): q/k/v and o biases, per-head q / k RMSNorm
    ``q_norm`` / ``k_norm`` [D] before RoPE (Qwen3; replicated weights whose gradients are summed over TP, as each
    rank normalises only its heads), the layer's sliding window and the attention dropout.

    Raises:
        ValueError: head counts that cannot be sharded over TP (message names the key to change).
    """

    def __init__(self, config: LlamaConfig, *, sequence_parallel: bool, kv_replicator: int, fuse_qkv: bool,
                 qkv_linear: bool, flash_attention: bool, init_method: InitMethod,
                 options: DecoderOptions | None = None, layer_index: int = 0,
                 output_init_method: InitMethod | None = None, **layer_kw: Any) -> None:
        super().__init__()
        opts = options or decoder_options(config)
        tp = parallel_state.get_tensor_model_parallel_world_size()
        nq, nkv, h = config.num_attention_heads, config.num_key_value_heads, config.hidden_size
        self.head_dim = getattr(config, "head_dim", None) or h // nq
        hd, sp = self.head_dim, sequence_parallel
        kw = dict(init_method=init_method, **layer_kw)
        if qkv_linear:
            self.qkv_proj = GQAQKVColumnParallelLinear(
                h, nq, nkv, hd, bias=opts.qkv_bias, kv_replicator=kv_replicator, fuse_qkv=fuse_qkv,
                sequence_parallel_enabled=sp, **kw)
        else:
            if nkv % tp or nq % tp or kv_replicator != 1:
                raise ValueError(
                    f"model.qkv_linear=False needs num_attention_heads ({nq}) and num_key_value_heads ({nkv}) "
                    f"divisible by tensor_model_parallel_size ({tp}) and kv_replicator=1 (got {kv_replicator}); "
                    f"set model.qkv_linear: True to use kv_replicator"
                )
            self.q_proj = ColumnParallelLinear(h, nq * hd, bias=opts.qkv_bias, sequence_parallel_enabled=sp, **kw)
            self.k_proj = ColumnParallelLinear(h, nkv * hd, bias=opts.qkv_bias, sequence_parallel_enabled=sp, **kw)
            self.v_proj = ColumnParallelLinear(h, nkv * hd, bias=opts.qkv_bias, sequence_parallel_enabled=sp, **kw)
        self.qkv_linear = qkv_linear
        self.q_norm = self.k_norm = None
        if opts.qk_norm:  # TP region: each rank normalises its own heads, so the shared weights' grads sum over TP
            norm_kw = {"dtype": layer_kw["dtype"], "device": layer_kw["device"]}
            self.q_norm = RMSNorm(hd, opts.norm_eps, sequence_parallel_enabled=tp > 1, **norm_kw)
            self.k_norm = RMSNorm(hd, opts.norm_eps, sequence_parallel_enabled=tp > 1, **norm_kw)
        self.o_proj = RowParallelLinear(nq * hd, h, bias=opts.o_bias, input_is_parallel=True,
                                        sequence_parallel_enabled=sp,
                                        **{**kw, "init_method": output_init_method or init_method})
        self.core_attention = CoreAttention(flash_attention=flash_attention, window=opts.window(layer_index),
                                            dropout=opts.attention_dropout)

    def forward(self, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None,
                segment_ids: torch.Tensor | None = None, kv_cache: LayerKVCache | None = None) -> torch.Tensor:
        """x [B, S(/tp), H], cos/sin [B, S, Dr] fp32 (None: no RoPE), segment_ids [B, S] or None -> [B, S(/tp), H].

        With ``kv_cache`` (inference): the S positions follow the cached ones; their keys / values are appended
        and they attend every cached position (:func:`cached_attention`); ``segment_ids`` must be None."""
        if self.qkv_linear:
            q, k, v = self.qkv_proj(x)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        b, s = q.shape[:2]
        q, k, v = (t.view(b, s, -1, self.head_dim) for t in (q, k, v))  # [B, S, heads, D]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, heads, S, D]
        if cos is not None:
            q, k = _rotate(q, k, cos, sin)
        if kv_cache is not None:
            k, v = kv_cache.append(k, v)
            out = cached_attention(q, k, v, window=self.core_attention.window)
        else:
            out = self.core_attention(q, k, v, segment_ids)  # [B, heads_local, S, D]
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


def _rotate(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
            sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE on the first ``Dr = cos.shape[-1]`` dims of each head of q / k [B, heads, S, D]; the other ``D - Dr``
    pass through (partial rotary, GPT-NeoX / Megatron ``rotary_percent``)."""
    dr = cos.shape[-1]
    if dr == q.shape[-1]:
        return apply_rotary_pos_emb(q, k, cos, sin)
    q_rot, k_rot = apply_rotary_pos_emb(q[..., :dr], k[..., :dr], cos, sin)
    return torch.cat([q_rot, q[..., dr:]], dim=-1), torch.cat([k_rot, k[..., dr:]], dim=-1)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block: ``h = x + drop(attn(norm1(x))); out = h + drop(mlp(norm2(h)))``; [B, S(/tp), H] -> same.

    ``drop`` is the hidden dropout (:class:`~nxd_lc.models.common.family.DecoderOptions`; identity at 0 or in
    eval), with a TP-layout-independent mask (:func:`~nxd_lc.layers.dropout.sharded_dropout`)."""

    #: nothing after the MLP saves a tensor for backward (the residual add does not): a checkpoint recomputation
    #: of this layer may skip the tiled MLP's chunk forwards (``nxd_lc.layers.tiled.discard_tiled_outputs``)
    tiled_output_unused_in_recompute: ClassVar[bool] = True

    def __init__(self, config: LlamaConfig, *, sequence_parallel: bool, init_method: InitMethod,
                 attn_kw: dict[str, Any], mlp: nn.Module | None = None, options: DecoderOptions | None = None,
                 layer_index: int = 0, output_init_method: InitMethod | None = None, **layer_kw: Any) -> None:
        super().__init__()
        opts = options or decoder_options(config)
        h, sp = config.hidden_size, sequence_parallel
        norm_kw = {"dtype": layer_kw["dtype"], "device": layer_kw["device"], "sequence_parallel_enabled": sp}
        self.input_layernorm = build_norm(opts.norm, h, opts.norm_eps, **norm_kw)
        self.self_attn = LlamaAttention(config, sequence_parallel=sp, init_method=init_method, options=opts,
                                        layer_index=layer_index, output_init_method=output_init_method,
                                        **attn_kw, **layer_kw)
        self.post_attention_layernorm = build_norm(opts.norm, h, opts.norm_eps, **norm_kw)
        self.hidden_dropout = opts.hidden_dropout
        self.sequence_parallel = sp
        mlp_kw = {"sequence_parallel_enabled": sp, "init_method": init_method, "ffn_dropout": opts.ffn_dropout,
                  "output_init_method": output_init_method, **layer_kw}
        # the feed-forward block: a given one (e.g. nxd_lc.moe.MoE for a mixture-of-experts layer), else the family's
        if mlp is not None:
            self.mlp = mlp
        elif opts.activation == "gelu":
            self.mlp = GeluMLP(h, config.intermediate_size, bias=opts.mlp_bias, **mlp_kw)
        else:
            self.mlp = LlamaMLP(h, config.intermediate_size, bias=opts.mlp_bias, **mlp_kw)

    def _drop(self, y: torch.Tensor) -> torch.Tensor:
        """Hidden dropout of a residual branch's output y [B, S(/tp), H] (sequence-sharded under SP)."""
        if not self.hidden_dropout or not self.training:
            return y
        return hidden_dropout(y, self.hidden_dropout, self.sequence_parallel)

    def forward(self, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None,
                segment_ids: torch.Tensor | None = None,
                kv_cache: LayerKVCache | None = None) -> torch.Tensor | tuple[torch.Tensor, Any]:
        """x [B, S(/tp), H], segment_ids [B, S] or None (see :class:`LlamaForCausalLM`), this layer's
        ``kv_cache`` or None -> [B, S(/tp), H]; ``(output, statistics)`` when the feed-forward block returns
        statistics too (a mixture-of-experts layer's :class:`~nxd_lc.moe.routing.RouterStats`)."""
        h = x + self._drop(self.self_attn(self.input_layernorm(x), cos, sin, segment_ids, kv_cache))
        y = self.mlp(self.post_attention_layernorm(h))
        if isinstance(y, tuple):
            y, stats = y
            return h + self._drop(y), stats
        return h + self._drop(y)


def hidden_dropout(y: torch.Tensor, p: float, sequence_parallel: bool) -> torch.Tensor:
    """Training-mode dropout of activations y [B, S(/tp), H] outside the TP region, the mask independent of the
    TP layout (sliced along S under sequence parallelism; see :mod:`nxd_lc.layers.dropout`)."""
    sp = sequence_parallel and parallel_state.get_tensor_model_parallel_world_size() > 1
    return sharded_dropout(y, p, True, shard_dim=1 if sp else None,
                           num_shards=parallel_state.get_tensor_model_parallel_world_size() if sp else 1,
                           shard_index=parallel_state.get_tensor_model_parallel_rank() if sp else 0)


class RemoteLayer(nn.Module):
    """Placeholder for decoder layer ``index`` held by another pipeline stage (no parameters; keeps the layer
    indices, hence the parameter names ``layers.<i>.*``, identical at every pipeline split)."""

    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Always raises RuntimeError: the layer's weights are on another pipeline stage."""
        raise RuntimeError(f"decoder layer {self.index} lives on another pipeline stage; run it there "
                           "(nxd_lc.pipeline) instead of calling the full model on this rank")


class LlamaForCausalLM(nn.Module):
    """Tensor/sequence-parallel Llama causal LM from an HF :class:`LlamaConfig`.

    Args:
        config: HF config (see :func:`build_llama_config`); kept as ``self.config`` (unpadded vocab).
        sequence_parallel: split activations outside the TP regions along S (needs S % tp == 0).
        kv_replicator: KV-head replication when num_key_value_heads < TP (must match
            ``parallel_state``'s); see :class:`GQAQKVColumnParallelLinear`.
        fuse_qkv: one fused ``[q; k; v]`` weight in ``qkv_proj``.
        qkv_linear: use ``GQAQKVColumnParallelLinear``; False -> separate q/k/v column layers.
        flash_attention: torch SDPA (True) or the eager reference attention (False).
        use_cpu_initialization: initialise full weights on CPU and slice (TP-size independent).
        dtype, device: of the parameters.
        keep_layers: decoder-layer indices this pipeline stage holds (None: all); the others become
            :class:`RemoteLayer` placeholders.
        keep_embedding, keep_head: whether this stage holds the embedding (first stage) and the final norm +
            lm head (last stage); the dropped modules are ``None``.

    Weights are initialised as HF does (``normal(0, initializer_range)`` for linear and embedding
    weights, ones for norms, zero biases); padded embedding rows are zeroed. With
    ``tie_word_embeddings`` the lm_head shares the embedding's Parameter (same ``[Vp/tp, H]`` layout).

    Raises:
        ValueError: on head / size combinations that cannot be sharded over TP.
    """

    def __init__(self, config: LlamaConfig, *, sequence_parallel: bool = False, kv_replicator: int = 1,
                 fuse_qkv: bool = True, qkv_linear: bool = True, flash_attention: bool = True,
                 use_cpu_initialization: bool = True, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None, keep_layers: Collection[int] | None = None,
                 keep_embedding: bool = True, keep_head: bool = True) -> None:
        super().__init__()
        self.config = config
        self.options = opts = decoder_options(config)
        self.sequence_parallel = sequence_parallel
        tp = parallel_state.get_tensor_model_parallel_world_size()
        self.vocab_size = config.vocab_size
        self.padded_vocab_size = pad_vocab_size(config.vocab_size, tp * opts.make_vocab_size_divisible_by)
        init = functools.partial(_normal_init, opts.init_std)
        output_init = functools.partial(_normal_init, opts.output_init_std)
        layer_kw = {"dtype": dtype, "device": device, "use_cpu_initialization": use_cpu_initialization}
        attn_kw = {"kv_replicator": kv_replicator, "fuse_qkv": fuse_qkv, "qkv_linear": qkv_linear,
                       "flash_attention": flash_attention}
        self.embed_tokens = ParallelEmbedding(self.padded_vocab_size, config.hidden_size,
                                              sequence_parallel_enabled=sequence_parallel, init_method=init,
                                              **layer_kw)
        self.embed_positions = self._position_table(init, dtype, device)
        # Every layer is built (so the seeded initialisation is the same at every pipeline split), and a layer
        # of another pipeline stage is dropped at once: peak memory is this stage's layers plus one.
        keep = set(range(config.num_hidden_layers)) if keep_layers is None else set(keep_layers)
        self.layers = nn.ModuleList()
        for i in range(config.num_hidden_layers):
            layer = LlamaDecoderLayer(config, sequence_parallel=sequence_parallel, init_method=init,
                                      attn_kw=attn_kw, mlp=self.build_mlp(i, config, sequence_parallel, init, layer_kw),
                                      options=opts, layer_index=i, output_init_method=output_init, **layer_kw)
            self.layers.append(layer if i in keep else RemoteLayer(i))
            del layer
        self.norm = build_norm(opts.norm, config.hidden_size, opts.norm_eps,
                               sequence_parallel_enabled=sequence_parallel, dtype=dtype, device=device)
        self.lm_head = ColumnParallelLinear(config.hidden_size, self.padded_vocab_size, bias=False,
                                            gather_output=False, sequence_parallel_enabled=sequence_parallel,
                                            init_method=init, **layer_kw)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary_emb = self._rotary()
        vocab_local = self.padded_vocab_size // tp
        first = parallel_state.get_tensor_model_parallel_rank() * vocab_local
        self.num_valid_vocab_local = max(0, min(vocab_local, config.vocab_size - first))
        self._zero_padded_embedding_rows()
        self._keep_pipeline_part(keep_embedding, keep_head)
        # tokens per chunk of the tiled CE in loss(); None: untiled (set by apply_memory_techniques)
        self.tiled_loss_chunk_size: int | None = None

    def _position_table(self, init: InitMethod, dtype: torch.dtype,
                        device: torch.device | str | None) -> nn.Embedding | None:
        """Learned absolute positions ``[max_position_embeddings, H]`` (replicated over TP; under sequence
        parallelism each rank adds the rows of its S/tp positions, so the weight's gradient is summed over TP),
        or None with RoPE."""
        if self.options.position_embedding != "learned_absolute":
            return None
        weight = torch.empty(self.config.max_position_embeddings, self.config.hidden_size, dtype=torch.float32)
        init(weight)  # on the host with the seeded generator, as the parallel layers' use_cpu_initialization
        table = nn.Embedding(*weight.shape, _weight=weight.to(dtype=dtype, device=device))
        table.weight.sequence_parallel_enabled = self.sequence_parallel
        return table

    def _rotary(self) -> RotaryEmbedding | None:
        """RoPE over the first ``rotary_percentage`` of each head's dims (None with learned positions)."""
        if self.options.position_embedding != "rope":
            return None
        spec = rope_spec_from_config(self.config)
        rotary_dim = int(spec.head_dim * self.options.rotary_percentage)
        if rotary_dim != spec.head_dim:
            spec = dataclasses.replace(spec, head_dim=rotary_dim)
        return RotaryEmbedding(spec)

    def embed(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """Token embedding (+ learned positions, + hidden dropout when training): input_ids, position_ids [B, S]
        -> [B, S(/tp), H] (sequence-sharded under SP, as the decoder layers take it)."""
        h = self.embed_tokens(input_ids)  # [B, S(/tp), H]
        if self.embed_positions is not None:
            pos = position_ids
            tp = parallel_state.get_tensor_model_parallel_world_size()
            if self.sequence_parallel and tp > 1:  # this rank's S/tp positions
                pos = pos.chunk(tp, dim=1)[parallel_state.get_tensor_model_parallel_rank()]
            h = h + self.embed_positions(pos).to(h.dtype)
        if self.options.hidden_dropout and self.training:
            h = hidden_dropout(h, self.options.hidden_dropout, self.sequence_parallel)
        return h

    def position_encoding(self, position_ids: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """RoPE ``(cos, sin)`` [B, S, Dr] fp32 for the decoder layers, or ``(None, None)`` with learned positions."""
        if self.rotary_emb is None:
            return None, None
        return self.rotary_emb(position_ids)

    def build_mlp(self, index: int, config: LlamaConfig, sequence_parallel: bool, init_method: InitMethod,
                  layer_kw: dict[str, Any]) -> nn.Module | None:
        """The feed-forward block of decoder layer ``index``, or None for the dense :class:`LlamaMLP` (what
        Llama uses everywhere; families with other blocks, e.g. mixture-of-experts layers, override this)."""
        return None

    def _keep_pipeline_part(self, keep_embedding: bool, keep_head: bool) -> None:
        """Drop the embedding and position table (not on the first pipeline stage) and the final norm + lm head
        (not on the last).

        With tied embeddings split over two stages, the last stage's lm head gets its own copy of the (already
        initialised) embedding weight; both are flagged ``pipeline_tied`` and their gradients are summed over the
        embedding group (:func:`nxd_lc.distributed.grads.allreduce_tied_embedding_gradients`); the copy is also
        flagged ``pipeline_tied_copy`` so global norms count the weight once (Megatron's shared embedding).
        """
        tied = bool(self.config.tie_word_embeddings)
        if keep_head and not keep_embedding and tied:
            self.lm_head.weight = nn.Parameter(self.embed_tokens.weight.detach().clone())
            for attr, value in vars(self.embed_tokens.weight).items():  # TP layout flags
                setattr(self.lm_head.weight, attr, value)
            self.lm_head.weight.pipeline_tied = True
            self.lm_head.weight.pipeline_tied_copy = True
        if keep_embedding and not keep_head and tied:
            self.embed_tokens.weight.pipeline_tied = True
        if not keep_embedding:
            self.embed_tokens = None
            self.embed_positions = None
        if not keep_head:
            self.norm = None
            self.lm_head = None

    def local_layers(self) -> list[tuple[int, LlamaDecoderLayer]]:
        """``(index, layer)`` of the decoder layers held by this process (all of them without pipelining)."""
        return [(i, layer) for i, layer in enumerate(self.layers) if not isinstance(layer, RemoteLayer)]

    @torch.no_grad()
    def _zero_padded_embedding_rows(self) -> None:
        """Zero the embedding rows of padded vocab ids (only on the last TP rank(s))."""
        if self.embed_tokens is not None:
            self.embed_tokens.weight[self.num_valid_vocab_local:].zero_()

    def _check_inputs(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None) -> torch.Tensor:
        """Validate [B, S] ids; return position_ids (default ``arange(S)`` per row)."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, S], got shape {tuple(input_ids.shape)}")
        b, s = input_ids.shape
        tp = parallel_state.get_tensor_model_parallel_world_size()
        if self.sequence_parallel and s % tp:
            raise ValueError(
                f"sequence length {s} is not divisible by tensor_model_parallel_size {tp}, which sequence "
                f"parallelism requires; pad the sequence (data.seq_length) to a multiple of {tp}"
            )
        if position_ids is None:
            return torch.arange(s, device=input_ids.device).unsqueeze(0).expand(b, s)
        if tuple(position_ids.shape) != (b, s):
            raise ValueError(f"position_ids shape {tuple(position_ids.shape)} must equal input_ids' {(b, s)}")
        return position_ids

    def kv_cache_unsupported(self) -> str | None:
        """Why this model cannot run with a :class:`KVCache` at the current layout, or None when it can."""
        if parallel_state.get_context_parallel_world_size() > 1:
            return "context parallelism shards the sequence over ranks"
        if self.sequence_parallel and parallel_state.get_tensor_model_parallel_world_size() > 1:
            return "sequence parallelism splits every forward's positions over the TP ranks"
        if any(isinstance(layer, RemoteLayer) for layer in self.layers):
            return "pipeline parallelism holds the layers on several ranks"
        return None

    def new_kv_cache(self) -> KVCache:
        """An empty :class:`KVCache` for :meth:`hidden_states` / :meth:`forward` (inference).

        Raises:
            ValueError: the layout cannot use one (:meth:`kv_cache_unsupported`).
        """
        why = self.kv_cache_unsupported()
        if why is not None:
            raise ValueError(f"KV cache not available: {why}")
        return KVCache(len(self.layers))

    def hidden_states(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                      segment_ids: torch.Tensor | None = None, kv_cache: KVCache | None = None) -> torch.Tensor:
        """input_ids [B, S], position_ids [B, S] or None (0..S-1) -> lm-head input [B, S, H].

        The final norm's output, entered into the TP region exactly as the lm head's column layer does:
        all-gathered to the full S under sequence parallelism (backward: reduce-scatter), identity otherwise
        (backward: all-reduce over TP). Whatever consumes it must therefore be a TP-sharded computation such
        as :meth:`logits_from_hidden` or :func:`causal_lm_loss_from_hidden` (each rank's gradient is partial).

        ``segment_ids`` [B, S] integer (packed-document index of each token, non-decreasing along S) restricts
        attention to each document (see :func:`nxd_lc.models.common.attention.core_attention`); None or all
        zeros attends causally over the whole row.

        ``kv_cache`` (from :meth:`new_kv_cache`; inference, no gradient): ``input_ids`` continue the cached
        positions (``position_ids`` default ``cache.length + arange(S)``) and are appended to the cache.

        Raises:
            ValueError: bad input shapes (names the tensor), or decreasing / non-integer segment_ids;
                ``segment_ids`` together with a ``kv_cache``.
        """
        if kv_cache is not None:
            if segment_ids is not None:
                raise ValueError("hidden_states: segment_ids (packed documents) cannot be used with a kv_cache")
            if position_ids is None:
                b, s = input_ids.shape
                position_ids = (kv_cache.length + torch.arange(s, device=input_ids.device)).unsqueeze(0).expand(b, s)
        position_ids = self._check_inputs(input_ids, position_ids)
        self._check_segment_ids(segment_ids, input_ids)
        cos, sin = self.position_encoding(position_ids)  # [B, S, Dr] fp32 (None: learned positions)
        h = self.embed(input_ids, position_ids)  # [B, S(/tp), H]
        h = self.run_layers(h, range(len(self.layers)), cos, sin, segment_ids, kv_cache)
        return self.head_input(h)

    @staticmethod
    def _check_segment_ids(segment_ids: torch.Tensor | None, input_ids: torch.Tensor) -> None:
        if segment_ids is not None and segment_ids.shape != input_ids.shape:
            raise ValueError(f"segment_ids shape {tuple(segment_ids.shape)} must equal input_ids' "
                             f"{tuple(input_ids.shape)}")

    def run_layers(self, h: torch.Tensor, layer_ids: Iterable[int], cos: torch.Tensor, sin: torch.Tensor,
                   segment_ids: torch.Tensor | None = None, kv_cache: KVCache | None = None) -> torch.Tensor:
        """Decoder layers ``layer_ids`` in order: h [B, S(/tp), H] -> [B, S(/tp), H]; cos/sin [B, S, D] fp32;
        ``kv_cache``: see :meth:`hidden_states`.

        Raises:
            RuntimeError: a layer of ``layer_ids`` lives on another pipeline stage.
        """
        for i in layer_ids:
            if kv_cache is None:
                out = self.layers[i](h, cos, sin, segment_ids)
            else:
                out = self.layers[i](h, cos, sin, segment_ids, kv_cache.layers[i])
            h = self.collect_layer_statistics(out)
        return h

    #: fp32 values of per-layer statistics that travel between pipeline stages beside the hidden states (0: none;
    #: a family whose layers return statistics, e.g. mixture of experts, sets it and overrides the methods below)
    pipeline_statistics_size: int = 0

    def begin_pipeline_stage(self, carried: torch.Tensor | None) -> None:
        """A pipeline stage starts: ``carried`` [pipeline_statistics_size] fp32 from the previous stage (None on
        the first). Llama carries nothing."""

    def end_pipeline_stage(self) -> torch.Tensor:
        """A (non-last) pipeline stage ends: the statistics to send on, [pipeline_statistics_size] fp32."""
        raise NotImplementedError(f"{type(self).__name__} carries no statistics between pipeline stages")

    def add_auxiliary_loss(self, loss_sum: torch.Tensor, num_tokens: torch.Tensor) -> torch.Tensor:
        """``loss_sum`` of the micro-batch's token losses plus any auxiliary term, times ``num_tokens`` so that
        ``loss_sum / num_tokens`` adds the term once (Llama: none; mixture of experts: the load-balancing loss)."""
        return loss_sum

    def collect_layer_statistics(self, out: torch.Tensor | tuple[torch.Tensor, Any]) -> torch.Tensor:
        """A decoder layer's output -> its hidden states [B, S(/tp), H]. Llama layers return only those; a
        family whose layers also return statistics (mixture of experts) overrides this to keep them."""
        if isinstance(out, tuple):
            raise TypeError(f"{type(self).__name__}: a decoder layer returned statistics this model does not "
                            "collect (a mixture-of-experts block in a Llama model?)")
        return out

    def head_input(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm of the last layer's output h [B, S(/tp), H], entered into the TP region -> [B, S, H]
        (see :meth:`hidden_states`)."""
        h = self.norm(h)  # [B, S(/tp), H]
        if self.lm_head.sequence_parallel_enabled:
            return gather_from_sequence_parallel_region(h, to_model_parallel=True)  # [B, S, H]
        return copy_to_tensor_model_parallel_region(h)

    def logits_from_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """lm-head input [B, S, H] (from :meth:`hidden_states`) -> logits_local [B, S, Vp/tp].

        Padded vocab columns hold the dtype's lowest finite value (see the module docstring).
        """
        return vocab_parallel_logits(hidden, self.lm_head.weight, self.num_valid_vocab_local)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                segment_ids: torch.Tensor | None = None, kv_cache: KVCache | None = None) -> torch.Tensor:
        """input_ids [B, S] (+ position_ids, segment_ids, kv_cache as :meth:`hidden_states`) -> logits_local
        [B, S, Vp/tp].

        ``logits_from_hidden(hidden_states(...))``: the lm head of the model's ``lm_head`` weight.
        """
        return self.logits_from_hidden(self.hidden_states(input_ids, position_ids, segment_ids, kv_cache))

    def loss(self, input_ids: torch.Tensor, labels: torch.Tensor, position_ids: torch.Tensor | None = None,
             ignore_index: int = -100, segment_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(loss_sum, num_tokens)`` of the micro-batch; see :func:`causal_lm_loss_from_hidden`.

        With ``tiled_loss_chunk_size`` set the [B, S, Vp/tp] logits are never materialised.
        """
        hidden = self.hidden_states(input_ids, position_ids, segment_ids)
        return causal_lm_loss_from_hidden(self, hidden, labels, ignore_index)


def causal_lm_loss_from_hidden(model: LlamaForCausalLM, hidden: torch.Tensor, labels: torch.Tensor,
                               ignore_index: int = -100) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed next-token cross-entropy from the lm-head input, tiled when ``model.tiled_loss_chunk_size`` is set.

    Args:
        model: the decoder (its ``lm_head.weight`` [Vp/tp, H], ``num_valid_vocab_local`` and
            ``tiled_loss_chunk_size`` are used).
        hidden: [B, S, H] from :meth:`LlamaForCausalLM.hidden_states`.
        labels: [B, S] int64, already shifted; ``ignore_index`` marks positions without a target.

    Returns:
        ``(loss_sum, num_tokens)`` as :func:`causal_lm_loss`. Untiled: ``causal_lm_loss`` of the full logits.
        Tiled (:func:`nxd_lc.layers.tiled.tiled_causal_lm_loss`): same loss and gradients, computed
        ``tiled_loss_chunk_size`` tokens at a time, never holding more than ``[chunk, Vp/tp]`` logits.

    Raises:
        ValueError: shapes disagree or labels are not integers.
    """
    if model.tiled_loss_chunk_size is None:
        return causal_lm_loss(model.logits_from_hidden(hidden), labels, ignore_index)
    return tiled_causal_lm_loss(hidden, model.lm_head.weight, labels, chunk_size=model.tiled_loss_chunk_size,
                                num_valid_vocab_local=model.num_valid_vocab_local, ignore_index=ignore_index)


def causal_lm_loss(logits_local: torch.Tensor, labels: torch.Tensor,
                   ignore_index: int = -100) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed next-token cross-entropy over vocab-parallel logits.

    Args:
        logits_local: [B, S, Vp/tp] from :meth:`LlamaForCausalLM.forward`.
        labels: [B, S] int64, already shifted by the data pipeline (``labels[:, t]`` is the target of
            position t); ``ignore_index`` marks positions without a target.

    Returns:
        ``(loss_sum, num_tokens)``: fp32 scalar sum of per-token losses over non-ignored positions
        and an int64 scalar tensor counting them (no host sync). The mean is ``loss_sum / num_tokens``
        (reduce both over DP/CP first for a global token-weighted mean).

    Raises:
        ValueError: (from :func:`parallel_cross_entropy`) if the shapes disagree or labels are not integers.
    """
    per_token = parallel_cross_entropy(logits_local, labels, ignore_index=ignore_index)  # [B, S] fp32
    valid = labels != ignore_index
    return per_token.masked_fill(~valid, 0.0).sum(), valid.sum()
