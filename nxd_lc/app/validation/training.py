"""Cross-field rules of the training run: trainer keys, named choices (accelerator, precision, optimizer,
scheduler, checkpointing), alignment and LoRA, checkpoint / preemption keys, the in-training retrieval
evaluation."""

from __future__ import annotations

import difflib
import math
import os

from nxd_lc.alignment.rules import validate_alignment
from nxd_lc.config.access import peft_config, seq_length
from nxd_lc.config.alignment_schema import pretraining_data_problems
from nxd_lc.config.peft_schema import PEFT_KEY, peft_problems
from nxd_lc.config.schema import CHECKPOINT_METHODS, NxdConfig
from nxd_lc.data.retrieval_tasks import TASKS
from nxd_lc.eval.retrieval import SCORINGS
from nxd_lc.lightning.preemption import signal_numbers
from nxd_lc.optim.optimizers import OPTIMIZER_NAMES
from nxd_lc.optim.schedulers import SCHEDULE_NAMES, phase_problem
from nxd_lc.precision.policy import PRECISION_TYPES
from nxd_lc.precision.rules import precision_problems
from nxd_lc.runtime.device import ACCELERATORS


def trainer_problems(cfg: NxdConfig) -> list[str]:
    """``trainer.val_check_interval``: an int >= 1 (optimizer steps) or a float in (0, 1] (fraction of an epoch)."""
    v = cfg.trainer.val_check_interval
    ok = (isinstance(v, int) and not isinstance(v, bool) and v >= 1) or (isinstance(v, float) and 0.0 < v <= 1.0)
    if v is not None and not ok:
        return [f"trainer.val_check_interval: {v!r} is not valid; give an int >= 1 (validate every N optimizer "
                f"steps) or a float in (0, 1] (a fraction of an epoch); to skip validation set "
                f"trainer.limit_val_batches: 0"]
    return []


