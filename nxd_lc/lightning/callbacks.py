"""Lightning callbacks: NxD-layout checkpointing, throughput logging, and loggers kept in step with checkpoints."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Optional

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.loggers import TensorBoardLogger

from nxd_lc.config.schema import CheckpointCallbackParams

log = logging.getLogger("nxd_lc.metrics")


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

    def _should_remove_checkpoint(self, trainer: pl.Trainer, previous: str, current: str) -> bool:
        """Remove a checkpoint that dropped out of the top k, including the one this run resumed from.

        Lightning never removes the checkpoint a run resumed from, so every restart would keep one more than
        ``save_top_k``; NxDT keeps ``save_top_k``. That is safe here because a removal happens only after its
        successor is published (synchronous saves are published before Lightning removes anything; removals
        under ``async_checkpointing`` wait for the publication). Checkpoints outside ``dirpath`` (an explicit
        ``resume_from_checkpoint`` elsewhere) are never removed.
        """
        if previous == current or self.dirpath is None:
            return False
        return Path(self.dirpath).absolute() in Path(previous).absolute().parents

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """After a resume, do not re-save the step that was just restored.

        Lightning calls ``on_train_batch_end`` for every micro-batch; with gradient accumulation the first
        micro-batches after a resume still see the restored ``global_step``, and the base class (whose
        "last saved step" is not part of its state) would write that step again under a different name.
        """
        super().on_train_start(trainer, pl_module)
        self._last_global_step_saved = trainer.global_step


def write_step_metrics(trainer: pl.Trainer) -> None:
    """Hand the values logged in the optimizer step that just ended to the loggers now, not after the step's hooks.

    Lightning writes a step's logged values only after every ``on_train_batch_end`` hook has run
    (``_TrainingEpochLoop.advance``: callbacks, then ``update_train_step_metrics``), so a checkpoint saved and
    published in that hook is on disk before the scalars of its own step are written: a crash in between loses them
    for good (the restart resumes after that step). Called before a checkpoint is published, this writes them first,
    exactly as Lightning would (same values, same TensorBoard step, only at ``log_every_n_steps`` steps and not inside
    a gradient-accumulation window); :class:`NxDTensorBoardLogger` drops Lightning's identical second write. Outside
    ``on_train_batch_end`` of a training step (validation, ``on_train_end``, sanity check) it does nothing.
    Uses Lightning's logger connector (``trainer._logger_connector``, pytorch-lightning 2.x).
    """
    module = trainer.lightning_module
    if (module is None or getattr(module, "_current_fx_name", None) != "on_train_batch_end" or not trainer.training
            or trainer.sanity_checking or not trainer.loggers):
        return
    if trainer.fit_loop._should_accumulate() and module.automatic_optimization:
        return
    connector = trainer._logger_connector
    if connector.should_update_logs:
        connector.log_metrics(connector.metrics["log"])


def flush_loggers(trainer: Optional[pl.Trainer]) -> None:
    """Make everything logged so far durable before a checkpoint is published: the current step's values
    (:func:`write_step_metrics`), then every logger's ``save()`` and its writer's ``flush()`` (TensorBoard's
    SummaryWriter otherwise buffers events for up to ``flush_secs``). A crash right after the publication then
    cannot lose a scalar of a step the checkpoint covers. Every rank may call it (the loggers write on global
    rank 0 only); None (no trainer attached yet) does nothing."""
    if trainer is None:
        return
    write_step_metrics(trainer)
    for logger in trainer.loggers:
        logger.save()
        flush = getattr(logger.experiment, "flush", None) if trainer.is_global_zero else None
        if callable(flush):
            flush()


class NxDTensorBoardLogger(TensorBoardLogger):
    """Lightning's TensorBoardLogger writing each (metric, step, value) once.

    :func:`write_step_metrics` writes a step's values before a checkpoint is published and Lightning writes the
    same values again moments later; the repeat is dropped so that TensorBoard shows one point per metric and step.
    A different value for a metric at a step already written is still written (nothing logged is ever dropped).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._last_written: dict[str, tuple[Optional[int], str]] = {}  # metric -> (step, repr(value)) last written

    def log_metrics(self, metrics: Any, step: Optional[int] = None) -> None:
        """Write ``metrics`` (name -> number or 0-d tensor) at ``step``, minus exact repeats of the last write."""
        fresh = {}
        for name, value in metrics.items():
            number = value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else value
            if isinstance(number, (int, float)):
                key = (step, repr(float(number)))  # repr: a NaN equals itself
                if self._last_written.get(name) == key:
                    continue
                self._last_written[name] = key
            fresh[name] = value
        if fresh:
            super().log_metrics(fresh, step)


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
        self._last_step: Optional[int] = None
        self.last_tokens_per_sec: Optional[float] = None

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = trainer.global_step
        if self._last_step is None:  # first micro-batch of the run (or of a resumed run): no step boundary yet
            self._last_step = step
            return
        if step == self._last_step:  # still accumulating
            return
        now = time.perf_counter()
        if self._last_time is not None:
            dt = max(now - self._last_time, 1e-9) / (step - self._last_step)
            seqs = self.global_batch_size / dt
            self.last_tokens_per_sec = seqs * self.seq_length
            # CPU tensors: Lightning would put a Python float on the module's device (a lazy op on XLA)
            pl_module.log("throughput/seqs_per_sec", torch.tensor(seqs), on_step=True, rank_zero_only=False)
            pl_module.log("throughput/tokens_per_sec", torch.tensor(self.last_tokens_per_sec), on_step=True,
                          prog_bar=True, rank_zero_only=False)
        self._last_time, self._last_step = now, step

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # validation time is not training throughput: restart the clock
        self._last_time = time.perf_counter()


