"""Structural checks of a raw config against the schema, before any domain rule: interpolations resolved,
NxDT key aliases, moved keys and NxDT's older SFT layout (:mod:`nxd_lc.config.sft_style_layout`) applied, unknown
keys ("did you mean"), per-key types. The result is the typed :class:`~nxd_lc.config.schema.NxdConfig`; the
cross-field rules live with their packages and are collected by :func:`nxd_lc.app.validation.load_config`.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import typing
from typing import Any, Mapping

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from nxd_lc.config.errors import ConfigError
from nxd_lc.config.interpolation import interpolation_problems
from nxd_lc.config.resolvers import register_resolvers
from nxd_lc.config.schema import KEY_ALIASES, MOVED_KEYS, NxdConfig
from nxd_lc.config.sft_style_layout import map_sft_style_layout

log = logging.getLogger(__name__)


PRECISION_ALIASES = {"mixed_precision_SR": "mixed_precisionSR"}  # NxDT spells it both ways


def _fields(cls: type) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls)}


def _nested_type(cls: type, name: str) -> type | None:
    """The dataclass type of field ``name`` of ``cls`` if it is a nested section (also an optional one,
    ``Optional[Section] = None`` such as ``model_alignment_strategy.peft``), else None."""
    default = _fields(cls)[name].default_factory  # type: ignore[misc]
    if default is not dataclasses.MISSING:
        value = default()
        if dataclasses.is_dataclass(value):
            return type(value)
    hint = typing.get_type_hints(cls).get(name)
    if typing.get_origin(hint) is typing.Union:
        sections = [a for a in typing.get_args(hint) if dataclasses.is_dataclass(a)]
        if len(sections) == 1:
            return sections[0]
    return None


_SCHEMA_LEAVES: list[str] = []


def _schema_leaves(cls: type = NxdConfig, prefix: str = "") -> list[str]:
    out = []
    for name in _fields(cls):
        sub = _nested_type(cls, name)
        if sub is not None:
            out.extend(_schema_leaves(sub, f"{prefix}{name}."))
        else:
            out.append(f"{prefix}{name}")
    return out


def _suggest(key: str, cls: type, prefix: str) -> str:
    """'did you mean ...' hint: nearest sibling name, else nearest dotted key anywhere in the schema."""
    siblings = list(_fields(cls))
    close = difflib.get_close_matches(key, siblings, n=1, cutoff=0.6)
    if close:
        return f"did you mean '{prefix}{close[0]}'?"
    if not _SCHEMA_LEAVES:
        _SCHEMA_LEAVES.extend(_schema_leaves())
    by_leaf = {k.rsplit(".", 1)[-1]: k for k in _SCHEMA_LEAVES}
    close = difflib.get_close_matches(key, list(by_leaf), n=1, cutoff=0.75)
    if close:
        return f"did you mean '{by_leaf[close[0]]}'?"
    return f"valid keys here: {', '.join(siblings)}"


def _check_keys(data: dict[str, Any], cls: type, prefix: str, problems: list[str]) -> None:
    fields = _fields(cls)
    empty_sections = []
    for key, value in data.items():
        if key not in fields:
            problems.append(f"{prefix}{key}: unknown key; {_suggest(str(key), cls, prefix)}")
            continue
        sub = _nested_type(cls, key)
        if sub is not None:
            if value is None:  # an empty section (`exp_manager:`) takes its defaults
                empty_sections.append(key)
                continue
            if not isinstance(value, Mapping):
                problems.append(f"{prefix}{key}: must be a mapping (section), got {type(value).__name__}")
                continue
            _check_keys(value, sub, f"{prefix}{key}.", problems)  # type: ignore[arg-type]
    for key in empty_sections:
        data.pop(key)


def _check_types(data: Mapping[str, Any], cls: type, prefix: str, problems: list[str]) -> None:
    """Assign each known leaf to a structured node of ``cls`` one by one, so every bad value is reported."""
    node = OmegaConf.structured(cls)
    for key, value in data.items():
        if key not in _fields(cls):
            continue
        sub = _nested_type(cls, key)
        if sub is not None:
            if isinstance(value, Mapping):
                _check_types(value, sub, f"{prefix}{key}.", problems)
            continue
        try:
            node[key] = value
        except OmegaConfBaseException as e:
            expected = _fields(cls)[key].type
            problems.append(f"{prefix}{key}: invalid value {value!r} (expected {expected}): "
                            f"{str(e).splitlines()[0]}")


def _parent(data: dict[str, Any], dotted: str) -> tuple[dict[str, Any] | None, str]:
    """(the dict holding the last component of ``dotted``, that component); None when a parent is missing."""
    *path, leaf = dotted.split(".")
    node: Any = data
    for part in path:
        node = node.get(part) if isinstance(node, dict) else None
    return (node if isinstance(node, dict) else None), leaf


def _move_keys(data: dict[str, Any], problems: list[str]) -> None:
    """Move each key of :data:`MOVED_KEYS` from its old place to its canonical one (a null there is dropped)."""
    for old, canonical in MOVED_KEYS:
        node, leaf = _parent(data, old)
        if node is None or leaf not in node:
            continue
        value = node.pop(leaf)
        if value is None:
            continue
        *path, target = canonical.split(".")
        parent: Any = data
        for part in path:
            if not isinstance(parent.get(part), dict):
                parent[part] = {}
            parent = parent[part]
        if parent.get(target) is not None:
            problems.append(f"{old}: also given as '{canonical}' (its canonical place); give only one of them")
            continue
        log.info("config: '%s' is read as '%s'", old, canonical)
        parent[target] = value


def _apply_aliases(data: dict[str, Any], problems: list[str]) -> None:
    _move_keys(data, problems)
    map_sft_style_layout(data, problems)  # data.use_sft_style_data_module / data.packing -> model_alignment_strategy
    for alias, canonical in KEY_ALIASES:
        node, leaf = _parent(data, alias)
        target = canonical.rsplit(".", 1)[-1]
        if node is not None and leaf in node:
            if target in node and node[target] is not None:
                problems.append(f"{alias}: NxDT alias of '{canonical}'; give only one of them")
                node.pop(leaf)
                continue
            log.info("config: '%s' (NxDT spelling) is read as '%s'", alias, canonical)
            node[target] = node.pop(leaf)
    prec = data.get("precision")
    if isinstance(prec, dict) and isinstance(prec.get("type"), str) and prec["type"] in PRECISION_ALIASES:
        canonical = PRECISION_ALIASES[prec["type"]]
        log.info("config: precision.type '%s' is read as '%s'", prec["type"], canonical)
        prec["type"] = canonical


def to_container(raw: DictConfig | Mapping[str, Any]) -> dict[str, Any]:
    """Resolve interpolations (``${multiply:...}``, ``${trainer.max_steps}``) into a plain dict.

    Raises:
        ConfigError: an interpolation cannot be resolved (names the key), or resolving them would take more than
            :data:`~nxd_lc.config.interpolation.MAX_INTERPOLATION_RESOLUTIONS` node resolutions (checked first).
    """
    register_resolvers()
    cfg = raw if isinstance(raw, DictConfig) else OmegaConf.create(dict(raw))
    too_costly = interpolation_problems(OmegaConf.to_container(cfg, resolve=False))
    if too_costly:
        raise ConfigError(too_costly)
    try:
        return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "?"
        raise ConfigError([f"{key}: cannot resolve interpolation: {str(e).splitlines()[0]}"]) from e


def typed_config(raw: DictConfig | Mapping[str, Any]) -> NxdConfig:
    """The typed config of ``raw`` after the structural checks (interpolation -> key aliases -> unknown keys ->
    per-key types); no cross-field rule is applied.

    Raises:
        ConfigError: with every structural problem found, each naming its dotted key.
    """
    data = to_container(raw)
    data.pop("hydra", None)
    problems: list[str] = []
    _apply_aliases(data, problems)
    _check_keys(data, NxdConfig, "", problems)
    _check_types(data, NxdConfig, "", problems)
    if problems:
        raise ConfigError(problems)
    merged = OmegaConf.merge(OmegaConf.structured(NxdConfig), data)
    return OmegaConf.to_object(merged)  # type: ignore[return-value]
