"""Gathering per-stage dicts over the pipeline-parallel group (exports that need the whole model).

Transport: ``torch.distributed``'s object collectives (``gather_object`` / ``all_gather_object``) where the backend
moves host tensors (gloo, nccl); on torch-xla, whose process group takes XLA tensors only (its ``allgather`` raises
"Expected XLA tensor" for the byte tensors the object collectives build), the pickled parts travel through the
default process group's key-value store instead (:func:`store_gather_bytes`): no device memory, no lazy graph, so
the ranks of different pipeline stages need not trace the same graphs around it.
"""

from __future__ import annotations

import io
import threading
import weakref
from typing import Any, Optional

import torch
import torch.distributed as dist

from nxd_lc.distributed import collectives, parallel_state
from nxd_lc.runtime.accel import HOST

__all__ = ["gather_pipeline_stages", "store_gather_bytes"]

#: scope (the default process group) -> key -> number of the next round; one counter per group and tag
_ROUNDS: weakref.WeakKeyDictionary[Any, dict[str, int]] = weakref.WeakKeyDictionary()
_ROUNDS_LOCK = threading.Lock()


def store_gather_bytes(payload: bytes, ranks: list[int], me: int, tag: str, store: dist.Store, scope: Any,
                       receivers: Optional[list[int]] = None) -> list[Optional[bytes]]:
    """Gather every rank's ``payload`` of the group ``ranks`` (global ranks, the same list on each of them) through
    ``store``; returns the payloads in ``ranks`` order on the ``receivers`` (default: every rank), ``[None, ...]``
    on the others.

    A collective in effect: every rank of ``ranks`` calls it the same number of times with the same ``tag``;
    rounds are numbered per (``scope``, ``ranks``, ``tag``). Round ``r`` writes the keys
    ``nxd_lc_gather/<tag>/<ranks>/<r>/<rank>`` (one per rank) and ``.../read`` (a counter); each receiver reads
    every rank's key (a blocking get, up to the store's timeout) and the last receiver deletes the round's keys.
    The store's server holds the whole round's bytes until then: use it for exports and small host objects, never
    in the training step.

    Raises:
        torch.distributed.DistStoreError: a rank did not write its part within the store's timeout.
        ValueError: ``me`` is not in ``ranks``.
    """
    if me not in ranks:
        raise ValueError(f"store_gather_bytes: rank {me} is not in the group {ranks}")
    receivers = list(ranks) if receivers is None else receivers
    group_key = f"{tag}/{'-'.join(map(str, ranks))}"
    with _ROUNDS_LOCK:
        rounds = _ROUNDS.setdefault(scope, {})
        number = rounds.get(group_key, 0)
        rounds[group_key] = number + 1
    prefix = f"nxd_lc_gather/{group_key}/{number}"
    store.set(f"{prefix}/{me}", payload)
    if me not in receivers:
        return [None] * len(ranks)
    parts: list[Optional[bytes]] = [store.get(f"{prefix}/{r}") for r in ranks]
    if store.add(f"{prefix}/read", 1) == len(receivers):
        for r in ranks:
            store.delete_key(f"{prefix}/{r}")
        store.delete_key(f"{prefix}/read")
    return parts


def _store_gather(part: dict[str, Any], rank0_only: bool) -> list[Optional[dict[str, Any]]]:
    """:func:`gather_pipeline_stages`'s exchange on torch-xla: ``part`` (host tensors and plain values) saved with
    ``torch.save`` and loaded back with ``weights_only=True`` (no code runs on load).

    Raises:
        RuntimeError: the process group has no key-value store (torch-xla's ``DummyStore``:
            ``XLA_USE_DUMMY_STORE=1`` with ``TORCH_DIST_INIT_BARRIER=0``); the message names the variables.
    """
    store = None if collectives.xla_store_is_dummy() else collectives.default_store()
    if store is None:
        raise RuntimeError("gathering the pipeline stages' exports needs the process group's key-value store; "
                           "torch-xla's DummyStore (XLA_USE_DUMMY_STORE=1 with TORCH_DIST_INIT_BARRIER=0) holds no "
                           "keys: unset XLA_USE_DUMMY_STORE for this run")
    ranks = parallel_state.get_group_ranks("pp")
    buffer = io.BytesIO()
    torch.save(part, buffer)
    raw = store_gather_bytes(buffer.getvalue(), ranks, collectives.get_global_rank(), "pp_stages", store,
                             dist.group.WORLD, receivers=[ranks[0]] if rank0_only else None)
    return [None if b is None else torch.load(io.BytesIO(b), map_location=HOST, weights_only=True) for b in raw]


def gather_pipeline_stages(part: dict[str, Any], rank0_only: bool = False) -> dict[str, Any]:
    """Merge the dicts of all pipeline stages (each stage holds disjoint keys, e.g. its parameters' exports).

    Collective over this rank's PP group (a no-op returning ``part`` at PP 1). With ``rank0_only`` only pipeline
    rank 0 receives the merged dict (``{}`` elsewhere); otherwise every rank does. Values travel as pickled
    objects (CPU tensors; through the key-value store on torch-xla, module docstring), so use it for exports,
    not in the training step.

    Raises:
        RuntimeError: on torch-xla without a key-value store (:func:`_store_gather`).
    """
    group = parallel_state.get_pipeline_model_parallel_group()
    size = collectives.group_size(group)
    if size == 1:
        return part
    first = parallel_state.get_group_ranks("pp")[0]
    me = collectives.get_global_rank()
    if collectives.is_xla_backend(group):
        parts: list[Any] = _store_gather(part, rank0_only)
    else:
        parts = [None] * size
        if rank0_only:
            dist.gather_object(part, parts if me == first else None, dst=first, group=group)
        else:
            dist.all_gather_object(parts, part, group=group)
    if rank0_only and me != first:
        return {}
    merged: dict[str, Any] = {}
    for p in parts:
        merged.update(p or {})
    return merged
