"""Shims for the torch versions nxd_lc supports (2.9 through 2.14; 2.14, TorchNeuron's newest, is admitted by the
pins but not run here): the one place for version fallbacks.

Each shim uses the native API where the running torch has it and an equivalent built from older APIs
otherwise; callers never branch on versions themselves (DESIGN.md principle 10).

* :func:`all_to_all` — gloo gained ``alltoall`` after torch 2.9 (torch 2.9's gloo raises
  ``RuntimeError: Backend gloo does not support alltoall``); the fallback exchanges the chunks with
  point-to-point ``batch_isend_irecv`` (which gloo has had throughout).
* :func:`pipeline_stage_class` — torch 2.9's ``PipelineStage`` opens its neighbour connections with a float32
  receive buffer but an int64 send tensor (8 vs 4 bytes): NCCL does not notice, gloo aborts the process
  (``op.preamble.length <= op.nbytes``). Later torch sends float32 (upstream fix); on torch < 2.10 a subclass
  builds the same warm-up operations with the upstream fix.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["all_to_all", "pipeline_stage_class"]

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


def _torch_before(major: int, minor: int) -> bool:
    version = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    return version < (major, minor)


def pipeline_eval_needs_stage_count_microbatches() -> bool:
    """True on torch < 2.10, whose single-stage pipeline schedules (GPipe included, so forward-only runs too)
    refuse fewer micro-batches than pipeline stages, and whose looped breadth-first schedule (several stages per
    rank) then returns NaN losses; torch >= 2.10 takes any number in both."""
    return _torch_before(2, 10)


def pipeline_stage_class() -> type:
    """``torch.distributed.pipelining.PipelineStage``, or on torch < 2.10 a subclass whose neighbour warm-up
    sends a float32 tensor, matching the float32 receive buffer (the upstream fix; see the module docstring)."""
    from torch.distributed.pipelining import PipelineStage

    if not _torch_before(2, 10):
        return PipelineStage

    class _PipelineStage(PipelineStage):  # type: ignore[misc, valid-type]
        """PipelineStage with torch >= 2.10's dtype-consistent neighbour warm-up (gloo-safe)."""

        def _get_init_p2p_neighbors_ops(self) -> list[dist.P2POp]:
            ops: list[dist.P2POp] = []
            ranks = self.stage_index_to_group_rank
            recv = torch.zeros(1, device=self.device, dtype=torch.float32)
            send = torch.tensor(self.stage_index, device=self.device, dtype=torch.float32)
            if not self.is_first:  # forward from the previous stage, backward to it
                ops.append(dist.P2POp(dist.irecv, recv, group_peer=ranks[self.stage_index - 1], group=self.group))
            if not self.is_last:
                ops.append(dist.P2POp(dist.isend, send, group_peer=ranks[self.stage_index + 1], group=self.group))
            if not self.is_first:
                ops.append(dist.P2POp(dist.isend, send, group_peer=ranks[self.stage_index - 1], group=self.group))
            if not self.is_last:
                ops.append(dist.P2POp(dist.irecv, recv, group_peer=ranks[self.stage_index + 1], group=self.group))
            return ops

    return _PipelineStage
