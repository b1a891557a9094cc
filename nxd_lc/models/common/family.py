"""Per-family options of the one decoder (:class:`~nxd_lc.models.llama.model.LlamaForCausalLM`).

Every supported family is the same pre-norm decoder (``h = x + attn(norm1(x)); out = h + mlp(norm2(h))``) and
differs only in small parts, collected here as a :class:`DecoderOptions` read from the model's config:

============  ==========  =========  ===============  ==========  =======  ===============  ==========
family        norm        MLP        q/k/v bias       o bias      q/k norm sliding window   positions
============  ==========  =========  ===============  ==========  =======  ===============  ==========
llama         RMSNorm     SwiGLU     attention_bias   attention_  no       no               RoPE
                                                      bias
mistral       RMSNorm     SwiGLU     no               no          no       ``sliding_window``  RoPE
mixtral       RMSNorm     MoE        no               no          no       (not supported)  RoPE
qwen2         RMSNorm     SwiGLU     yes              no          no       ``layer_types``  RoPE
qwen3         RMSNorm     SwiGLU     attention_bias   attention_  per-head ``layer_types``  RoPE
                                                      bias        RMSNorm
megatron      YAML        YAML       has_bias         has_bias    no       YAML             YAML
============  ==========  =========  ===============  ==========  =======  ===============  ==========

(transformers' ``modeling_{llama,mistral,qwen2,qwen3}.py`` are the references; the Megatron source's options come
from NxDT's ``model:`` YAML keys, :mod:`nxd_lc.models.megatron`, and are stored on the config as the plain dict
``config.nxd_decoder`` so the config stays JSON-serialisable.)
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, fields
from typing import Any

__all__ = ["FAMILIES", "DecoderOptions", "decoder_options", "hf_export_config", "scaled_init_std"]

#: HF ``model_type`` values the decoder reads (``mixtral`` adds mixture-of-experts blocks).
FAMILIES = ("llama", "mistral", "mixtral", "qwen2", "qwen3")


@dataclass(frozen=True)
class DecoderOptions:
    """The family-specific parts of the decoder.

    Attributes:
        norm: ``rmsnorm`` (Zhang & Sennrich 2019) or ``layernorm`` (Ba et al. 2016, with bias).
        norm_eps: epsilon of every norm.
        activation: ``swiglu`` (fused gate/up, Shazeer 2020) or ``gelu`` (exact erf GeLU between ``up_proj`` and
            ``down_proj``, GPT-2 / Megatron).
        qkv_bias / o_bias / mlp_bias: biases of the q/k/v projections, the attention output and the MLP linears.
        qk_norm: per-head RMSNorm of q and k (over head_dim) before RoPE (Qwen3).
        layer_windows: per decoder layer, the sliding-window size in keys (query t attends keys ``t - w < j <= t``,
            transformers' ``sliding_window_overlay``) or None for full causal attention; empty: none anywhere.
        position_embedding: ``rope`` or ``learned_absolute`` (a trained ``[max_positions, H]`` table added to the
            token embedding, GPT-2).
        rotary_percentage: share of each head's dims RoPE rotates (the first ``rotary_dim``; GPT-NeoX /
            Megatron ``rotary_percent``); 1.0 rotates all.
        hidden_dropout: dropout on the embedding output and on the attention / MLP outputs before each residual add.
        attention_dropout: dropout on the attention probabilities.
        ffn_dropout: dropout on the MLP's activation (between its two projections).
        init_std: std of the normal init of every linear / embedding weight.
        output_init_std: std of ``o_proj`` / ``down_proj`` (Megatron's scaled init, ``init_std / sqrt(2 L)``,
            Megatron-LM ``scaled_init_method_normal``; equal to ``init_std`` without scaling).
        make_vocab_size_divisible_by: the embedding / lm head hold ``ceil(V / (m * tp)) * m * tp`` rows
            (Megatron-LM's ``_vocab_size_with_padding``; 1: a multiple of TP only). The padded logits are masked.
    """

    norm: str = "rmsnorm"
    norm_eps: float = 1e-6
    activation: str = "swiglu"
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    layer_windows: tuple[int | None, ...] = ()
    position_embedding: str = "rope"
    rotary_percentage: float = 1.0
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    ffn_dropout: float = 0.0
    init_std: float = 0.02
    output_init_std: float = 0.02
    make_vocab_size_divisible_by: int = 1

    def window(self, layer: int) -> int | None:
        """Sliding-window size of decoder layer ``layer`` (None: full causal attention)."""
        return self.layer_windows[layer] if self.layer_windows else None


def _layer_windows(config: Any) -> tuple[int | None, ...]:
    """Per-layer sliding windows from ``layer_types`` (qwen2 / qwen3) or a model-wide ``sliding_window``
    (mistral); () when no layer slides."""
    window = getattr(config, "sliding_window", None)
    n = int(config.num_hidden_layers)
    if config.model_type in ("qwen2", "qwen3"):
        types = getattr(config, "layer_types", None) or ["full_attention"] * n
        if not getattr(config, "use_sliding_window", False) or window is None:
            return ()
        out = tuple(int(window) if t == "sliding_attention" else None for t in types[:n])
        return out if any(w is not None for w in out) else ()
    if config.model_type == "mistral" and window is not None:
        return (int(window),) * n
    return ()


def _hf_options(config: Any) -> dict[str, Any]:
    """Options of an HF config.json family (module table)."""
    attention_bias = bool(getattr(config, "attention_bias", False))
    kind = config.model_type
    std = float(getattr(config, "initializer_range", 0.02))
    return {
        "norm": "rmsnorm", "norm_eps": float(config.rms_norm_eps), "activation": "swiglu",
        # transformers' mistral / mixtral / qwen2 / qwen3 classes hard-code their biases (a stray config field
        # changes nothing there, so it does not here)
        "qkv_bias": True if kind == "qwen2" else attention_bias if kind in ("llama", "qwen3") else False,
        "o_bias": attention_bias if kind in ("llama", "qwen3") else False,
        "mlp_bias": bool(getattr(config, "mlp_bias", False)) if kind == "llama" else False,
        "qk_norm": kind == "qwen3",
        "layer_windows": _layer_windows(config), "attention_dropout": float(getattr(config, "attention_dropout", 0.0)),
        "init_std": std, "output_init_std": std,
    }


def decoder_options(config: Any) -> DecoderOptions:
    """The :class:`DecoderOptions` of an HF config (``model_type`` in :data:`FAMILIES`), or of a Megatron-source
    config (``config.nxd_decoder``, a dict of DecoderOptions fields, wins over the family's defaults).

    Raises:
        ValueError: an unknown ``model_type``; an ``nxd_decoder`` entry that is not a DecoderOptions field.
    """
    kind = getattr(config, "model_type", "llama")
    if kind not in FAMILIES:
        raise ValueError(f"model_type {kind!r} is not supported; supported: {', '.join(FAMILIES)}")
    options = _hf_options(config)
    extra = dict(getattr(config, "nxd_decoder", None) or {})
    unknown = set(extra) - {f.name for f in fields(DecoderOptions)}
    if unknown:
        raise ValueError(f"config.nxd_decoder has unknown entries {sorted(unknown)}")
    options.update(extra)
    if isinstance(options["layer_windows"], list):
        options["layer_windows"] = tuple(options["layer_windows"])
    return DecoderOptions(**options)


def scaled_init_std(std: float, num_layers: int) -> float:
    """``std / sqrt(2 * num_layers)``: Megatron-LM's scaled init of the residual-branch output layers
    (``megatron/model/utils.py`` ``scaled_init_method_normal``; GPT-2 paper, Radford et al. 2019, sec. 2.3)."""
    return std / math.sqrt(2.0 * num_layers)


#: the DecoderOptions fields that change the computation of a trained model (not its initialisation or dropout)
_ARCHITECTURE_FIELDS = ("norm", "norm_eps", "activation", "qkv_bias", "o_bias", "mlp_bias", "qk_norm", "layer_windows",
                        "position_embedding", "rotary_percentage")


def hf_export_config(config: Any) -> Any:
    """A copy of ``config`` for an HF ``config.json``: a Megatron-source config loses its ``nxd_decoder`` entry,
    which transformers would ignore, so it must describe nothing transformers' class of ``model_type`` lacks. An
    ``auto_map`` read from the source config.json is dropped: the export holds transformers' own class of
    ``model_type`` (nxd_lc never ran the source's code), and the mapped code files are not in the export directory.

    Raises:
        ValueError: the Megatron options give an architecture the HF family does not have (e.g. LayerNorm, GeLU,
            learned positions, biases or partial rotary on a llama config); names the differing options.
    """
    out = copy.deepcopy(config)
    if hasattr(out, "auto_map"):
        delattr(out, "auto_map")
    extra = getattr(out, "nxd_decoder", None)
    if not extra:
        return out
    delattr(out, "nxd_decoder")
    ours, theirs = decoder_options(config), decoder_options(out)
    differ = [f"{f}={getattr(ours, f)!r} (HF {out.model_type}: {getattr(theirs, f)!r})"
              for f in _ARCHITECTURE_FIELDS if getattr(ours, f) != getattr(theirs, f)]
    if differ:
        raise ValueError(f"not supported yet: HF export of this model_source: megatron architecture; transformers' "
                         f"{out.model_type} has no {', '.join(differ)}. Keep the nxd checkpoint (or use rmsnorm, "
                         "swiglu, rope with rotary_percentage 1 and has_bias false, which export as Llama)")
    return out
