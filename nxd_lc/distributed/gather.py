"""Gathering per-stage dicts over the pipeline-parallel group (exports that need the whole model)."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from nxd_lc.distributed import collectives, parallel_state


def gather_pipeline_stages(part: dict[str, Any], rank0_only: bool = False) -> dict[str, Any]:
    """Merge the dicts of all pipeline stages (each stage holds disjoint keys, e.g. its parameters' exports).

    Collective over this rank's PP group (a no-op returning ``part`` at PP 1). With ``rank0_only`` only pipeline
    rank 0 receives the merged dict (``{}`` elsewhere); otherwise every rank does. Values travel as pickled
    objects (CPU tensors), so use it for exports, not in the training step.
    """
    group = parallel_state.get_pipeline_model_parallel_group()
    size = collectives.group_size(group)
    if size == 1:
        return part
    parts: list[Any] = [None] * size
    if rank0_only:
        first = parallel_state.get_group_ranks("pp")[0]
        me = collectives.get_global_rank()
        dist.gather_object(part, parts if me == first else None, dst=first, group=group)
        if me != first:
            return {}
    else:
        dist.all_gather_object(parts, part, group=group)
    merged: dict[str, Any] = {}
    for p in parts:
        merged.update(p or {})
    return merged