class MetricsPrinter(pl.Callback):
    """Writes one line of metrics every ``log_every_n_steps`` optimizer steps to the ``nxd_lc.metrics`` logger
    (console and the run's text log), from global rank 0, plus ``val_loss`` after each validation.

    ``loss`` is the mean of ``reduced_train_loss`` (the DP-mean of a step's micro-batch losses) over the steps
    since the previous line, as Megatron's training log averages over its log interval; TensorBoard keeps the
    per-step values. The other figures are those of the step printed.

    No device value is read back between printed lines: each step's loss tensor is kept by reference and the
    interval's values are converted to numbers only when a line is printed (one host sync per line, not per
    step; on XLA no extra graph either, as the values are already computed).
    """

    KEYS = (("lr", "lr", "{:.3e}"), ("gradient_norm", "grad_norm", "{:.3f}"), ("parameter_norm", "param_norm",
            "{:.2f}"), ("throughput/tokens_per_sec", "tokens/s", "{:.0f}"), ("throughput/seqs_per_sec", "seqs/s",
            "{:.3f}"), ("consumed_samples", "consumed", "{:.0f}"),
            # preference training (DPO / ORPO): the step's values
            ("rewards/accuracies", "rewards/accuracies", "{:.3f}"), ("rewards/margins", "rewards/margins", "{:.4f}"))

    def __init__(self, log_every_n_steps: int, max_steps: int) -> None:
        self.log_every_n_steps = log_every_n_steps
        self.max_steps = max_steps
        self._last_step: Optional[int] = None
        self._losses: list[Any] = []  # reduced_train_loss of each step since the last line (tensors or numbers)
        self.printed_losses: list[tuple[int, float]] = []  # (step, mean loss) of every printed line

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """The restored / initial step: nothing trained yet in this run."""
        self._last_step = trainer.global_step

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = trainer.global_step
        if step == self._last_step or not trainer.is_global_zero:  # still accumulating (or not rank 0)
            return
        self._last_step = step
        metrics = trainer.callback_metrics
        if "reduced_train_loss" in metrics:
            self._losses.append(metrics["reduced_train_loss"])
        if step % self.log_every_n_steps != 0 and step != self.max_steps:
            return
        parts = [f"step {step}/{self.max_steps}"]
        if self._losses:
            mean = sum(float(v) for v in self._losses) / len(self._losses)
            self.printed_losses.append((step, mean))
            parts.append(f"loss {mean:.4f}")
        for key, label, fmt in self.KEYS:
            if key in metrics:
                parts.append(f"{label} {fmt.format(float(metrics[key]))}")
        self._losses = []
        log.info(" | ".join(parts))

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        metrics = trainer.callback_metrics
        if trainer.is_global_zero and "val_loss" in metrics and not trainer.sanity_checking:
            extra = "".join(f" | {k} {float(metrics[k]):.4f}" for k in ("val_rewards/accuracies", "val_rewards/margins")
                            if k in metrics)
            log.info("step %d | val_loss %.4f%s", trainer.global_step, float(metrics["val_loss"]), extra)
