"""The architecture dict of a run: the HF ``config.json`` named by ``model.model_config``, or with
``model_source: megatron`` the equivalent dict of the ``model:`` keys (:mod:`nxd_lc.models.megatron`)."""

from __future__ import annotations

import json
import os
from typing import Any

from nxd_lc.config.access import resolve_path
from nxd_lc.config.errors import ConfigError
from nxd_lc.config.schema import NxdConfig
from nxd_lc.models.megatron import megatron_config_dict, megatron_problems


def read_model_json(cfg: NxdConfig) -> dict[str, Any] | None:
    """The HF config.json named by ``model.model_config`` as a dict, or None when unset/missing; with
    ``model_source: megatron`` the equivalent dict of the ``model:`` keys (None while they have problems).

    Raises:
        ConfigError: the file is not valid JSON (names the file, line and column) or not a JSON object.
    """
    if cfg.model_source == "megatron":  # the architecture is the model: keys (nxd_lc.models.megatron)
        return None if megatron_problems(cfg.model, "megatron") else megatron_config_dict(cfg.model)
    if not cfg.model.model_config:
        return None
    path = resolve_path(cfg.model.model_config)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            raw = json.load(f)
    except json.JSONDecodeError as e:
        raise ConfigError([f"model.model_config: {path} is not valid JSON (line {e.lineno}, column {e.colno}: "
                           f"{e.msg}); fix the file or point model.model_config at a valid HF config.json"]) from None
    if not isinstance(raw, dict):
        raise ConfigError([f"model.model_config: {path} must hold a JSON object (an HF config.json), got a JSON "
                           f"{type(raw).__name__}"])
    return raw
