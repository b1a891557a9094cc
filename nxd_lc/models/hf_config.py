"""The transformers config of a decoder from an HF ``config.json``: the family's config class
(:data:`CONFIG_CLASSES`), NxDT's ``model:`` YAML overrides and ``model.hf_config_overrides`` (``rope_scaling``
merged into the file's own, validated by HF's rules)."""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from transformers import PretrainedConfig

from nxd_lc.models.common.rope import raise_on_problems, rope_scaling_problems, rope_spec_from_config
from nxd_lc.models.config_classes import CONFIG_CLASSES
from nxd_lc.models.config_json import read_config_json

__all__ = ["CONFIG_CLASSES", "build_llama_config"]


# NxDT ``model:`` YAML keys that override the HF config.json, -> the LlamaConfig field they set.
_OVERRIDES = {
    "num_layers": "num_hidden_layers",
    "hidden_size": "hidden_size",
    "max_position_embeddings": "max_position_embeddings",
    "rope_theta": "rope_theta",
    "encoder_seq_length": None,  # validated against max_position_embeddings, not stored
}




def _read_config_json(path: Path) -> dict[str, Any]:
    """Parse an HF config.json into a dict (read and type-checked by
    :func:`~nxd_lc.models.config_json.read_config_json`); FileNotFoundError / ValueError name the file (and its line
    or field)."""
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"model.model_config: {path} does not exist; point it at an HF config.json or its directory"
        )
    raw = read_config_json(str(path))
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
        raise ValueError(f"model.model_config: {model_config_path}: hidden_act={config.hidden_act!r} is not supported "
                         "(Llama uses 'silu')")
    rope_spec_from_config(config, key)  # fail now on an unsupported rope_scaling
    return config
