"""Precision modes (``precision.type``) -> the dtypes a training step uses, off and on Trainium.

NxDT realises a mode on Trainium through the environment (``XLA_USE_BF16``, ``XLA_DOWNCAST_BF16``,
``NEURON_RT_STOCHASTIC_ROUNDING_EN``) plus NxD's optimizer wrapper (master weights, fp32 gradient accumulation).
nxd_lc implements the same semantics in PyTorch on every backend, Trainium included (the two bf16 flags are set to
0 there: :mod:`nxd_lc.runtime.env`), decided here once:

=================  ========  ========  ============  ============  ============  ==========================
``type``           params    compute   grads (acc.)  master wts    optim state   fp32 -> bf16 param update
=================  ========  ========  ============  ============  ============  ==========================
fp32               fp32      fp32      fp32          (params)      fp32          --
bf16SR             bf16      bf16      bf16          --            bf16 [1]      stochastic rounding
mixed_precision    bf16      bf16      fp32          fp32          fp32          round to nearest
mixed_precisionSR  bf16      bf16      fp32          fp32          fp32          stochastic rounding
autocast           fp32      bf16 [2]  fp32          (params)      fp32          --
manual             [3]       [3]       [3]           [3]           [3]           [3]
=================  ========  ========  ============  ============  ============  ==========================

[1] fp32 with ``model.optim.name: adamw_fp32OptState`` (NxD's AdamW that keeps fp32 state for bf16 params).
[2] ``torch.autocast(dtype=bfloat16)`` around forward and loss; norms, softmax and the loss stay fp32.
[3] params bf16 when ``xla_use_bf16`` or ``xla_downcast_bf16`` is ``'1'``; ``master_weights`` and
    ``fp32_grad_acc`` as set; stochastic rounding when ``neuron_rt_stochastic_rounding_en`` is ``'1'``; optimizer
    state fp32 with master weights (or adamw_fp32OptState), else the params' dtype. With fp32 params,
    master weights and fp32 accumulation hold trivially (the params and grads are fp32 already).

TP/SP collectives run in ``precision.parallel_layers_reduce_dtype`` (NxD's ``reduce_dtype``; default fp32: a bf16
activation is reduced in fp32 and cast back). Source of the mode table: NxDT's ``training_orchestrator`` precision
handling (facts in ``shared/reference/nxdt_hf_llama3_8B_config.yaml``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Optional

import torch

from nxd_lc.config.schema import NxdConfig
from nxd_lc.runtime.env import flag_on

#: NxDT's ``precision.type`` values (``mixed_precision_SR`` is read as ``mixed_precisionSR``).
PRECISION_TYPES = ("bf16SR", "fp32", "autocast", "mixed_precision", "mixed_precisionSR", "manual")

#: ``precision.parallel_layers_reduce_dtype`` spellings -> dtype.
REDUCE_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "float32": torch.float32,
                                         "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class PrecisionPolicy:
    """The dtypes of one precision mode (see the module table).

    Attributes:
        mode: canonical ``precision.type``.
        param_dtype: dtype of the model's parameters (and of their ``.grad``).
        autocast_dtype: dtype of ``torch.autocast`` around forward + loss, or None.
        master_weights: the optimizer keeps fp32 copies of bf16 parameters and steps those.
        fp32_grad_acc: gradients of bf16 parameters accumulate over micro-batches in fp32 ``main_grad`` buffers.
        stochastic_rounding: the fp32 -> bf16 parameter update is rounded stochastically (unbiased).
        optim_state_dtype: dtype optimizer state tensors are stored in between steps.
        reduce_dtype: dtype of TP/SP collectives.
        grad_reduce_fp32: bf16 gradients are all-reduced over DP in fp32 (``precision.fp32_grads_cc``).

    On torch-xla these dtypes are what the device holds: nxd_lc never sets ``XLA_USE_BF16`` /
    ``XLA_DOWNCAST_BF16`` and refuses them preset (:mod:`nxd_lc.runtime.env`); :meth:`describe_on_device` states
    the on-device dtype of every tensor class from torch-xla's own rule (:func:`device_dtype`).
    """

    mode: str
    param_dtype: torch.dtype
    autocast_dtype: Optional[torch.dtype]
    master_weights: bool
    fp32_grad_acc: bool
    stochastic_rounding: bool
    optim_state_dtype: torch.dtype
    reduce_dtype: torch.dtype
    grad_reduce_fp32: bool = False

    def tensor_dtypes(self) -> dict[str, Optional[torch.dtype]]:
        """The dtype each tensor class of a training step is held or computed in, as nxd_lc asks for it (None: the
        mode has no such tensor). Classes: ``parameters``, ``gradients`` (``param.grad``), ``grad accumulation``
        (``main_grad`` or ``.grad``), ``master weights``, ``optimizer state``, ``SR working copy`` (the fp32 sum the
        software stochastic rounding rounds), ``TP/SP reductions``, ``DP reductions``, ``norm statistics`` (RMSNorm's
        mean of squares and rsqrt: float32 in :mod:`nxd_lc.models.common.norm`), ``loss`` (the cross-entropy's
        log-sum-exp: float32 in :mod:`nxd_lc.layers.cross_entropy`)."""
        fp32 = torch.float32
        acc = fp32 if self.fp32_grad_acc or not self.low_precision_params else self.param_dtype
        return {"parameters": self.param_dtype, "gradients": self.param_dtype, "grad accumulation": acc,
                "master weights": fp32 if self.master_weights else None, "optimizer state": self.optim_state_dtype,
                "SR working copy": fp32 if self.stochastic_rounding and self.low_precision_params else None,
                "TP/SP reductions": self.reduce_dtype,
                "DP reductions": fp32 if acc == fp32 or self.grad_reduce_fp32 else acc,
                "norm statistics": fp32, "loss": fp32}

    def describe_on_device(self, platform: str, environ: Optional[Mapping[str, str]] = None) -> str:
        """One line: the dtype each tensor class of :meth:`tensor_dtypes` has *on the device* of ``platform``
        ('cpu', 'gpu', 'xla', 'neuron' = torch-xla on Neuron, 'neuron_native'), under ``environ`` (default
        ``os.environ``): :func:`device_dtype`. The dry run prints it for xla / neuron."""
        short = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float64: "f64"}
        cells = [f"{name} {short[device_dtype(dt, platform, environ)]}"
                 for name, dt in self.tensor_dtypes().items() if dt is not None]
        return f"on the device ({platform}): " + ", ".join(cells)

    def describe(self) -> str:
        """One line naming the dtypes, e.g. for the dry-run report and the startup log."""
        short = {torch.float32: "fp32", torch.bfloat16: "bf16"}
        parts = [f"params {short[self.param_dtype]}",
                 f"compute {short[self.autocast_dtype or self.param_dtype]}"
                 + (" (autocast)" if self.autocast_dtype else ""),
                 f"grad accumulation {'fp32' if self.fp32_grad_acc or not self.low_precision_params else 'bf16'}",
                 f"master weights {'fp32' if self.master_weights else 'none'}",
                 f"optimizer state {short[self.optim_state_dtype]}",
                 f"bf16 update rounding {'stochastic' if self.stochastic_rounding else 'nearest'}"
                 if self.low_precision_params else "no bf16 rounding",
                 f"TP/SP reductions {short[self.reduce_dtype]}"]
        return f"precision {self.mode}: " + ", ".join(parts)

    @property
    def low_precision_params(self) -> bool:
        """True when parameters are bf16 (the optimizer then needs :class:`~nxd_lc.optim.MixedPrecisionOptimizer`)."""
        return self.param_dtype != torch.float32


def device_dtype(dtype: torch.dtype, platform: str, environ: Optional[Mapping[str, str]] = None) -> torch.dtype:
    """The dtype a tensor of ``dtype`` is stored and computed in on ``platform`` (module table of
    ``describe_on_device``).

    On torch-xla ('xla', 'neuron'), pytorch/xla ``torch_xla/csrc/dtype.cpp`` (``MaybeDowncastToXlaDeviceType``):
    under ``XLA_USE_BF16`` float32 and float64 become bf16; under ``XLA_DOWNCAST_BF16`` float32 becomes bf16 and
    float64 float32; on a Neuron device float64 is float32 always. Both flags are read as torch-xla reads them
    (:func:`nxd_lc.runtime.env.preset_bf16_flags`). Elsewhere (CPU, CUDA, the native Neuron device, which has no
    such flags) a dtype is what it says.
    """
    if platform not in ("xla", "neuron"):
        return dtype
    env = os.environ if environ is None else environ
    use_bf16 = flag_on(env.get("XLA_USE_BF16", "0"))
    downcast = flag_on(env.get("XLA_DOWNCAST_BF16", "0"))
    if dtype == torch.float64:
        return torch.bfloat16 if use_bf16 else torch.float32 if (downcast or platform == "neuron") else dtype
    if dtype == torch.float32 and (use_bf16 or downcast):
        return torch.bfloat16
    return dtype


def reduce_dtype(name: Optional[str]) -> torch.dtype:
    """``precision.parallel_layers_reduce_dtype`` -> dtype (None -> fp32, NxD's default).

    Raises:
        ValueError: an unknown spelling (names the key and the accepted values).
    """
    if name is None:
        return torch.float32
    if name not in REDUCE_DTYPES:
        raise ValueError(f"precision.parallel_layers_reduce_dtype: {name!r} is not one of {sorted(REDUCE_DTYPES)}")
    return REDUCE_DTYPES[name]


def resolve_precision(cfg: NxdConfig) -> PrecisionPolicy:
    """The :class:`PrecisionPolicy` of ``cfg.precision`` (type already canonical: ``mixed_precision_SR`` is read
    as ``mixed_precisionSR`` by :func:`nxd_lc.config.structure.typed_config`).

    Raises:
        ValueError: an unknown ``precision.type`` or ``parallel_layers_reduce_dtype``.
    """
    p = cfg.precision
    fp32_state_optim = cfg.model.optim.name == "adamw_fp32OptState"
    bf16, fp32 = torch.bfloat16, torch.float32
    common = {"mode": p.type, "reduce_dtype": reduce_dtype(p.parallel_layers_reduce_dtype),
              "grad_reduce_fp32": bool(p.fp32_grads_cc)}
    if p.type == "fp32":
        return PrecisionPolicy(param_dtype=fp32, autocast_dtype=None, master_weights=False, fp32_grad_acc=False,
                               stochastic_rounding=False, optim_state_dtype=fp32, **common)
    if p.type == "bf16SR":
        return PrecisionPolicy(param_dtype=bf16, autocast_dtype=None, master_weights=False, fp32_grad_acc=False,
                               stochastic_rounding=True, optim_state_dtype=fp32 if fp32_state_optim else bf16,
                               **common)
    if p.type in ("mixed_precision", "mixed_precisionSR"):
        return PrecisionPolicy(param_dtype=bf16, autocast_dtype=None, master_weights=True, fp32_grad_acc=True,
                               stochastic_rounding=p.type == "mixed_precisionSR", optim_state_dtype=fp32, **common)
    if p.type == "autocast":
        return PrecisionPolicy(param_dtype=fp32, autocast_dtype=bf16, master_weights=False, fp32_grad_acc=False,
                               stochastic_rounding=False, optim_state_dtype=fp32, **common)
    if p.type == "manual":
        low = "1" in (str(p.xla_use_bf16), str(p.xla_downcast_bf16))
        master = bool(p.master_weights) and low
        return PrecisionPolicy(
            param_dtype=bf16 if low else fp32, autocast_dtype=None, master_weights=master,
            fp32_grad_acc=bool(p.fp32_grad_acc) and low,
            stochastic_rounding=low and str(p.neuron_rt_stochastic_rounding_en) == "1",
            optim_state_dtype=fp32 if (master or fp32_state_optim or not low) else bf16, **common)
    raise ValueError(f"precision.type: {p.type!r} is not one of {', '.join(PRECISION_TYPES)}")


def apply_precision(model: torch.nn.Module, policy: PrecisionPolicy) -> torch.nn.Module:
    """Put ``model`` in the policy's parameter dtype and set the TP/SP reduce dtype (process-wide).

    Only parameters are cast: buffers keep their dtype (RoPE's fp32 frequency tables stay fp32, as in HF), and so
    do parameters flagged ``keep_fp32`` (the mixture-of-experts router weight, kept in fp32 as NxD does).
    Call before the optimizer is built (master weights are copied from the parameters then).

    Returns:
        ``model`` (cast in place).
    """
    from nxd_lc.distributed.mappings import set_reduce_dtype

    set_reduce_dtype(policy.reduce_dtype)
    for p in model.parameters():
        if p.is_floating_point() and p.dtype != policy.param_dtype and not getattr(p, "keep_fp32", False):
            p.data = p.data.to(policy.param_dtype)
    return model
