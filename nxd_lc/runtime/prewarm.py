"""The prewarm (graph-extraction) pass: ``python train.py --config-name X +prewarm=true``.

A prewarm runs the same config for a few optimizer steps with no checkpoints, no loggers and no resume, so
that every graph of the training step (and of validation, when it falls within those steps) is compiled
into the compile cache before the real run; on Neuron this is what ``neuron_parallel_compile`` does. It then
writes the manifest of the graph hashes it compiled beside the cache
(:mod:`nxd_lc.runtime.compile_cache`); the next training run checks its graphs against it.

Which steps (measured on XLA-CPU, ``tests/test_prewarm.py``): a training run compiles new graphs at the first
two optimizer steps (the optimizer state appears), at the first logging step (read-backs every
``trainer.log_every_n_steps`` = L), at the first validation, at the first step after it, and again at the first
validation that falls on a logging step (or off one, whichever came second) and the step after that; the
pattern of validation steps relative to logging steps repeats every ``lcm(L, V)`` steps (V the integer
``trainer.val_check_interval``). Checkpoint saves compile nothing: they follow a step's sync, so parameters and
optimizer state are materialized device data and the host copies are transfers. So the prewarm runs:

* without validation (``limit_val_batches: 0`` or a fractional ``val_check_interval``):
  ``max(PREWARM_MIN_STEPS, L + 1)`` steps;
* with validation every V steps: ``V + lcm(L, V) + 1`` steps (every validation/logging combination of the run,
  and the step after each). When that exceeds ``trainer.max_steps`` the prewarm is the whole schedule with V
  unchanged; otherwise V is first shortened to ``V'``, the smallest interval >= 3 with ``V' = V (mod L)`` (same
  validation/logging pattern, so the same graphs, in fewer steps: V' >= 3 keeps a plain step between a
  step-after-validation and the next validation) and the prewarm runs ``V' + lcm(L, V') + 1`` steps.

The step count is capped at ``trainer.max_steps``. Not covered: how the last step of the run falls relative to
L and V can add graphs read back at the end of fit (once, after the last step), and fractional
``val_check_interval`` validations (at epoch ends) are covered only when an epoch ends within the prewarm.

**Under neuron_parallel_compile** (``neuron_parallel_compile torchrun train.py ...``, as Neuron users prewarm):
torch-neuronx's tool runs the script with ``NEURON_EXTRACT_GRAPHS_ONLY`` set; graphs are extracted, not executed,
then compiled in parallel into ``NEURON_COMPILE_CACHE_URL``, and every tensor read back holds garbage or zeros
(``shared/reference/neuron_platform.md``, "Compile cache and prewarm"). :func:`extracting_graphs` reads the variable
as neuronx-distributed's Python code does (``if os.environ.get("NEURON_EXTRACT_GRAPHS_ONLY", None):``: set = any
non-empty value; ``neuron_parallel_compile`` sets ``1``). The run is then this module's prewarm whatever
``prewarm`` says (:func:`run_prewarm`, one log line): the prewarm's config (no checkpoints, no TensorBoard, no
resume) with its step count capped at :data:`EXTRACT_MAX_STEPS` = 10, the length of NxDT's ``train.sh`` compile
run (``COMPILE=1``: "about 10 steps, no checkpoints"; issue 39 and neuron_platform.md), no graph manifest
(:func:`begin_graph_recording`) and no host-side non-finite / loss checks
(:meth:`nxd_lc.lightning.nonfinite.NonFiniteStepGuard.check`: the values are not real). The graphs stay the training
run's: the in-graph non-finite selection is still traced, only its read-back is skipped. A schedule longer than 10
steps (``log_every_n_steps`` >= 10, or a long validation pattern) is cut at 10 with a warning: graphs first met
after step 10 compile in the training run.

What the launch refuses (:func:`graph_extraction_problems`, before anything is built; the dry run lists it): the
variable set on a run that resolves to ``cpu`` / ``gpu`` on its host (no Neuron compiler: nothing would be extracted,
and the run would silently train a few steps without checkpoints or resume), and a value that reads as off
(``0``, ``false``, ``no``, ``off``), which NxD counts as set: it is unclear which the user meant, and the two differ
in everything the run writes. ``neuron_parallel_compile`` sets ``1``; unset the variable to train.

On Neuron (``trainer.accelerator: neuron`` or ``xla`` with ``PJRT_DEVICE=NEURON``, and the native device) no graph
manifest is recorded at all: torch-xla's persistent cache, which records it, has not been verified through
Neuron's PJRT plugin (:func:`begin_graph_recording` logs why). The Neuron compiler's own cache at
``compiler_cache_url`` is what a prewarm fills there.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import shutil
import time
from typing import Any, Callable, Mapping, Optional

from nxd_lc.config.schema import NxdConfig
from nxd_lc.runtime.compile_cache import (
    ManifestCheck,
    check_manifest,
    manifest_path,
    recorded_graphs,
    start_graph_recording,
    write_manifest,
)

log = logging.getLogger(__name__)

__all__ = ["EXTRACT_MAX_STEPS", "GRAPHS_ONLY_ENV", "GRAPH_RECORD_SUBDIR", "PREWARM_MIN_STEPS",
           "begin_graph_recording", "check_run_graphs", "end_graph_recording", "extracting_graphs", "finish_prewarm",
           "graph_extraction_problems", "prewarm_config", "prewarm_schedule", "prewarm_steps", "run_prewarm"]

#: Sub-directory of ``compiler_cache_url`` holding the per-run graph record directories.
GRAPH_RECORD_SUBDIR = "nxd_lc_graphs"

#: Fewest optimizer steps of a prewarm: step 1 (no optimizer state yet), step 2 (state exists), one more.
PREWARM_MIN_STEPS = 3

#: Set by torch-neuronx's ``neuron_parallel_compile``: graphs are extracted, not executed (module docstring).
GRAPHS_ONLY_ENV = "NEURON_EXTRACT_GRAPHS_ONLY"

#: Most optimizer steps of a run under ``neuron_parallel_compile``: NxDT's ``train.sh`` compile run (``COMPILE=1``)
#: trains about 10 steps with no checkpoints (issue 39; ``shared/reference/neuron_platform.md``).
EXTRACT_MAX_STEPS = 10


def extracting_graphs(environ: Optional[Mapping[str, str]] = None) -> bool:
    """True under ``neuron_parallel_compile``: :data:`GRAPHS_ONLY_ENV` is set to a non-empty value in ``environ``
    (default ``os.environ``), as neuronx-distributed tests it (``os.environ.get(..., None)`` for truth: ``0`` counts
    as set, an empty value does not). Values read back from the device are then not real (module docstring)."""
    return bool((os.environ if environ is None else environ).get(GRAPHS_ONLY_ENV))


#: Values of :data:`GRAPHS_ONLY_ENV` that read as "off" but that NxD counts as set (refused at launch).
_OFF_SPELLINGS = ("0", "false", "no", "off")


def graph_extraction_problems(cfg: NxdConfig, environ: Optional[Mapping[str, str]] = None) -> list[str]:
    """The launch's refusals of :data:`GRAPHS_ONLY_ENV` in ``environ`` (default ``os.environ``; module docstring):
    set on a run whose ``trainer.accelerator`` resolves to cpu / gpu on this host, or set to a value that reads as
    off. Each names the variable, what the extraction run would skip and the fix; empty when unset (or empty)."""
    env = os.environ if environ is None else environ
    if not extracting_graphs(env):
        return []
    from nxd_lc.runtime.device import config_runtime

    value, acc = env[GRAPHS_ONLY_ENV], cfg.trainer.accelerator
    skips = (f"it would train {prewarm_config(cfg, EXTRACT_MAX_STEPS).trainer.max_steps} optimizer step(s) of "
             f"trainer.max_steps {cfg.trainer.max_steps}, save no checkpoint and not resume")
    if value.strip().lower() in _OFF_SPELLINGS:
        return [f"{GRAPHS_ONLY_ENV}={value!r}: set, so graph extraction is on (neuronx-distributed and NxDT count any "
                f"non-empty value as set); {skips}; unset it to train (unset {GRAPHS_ONLY_ENV}), or set it to 1 "
                "for neuron_parallel_compile's extraction pass"]
    if config_runtime(acc) == "host":
        import torch

        where = "gpu" if acc == "gpu" or (acc == "auto" and torch.cuda.is_available()) else "cpu"
        return [f"{GRAPHS_ONLY_ENV}={value!r} (neuron_parallel_compile's graph extraction) is set, but "
                f"trainer.accelerator {acc} runs on {where} on this host, which has no Neuron compiler: nothing "
                f"would be extracted, and {skips}; unset it to train here (+prewarm=true is the prewarm pass off "
                "Neuron), or run neuron_parallel_compile on a Trainium host (trainer.accelerator neuron or xla)"]
    return []


def _validation_interval(cfg: NxdConfig) -> Optional[int]:
    """The run's integer validation interval in optimizer steps, or None when no periodic validation runs."""
    t = cfg.trainer
    v = t.val_check_interval
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0 or t.limit_val_batches in (0, 0.0):
        return None
    return v


