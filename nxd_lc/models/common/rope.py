"""Rotary position embedding (RoPE) with every Llama-family scaling type of transformers.

Shapes (batch-first, see DESIGN.md):
    position_ids  [B, S]            int64 absolute positions (CP-split or per-document positions are fine)
    inv_freq      [D/2]             float32, D = head_dim
    cos, sin      [B, S, D]         always float32, already multiplied by the attention scaling
    q, k          [B, heads, S, D]

Formula (Su et al. 2021, "RoFormer", arXiv:2104.09864; layout of HF transformers
``modeling_llama.py``): ``inv_freq[i] = 1 / theta ** (2i / D)``, ``freqs = pos * inv_freq``,
``emb = cat(freqs, freqs)``, and ``x' = x * cos(emb) + rotate_half(x) * sin(emb)`` where
``rotate_half([x1, x2]) = [-x2, x1]`` (the "half split", not interleaved pairs).

Scaling types (``rope_type``), each a function ``(RopeSpec, seq_len) -> (inv_freq, attention_scaling)``
in :data:`ROPE_INV_FREQ_FNS`; the facts (formulas, defaults, length rules) are those of transformers
``modeling_rope_utils.py`` so the results equal its output:

    default   unscaled RoPE
    linear    position interpolation, inv_freq / factor (Chen et al. 2023, arXiv:2306.15595)
    dynamic   NTK-aware base change that grows with the sequence length (bloc97/emozilla; HF state machine)
    yarn      NTK-by-parts ramp + attention factor ``0.1 ln(s) + 1`` (Peng et al. 2023, arXiv:2309.00071)
    llama3    Llama 3.1 wavelength-dependent scaling (Meta ``apply_scaling``)
    longrope  per-dimension rescale factors, short/long set chosen by length (Ding et al. 2024, arXiv:2402.13753)

``dynamic`` and ``longrope`` depend on the current length ``L = max(position_ids) + 1`` (HF semantics);
under context parallelism ``L`` is all-reduced (max) over the CP group so every shard uses the
frequencies of the full sequence. :func:`rope_scaling_problems` checks a ``rope_scaling`` dict.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from nxd_lc.distributed import collectives, parallel_state
from nxd_lc.layers.fusions import liger_rope
from nxd_lc.runtime.accel import HOST

__all__ = [
    "LENGTH_DEPENDENT_ROPE_TYPES",
    "ROPE_INV_FREQ_FNS",
    "SUPPORTED_ROPE_TYPES",
    "YARN_REQUIRED_FIELDS",
    "RopeSpec",
    "RotaryEmbedding",
    "apply_rotary_pos_emb",
    "raise_on_problems",
    "rope_scaling_problems",
    "rope_spec_from_config",
    "rotate_half",
    "warn_if_rope_scaling_is_noop",
]

log = logging.getLogger(__name__)

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")
LENGTH_DEPENDENT_ROPE_TYPES = ("dynamic", "longrope")
#: NeMo RL: with rope_type yarn, every one of these is required in ``model.hf_config_overrides.rope_scaling``.
YARN_REQUIRED_FIELDS = ("rope_theta", "factor", "original_max_position_embeddings", "truncate", "beta_fast",
                        "beta_slow", "mscale", "mscale_all_dim")
# rope_type -> (required when strict, required by HF's own validation, optional). HF facts:
# transformers 5.x RotaryEmbeddingConfigMixin._validate_<type>_rope_parameters.
_TYPE_FIELDS: dict[str, tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]] = {
    "default": ((), (), ()),
    "linear": (("factor",), ("factor",), ()),
    "dynamic": (("factor",), ("factor",), ()),
    "yarn": (YARN_REQUIRED_FIELDS, ("factor",), ("attention_factor", *YARN_REQUIRED_FIELDS)),
    "llama3": (("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
               ("factor", "low_freq_factor", "high_freq_factor"), ("original_max_position_embeddings",)),
    "longrope": (("short_factor", "long_factor", "original_max_position_embeddings"), ("short_factor", "long_factor"),
                 ("factor", "attention_factor", "original_max_position_embeddings")),
}
_COMMON_FIELDS = ("rope_type", "rope_theta", "partial_rotary_factor")
# field -> (bound, inclusive): numbers that must be > bound (>= when inclusive).
_NUMBER_BOUNDS: dict[str, tuple[float, bool]] = {
    "rope_theta": (0.0, False), "factor": (1.0, True), "attention_factor": (0.0, False), "beta_fast": (0.0, False),
    "beta_slow": (0.0, False), "low_freq_factor": (0.0, False), "high_freq_factor": (0.0, False),
    "mscale": (0.0, True), "mscale_all_dim": (0.0, True),
}


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _field_problem(name: str, value: Any, head_dim: int | None) -> str | None:
    """The problem with one present (non-None) scaling field's value, or None when it is fine."""
    if name in _NUMBER_BOUNDS:
        bound, inclusive = _NUMBER_BOUNDS[name]
        ok = _is_number(value) and (value >= bound if inclusive else value > bound)
        return None if ok else f"must be a number {'>=' if inclusive else '>'} {bound:g}, got {value!r}"
    if name == "original_max_position_embeddings":
        ok = isinstance(value, int) and not isinstance(value, bool) and value > 0
        return None if ok else f"must be a positive integer (the pretraining context length), got {value!r}"
    if name == "truncate":
        return None if isinstance(value, bool) else f"must be true or false, got {value!r}"
    if name in ("short_factor", "long_factor"):
        if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)) or \
                not all(_is_number(x) and x > 0 for x in value):
            return f"must be a list of positive numbers (one per rotary frequency), got {value!r}"
        if head_dim is not None and len(value) != head_dim // 2:
            return f"must have head_dim / 2 = {head_dim // 2} entries, got {len(value)}"
        return None
    if name == "partial_rotary_factor" and value != 1 and value != 1.0:
        return f"not supported yet: partial_rotary_factor={value!r} (Llama rotates the whole head); remove it"
    return None


