"""Shims for the torch versions nxd_lc supports (2.9 through 2.13): the one place for version fallbacks.

Each shim uses the native API where the running torch has it and an equivalent built from older APIs
otherwise; callers never branch on versions themselves (DESIGN.md principle 10).

* :func:`all_to_all` — gloo gained ``alltoall`` after torch 2.9 (torch 2.9's gloo raises
  ``RuntimeError: Backend gloo does not support alltoall``); the fallback exchanges the chunks with
  point-to-point ``batch_isend_irecv`` (which gloo has had throughout).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["all_to_all"]

# Backends found (at run time) to lack a native all_to_all; filled on the first failure.
_NO_NATIVE_ALL_TO_ALL: set[str] = set()


def _p2p_all_to_all(outputs: list[torch.Tensor], inputs: list[torch.Tensor], group: dist.ProcessGroup) -> None:
    """``outputs[j] <- inputs[rank]`` of group rank ``j``, with one isend/irecv pair per peer."""
    rank = dist.get_rank(group)
    outputs[rank].copy_(inputs[rank])
    ops = []
    for j in range(len(inputs)):
        if j == rank:
            continue
        peer = dist.get_global_rank(group, j)
        ops.append(dist.P2POp(dist.isend, inputs[j], peer, group=group))
        ops.append(dist.P2POp(dist.irecv, outputs[j], peer, group=group))
    for work in dist.batch_isend_irecv(ops):
        work.wait()


def all_to_all(outputs: list[torch.Tensor], inputs: list[torch.Tensor], group: dist.ProcessGroup) -> None:
    """``torch.distributed.all_to_all(outputs, inputs, group)``, on every backend and supported torch.

    Args:
        outputs: one preallocated tensor per group rank; ``outputs[j]`` receives rank ``j``'s ``inputs[rank]``.
        inputs: one contiguous tensor per group rank (same shapes/dtypes as the matching outputs on the peer).
        group: the process group (size = ``len(inputs)``).

    Raises:
        RuntimeError: any failure of the collective other than the backend lacking ``alltoall``.
    """
    backend = str(dist.get_backend(group))
    if backend not in _NO_NATIVE_ALL_TO_ALL:
        try:
            dist.all_to_all(outputs, inputs, group=group)
            return
        except RuntimeError as e:  # raised locally, before any communication, identically on every rank
            if "does not support alltoall" not in str(e):
                raise
            _NO_NATIVE_ALL_TO_ALL.add(backend)
    _p2p_all_to_all(outputs, inputs, group)
