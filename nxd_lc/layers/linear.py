"""Tensor-parallel linear layers (NxD / Megatron-LM semantics) and TP sharding helpers.

Shapes: activations are batch-first ``[B, S, H]``; under sequence parallelism the input of a
column layer and the output of a row layer are ``[B, S/tp, H]`` (sequence split over TP).

* :class:`ColumnParallelLinear`: weight ``[out/tp, in]`` (``partition_dim=0``), bias ``[out/tp]``.
  ``[B, S, in]`` -> ``[B, S, out/tp]`` (or ``[B, S, out]`` with ``gather_output``).
* :class:`RowParallelLinear`: weight ``[out, in/tp]`` (``partition_dim=1``), bias ``[out]``
  replicated and added after the reduction. ``[B, S, in/tp]`` -> ``[B, S, out]``.

Sharded parameters carry ``tensor_model_parallel=True``, ``partition_dim`` and ``partition_stride``, and, where
rank ``r`` holds block ``partition_order[r]`` rather than block ``r`` (``o_proj`` under NxD's interleaved KV-replica
layout: its input columns follow the query heads, :mod:`nxd_lc.distributed.kv_layout`), ``partition_order``;
replicated ones ``tensor_model_parallel=False``. A row bias under sequence parallelism carries
``sequence_parallel_enabled=True`` (its gradient only sees this rank's ``S/tp`` tokens and must be
all-reduced over TP, see :mod:`nxd_lc.distributed.grads`).

Initialisation (NxD ``use_cpu_initialization``): with ``use_cpu_initialization=True`` the full
master weight is created on CPU in fp32, initialised with ``init_method`` from the current torch
RNG, and this rank keeps its slice, so TP=N yields exactly the TP=1 weights for the same seed.
Otherwise the local shard is initialised directly on ``device`` from a per-TP-rank seed drawn
from the current RNG (cheaper, but not bit-identical across TP sizes).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from nxd_lc.distributed import collectives, parallel_state
from nxd_lc.distributed.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
    sequence_parallel_linears,
)
from nxd_lc.runtime.accel import HOST, fork_accelerator_rng

InitMethod = Callable[[torch.Tensor], object]


def default_init_method(fan_in: int) -> InitMethod:
    """``U(-1/sqrt(fan_in), 1/sqrt(fan_in))``: what ``nn.Linear.reset_parameters`` gives
    (kaiming_uniform with a=sqrt(5)), using the FULL (unsharded) fan-in."""
    bound = 1.0 / math.sqrt(fan_in) if fan_in > 0 else 0.0
    return lambda w: nn.init.uniform_(w, -bound, bound)


def split_tensor_for_rank(full: torch.Tensor, dim: int, rank: int, world_size: int, stride: int = 1,
                          order: Sequence[int] | None = None) -> torch.Tensor:
    """Rank ``rank``'s shard of ``full`` along ``dim`` (a view/copy, same dtype and device).

    With ``stride > 1`` the dim is first cut into ``stride`` equal blocks (e.g. fused gate/up
    projections) and each block is split over the ranks; the rank's pieces are concatenated.
    ``order``: rank ``r`` takes piece ``order[r]`` (a permutation of the ranks; None: piece ``r``).

    Raises:
        ValueError: if ``full.shape[dim]`` is not divisible by ``world_size * stride``.
    """
    if full.shape[dim] % (world_size * stride) != 0:
        raise ValueError(
            f"cannot shard dim {dim} of size {full.shape[dim]} over tensor_model_parallel_size "
            f"{world_size} with stride {stride}; the size must be a multiple of {world_size * stride}"
        )
    blocks = full.chunk(stride, dim=dim)
    piece = rank if order is None else order[rank]
    return torch.cat([b.chunk(world_size, dim=dim)[piece] for b in blocks], dim=dim)


def merge_tensor_shards(shards: Sequence[torch.Tensor], dim: int, stride: int = 1,
                        order: Sequence[int] | None = None) -> torch.Tensor:
    """Inverse of :func:`split_tensor_for_rank`: ``shards[r]`` is rank r's shard (piece ``order[r]`` when
    given); returns the full tensor."""
    if order is not None:
        by_piece = [shards[0]] * len(shards)
        for r, piece in enumerate(order):
            by_piece[piece] = shards[r]
        shards = by_piece
    pieces = [s.chunk(stride, dim=dim) for s in shards]
    return torch.cat([p[b] for b in range(stride) for p in pieces], dim=dim)


def mark_parameter(param: nn.Parameter, partition_dim: int | None, stride: int = 1,
                   order: Sequence[int] | None = None) -> nn.Parameter:
    """Set the TP attributes: ``partition_dim=None`` marks a TP-replicated parameter; ``order`` (rank ``r`` holds
    piece ``order[r]``) is kept as ``partition_order`` unless it is the identity."""
    param.tensor_model_parallel = partition_dim is not None
    if partition_dim is not None:
        param.partition_dim = partition_dim
        param.partition_stride = stride
        if order is not None and tuple(order) != tuple(range(len(order))):
            param.partition_order = tuple(order)
    return param


def partition_order(param: torch.Tensor) -> tuple[int, ...] | None:
    """The ``partition_order`` of a sharded parameter (None: rank ``r`` holds piece ``r``)."""
    return getattr(param, "partition_order", None)


def shard_full_parameter(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """This TP rank's slice of a full tensor laid out like ``param`` (uses its TP attributes);
    a TP-replicated ``param`` gets ``full`` unchanged.

    Raises:
        ValueError: if the slice's shape differs from ``param``'s.
    """
    if getattr(param, "tensor_model_parallel", False):
        local = split_tensor_for_rank(
            full, param.partition_dim, parallel_state.get_tensor_model_parallel_rank(),
            parallel_state.get_tensor_model_parallel_world_size(), getattr(param, "partition_stride", 1),
            partition_order(param),
        )
    else:
        local = full
    if tuple(local.shape) != tuple(param.shape):
        raise ValueError(
            f"full tensor of shape {tuple(full.shape)} gives a local shard {tuple(local.shape)} but the "
            f"parameter is {tuple(param.shape)}; check the checkpoint matches the model config"
        )
    return local


def gather_full_parameter(param: torch.Tensor) -> torch.Tensor:
    """All-gather a TP-sharded parameter into its full (unsharded) tensor; replicated ones are
    returned detached. Collective over the TP group: every TP rank must call it."""
    data = param.detach()
    if not getattr(param, "tensor_model_parallel", False):
        return data
    world = parallel_state.get_tensor_model_parallel_world_size()
    dim, stride = param.partition_dim, getattr(param, "partition_stride", 1)
    gathered = collectives.all_gather(data, dim, parallel_state.get_tensor_model_parallel_group())
    return merge_tensor_shards(gathered.chunk(world, dim=dim), dim, stride, partition_order(param))


def init_parameter(
    full_shape: tuple[int, ...], partition_dim: int | None, init_method: InitMethod, dtype: torch.dtype,
    device: torch.device | str | None, use_cpu_initialization: bool, stride: int = 1,
    order: Sequence[int] | None = None,
) -> nn.Parameter:
    """Create this rank's (possibly sharded) parameter; see the module docstring for the two modes.

    Args:
        full_shape: the unsharded shape.
        partition_dim: dim split over TP, or None for a TP-replicated parameter.
        order: rank ``r`` holds piece ``order[r]`` of the partitioned dim (None: piece ``r``).
    """
    device = torch.device(device) if device is not None else torch.get_default_device()
    rank = parallel_state.get_tensor_model_parallel_rank()
    world = parallel_state.get_tensor_model_parallel_world_size()
    if use_cpu_initialization or partition_dim is None:
        master = torch.empty(full_shape, dtype=torch.float32, device=HOST)  # same values on every device
        init_method(master)
        local = (master if partition_dim is None
                 else split_tensor_for_rank(master, partition_dim, rank, world, stride, order))
        data = local.to(device=device, dtype=dtype)
    else:
        local_shape = list(full_shape)
        if local_shape[partition_dim] % (world * stride) != 0:
            raise ValueError(
                f"parameter dim {partition_dim} of size {full_shape[partition_dim]} is not divisible by "
                f"tensor_model_parallel_size {world} (x stride {stride})"
            )
        local_shape[partition_dim] //= world
        seed = int(torch.randint(0, 2**31 - 1, (1,)).item()) + 2718 * (rank + 1)
        with fork_accelerator_rng():
            torch.manual_seed(seed)
            data = torch.empty(local_shape, dtype=dtype, device=device)
            init_method(data)
    param = nn.Parameter(data.contiguous())
    return mark_parameter(param, partition_dim, stride, order)


def _zeros_init(t: torch.Tensor) -> object:
    return nn.init.zeros_(t)


class ColumnParallelLinear(nn.Module):
    """``Y = X W^T + b`` with ``W`` split along its output dim: weight ``[out/tp, in]``.

    Forward: ``x [B, S, in]`` (or ``[B, S/tp, in]`` with ``sequence_parallel_enabled``, all-gathered
    on dim 1 here) -> ``[B, S, out/tp]``, or ``[B, S, out]`` with ``gather_output=True``.
    Backward of the input: all-reduce over TP, or reduce-scatter on dim 1 under SP. Under SP only the
    ``[B, S/tp, in]`` shard is kept for the weight gradient and gathered again in backward
    (:func:`~nxd_lc.distributed.mappings.sequence_parallel_linears`, as NxD and Megatron-LM).

    Args:
        stride: ``partition_stride``: the output dim holds ``stride`` equal blocks each split over TP
            (e.g. 2 for a fused ``[gate; up]`` projection so each rank holds its gate and up slices).
        use_cpu_initialization: see the module docstring. Bias is zero-initialised.

    Raises:
        ValueError: ``output_size`` not divisible by TP size x stride; ``gather_output`` together
            with ``sequence_parallel_enabled`` or ``stride > 1``.
    """

    def __init__(
        self, input_size: int, output_size: int, bias: bool = True, gather_output: bool = False,
        sequence_parallel_enabled: bool = False, init_method: InitMethod | None = None,
        dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
        use_cpu_initialization: bool = True, stride: int = 1,
    ) -> None:
        super().__init__()
        world = parallel_state.get_tensor_model_parallel_world_size()
        if output_size % (world * stride) != 0:
            raise ValueError(
                f"ColumnParallelLinear: output_size {output_size} is not divisible by "
                f"tensor_model_parallel_size {world} x stride {stride}"
            )
        if gather_output and (sequence_parallel_enabled or stride > 1):
            raise ValueError(
                "ColumnParallelLinear: gather_output=True cannot be combined with "
                "sequence_parallel_enabled=True or stride > 1; keep the output sharded"
            )
        self.input_size, self.output_size = input_size, output_size
        self.gather_output, self.sequence_parallel_enabled = gather_output, sequence_parallel_enabled
        init = init_method or default_init_method(input_size)
        self.weight = init_parameter((output_size, input_size), 0, init, dtype, device, use_cpu_initialization, stride)
        self.bias = (
            init_parameter((output_size,), 0, _zeros_init, dtype, device, True, stride) if bias else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, S, in]`` (``[B, S/tp, in]`` under SP) -> ``[B, S, out/tp]`` (``[B, S, out]`` gathered)."""
        if self.sequence_parallel_enabled:  # keeps x [B, S/tp, in] for the backward, not the gathered input
            (y,) = sequence_parallel_linears(x, [self.weight], [self.bias])
        else:
            y = F.linear(copy_to_tensor_model_parallel_region(x), self.weight, self.bias)
        return gather_from_tensor_model_parallel_region(y) if self.gather_output else y

    def extra_repr(self) -> str:
        return (f"in={self.input_size}, out={self.output_size}, local_weight={tuple(self.weight.shape)}, "
                f"sequence_parallel={self.sequence_parallel_enabled}")


