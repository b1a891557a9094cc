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

import functools
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import LlamaConfig

from nxd_lc.distributed import parallel_state
from nxd_lc.layers import (
    ColumnParallelLinear,
    GQAQKVColumnParallelLinear,
    ParallelEmbedding,
    RowParallelLinear,
    parallel_cross_entropy,
)
from nxd_lc.layers.linear import InitMethod
from nxd_lc.models.common.attention import CoreAttention
from nxd_lc.models.common.mlp import LlamaMLP
from nxd_lc.models.common.norm import RMSNorm
from nxd_lc.models.common.rope import RotaryEmbedding, apply_rotary_pos_emb, rope_spec_from_config

__all__ = [
    "LlamaAttention",
    "LlamaDecoderLayer",
    "LlamaForCausalLM",
    "build_llama_config",
    "causal_lm_loss",
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
    if raw.get("model_type", "llama") != "llama":
        raise ValueError(f"model.model_config: {path} has model_type={raw['model_type']!r}; expected 'llama'")
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


def build_llama_config(model_config_path: str, overrides: dict[str, Any] | None = None) -> LlamaConfig:
    """Read an HF Llama ``config.json`` and apply NxDT's ``model:`` overrides.

    Args:
        model_config_path: a config.json file or a directory containing one (NxDT ``model.model_config``).
        overrides: NxDT keys ``num_layers`` (-> num_hidden_layers), ``hidden_size``,
            ``max_position_embeddings``, ``rope_theta`` and ``encoder_seq_length`` (checked to be
            <= max_position_embeddings). ``None`` or -1 leaves the config.json value.

    Raises:
        FileNotFoundError: the file does not exist.
        ValueError: invalid JSON, not a Llama config, a bad override value or unknown override key,
            encoder_seq_length > max_position_embeddings, hidden_act other than silu, or an
            unsupported rope_scaling type.
    """
    overrides = dict(overrides or {})
    raw = _read_config_json(Path(model_config_path))
    _apply_overrides(raw, overrides)
    try:
        config = LlamaConfig.from_dict(raw)
    except Exception as e:  # noqa: BLE001 - transformers raises strict-validation errors, KeyError, ...
        raise ValueError(f"model.model_config: {model_config_path} is not a valid Llama config: {e}") from e
    seq = overrides.get("encoder_seq_length")
    if seq not in (None, -1) and seq > config.max_position_embeddings:
        raise ValueError(
            f"model.encoder_seq_length ({seq}) exceeds max_position_embeddings "
            f"({config.max_position_embeddings}); set model.max_position_embeddings >= {seq}"
        )
    if config.hidden_act != "silu":
        raise ValueError(f"model.model_config: hidden_act={config.hidden_act!r} is not supported (Llama uses 'silu')")
    rope_spec_from_config(config)  # fail now on an unsupported rope_scaling
    return config


def pad_vocab_size(vocab_size: int, tp: int) -> int:
    """Smallest multiple of ``tp`` >= ``vocab_size`` (so the vocab shards evenly over TP)."""
    return -(-vocab_size // tp) * tp


def _normal_init(std: float, tensor: torch.Tensor) -> object:
    return nn.init.normal_(tensor, 0.0, std)


class LlamaAttention(nn.Module):
    """Causal self-attention with GQA and RoPE; heads sharded over TP.

    ``forward(x [B, S(/tp), H], cos, sin [B, S, D]) -> [B, S(/tp), H]``. With ``qkv_linear`` the
    projection is one :class:`GQAQKVColumnParallelLinear` ``qkv_proj`` (supports ``kv_replicator``,
    ``fuse_qkv``); otherwise three ColumnParallelLinear ``q_proj``/``k_proj``/``v_proj``, which need
    ``num_key_value_heads % tp == 0`` (``fuse_qkv`` then has no effect).

    Raises:
        ValueError: head counts that cannot be sharded over TP (message names the key to change).
    """

    def __init__(self, config: LlamaConfig, *, sequence_parallel: bool, kv_replicator: int, fuse_qkv: bool,
                 qkv_linear: bool, flash_attention: bool, init_method: InitMethod, **layer_kw: Any) -> None:
        super().__init__()
        tp = parallel_state.get_tensor_model_parallel_world_size()
        nq, nkv, h = config.num_attention_heads, config.num_key_value_heads, config.hidden_size
        self.head_dim = getattr(config, "head_dim", None) or h // nq
        bias, hd, sp = bool(config.attention_bias), self.head_dim, sequence_parallel
        kw = dict(init_method=init_method, **layer_kw)
        if qkv_linear:
            self.qkv_proj = GQAQKVColumnParallelLinear(
                h, nq, nkv, hd, bias=bias, kv_replicator=kv_replicator, fuse_qkv=fuse_qkv,
                sequence_parallel_enabled=sp, **kw)
        else:
            if nkv % tp or nq % tp or kv_replicator != 1:
                raise ValueError(
                    f"model.qkv_linear=False needs num_attention_heads ({nq}) and num_key_value_heads ({nkv}) "
                    f"divisible by tensor_model_parallel_size ({tp}) and kv_replicator=1 (got {kv_replicator}); "
                    f"set model.qkv_linear: True to use kv_replicator"
                )
            self.q_proj = ColumnParallelLinear(h, nq * hd, bias=bias, sequence_parallel_enabled=sp, **kw)
            self.k_proj = ColumnParallelLinear(h, nkv * hd, bias=bias, sequence_parallel_enabled=sp, **kw)
            self.v_proj = ColumnParallelLinear(h, nkv * hd, bias=bias, sequence_parallel_enabled=sp, **kw)
        self.qkv_linear = qkv_linear
        self.o_proj = RowParallelLinear(nq * hd, h, bias=bias, input_is_parallel=True,
                                        sequence_parallel_enabled=sp, **kw)
        self.core_attention = CoreAttention(flash_attention=flash_attention)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [B, S(/tp), H], cos/sin [B, S, D] fp32 -> [B, S(/tp), H]."""
        if self.qkv_linear:
            q, k, v = self.qkv_proj(x)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        b, s = q.shape[:2]
        q, k, v = (t.view(b, s, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))  # [B, heads, S, D]
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        out = self.core_attention(q, k, v)  # [B, heads_local, S, D]
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block: ``h = x + attn(norm1(x)); out = h + mlp(norm2(h))``; [B, S(/tp), H] -> same."""

    def __init__(self, config: LlamaConfig, *, sequence_parallel: bool, init_method: InitMethod,
                 attn_kw: dict[str, Any], **layer_kw: Any) -> None:
        super().__init__()
        h, eps, sp = config.hidden_size, config.rms_norm_eps, sequence_parallel
        norm_kw = {"dtype": layer_kw["dtype"], "device": layer_kw["device"]}
        self.input_layernorm = RMSNorm(h, eps, sequence_parallel_enabled=sp, **norm_kw)
        self.self_attn = LlamaAttention(config, sequence_parallel=sp, init_method=init_method, **attn_kw,
                                        **layer_kw)
        self.post_attention_layernorm = RMSNorm(h, eps, sequence_parallel_enabled=sp, **norm_kw)
        self.mlp = LlamaMLP(h, config.intermediate_size, bias=bool(getattr(config, "mlp_bias", False)),
                            sequence_parallel_enabled=sp, init_method=init_method, **layer_kw)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [B, S(/tp), H] -> [B, S(/tp), H]."""
        h = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return h + self.mlp(self.post_attention_layernorm(h))


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

    Weights are initialised as HF does (``normal(0, initializer_range)`` for linear and embedding
    weights, ones for norms, zero biases); padded embedding rows are zeroed. With
    ``tie_word_embeddings`` the lm_head shares the embedding's Parameter (same ``[Vp/tp, H]`` layout).

    Raises:
        ValueError: on head / size combinations that cannot be sharded over TP.
    """

    def __init__(self, config: LlamaConfig, *, sequence_parallel: bool = False, kv_replicator: int = 1,
                 fuse_qkv: bool = True, qkv_linear: bool = True, flash_attention: bool = True,
                 use_cpu_initialization: bool = True, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.config = config
        self.sequence_parallel = sequence_parallel
        tp = parallel_state.get_tensor_model_parallel_world_size()
        self.vocab_size = config.vocab_size
        self.padded_vocab_size = pad_vocab_size(config.vocab_size, tp)
        init = functools.partial(_normal_init, config.initializer_range)
        layer_kw = {"dtype": dtype, "device": device, "use_cpu_initialization": use_cpu_initialization}
        attn_kw = {"kv_replicator": kv_replicator, "fuse_qkv": fuse_qkv, "qkv_linear": qkv_linear,
                       "flash_attention": flash_attention}
        self.embed_tokens = ParallelEmbedding(self.padded_vocab_size, config.hidden_size,
                                              sequence_parallel_enabled=sequence_parallel, init_method=init,
                                              **layer_kw)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, sequence_parallel=sequence_parallel, init_method=init, attn_kw=attn_kw,
                              **layer_kw)
            for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, sequence_parallel_enabled=sequence_parallel,
                            dtype=dtype, device=device)
        self.lm_head = ColumnParallelLinear(config.hidden_size, self.padded_vocab_size, bias=False,
                                            gather_output=False, sequence_parallel_enabled=sequence_parallel,
                                            init_method=init, **layer_kw)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary_emb = RotaryEmbedding(rope_spec_from_config(config))
        vocab_local = self.padded_vocab_size // tp
        first = parallel_state.get_tensor_model_parallel_rank() * vocab_local
        self.num_valid_vocab_local = max(0, min(vocab_local, config.vocab_size - first))
        self._zero_padded_embedding_rows()

    @torch.no_grad()
    def _zero_padded_embedding_rows(self) -> None:
        """Zero the embedding rows of padded vocab ids (only on the last TP rank(s))."""
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

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [B, S], position_ids [B, S] or None (0..S-1) -> logits_local [B, S, Vp/tp].

        Padded vocab columns hold the dtype's lowest finite value (see the module docstring).
        """
        position_ids = self._check_inputs(input_ids, position_ids)
        cos, sin = self.rotary_emb(position_ids)  # [B, S, D] fp32
        h = self.embed_tokens(input_ids)  # [B, S(/tp), H]
        for layer in self.layers:
            h = layer(h, cos, sin)
        logits = self.lm_head(self.norm(h))  # SP: lm_head all-gathers S -> [B, S, Vp/tp]
        if self.num_valid_vocab_local < logits.shape[-1]:
            pad = torch.arange(logits.shape[-1], device=logits.device) >= self.num_valid_vocab_local
            logits = logits.masked_fill(pad, torch.finfo(logits.dtype).min)
        return logits

    def loss(self, input_ids: torch.Tensor, labels: torch.Tensor, position_ids: torch.Tensor | None = None,
             ignore_index: int = -100) -> tuple[torch.Tensor, torch.Tensor]:
        """``causal_lm_loss(self(input_ids, position_ids), labels, ignore_index)``; see there."""
        return causal_lm_loss(self(input_ids, position_ids), labels, ignore_index)


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