def _missing_problem(key: str, rope_type: str, required: tuple[str, ...], missing: list[str], strict: bool) -> str:
    """One message listing every missing required field of ``rope_type``."""
    if rope_type == "yarn" and strict:
        return (f"{key}: rope_type 'yarn' requires every one of {', '.join(required)} (NeMo RL); missing: "
                f"{', '.join(missing)}")
    return f"{key}: rope_type {rope_type!r} requires {', '.join(required)}; missing: {', '.join(missing)}"


def rope_scaling_problems(rope_scaling: Any, key: str = "model.hf_config_overrides.rope_scaling", *,
                          head_dim: int | None = None, strict: bool = True) -> list[str]:
    """Every problem of one ``rope_scaling`` dict, one message per problem, each naming ``key``.

    Args:
        rope_scaling: the fields (``rope_type`` or legacy ``type``, ``rope_theta``, ``factor``, ...).
            Without ``rope_type`` (a partial override merged over config.json) only the present
            fields' values are checked.
        key: the dotted config key the messages name.
        head_dim: when given, longrope's short/long factors must have head_dim / 2 entries.
        strict: NeMo RL rules for user-written overrides: yarn requires all of
            :data:`YARN_REQUIRED_FIELDS`, llama3/longrope require ``original_max_position_embeddings``,
            and fields the rope_type does not use are errors. ``strict=False`` applies HF's rules for
            a config.json (yarn needs ``factor`` only; unused fields are logged, not errors).

    Checks: rope_type is one of :data:`SUPPORTED_ROPE_TYPES`; required fields present (all missing ones
    in one message); ``factor >= 1``; theta, beta_fast/slow, low/high_freq_factor, attention_factor > 0;
    mscale, mscale_all_dim >= 0; ``original_max_position_embeddings`` a positive int; ``truncate`` a bool;
    beta_fast > beta_slow; high_freq_factor > low_freq_factor; ``partial_rotary_factor`` 1 if present.
    """
    if not isinstance(rope_scaling, Mapping):
        return [f"{key}: must be a mapping of RoPE scaling fields (rope_type, factor, ...), got "
                f"{type(rope_scaling).__name__}"]
    fields = dict(rope_scaling)
    problems: list[str] = []
    if "type" in fields:  # legacy spelling
        legacy = fields.pop("type")
        if fields.setdefault("rope_type", legacy) != legacy:
            problems.append(f"{key}: type={legacy!r} and rope_type={fields['rope_type']!r} disagree; keep rope_type")
    rope_type = fields.get("rope_type")
    allowed = set(_COMMON_FIELDS).union(*(set(a) | set(c) for a, _, c in _TYPE_FIELDS.values()))
    if rope_type is not None and rope_type not in _TYPE_FIELDS:
        problems.append(f"{key}.rope_type: {rope_type!r} is not supported; use one of {list(SUPPORTED_ROPE_TYPES)}")
    elif rope_type is not None:
        strict_required, hf_required, optional = _TYPE_FIELDS[rope_type]
        required = strict_required if strict else hf_required
        # strict: a null value counts as missing; HF's rules only need the key (yarn derives a null factor)
        missing = [name for name in required if (fields.get(name) is None if strict else name not in fields)]
        if missing:
            problems.append(_missing_problem(key, rope_type, required, missing, strict))
        allowed = set(_COMMON_FIELDS) | set(strict_required) | set(optional)
    unused = [name for name in fields if name not in allowed]
    if unused:
        text = (f"{key}: {', '.join(unused)} not used by rope_type {rope_type!r} (its fields: "
                f"{', '.join(sorted(allowed - {'rope_type', 'partial_rotary_factor'}))})")
        if strict:
            problems.append(text + "; remove them")
        else:
            log.warning("%s; ignored as transformers does", text)
    for name, value in fields.items():
        problem = None if value is None or name == "rope_type" else _field_problem(name, value, head_dim)
        if problem:
            problems.append(f"{key}.{name}: {problem}")
    problems += _order_problems(fields, key)
    return problems


