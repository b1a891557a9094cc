"""The run's own description, saved with every checkpoint it writes: the resolved config (``run_config.yaml``) and
the HF ``config.json`` its ``model.model_config`` named (``model_config.json``), so that what is made from a
checkpoint later (the HF export, :mod:`nxd_lc.app.convert`) builds the model that was trained, whatever config the
command line of that later step names.

``run_config.yaml`` is the typed config as the run resolved it (every default filled in, interpolations resolved),
written by :func:`run_record_files`; it loads back with :func:`nxd_lc.app.validation.load_config` to an equal
config. ``model_config.json`` is a byte copy of the source file (of ``<dir>/config.json`` when ``model.model_config``
is an HF directory): the checkpoint keeps describing its model when that file is edited or moved.
"""

from __future__ import annotations

import os
from dataclasses import asdict

from omegaconf import OmegaConf

from nxd_lc.config.access import resolve_path
from nxd_lc.config.schema import NxdConfig

__all__ = ["MODEL_CONFIG_FILE", "RUN_CONFIG_FILE", "config_differences", "flat_keys", "model_config_file",
           "resolved_config_yaml", "run_record_files"]

#: the resolved run config inside a checkpoint directory ``<root>/<tag>``
RUN_CONFIG_FILE = "run_config.yaml"
#: the copy of the run's HF ``config.json`` (``model.model_config``) inside a checkpoint directory
MODEL_CONFIG_FILE = "model_config.json"

_HEADER = ("# The resolved config of the nxd_lc run that wrote this checkpoint (every default filled in). The HF\n"
           "# export (python -m nxd_lc.cli.convert) builds its model from it; model_config.json beside it is the\n"
           "# run's model.model_config file as it was read.\n")


def resolved_config_yaml(cfg: NxdConfig) -> str:
    """``cfg`` as YAML: every key of the typed config, defaults included (the text the dry run prints).

    Returns:
        YAML text that :func:`nxd_lc.app.validation.load_config` turns back into a config equal to ``cfg``.
    """
    return OmegaConf.to_yaml(OmegaConf.structured(asdict(cfg)))


def model_config_file(cfg: NxdConfig) -> str | None:
    """The HF ``config.json`` file ``model.model_config`` names (``<dir>/config.json`` for a directory), absolute;
    None when unset (``model_source: megatron`` takes the architecture from the ``model:`` keys) or missing."""
    if not cfg.model.model_config:
        return None
    path = resolve_path(cfg.model.model_config)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    return path if os.path.isfile(path) else None


def run_record_files(cfg: NxdConfig) -> dict[str, str]:
    """The files every checkpoint of the run holds besides its shards: name -> text.

    ``run_config.yaml`` (:func:`resolved_config_yaml` under a comment header) and, when ``model.model_config`` names
    a readable file, ``model_config.json`` (its bytes, decoded as UTF-8).

    Raises:
        OSError: ``model.model_config`` exists but cannot be read.
    """
    files = {RUN_CONFIG_FILE: _HEADER + resolved_config_yaml(cfg)}
    path = model_config_file(cfg)
    if path is not None:
        with open(path, encoding="utf-8") as f:
            files[MODEL_CONFIG_FILE] = f.read()
    return files


def flat_keys(prefix: str, value: object) -> dict[str, object]:
    """``{"a.b": leaf}`` of a nested dict under ``prefix`` (lists and other values are leaves)."""
    if not isinstance(value, dict):
        return {prefix: value}
    out: dict[str, object] = {}
    for k, v in value.items():
        out.update(flat_keys(f"{prefix}.{k}" if prefix else str(k), v))
    return out


def config_differences(a: str, b: str, limit: int = 10) -> list[str]:
    """The dotted keys on which two resolved configs (:func:`resolved_config_yaml` texts) differ, at most ``limit``
    (and a count of the rest), each as ``"<key>: <a's value> vs <b's value>"``; empty when they are equal."""
    import yaml

    fa, fb = flat_keys("", yaml.safe_load(a) or {}), flat_keys("", yaml.safe_load(b) or {})
    keys = [k for k in sorted(set(fa) | set(fb)) if fa.get(k, "<unset>") != fb.get(k, "<unset>")]
    lines = [f"{k}: {fa.get(k, '<unset>')!r} vs {fb.get(k, '<unset>')!r}" for k in keys[:limit]]
    if len(keys) > limit:
        lines.append(f"... and {len(keys) - limit} more keys")
    return lines
