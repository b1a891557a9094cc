"""The architecture dict of a run: the HF ``config.json`` named by ``model.model_config``, or with
``model_source: megatron`` the equivalent dict of the ``model:`` keys (:mod:`nxd_lc.models.megatron`).

The file is read with :mod:`nxd_lc.config.input_files` (UTF-8 only, NUL bytes, NaN / Infinity, out-of-range
numbers and too-deep nesting refused naming the file and line) and the fields nxd_lc and transformers read are
type-checked (:data:`FIELD_TYPES`), so a string, bool or list where a number belongs is one error naming the file
and the key, not a ``TypeError`` from inside the model build.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

from nxd_lc.config.access import resolve_path
from nxd_lc.config.errors import ConfigError
from nxd_lc.config.input_files import parse_json, read_text
from nxd_lc.config.schema import NxdConfig
from nxd_lc.models.megatron import megatron_config_dict, megatron_problems

_COUNTS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
           "max_position_embeddings", "num_key_value_heads", "head_dim", "num_local_experts", "num_experts_per_tok",
           "sliding_window", "pretraining_tp", "moe_intermediate_size")
_POSITIVE_NUMBERS = ("rope_theta", "rms_norm_eps")
_NUMBERS = ("initializer_range", "attention_dropout", "router_aux_loss_coef", "router_jitter_noise")
_BOOLS = ("tie_word_embeddings", "use_sliding_window", "attention_bias", "mlp_bias", "use_cache",
          "output_router_logits")
_STRINGS = ("model_type", "hidden_act", "torch_dtype", "dtype")

#: config.json key -> what it must hold: ``count`` (an int >= 1; null allowed for the optional ones transformers
#: derives: num_key_value_heads, head_dim, sliding_window), ``count0`` (an int >= 0), ``positive`` / ``number``
#: (a finite int or float > 0 / >= 0), ``bool``, ``string``, ``token_ids`` (an int >= 0, a list of them, or
#: null), ``mapping`` (an object or null), ``strings`` (a list of strings or null).
FIELD_TYPES: dict[str, str] = {**dict.fromkeys(_COUNTS, "count"), "max_window_layers": "count0",
                               **dict.fromkeys(_POSITIVE_NUMBERS, "positive"), **dict.fromkeys(_NUMBERS, "number"),
                               **dict.fromkeys(_BOOLS, "bool"), **dict.fromkeys(_STRINGS, "string"),
                               **dict.fromkeys(("bos_token_id", "eos_token_id", "pad_token_id"), "token_ids"),
                               **dict.fromkeys(("rope_scaling", "rope_parameters"), "mapping"),
                               "architectures": "strings"}
_NULLABLE = {"num_key_value_heads", "head_dim", "sliding_window", "torch_dtype", "dtype"}
_WANTED = {"count": "an integer >= 1", "count0": "an integer >= 0", "positive": "a finite number > 0",
           "number": "a finite number >= 0", "bool": "true or false", "string": "a string",
           "token_ids": "a token id (integer >= 0), a list of them, or null", "mapping": "an object or null",
           "strings": "a list of strings or null"}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _fits(kind: str, value: Any) -> bool:
    number = (_is_int(value) or isinstance(value, float)) and math.isfinite(value)
    checks = {"count": lambda v: _is_int(v) and v >= 1, "count0": lambda v: _is_int(v) and v >= 0,
              "positive": lambda v: number and v > 0, "number": lambda v: number and v >= 0,
              "bool": lambda v: isinstance(v, bool), "string": lambda v: isinstance(v, str),
              "token_ids": lambda v: v is None or (_is_int(v) and v >= 0) or (
                  isinstance(v, list) and all(_is_int(i) and i >= 0 for i in v)),
              "mapping": lambda v: v is None or isinstance(v, dict),
              "strings": lambda v: v is None or (isinstance(v, list) and all(isinstance(s, str) for s in v))}
    return checks[kind](value)


def config_json_problems(raw: dict[str, Any], path: str, key: str = "model.model_config") -> list[str]:
    """One problem per field of :data:`FIELD_TYPES` in ``raw`` whose value has the wrong type or range, naming
    ``key``, the file, the field, what it holds and what it must hold (empty: all fit)."""
    problems = []
    for field, kind in FIELD_TYPES.items():
        if field not in raw or (raw[field] is None and field in _NULLABLE):
            continue
        value = raw[field]
        if not _fits(kind, value):
            shown = json.dumps(value)[:60]
            problems.append(f"{key}: {path}: field {field!r} is {shown} ({type(value).__name__}), but must be "
                            f"{_WANTED[kind]}; fix the file")
    return problems


def read_config_json(path: str, key: str = "model.model_config") -> dict[str, Any]:
    """The HF config.json file ``path`` as a dict, read and checked (module doc).

    Raises:
        OSError: the file cannot be read.
        ConfigError: not UTF-8 / NUL bytes (names file, line and byte), not valid JSON (names file, line and
            column), out-of-range numbers or too-deep nesting, not a JSON object, or fields of the wrong type (one
            problem per field, naming it).
    """
    try:
        raw = parse_json(read_text(path, key=key), path, key=key)
    except json.JSONDecodeError as e:
        raise ConfigError([f"{key}: {path} is not valid JSON (line {e.lineno}, column {e.colno}: {e.msg}); fix "
                           f"the file or point {key} at a valid HF config.json"]) from None
    except ValueError as e:
        raise ConfigError([str(e)]) from None
    if not isinstance(raw, dict):
        raise ConfigError([f"{key}: {path} must hold a JSON object (an HF config.json), got a JSON "
                           f"{type(raw).__name__}"])
    problems = config_json_problems(raw, path, key)
    if problems:
        raise ConfigError(problems)
    return raw


def read_model_json(cfg: NxdConfig) -> dict[str, Any] | None:
    """The HF config.json named by ``model.model_config`` as a dict, or None when unset/missing; with
    ``model_source: megatron`` the equivalent dict of the ``model:`` keys (None while they have problems).

    Raises:
        ConfigError: as :func:`read_config_json` (names the file, and its line, column or field).
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
    return read_config_json(path)