def _order_problems(fields: Mapping[str, Any], key: str) -> list[str]:
    """beta_fast > beta_slow (YaRN's ramp runs from fast to slow) and high_freq_factor > low_freq_factor."""
    problems = []
    for big, small in (("beta_fast", "beta_slow"), ("high_freq_factor", "low_freq_factor")):
        hi, lo = fields.get(big), fields.get(small)
        if _is_number(hi) and _is_number(lo) and hi <= lo:
            problems.append(f"{key}.{big}: must be greater than {small} ({hi!r} <= {lo!r})")
    return problems


def raise_on_problems(problems: list[str], what: str) -> None:
    """Raise one ValueError listing every problem (no-op for an empty list)."""
    if problems:
        raise ValueError(f"invalid {what} ({len(problems)} problem(s)):\n  - " + "\n  - ".join(problems))


@dataclass(frozen=True)
class RopeSpec:
    """Everything RoPE needs from a model config, independent of the transformers version.

    Attributes:
        head_dim: per-head size D (even).
        rope_theta: base wavelength theta.
        rope_type: one of :data:`ROPE_INV_FREQ_FNS`' keys.
        max_position_embeddings: the model's maximum length (``dynamic`` scales beyond it; ``yarn`` and
            ``longrope`` derive ``factor`` from it when ``factor`` is absent, as HF does).
        params: the remaining scaling fields of ``rope_scaling`` / ``rope_parameters``
            (e.g. ``factor``, ``low_freq_factor``), without ``rope_type`` / ``rope_theta``.
    """

    head_dim: int
    rope_theta: float
    rope_type: str = "default"
    max_position_embeddings: int = 2048
    params: Mapping[str, Any] = field(default_factory=dict)

    def require(self, key: str) -> Any:
        """Return ``params[key]``; raise ValueError naming the key when it is missing or None."""
        if self.params.get(key) is None:
            raise ValueError(
                f"rope_scaling.rope_type={self.rope_type} requires rope_scaling.{key} in the model "
                f"config; add it (see transformers modeling_rope_utils.py for its meaning)"
            )
        return self.params[key]

    def original_max_position_embeddings(self) -> int:
        """``params['original_max_position_embeddings']``, else max_position_embeddings (HF's fallback)."""
        return int(self.params.get("original_max_position_embeddings") or self.max_position_embeddings)


