"""Lightning callbacks: NxD-layout checkpointing and throughput logging."""

from __future__ import annotations

import time
from typing import Any, Optional

import pytorch_lightning as pl
from pytorch_lightning.callbacks import ModelCheckpoint

from nxd_lc.config.schema import CheckpointCallbackParams


class NxDModelCheckpoint(ModelCheckpoint):
    """Lightning's ModelCheckpoint writing checkpoint *directories* ``<dirpath>/<tag>`` (no ``.ckpt`` suffix).

    Top-k bookkeeping, ``monitor``/``mode``, ``save_last``, ``every_n_train_steps`` and the filename pattern
    (``{step}``, ``{consumed_samples}``) are Lightning's; the strategy (:class:`NxDStrategy`) turns each save into
    NxD's sharded layout and each removal into an atomic directory removal.
    """

    FILE_EXTENSION = ""

    @classmethod
    def from_config(cls, params: CheckpointCallbackParams, dirpath: str) -> NxDModelCheckpoint:
        """Build from ``exp_manager.checkpoint_callback_params``."""
        return cls(dirpath=dirpath, filename=params.filename, monitor=params.monitor,
                   save_top_k=params.save_top_k, mode=params.mode, save_last=params.save_last,
                   every_n_train_steps=params.every_n_train_steps, save_on_train_epoch_end=False,
                   auto_insert_metric_name=True)


class ThroughputLogger(pl.Callback):
    """Logs ``throughput/tokens_per_sec`` and ``throughput/seqs_per_sec`` of the whole job per optimizer step.

    A step processes ``global_batch_size`` sequences of ``seq_length`` tokens over all data-parallel ranks;
    throughput = that / wall-clock seconds since the previous step ended (the first step, which includes
    warm-up, is skipped). Lightning's ThroughputMonitor multiplies by the world size, which over-counts when
    tensor-parallel ranks share a sample, hence this callback.

    Args:
        global_batch_size: sequences per optimizer step, all DP ranks together.
        seq_length: tokens per sequence.
    """

    def __init__(self, global_batch_size: int, seq_length: int) -> None:
        self.global_batch_size = global_batch_size
        self.seq_length = seq_length
        self._last_time: Optional[float] = None
        self._last_step = -1
        self.train_start_time: Optional[float] = None
        self.last_tokens_per_sec: Optional[float] = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.train_start_time = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = trainer.global_step
        if step == self._last_step:  # still accumulating
            return
        now = time.perf_counter()
        if self._last_time is not None and step > self._last_step >= 0:
            dt = max(now - self._last_time, 1e-9) / (step - self._last_step)
            seqs = self.global_batch_size / dt
            self.last_tokens_per_sec = seqs * self.seq_length
            pl_module.log("throughput/seqs_per_sec", seqs, on_step=True, rank_zero_only=False)
            pl_module.log("throughput/tokens_per_sec", self.last_tokens_per_sec, on_step=True,
                          prog_bar=True, rank_zero_only=False)
        self._last_time, self._last_step = now, step

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # validation time is not training throughput: restart the clock
        self._last_time = time.perf_counter()
