"""A step whose loss or gradients are NaN / inf is not applied; the run stops after N in a row.

Keys: ``trainer.check_for_nan_in_loss_and_grad``, ``trainer.max_consecutive_nonfinite_steps``.

The signal is the step's global gradient norm (:func:`nxd_lc.distributed.grads.global_grad_norm`), computed after
the gradients are reduced and before clipping. It is the same number on every rank (all-reduced over the model-
and data-parallel groups), so every rank takes the same decision and the replicas stay equal. A non-finite loss
reaches it too: the loss's backward multiplies every gradient by values derived from it, so a NaN / inf loss
gives a non-finite gradient (tests/test_nonfinite_step.py injects both).

What happens at a non-finite step (Megatron's ``check_for_nan_in_loss_and_grad`` stops at the first one; a
loss scaler skips and goes on; ``trainer.max_consecutive_nonfinite_steps`` spans the two):

* its optimizer update is not applied: parameters, master weights and optimizer state stay as before the step
  (:mod:`nxd_lc.optim.nonfinite`); its batch counts as consumed and the LR schedule advances (they follow the step
  count, the same on every device type);
* after ``max_consecutive_nonfinite_steps`` non-finite steps in a row (default 1) the run raises
  :class:`NonFiniteTrainingError` naming the steps, so the job exits non-zero and no checkpoint of the state after
  them is written (a save in between is refused the same way; the previous checkpoint stays the newest).

CPU and CUDA read the norm on the host once per step and raise at the step itself. On torch-xla and on TorchNeuron's
native device (eager, but a host read waits for the device: measured on the stand-in device of the tests, it was the
one device-to-host read of an ordinary step) no step reads the host (DESIGN.md 16): the decision is made in the
step's graph (the update is selected away, consecutive counts kept on the device, and once the limit is reached no
further update is applied); the host reads the counters where it reads the device anyway (logging steps:
``trainer.log_every_n_steps``, a checkpoint save, the last step) and raises there, naming the steps where it
happened. The run therefore stops at most ``log_every_n_steps - 1`` steps later there, with the weights of the last
finite step.

Under ``neuron_parallel_compile`` (``NEURON_EXTRACT_GRAPHS_ONLY`` set: :func:`nxd_lc.runtime.prewarm.
extracting_graphs`) every value read back is garbage or zeros, so the host side decides nothing: the eager host
decision and :meth:`NonFiniteStepGuard.check` do nothing. The in-graph selection is still traced, so the graphs
extracted are the training run's.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch

from nxd_lc.optim.nonfinite import UpdateSnapshot, select_update, skip_update, snapshot_update_state
from nxd_lc.runtime.accel import NEURON_DEVICE_TYPE
from nxd_lc.runtime.prewarm import extracting_graphs

log = logging.getLogger(__name__)


class NonFiniteTrainingError(RuntimeError):
    """Raised when ``trainer.max_consecutive_nonfinite_steps`` optimizer steps in a row had a NaN / inf loss or
    gradient norm. ``first_step`` / ``last_step``: 1-based optimizer steps of that run of steps."""

    def __init__(self, first_step: int, last_step: int, limit: int, skipped_total: int) -> None:
        self.first_step, self.last_step = first_step, last_step
        steps = f"step {last_step}" if first_step == last_step else f"steps {first_step}-{last_step}"
        super().__init__(
            f"trainer.check_for_nan_in_loss_and_grad: the loss / gradient norm was NaN or infinite at optimizer "
            f"{steps} ({last_step - first_step + 1} in a row; trainer.max_consecutive_nonfinite_steps = {limit}; "
            f"{skipped_total} update(s) skipped in this run). Their updates were not applied and the run stops "
            f"here; the newest checkpoint is the last finite state. Look at the data of those steps, lower "
            f"model.optim.lr, set trainer.gradient_clip_val, or raise trainer.max_consecutive_nonfinite_steps to "
            f"skip such steps and go on")


class NonFiniteStepGuard:
    """Skips non-finite optimizer steps and stops the run after ``limit`` in a row (module docstring).

    Args:
        limit: ``trainer.max_consecutive_nonfinite_steps`` (>= 1).

    Use: :meth:`before_step` between the gradient reduction and the optimizer step, :meth:`after_step` right
    after the step, :meth:`check` where the host reads device values anyway (XLA, native Neuron; a no-op
    elsewhere).
    """

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"trainer.max_consecutive_nonfinite_steps must be >= 1, got {limit}")
        self.limit = int(limit)
        self.in_graph: Optional[bool] = None  # decided by the device of the first norm
        # host path
        self.run = 0
        self.skipped = 0
        # in-graph path: 0-dim device tensors
        self._step_t: Optional[torch.Tensor] = None  # 1-based index of the step being computed (int64)
        self._run_t: Optional[torch.Tensor] = None  # non-finite steps in a row up to the last step (int64)
        self._trip_t: Optional[torch.Tensor] = None  # step at which the run reached the limit, -1 while not (int64)
        self._skipped_t: Optional[torch.Tensor] = None  # updates not applied so far (int64)
        self._ok: Optional[torch.Tensor] = None
        self._snap: Optional[UpdateSnapshot] = None
        self._reported_skips = 0
        self._calls = 0

    def before_step(self, norm: torch.Tensor, step: Optional[int], optimizer: Any,
                    params: list[torch.nn.Parameter]) -> None:
        """Decide about the coming optimizer step from its global gradient ``norm`` (0-dim, same on all ranks).

        Args:
            norm: the step's global gradient norm, before clipping.
            step: 1-based index of the optimizer step being computed (``trainer.global_step + 1``); None: count
                the calls (a module stepped without a Trainer).
            optimizer: the optimizer about to step.
            params: the model's trainable parameters.

        Raises:
            NonFiniteTrainingError: (eager devices) this step completes ``limit`` non-finite steps in a row.
        """
        self._calls += 1
        step = self._calls if step is None else step
        if self.in_graph is None:  # lazy XLA graphs, and TorchNeuron's device (a host read waits for the device)
            self.in_graph = norm.device.type in ("xla", NEURON_DEVICE_TYPE)
        if not self.in_graph:
            if not extracting_graphs():  # under neuron_parallel_compile the norm read back is not real
                self._host_decision(bool(torch.isfinite(norm)), step, optimizer, params)
            return
        dev = norm.device
        if self._step_t is None:
            self._step_t = torch.tensor(step, dtype=torch.int64, device=dev)  # one upload per run (or resume)
            self._run_t = torch.zeros((), dtype=torch.int64, device=dev)
            self._trip_t = torch.full((), -1, dtype=torch.int64, device=dev)
            self._skipped_t = torch.zeros((), dtype=torch.int64, device=dev)
        else:
            self._step_t = self._step_t + 1
        bad = ~torch.isfinite(norm)
        self._run_t = torch.where(bad, self._run_t + 1, torch.zeros_like(self._run_t))
        trip = bad & (self._run_t >= self.limit) & (self._trip_t < 0)
        self._trip_t = torch.where(trip, self._step_t, self._trip_t)
        self._ok = ~bad & (self._trip_t < 0)  # once the limit is reached nothing is applied until the host stops
        self._skipped_t = self._skipped_t + (~self._ok).to(torch.int64)
        self._snap = snapshot_update_state(optimizer, params)

    def _host_decision(self, finite: bool, step: int, optimizer: Any, params: list[torch.nn.Parameter]) -> None:
        if finite:
            self.run = 0
            return
        self.run += 1
        self.skipped += 1
        skip_update(optimizer, params)
        if self.run >= self.limit:
            raise NonFiniteTrainingError(step - self.run + 1, step, self.limit, self.skipped)
        log.warning("optimizer step %d: the loss / gradient norm is NaN or infinite; its update is not applied "
                    "(%d in a row, the run stops at %d: trainer.max_consecutive_nonfinite_steps)",
                    step, self.run, self.limit)

    def after_step(self, optimizer: Any) -> None:
        """In-graph path: keep the step's update only where it was finite (a no-op on eager devices)."""
        if self._snap is None or self._ok is None:
            return
        select_update(self._ok, optimizer, self._snap)
        self._snap = None  # drop the lazy references before the graph is cut (they would become graph outputs)
        self._ok = None

    def check(self) -> None:
        """In-graph path: read the counters (a device-to-host transfer: call it only where the host reads the
        device anyway) and raise when the limit was reached; warn about updates skipped since the last check.

        Does nothing under ``neuron_parallel_compile`` (module docstring: the counters read back are not real).

        Raises:
            NonFiniteTrainingError: ``limit`` non-finite steps in a row happened.
        """
        if not self.in_graph or self._trip_t is None or extracting_graphs():
            return
        # two transfers of values the step's graph already computed (a stack would be a new graph to compile)
        trip, skipped = int(self._trip_t.cpu()), int(self._skipped_t.cpu())
        if trip >= 0:
            raise NonFiniteTrainingError(trip - self.limit + 1, trip, self.limit, skipped)
        if skipped > self._reported_skips:
            log.warning("%d optimizer update(s) with a NaN / infinite loss or gradient norm were not applied so far "
                        "(fewer than trainer.max_consecutive_nonfinite_steps = %d in a row)", skipped, self.limit)
            self._reported_skips = skipped
