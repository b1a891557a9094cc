"""The one place that calls ``torch.distributed`` collectives.

Every other module of nxd_lc goes through these functions, so a new backend (torch-xla in a
later issue) only has to be taught here. All functions are plain tensor operations without
autograd; :mod:`nxd_lc.distributed.mappings` wraps them in autograd functions.

Conventions
-----------
* ``group=None`` means "no process group": either ``torch.distributed`` is not initialised
  (single-process reference runs, unit tests) or the caller's group getter returned ``None``.
  Every collective is then a no-op that returns its input (world size 1). The default world
  group is never used implicitly; :mod:`nxd_lc.distributed.parallel_state` hands out groups.
* A collective over a group of size 1 is also a no-op (no communication is issued).
* ``dim`` arguments follow the tensor's own layout (e.g. 1 = sequence for ``[B, S, H]``) and
  may be negative.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

ProcessGroup = dist.ProcessGroup

_REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
}
_BACKENDS = {"cpu": "gloo", "cuda": "nccl"}


def default_backend(device_type: str) -> str:
    """Return the torch.distributed backend for a device type: ``'gloo'`` (cpu), ``'nccl'`` (cuda).

    Raises:
        ValueError: for any other device type (XLA/Neuron devices are added in a later issue).
    """
    if device_type not in _BACKENDS:
        raise ValueError(
            f"default_backend: unsupported device type {device_type!r}; expected one of "
            f"{sorted(_BACKENDS)} (XLA/Neuron backends are not implemented yet)"
        )
    return _BACKENDS[device_type]


def is_initialized() -> bool:
    """True when ``torch.distributed`` is available and its default group is initialised."""
    return dist.is_available() and dist.is_initialized()


def get_global_rank() -> int:
    """Rank in the default (world) group, 0 when torch.distributed is not initialised."""
    return dist.get_rank() if is_initialized() else 0


def get_global_world_size() -> int:
    """Size of the default (world) group, 1 when torch.distributed is not initialised."""
    return dist.get_world_size() if is_initialized() else 1


def group_size(group: ProcessGroup | None) -> int:
    """Number of ranks in ``group``; 1 for ``group=None``."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: ProcessGroup | None) -> int:
    """This process's rank inside ``group``; 0 for ``group=None``."""
    return 0 if group is None else dist.get_rank(group)


def new_group(ranks: Sequence[int]) -> ProcessGroup:
    """Create a process group over global ``ranks``.

    Like ``torch.distributed.new_group`` this must be called by every process of the world
    group with the same ``ranks``, in the same order, even by processes not in ``ranks``.
    """
    return dist.new_group(ranks=list(ranks))


def destroy_group(group: ProcessGroup) -> None:
    """Release a group created by :func:`new_group` (best effort, ignores already-gone groups)."""
    try:
        dist.destroy_process_group(group)
    except (ValueError, RuntimeError, AssertionError):
        pass


def _backend(group: ProcessGroup) -> str:
    return str(dist.get_backend(group)).lower()


def all_reduce(tensor: torch.Tensor, group: ProcessGroup | None, op: str = "sum") -> torch.Tensor:
    """In-place all-reduce of ``tensor`` over ``group``; returns ``tensor``.

    Args:
        op: ``'sum'``, ``'max'``, ``'min'`` or ``'avg'`` (avg = sum / group size, which works on
            gloo that has no native AVG).

    Raises:
        ValueError: for an unknown ``op``.
    """
    if op not in _REDUCE_OPS and op != "avg":
        raise ValueError(f"all_reduce: unknown op {op!r}; expected sum, max, min or avg")
    size = group_size(group)
    if size == 1:
        return tensor
    dist.all_reduce(tensor, op=_REDUCE_OPS["sum" if op == "avg" else op], group=group)
    if op == "avg":
        tensor.div_(size)
    return tensor


