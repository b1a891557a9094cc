"""The training progress bar in optimizer steps (NxDT's unit for ``trainer.max_steps``, ``val_check_interval`` and
checkpoint intervals).

Lightning's bars count training batches, which are micro-batches under gradient accumulation, against the
smaller of the epoch's batches and the optimizer steps left, so a run with 2 micro-batches per step ended at
``360/180``; Lightning's rich bar also shows ``max_epochs: -1`` (train until ``max_steps``) as ``Epoch 0/-2``.
"""

from __future__ import annotations

import math
from typing import Any

import pytorch_lightning as pl
from pytorch_lightning.callbacks import TQDMProgressBar
from pytorch_lightning.callbacks.progress.tqdm_progress import convert_inf

__all__ = ["OptimizerStepProgressBar"]


class OptimizerStepProgressBar(TQDMProgressBar):
    """Lightning's tqdm bar, counting optimizer steps (``trainer.global_step``) instead of micro-batches.

    With ``trainer.max_steps`` > 0 the bar runs over the whole run: ``global_step / max_steps``, across epochs (a
    resumed run starts at its restored step). With ``max_steps: -1`` (epoch-bound) it counts each epoch's optimizer
    steps, ``ceil(batches per epoch / accumulate_grad_batches)``. The description is ``Epoch <e>``, with the last
    epoch index (``/<max_epochs - 1>``) only when ``max_epochs`` bounds the run. Validation bars are Lightning's.
    Arguments as :class:`~pytorch_lightning.callbacks.TQDMProgressBar`.
    """

    def __init__(self, refresh_rate: int = 1, process_position: int = 0, leave: bool = False) -> None:
        super().__init__(refresh_rate=refresh_rate, process_position=process_position, leave=leave)
        self._epoch_first_step = 0

    @staticmethod
    def _total(trainer: pl.Trainer) -> float:
        """Optimizer steps the bar counts to: ``max_steps``, else this epoch's (``inf`` for an endless loader)."""
        if trainer.max_steps is not None and trainer.max_steps > 0:
            return trainer.max_steps
        return math.ceil(trainer.num_training_batches / trainer.accumulate_grad_batches)

    def _done(self, trainer: pl.Trainer) -> int:
        """Optimizer steps done, counted like :meth:`_total`."""
        if trainer.max_steps is not None and trainer.max_steps > 0:
            return trainer.global_step
        return trainer.global_step - self._epoch_first_step

    @staticmethod
    def _description(trainer: pl.Trainer) -> str:
        bounded = trainer.max_epochs is not None and trainer.max_epochs > 0
        return f"Epoch {trainer.current_epoch}" + (f"/{trainer.max_epochs - 1}" if bounded else "")

    def on_train_start(self, trainer: pl.Trainer, *_: Any) -> None:
        """Create the bar at the optimizer steps done so far out of :meth:`_total`. A run resumed from a checkpoint
        saved inside an epoch (the usual case: ``max_steps``-bound runs have one long epoch) restarts that epoch
        without Lightning calling ``on_train_epoch_start``, so the bar is set here too (before: ``8/?``)."""
        super().on_train_start(trainer)
        # optimizer steps of this epoch done before the restore (0 on a fresh start)
        batches = trainer.fit_loop.epoch_loop.batch_progress.current.completed
        self._start_epoch_bar(trainer, batches // max(trainer.accumulate_grad_batches, 1))

    def on_train_epoch_start(self, trainer: pl.Trainer, *_: Any) -> None:
        """Reset the bar to the optimizer steps done so far out of :meth:`_total`."""
        if self._leave:
            self.train_progress_bar = self.init_train_tqdm()
        self._start_epoch_bar(trainer, 0)

    def _start_epoch_bar(self, trainer: pl.Trainer, steps_in_epoch: int) -> None:
        """Point the bar at the current epoch, of which ``steps_in_epoch`` optimizer steps are done: total
        :meth:`_total`, start :meth:`_done`, its description."""
        self._epoch_first_step = trainer.global_step - steps_in_epoch
        bar = self.train_progress_bar
        bar.reset()
        bar.total = convert_inf(self._total(trainer))
        bar.initial = self._done(trainer)
        if not bar.disable:
            bar.n = bar.initial
            bar.refresh()
        bar.set_description(self._description(trainer))

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        """Advance the bar when this micro-batch ended an optimizer step (every ``refresh_rate`` steps)."""
        bar = self.train_progress_bar
        done = self._done(trainer)
        if bar is None or bar.disable or done == bar.n or not self._should_update(done, bar.total):
            return
        bar.n = done
        bar.refresh()
        bar.set_postfix(self.get_metrics(trainer, pl_module))