def _number(value: object) -> float | None:
    """``value`` as a float when it is a real number (not a bool), else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _domain(key: str, value: object, low: float, high: float = math.inf, *, low_open: bool = False,
            high_open: bool = False) -> list[str]:
    """``[problem]`` when ``value`` is not a finite number in the interval, naming ``key`` and the interval."""
    x = _number(value)
    inside = x is not None and math.isfinite(x) and (x > low if low_open else x >= low) and (
        x < high if high_open else x <= high)
    if inside:
        return []
    left, right = "(" if low_open else "[", ")" if high_open or math.isinf(high) else "]"
    interval = f"{left}{low:g}, {'inf' if math.isinf(high) else f'{high:g}'}{right}"
    return [f"{key}: {value!r} is not a finite number in {interval}"]


def domain_problems(cfg: NxdConfig) -> list[str]:
    """The numeric domain of the optimizer, schedule, clipping, seed and loader keys, checked before anything is
    built (each of these otherwise validated and then trained wrongly or failed later with a raw torch error):
    ``trainer.gradient_clip_val`` > 0 (0 / null: no clipping; a negative value would flip every gradient),
    ``model.optim.lr`` / ``weight_decay`` / ``momentum`` / ``sched.min_lr`` finite and >= 0 with ``min_lr <= lr``,
    ``betas`` in [0, 1), ``eps`` > 0, ``sched.gamma`` > 0, ``seed`` an integer in [0, 2^32) (numpy's and
    Lightning's seed range), ``data.num_workers`` an integer >= 0, ``trainer.max_consecutive_nonfinite_steps`` an
    integer >= 1."""
    optim, p = cfg.model.optim, []
    clip = cfg.trainer.gradient_clip_val
    if clip is not None and clip != 0:
        p += [f"{q}; 0 or null turns clipping off" for q in _domain("trainer.gradient_clip_val", clip, 0.0,
                                                                     low_open=True)]
    p += _domain("model.optim.lr", optim.lr, 0.0)
    p += _domain("model.optim.weight_decay", optim.weight_decay, 0.0)
    p += _domain("model.optim.momentum", optim.momentum, 0.0)
    p += _domain("model.optim.eps", optim.eps, 0.0, low_open=True)
    for i, beta in enumerate(list(optim.betas)[:2]):
        p += _domain(f"model.optim.betas[{i}]", beta, 0.0, 1.0, high_open=True)
    p += _domain("model.optim.sched.min_lr", optim.sched.min_lr, 0.0)
    if not p and optim.sched.min_lr > optim.lr:
        p.append(f"model.optim.sched.min_lr: {optim.sched.min_lr} is above model.optim.lr ({optim.lr}); the schedule "
                 "would raise the learning rate while it anneals: give min_lr <= lr")
    if optim.sched.gamma is not None:
        p += _domain("model.optim.sched.gamma", optim.sched.gamma, 0.0, low_open=True)
    if isinstance(cfg.seed, bool) or not isinstance(cfg.seed, int) or not 0 <= cfg.seed < 2**32:
        p.append(f"seed: {cfg.seed!r} is not an integer in [0, 2^32)")
    workers = cfg.data.num_workers
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
        p.append(f"data.num_workers: {workers!r} is not an integer >= 0 (0: load in the training process)")
    limit = cfg.trainer.max_consecutive_nonfinite_steps
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        p.append(f"trainer.max_consecutive_nonfinite_steps: {limit!r} is not an integer >= 1 (1: stop at the first "
                 "step with a NaN / infinite loss or gradient norm; trainer.check_for_nan_in_loss_and_grad: false "
                 "turns the check off)")
    return p


def choice_problems(cfg: NxdConfig) -> list[str]:
    p: list[str] = []
    choices = [
        ("model_source", cfg.model_source, ("hf", "megatron")),
        ("trainer.accelerator", cfg.trainer.accelerator, ACCELERATORS),
        ("precision.type", cfg.precision.type, PRECISION_TYPES),
        ("model.optim.name", cfg.model.optim.name, OPTIMIZER_NAMES),
        ("model.optim.sched.name", cfg.model.optim.sched.name, SCHEDULE_NAMES),
        ("exp_manager.checkpoint_callback_params.mode", cfg.exp_manager.checkpoint_callback_params.mode,
         ("max", "min")),
        ("model.activations_checkpoint_granularity", cfg.model.activations_checkpoint_granularity,
         (None, "selective", "full")),
        ("model.activations_checkpoint_method", cfg.model.activations_checkpoint_method, CHECKPOINT_METHODS),
        ("trainer.lnc", cfg.trainer.lnc, (None, 1, 2)),  # Trainium2 logical NeuronCore config
    ]
    for key, value, allowed in choices:
        if value not in allowed:
            near = difflib.get_close_matches(str(value), [str(a) for a in allowed if a], n=1)
            hint = f"did you mean '{near[0]}'? " if near else ""
            p.append(f"{key}: unknown value {value!r}; {hint}choose one of {', '.join(map(str, allowed))}")
    if cfg.trainer.max_steps < 1:
        p.append(f"trainer.max_steps: must be >= 1, got {cfg.trainer.max_steps}")
    if cfg.bucket_size_collectives is not None and cfg.bucket_size_collectives < 1:
        p.append(f"bucket_size_collectives: must be >= 1 MiB (or null for 64), got {cfg.bucket_size_collectives}")
    if cfg.trainer.log_every_n_steps < 1:
        p.append(f"trainer.log_every_n_steps: must be >= 1, got {cfg.trainer.log_every_n_steps}")
    phase = phase_problem(cfg.model.optim.sched)  # phases longer than the run are NeMo's behaviour: warned at build
    if phase is not None:
        p.append(phase)
    if len(cfg.model.optim.betas) != 2:
        p.append(f"model.optim.betas: needs two values, got {cfg.model.optim.betas}")
    return p + domain_problems(cfg) + precision_problems(cfg) + alignment_problems(cfg)


def alignment_problems(cfg: NxdConfig) -> list[str]:
    """``model_alignment_strategy`` (with its ``peft``: LoRA) and the alignment ``data.*`` keys."""
    peft = peft_config(cfg)
    p = validate_alignment(cfg.model_alignment_strategy, cfg.data, seq_length(cfg)) + peft_problems(peft)
    if cfg.model_alignment_strategy is None:
        p += pretraining_data_problems(cfg.data)
    strategy = cfg.model_alignment_strategy
    if strategy is not None and (strategy.dpo is not None or strategy.orpo is not None):
        if cfg.model.tiled_loss_chunk_size:
            p.append("model.tiled_loss_chunk_size: DPO / ORPO compute sequence log-probs, not the tiled causal-LM "
                     "loss; unset it")
    if peft is not None and cfg.model.tiled_mlp_chunk_size and {"gate_up_proj", "down_proj"} & set(
            peft.target_modules or []):
        p.append("model.tiled_mlp_chunk_size: the tiled MLP reads the base weights and would skip LoRA adapters on "
                 f"gate_up_proj / down_proj; unset it or drop those from {PEFT_KEY}.target_modules")
    return p


def path_name_problems(cfg: NxdConfig) -> list[str]:
    """Names that become one path component inside the run directory must stay one: ``exp_manager.name`` (the
    run's directory under ``exp_dir``) and ``exp_manager.checkpoint_callback_params.filename`` (each checkpoint's
    directory under ``checkpoints/``) may not contain a path separator, start with '.', or be empty. A filename
    with '/' or '../' saved outside ``checkpoints/``, and the next start, finding no checkpoint there, began again
    at step 1."""
    p = []
    for key, value in (("exp_manager.name", cfg.exp_manager.name),
                       ("exp_manager.checkpoint_callback_params.filename",
                        cfg.exp_manager.checkpoint_callback_params.filename)):
        text = value if isinstance(value, str) else ""
        if not text.strip() or text.startswith(".") or any(sep in text for sep in ("/", "\\", os.sep, "\0")):
            p.append(f"{key}: {value!r} must be one non-empty directory name (no '/', '\\' or NUL, not starting "
                     "with '.'); it names a directory inside the run directory")
    return p


def checkpoint_problems(cfg: NxdConfig) -> list[str]:
    """``exp_manager.ckpt_ptl_version`` must parse as a version (it is compared with the checkpoint's own);
    ``exp_manager.preemption_signals`` must name signals nxd_lc handles; names that become paths
    (:func:`path_name_problems`)."""
    from packaging.version import InvalidVersion, Version

    names = path_name_problems(cfg)
    if names:
        return names

    version = cfg.exp_manager.ckpt_ptl_version
    try:
        if version is not None:
            Version(version)
    except InvalidVersion:
        return [f"exp_manager.ckpt_ptl_version: {version!r} is not a version; give the pytorch-lightning version "
                f"the checkpoint was saved with, e.g. '1.8.6', or remove it"]
    try:
        signal_numbers(list(cfg.exp_manager.preemption_signals))
    except ValueError as e:
        return [str(e)]
    return retrieval_eval_problems(cfg)


def retrieval_eval_problems(cfg: NxdConfig) -> list[str]:
    """``exp_manager.retrieval_eval``: known tasks / scorings, depths in [0, 1], positive counts; pretraining data
    (its held-out split is the haystack) and one pipeline stage."""
    r, key = cfg.exp_manager.retrieval_eval, "exp_manager.retrieval_eval"
    if r.every_n_steps == 0:
        return []
    p: list[str] = []
    if r.every_n_steps < 0:
        p.append(f"{key}.every_n_steps: must be >= 0 (0 = off), got {r.every_n_steps}")
    bad = [t for t in r.tasks if t not in TASKS]
    if bad or not r.tasks:
        p.append(f"{key}.tasks: unknown {bad or 'none given'}; choose from {', '.join(TASKS)}")
    bad = [s for s in r.scorings if s not in SCORINGS]
    if bad or not r.scorings:
        p.append(f"{key}.scorings: unknown {bad or 'none given'}; choose from {', '.join(SCORINGS)}")
    if any(not 0 <= d <= 1 for d in r.depths) or not r.depths:
        p.append(f"{key}.depths: need numbers in [0, 1], got {list(r.depths)}")
    if any(L < 1 for L in r.lengths):
        p.append(f"{key}.lengths: need positive token counts, got {list(r.lengths)}")
    for name in ("num_samples", "num_candidates"):
        if getattr(r, name) < 1:
            p.append(f"{key}.{name}: must be >= 1, got {getattr(r, name)}")
    if cfg.distributed_strategy.pipeline_model_parallel_size > 1:
        p.append(f"{key}: not supported with pipeline_model_parallel_size > 1 (the evaluation runs the whole model "
                 "on each rank); set every_n_steps: 0 and evaluate the converted checkpoint with "
                 "python -m nxd_lc.cli.passkey")
    if cfg.model_alignment_strategy is not None:
        p.append(f"{key}: needs the pretraining data module (its held-out split is the haystack); for fine-tuning "
                 "runs evaluate the converted checkpoint with python -m nxd_lc.cli.niah")
    return p
