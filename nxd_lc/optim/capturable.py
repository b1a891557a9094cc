"""Adam / AdamW with ``model.optim.capturable: true`` on torch-xla devices, finite at learning rate 0.

torch's capturable Adam, one tensor at a time (``torch.optim.adam._single_tensor_adam``: the path torch takes on
``xla`` devices, whose foreach capturable kernels it does not support), folds the step size into the denominator::

    denom = exp_avg_sq.sqrt() / (bias_correction2_sqrt * -step_size) + eps / -step_size
    param.addcdiv_(exp_avg, denom)

At ``lr == 0`` an element whose second moment is 0 (a gradient that has been exactly 0: embedding rows of tokens
not yet seen, the padded vocabulary, a dropped expert) gets ``0 / -0 = NaN`` in ``denom`` and the parameter becomes
NaN (pytorch/pytorch#126514, torch 2.9 to 2.13 at least; fixed upstream in pull request #186444). NxDT's examples hit
it on their first step: Megatron's linear warm-up (``CosineAnnealing`` with ``constant_steps``) starts at lr 0, and
the Megatron / Mixtral files set ``capturable: True``. torch's foreach path (CUDA, native Neuron) is not affected.

:class:`CapturableAdamW` / :class:`CapturableAdam` are torch's classes (same constructor, parameter groups and
state, so checkpoints load either way) whose :meth:`step` adds ``eps`` before folding in the step size, as the
upstream fix does: ``denom = (sqrt(v) / sqrt(bc2) + eps) / -step_size``, so lr 0 gives ``exp_avg / -inf = 0``
and no NaN. The step count stays a device tensor (no host read, the point of ``capturable``); the update equals
torch's non-capturable one up to float rounding.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

__all__ = ["CapturableAdam", "CapturableAdamW", "needs_finite_capturable_adam"]

#: device types on which torch runs capturable Adam one tensor at a time (no foreach capturable kernels)
SINGLE_TENSOR_CAPTURABLE_DEVICES = frozenset({"xla"})


def needs_finite_capturable_adam(params: list[torch.Tensor]) -> bool:
    """True when a capturable torch Adam over ``params`` would take the single-tensor path (module docstring)."""
    return any(p.device.type in SINGLE_TENSOR_CAPTURABLE_DEVICES for p in params)


class _FiniteCapturableStep:
    """The Adam step of the module docstring, for a ``torch.optim.Adam`` subclass built with ``capturable=True``."""

    param_groups: list[dict[str, Any]]
    state: dict[torch.Tensor, dict[str, Any]]

    def _check(self) -> None:
        for group in self.param_groups:
            unsupported = [k for k in ("maximize", "differentiable", "fused") if group.get(k)]
            if unsupported or group.get("foreach") or not group.get("capturable"):
                raise ValueError(f"{type(self).__name__}: capturable=True, foreach/maximize/differentiable/fused off "
                                 f"only; got {unsupported or 'foreach / capturable settings'}")

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One Adam(W) update of every parameter with a gradient; returns ``closure()`` when given."""
        self._check()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    _update(p, p.grad, self.state[p], group)
        return loss


def _update(p: torch.Tensor, grad: torch.Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
    """Adam(W)'s update of ``p`` in place (torch's formulas, eps added before the step size is folded in)."""
    beta1, beta2 = group["betas"]
    lr, eps, wd, amsgrad = group["lr"], group["eps"], group["weight_decay"], group["amsgrad"]
    if not state:  # torch's capturable state: the step count on the parameter's device
        state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        if amsgrad:
            state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    step_t, exp_avg, exp_avg_sq = state["step"], state["exp_avg"], state["exp_avg_sq"]
    step_t += 1
    if wd != 0:
        if group.get("decoupled_weight_decay", False):
            p.mul_(1 - lr * wd)
        else:
            grad = grad.add(p, alpha=wd)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    bias_correction1 = 1 - torch.pow(beta1, step_t)
    bias_correction2_sqrt = (1 - torch.pow(beta2, step_t)).sqrt()
    second = exp_avg_sq
    if amsgrad:
        torch.maximum(state["max_exp_avg_sq"], exp_avg_sq, out=state["max_exp_avg_sq"])
        second = state["max_exp_avg_sq"]
    step_size_neg = (lr / bias_correction1).neg()
    denom = (second.sqrt() / bias_correction2_sqrt).add_(eps).div_(step_size_neg)
    p.addcdiv_(exp_avg, denom)


class CapturableAdamW(_FiniteCapturableStep, torch.optim.AdamW):
    """``torch.optim.AdamW(..., capturable=True, foreach=False)`` with a step that stays finite at lr 0."""


class CapturableAdam(_FiniteCapturableStep, torch.optim.Adam):
    """``torch.optim.Adam(..., capturable=True, foreach=False)`` with a step that stays finite at lr 0."""