class RowParallelLinear(nn.Module):
    """``Y = X W^T + b`` with ``W`` split along its input dim: weight ``[out, in/tp]``, bias ``[out]``.

    Forward: ``x [B, S, in/tp]`` (``input_is_parallel=True``; otherwise ``[B, S, in]`` is split
    here) -> partial products summed over TP -> ``[B, S, out]``, or reduce-scattered on dim 1 to
    ``[B, S/tp, out]`` with ``sequence_parallel_enabled``. The bias is added after the reduction.

    ``partition_order``: rank ``r`` holds the block ``partition_order[r]`` of the input columns (the attention
    output projection under NxD's interleaved KV-replica layout, whose input is the rank's query heads:
    :func:`nxd_lc.distributed.kv_layout.query_block_order`); None: block ``r``.

    Raises:
        ValueError: ``input_size`` not divisible by the TP size; ``sequence_parallel_enabled`` or a
            ``partition_order`` with ``input_is_parallel=False``.
    """

    def __init__(
        self, input_size: int, output_size: int, bias: bool = True, input_is_parallel: bool = True,
        sequence_parallel_enabled: bool = False, init_method: InitMethod | None = None,
        dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
        use_cpu_initialization: bool = True, partition_order: Sequence[int] | None = None,
    ) -> None:
        super().__init__()
        world = parallel_state.get_tensor_model_parallel_world_size()
        if input_size % world != 0:
            raise ValueError(
                f"RowParallelLinear: input_size {input_size} is not divisible by "
                f"tensor_model_parallel_size {world}"
            )
        if sequence_parallel_enabled and not input_is_parallel:
            raise ValueError("RowParallelLinear: sequence_parallel_enabled=True requires input_is_parallel=True")
        if partition_order is not None and not input_is_parallel:
            raise ValueError("RowParallelLinear: a partition_order requires input_is_parallel=True (the input is "
                             "split in rank order here)")
        self.input_size, self.output_size = input_size, output_size
        self.input_is_parallel, self.sequence_parallel_enabled = input_is_parallel, sequence_parallel_enabled
        init = init_method or default_init_method(input_size)
        self.weight = init_parameter((output_size, input_size), 1, init, dtype, device, use_cpu_initialization,
                                     order=partition_order)
        self.bias = init_parameter((output_size,), None, _zeros_init, dtype, device, True) if bias else None
        if self.bias is not None and sequence_parallel_enabled:
            self.bias.sequence_parallel_enabled = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, S, in/tp]`` -> ``[B, S, out]`` (``[B, S/tp, out]`` under SP)."""
        if not self.input_is_parallel:
            x = scatter_to_tensor_model_parallel_region(x)
        y = F.linear(x, self.weight)
        if self.sequence_parallel_enabled:
            y = reduce_scatter_to_sequence_parallel_region(y)
        else:
            y = reduce_from_tensor_model_parallel_region(y)
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        return (f"in={self.input_size}, out={self.output_size}, local_weight={tuple(self.weight.shape)}, "
                f"sequence_parallel={self.sequence_parallel_enabled}")
