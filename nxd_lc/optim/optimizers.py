"""Optimizer registry by NeMo name (``model.optim.name``) and weight-decay parameter groups.

Names follow NeMo / NxDT (``nemo.core.optim.optimizers.AVAILABLE_OPTIMIZERS`` plus NxD's
``adamw_fp32OptState``): torch.optim classes where torch has the optimizer, our own
:class:`~nxd_lc.optim.novograd.Novograd` otherwise. Note ``model.optim.eps`` (default 1e-8) is passed to every
optimizer, including those whose torch default differs (adadelta 1e-6, adagrad 1e-10). Each builder receives
the parameter groups of :func:`param_groups` and the typed :class:`~nxd_lc.config.schema.OptimConfig`; a key
the chosen optimizer cannot use, set away from its default, is an error naming it, never ignored.

Weight-decay groups follow NeMo's Megatron rule (``nemo/collections/nlp/modules/common/megatron/utils.py``,
``get_params_for_weight_decay_optimization`` / ``get_all_params_for_weight_decay_optimization``, selected by
``model.do_layer_norm_weight_decay`` in ``MegatronBaseModel.setup_optimizer_param_groups``):

* ``do_layer_norm_weight_decay: true``  -> every parameter gets ``model.optim.weight_decay``;
* ``do_layer_norm_weight_decay: false`` -> parameters of normalisation modules and biases get 0.

NeMo decides "normalisation module" by module type (FusedLayerNorm, MixedFusedRMSNorm, ...); this module only
sees ``(name, parameter)`` pairs, so it decides by name and shape (:func:`is_no_decay_param`). NxDT's HF path
differs from NeMo (``BaseHfModel.setup_optimizer_param_groups``): it *adds* ``"LayerNorm"`` to the no-decay list
when the flag is true (the inverse of its name; Llama norms are not named ``LayerNorm`` so it has no effect there)
and hard-codes weight_decay 0.01 for the decayed group. nxd_lc follows NeMo and honours
``model.optim.weight_decay``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch

from nxd_lc.config.schema import OptimConfig
from nxd_lc.optim.capturable import CapturableAdam, CapturableAdamW, needs_finite_capturable_adam
from nxd_lc.optim.novograd import Novograd
from nxd_lc.precision.policy import PrecisionPolicy
from nxd_lc.runtime.accel import HOST

log = logging.getLogger(__name__)

ParamGroup = dict[str, Any]


def is_no_decay_param(name: str, param: torch.Tensor) -> bool:
    """True when ``param`` is a bias or a normalisation weight (excluded from weight decay in NeMo).

    Rule: the last dotted component of ``name`` ends with ``bias`` (NeMo: ``name.endswith('bias')``), or any
    dotted component contains ``norm`` (case-insensitive: ``input_layernorm``, ``post_attention_layernorm``,
    ``norm``, ``q_norm``, ``LayerNorm``), or the parameter is 1-D (norm scales and biases are the only 1-D
    parameters of Llama-family decoders; this also catches norms named otherwise, e.g. ``ln_f``).

    Args:
        name: dotted parameter name as given by ``Module.named_parameters()``.
        param: the parameter (only its ``ndim`` is read).
    """
    parts = name.split(".")
    if parts[-1].endswith("bias"):
        return True
    if any("norm" in part.lower() for part in parts):
        return True
    return param.ndim == 1


def param_groups(named_params: Iterable[tuple[str, torch.nn.Parameter]], weight_decay: float,
                 do_layer_norm_weight_decay: bool) -> list[ParamGroup]:
    """Split trainable parameters into optimizer parameter groups by weight decay.

    Only parameters with ``requires_grad`` are kept; a parameter object given twice (tied weights) is kept
    once, under its first name. Empty groups are dropped. Each group carries ``params``, ``weight_decay``,
    ``group_name`` (``"decay"`` / ``"no_decay"``) and ``param_names`` (names in ``params`` order, for
    logging and checkpoint mapping; torch keeps extra group keys in ``state_dict()``).

    Args:
        named_params: ``(name, parameter)`` pairs, e.g. ``model.named_parameters()``.
        weight_decay: ``model.optim.weight_decay`` for the decayed group.
        do_layer_norm_weight_decay: True -> one group, all parameters decayed (NeMo
            ``get_all_params_for_weight_decay_optimization``); False -> biases and norm weights get 0.

    Raises:
        ValueError: no parameter requires grad.
    """
    decay: list[tuple[str, torch.nn.Parameter]] = []
    no_decay: list[tuple[str, torch.nn.Parameter]] = []
    seen: set[int] = set()
    for name, param in named_params:
        if not param.requires_grad or id(param) in seen:
            continue
        seen.add(id(param))
        if not do_layer_norm_weight_decay and is_no_decay_param(name, param):
            no_decay.append((name, param))
        else:
            decay.append((name, param))
    if not decay and not no_decay:
        raise ValueError("build_optimizer: no parameter requires grad; nothing to optimize (check that the "
                         "model was built and its parameters are not all frozen)")
    groups = []
    for group_name, members, wd in (("decay", decay, weight_decay), ("no_decay", no_decay, 0.0)):
        if members:
            groups.append({"params": [p for _, p in members], "param_names": [n for n, _ in members],
                           "weight_decay": float(wd), "group_name": group_name})
    return groups


#: OptimConfig keys each optimizer reads besides ``name`` / ``lr`` / ``sched``. Any other key set away from its
#: default is an error naming it (a setting the optimizer would silently ignore).
_USED_KEYS: dict[str, frozenset[str]] = {
    "adamw": frozenset({"weight_decay", "betas", "eps", "capturable", "amsgrad"}),
    "adamw_fp32OptState": frozenset({"weight_decay", "betas", "eps", "capturable", "amsgrad"}),
    "adam": frozenset({"weight_decay", "betas", "eps", "capturable", "amsgrad"}),
    "sgd": frozenset({"weight_decay", "momentum"}),
    "adadelta": frozenset({"weight_decay", "rho", "eps", "capturable"}),
    "adamax": frozenset({"weight_decay", "betas", "eps", "capturable"}),
    "adagrad": frozenset({"weight_decay", "lr_decay", "initial_accumulator_value", "eps"}),
    "rmsprop": frozenset({"weight_decay", "alpha", "eps", "momentum", "centered", "capturable"}),
    "rprop": frozenset({"etas", "step_sizes", "capturable"}),
    "novograd": frozenset({"weight_decay", "betas", "eps", "amsgrad", "grad_averaging"}),
    "adafactor": frozenset({"weight_decay", "eps", "decay_rate", "clip_threshold"}),
}
_ALWAYS = frozenset({"name", "lr", "sched"})


def _check_unused_keys(name: str, cfg: OptimConfig) -> None:
    """Raise ValueError for the first OptimConfig key the optimizer cannot use that differs from its default."""
    default = OptimConfig()
    for key in cfg.__dataclass_fields__:
        if key in _ALWAYS or key in _USED_KEYS[name]:
            continue
        value, dflt = getattr(cfg, key), getattr(default, key)
        if (list(value) if isinstance(value, (list, tuple)) else value) != dflt:
            users = sorted(n for n, keys in _USED_KEYS.items() if key in keys)
            raise ValueError(f"model.optim.{key}: {value!r} is not used by {name}; remove model.optim.{key} "
                             f"(it applies to {', '.join(users) or 'no optimizer'})")


def _pair(key: str, name: str, values: Any) -> tuple[float, float]:
    """``values`` as a float pair; ValueError naming ``model.optim.<key>`` otherwise."""
    if len(values) != 2:
        raise ValueError(f"model.optim.{key}: {name} needs two values, got {list(values)}")
    return float(values[0]), float(values[1])


def _adam_variant(groups: list[ParamGroup], cfg: OptimConfig, torch_class: type) -> tuple[type, dict[str, Any]]:
    """(class, capturable keyword arguments) of an Adam(W): ``torch_class`` (torch.optim.Adam / AdamW), or nxd_lc's
    :mod:`~nxd_lc.optim.capturable` twin (one tensor at a time) where torch's capturable step would write NaN at
    lr 0: ``model.optim.capturable`` on an xla device."""
    if cfg.capturable and needs_finite_capturable_adam([p for g in groups for p in g["params"]]):
        twin = CapturableAdamW if torch_class is torch.optim.AdamW else CapturableAdam
        return twin, {"capturable": True, "foreach": False}
    return torch_class, {"capturable": cfg.capturable}


def _adamw(groups: list[ParamGroup], cfg: OptimConfig) -> torch.optim.Optimizer:
    """torch.optim.AdamW: decoupled weight decay (Loshchilov & Hutter, arXiv:1711.05101)."""
    cls, capturable = _adam_variant(groups, cfg, torch.optim.AdamW)
    return cls(groups, lr=cfg.lr, betas=_pair("betas", "adamw", cfg.betas), eps=cfg.eps,
               weight_decay=cfg.weight_decay, amsgrad=cfg.amsgrad, **capturable)


def _adamw_fp32_opt_state(groups: list[ParamGroup], cfg: OptimConfig) -> torch.optim.Optimizer:
    """NxD's ``adamw_fp32OptState``: AdamW whose moments (exp_avg, exp_avg_sq) are kept in fp32.

    torch.optim.AdamW keeps its state in the parameter dtype, so with fp32 parameters this is exactly AdamW
    with fp32 state. With bf16 parameters NxD keeps fp32 moments beside bf16 params; that variant belongs to
    the precision module (master weights) and is refused here rather than silently run with bf16 moments.

    Raises:
        ValueError: a parameter is not float32.
    """
    for group in groups:
        for name, p in zip(group["param_names"], group["params"]):
            if p.dtype != torch.float32:
                raise ValueError(f"model.optim.name=adamw_fp32OptState: parameter {name!r} is {p.dtype}; fp32 "
                                 f"optimizer state for non-fp32 parameters is not supported yet (precision "
                                 f"issue); use precision.type: fp32 (fp32 parameters)")
    cls, capturable = _adam_variant(groups, cfg, torch.optim.AdamW)
    return cls(groups, lr=cfg.lr, betas=_pair("betas", "adamw_fp32OptState", cfg.betas), eps=cfg.eps,
               weight_decay=cfg.weight_decay, amsgrad=cfg.amsgrad, **capturable)


def _adam(groups: list[ParamGroup], cfg: OptimConfig) -> torch.optim.Optimizer:
    """torch.optim.Adam (Kingma & Ba, arXiv:1412.6980); weight_decay is L2 (added to the gradient)."""
    cls, capturable = _adam_variant(groups, cfg, torch.optim.Adam)
    return cls(groups, lr=cfg.lr, betas=_pair("betas", "adam", cfg.betas), eps=cfg.eps,
               weight_decay=cfg.weight_decay, amsgrad=cfg.amsgrad, **capturable)


def _sgd(groups: list[ParamGroup], cfg: OptimConfig) -> torch.optim.Optimizer:
    """torch.optim.SGD with ``model.optim.momentum`` (heavy ball); weight_decay is L2."""
    return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)


def _adadelta(groups: list[ParamGroup], cfg: OptimConfig) -> torch.optim.Optimizer:
    """torch.optim.Adadelta (Zeiler, arXiv:1212.5701) with ``rho``; weight_decay is L2."""
    return torch.optim.Adadelta(groups, lr=cfg.lr, rho=cfg.rho, eps=cfg.eps, weight_decay=cfg.weight_decay,
                                capturable=cfg.capturable)


def _adamax(groups: list[ParamGroup], cfg: OptimConfig) -> torch.optim.Optimizer:
    """torch.optim.Adamax (infinity-norm Adam, Kingma & Ba arXiv:1412.6980 sec. 7); weight_decay is L2."""
    return torch.optim.Adamax(groups, lr=cfg.lr, betas=_pair("betas", "adamax", cfg.betas), eps=cfg.eps,
                              weight_decay=cfg.weight_decay, capturable=cfg.capturable)


def _adagrad(groups: list[ParamGroup], cfg: OptimConfig) -> torch.optim.Optimizer:
    """torch.optim.Adagrad (Duchi et al., JMLR 2011) with ``lr_decay`` / ``initial_accumulator_value``."""
    return torch.optim.Adagrad(groups, lr=cfg.lr, lr_decay=cfg.lr_decay, weight_decay=cfg.weight_decay,
                               initial_accumulator_value=cfg.initial_accumulator_value, eps=cfg.eps)


def _rmsprop(groups: list[ParamGroup], cfg: OptimConfig) -> torch.optim.Optimizer:
    """torch.optim.RMSprop (Hinton, lecture 6e) with ``alpha``, ``momentum``, ``centered``; wd is L2."""
    return torch.optim.RMSprop(groups, lr=cfg.lr, alpha=cfg.alpha, eps=cfg.eps, weight_decay=cfg.weight_decay,
                               momentum=cfg.momentum, centered=cfg.centered, capturable=cfg.capturable)


def _rprop(groups: list[ParamGroup], cfg: OptimConfig) -> torch.optim.Optimizer:
    """torch.optim.Rprop (Riedmiller & Braun, 1993) with ``etas`` and ``step_sizes``; it has no weight decay."""
    return torch.optim.Rprop(groups, lr=cfg.lr, etas=_pair("etas", "rprop", cfg.etas),
                             step_sizes=_pair("step_sizes", "rprop", cfg.step_sizes), capturable=cfg.capturable)


def _novograd(groups: list[ParamGroup], cfg: OptimConfig) -> torch.optim.Optimizer:
    """:class:`nxd_lc.optim.novograd.Novograd` (NeMo ``novograd``), with ``grad_averaging`` / ``amsgrad``."""
    return Novograd(groups, lr=cfg.lr, betas=_pair("betas", "novograd", cfg.betas), eps=cfg.eps,
                    weight_decay=cfg.weight_decay, grad_averaging=cfg.grad_averaging, amsgrad=cfg.amsgrad)


def _adafactor(groups: list[ParamGroup], cfg: OptimConfig) -> torch.optim.Optimizer:
    """torch.optim.Adafactor (Shazeer & Stern, arXiv:1804.04235), NeMo argument names mapped onto torch's.

    ``decay_rate`` -> ``beta2_decay``, ``clip_threshold`` -> ``d``, ``eps`` -> ``eps[0]`` (the regulariser
    added to squared gradients; ``eps[1]`` = 1e-3, the default of both NeMo and torch); weight decay is
    decoupled. torch's Adafactor has no first moment (NeMo ``beta1``) and always uses the relative step
    ``min(lr, 1/sqrt(t))`` scaled by the parameter RMS (NeMo ``relative_step`` / ``scale_parameter`` true), so
    ``lr`` caps the step size.

    Raises:
        ValueError: torch < 2.5 (no torch.optim.Adafactor).
    """
    if not hasattr(torch.optim, "Adafactor"):
        raise ValueError(f"model.optim.name=adafactor needs torch.optim.Adafactor (torch >= 2.5); this is "
                         f"torch {torch.__version__}")
    return torch.optim.Adafactor(groups, lr=cfg.lr, beta2_decay=cfg.decay_rate, eps=(cfg.eps, 1e-3),
                                 d=cfg.clip_threshold, weight_decay=cfg.weight_decay)


#: NeMo optimizer name -> builder(param_groups, OptimConfig): the one list of optimizer names (validation reads
#: :data:`OPTIMIZER_NAMES`).
OPTIMIZER_BUILDERS: dict[str, Callable[[list[ParamGroup], OptimConfig], torch.optim.Optimizer]] = {
    "adamw": _adamw,
    "adamw_fp32OptState": _adamw_fp32_opt_state,
    "adam": _adam,
    "sgd": _sgd,
    "adadelta": _adadelta,
    "adamax": _adamax,
    "adagrad": _adagrad,
    "rmsprop": _rmsprop,
    "rprop": _rprop,
    "novograd": _novograd,
    "adafactor": _adafactor,
}

#: Every optimizer name ``model.optim.name`` accepts (NeMo's plus NxD's ``adamw_fp32OptState``).
OPTIMIZER_NAMES: tuple[str, ...] = tuple(OPTIMIZER_BUILDERS)


def build_optimizer(named_params: Iterable[tuple[str, torch.nn.Parameter]], optim_cfg: OptimConfig,
                    do_layer_norm_weight_decay: bool, policy: PrecisionPolicy | None = None, zero1: bool = False,
                    seed: int = 0) -> torch.optim.Optimizer:
    """Build the optimizer named by ``model.optim.name`` over the trainable parameters.

    Args:
        named_params: ``(name, parameter)`` pairs (this rank's shards under TP); frozen ones are skipped.
        optim_cfg: ``model.optim``; the keys each optimizer reads are listed in ``_USED_KEYS`` (NeMo names,
            passed to the torch.optim class of the same name); ``sched`` is read by
            :func:`nxd_lc.optim.schedulers.build_scheduler`.
        do_layer_norm_weight_decay: ``model.do_layer_norm_weight_decay`` (see :func:`param_groups`).
        policy: the precision policy; with bf16 parameters (or ``zero1``) the torch optimizer is wrapped in
            :class:`~nxd_lc.optim.wrapper.NxDOptimizer` (fp32 master weights / stochastic rounding / ZeRO-1).
        zero1: ``distributed_strategy.zero1``: shard optimizer state and master weights over DP x CP.
        seed: seed of the stochastic-rounding generator.

    Returns:
        A torch optimizer whose groups are those of :func:`param_groups`, each with ``lr = optim_cfg.lr``
        (an :class:`~nxd_lc.optim.wrapper.NxDOptimizer` when wrapped).

    Raises:
        ValueError: ``unknown optimizer`` for a name outside :data:`OPTIMIZER_NAMES`; a setting the optimizer
            cannot honour; no trainable params.
    """
    name = optim_cfg.name
    if name not in OPTIMIZER_BUILDERS:
        raise ValueError(f"model.optim.name: unknown optimizer {name!r}; choose one of "
                         f"{', '.join(OPTIMIZER_BUILDERS)}")
    if optim_cfg.lr < 0 or optim_cfg.weight_decay < 0:
        raise ValueError(f"model.optim.lr / model.optim.weight_decay: must be >= 0, got lr={optim_cfg.lr}, "
                         f"weight_decay={optim_cfg.weight_decay}")
    _check_unused_keys(name, optim_cfg)
    groups = param_groups(named_params, optim_cfg.weight_decay, do_layer_norm_weight_decay)
    builder = OPTIMIZER_BUILDERS[name]
    on_cpu = any(p.device.type == HOST.type for g in groups for p in g["params"])
    if optim_cfg.capturable and on_cpu:  # graph capture (CUDA graphs / XLA) does not exist on CPU; torch refuses it
        log.info("model.optim.capturable: true has no meaning for CPU parameters (no graph capture) and is not "
                 "passed to %s here; it applies on cuda / xla / neuron", name)
        optim_cfg = dataclasses.replace(optim_cfg, capturable=False)
    if policy is not None and (policy.low_precision_params or zero1):
        from nxd_lc.optim.wrapper import NxDOptimizer

        return NxDOptimizer(groups, lambda gs: builder(gs, optim_cfg), policy, zero1=zero1, seed=seed)
    return builder(groups, optim_cfg)
