"""Learning-rate schedules by NeMo / NxDT name (``model.optim.sched.name``), as ``LambdaLR``.

``step`` below is the number of optimizer steps taken so far (``LambdaLR.last_epoch``: 0 at construction,
+1 per ``scheduler.step()``, which Lightning calls after each optimizer step). ``lr`` is the group's initial
learning rate (``model.optim.lr``), ``W`` = ``warmup_steps``, ``C`` = ``constant_steps``, ``M`` =
``max_steps`` and ``min_lr`` an absolute learning rate. Each ``*_lr`` function returns an absolute learning
rate; the ``LambdaLR`` factor is that value divided by the group's initial lr.

The factors are closures (plain functions), so ``LambdaLR.state_dict()`` stores only the step counter:
on resume the schedule comes from the current config (a changed ``max_steps`` takes effect) and the step
from the checkpoint. The other NeMo schedules' formulas are in :mod:`nxd_lc.optim.annealing`.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable

import torch
from torch.optim.lr_scheduler import LambdaLR

from nxd_lc.config.schema import SchedConfig
from nxd_lc.optim.annealing import (
    exponential_lr,
    noam_annealing_lr,
    square_annealing_lr,
    step_lr,
    warmup_annealing_lr,
    warmup_hold_policy_lr,
)

log = logging.getLogger(__name__)


def linear_annealing_with_warmup_lr(step: int, lr: float, warmup_steps: int, max_steps: int,
                                    min_lr: float = 0.0) -> float:
    """NxDT ``LinearAnnealingWithWarmUp``: linear warm-up from 0, then linear decay to ``min_lr`` at M.

    Formula (NxDT ``neuronx_distributed_training/optim/lr_schedulers.py``, which calls transformers'
    ``_get_linear_schedule_with_warmup_lr_lambda``)::

        step <  W : lr * step / max(1, W)
        step >= W : min_lr + (lr - min_lr) * max(0, (M - step) / max(1, M - W))

    With ``min_lr = 0`` (NxDT has no min_lr for this schedule) this is NxDT's formula exactly; a positive
    ``min_lr`` is a floor reached at M, as in Megatron's linear decay style
    (``megatron/core/optimizer_param_scheduler.py``: ``min_lr + (max_lr - min_lr) * (1 - decay_ratio)``).
    """
    if step < warmup_steps:
        return lr * step / max(1, warmup_steps)
    remaining = max(0.0, (max_steps - step) / max(1, max_steps - warmup_steps))
    return min_lr + (lr - min_lr) * remaining


def cosine_annealing_lr(step: int, lr: float, warmup_steps: int, max_steps: int, min_lr: float = 0.0,
                        constant_steps: int = 0) -> float:
    """NeMo ``CosineAnnealing`` (``nemo/core/optim/lr_scheduler.py``), both of its branches.

    ``constant_steps == 0`` (``WarmupAnnealHoldPolicy._get_warmup_lr`` + ``_cosine_annealing``)::

        0 < W and step <= W : lr * (step + 1) / (W + 1)
        step > M            : min_lr
        otherwise           : min_lr + (lr - min_lr) * 0.5 * (1 + cos(pi * (step - W) / (M - W)))

    ``constant_steps > 0`` (``_linear_warmup_with_cosine_annealing``, Megatron-style), with
    ``D = M - C - W`` decay steps; the C constant steps come at the END, held at ``min_lr``::

        0 < W and step <= W : lr * step / W
        step > W + D        : min_lr
        otherwise           : min_lr + (lr - min_lr) * 0.5 * (1 + cos(pi * (step - W) / D))
    """
    if constant_steps == 0:
        if 0 < warmup_steps and step <= warmup_steps:
            return lr * (step + 1) / (warmup_steps + 1)
        if step > max_steps:
            return min_lr
        progress = (step - warmup_steps) / max(1, max_steps - warmup_steps)
        return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
    decay_steps = max_steps - constant_steps - warmup_steps
    if 0 < warmup_steps and step <= warmup_steps:
        return lr * step / warmup_steps
    if step > warmup_steps + decay_steps:
        return min_lr
    progress = (step - warmup_steps) / max(1, decay_steps)
    return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


def constant_lr(step: int, lr: float, warmup_steps: int, max_steps: int, min_lr: float = 0.0) -> float:
    """``Constant`` and ``WarmupPolicy``: NeMo's ``WarmupPolicy`` (``nemo/core/optim/lr_scheduler.py``)::

        0 < W and step <= W : lr * (step + 1) / (W + 1)
        step > M            : min_lr
        otherwise           : lr
    """
    if 0 < warmup_steps and step <= warmup_steps:
        return lr * (step + 1) / (warmup_steps + 1)
    if step > max_steps:
        return min_lr
    return lr


#: SchedConfig keys each schedule reads besides ``name`` / ``max_steps``; another key set away from its default
#: is an error naming it.
_USED_KEYS: dict[str, frozenset[str]] = {
    "LinearAnnealingWithWarmUp": frozenset({"warmup_steps", "min_lr"}),
    "CosineAnnealing": frozenset({"warmup_steps", "constant_steps", "min_lr"}),
    "Constant": frozenset({"warmup_steps", "min_lr"}),
    "WarmupPolicy": frozenset({"warmup_steps", "min_lr"}),
    "WarmupHoldPolicy": frozenset({"warmup_steps", "hold_steps", "min_lr"}),
    "SquareAnnealing": frozenset({"warmup_steps", "min_lr"}),
    "NoamAnnealing": frozenset({"warmup_steps", "min_lr", "d_model"}),
    "WarmupAnnealing": frozenset({"warmup_steps", "min_lr"}),
    "StepLR": frozenset({"step_size", "gamma"}),
    "ExponentialLR": frozenset({"gamma"}),
}
#: Keys a schedule cannot run without (None in the config).
_REQUIRED: dict[str, tuple[str, ...]] = {"NoamAnnealing": ("d_model",), "StepLR": ("step_size",),
                                         "ExponentialLR": ("gamma",)}


def _check_keys(sched_cfg: SchedConfig) -> None:
    """Raise ValueError naming a key the schedule cannot use (set away from its default) or lacks."""
    name, default = sched_cfg.name, SchedConfig()
    for key in sorted(set(default.__dataclass_fields__) - {"name", "max_steps"} - _USED_KEYS[name]):
        if getattr(sched_cfg, key) != getattr(default, key):
            users = [n for n, keys in _USED_KEYS.items() if key in keys]
            raise ValueError(f"model.optim.sched.{key}: only {', '.join(users)} use {key}; remove it for {name}")
    for key in _REQUIRED.get(name, ()):
        if getattr(sched_cfg, key) is None:
            raise ValueError(f"model.optim.sched.{key}: {name} needs {key}; set model.optim.sched.{key}")
    if sched_cfg.gamma is not None and sched_cfg.gamma <= 0:
        raise ValueError(f"model.optim.sched.gamma: must be > 0, got {sched_cfg.gamma}")


def _long_phases_message(sched_cfg: SchedConfig, max_steps: int) -> str:
    """The warning for warm-up + constant + hold steps beyond the schedule length ``max_steps``: NeMo runs such a
    config with its formulas unchanged (no error), so nxd_lc does too and says what the learning rate does."""
    w, c, h = sched_cfg.warmup_steps, sched_cfg.constant_steps, sched_cfg.hold_steps
    if sched_cfg.name == "CosineAnnealing" and c > 0 and w + h <= max_steps:
        # NeMo's formula with D = M - C - W < 0: min_lr from the end of warm-up on (NxDT's megatron_gpt example)
        return (f"model.optim.sched: warmup {w} + constant_steps {c} exceed the schedule length {max_steps}, so "
                f"NeMo's CosineAnnealing holds min_lr {sched_cfg.min_lr:g} from the end of warm-up (no cosine decay), "
                "as NeMo / NxDT train this config; lower constant_steps to get a decay")
    if w >= max_steps:
        return (f"model.optim.sched.warmup_steps: {w} >= the schedule length {max_steps} (trainer.max_steps or "
                f"sched.max_steps): the run ends inside the warm-up, which is truncated (the learning rate follows "
                f"the {w}-step ramp and never reaches model.optim.lr), as NeMo trains this config; lower warmup_steps "
                "for a complete warm-up")
    return (f"model.optim.sched: warmup {w} + constant {c} + hold {h} exceed the schedule length {max_steps}: the "
            "run ends before the decay phase (NeMo's formulas, unchanged); lower them to get a decay")


def phase_problem(sched_cfg: SchedConfig) -> str | None:
    """The problem when a phase length (warm-up, constant, hold) is negative, else None: the one wording of the rule
    for validation and :func:`build_scheduler`. Phases longer than the schedule are allowed (NeMo; warned)."""
    w, c, h = sched_cfg.warmup_steps, sched_cfg.constant_steps, sched_cfg.hold_steps
    if min(w, c, h) < 0:
        return f"model.optim.sched.warmup_steps / constant_steps / hold_steps: must be >= 0, got {w} / {c} / {h}"
    return None


def _check(sched_cfg: SchedConfig, max_steps: int, lrs: list[float]) -> None:
    """Raise ValueError naming the key for schedule settings no formula can honour."""
    if max_steps < 1:
        raise ValueError(f"model.optim.sched.max_steps: schedule length must be >= 1, got {max_steps} "
                         f"(set model.optim.sched.max_steps or trainer.max_steps)")
    problem = phase_problem(sched_cfg)
    if problem is not None:
        raise ValueError(problem)
    total = sched_cfg.warmup_steps + sched_cfg.constant_steps + sched_cfg.hold_steps
    if total > max_steps and os.environ.get("RANK", "0") == "0":
        log.warning(_long_phases_message(sched_cfg, max_steps))
    _check_keys(sched_cfg)
    if sched_cfg.min_lr < 0 or any(sched_cfg.min_lr > lr for lr in lrs):
        raise ValueError(f"model.optim.sched.min_lr: {sched_cfg.min_lr} must be >= 0 and <= model.optim.lr "
                         f"{min(lrs) if lrs else '?'}")


def _lr_fn(sched_cfg: SchedConfig, max_steps: int) -> Callable[[int, float], float]:
    """Absolute-lr function ``f(step, lr)`` of the named schedule (settings already checked)."""
    w, m, c, lo = sched_cfg.warmup_steps, max_steps, sched_cfg.constant_steps, sched_cfg.min_lr
    h, d, size, gamma = sched_cfg.hold_steps, sched_cfg.d_model, sched_cfg.step_size, sched_cfg.gamma
    fns: dict[str, Callable[[int, float], float]] = {
        "LinearAnnealingWithWarmUp": lambda step, lr: linear_annealing_with_warmup_lr(step, lr, w, m, lo),
        "CosineAnnealing": lambda step, lr: cosine_annealing_lr(step, lr, w, m, lo, c),
        "Constant": lambda step, lr: constant_lr(step, lr, w, m, lo),
        "WarmupPolicy": lambda step, lr: constant_lr(step, lr, w, m, lo),
        "WarmupHoldPolicy": lambda step, lr: warmup_hold_policy_lr(step, lr, w, h, m, lo),
        "SquareAnnealing": lambda step, lr: square_annealing_lr(step, lr, w, m, lo),
        "NoamAnnealing": lambda step, lr: noam_annealing_lr(step, lr, int(d or 0), w, m, lo),
        "WarmupAnnealing": lambda step, lr: warmup_annealing_lr(step, lr, w, m, lo),
        "StepLR": lambda step, lr: step_lr(step, lr, int(size or 0), 0.1 if gamma is None else gamma),
        "ExponentialLR": lambda step, lr: exponential_lr(step, lr, float(gamma or 0.0)),
    }
    return fns[sched_cfg.name]


def _factor(lr_fn: Callable[[int, float], float], base_lr: float) -> Callable[[int], float]:
    """LambdaLR factor ``lr_fn(step, base_lr) / base_lr`` (0 when base_lr is 0)."""
    def factor(step: int) -> float:
        return lr_fn(step, base_lr) / base_lr if base_lr > 0 else 0.0
    return factor


#: Every schedule name ``model.optim.sched.name`` accepts (NeMo's): the one list (validation reads it).
SCHEDULE_NAMES: tuple[str, ...] = tuple(_USED_KEYS)


def build_scheduler(optimizer: torch.optim.Optimizer, sched_cfg: SchedConfig, max_steps: int) -> LambdaLR:
    """Build the ``LambdaLR`` for ``model.optim.sched`` (one factor per parameter group).

    Args:
        optimizer: the optimizer; each group's ``initial_lr`` (else ``lr``) is its peak learning rate.
        sched_cfg: ``model.optim.sched``; ``sched_cfg.max_steps`` overrides ``max_steps`` when set.
        max_steps: schedule length in optimizer steps when ``sched_cfg.max_steps`` is None (usually
            ``trainer.max_steps``).

    Returns:
        ``LambdaLR`` to be stepped once per optimizer step (Lightning ``interval: step``).

    Raises:
        ValueError: ``unknown schedule`` for a name outside :data:`SCHEDULE_NAMES`; a setting the schedule cannot honour
            (negative steps, warmup + constant + hold > length, a key the schedule does not use set away from its
            default, a required key missing: NoamAnnealing d_model, StepLR step_size, ExponentialLR gamma;
            min_lr > lr).
    """
    name = sched_cfg.name
    if name not in SCHEDULE_NAMES:
        raise ValueError(f"model.optim.sched.name: unknown schedule {name!r}; choose one of "
                         f"{', '.join(SCHEDULE_NAMES)}")
    length = sched_cfg.max_steps if sched_cfg.max_steps is not None else max_steps
    base_lrs = [float(g.get("initial_lr", g["lr"])) for g in optimizer.param_groups]
    _check(sched_cfg, length, base_lrs)
    lr_fn = _lr_fn(sched_cfg, length)
    return LambdaLR(optimizer, [_factor(lr_fn, base) for base in base_lrs])
