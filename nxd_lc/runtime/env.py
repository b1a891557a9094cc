"""Config -> environment variables, applied once at startup before any runtime (torch-xla) initialises.

NxDT maps its top-level keys and precision mode to Neuron/XLA environment variables (facts in
``shared/reference/nxdt_hf_llama3_8B_config.yaml``). A variable already set in the environment wins, as in NxDT.
Off Trainium these variables are inert but still set, so a run's environment is the same on every backend and is
printed once by rank 0.

**XLA_USE_BF16 / XLA_DOWNCAST_BF16 are set to '0' in every mode** (issue 38; measurements in docs/precision.md).
NxDT realises its modes with them, but under either flag torch-xla stores every ``torch.float32`` tensor as bf16 on
the device (and ``float64`` as bf16 / f32; pytorch/xla ``torch_xla/csrc/dtype.cpp``), so fp32 master weights,
``main_grad``, optimizer state, norm statistics and the loss silently become bf16 unless every one of them is held
in float64 (NxD's convention). nxd_lc casts explicitly instead (bf16 parameters by :mod:`nxd_lc.precision`, fp32
where fp32 is meant), which torch-xla has advised since 2.5 ("convert your model to bf16 directly") and which is
the only convention the native ``neuron`` device (no such flags) shares. A '1' already in the environment is
refused on xla / neuron by :func:`preset_bf16_flags` (named, with the fix). The precision keys
``xla_use_bf16`` / ``xla_downcast_bf16`` of ``precision.type: manual`` keep NxDT's meaning (bf16 parameters)
through that cast. ``NEURON_RT_STOCHASTIC_ROUNDING_EN`` is still set from the mode: on Neuron the runtime then
rounds fp32 -> bf16 stochastically in hardware (:func:`nxd_lc.precision.stochastic_rounding.hardware_rounding`).

**Node settings** (:data:`NODE_ENV`): what NxDT's launcher ``examples/train_setup.sh`` exports on every Trainium
node (facts in ``shared/reference/neuron_platform.md``, "Node settings", and issue 39), one row each, only where
they apply (:func:`node_env`): ``MALLOC_ARENA_MAX=128`` on xla / neuron (torch-xla or the native device: 32-64
processes of many threads per node), ``XLA_DISABLE_FUNCTIONALIZATION=0`` where torch-xla runs (it is torch-xla's
default: functionalization on), and the EFA variables ``FI_PROVIDER=efa``, ``FI_EFA_USE_DEVICE_RDMA=1``,
``FI_EFA_FORK_SAFE=1`` on xla / neuron runs of several nodes (libfabric, which the Neuron runtime's collectives use
between nodes, reads them when it starts, after this table is applied). The environment wins, as for every row.
glibc reads ``MALLOC_ARENA_MAX`` once, at the process's first allocation, so the variable set here reaches only
the processes started later (the Neuron compiler, data workers); :func:`apply_env` also applies it to the running
process with ``mallopt(M_ARENA_MAX)`` (glibc). The SLURM example exports all of them before the processes start.

**TorchNeuron's NEFF cache**: on the native ``neuron`` device ``compiler_cache_url`` also sets
``TORCH_NEURONX_NEFF_CACHE_DIR`` (:data:`NATIVE_NEFF_CACHE_VAR`; the variable the April 2026 torch-neuronx source
names, default ``/tmp/neff_cache``: ``shared/reference/neuron_platform.md``), when it is a local directory.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from nxd_lc.config.schema import NxdConfig
from nxd_lc.runtime.device import config_runtime

log = logging.getLogger(__name__)

#: The torch-xla variables that turn float32 into bf16 on the device (``torch_xla/csrc/dtype.cpp``); nxd_lc sets both
#: to '0' and refuses a preset '1' on xla / neuron (module docstring).
XLA_BF16_FLAGS = ("XLA_USE_BF16", "XLA_DOWNCAST_BF16")

#: NxDT's precision modes -> (XLA_USE_BF16, XLA_DOWNCAST_BF16, NEURON_RT_STOCHASTIC_ROUNDING_EN, extra cc flags), as
#: NxDT sets them. The first two are what the mode *means* (bf16 parameters; read by the precision rules); nxd_lc
#: sets them to '0' and realises that meaning by explicit casts (module docstring).
PRECISION_ENV: dict[str, tuple[str, str, str | None, str]] = {
    "bf16SR": ("1", "0", "1", "--enable-mixed-precision-accumulation"),
    "mixed_precision": ("0", "1", "0", "--enable-mixed-precision-accumulation"),
    "mixed_precisionSR": ("0", "1", "1", "--enable-mixed-precision-accumulation"),
    "fp32": ("0", "0", None, "--auto-cast none"),
    "autocast": ("0", "0", "0", "--enable-mixed-precision-accumulation --auto-cast none"),
}


#: NxDT ``train_setup.sh``'s node settings: (variable, value, where it applies). 'xla_neuron': accelerator xla or
#: neuron (torch-xla or the native device); 'torch_xla': where torch-xla runs; 'efa': xla / neuron on more than one
#: node (``trainer.num_nodes`` > 1). Module docstring: sources and why each applies there.
NODE_ENV: tuple[tuple[str, str, str], ...] = (
    ("MALLOC_ARENA_MAX", "128", "xla_neuron"),
    ("XLA_DISABLE_FUNCTIONALIZATION", "0", "torch_xla"),
    ("FI_PROVIDER", "efa", "efa"),
    ("FI_EFA_USE_DEVICE_RDMA", "1", "efa"),
    ("FI_EFA_FORK_SAFE", "1", "efa"),
)

#: TorchNeuron's NEFF cache directory variable (native ``neuron`` device; module docstring).
NATIVE_NEFF_CACHE_VAR = "TORCH_NEURONX_NEFF_CACHE_DIR"

#: glibc ``malloc.h``'s ``M_ARENA_MAX`` parameter number for ``mallopt``.
_M_ARENA_MAX = -8


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
    # bf16 parameters come from explicit casts, never from these flags (module docstring)
    rows += [("precision.type", var, "0") for var in XLA_BF16_FLAGS]
    if p.type == "manual":
        rows += [("precision.neuron_rt_stochastic_rounding_en", "NEURON_RT_STOCHASTIC_ROUNDING_EN",
                  str(p.neuron_rt_stochastic_rounding_en))]
    elif p.type in PRECISION_ENV:
        _, _, sr, flags = PRECISION_ENV[p.type]
        if sr is not None:
            rows.append(("precision.type", "NEURON_RT_STOCHASTIC_ROUNDING_EN", sr))
        rows.append(("precision.type", "NEURON_CC_FLAGS", flags))
    if cfg.compiler_flags:
        rows.append(("compiler_flags", "NEURON_CC_FLAGS", cfg.compiler_flags))
    rows.append(("compiler_cache_url", "NEURON_COMPILE_CACHE_URL", cfg.compiler_cache_url))
    runtime = config_runtime(cfg.trainer.accelerator)
    if runtime == "neuron_native" and cfg.compiler_cache_url and "://" not in cfg.compiler_cache_url:
        rows.append(("compiler_cache_url", NATIVE_NEFF_CACHE_VAR, cfg.compiler_cache_url))
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
    return rows + node_env(runtime, cfg.trainer.num_nodes)


def node_env(runtime: str, num_nodes: int) -> list[tuple[str, str, str]]:
    """(config key, variable, value) of the :data:`NODE_ENV` rows that apply to a run on ``runtime``
    (:func:`nxd_lc.runtime.device.config_runtime`: 'torch_xla' | 'neuron_native' | 'host') over ``num_nodes``
    nodes. The config key is the one that decides whether the row applies (``trainer.accelerator``, or
    ``trainer.num_nodes`` for EFA)."""
    applies = {"xla_neuron": runtime != "host", "torch_xla": runtime == "torch_xla",
               "efa": runtime != "host" and num_nodes > 1}
    return [("trainer.num_nodes" if where == "efa" else "trainer.accelerator", var, value)
            for var, value, where in NODE_ENV if applies[where]]


def limit_malloc_arenas(value: str) -> bool:
    """Apply ``MALLOC_ARENA_MAX=value`` to this process: ``mallopt(M_ARENA_MAX, value)`` (glibc reads the variable
    only at the first allocation, long before nxd_lc runs). Returns True when glibc accepted it, False elsewhere
    (another C library, a value that is not an integer, mallopt refusing it)."""
    import ctypes
    import platform

    if platform.libc_ver()[0] != "glibc":
        return False
    try:
        return bool(ctypes.CDLL(None).mallopt(_M_ARENA_MAX, int(value)))
    except (OSError, AttributeError, ValueError):
        return False


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
    arenas = table.get("MALLOC_ARENA_MAX")
    if environ is None and arenas is not None and arenas.source == "config":  # the live process, not a dry run
        limit_malloc_arenas(arenas.value)
    return list(table.values())


def format_env_table(entries: list[EnvEntry]) -> str:
    """A fixed-width table of the effective environment (printed once by rank 0)."""
    w_var = max([len(e.var) for e in entries] + [8])
    w_key = max([len(e.key) for e in entries] + [10])
    lines = [f"{'variable':<{w_var}}  {'config key':<{w_key}}  {'source':<18}  value"]
    lines += [f"{e.var:<{w_var}}  {e.key:<{w_key}}  {e.source:<18}  {e.value}" for e in entries]
    return "\n".join(lines)


def flag_on(value: str) -> bool:
    """torch-xla's reading of a boolean variable (``runtime::sys_util::GetEnvBool``): ``true`` / ``false``
    exactly, else C's ``atoi`` (leading blanks, a sign, the leading digits) is non-zero."""
    if value in ("true", "false"):
        return value == "true"
    m = re.match(r"\s*[+-]?(\d+)", value)
    return bool(m) and int(m.group(1)) != 0


