"""Software stochastic rounding from fp32 to bf16.

On Trainium the Neuron runtime rounds fp32 -> bf16 stochastically in hardware when
``NEURON_RT_STOCHASTIC_ROUNDING_EN=1`` (NxDT precision types ``bf16SR`` and
``mixed_precisionSR``). Off Neuron we do the same rounding in software so that a bf16
parameter receiving many updates far below half a bf16 ulp still moves, on average, by the
exact fp32 amount instead of stalling as it does under round-to-nearest-even.

Method (the standard bit trick). bf16 is the upper 16 bits of the fp32 bit pattern. Let
``b`` be the fp32 bit pattern of ``x`` read as an integer and ``r ~ U{0, ..., 2**16 - 1}``.
Then::

    SR(x) = bf16_from_bits((b + r) & 0xFFFF0000)

For finite ``x`` lying between its two bf16 neighbours ``lo <= x < hi`` (``hi = lo + ulp``
in magnitude), with ``f = (b & 0xFFFF) / 2**16`` the fraction of an ulp that ``|x|`` lies
above ``|lo|``, the carry into the upper half happens with probability ``f``, so::

    P(SR(x) = hi) = f,   P(SR(x) = lo) = 1 - f,   E[SR(x)] = lo + f * ulp = x.

Because IEEE patterns are sign-magnitude, the trick acts on ``|x|`` and keeps the sign, so
negative values are rounded away from / toward zero with the same probabilities. A carry out
of the mantissa increments the exponent, which is exactly the next bf16 value (e.g. values
just below 2.0 round up to 2.0). Infinities have zero low bits and are unchanged; NaN is
mapped explicitly to NaN (a NaN pattern plus ``r`` could otherwise wrap to an infinity or
zero). Finite fp32 values above the largest finite bf16 round up to ``inf`` with probability
``f``, the same place round-to-nearest overflows.

Where the rounding happens (:func:`hardware_rounding`): on a Neuron device (torch-xla with
``PJRT_DEVICE=NEURON``, or the native ``neuron`` device) with ``NEURON_RT_STOCHASTIC_ROUNDING_EN=1`` -- which the
SR modes set (:mod:`nxd_lc.runtime.env`) -- the runtime already rounds every fp32 -> bf16 conversion
stochastically, so the optimizer's write-back is a plain cast there and this module does not round a second
time. Everywhere else (CPU, CUDA, torch-xla on CPU, a Neuron device with the variable '0') this module rounds. The
hardware path has not run here (no Trainium).

Sources: Gupta et al. 2015, "Deep Learning with Limited Numerical Precision" (stochastic
rounding, E[round(x)] = x); Zamirai et al. 2020, "Revisiting BFloat16 Training"
(stochastic rounding of the bf16 weight update).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch
from torch import Tensor

from nxd_lc.runtime.env import flag_on
from nxd_lc.runtime.xla import bitcast_float32_int32, xla_hardware

__all__ = ["hardware_rounding", "stochastic_round_to_bf16", "sr_add_"]

_LOW_BITS = 16
_HIGH_MASK = -(1 << _LOW_BITS)  # 0xFFFF0000 as a signed int32


def hardware_rounding(device: torch.device, environ: Mapping[str, str] | None = None) -> bool:
    """True where Neuron's runtime rounds fp32 -> bf16 stochastically itself (module docstring): ``device`` is a
    Neuron device -- the native ``neuron`` device, or an XLA device whose PJRT hardware is NEURON -- and
    ``NEURON_RT_STOCHASTIC_ROUNDING_EN`` is 1 in ``environ`` (default ``os.environ``). Callers then cast instead of
    calling :func:`stochastic_round_to_bf16`."""
    env = os.environ if environ is None else environ
    if not flag_on(env.get("NEURON_RT_STOCHASTIC_ROUNDING_EN", "0")):
        return False
    if device.type == "neuron":
        return True
    return device.type == "xla" and xla_hardware() == "NEURON"


def _check_generator(generator: torch.Generator | None, device: torch.device) -> None:
    """Raise ValueError if ``generator`` lives on a different device type than ``device``."""
    if generator is not None and generator.device.type != device.type:
        raise ValueError(
            f"stochastic rounding: generator is on device '{generator.device}' but the tensor "
            f"is on '{device}'; create the generator with torch.Generator(device='{device.type}')"
        )


def stochastic_round_to_bf16(x: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """Round an fp32 tensor to bf16 stochastically and without bias.

    Each element becomes one of its two bf16 neighbours, the upper one with probability
    equal to the fraction of a bf16 ulp by which it exceeds the lower one, so
    ``E[stochastic_round_to_bf16(x)] == x`` elementwise (Gupta et al. 2015). Values exactly
    representable in bf16, ``+-0``, ``+-inf`` are returned unchanged and NaN stays NaN.
    See the module docstring for the bit trick and its derivation.

    Args:
        x: fp32 tensor of any shape, on any device.
        generator: optional ``torch.Generator`` on the same device type as ``x`` for
            reproducible rounding; ``None`` uses the global default generator.

    Returns:
        bf16 tensor with the same shape and device as ``x``.

    Raises:
        ValueError: if ``x`` is not float32, or ``generator`` is on another device type.
    """
    if x.dtype != torch.float32:
        raise ValueError(
            f"stochastic_round_to_bf16 expects a float32 tensor, got {x.dtype}; "
            "cast with x.float() first"
        )
    _check_generator(generator, x.device)
    on_xla = x.device.type == "xla"  # Tensor.view(dtype) is a host round trip there: XLA's bit cast instead
    bits = bitcast_float32_int32(x) if on_xla else x.contiguous().view(torch.int32)
    noise = torch.randint(
        0, 1 << _LOW_BITS, bits.shape, dtype=torch.int32, device=x.device, generator=generator
    )
    # The low 16 bits are zero after masking, so the fp32 -> bf16 cast below is exact.
    masked = (bits + noise) & _HIGH_MASK
    rounded = bitcast_float32_int32(masked, to_int=False) if on_xla else masked.view(torch.float32)
    rounded = torch.where(torch.isnan(x), x, rounded)
    return rounded.to(torch.bfloat16)


def sr_add_(
    param: Tensor, update: Tensor, generator: torch.Generator | None = None
) -> Tensor:
    """In place ``param <- SR_bf16(fp32(param) + update)``: a bf16 update without stalling.

    The sum is formed in fp32 (exact for a bf16 ``param``, rounded once by fp32 addition)
    and stochastically rounded back to bf16, so the expected new parameter equals the fp32
    result; this is the fp32 -> bf16 parameter update of NxDT's ``bf16SR`` precision mode
    done in software (Zamirai et al. 2020, "Revisiting BFloat16 Training"). Runs under
    ``torch.no_grad()`` so it is safe on leaf parameters that require grad.

    Args:
        param: bf16 tensor, any shape [*]; modified in place.
        update: fp32 tensor with exactly the shape of ``param``, on the same device
            (e.g. ``-lr * step`` from an optimizer).
        generator: optional ``torch.Generator`` on ``param``'s device type.

    Returns:
        ``param`` (the same tensor object), for chaining.

    Raises:
        ValueError: if ``param`` is not bf16, ``update`` is not fp32, shapes differ, or the
            devices differ.
    """
    if param.dtype != torch.bfloat16:
        raise ValueError(f"sr_add_: param must be bfloat16, got {param.dtype}")
    if update.dtype != torch.float32:
        raise ValueError(
            f"sr_add_: update must be float32, got {update.dtype}; pass update.float()"
        )
    if update.shape != param.shape:
        raise ValueError(
            f"sr_add_: update shape {tuple(update.shape)} != param shape {tuple(param.shape)}"
        )
    if update.device != param.device:
        raise ValueError(
            f"sr_add_: update is on {update.device} but param is on {param.device}"
        )
    with torch.no_grad():
        total = param.float() + update
        param.copy_(stochastic_round_to_bf16(total, generator))
    return param
