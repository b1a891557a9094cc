"""Token routing for mixture-of-experts layers: the top-k router, expert capacity and the load-balancing loss.

Shapes: ``T`` tokens (batch and sequence flattened), ``H`` hidden, ``E`` experts, ``k`` experts per token.

Router (Mixtral, Jiang et al. 2024, arXiv:2401.04088; transformers ``MixtralTopKRouter``): logits
``x @ W_r^T`` [T, E], affinities ``softmax(logits)`` in fp32, the ``k`` largest per token; with
``normalize_top_k_affinities`` (Mixtral: always) the k weights are divided by their sum. Only ``top_k`` routing
is implemented; NxDT's ``sinkhorn`` is refused by the config check.

Load-balancing loss (Switch Transformer, Fedus et al. 2021, arXiv:2101.03961, eqs. 4-6, in the form of
transformers' ``load_balancing_loss_func`` for Mixtral): over all MoE layers' tokens together,
``f_e`` = (top-k assignments to expert e) / (tokens), ``P_e`` = mean affinity of expert e, and
``aux = E * sum_e f_e * P_e``. Both are sums over tokens and layers divided by the token count, so each layer
contributes additive statistics (:class:`RouterStats`); the sums can also be all-reduced over ranks that hold
other tokens of the same batch before the product is formed, which gives the loss of the whole batch.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

__all__ = ["RouterStats", "TopKRouting", "expert_capacity", "load_balancing_loss", "route_top_k"]


class TopKRouting(NamedTuple):
    """One router call's result for T tokens.

    Attributes:
        logits: [T, E] router logits (fp32).
        affinities: [T, E] fp32 softmax of the logits.
        expert_index: [T, k] int64, the chosen experts, highest affinity first.
        weights: [T, k] fp32 affinities of the chosen experts (normalised to sum 1 per token when asked).
    """

    logits: torch.Tensor
    affinities: torch.Tensor
    expert_index: torch.Tensor
    weights: torch.Tensor


class RouterStats(NamedTuple):
    """Additive statistics of the load-balancing loss for one or more layers' tokens.

    Attributes:
        assignments: [E] fp32 count of top-k assignments per expert (no gradient).
        affinity_sum: [E] fp32 sum over tokens of each expert's affinity (differentiable).
        tokens: 0-dim fp32 number of routed tokens.
    """

    assignments: torch.Tensor
    affinity_sum: torch.Tensor
    tokens: torch.Tensor

    def __add__(self, other: object) -> RouterStats:  # type: ignore[override]
        if not isinstance(other, RouterStats):
            return NotImplemented
        return RouterStats(self.assignments + other.assignments, self.affinity_sum + other.affinity_sum,
                           self.tokens + other.tokens)

    def flat(self) -> torch.Tensor:
        """``[assignments (E), affinity_sum (E), tokens]`` as one [2E + 1] fp32 tensor (for one collective or one
        pipeline send; the affinity part keeps its gradient)."""
        return torch.cat([self.assignments, self.affinity_sum, self.tokens.reshape(1)]).float()

    @classmethod
    def from_flat(cls, flat: torch.Tensor, num_experts: int) -> RouterStats:
        """The inverse of :meth:`flat` (assignments and tokens detached, as they carry no gradient)."""
        e = num_experts
        return cls(flat[:e].detach(), flat[e:2 * e], flat[2 * e].detach())

    @classmethod
    def of(cls, routing: TopKRouting, num_experts: int) -> RouterStats:
        """Statistics of one routing result (all T tokens count)."""
        counts = torch.zeros(num_experts, dtype=torch.float32, device=routing.logits.device)
        counts = counts.scatter_add(0, routing.expert_index.reshape(-1),
                                    torch.ones(routing.expert_index.numel(), device=counts.device))
        # made on the device (a factory op), not uploaded: torch.tensor(..., device=) was a host-to-device copy per
        # MoE layer and micro-batch (on the native neuron device's stand-in: 8 of an ordinary step's 16)
        tokens = torch.full((), float(routing.logits.shape[0]), dtype=torch.float32, device=counts.device)
        return cls(counts.detach(), routing.affinities.sum(dim=0), tokens)


def route_top_k(x: torch.Tensor, router_weight: torch.Tensor, top_k: int,
                normalize_top_k_affinities: bool = True) -> TopKRouting:
    """Top-k routing of ``x`` [T, H] with ``router_weight`` [E, H].

    The logits are computed in fp32 (x and the weight upcast: NxD keeps its router in fp32; for fp32 models this
    equals transformers' ``F.linear`` then ``softmax(logits.float())``). Ties in ``torch.topk`` go to the lower
    expert index.

    Raises:
        ValueError: ``top_k`` not in ``[1, E]`` or shapes that disagree.
    """
    num_experts = router_weight.shape[0]
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"model.moe.top_k must be between 1 and num_experts ({num_experts}), got {top_k}")
    if x.dim() != 2 or x.shape[1] != router_weight.shape[1]:
        raise ValueError(f"router input must be [T, {router_weight.shape[1]}], got {tuple(x.shape)}")
    logits = F.linear(x.float(), router_weight.float())
    affinities = torch.softmax(logits, dim=-1)
    weights, index = torch.topk(affinities, top_k, dim=-1)
    if normalize_top_k_affinities:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return TopKRouting(logits, affinities, index, weights)


def expert_capacity(num_tokens: int, num_experts: int, top_k: int, capacity_factor: float) -> int:
    """Tokens each expert accepts per call: ``ceil(capacity_factor * T * k / E)`` (Switch Transformer's expert
    capacity with k assignments per token; NxD's ``capacity_factor``), at least 1 and at most T.

    Raises:
        ValueError: ``capacity_factor`` <= 0.
    """
    if capacity_factor <= 0:
        raise ValueError(f"model.moe.capacity_factor must be > 0 for capacity-limited routing, got {capacity_factor}")
    return max(1, min(num_tokens, math.ceil(capacity_factor * num_tokens * top_k / num_experts)))


def load_balancing_loss(stats: RouterStats, num_experts: int) -> torch.Tensor:
    """``E * sum_e (assignments_e / tokens) * (affinity_sum_e / tokens)`` (module docstring): 0-dim fp32, 1.0 for
    perfectly uniform routing with k = 1, k for uniform routing with k experts per token."""
    return num_experts * torch.sum((stats.assignments / stats.tokens) * (stats.affinity_sum / stats.tokens))
