"""Optimizers and learning-rate schedules by NeMo / NxDT name (``model.optim``, ``model.optim.sched``)."""

from nxd_lc.optim.annealing import (
    exponential_lr,
    noam_annealing_lr,
    square_annealing_lr,
    step_lr,
    warmup_annealing_lr,
    warmup_hold_policy_lr,
)
from nxd_lc.optim.novograd import Novograd
from nxd_lc.optim.optimizers import (
    OPTIMIZER_BUILDERS,
    OPTIMIZER_NAMES,
    build_optimizer,
    is_no_decay_param,
    param_groups,
)
from nxd_lc.optim.schedulers import (
    SCHEDULE_NAMES,
    build_scheduler,
    constant_lr,
    cosine_annealing_lr,
    linear_annealing_with_warmup_lr,
)
from nxd_lc.optim.wrapper import NxDOptimizer, install_fp32_grad_accumulation

__all__ = [
    "OPTIMIZER_BUILDERS",
    "OPTIMIZER_NAMES",
    "SCHEDULE_NAMES",
    "Novograd",
    "NxDOptimizer",
    "build_optimizer",
    "build_scheduler",
    "constant_lr",
    "cosine_annealing_lr",
    "exponential_lr",
    "install_fp32_grad_accumulation",
    "is_no_decay_param",
    "linear_annealing_with_warmup_lr",
    "noam_annealing_lr",
    "param_groups",
    "square_annealing_lr",
    "step_lr",
    "warmup_annealing_lr",
    "warmup_hold_policy_lr",
]