def all_gather(tensor: torch.Tensor, dim: int, group: ProcessGroup | None) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along ``dim`` in group-rank order (new tensor).

    Shapes: input ``[..., n, ...]`` (same shape on every rank) -> output ``[..., n * world, ...]``.
    """
    size = group_size(group)
    if size == 1:
        return tensor
    tensor = tensor.contiguous()
    if _backend(group) == "nccl" and dim % tensor.dim() == 0:
        out = tensor.new_empty((tensor.shape[0] * size, *tensor.shape[1:]))
        dist.all_gather_into_tensor(out, tensor, group=group)
        return out
    parts = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(parts, tensor, group=group)
    return torch.cat(parts, dim=dim)


def reduce_scatter(tensor: torch.Tensor, dim: int, group: ProcessGroup | None) -> torch.Tensor:
    """Sum ``tensor`` over ``group`` and keep this rank's chunk along ``dim`` (new tensor).

    Shapes: input ``[..., n * world, ...]`` -> output ``[..., n, ...]``; chunk ``r`` of the sum goes
    to group rank ``r``. gloo has no reduce-scatter, so there it is an all-reduce followed by a
    slice (same result, ``world`` times the traffic); nccl uses ``reduce_scatter_tensor``.

    Raises:
        ValueError: if ``tensor.shape[dim]`` is not divisible by the group size.
    """
    size = group_size(group)
    if size == 1:
        return tensor
    if tensor.shape[dim] % size != 0:
        raise ValueError(
            f"reduce_scatter: dim {dim} has size {tensor.shape[dim]}, not divisible by the group "
            f"size {size}; pad the sequence/feature dimension to a multiple of {size}"
        )
    rank = dist.get_rank(group)
    if _backend(group) == "nccl":
        moved = tensor.movedim(dim, 0).contiguous()
        out = moved.new_empty((moved.shape[0] // size, *moved.shape[1:]))
        dist.reduce_scatter_tensor(out, moved, group=group)
        return out.movedim(0, dim).contiguous()
    summed = tensor.clone()
    dist.all_reduce(summed, group=group)
    return summed.chunk(size, dim=dim)[rank].contiguous()


def all_to_all(
    tensor: torch.Tensor, scatter_dim: int, gather_dim: int, group: ProcessGroup | None
) -> torch.Tensor:
    """Split ``tensor`` along ``scatter_dim``, send chunk ``r`` to rank ``r``, concatenate the
    received chunks along ``gather_dim`` in rank order (Ulysses-style head/sequence exchange).

    Shapes: ``scatter_dim`` shrinks by the group size, ``gather_dim`` grows by it.

    Raises:
        ValueError: if ``tensor.shape[scatter_dim]`` is not divisible by the group size.
    """
    size = group_size(group)
    if size == 1:
        return tensor
    if tensor.shape[scatter_dim] % size != 0:
        raise ValueError(
            f"all_to_all: dim {scatter_dim} has size {tensor.shape[scatter_dim]}, not divisible by "
            f"the group size {size}"
        )
    inputs = [c.contiguous() for c in tensor.chunk(size, dim=scatter_dim)]
    outputs = [torch.empty_like(c) for c in inputs]
    dist.all_to_all(outputs, inputs, group=group)
    return torch.cat(outputs, dim=gather_dim)


def broadcast(tensor: torch.Tensor, src: int, group: ProcessGroup | None) -> torch.Tensor:
    """In-place broadcast from ``src`` (a rank *inside* ``group``) to all ranks; returns ``tensor``."""
    if group_size(group) == 1:
        return tensor
    dist.broadcast(tensor, src=dist.get_global_rank(group, src), group=group)
    return tensor


def barrier(group: ProcessGroup | None = None) -> None:
    """Block until every rank of ``group`` arrives; with ``group=None`` the world group is used
    when torch.distributed is initialised (a no-op otherwise)."""
    if group is None:
        if is_initialized():
            dist.barrier()
        return
    if group_size(group) > 1:
        dist.barrier(group=group)
