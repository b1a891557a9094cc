"""Leaving out the update of a step whose gradients are not finite (``trainer.check_for_nan_in_loss_and_grad``).

Two ways, chosen by the device (the decision itself is :class:`nxd_lc.lightning.nonfinite.NonFiniteStepGuard`'s):

* **on the host** (CPU, CUDA, Neuron eager): the step's global gradient norm is read once; when it is NaN / inf,
  :func:`skip_update` makes the coming ``optimizer.step()`` change nothing, exactly: a torch optimizer skips
  every parameter whose ``.grad`` is None (no moment decay, no weight decay, its ``step`` count unchanged), and
  :class:`~nxd_lc.optim.NxDOptimizer` skips its whole step (no master-weight write-back, no stochastic rounding
  draw on the parameters).
* **in the graph** (torch-xla: no host read on an ordinary step, DESIGN.md 16): :func:`snapshot_update_state`
  keeps references to everything the step may change (parameters, fp32 master weights, floating and device
  optimizer state) before the step; after it, :func:`select_update` puts back the old values where ``ok`` is
  false (``torch.where(ok, new, old)`` per tensor). On XLA the references are lazy graph inputs, so the select
  fuses with the update and costs no memory beyond the update itself (torch-xla's ``syncfree`` optimizers gate
  their step on ``found_inf`` the same way). What stays on the host is not rolled back: a CPU ``step`` counter
  of a torch optimizer (only with ``model.optim.capturable: false``) and the stochastic-rounding generator.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


def _unwrap(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer behind a Lightning ``LightningOptimizer`` (or the optimizer itself)."""
    return getattr(optimizer, "optimizer", optimizer)


def skip_update(optimizer: Any, params: list[torch.nn.Parameter]) -> None:
    """Make the next ``optimizer.step()`` leave ``params`` and the optimizer state exactly as they are.

    Args:
        optimizer: a torch optimizer over ``params`` or an :class:`~nxd_lc.optim.NxDOptimizer` (also wrapped in
            Lightning's ``LightningOptimizer``).
        params: the model's trainable parameters (their gradients are dropped).

    The step still runs (Lightning counts it, the LR schedule advances); gradients are cleared by the next
    ``zero_grad`` as on every step (fp32 ``main_grad`` buffers are zeroed there, so a NaN in them does not carry).
    """
    inner = _unwrap(optimizer)
    if hasattr(inner, "skip_next_step"):
        inner.skip_next_step = True
    for p in params:
        p.grad = None


@dataclass
class UpdateSnapshot:
    """Values of the tensors a step may change, taken before it (see :func:`snapshot_update_state`).

    Attributes:
        tensors: ``(parameter, value before the step)`` for the model's parameters and persistent master
            weights (updated in place by the step).
        state: ``{(index of the state's key in the optimizer's params, state name): value before the step}`` for
            every floating / device state tensor; keys absent before the step (state created by it) are
            restored to zeros.
    """

    tensors: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    state: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)


def _state_keys(inner: torch.optim.Optimizer) -> list[Any]:
    """The optimizer's parameters in group order (the keys of ``inner.state``)."""
    return [p for g in inner.param_groups for p in g["params"]]


def _gated(value: Any, device: torch.device) -> bool:
    """A state entry the select can restore: a tensor on the parameters' device (host counters cannot)."""
    return torch.is_tensor(value) and value.device == device


def snapshot_update_state(optimizer: Any, params: list[torch.nn.Parameter]) -> UpdateSnapshot:
    """References to the values ``optimizer.step()`` may change, for :func:`select_update` (in-graph path).

    On XLA these are lazy values (no copy is made until the graph runs, and then only if the select needs the
    old value, which it does inside the fused update). Do not call this on an eager device: there every
    reference is a full copy (parameters + master weights + state), which is why eager devices skip on the host
    (:func:`skip_update`).

    Args:
        optimizer: as :func:`skip_update`.
        params: the model's trainable parameters.
    """
    inner = _unwrap(optimizer)
    snap = UpdateSnapshot()
    tensors: list[torch.Tensor] = list(params)
    slots = getattr(inner, "slots", None)
    if slots is not None and getattr(inner, "persistent", False):  # NxDOptimizer's fp32 master weights
        tensors += [s.work for s in slots]
    snap.tensors = [(t, t.detach().clone()) for t in tensors]
    for i, key in enumerate(_state_keys(inner)):
        for name, value in inner.state.get(key, {}).items():
            if _gated(value, key.device):
                snap.state[(i, name)] = value.detach().clone()
    return snap


@torch.no_grad()
def select_update(ok: torch.Tensor, optimizer: Any, snap: UpdateSnapshot) -> None:
    """Keep the step's new values where ``ok`` holds, else put back the values of ``snap`` (in place).

    Args:
        ok: 0-dim bool tensor on the parameters' device, the same on every rank.
        optimizer: the optimizer the snapshot was taken of.
        snap: from :func:`snapshot_update_state`, taken after the gradients were computed and before the step.
    """
    inner = _unwrap(optimizer)
    for t, old in snap.tensors:
        if t.numel() == old.numel():  # bf16SR working tensors are freed after the step (numel 0): nothing to keep
            t.data.copy_(torch.where(ok, t.data, old.view_as(t)))
    for i, key in enumerate(_state_keys(inner)):
        state = inner.state.get(key)
        if not state:
            continue
        for name, value in list(state.items()):
            if not _gated(value, key.device):
                continue
            old = snap.state.get((i, name))
            old = torch.zeros_like(value) if old is None else old.to(value.dtype)
            state[name] = torch.where(ok, value, old)