def preset_bf16_flags(environ: Mapping[str, str] | None = None) -> list[str]:
    """The problems of :data:`XLA_BF16_FLAGS` already switched on in ``environ`` (default ``os.environ``), one line
    per variable naming it and the fix. Callers judge them only where torch-xla runs (accelerator xla / neuron).

    Under either flag torch-xla stores float32 as bf16 on the device for the whole process (read once, at the first
    tensor), whatever the config asks: every mode's fp32 tensors (master weights, ``main_grad``, optimizer state,
    the software stochastic rounding's working copy, norm statistics, the loss) would be bf16 and updates below half
    a bf16 step lost. Measured (tiny Llama, 5 AdamW steps at lr 1e-6, issue 38): 1.1% of the master elements
    moved under XLA_DOWNCAST_BF16=1 against 56.5% on CPU.
    """
    env = os.environ if environ is None else environ
    out = []
    for var in XLA_BF16_FLAGS:
        if var in env and flag_on(env[var]):
            out.append(f"{var}={env[var]} is set in the environment: torch-xla then stores every float32 tensor as "
                       "bf16 on the device (pytorch/xla csrc/dtype.cpp), so the fp32 master weights, main_grad, "
                       "optimizer state, norm statistics and loss of every precision.type would be bf16 and small "
                       f"updates lost. nxd_lc casts explicitly instead: unset {var} (or set it to 0); precision.type "
                       "chooses bf16 parameters itself (mixed_precision: bf16 parameters, fp32 master weights)")
    return out
