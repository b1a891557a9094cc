"""Whole-config validation: turn a raw Hydra/OmegaConf config into a validated :class:`NxdConfig`.

All problems are collected and raised together in one :class:`~nxd_lc.config.errors.ConfigError` (a
``ValueError``), each line naming the dotted key and the fix. Order of checks: the structural ones of the config
core (:func:`nxd_lc.config.structure.typed_config`: interpolation -> key aliases -> unknown keys ("did you
mean") -> per-key types), then the cross-field rules, grouped by domain in this package (:mod:`.parallel`,
:mod:`.model`, :mod:`.data`, :mod:`.training`) and calling each package's own rules (precision, MoE, Megatron,
tokenizer, pipeline split, ...). Features accepted by the schema but not implemented are reported by
:func:`unsupported_features` ("not supported yet: <key>"), which the trainer raises at launch and the dry run
prints.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping

from omegaconf import DictConfig

from nxd_lc.app.validation.data import (
    batch_problems,
    curriculum_problems,
    data_source_problems,
    data_unsupported,
    mixture_problems,
    sft_style_problems,
)
from nxd_lc.app.validation.data import path_problems as input_path_problems
from nxd_lc.app.validation.launch import launch_problems
from nxd_lc.app.validation.memory import estimate_memory, position_problems
from nxd_lc.app.validation.memory_judgement import memory_estimate_problems
from nxd_lc.app.validation.model import (
    family_problems,
    fusion_config_problems,
    megatron_source_problems,
    memory_problems,
    moe_layout_problems,
)
from nxd_lc.app.validation.parallel import (
    context_parallel_problems,
    head_problems,
    parallel_problems,
    pipeline_problems,
)
from nxd_lc.app.validation.resources import dataset_size_problems, num_workers_problems, run_dir_problems
from nxd_lc.app.validation.training import checkpoint_problems, choice_problems, trainer_problems
from nxd_lc.config.errors import ConfigError
from nxd_lc.config.schema import NxdConfig
from nxd_lc.config.structure import typed_config
from nxd_lc.models.config_json import read_model_json
from nxd_lc.precision.rules import log_precision_overrides

__all__ = ["check_supported", "cross_field_problems", "load_config", "memory_report", "path_problems",
           "unsupported_features"]

log = logging.getLogger(__name__)


def load_config(raw: DictConfig | Mapping[str, Any], world_size: int | None = None,
                check_paths: bool = False) -> NxdConfig:
    """Validate ``raw`` and return the typed config.

    Args:
        raw: the composed Hydra config (or a plain nested dict).
        world_size: the launched world size; when given it must equal ``trainer.devices * trainer.num_nodes``.
        check_paths: also require data paths and ``resume_from_checkpoint`` to exist (true at launch).

    Raises:
        ConfigError: with every problem found, each naming its dotted key.
    """
    cfg = typed_config(raw)
    problems = cross_field_problems(cfg, world_size)
    if check_paths:
        problems.extend(path_problems(cfg))
    if problems:
        raise ConfigError(problems)
    log_precision_overrides(cfg)
    return cfg


def cross_field_problems(cfg: NxdConfig, world_size: int | None = None) -> list[str]:
    """All cross-field rule violations of a typed config (empty when valid)."""
    hf = read_model_json(cfg)  # read once; both head and CP rules need it
    problems = (parallel_problems(cfg, world_size) + trainer_problems(cfg) + batch_problems(cfg)
                + head_problems(cfg, hf) + context_parallel_problems(cfg, hf) + memory_problems(cfg)
                + choice_problems(cfg) + pipeline_problems(cfg, hf)
                + checkpoint_problems(cfg) + mixture_problems(cfg) + curriculum_problems(cfg)
                + moe_layout_problems(cfg, hf) + data_source_problems(cfg) + megatron_source_problems(cfg)
                + family_problems(cfg, hf) + sft_style_problems(cfg) + fusion_config_problems(cfg)
                + position_problems(cfg, hf) + dataset_size_problems(cfg))
    if problems:  # the memory estimate needs sizes every other rule has accepted
        return problems
    try:
        problems, warnings = memory_estimate_problems(cfg, hf)
    except ValueError as e:  # a memory budget below every plan's estimate (names model.activations_memory_budget)
        return [str(e)]
    for warning in warnings:
        log.warning("%s", warning)
    return problems


def path_problems(cfg: NxdConfig) -> list[str]:
    """What the launch needs on its host (``load_config(check_paths=True)``, on every rank at launch; the dry run lists
    them, being possibly another host, e.g. a login node, and exits 3): the input paths
    (:func:`nxd_lc.app.validation.data.path_problems`), the run directory
    (:func:`nxd_lc.app.validation.resources.run_dir_problems`), the CPUs for ``data.num_workers``
    (:func:`nxd_lc.app.validation.resources.num_workers_problems`) and the keys the launch path reads that the
    cross-field rules leave open (:func:`nxd_lc.app.validation.launch.launch_problems`: the tokenizer, CUDA graphs on
    ``auto``, ``NEURON_EXTRACT_GRAPHS_ONLY``)."""
    return input_path_problems(cfg) + run_dir_problems(cfg) + num_workers_problems(cfg) + launch_problems(cfg)


def memory_report(cfg: NxdConfig) -> list[str]:
    """The dry run's lines of the memory estimate per rank (:mod:`.memory`) of a validated config."""
    est = estimate_memory(cfg, read_model_json(cfg))
    return est.describe() if est is not None else [
        "memory estimate: unknown (no model config.json to size the model from)"]


def unsupported_features(cfg: NxdConfig) -> list[str]:
    """Keys set to values whose feature is not implemented: ``not supported yet: <key>=<value>`` (every optimizer
    and scheduler name of the schema is implemented; what remains is the accelerator-dependent layout and the
    data keys)."""
    return data_unsupported(cfg)


def check_supported(cfg: NxdConfig) -> None:
    """Raise :class:`ConfigError` listing every key whose feature is not implemented yet."""
    problems = unsupported_features(cfg)
    if problems:
        raise ConfigError(problems)
