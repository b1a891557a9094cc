"""Preemption-safe training: signals set a flag; at the next step boundary all ranks agree, save, and stop.

What SLURM (``--signal=USR1@90``, then SIGTERM before a preemption/requeue), Kubernetes (SIGTERM) and a user's
Ctrl-C (SIGINT) send must never be handled inside the signal handler: a handler runs between two bytecodes of
whatever the main thread was doing, possibly inside a tensor-parallel collective, and Lightning's own SIGTERM
handler issues a collective there (a hang when the other rank is inside a TP collective). So
:class:`PreemptionCallback` replaces the handlers for ``exp_manager.preemption_signals`` by one that only sets a
flag. At every optimizer-step boundary (``on_train_batch_end`` after ``global_step`` advanced) all ranks take one
small host vote (:func:`nxd_lc.distributed.collectives.world_max`; on torch-xla through the process group's
key-value store, so the vote never reads a device tensor and the host does not wait for the device) over

* "a preemption signal arrived here",
* "my torchrun parent died" (``os.getppid()`` changed: the worker was re-parented; parent-death detection),
* "my asynchronous checkpoint write is still running" (:mod:`nxd_lc.lightning.strategy`, ``async_checkpointing``).

When the vote says a signal arrived (on any rank) or a parent died, every rank waits for an asynchronous save in
flight, saves a complete checkpoint of the step just finished (through the checkpoint callback: its name pattern,
top-k bookkeeping and atomic publication), and sets ``trainer.should_stop``; ``train.py`` then returns and every
process exits with status ``128 + signum`` (:attr:`PreemptionCallback.exit_status`: 143 for SIGTERM, so that every
torchrun agent stops at once instead of waiting at its exit barrier for the agent the signal reached). The work
lost is therefore at most the step that was running when the signal arrived; the time to
exit is the rest of that step plus one save (the README lists measured figures). A second SIGINT raises
``KeyboardInterrupt`` at once (for a user who does not want to wait).

Before training starts (configuration, tokenizer training, packing, model build, checkpoint restore) there is no
step boundary to wait for and nothing to save: the handlers then raise :class:`StartupInterrupted` at once, so the
run stops within seconds (torchrun would otherwise SIGKILL the workers after its grace period). Every cache written
during start-up goes to a temporary path published by one ``os.replace`` (:func:`nxd_lc.data.tokenizer.build_once`
and the cache writers), and the temporary path is removed as the exception unwinds, so nothing is left half
written. From ``on_train_start`` on, the handlers only set the flag.

The same vote also tells when an asynchronous save has been written by every rank, so that it is published at the
first step boundary after that (see :meth:`nxd_lc.lightning.strategy.NxDStrategy.publish_async_save`).

Lightning's own SIGTERM path (its handler sets ``trainer.received_sigterm``; its training-epoch loop broadcasts rank
0's flag as a device tensor and reads it back with ``.item()`` before every micro-batch of a distributed run) is
dead weight once SIGTERM is ours: the flag never becomes true, yet on torch-xla every micro-batch costs a graph
execution and a host read. :class:`StepBoundaryEpochLoop` is Lightning's loop without that broadcast;
:func:`nxd_lc.lightning.trainer.build_trainer` installs it on the Trainer when SIGTERM is among
``exp_manager.preemption_signals`` (:attr:`PreemptionCallback.owns_sigterm`). Without SIGTERM there (e.g. ``[]``),
Lightning's handler is in charge of SIGTERM and its broadcast stays: the handler's own broadcast on rank 0 is matched
by the loop's on the other ranks.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from types import FrameType
from typing import Any, Callable, Optional, Union

import pytorch_lightning as pl
from pytorch_lightning.loops.training_epoch_loop import _TrainingEpochLoop

from nxd_lc.distributed import collectives
from nxd_lc.runtime import faults

log = logging.getLogger(__name__)

#: signals ``exp_manager.preemption_signals`` may name
PREEMPTION_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT", "SIGHUP")
_Handler = Union[Callable[[int, Optional[FrameType]], Any], int, None]


class StartupInterrupted(BaseException):
    """A preemption signal arrived before the first training step (nothing to save): raised by the handler of
    :class:`PreemptionCallback` until ``on_train_start``. A ``BaseException`` like ``KeyboardInterrupt``, so no
    ``except Exception`` on the way swallows it; ``train.py`` exits with status ``128 + signum``.

    Attributes:
        signum: the signal number that arrived.
    """

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(f"{signal.Signals(signum).name} before the first training step: stopped (no step was taken, "
                         "nothing to save)")


def signal_numbers(names: list[str]) -> list[int]:
    """Signal numbers of ``names`` (e.g. ``["SIGTERM", "SIGUSR1"]``).

    Raises:
        ValueError: a name outside :data:`PREEMPTION_SIGNALS` (names the key ``exp_manager.preemption_signals``).
    """
    bad = [n for n in names if n not in PREEMPTION_SIGNALS]
    if bad:
        raise ValueError(f"exp_manager.preemption_signals: {bad} not allowed; choose from {list(PREEMPTION_SIGNALS)}")
    return [int(getattr(signal, n)) for n in names]


class PreemptionCallback(pl.Callback):
    """Flag-only signal handlers, parent-death detection and the per-step vote (see the module docstring).

    Args:
        signals: signal names that request a checkpoint-and-exit (``exp_manager.preemption_signals``).
        save: called on every rank with the trainer to save a complete checkpoint of the current step
            (collective); None (no checkpoint callback) stops without saving and warns.
    """

    def __init__(self, signals: list[str], save: Optional[Callable[[pl.Trainer], None]] = None) -> None:
        self.signums = signal_numbers(signals)
        self.save = save
        self.received: Optional[int] = None  # signal number that arrived on this rank
        self.stopped_for: Optional[str] = None  # why training was stopped (after the vote), for the log / tests
        self.stop_signum: Optional[int] = None  # the agreed signal (the largest voted; SIGHUP for a dead launcher)
        self._sigint_count = 0
        self._previous: dict[int, _Handler] = {}
        self._ppid = os.getppid()
        self._last_step = -1
        self._signal_time: Optional[float] = None
        self._training = False  # until on_train_start a signal stops the run at once (StartupInterrupted)
        self._warned_thread = False

    # ---------------------------------------------------------------- handlers
    def _handler(self, signum: int, frame: Optional[FrameType]) -> None:
        """Runs inside the signal: set the flag, nothing else (no I/O beyond a log line, no collective); before
        training started, raise :class:`StartupInterrupted` instead (nothing to save, no collective in flight that
        a step boundary would wait for)."""
        if not self._training:
            self.received = signum
            raise StartupInterrupted(signum)
        if signum == signal.SIGINT:
            self._sigint_count += 1
            if self._sigint_count > 1:
                raise KeyboardInterrupt
        if self.received is None:
            self.received = signum
            self._signal_time = time.monotonic()

    @property
    def exit_status(self) -> int:
        """The process's exit status after training: 0, or ``128 + signum`` on every rank once a preemption stop
        was agreed (the signal any rank received; SIGHUP when the launcher died). Not 0 after a preemption save:
        a torchrun agent whose workers all exit 0 waits up to 300 s at its exit barrier for the other nodes'
        agents, and the agent the signal reached has already gone; a failed worker makes every agent stop at once.
        SLURM and Kubernetes read it as the signal that stopped the job."""
        return 0 if self.stop_signum is None else 128 + self.stop_signum

    @property
    def owns_sigterm(self) -> bool:
        """True when SIGTERM is among the handled signals: from ``on_train_start`` on this callback's handler
        replaces Lightning's, so ``trainer.received_sigterm`` never becomes true (:class:`StepBoundaryEpochLoop`)."""
        return int(signal.SIGTERM) in self.signums

    def install(self) -> None:
        """Install the flag-only handlers, remembering the handlers found the first time.

        Called as early as possible in a run (``train.py``, before the data and model are built, so that a signal
        during start-up stops the run at once: :class:`StartupInterrupted`) and again at ``on_train_start``, after
        Lightning's signal connector registered its own SIGTERM handler (which would run a collective inside the
        handler), from where on a signal only sets the flag for the next step boundary.

        Python delivers signals to the main thread only: called from another thread (a run inside a worker thread,
        the multi-device XLA test bed's device threads) it installs nothing and warns once, as Lightning's signal
        connector does; the step-boundary vote still runs (parent death, asynchronous saves).
        """
        if threading.current_thread() is not threading.main_thread():
            if self.signums and not self._warned_thread:
                self._warned_thread = True
                log.warning("preemption signal handlers not installed: signals reach only the main thread, and this "
                            "run is in thread %r (exp_manager.preemption_signals has no effect here)",
                            threading.current_thread().name)
            return
        for s in self.signums:
            if s not in self._previous:
                self._previous[s] = signal.getsignal(s)
            signal.signal(s, self._handler)

    def restore(self) -> None:
        """Put back the handlers found by :meth:`install`."""
        for s, h in self._previous.items():
            signal.signal(s, h if h is not None else signal.SIG_DFL)
        self._previous = {}

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Install after Lightning's signal connector registered its handlers (it does so before this hook)."""
        self._last_step = trainer.global_step
        self._training = True
        self.install()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """An asynchronous save still in flight is written and published before training ends."""
        self._finish_async(trainer)
        self.restore()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        """On a crash: let an asynchronous write finish (never published: no collective here) and restore."""
        wait = getattr(trainer.strategy, "wait_async_write", None)
        if wait is not None:
            wait()
        self.restore()

    # ---------------------------------------------------------------- step boundary
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        """Fault-injection point ``mid_step`` (:mod:`nxd_lc.runtime.faults`; nothing unless NXD_LC_FAULT is set)."""
        faults.inject("mid_step", trainer.global_step + 1)

    def parent_died(self) -> bool:
        """True when this process was re-parented since the callback was created (its launcher died)."""
        return os.getppid() != self._ppid

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        """At an optimizer-step boundary: vote, publish a finished async save, and save + stop on preemption."""
        if trainer.global_step == self._last_step:  # inside a gradient-accumulation step
            return
        self._last_step = trainer.global_step
        strategy = trainer.strategy
        writing = bool(getattr(strategy, "async_write_running", lambda: False)())
        signalled, orphaned, busy = collectives.world_max(
            [self.received or 0, self.parent_died(), writing], tag="nxd_lc_step_vote")
        if not busy and getattr(strategy, "async_save_pending", lambda: False)():
            strategy.publish_async_save()
        if not (signalled or orphaned):
            return
        self.stopped_for = "preemption signal" if signalled else "launcher (torchrun) died"
        self.stop_signum = int(signalled) if signalled else int(signal.SIGHUP)
        name = signal.Signals(self.received).name if self.received is not None else "another rank's signal"
        log.warning("rank %d: %s (%s) at step %d: saving a checkpoint and stopping", trainer.global_rank,
                    self.stopped_for,
                    name if signalled else f"parent pid {self._ppid} gone", trainer.global_step)
        self._finish_async(trainer)
        if self.save is None:
            log.warning("no checkpoint callback (exp_manager.create_checkpoint_callback: false): stopping without "
                        "a checkpoint; the work since the start is lost")
        else:
            self.save(trainer)
        trainer.should_stop = True
        if self._signal_time is not None and trainer.is_global_zero:
            log.warning("preemption checkpoint of step %d saved %.1f s after the signal", trainer.global_step,
                        time.monotonic() - self._signal_time)

    @staticmethod
    def _finish_async(trainer: pl.Trainer) -> None:
        finish = getattr(trainer.strategy, "finish_async_save", None)
        if finish is not None:
            finish()


