"""Recovery-time instrumentation (``exp_manager.enable_recovery_time_instrumentation``, NxDT's key).

The time from process start to the first completed training step, split into phases; after a restart that is
the time a failure costs beyond the lost steps. Phase boundaries (wall clock, ``time.time()``):

============================  =====================================================================
``startup_s``                 process start -> ``nxd_lc.app.run.run`` entered: interpreter start and imports
                              (process start is the kernel's: ``/proc/self/stat`` field 22 + boot time)
``distributed_init_s``        -> process group and ``parallel_state`` ready
``model_build_s``             -> model built, HF weights loaded, moved to the device
``data_setup_s``              -> data module and LightningModule built (tokenizer, packed-data cache)
``restore_s``                 -> ``on_train_start``: Lightning's setup plus the checkpoint restore
                              (resume plan and verification included)
``first_step_s``              -> the first optimizer step after (re)start has finished
============================  =====================================================================

:class:`RecoveryTimer` logs one line per phase on global rank 0 and logs ``recovery/<phase>`` and
``recovery/total_s`` as scalars to the Lightning loggers at the first step.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Optional

import pytorch_lightning as pl

log = logging.getLogger(__name__)

PHASES = ("startup_s", "distributed_init_s", "model_build_s", "data_setup_s", "restore_s", "first_step_s")


def process_start_time() -> float:
    """This process's start as seconds since the epoch, from ``/proc`` (Linux); ``time.time()`` elsewhere.

    Formula: boot time (``btime`` of ``/proc/stat``) + start ticks (field 22 of ``/proc/self/stat``) / CLK_TCK.
    """
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            btime = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return btime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, StopIteration, ValueError, IndexError):
        return time.time()


class RecoveryTimer(pl.Callback):
    """Records phase boundaries (:meth:`mark`) and reports the phases at the first optimizer step.

    Args:
        resumed_from: the checkpoint the run resumes from (None for a fresh start; only reported).
    """

    def __init__(self) -> None:
        self.marks: dict[str, float] = {"process_start": process_start_time()}
        self.resumed_from: Optional[str] = None
        self.phases: dict[str, float] = {}
        self._start_step: Optional[int] = None

    def mark(self, name: str) -> None:
        """Record the end of phase ``name`` (one of :data:`PHASES`) now."""
        self.marks[name] = time.time()

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """The data module and the LightningModule exist when Lightning's fit starts."""
        self.marks.setdefault("data_setup_s", time.time())

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.mark("restore_s")
        self._start_step = trainer.global_step

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self.phases or trainer.global_step == self._start_step:
            return
        self.mark("first_step_s")
        previous = self.marks["process_start"]
        for phase in PHASES:
            t = self.marks.get(phase, previous)
            self.phases[phase] = max(0.0, t - previous)
            previous = max(previous, t)
        total = sum(self.phases.values())
        if trainer.is_global_zero:
            what = f"resume from {self.resumed_from}" if self.resumed_from else "fresh start"
            log.info("recovery time (%s): %.2f s from process start to the end of step %d", what, total,
                     trainer.global_step)
            for phase in PHASES:
                log.info("  %-20s %8.2f s", phase, self.phases[phase])
        metrics = {f"recovery/{k}": v for k, v in self.phases.items()}
        metrics["recovery/total_s"] = total
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)
