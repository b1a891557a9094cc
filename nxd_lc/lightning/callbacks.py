"""Lightning callbacks: NxD-layout checkpointing, throughput logging, and loggers kept in step with checkpoints."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any, Callable, Optional

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.core.saving import save_hparams_to_yaml
from pytorch_lightning.loggers import TensorBoardLogger
from pytorch_lightning.utilities import rank_zero_only

from nxd_lc.checkpoint import sharded
from nxd_lc.checkpoint.xser import load_structure
from nxd_lc.config.schema import CheckpointCallbackParams

log = logging.getLogger("nxd_lc.metrics")
_ckpt_log = logging.getLogger(__name__)


class NxDModelCheckpoint(ModelCheckpoint):
    """Lightning's ModelCheckpoint writing checkpoint *directories* ``<dirpath>/<tag>`` (no ``.ckpt`` suffix).

    Top-k bookkeeping, ``monitor``/``mode``, ``save_last``, ``every_n_train_steps`` and the filename pattern
    (``{step}``, ``{consumed_samples}``) are Lightning's; the strategy (:class:`NxDStrategy`) turns each save into
    NxD's sharded layout and each removal into an atomic directory removal.
    """

    FILE_EXTENSION = ""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._remove_after_next_save: list[str] = []  # see _reconcile_top_k

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
        """After a resume: do not re-save the step that was just restored, and bring the top-k list in line with
        the checkpoints on disk (:meth:`_reconcile_top_k`).

        Lightning calls ``on_train_batch_end`` for every micro-batch; with gradient accumulation the first
        micro-batches after a resume still see the restored ``global_step``, and the base class (whose
        "last saved step" is not part of its state) would write that step again under a different name.
        """
        super().on_train_start(trainer, pl_module)
        self._last_global_step_saved = trainer.global_step
        self._reconcile_top_k(trainer)

    def _save_checkpoint(self, trainer: pl.Trainer, filepath: str) -> None:
        """Lightning's save, then the removal of a checkpoint that :meth:`_reconcile_top_k` left in place only
        because the run resumed from it (now that a newer checkpoint exists; deferred until that one is published
        under ``async_checkpointing``)."""
        super()._save_checkpoint(trainer, filepath)
        pending, self._remove_after_next_save = self._remove_after_next_save, []
        for path in pending:
            if os.path.abspath(path) != os.path.abspath(filepath):
                self._remove_checkpoint(trainer, path)

    def _recorded_score(self, tag_dir: str, max_step: int) -> Optional[torch.Tensor]:
        """The monitor value this callback recorded for checkpoint ``tag_dir`` when it saved it, or None.

        Read from the checkpoint's own ``user_content.pt``: the state of a ModelCheckpoint with the same
        ``monitor`` whose ``best_k_models`` lists this checkpoint's name (so it was saved as one of the top k into
        a directory of that name), and only when its ``global_step`` is at most ``max_step`` (the run being
        resumed, up to the checkpoint resumed from). Anything else (another writer, a copy under another name,
        unreadable) gives None.
        """
        try:
            content = load_structure(os.path.join(tag_dir, sharded.USER_CONTENT_FILE))  # restricted unpickler
        except Exception as e:  # noqa: BLE001 - an unreadable checkpoint is simply not adopted
            _ckpt_log.info("save_top_k: not counting %s (user_content unreadable: %s)", tag_dir, e)
            return None
        step = content.get("global_step") if isinstance(content, dict) else None
        if not isinstance(step, int) or step > max_step:
            return None
        name = os.path.basename(tag_dir)
        for state in (content.get("callbacks") or {}).values():
            if isinstance(state, dict) and state.get("monitor") == self.monitor:
                for path, score in (state.get("best_k_models") or {}).items():
                    if os.path.basename(str(path)) == name:
                        return torch.as_tensor(score)
        return None

    def _top_k_plan(self, trainer: pl.Trainer) -> tuple[dict[str, torch.Tensor], list[str], list[str]]:
        """Global rank 0's part of :meth:`_reconcile_top_k`: ``(top k, remove now, remove after the next save)``."""
        assert self.dirpath is not None
        dirpath = os.path.abspath(self.dirpath)
        resumed = os.path.abspath(trainer.ckpt_path) if trainer.ckpt_path else None
        last = os.path.abspath(self.last_model_path) if self.last_model_path else None
        known = {os.path.abspath(p): v for p, v in self.best_k_models.items() if os.path.isdir(p)}
        if resumed is not None and os.path.dirname(resumed) == dirpath:  # a continuation of this run
            for tag in sharded.list_checkpoints(dirpath):
                path = os.path.join(dirpath, tag)
                if path not in known and path != last:
                    score = self._recorded_score(path, trainer.global_step)
                    if score is not None:
                        known[path] = score
        ranked = sorted(known, key=lambda p: float(known[p]), reverse=self.mode == "max")
        keep, drop = ranked[:self.save_top_k], ranked[self.save_top_k:]
        return ({p: known[p] for p in keep}, [p for p in drop if p != resumed], [p for p in drop if p == resumed])

    def _reconcile_top_k(self, trainer: pl.Trainer) -> None:
        """Collective: make ``save_top_k`` hold across restarts.

        The top-k list restored from the checkpoint resumed from misses checkpoints whose removal was lost (a crash
        between publishing a checkpoint and removing the one it displaced, removals deferred by an asynchronous save
        that never finished), Lightning drops the list when the run directory was moved, and a smaller
        ``save_top_k`` than the saved run's is never enforced. Global rank 0 adds every complete checkpoint in
        ``dirpath`` that an earlier part of this run saved as a top-k checkpoint (its score read from its own
        ``user_content.pt``, :meth:`_recorded_score`), ranks them all by ``monitor``/``mode``, removes those
        beyond ``save_top_k`` and broadcasts the result. The checkpoint resumed from is never removed here: if it
        falls outside the top k it is removed after the next checkpoint is saved. Nothing happens on a fresh start
        (no checkpoint restored), without a ``monitor`` or with ``save_top_k`` -1 (keep all) or 0.
        """
        if trainer.ckpt_path is None or self.monitor is None or self.save_top_k <= 0 or self.dirpath is None:
            return
        plan = self._top_k_plan(trainer) if trainer.is_global_zero else None
        top, remove_now, remove_later = trainer.strategy.broadcast(plan, src=0)
        self.best_k_models = dict(top)
        self._remove_after_next_save = list(remove_later)
        if top:
            worst, best = (min, max) if self.mode == "max" else (max, min)
            if len(top) == self.save_top_k:
                self.kth_best_model_path = worst(top, key=lambda p: float(top[p]))
                self.kth_value = top[self.kth_best_model_path]
            self.best_model_path = best(top, key=lambda p: float(top[p]))
            self.best_model_score = top[self.best_model_path]
        for path in remove_now:
            if trainer.is_global_zero:
                _ckpt_log.warning("save_top_k=%d: removing %s, left over beyond the top %d by %s (e.g. a crash "
                                  "before its removal)", self.save_top_k, path, self.save_top_k, self.monitor)
            self._remove_checkpoint(trainer, path)


