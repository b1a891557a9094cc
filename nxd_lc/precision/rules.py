"""Validation rules of the ``precision`` section (and the checkpoint keys that depend on the mode): which
environment keys a ``precision.type`` overrides, and which combinations cannot be honoured. Collected by
:func:`nxd_lc.app.validation.load_config`; the modes themselves are :mod:`nxd_lc.precision.policy`."""

from __future__ import annotations

import logging
import os

from nxd_lc.config.schema import NxdConfig
from nxd_lc.precision.policy import PRECISION_TYPES, resolve_precision
from nxd_lc.runtime.device import is_lazy_config_accelerator
from nxd_lc.runtime.env import PRECISION_ENV, preset_bf16_flags

log = logging.getLogger(__name__)


def policy_flag(cfg: NxdConfig, flag: str) -> bool:
    """A boolean of the precision mode's policy (``master_weights``, ``fp32_grad_acc``: the policy's own rule);
    False for an unknown type or reduce dtype, which are reported by their own checks."""
    try:
        return bool(getattr(resolve_precision(cfg), flag))
    except ValueError:
        return False


#: The ``precision`` keys that set XLA / Neuron environment variables themselves only with ``type: manual``.
PRECISION_ENV_KEYS = ("xla_use_bf16", "xla_downcast_bf16", "neuron_rt_stochastic_rounding_en")


def precision_env_overrides(cfg: NxdConfig) -> list[tuple[str, str, str]]:
    """``(key, configured value, value the type uses)`` for each of :data:`PRECISION_ENV_KEYS` whose value a
    non-manual ``precision.type`` replaces (as NxDT does); a type that leaves a variable unset uses '0'."""
    prec = cfg.precision
    if prec.type not in PRECISION_ENV:
        return []
    by_type = dict(zip(PRECISION_ENV_KEYS, PRECISION_ENV[prec.type][:3]))
    out = []
    for key in PRECISION_ENV_KEYS:
        value, used = str(getattr(prec, key)), by_type[key] or "0"
        if value in ("0", "1") and value != used:
            out.append((key, value, used))
    return out


def _override_line(precision_type: str, key: str, value: str, used: str) -> str:
    """The line of one overridden precision key, in the terms of the environment table: the XLA bf16 flags are set to
    '0' whatever the type (:mod:`nxd_lc.runtime.env`: the type's bf16 parameters are explicit casts), so only what
    the type means is said; NEURON_RT_STOCHASTIC_ROUNDING_EN is set to the type's value."""
    if key == "neuron_rt_stochastic_rounding_en":
        return (f"precision.{key} '{value}' is overridden by precision.type {precision_type}, which sets "
                f"NEURON_RT_STOCHASTIC_ROUNDING_EN={used} (these keys are read only with precision.type manual)")
    return (f"precision.{key} '{value}' is not read: precision.type {precision_type} decides the dtypes (NxDT sets "
            f"{key.upper()}={used} for it; nxd_lc casts explicitly and sets {key.upper()}=0, as its environment table "
            "shows; these keys are read only with precision.type manual)")


def log_precision_overrides(cfg: NxdConfig) -> list[str]:
    """Log (info, global rank 0 only) each precision key a non-manual ``precision.type`` overrides; returns the
    lines (every rank). NxDT's examples set all three to '0' beside ``mixed_precision``, which uses '1' for
    ``xla_downcast_bf16``: that is overridden, not an error (a '1' the type turns off is, see validation)."""
    lines = [_override_line(cfg.precision.type, key, value, used) for key, value, used in precision_env_overrides(cfg)]
    if os.environ.get("RANK", "0") == "0":
        for line in lines:
            log.info("config: %s", line)
    return lines


def precision_problems(cfg: NxdConfig) -> list[str]:
    """Precision keys that cannot be honoured together (modes -> dtypes: :mod:`nxd_lc.precision.policy`), and, where
    the run's tensors are torch-xla's (``trainer.accelerator`` xla, or neuron / auto resolving to torch-xla), a
    ``XLA_USE_BF16`` / ``XLA_DOWNCAST_BF16`` already switched on in the environment (it would make every fp32
    tensor bf16 on the device: :func:`nxd_lc.runtime.env.preset_bf16_flags`)."""
    p: list[str] = []
    if is_lazy_config_accelerator(cfg.trainer.accelerator):
        p += [f"trainer.accelerator {cfg.trainer.accelerator}: {line}" for line in preset_bf16_flags()]
    prec, ckpt = cfg.precision, cfg.exp_manager.checkpoint_callback_params
    reduce = prec.parallel_layers_reduce_dtype
    if reduce not in (None, "fp32", "float32", "bf16", "bfloat16"):
        p.append(f"precision.parallel_layers_reduce_dtype: unknown value {reduce!r}; choose fp32 or bf16")
    for key in PRECISION_ENV_KEYS:
        if str(getattr(prec, key)) not in ("0", "1"):
            p.append(f"precision.{key}: must be '0' or '1', got {getattr(prec, key)!r}")
    for key, value, used in precision_env_overrides(cfg):
        if value == "1":  # NxDT's default is '0': a '1' the type turns off was set on purpose
            p.append(f"precision.{key}: '1' contradicts precision.type {prec.type}, which uses '{used}' (the type "
                     f"sets it); remove it, or use precision.type manual to set it yourself")
    if prec.type != "manual" and prec.type in PRECISION_TYPES:
        for key in ("master_weights", "fp32_grad_acc"):
            if getattr(prec, key) and not policy_flag(cfg, key):  # true where the type has none: set on purpose
                p.append(f"precision.{key}: true contradicts precision.type {prec.type}, which has none (only read "
                         f"with precision.type manual; the type fixes it, see the README precision table); set it "
                         "false or use precision.type manual")
    if ckpt.use_master_weights_in_ckpt and not policy_flag(cfg, "master_weights"):
        p.append(f"exp_manager.checkpoint_callback_params.use_master_weights_in_ckpt: precision.type {prec.type} "
                 "keeps no fp32 master weights; use mixed_precision / mixed_precisionSR (or manual with "
                 "master_weights and bf16) or set it false")
    if ckpt.use_master_weights_in_ckpt and cfg.exp_manager.save_bf16:
        p.append("exp_manager.save_bf16: contradicts checkpoint_callback_params.use_master_weights_in_ckpt "
                 "(fp32 master weights); set one of them false")
    return p
