"""Mixture-of-experts feed-forward layer over tensor, sequence and expert parallelism.

Shapes: ``B`` micro batch, ``S`` sequence, ``H`` hidden, ``I`` expert intermediate size, ``E`` experts, ``k``
experts per token, ``T = B*S`` tokens of the TP region, ``C`` slots per expert, ``tp`` / ``ep`` the TP / EP sizes.

    x, output            [B, S, H], or [B, S/tp, H] under sequence parallelism
    router.weight        [E, H] fp32, TP- and EP-replicated
    experts.gate_up_proj [E/ep, 2I/tp, H]: expert e's ``[gate; up]`` rows (HF ``MixtralExperts`` layout per
                         expert), each half split over TP as in :class:`~nxd_lc.models.common.mlp.LlamaMLP`
    experts.down_proj    [E/ep, H, I/tp]

Forward (GShard/Switch-style slot dispatch, Lepikhin et al. 2020, arXiv:2006.16668; Fedus et al. 2021):

1. route every token of this rank (:func:`~nxd_lc.moe.routing.route_top_k`, fp32) -- on the local ``S/tp``
   shard under sequence parallelism, so the router's gradient is summed over TP like a norm weight's;
2. enter the TP region: all-gather x (SP) or copy (no SP), together with the routing;
3. give each (token, expert) pair a slot: its rank among that expert's tokens in flattened ``(b, s)`` order.
   With ``capacity_factor`` (and ``dropless: false``) an expert keeps ``C = ceil(cf * T * k / E)`` slots
   (:func:`~nxd_lc.moe.routing.expert_capacity`); later tokens beyond ``C`` are dropped for that expert (NxD's
   order: first and second choices compete equally). Dropless: ``C`` = the largest expert load in the EP
   group, nothing is dropped (one host read of the load per call); on XLA ``C = T`` (static, no host read);
4. the kept pairs' top-k affinities are renormalised to sum 1 per token when ``normalize_top_k_affinities``
   (after dropping, as NxD; a token that lost every expert outputs 0, the residual carries it);
5. scatter tokens into ``[E, C, H]`` slots, all-to-all over EP (each rank receives ``[E/ep, ep*C, H]`` for its
   experts), run the SwiGLU experts with batched GEMMs (partial sums over TP), all-to-all back;
6. combine: each token's weighted sum of its experts' outputs, leaving the TP region (reduce-scatter under SP,
   all-reduce otherwise).

Gradients: the routing weights multiply TP-partial expert outputs, so their gradient is summed over TP (the
gather / copy of step 2); expert parameters are flagged ``expert_model_parallel`` (their gradients are reduced
over the expert-data-parallel group, not DP).

Load-balancing statistics (:class:`~nxd_lc.moe.routing.RouterStats`) of the layer's tokens are returned with the
output; under sequence parallelism they are summed over TP (identity backward: every TP rank computes the same
loss from them).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nxd_lc.distributed import collectives, parallel_state
from nxd_lc.distributed.mappings import (
    all_to_all_expert_parallel_region,
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from nxd_lc.layers.linear import InitMethod, init_parameter, mark_parameter, split_tensor_for_rank
from nxd_lc.moe.routing import RouterStats, expert_capacity, route_top_k
from nxd_lc.runtime.accel import HOST, compiles_per_shape

__all__ = ["ExpertMLPs", "MoE", "mark_expert_parameter"]


def mark_expert_parameter(param: nn.Parameter) -> nn.Parameter:
    """Flag an expert parameter: dim 0 (experts) is split over the EP group and its gradient is reduced over
    the expert-data-parallel group (NxD's ``expert_model_parallel`` attribute)."""
    param.expert_model_parallel = True
    return param


class ExpertMLPs(nn.Module):
    """This rank's ``E/ep`` SwiGLU experts (HF ``MixtralExperts``: ``down(silu(gate(x)) * up(x))``), TP-sharded.

    Args:
        num_experts: E (divisible by the EP size).
        hidden_size: H.
        intermediate_size: I (divisible by the TP size).
        init_method: in-place init of a full weight; the full ``[E, 2I, H]`` / ``[E, H, I]`` tensors are
            initialised on the host and sliced (same values at every TP / EP layout).
        dtype, device: of the parameters.
        output_init_method: init of ``down_proj`` (default ``init_method``).

    Raises:
        ValueError: E not divisible by EP, or I not divisible by TP.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, init_method: InitMethod,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
                 output_init_method: InitMethod | None = None) -> None:
        super().__init__()
        ep = parallel_state.get_expert_model_parallel_world_size()
        tp = parallel_state.get_tensor_model_parallel_world_size()
        if num_experts % ep:
            raise ValueError(f"model.moe.num_experts ({num_experts}) must be divisible by "
                             f"distributed_strategy.expert_model_parallel_size ({ep})")
        if intermediate_size % tp:
            raise ValueError(f"the expert intermediate_size ({intermediate_size}) must be divisible by "
                             f"tensor_model_parallel_size ({tp})")
        self.num_experts, self.num_local_experts = num_experts, num_experts // ep
        self.first_expert = parallel_state.get_expert_model_parallel_rank() * self.num_local_experts
        self.gate_up_proj = self._init((num_experts, 2 * intermediate_size, hidden_size), 1, 2, init_method,
                                       dtype, device)
        self.down_proj = self._init((num_experts, hidden_size, intermediate_size), 2, 1,
                                    output_init_method or init_method, dtype, device)

    def _init(self, full_shape: tuple[int, int, int], partition_dim: int, stride: int, init_method: InitMethod,
              dtype: torch.dtype, device: torch.device | str | None) -> nn.Parameter:
        master = torch.empty(full_shape, dtype=torch.float32, device=HOST)
        init_method(master)
        local = master[self.first_expert:self.first_expert + self.num_local_experts]
        local = split_tensor_for_rank(local, partition_dim, parallel_state.get_tensor_model_parallel_rank(),
                                      parallel_state.get_tensor_model_parallel_world_size(), stride)
        device = torch.device(device) if device is not None else torch.get_default_device()
        param = nn.Parameter(local.to(device=device, dtype=dtype).contiguous())
        return mark_expert_parameter(mark_parameter(param, partition_dim, stride))

    def forward(self, slots: torch.Tensor) -> torch.Tensor:
        """slots [E/ep, N, H] (expert-major token slots) -> [E/ep, N, H] partial sums over TP."""
        gate, up = torch.bmm(slots, self.gate_up_proj.transpose(1, 2)).chunk(2, dim=-1)  # [E/ep, N, I/tp]
        return torch.bmm(F.silu(gate) * up, self.down_proj.transpose(1, 2))


class MoE(nn.Module):
    """Top-k routed mixture of SwiGLU experts (module docstring); ``forward`` returns ``(y, RouterStats)``.

    Args:
        hidden_size, intermediate_size, num_experts, top_k: H, I, E, k (NxDT ``model.moe.num_experts`` /
            ``top_k``; HF ``num_local_experts`` / ``num_experts_per_tok``).
        capacity_factor: slots per expert relative to a uniform load (``model.moe.capacity_factor``); None or
            <= 0: no capacity limit.
        dropless: never drop tokens (``model.moe.dropless``; overrides ``capacity_factor``).
        normalize_top_k_affinities: renormalise the kept top-k affinities per token (Mixtral: true).
        sequence_parallel: x and the output are ``[B, S/tp, H]``.
        init_method: in-place init of full weights (router and experts).
        output_init_method: init of the experts' ``down_proj`` (default ``init_method``; Megatron's scaled init).
        dtype, device: of the expert parameters (the router weight is fp32).

    Raises:
        ValueError: bad sizes (see :class:`ExpertMLPs`), ``top_k`` outside ``[1, E]``.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, *,
                 capacity_factor: float | None = None, dropless: bool = True,
                 normalize_top_k_affinities: bool = True, sequence_parallel: bool = False,
                 init_method: InitMethod, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None, output_init_method: InitMethod | None = None) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"model.moe.top_k must be between 1 and model.moe.num_experts ({num_experts}), "
                             f"got {top_k}")
        self.num_experts, self.top_k = num_experts, top_k
        self.capacity_factor = None if dropless or not capacity_factor or capacity_factor <= 0 else capacity_factor
        self.normalize_top_k_affinities = normalize_top_k_affinities
        self.sequence_parallel = sequence_parallel
        self.router = nn.Linear(hidden_size, num_experts, bias=False, device="meta")  # weight replaced below
        # full [E, H] fp32 weight initialised on the host (same values at every layout), TP-replicated
        self.router.weight = init_parameter((num_experts, hidden_size), None, init_method, torch.float32, device,
                                            use_cpu_initialization=True)
        self.router.weight.sequence_parallel_enabled = sequence_parallel  # grads summed over TP (local tokens)
        self.router.weight.keep_fp32 = True  # stays fp32 in bf16 precision modes (apply_precision), as NxD's router
        self.experts = ExpertMLPs(num_experts, hidden_size, intermediate_size, init_method, dtype, device,
                                  output_init_method)

    def _enter_tp_region(self, x: torch.Tensor, weights: torch.Tensor,
                         index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Local x [B, s, H], top-k weights / index [B, s, k] -> the TP region's [B, S, ...] tensors."""
        if self.sequence_parallel:
            group = parallel_state.get_tensor_model_parallel_group()
            return (gather_from_sequence_parallel_region(x, to_model_parallel=True),
                    gather_from_sequence_parallel_region(weights, to_model_parallel=True),
                    collectives.all_gather(index, 1, group))
        return copy_to_tensor_model_parallel_region(x), copy_to_tensor_model_parallel_region(weights), index

    def _stats(self, routing_stats: RouterStats) -> RouterStats:
        """Sum the statistics over TP under sequence parallelism (each TP rank routed its own tokens)."""
        if not self.sequence_parallel or parallel_state.get_tensor_model_parallel_world_size() == 1:
            return routing_stats
        group = parallel_state.get_tensor_model_parallel_group()
        tp = parallel_state.get_tensor_model_parallel_world_size()
        return RouterStats(collectives.all_reduce(routing_stats.assignments.clone(), group),
                           reduce_from_tensor_model_parallel_region(routing_stats.affinity_sum),
                           routing_stats.tokens * tp)

    def _capacity(self, load: torch.Tensor, tokens: int) -> int:
        """Slots per expert: the capacity-factor formula, or (dropless) the largest load over the EP group; on XLA
        (dropless) every token: an expert takes a token at most once, so ``T`` slots drop nothing, with static
        shapes and no host read (the largest load is data: a host read in every MoE layer, and a new graph, i.e.
        a compile, for every new value; under pipeline parallelism the reads also broke the stages' ordered graph
        cuts). NxD's dropless training likewise runs every expert over every token. The same on TorchNeuron's native
        device (:func:`~nxd_lc.runtime.accel.compiles_per_shape`: the read waits for the device, and every new
        capacity is a new shape, i.e. a compile, for the dispatch ops)."""
        if self.capacity_factor is not None:
            return expert_capacity(tokens, self.num_experts, self.top_k, self.capacity_factor)
        if load.device.type == "xla" or compiles_per_shape(load.device):
            return tokens
        peak = load.max().reshape(1).to(torch.int64)
        group = parallel_state.get_expert_model_parallel_group()
        if collectives.group_size(group) > 1:
            peak = collectives.all_reduce(peak.clone(), group, op="max")
        return max(1, int(peak.item()))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, RouterStats]:
        """x [B, S(/tp), H] -> (y [B, S(/tp), H], this layer's :class:`RouterStats`)."""
        b, s_local, h = x.shape
        routing = route_top_k(x.reshape(-1, h), self.router.weight, self.top_k, normalize_top_k_affinities=False)
        stats = self._stats(RouterStats.of(routing, self.num_experts))
        k, e = self.top_k, self.num_experts
        x_tp, weights, index = self._enter_tp_region(x, routing.weights.view(b, s_local, k),
                                                     routing.expert_index.view(b, s_local, k))
        tokens = x_tp.shape[0] * x_tp.shape[1]
        index, weights = index.reshape(tokens, k), weights.reshape(tokens, k)
        chosen = torch.zeros(tokens, e, dtype=torch.int64, device=x.device).scatter_(1, index, 1)  # [T, E]
        capacity = self._capacity(chosen.sum(0), tokens)
        slot = (chosen.cumsum(0) - 1).gather(1, index)  # [T, k]: rank of the token among the expert's tokens
        kept = slot < capacity
        weights = weights * kept
        if self.normalize_top_k_affinities:
            weights = weights / weights.sum(-1, keepdim=True).clamp_min(torch.finfo(weights.dtype).tiny)
        flat_slot = torch.where(kept, index * capacity + slot, e * capacity).reshape(-1)  # dropped -> spare row
        src = x_tp.reshape(tokens, 1, h).expand(tokens, k, h).reshape(tokens * k, h)
        slots = x_tp.new_zeros(e * capacity + 1, h).index_add(0, flat_slot, src)[:-1].view(e, capacity, h)
        slots = all_to_all_expert_parallel_region(slots, 0, 1)  # [E/ep, ep*C, H]
        out = all_to_all_expert_parallel_region(self.experts(slots), 1, 0)  # [E, C, H] partial over TP
        out = torch.cat([out.reshape(e * capacity, h), out.new_zeros(1, h)])[flat_slot].view(tokens, k, h)
        y = (out * weights.to(out.dtype).unsqueeze(-1)).sum(1).view(x_tp.shape)  # [B, S, H] partial over TP
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(y), stats
        return reduce_from_tensor_model_parallel_region(y), stats
