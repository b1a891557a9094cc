"""RMSNorm (Zhang & Sennrich 2019, arXiv:1910.07467) and LayerNorm (Ba et al. 2016, arXiv:1607.06450), computed
in float32.

Shapes: x [..., H] (e.g. [B, S, H], or [B, S/tp, H] under sequence parallelism) -> same shape and dtype.

``y = weight * x / sqrt(mean(x^2, -1) + eps)``, as HF ``LlamaRMSNorm``: the normalisation in float32, the result
cast back to x's dtype, then multiplied by the weight (in x's dtype); backward keeps only x and the reciprocal RMS
(:class:`_RMSNormFunction`). With ``kernel = "liger"``
(``model.fusions.rms_norm``, :mod:`nxd_lc.layers.fusions`) Liger-Kernel's fused kernel computes the same with the
same casting.

LayerNorm: ``y = weight * (x - mean) / sqrt(var + eps) + bias`` (biased variance, ``torch.nn.LayerNorm``), in
float32, cast back to x's dtype.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from nxd_lc.layers.fusions import liger_rms_norm

__all__ = ["LayerNorm", "RMSNorm", "build_norm"]


class RMSNorm(nn.Module):
    """Root-mean-square layer norm over the last dim.

    Args:
        hidden_size: H, size of the normalised (last) dim.
        eps: added to the mean square before the rsqrt.
        sequence_parallel_enabled: mark ``weight`` with ``sequence_parallel_enabled = True`` so its
            gradient is all-reduced over the TP group (each rank only sees S/tp tokens).
        dtype, device: of the weight (initialised to ones).
    """

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-6,
        sequence_parallel_enabled: bool = False,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if hidden_size <= 0 or eps < 0:
            raise ValueError(f"RMSNorm needs hidden_size > 0 and eps >= 0, got {hidden_size}, {eps}")
        self.hidden_size = hidden_size
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device))
        self.weight.sequence_parallel_enabled = sequence_parallel_enabled
        #: ``torch`` or ``liger`` (set by :func:`nxd_lc.models.common.fusions.apply_fusions`)
        self.kernel = "torch"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., H] -> [..., H], x's dtype."""
        if self.kernel == "liger":
            return liger_rms_norm(x, self.weight, self.eps)
        return _RMSNormFunction.apply(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}"


class _RMSNormFunction(torch.autograd.Function):
    """RMSNorm that keeps only its input and the reciprocal RMS for backward (as Apex's and Liger-Kernel's fused
    RMSNorms do), instead of autograd's float32 copy of x and the normalised output: per token ``e H + 4`` bytes
    instead of ``4 H + e H + 4`` (``e`` = x's element size; in bf16 a third).

    Forward (as HF ``LlamaRMSNorm``): ``r = rsqrt(mean(x^2) + eps)`` and ``xhat = x r`` in float32,
    ``y = xhat.to(dtype) * w.to(dtype)``. Backward, with ``g`` the output gradient and ``gh = (g w).float()`` (the
    derivative of ``y = x r`` with ``r`` depending on ``x``; Zhang & Sennrich 2019, arXiv:1910.07467, eq. 4 ff.):
    ``dx = gh r - r^3 x mean(gh x)``, computed in the order autograd's graph would (so TP layouts round alike),
    ``dw = sum over tokens of g xhat`` (in g's dtype). The price: two more
    casts in backward than autograd's graph (x and ``gh`` to float32, recomputed instead of saved).
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x32 = x.float()  # no op for fp32 input
        rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)  # [..., 1] fp32
        ctx.save_for_backward(x, rstd, weight)
        return (x32 * rstd).to(x.dtype) * weight.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        x, rstd, weight = ctx.saved_tensors
        x32 = x.float()  # no op for fp32 input
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:  # autograd's chain through x32 * rsqrt(mean(x32^2) + eps), in its order
            gh = (grad * weight.to(grad.dtype)).float()
            d_ms = (gh * x32).sum(-1, keepdim=True) * -0.5 * rstd.pow(3)  # d / d(mean(x^2) + eps)
            grad_x = (gh * rstd + d_ms / x.shape[-1] * (2.0 * x32)).to(x.dtype)
        if ctx.needs_input_grad[1]:  # in the gradient's dtype, as autograd would (the sum accumulates in fp32)
            grad_w = (grad * (x32 * rstd).to(grad.dtype)).sum(dim=tuple(range(grad.dim() - 1))).to(weight.dtype)
        return grad_x, grad_w, None


class LayerNorm(nn.Module):
    """Layer norm with weight and bias over the last dim, computed in float32.

    Args:
        hidden_size: H, size of the normalised (last) dim.
        eps: added to the variance.
        sequence_parallel_enabled: mark ``weight`` and ``bias`` ``sequence_parallel_enabled`` (gradients
            all-reduced over TP, as :class:`RMSNorm`).
        dtype, device: of the parameters (weight ones, bias zeros).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-5, sequence_parallel_enabled: bool = False,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> None:
        super().__init__()
        if hidden_size <= 0 or eps < 0:
            raise ValueError(f"LayerNorm needs hidden_size > 0 and eps >= 0, got {hidden_size}, {eps}")
        self.hidden_size, self.eps = hidden_size, eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.zeros(hidden_size, dtype=dtype, device=device))
        for p in (self.weight, self.bias):
            p.sequence_parallel_enabled = sequence_parallel_enabled

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., H] -> [..., H], x's dtype."""
        y = torch.nn.functional.layer_norm(x.float(), (self.hidden_size,), self.weight.float(), self.bias.float(),
                                           self.eps)
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}"


def build_norm(kind: str, hidden_size: int, eps: float, *, sequence_parallel_enabled: bool = False,
               dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> nn.Module:
    """``kind`` ``rmsnorm`` -> :class:`RMSNorm`, ``layernorm`` -> :class:`LayerNorm` (other arguments as theirs).

    Raises:
        ValueError: another ``kind``.
    """
    classes = {"rmsnorm": RMSNorm, "layernorm": LayerNorm}
    if kind not in classes:
        raise ValueError(f"normalization {kind!r} is not supported; use rmsnorm or layernorm")
    return classes[kind](hidden_size, eps, sequence_parallel_enabled=sequence_parallel_enabled, dtype=dtype,
                         device=device)