def write_step_metrics(trainer: pl.Trainer) -> None:
    """Hand the values logged in the optimizer step that just ended to the loggers now, not after the step's hooks.

    Lightning writes a step's logged values only after every ``on_train_batch_end`` hook has run
    (``_TrainingEpochLoop.advance``: callbacks, then ``update_train_step_metrics``), so a checkpoint saved and
    published in that hook is on disk before the scalars of its own step are written: a crash in between loses them
    for good (the restart resumes after that step). Called before a checkpoint is published, this writes them first,
    exactly as Lightning would (same values, same TensorBoard step, only at ``log_every_n_steps`` steps and the last
    step, ``trainer.max_steps``, and not inside a gradient-accumulation window); :class:`NxDTensorBoardLogger` drops
    Lightning's identical second write. Outside
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
    if connector.should_update_logs or 0 < trainer.max_steps <= trainer.global_step:
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
    """Lightning's TensorBoardLogger writing each (metric, step, value) once, and ``hparams.yaml`` per launch.

    :func:`write_step_metrics` writes a step's values before a checkpoint is published and Lightning writes the
    same values again moments later; the repeat is dropped so that TensorBoard shows one point per metric and step.
    A different value for a metric at a step already written is still written (nothing logged is ever dropped).

    Lightning writes ``hparams.yaml`` only when the file does not exist yet, so a resumed run kept the first
    launch's (``{}`` before the config was logged); here the first :meth:`save` of each launch rewrites it with the
    hyperparameters logged (:func:`~nxd_lc.lightning.exp_manager.build_loggers`: the resolved config).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._last_written: dict[str, tuple[Optional[int], str]] = {}  # metric -> (step, repr(value)) last written
        self._hparams_saved = False

    @rank_zero_only
    def save(self) -> None:
        """Lightning's save (flushes the events), then, once per launch, ``<log_dir>/hparams.yaml`` rewritten with
        the logged hyperparameters (global rank 0)."""
        super().save()
        if not self._hparams_saved and self.hparams and os.path.isdir(self.log_dir):
            save_hparams_to_yaml(os.path.join(self.log_dir, self.NAME_HPARAMS_FILE), self.hparams)
            self._hparams_saved = True

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
        schedule: optional ``step -> (global_batch_size, seq_length)`` of optimizer step ``step`` (a
            ``data.curriculum`` changes both between stages); overrides the two constants.
    """

    def __init__(self, global_batch_size: int, seq_length: int,
                 schedule: Optional[Callable[[int], tuple[int, int]]] = None) -> None:
        self.global_batch_size = global_batch_size
        self.seq_length = seq_length
        self.schedule = schedule
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
            batch, seq = self.schedule(step - 1) if self.schedule else (self.global_batch_size, self.seq_length)
            seqs = batch / dt
            self.last_tokens_per_sec = seqs * seq
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