class StepBoundaryEpochLoop(_TrainingEpochLoop):
    """Lightning's training-epoch loop without its per-micro-batch SIGTERM broadcast.

    Lightning (since its PR #20825; 2.6.6 in both venvs) calls ``_broadcast_sigterm_tensor`` before every training
    batch of a distributed run: rank 0's ``received_sigterm`` as a one-element tensor on the strategy's device,
    ``torch.distributed.broadcast``, then ``.item()``. On torch-xla that is a graph execution and a device-to-host
    read per micro-batch (the host waits for the device before it can trace the next micro-batch); on CUDA a device
    synchronisation. When :class:`PreemptionCallback` handles SIGTERM (:attr:`PreemptionCallback.owns_sigterm`)
    Lightning's flag never becomes true during training and the step-boundary vote tells every rank, so the
    broadcast carries nothing.
    Installed per Trainer by :func:`nxd_lc.lightning.trainer.build_trainer` (Lightning's own loop is replaced,
    ``trainer.fit_loop.epoch_loop = ...``, with the same step limits); a test pins the private method's name.
    """

    def _broadcast_sigterm_tensor(self) -> None:
        """Nothing to broadcast: SIGTERM is :class:`PreemptionCallback`'s, agreed on at the step boundary."""


def install_step_boundary_epoch_loop(trainer: pl.Trainer) -> bool:
    """Replace ``trainer``'s training-epoch loop by :class:`StepBoundaryEpochLoop` (same ``min_steps`` /
    ``max_steps``), before ``fit``. Returns False, and changes nothing, when this Lightning has no
    ``_TrainingEpochLoop._broadcast_sigterm_tensor`` (older 2.x releases have no per-batch broadcast to skip; a
    newer Lightning that renamed it fails ``tests/test_xla_host_reads.py``'s pin test)."""
    if not callable(getattr(_TrainingEpochLoop, "_broadcast_sigterm_tensor", None)):
        log.info("this Lightning has no _TrainingEpochLoop._broadcast_sigterm_tensor: its training loop is kept")
        return False
    old = trainer.fit_loop.epoch_loop
    trainer.fit_loop.epoch_loop = StepBoundaryEpochLoop(trainer, min_steps=old.min_steps, max_steps=old.max_steps)
    return True


def checkpoint_callback_saver(callback: Any) -> Callable[[pl.Trainer], None]:
    """A ``save`` for :class:`PreemptionCallback` through Lightning's ``ModelCheckpoint`` ``callback``.

    The checkpoint gets the callback's name pattern and enters its top-k bookkeeping (so ``save_top_k`` still
    holds); when the monitor would not keep it (a metric monitor on which this step is not among the best k), it
    is saved all the same: a preemption checkpoint is for resuming, and the newest by step is what
    ``resume_if_exists`` picks. A step already saved (a periodic save at this very step) is not saved again.
    """
    def save(trainer: pl.Trainer) -> None:
        if callback._last_global_step_saved == trainer.global_step:
            return
        candidates = callback._monitor_candidates(trainer)
        callback._save_topk_checkpoint(trainer, candidates)
        if callback._last_global_step_saved != trainer.global_step:
            trainer.save_checkpoint(callback.format_checkpoint_name(candidates))
            callback._last_global_step_saved = trainer.global_step
        callback._save_last_checkpoint(trainer, candidates)

    return save