def _exponents(spec: RopeSpec) -> torch.Tensor:
    """``arange(0, D, 2) / D`` as fp32 [D/2] on CPU (the RoFormer exponent ``2i / D``)."""
    return torch.arange(0, spec.head_dim, 2, dtype=torch.int64, device=HOST).to(torch.float32) / spec.head_dim


def _base_inv_freq(spec: RopeSpec, theta: float | None = None) -> torch.Tensor:
    """``1 / theta ** (2i / D)`` as fp32 [D/2] (RoFormer eq. 15)."""
    return 1.0 / ((spec.rope_theta if theta is None else theta) ** _exponents(spec))


def _default_inv_freq(spec: RopeSpec, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    """Unscaled RoPE: (inv_freq [D/2] fp32, attention_scaling 1.0)."""
    return _base_inv_freq(spec), 1.0


def _linear_inv_freq(spec: RopeSpec, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    """Position interpolation (Chen et al. 2023, arXiv:2306.15595): ``inv_freq / factor``; scaling 1.0."""
    return _base_inv_freq(spec) / spec.require("factor"), 1.0


def _dynamic_inv_freq(spec: RopeSpec, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    """Dynamic NTK scaling (HF ``_compute_dynamic_ntk_parameters``): for ``L = max(seq_len, M)``,
    ``theta' = theta * (factor * L / M - (factor - 1)) ** (D / (D - 2))`` with M = max_position_embeddings,
    then unscaled RoPE with theta'. At L <= M this is exactly the default RoPE. Scaling 1.0.
    """
    factor, m, d = spec.require("factor"), spec.max_position_embeddings, spec.head_dim
    length = max(seq_len or m, m)
    theta = spec.rope_theta * ((factor * length / m) - (factor - 1)) ** (d / (d - 2))
    return _base_inv_freq(spec, theta), 1.0


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature ``0.1 * mscale * ln(scale) + 1`` (1.0 for scale <= 1; arXiv:2309.00071 eq. 22)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_attention_factor(spec: RopeSpec, factor: float) -> float:
    """``attention_factor`` if given; else mscale(f, mscale) / mscale(f, mscale_all_dim) when both are
    non-zero (DeepSeek style); else mscale(f) (HF ``_compute_yarn_parameters``)."""
    if spec.params.get("attention_factor") is not None:
        return float(spec.params["attention_factor"])
    mscale, mscale_all_dim = spec.params.get("mscale"), spec.params.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim))
    return _yarn_mscale(factor)


def _yarn_correction_range(spec: RopeSpec, orig: int) -> tuple[float, float]:
    """Dimension indices where the ramp starts/ends: ``d(r) = D ln(orig / (2 pi r)) / (2 ln theta)`` for
    r = beta_fast, beta_slow (YaRN's inverse of "rotations over the original context"); floored/ceiled
    when ``truncate`` (default True), clipped to [0, D - 1]. beta_fast/beta_slow default to 32/1 when falsy.
    """
    d, theta = spec.head_dim, spec.rope_theta

    def dim_of(rotations: float) -> float:
        return (d * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = dim_of(spec.params.get("beta_fast") or 32), dim_of(spec.params.get("beta_slow") or 1)
    if spec.params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, d - 1)


def _yarn_inv_freq(spec: RopeSpec, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    """YaRN "NTK-by-parts" (Peng et al. 2023, arXiv:2309.00071; HF ``_compute_yarn_parameters``).

    Dimensions below the correction range keep ``inv_freq`` (extrapolation), those above use
    ``inv_freq / factor`` (interpolation), and a linear ramp blends them in between. ``factor``
    defaults to ``max_position_embeddings / original_max_position_embeddings`` when absent. The
    formula does not depend on the sequence length: it is applied at every position (HF semantics).
    Returns (inv_freq [D/2] fp32, attention_factor) — see :func:`_yarn_attention_factor`.
    """
    orig = spec.original_max_position_embeddings()
    factor = spec.params.get("factor")
    if factor is None:
        factor = spec.max_position_embeddings / orig
    pos_freqs = spec.rope_theta ** _exponents(spec)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    low, high = _yarn_correction_range(spec, orig)
    if low == high:
        high += 0.001  # avoid a zero-width ramp (as HF)
    ramp = ((torch.arange(spec.head_dim // 2, dtype=torch.float32, device=HOST) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # weight of the unscaled (extrapolated) frequency
    return interpolation * (1 - keep) + extrapolation * keep, _yarn_attention_factor(spec, factor)


def _llama3_inv_freq(spec: RopeSpec, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    """Llama 3.1 frequency-dependent scaling (Meta's reference ``apply_scaling``; HF ``_compute_llama3_parameters``).

    Wavelengths shorter than ``orig/high_freq_factor`` are kept, longer than ``orig/low_freq_factor``
    are divided by ``factor``, and those in between are blended with
    ``s = (orig / wavelen - low) / (high - low)``: ``(1 - s) * f / factor + s * f``. Scaling 1.0.
    """
    factor = spec.require("factor")
    low, high = spec.require("low_freq_factor"), spec.require("high_freq_factor")
    orig = spec.original_max_position_embeddings()
    inv_freq = _base_inv_freq(spec)
    wavelen = 2 * math.pi / inv_freq
    low_freq_wavelen, high_freq_wavelen = orig / low, orig / high
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (orig / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled), 1.0


def _longrope_inv_freq(spec: RopeSpec, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    """LongRoPE (Ding et al. 2024, arXiv:2402.13753; HF ``_compute_longrope_parameters``).

    ``inv_freq = 1 / (ext * theta ** (2i / D))`` with ``ext = long_factor`` when ``seq_len >
    original_max_position_embeddings`` else ``short_factor``. Attention factor: ``attention_factor`` if
    given, else ``sqrt(1 + ln(factor) / ln(orig))`` (1.0 for factor <= 1), where ``factor`` defaults to
    ``max_position_embeddings / orig``; it does not depend on the length.
    """
    orig = spec.original_max_position_embeddings()
    factor = spec.params.get("factor")
    if factor is None:
        factor = spec.max_position_embeddings / orig
    scaling = spec.params.get("attention_factor")
    if scaling is None:
        scaling = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    use_long = bool(seq_len) and seq_len > orig
    ext = torch.tensor(spec.require("long_factor" if use_long else "short_factor"), dtype=torch.float32, device=HOST)
    return 1.0 / (ext * spec.rope_theta ** _exponents(spec)), float(scaling)


ROPE_INV_FREQ_FNS: dict[str, Callable[[RopeSpec, int | None], tuple[torch.Tensor, float]]] = {
    "default": _default_inv_freq,
    "linear": _linear_inv_freq,
    "dynamic": _dynamic_inv_freq,
    "yarn": _yarn_inv_freq,
    "llama3": _llama3_inv_freq,
    "longrope": _longrope_inv_freq,
}
assert set(ROPE_INV_FREQ_FNS) == set(SUPPORTED_ROPE_TYPES)


def _raw_rope_dict(config: Any) -> dict[str, Any]:
    """Merge transformers 5.x ``rope_parameters`` or 4.x ``rope_theta`` + ``rope_scaling`` into one dict."""
    params = getattr(config, "rope_parameters", None)
    if params is None:  # transformers 4.x
        params = dict(getattr(config, "rope_scaling", None) or {})
        if getattr(config, "rope_theta", None) is not None:
            params.setdefault("rope_theta", config.rope_theta)
    params = dict(params)
    if any(isinstance(v, Mapping) for v in params.values()):
        raise ValueError("not supported yet: per-layer-type rope_parameters (nested dict) in the model config")
    if "type" in params:  # legacy spelling of rope_type
        params.setdefault("rope_type", params["type"])
        params.pop("type")
    return params


def rope_spec_from_config(config: Any, key: str = "rope_scaling") -> RopeSpec:
    """Build a :class:`RopeSpec` from an HF ``LlamaConfig`` (transformers 4.45+ or 5.x).

    The scaling fields are checked with HF's requirements (:func:`rope_scaling_problems` with
    ``strict=False``: yarn needs only ``factor``; beta_fast/beta_slow/truncate/mscale take HF's
    defaults). ``original_max_position_embeddings`` defaults to ``max_position_embeddings`` for
    llama3/yarn/longrope, as transformers 5.x's ``standardize_rope_params`` does.

    Raises:
        ValueError: every problem of the scaling fields, each naming ``key``; an odd head_dim; a
            per-layer (nested) rope_parameters dict.
    """
    raw = _raw_rope_dict(config)
    rope_type = raw.pop("rope_type", None) or "default"
    theta = raw.pop("rope_theta", None)
    theta = 10000.0 if theta is None else theta
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if head_dim % 2:
        raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
    if rope_type in ("llama3", "yarn", "longrope") and raw.get("original_max_position_embeddings") is None:
        raw["original_max_position_embeddings"] = int(config.max_position_embeddings)
    problems = rope_scaling_problems({"rope_type": rope_type, "rope_theta": theta, **raw}, key,
                                     head_dim=int(head_dim), strict=False)
    raise_on_problems(problems, "rope_scaling in the model config")
    return RopeSpec(head_dim=int(head_dim), rope_theta=float(theta), rope_type=rope_type,
                    max_position_embeddings=int(config.max_position_embeddings), params=raw)


def rope_spec_with_scaling(base: RopeSpec, rope_scaling: Mapping[str, Any] | None,
                           key: str = "rope_scaling") -> RopeSpec:
    """``base`` (a model's RoPE) with its scaling replaced by ``rope_scaling`` (HF ``rope_scaling`` fields).

    ``rope_theta`` defaults to the base's; llama3 / yarn / longrope's ``original_max_position_embeddings`` defaults
    to the base's ``max_position_embeddings`` (as :func:`rope_spec_from_config`). None returns ``base`` unchanged;
    ``{rope_type: default}`` gives unscaled RoPE at the base's theta. Used by ``data.curriculum`` stages.

    Raises:
        ValueError: every problem of the fields (:func:`rope_scaling_problems`, HF's requirements), naming ``key``.
    """
    if rope_scaling is None:
        return base
    raw = dict(rope_scaling)
    rope_type = raw.pop("rope_type", None) or raw.pop("type", None) or "default"
    theta = raw.pop("rope_theta", None)
    theta = base.rope_theta if theta is None else theta
    if rope_type in ("llama3", "yarn", "longrope") and raw.get("original_max_position_embeddings") is None:
        raw["original_max_position_embeddings"] = base.max_position_embeddings
    raise_on_problems(rope_scaling_problems({"rope_type": rope_type, "rope_theta": theta, **raw}, key,
                                            head_dim=base.head_dim, strict=False), key)
    return RopeSpec(head_dim=base.head_dim, rope_theta=float(theta), rope_type=rope_type,
                    max_position_embeddings=base.max_position_embeddings, params=raw)


def warn_if_rope_scaling_is_noop(config: Any, seq_length: int) -> str | None:
    """Log (warning) and return a message when the scaling brings no context extension at ``seq_length``.

    ``yarn`` with ``seq_length <= original_max_position_embeddings``: no trained position lies beyond
    the original context, so YaRN extends nothing. What is computed stays HF's formula (parity): with
    ``factor == 1`` it equals unscaled RoPE exactly; with ``factor > 1`` the low frequencies are still
    interpolated and cos/sin multiplied by the attention factor, i.e. the model is changed for no gain.
    ``dynamic`` with ``seq_length <= max_position_embeddings``: exactly unscaled RoPE (HF semantics).

    Args:
        config: an HF ``LlamaConfig`` or a :class:`RopeSpec`.
        seq_length: the model's sequence length (``model.encoder_seq_length``, else ``data.seq_length``).

    Returns:
        The warning text, or None when the scaling is useful (or the type is not length-gated).
    """
    spec = config if isinstance(config, RopeSpec) else rope_spec_from_config(config)
    if spec.rope_type == "yarn" and seq_length <= spec.original_max_position_embeddings():
        orig, factor = spec.original_max_position_embeddings(), spec.params.get("factor")
        effect = ("it equals unscaled RoPE exactly" if factor is not None and float(factor) == 1.0 else
                  f"HF's YaRN formula is still applied (factor {factor}: low frequencies interpolated, cos/sin "
                  f"scaled by the attention factor), which changes the model without extending its context")
        msg = (f"rope_scaling: rope_type yarn is a no-op at seq_length {seq_length} <= "
               f"original_max_position_embeddings {orig}: no trained position lies beyond the original context; "
               f"{effect}. Raise model.encoder_seq_length above {orig} or drop rope_scaling.")
    elif spec.rope_type == "dynamic" and seq_length <= spec.max_position_embeddings:
        msg = (f"rope_scaling: rope_type dynamic is a no-op at seq_length {seq_length} <= max_position_embeddings "
               f"{spec.max_position_embeddings}: dynamic NTK only rescales longer sequences (unscaled RoPE is used).")
    else:
        return None
    log.warning(msg)
    return msg


class RotaryEmbedding(nn.Module):
    """Computes fp32 ``cos, sin`` [B, S, D] for ``position_ids`` [B, S], scaled by ``attention_scaling``.

    The frequencies are non-persistent buffers (``inv_freq``; ``long_inv_freq`` for longrope) kept in
    float32 whatever ``module.to(dtype)`` / ``.half()`` does: fp32 masters are kept on CPU and restored
    after every ``_apply`` (this also refills them after ``to_empty``).

    Length-dependent types follow HF's ``dynamic_rope_update`` with ``L = max(position_ids) + 1``
    (all-reduced max over the CP group, or the ``seq_len`` passed to :meth:`forward`):
    ``longrope`` uses the long factors iff ``L > original_max_position_embeddings``; ``dynamic``
    recomputes ``inv_freq`` for L when L exceeds the largest length seen so far and returns to the
    original frequencies when ``L < max_position_embeddings`` after having grown.
    """

    def __init__(self, spec: RopeSpec) -> None:
        super().__init__()
        self.spec = spec
        self._masters: dict[str, torch.Tensor] = {}
        self.attention_scaling = 1.0
        self._max_seq_len_cached = spec.max_position_embeddings  # dynamic: largest length seen (HF)
        self.set_spec(spec)

    def set_spec(self, spec: RopeSpec) -> None:
        """Switch to ``spec`` in place (frequencies recomputed on their current device; the module object, which
        pipeline stages share, stays the same). Used between ``data.curriculum`` stages.

        Raises:
            ValueError: an unknown ``rope_type``, or a ``head_dim`` other than the current one.
        """
        if spec.rope_type not in ROPE_INV_FREQ_FNS:
            raise ValueError(f"rope_scaling.rope_type={spec.rope_type!r} is unknown; use one of "
                             f"{list(SUPPORTED_ROPE_TYPES)}")
        if spec.head_dim != self.spec.head_dim:
            raise ValueError(f"RotaryEmbedding.set_spec: head_dim {spec.head_dim} != {self.spec.head_dim}")
        self.spec = spec
        inv_freq, attention_scaling = ROPE_INV_FREQ_FNS[spec.rope_type](spec, None)
        self.attention_scaling = float(attention_scaling)
        self._set_frequencies("inv_freq", inv_freq)
        if spec.rope_type == "longrope":
            self._set_frequencies("long_inv_freq", _longrope_inv_freq(spec, spec.original_max_position_embeddings()
                                                                      + 1)[0])
        elif "long_inv_freq" in self._buffers:
            del self._buffers["long_inv_freq"]
            self._masters.pop("long_inv_freq", None)
        self._max_seq_len_cached = spec.max_position_embeddings

    def _set_frequencies(self, name: str, value: torch.Tensor) -> None:
        """Store the fp32 CPU master of buffer ``name`` and (re)place the buffer on its current device."""
        master = value.detach().to(device=HOST, dtype=torch.float32)
        self._masters[name] = master
        if name in self._buffers:
            setattr(self, name, master.to(self._buffers[name].device))
        else:
            self.register_buffer(name, master.clone(), persistent=False)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> RotaryEmbedding:
        """nn.Module._apply, then restore every frequency buffer to fp32 from its master (same device)."""
        super()._apply(fn, recurse)
        for name, master in self._masters.items():
            setattr(self, name, master.to(self._buffers[name].device))
        return self

    def _sequence_length(self, position_ids: torch.Tensor) -> int:
        """``max(position_ids) + 1`` over this batch, all-reduced (max) over the CP group (host sync)."""
        length = position_ids.max().to(torch.int64).reshape(1) + 1
        if parallel_state.get_context_parallel_world_size() > 1:
            collectives.all_reduce(length, parallel_state.get_context_parallel_group(), op="max")
        return int(length.item())

    def _frequencies_for(self, seq_len: int) -> torch.Tensor:
        """The fp32 ``inv_freq`` [D/2] to use at length ``seq_len`` (updates dynamic's state as HF does)."""
        if self.spec.rope_type == "longrope":
            orig = self.spec.original_max_position_embeddings()
            return self.long_inv_freq if seq_len > orig else self.inv_freq
        original = self.spec.max_position_embeddings
        if seq_len > self._max_seq_len_cached:  # growth
            self._set_frequencies("inv_freq", _dynamic_inv_freq(self.spec, seq_len)[0])
            self._max_seq_len_cached = seq_len
        if seq_len < original < self._max_seq_len_cached:  # back to the original scale
            self._set_frequencies("inv_freq", _default_inv_freq(self.spec)[0])
            self._max_seq_len_cached = original
        return self.inv_freq

    @torch.no_grad()
    def forward(self, position_ids: torch.Tensor, seq_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """position_ids [B, S] -> (cos, sin), each [B, S, D] float32 (no gradient).

        Args:
            seq_len: for ``dynamic`` / ``longrope`` only: the length L to scale for; default
                ``max(position_ids) + 1`` over the CP group (a collective: call on every CP rank).

        Raises:
            ValueError: position_ids is not 2-D.
        """
        if position_ids.dim() != 2:
            raise ValueError(f"position_ids must be [B, S], got shape {tuple(position_ids.shape)}")
        inv_freq = self.inv_freq
        if self.spec.rope_type in LENGTH_DEPENDENT_ROPE_TYPES:
            inv_freq = self._frequencies_for(seq_len if seq_len is not None else self._sequence_length(position_ids))
        inv_freq = inv_freq.to(device=position_ids.device, dtype=torch.float32)
        freqs = position_ids.to(torch.float32)[..., None] * inv_freq  # [B, S, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling

    def extra_repr(self) -> str:
        return (f"rope_type={self.spec.rope_type}, theta={self.spec.rope_theta}, head_dim={self.spec.head_dim}, "
                f"attention_scaling={self.attention_scaling:.6g}")


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[..., D] -> [..., D]: ``[x1, x2] -> [-x2, x1]`` with x1, x2 the two halves of the last dim."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kernel: str = "torch"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [B, Hq, S, D] and k [B, Hkv, S, D] by cos/sin [B, S, D] (fp32, from :class:`RotaryEmbedding`).

    As HF Llama's ``apply_rotary_pos_emb``: cos / sin are cast to q's dtype (the angles themselves were computed in
    float32) and the rotation runs in that dtype, so a bf16 layer does no float32 copies of q and k (four fewer
    casts per layer, forward and backward, than rotating in float32). ``kernel = "liger"``
    (``model.fusions.rope``): Liger-Kernel's fused RoPE, the same computation in one kernel.
    """
    if kernel == "liger":
        return liger_rope(q, k, cos, sin)
    cos, sin = cos.to(q.dtype).unsqueeze(1), sin.to(q.dtype).unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