def _steps_covering(log_every: int, val_every: int) -> int:
    """``V + lcm(L, V) + 1``: through every validation/logging combination of the run and the step after it."""
    return val_every + math.lcm(log_every, val_every) + 1


def prewarm_schedule(cfg: NxdConfig) -> tuple[int, Optional[int]]:
    """``(optimizer steps, validation interval)`` of the prewarm of ``cfg`` (module docstring).

    The interval is None when the run has no periodic validation (then the config's value is kept).
    """
    max_steps = cfg.trainer.max_steps if cfg.trainer.max_steps is not None and cfg.trainer.max_steps > 0 else None
    log_every = max(1, cfg.trainer.log_every_n_steps)
    steps, val = max(PREWARM_MIN_STEPS, log_every + 1), _validation_interval(cfg)
    if val is not None:
        if max_steps is None or _steps_covering(log_every, val) < max_steps:
            if val > PREWARM_MIN_STEPS:  # the smallest interval >= 3 with the same residue mod L
                val -= log_every * ((val - PREWARM_MIN_STEPS) // log_every)
            steps = max(steps, _steps_covering(log_every, val))
        else:
            steps = max_steps
    if max_steps is not None:
        steps = min(steps, max_steps)
    return max(1, steps), val


def prewarm_steps(cfg: NxdConfig) -> int:
    """Optimizer steps of the prewarm of ``cfg`` (module docstring); at least 1."""
    return prewarm_schedule(cfg)[0]


def prewarm_config(cfg: NxdConfig, max_steps_cap: Optional[int] = None) -> NxdConfig:
    """``cfg`` for the prewarm: :func:`prewarm_schedule`'s steps (at most ``max_steps_cap`` when given: the
    :data:`EXTRACT_MAX_STEPS` of a ``neuron_parallel_compile`` run) and validation interval, no checkpoints, no
    TensorBoard, no resume, ``prewarm`` true.

    The model, data, parallel layout, precision, ``log_every_n_steps`` and ``limit_val_batches`` are unchanged, so
    the graphs are the training run's. The original ``cfg`` is not modified.
    """
    steps, val = prewarm_schedule(cfg)
    if max_steps_cap is not None:
        steps = min(steps, max_steps_cap)
    em = dataclasses.replace(cfg.exp_manager, create_checkpoint_callback=False, create_tensorboard_logger=False,
                             resume_if_exists=False, resume_from_checkpoint=None)
    trainer = dataclasses.replace(cfg.trainer, max_steps=steps,
                                  val_check_interval=cfg.trainer.val_check_interval if val is None else val)
    return dataclasses.replace(cfg, exp_manager=em, trainer=trainer, prewarm=True)


def finish_prewarm(cfg: NxdConfig, record_dir: str, steps: int, config_name: str = "") -> str:
    """Write the manifest of the graphs recorded in ``record_dir`` beside ``cfg.compiler_cache_url``.

    Returns:
        The manifest path.

    Raises:
        ValueError: ``compiler_cache_url`` is not a local directory.
        FileNotFoundError: ``record_dir`` does not exist.
    """
    path = manifest_path(cfg.compiler_cache_url)
    graphs = recorded_graphs(record_dir)
    write_manifest(path, graphs, steps=steps, config_name=config_name or cfg.name)
    log.info("prewarm: %d graph(s) compiled in %d step(s); manifest written to %s", len(graphs), steps, path)
    return path


def check_run_graphs(cfg: NxdConfig, record_dir: str) -> Optional[ManifestCheck]:
    """After training: compare the graphs recorded in ``record_dir`` with the prewarm manifest (logs the result).

    Returns None when there is no manifest (one info line says how to make one).
    """
    return check_manifest(manifest_path(cfg.compiler_cache_url), recorded_graphs(record_dir))


def begin_graph_recording(cfg: NxdConfig, accelerator: str, rank: int) -> Optional[str]:
    """Start recording this process's graphs for the manifest (prewarm or check); return the record directory.

    Call once at startup, after :func:`nxd_lc.runtime.env.apply_env` and before the first graph is compiled.
    Records on global rank 0 of an xla run off Neuron only (the ranks run one program; rank 0's graphs are the
    manifest), into a fresh ``<compiler_cache_url>/nxd_lc_graphs/run-<time>-<pid>`` (:mod:`compile_cache`'s
    docstring: why beside the real cache and why it does not disturb it). Returns None when nothing is recorded:
    cpu / gpu (no lazy graphs), rank != 0, and, with one info line saying why, under ``neuron_parallel_compile``
    (:func:`extracting_graphs`), on Neuron (``neuron``, ``neuron_native``, or ``xla`` with ``PJRT_DEVICE=NEURON``:
    torch-xla's persistent cache is not verified through Neuron's PJRT plugin), a remote ``compiler_cache_url``
    (``s3://...``: the manifest needs a local directory), or ``XLA_PERSISTENT_CACHE_PATH`` already set (the
    user's own torch-xla persistent cache wins; recording would take it over).

    Raises:
        ModuleNotFoundError: xla / neuron without torch-xla.
    """
    what = "prewarm manifest" if cfg.prewarm else "graph manifest check"
    if accelerator not in ("xla", "neuron", "neuron_native"):
        if cfg.prewarm:
            log.warning("prewarm on trainer.accelerator=%s: no lazy graphs to record, no manifest written",
                        accelerator)
        return None
    if rank != 0:
        return None
    reason = _not_recorded_because(cfg, accelerator)
    if reason:
        log.info("%s off: %s", what, reason)
        return None
    root = os.path.join(os.path.abspath(cfg.compiler_cache_url), GRAPH_RECORD_SUBDIR)
    record_dir = os.path.join(root, f"run-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
    return start_graph_recording(record_dir)


def _not_recorded_because(cfg: NxdConfig, accelerator: str) -> Optional[str]:
    """Why :func:`begin_graph_recording` records nothing on rank 0 of an xla / neuron run (None: it records)."""
    from nxd_lc.runtime.xla import torch_xla_available, xla_hardware

    if extracting_graphs():
        return (f"{GRAPHS_ONLY_ENV}={os.environ[GRAPHS_ONLY_ENV]!r} (neuron_parallel_compile: graphs are extracted, "
                "not run)")
    if accelerator == "neuron_native":
        return "TorchNeuron's native device has no torch-xla graphs to record"
    if "://" in cfg.compiler_cache_url or not cfg.compiler_cache_url:
        return f"compiler_cache_url={cfg.compiler_cache_url!r} is not a local directory"
    if os.environ.get("XLA_PERSISTENT_CACHE_PATH"):
        return (f"XLA_PERSISTENT_CACHE_PATH={os.environ['XLA_PERSISTENT_CACHE_PATH']!r} is set (your torch-xla "
                "persistent cache is kept; unset it to record graphs)")
    if accelerator == "neuron" or (torch_xla_available() and xla_hardware() == "NEURON"):
        return ("on Neuron torch-xla's persistent cache, which records the graphs, is not verified through Neuron's "
                "PJRT plugin yet (torch-xla 2.9 cannot load its own serialized executables through a plugin: "
                "pytorch/xla#9094); the Neuron compiler's cache at compiler_cache_url works as before")
    return None


def end_graph_recording(cfg: NxdConfig, record_dir: Optional[str], steps: int) -> Optional[ManifestCheck]:
    """After fit: write the manifest (prewarm) or check this run's graphs against it (training run).

    The record directory (serialized executables nobody reads back, see the module docstring) is deleted once its
    graph hashes are read. ``steps``: optimizer steps run (stored in the manifest). Returns the check of a training
    run with a manifest, else None. A no-op for ``record_dir`` None.

    Raises:
        ValueError: the existing manifest is malformed (training run; names the file and the fix).
    """
    if record_dir is None:
        return None
    try:
        if cfg.prewarm:
            finish_prewarm(cfg, record_dir, steps)
            return None
        return check_run_graphs(cfg, record_dir)
    finally:
        shutil.rmtree(record_dir, ignore_errors=True)
        try:
            os.rmdir(os.path.dirname(record_dir))  # the nxd_lc_graphs parent, when no other run is recording
        except OSError:
            pass


def run_prewarm(cfg: NxdConfig, fit: Callable[[NxdConfig], Any]) -> Any:
    """Run the prewarm of ``cfg``: ``fit(prewarm_config(cfg))`` (``fit`` is the training assembly, which records
    the graphs and writes the manifest through :func:`begin_graph_recording` / :func:`end_graph_recording`).

    Under ``neuron_parallel_compile`` (:func:`extracting_graphs`) this is the run whatever ``cfg.prewarm`` says,
    with at most :data:`EXTRACT_MAX_STEPS` steps (module docstring); one info line says so, and a warning when the
    prewarm schedule wanted more steps.

    Returns what ``fit`` returns (the Trainer).
    """
    if not extracting_graphs():
        pcfg = prewarm_config(cfg)
        log.info("prewarm: %d optimizer step(s), no checkpoints, no TensorBoard, no resume", pcfg.trainer.max_steps)
        return fit(pcfg)
    pcfg, wanted = prewarm_config(cfg, EXTRACT_MAX_STEPS), prewarm_steps(cfg)
    log.warning("%s=%r (neuron_parallel_compile): graph extraction, values read back are not real: %d optimizer "
                "step(s) of trainer.max_steps %s (the prewarm schedule, at most NxDT's %d), no checkpoints (none is "
                "saved), no resume (an existing checkpoint is not loaded), no TensorBoard, no graph manifest, no "
                "non-finite / loss checks; unset %s to train", GRAPHS_ONLY_ENV, os.environ[GRAPHS_ONLY_ENV],
                pcfg.trainer.max_steps, cfg.trainer.max_steps, EXTRACT_MAX_STEPS, GRAPHS_ONLY_ENV)
    if wanted > pcfg.trainer.max_steps:
        log.warning("the prewarm schedule of this config has %d steps (log_every_n_steps %d, validation every %s); "
                    "neuron_parallel_compile runs %d: graphs first met after step %d compile in the training run",
                    wanted, cfg.trainer.log_every_n_steps, prewarm_schedule(cfg)[1], pcfg.trainer.max_steps,
                    pcfg.trainer.max_steps)
    return fit(pcfg)
