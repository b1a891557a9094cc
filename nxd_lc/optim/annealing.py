"""Closed-form learning rates of NeMo's warm-up / annealing schedules and torch's StepLR / ExponentialLR.

Conventions as in :mod:`nxd_lc.optim.schedulers`: ``step`` = optimizer steps taken so far (``last_epoch``),
``lr`` = the group's initial (peak) learning rate, ``W`` = ``warmup_steps``, ``H`` = ``hold_steps``, ``M`` =
``max_steps``; every function returns an absolute learning rate. Formulas follow NeMo's
``nemo/core/optim/lr_scheduler.py`` (read for the formulas; our own code). Where NeMo uses ``base_lrs[0]`` for
every group (WarmupAnnealing) we use each group's own ``lr`` (identical with one lr for all groups).

NeMo's shared warm-up (``WarmupPolicy._get_warmup_lr``), used by every schedule here except Noam::

    0 < W and step <= W : lr * (step + 1) / (W + 1)
    step > M            : min_lr
"""

from __future__ import annotations

import math


def _warmup_or_tail(step: int, lr: float, warmup_steps: int, max_steps: int, min_lr: float) -> float | None:
    """NeMo ``WarmupPolicy.get_lr`` head: the warm-up value, ``min_lr`` past M, else None (schedule body)."""
    if 0 < warmup_steps and step <= warmup_steps:
        return lr * (step + 1) / (warmup_steps + 1)
    if step > max_steps:
        return min_lr
    return None


def warmup_hold_policy_lr(step: int, lr: float, warmup_steps: int, hold_steps: int, max_steps: int,
                          min_lr: float = 0.0) -> float:
    """NeMo ``WarmupHoldPolicy``: warm-up, ``H`` steps held at ``lr``, then NeMo's constant body::

        0 < W and step <= W : lr * (step + 1) / (W + 1)
        step < W + H        : lr                    (hold)
        step > M            : min_lr
        otherwise           : lr                    (WarmupPolicy._get_lr, the constant policy)

    NeMo stores ``hold_steps + warmup_steps`` as its hold boundary. WarmupHoldPolicy used by name has the
    constant body, so the hold phase and the body give the same ``lr``; ``hold_steps`` only matters to NeMo's
    subclasses (e.g. NoamHoldAnnealing). Recent NeMo rewrote the hold test as ``hold_steps < step >= W``,
    which inverts it; we follow the original ``W <= step < W + H`` (same values here either way).
    """
    if 0 < warmup_steps and step <= warmup_steps:
        return lr * (step + 1) / (warmup_steps + 1)
    if step < warmup_steps + hold_steps:
        return lr
    return min_lr if step > max_steps else lr


def square_annealing_lr(step: int, lr: float, warmup_steps: int, max_steps: int, min_lr: float = 0.0) -> float:
    """NeMo ``SquareAnnealing`` (``_square_annealing`` on the post-warm-up steps)::

        0 < W and step <= W : lr * (step + 1) / (W + 1)
        step > M            : min_lr
        otherwise           : max(min_lr, lr * ((M - step) / (M - W)) ** 2)

    NeMo's class default ``min_lr`` is 1e-5; here it is ``model.optim.sched.min_lr`` (default 0).
    """
    head = _warmup_or_tail(step, lr, warmup_steps, max_steps, min_lr)
    if head is not None:
        return head
    return max(min_lr, lr * ((max_steps - step) / (max_steps - warmup_steps)) ** 2)


def warmup_annealing_lr(step: int, lr: float, warmup_steps: int, max_steps: int, min_lr: float = 0.0) -> float:
    """NeMo ``WarmupAnnealing``: warm-up, then linear decay from ``lr`` to ``min_lr`` at M::

        0 < W and step <= W : lr * (step + 1) / (W + 1)
        step > M            : min_lr
        otherwise           : min_lr + (1 - (step - W) / (M - W)) * (lr - min_lr)
    """
    head = _warmup_or_tail(step, lr, warmup_steps, max_steps, min_lr)
    if head is not None:
        return head
    progress = (step - warmup_steps) / (max_steps - warmup_steps)
    return min_lr + (1.0 - progress) * (lr - min_lr)


def noam_annealing_lr(step: int, lr: float, d_model: int, warmup_steps: int, max_steps: int,
                      min_lr: float = 0.0) -> float:
    """NeMo ``NoamAnnealing`` (Vaswani et al. 2017, "Attention Is All You Need", eq. 3, scaled by ``lr``)::

        s = max(1, step)
        s > M  : min_lr
        W > 0  : out = lr * d_model^-0.5 * min(s^-0.5, s * W^-1.5)
        W == 0 : out = lr * d_model^-0.5 * s^-0.5
        s > W  : out = max(out, min_lr)

    The peak, at s = W, is ``lr * (d_model * W)^-0.5``: ``lr`` is a scale, not the peak learning rate.

    Raises:
        ValueError: ``d_model`` < 1.
    """
    if d_model < 1:
        raise ValueError(f"model.optim.sched.d_model: NoamAnnealing needs d_model >= 1, got {d_model}")
    s = max(1, step)
    if s > max_steps:
        return min_lr
    if warmup_steps > 0:
        mult = d_model ** -0.5 * min(s ** -0.5, s * warmup_steps ** -1.5)
    else:
        mult = d_model ** -0.5 * s ** -0.5
    out = lr * mult
    return max(out, min_lr) if s > warmup_steps else out


def step_lr(step: int, lr: float, step_size: int, gamma: float = 0.1) -> float:
    """``StepLR`` (NeMo registers ``torch.optim.lr_scheduler.StepLR``; its closed form)::

        lr * gamma ** (step // step_size)

    Raises:
        ValueError: ``step_size`` < 1.
    """
    if step_size < 1:
        raise ValueError(f"model.optim.sched.step_size: StepLR needs step_size >= 1, got {step_size}")
    return lr * gamma ** (step // step_size)


def exponential_lr(step: int, lr: float, gamma: float) -> float:
    """``ExponentialLR`` (NeMo registers ``torch.optim.lr_scheduler.ExponentialLR``; its closed form)::

        lr * gamma ** step
    """
    return lr * math.pow(gamma, step)
