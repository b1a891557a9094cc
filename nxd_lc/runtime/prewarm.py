"""The prewarm (graph-extraction) pass: ``python train.py --config-name X +prewarm=true``.

A prewarm runs the same config for a few optimizer steps with no checkpoints, no loggers and no resume, so
that every graph of the training step (and of validation, when it falls within those steps) is compiled
into the compile cache before the real run; on Neuron this is what ``neuron_parallel_compile`` does. It then
writes the manifest of the graph hashes it compiled beside the cache
(:mod:`nxd_lc.runtime.compile_cache`); the next training run checks its graphs against it.

How many steps: the step graph changes after the first optimizer step (the optimizer state appears) and on
logging steps (read-backs every ``trainer.log_every_n_steps``), so the prewarm runs
``max(PREWARM_MIN_STEPS, log_every_n_steps + 1)`` steps, capped at ``trainer.max_steps``.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Optional

from nxd_lc.config.schema import NxdConfig
from nxd_lc.runtime.compile_cache import (
    ManifestCheck,
    check_manifest,
    manifest_path,
    recorded_graphs,
    write_manifest,
)

log = logging.getLogger(__name__)

__all__ = ["PREWARM_MIN_STEPS", "check_run_graphs", "finish_prewarm", "prewarm_config", "prewarm_steps", "run_prewarm"]

#: Fewest optimizer steps of a prewarm: step 1 (no optimizer state yet), step 2 (state exists), one more.
PREWARM_MIN_STEPS = 3


def prewarm_steps(cfg: NxdConfig) -> int:
    """Optimizer steps of the prewarm of ``cfg`` (module docstring); at least 1."""
    steps = max(PREWARM_MIN_STEPS, cfg.trainer.log_every_n_steps + 1)
    if cfg.trainer.max_steps is not None and cfg.trainer.max_steps > 0:
        steps = min(steps, cfg.trainer.max_steps)
    return max(1, steps)


def prewarm_config(cfg: NxdConfig) -> NxdConfig:
    """``cfg`` for the prewarm: :func:`prewarm_steps` steps, no checkpoints, no TensorBoard, no resume.

    The model, data, parallel layout and precision are unchanged, so the graphs are the training run's. The
    original ``cfg`` is not modified.
    """
    em = dataclasses.replace(cfg.exp_manager, create_checkpoint_callback=False, create_tensorboard_logger=False,
                             resume_if_exists=False, resume_from_checkpoint=None)
    trainer = dataclasses.replace(cfg.trainer, max_steps=prewarm_steps(cfg))
    return dataclasses.replace(cfg, exp_manager=em, trainer=trainer)


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

    Returns None when there is no manifest (a warning says how to make one).
    """
    return check_manifest(manifest_path(cfg.compiler_cache_url), recorded_graphs(record_dir))


def run_prewarm(cfg: NxdConfig, fit: Callable[[NxdConfig], Any]) -> Any:
    """Run the prewarm of ``cfg`` with ``fit`` (the training assembly) and write the manifest.

    On ``trainer.accelerator`` xla / neuron the graphs are recorded (:func:`start_graph_recording`) and the
    manifest is written; on cpu / gpu there are no lazy graphs, so the steps run and no manifest is written
    (a warning says so). Returns what ``fit`` returns (the Trainer).

    Raises:
        ModuleNotFoundError: xla / neuron without torch-xla.
    """
    from nxd_lc.runtime.compile_cache import start_graph_recording

    pcfg = prewarm_config(cfg)
    record = start_graph_recording() if cfg.trainer.accelerator in ("xla", "neuron") else None
    trainer = fit(pcfg)
    if record is None:
        log.warning("prewarm on trainer.accelerator=%s: no lazy graphs to record, no manifest written",
                    cfg.trainer.accelerator)
    else:
        finish_prewarm(cfg, record, pcfg.trainer.max_steps or 0)
    return trainer
