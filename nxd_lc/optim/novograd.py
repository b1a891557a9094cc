"""NovoGrad: Adam-like optimizer with a layer-wise (per-tensor) second moment.

Paper: B. Ginsburg et al., "Stochastic Gradient Methods with Layer-wise Adaptive Moments for Training of Deep
Networks", arXiv:1905.11286 (2019). Update rule as in NeMo's ``nemo/core/optim/novograd.py`` (read for the
formula; this is our own implementation), without NeMo's optional layer-wise update clipping (``luc``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch


class Novograd(torch.optim.Optimizer):
    """NovoGrad with NeMo's update rule, per parameter tensor ``p`` with gradient ``g`` at step ``t``::

        n_t   = ||g||_2^2                                 while n_{t-1} == 0 (first step; as NeMo)
        n_t   = beta2 * n_{t-1} + (1 - beta2) * ||g||_2^2   otherwise   (a scalar per tensor)
        d_t   = g / (sqrt(n_t) + eps)               (amsgrad: sqrt(max_{s<=t} n_s))
        d_t  += weight_decay * p                    (L2 added after normalisation, as NeMo)
        d_t  *= (1 - beta1)                         only when grad_averaging
        m_t   = beta1 * m_{t-1} + d_t
        p    -= lr * m_t

    State per parameter: ``step`` (int), ``exp_avg`` (like ``p``), ``exp_avg_sq`` (0-dim tensor, fp32 for
    reduced-precision params) and ``max_exp_avg_sq`` (0-dim, amsgrad only). The gradient is not modified.

    Under tensor parallelism each rank sees only its shard, so ``||g||`` is the shard's norm (NeMo behaves the
    same on a Megatron shard); parameters replicated over TP get identical updates on every rank.

    Args:
        params: parameters or parameter groups.
        lr: learning rate (> 0 expected; >= 0 accepted).
        betas: ``(beta1, beta2)``, each in [0, 1). NeMo default (0.95, 0.98).
        eps: added to ``sqrt(n_t)``.
        weight_decay: L2 coefficient (>= 0).
        grad_averaging: scale the normalised gradient by ``1 - beta1`` before the momentum update.
        amsgrad: use the running maximum of ``n_t``.

    Raises:
        ValueError: a hyper-parameter out of range (message names it); a sparse gradient at ``step``.
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.95, 0.98),
                 eps: float = 1e-8, weight_decay: float = 0.0, grad_averaging: bool = False,
                 amsgrad: bool = False) -> None:
        if lr < 0.0:
            raise ValueError(f"Novograd: lr must be >= 0, got {lr}")
        if eps < 0.0:
            raise ValueError(f"Novograd: eps must be >= 0, got {eps}")
        if not all(0.0 <= b < 1.0 for b in betas) or len(betas) != 2:
            raise ValueError(f"Novograd: betas must be two values in [0, 1), got {betas}")
        if weight_decay < 0.0:
            raise ValueError(f"Novograd: weight_decay must be >= 0, got {weight_decay}")
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay,
                    "grad_averaging": grad_averaging, "amsgrad": amsgrad}
        super().__init__(params, defaults)

    def _state_for(self, p: torch.Tensor, amsgrad: bool) -> dict[str, Any]:
        """Lazily initialised state of ``p`` (second moments kept in at least fp32)."""
        state = self.state[p]
        if not state:
            moment_dtype = torch.promote_types(p.dtype, torch.float32)
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros((), dtype=moment_dtype, device=p.device)
            if amsgrad:
                state["max_exp_avg_sq"] = torch.zeros((), dtype=moment_dtype, device=p.device)
        return state

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One NovoGrad update of every parameter that has a gradient; returns ``closure()`` if given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise ValueError("Novograd: sparse gradients are not supported; use dense embeddings")
                self._update(p, group, beta1, beta2)
        return loss

    def _update(self, p: torch.Tensor, group: dict[str, Any], beta1: float, beta2: float) -> None:
        """Apply the update rule of the class docstring to one parameter tensor."""
        state = self._state_for(p, group["amsgrad"])
        state["step"] += 1
        exp_avg_sq: torch.Tensor = state["exp_avg_sq"]
        grad = p.grad
        norm_sq = grad.to(exp_avg_sq.dtype).pow(2).sum()
        blended = exp_avg_sq * beta2 + norm_sq * (1.0 - beta2)
        exp_avg_sq.copy_(torch.where(exp_avg_sq == 0, norm_sq, blended))  # no host sync
        second = exp_avg_sq
        if group["amsgrad"]:
            torch.maximum(state["max_exp_avg_sq"], exp_avg_sq, out=state["max_exp_avg_sq"])
            second = state["max_exp_avg_sq"]
        update = grad / (second.sqrt() + group["eps"]).to(grad.dtype)
        if group["weight_decay"] != 0.0:
            update = update.add(p, alpha=group["weight_decay"])
        if group["grad_averaging"]:
            update = update.mul(1.0 - beta1)
        exp_avg: torch.Tensor = state["exp_avg"]
        exp_avg.mul_(beta1).add_(update)
        p.add_(exp_avg, alpha=-group["lr"])
