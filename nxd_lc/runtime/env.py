"""Config -> environment variables, applied once at startup before any runtime (torch-xla) initialises.

NxDT maps its top-level keys and precision mode to Neuron/XLA environment variables (facts in
``shared/reference/nxdt_hf_llama3_8B_config.yaml``). A variable already set in the environment wins, as in NxDT.
Off Trainium these variables are inert but still set, so a run's environment is the same on every backend and is
printed once by rank 0.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from nxd_lc.config.schema import NxdConfig

log = logging.getLogger(__name__)

#: NxDT's precision modes -> (XLA_USE_BF16, XLA_DOWNCAST_BF16, NEURON_RT_STOCHASTIC_ROUNDING_EN, extra cc flags)
PRECISION_ENV: dict[str, tuple[str, str, str | None, str]] = {
    "bf16SR": ("1", "0", "1", "--enable-mixed-precision-accumulation"),
    "mixed_precision": ("0", "1", "0", "--enable-mixed-precision-accumulation"),
    "mixed_precisionSR": ("0", "1", "1", "--enable-mixed-precision-accumulation"),
    "fp32": ("0", "0", None, "--auto-cast none"),
    "autocast": ("0", "0", "0", "--enable-mixed-precision-accumulation --auto-cast none"),
}


@dataclass
class EnvEntry:
    """One row of the effective-environment table."""

    key: str  # config key the value comes from
    var: str  # environment variable
    value: str  # value in effect after startup
    source: str  # 'config' | 'environment' (already set, so it won)


def _bool_str(v: bool) -> str:
    return "1" if v else "0"


def desired_env(cfg: NxdConfig) -> list[tuple[str, str, str]]:
    """(config key, variable, value) for every variable the config asks for; NEURON_CC_FLAGS is appended to."""
    rows: list[tuple[str, str, str]] = []
    p = cfg.precision
    if p.type == "manual":
        rows += [("precision.xla_use_bf16", "XLA_USE_BF16", str(p.xla_use_bf16)),
                 ("precision.xla_downcast_bf16", "XLA_DOWNCAST_BF16", str(p.xla_downcast_bf16)),
                 ("precision.neuron_rt_stochastic_rounding_en", "NEURON_RT_STOCHASTIC_ROUNDING_EN",
                  str(p.neuron_rt_stochastic_rounding_en))]
    elif p.type in PRECISION_ENV:
        use_bf16, downcast, sr, flags = PRECISION_ENV[p.type]
        rows += [("precision.type", "XLA_USE_BF16", use_bf16), ("precision.type", "XLA_DOWNCAST_BF16", downcast)]
        if sr is not None:
            rows.append(("precision.type", "NEURON_RT_STOCHASTIC_ROUNDING_EN", sr))
        rows.append(("precision.type", "NEURON_CC_FLAGS", flags))
    if cfg.compiler_flags:
        rows.append(("compiler_flags", "NEURON_CC_FLAGS", cfg.compiler_flags))
    rows.append(("compiler_cache_url", "NEURON_COMPILE_CACHE_URL", cfg.compiler_cache_url))
    rows.append(("model.fusions.softmax", "NEURON_FUSE_SOFTMAX", _bool_str(cfg.model.fusions.softmax)))
    optional = [
        ("async_exec_max_inflight_requests", "NEURON_RT_ASYNC_EXEC_MAX_INFLIGHT_REQUESTS",
         cfg.async_exec_max_inflight_requests),
        ("bucket_size_collectives", "BUCKET_CAP_MB", cfg.bucket_size_collectives),
        ("trainer.lnc", "NEURON_LOGICAL_NC_CONFIG", cfg.trainer.lnc),
        ("neuron_rt_exec_timeout", "NEURON_RT_EXEC_TIMEOUT", cfg.neuron_rt_exec_timeout),
        ("neuron_experimental_compress_rg", "NEURON_EXPERIMENTAL_COMPRESS_RG",
         None if cfg.neuron_experimental_compress_rg is None else _bool_str(cfg.neuron_experimental_compress_rg)),
    ]
    rows += [(k, var, str(v)) for k, var, v in optional if v is not None]
    return rows


def apply_env(cfg: NxdConfig, environ: dict[str, str] | None = None) -> list[EnvEntry]:
    """Set the variables of :func:`desired_env` in ``environ`` (default ``os.environ``); existing ones win.

    ``NEURON_CC_FLAGS`` is the exception NxDT makes: config flags are appended to what the environment holds,
    skipping flags already present.

    Returns:
        The effective table, one :class:`EnvEntry` per variable.
    """
    env = os.environ if environ is None else environ
    preset = {var for _, var, _ in desired_env(cfg) if var in env}
    table: dict[str, EnvEntry] = {}
    for key, var, value in desired_env(cfg):
        if var == "NEURON_CC_FLAGS":
            current = env.get(var, "")
            if value not in current:
                env[var] = f"{current} {value}".strip()
            table[var] = EnvEntry(key, var, env[var], "environment+config" if var in preset else "config")
            continue
        if var in preset:
            table[var] = EnvEntry(key, var, env[var], "environment")
        else:
            env[var] = value
            table[var] = EnvEntry(key, var, value, "config")
    return list(table.values())


def format_env_table(entries: list[EnvEntry]) -> str:
    """A fixed-width table of the effective environment (printed once by rank 0)."""
    w_var = max([len(e.var) for e in entries] + [8])
    w_key = max([len(e.key) for e in entries] + [10])
    lines = [f"{'variable':<{w_var}}  {'config key':<{w_key}}  {'source':<18}  value"]
    lines += [f"{e.var:<{w_var}}  {e.key:<{w_key}}  {e.source:<18}  {e.value}" for e in entries]
    return "\n".join(lines)
