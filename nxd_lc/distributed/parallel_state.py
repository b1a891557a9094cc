"""Process groups for tensor, context, data and pipeline parallelism (the one source of groups).

Rank layout (NxD, Megatron): global ranks are laid out as ``[PP, DP, CP, TP]`` with TP the
fastest-varying index::

    global_rank = ((pp_rank * DP + dp_rank) * CP + cp_rank) * TP + tp_rank

so the TP group holds contiguous ranks, the CP group strides by TP, the DP group by TP*CP and
the PP group by TP*CP*DP. ``DP = world / (TP * CP * PP)``.

Expert parallelism (EP, NxD's ``expert_model_parallel_size``) is carved out of the DP ranks as NxD does
(expert layout ``[PP, DP/EP, EP, TP]``): ``dp_rank = edp_rank * EP + ep_rank``. The EP group holds the EP
consecutive DP ranks of one (PP, CP, TP) position (global ranks strided by TP*CP): they exchange tokens and each
holds ``num_experts / EP`` experts. The expert-data-parallel group (``edp``) holds the ranks with the same EP rank
(strided by TP*CP*EP): the replicas of the same experts, over which expert gradients are reduced (with CP:
``edp_cp``). DP must be divisible by EP.

KV-shared group: with ``kv_replicator = K > 1`` each KV head is held by K TP ranks, placed as NxD places them on
the platform (:mod:`nxd_lc.distributed.kv_layout`): ``interleaved`` (Trn1, NxD's default: ``K0 K1 .. K0 K1 ..``,
groups ``{j, j + TP/K, ..}`` inside a TP group) or ``adjacent`` (Trn2 / Trn3: ``K0 K0 .. K1 K1 ..``, K contiguous
ranks). :func:`get_kv_replica_layout` says which; the layers place heads by it.

When ``torch.distributed`` is not initialised everything behaves as world size 1: group getters
return ``None`` (collectives on ``None`` are no-ops), ranks are 0 and sizes are 1. When it is
initialised, :func:`initialize_model_parallel` must be called first; the getters raise
``RuntimeError`` otherwise (never silently falling back to the world group).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from nxd_lc.distributed import collectives
from nxd_lc.distributed.collectives import ProcessGroup
from nxd_lc.distributed.kv_layout import INTERLEAVED, kv_shared_group_index


@dataclass
class _State:
    tp: int
    cp: int
    dp: int
    pp: int
    kv_replicator: int
    kv_replica_layout: str
    groups: dict[str, ProcessGroup]
    ranks: dict[str, list[int]]
    all_groups: list[ProcessGroup]
    rank_tensors: dict[tuple[str, str], torch.Tensor] = field(default_factory=dict)


class _Store:
    """Holds the parallel state of this process (attribute ``state``).

    One object per process: a Trainium node runs one process per NeuronCore, a GPU node one per GPU. The test bed
    of several XLA devices in one process (``tests/xla_testbed.py``, one thread per device) replaces it with a
    ``threading.local`` for the duration of a test, so that each device thread has its own groups and ranks.
    """

    state: _State | None = None


_STORE: _Store = _Store()


def _layout_groups(tp: int, cp: int, dp: int, pp: int, kv: int, ep: int = 1,
                   kv_layout: str = INTERLEAVED) -> dict[str, list[list[int]]]:
    """All rank lists per group kind for the ``[PP, DP, CP, TP]`` layout, EP carved from DP (pure, no
    communication)."""

    def rank(p: int, d: int, c: int, t: int) -> int:
        return ((p * dp + d) * cp + c) * tp + t

    idx = [(p, d, c, t) for p in range(pp) for d in range(dp) for c in range(cp) for t in range(tp)]
    keys = {
        "tp": lambda p, d, c, t: (p, d, c),
        "cp": lambda p, d, c, t: (p, d, t),
        "dp": lambda p, d, c, t: (p, c, t),
        "dp_cp": lambda p, d, c, t: (p, t),
        "pp": lambda p, d, c, t: (d, c, t),
        "mp": lambda p, d, c, t: (d, c),
        "kv": lambda p, d, c, t: (p, d, c, kv_shared_group_index(t, tp, kv, kv_layout)),
        "ep": lambda p, d, c, t: (p, d // ep, c, t),  # dp_rank = edp_rank * EP + ep_rank
        "edp": lambda p, d, c, t: (p, d % ep, c, t),
        "edp_cp": lambda p, d, c, t: (p, d % ep, t),
    }
    layout: dict[str, list[list[int]]] = {}
    for name, key in keys.items():
        buckets: dict[tuple, list[int]] = {}
        for i in idx:
            buckets.setdefault(key(*i), []).append(rank(*i))
        layout[name] = [sorted(v) for v in buckets.values()]
    # embedding group: first and last pipeline stage of each (DP, CP, TP) position (tied embeddings, Megatron)
    layout["emb"] = [sorted({rank(0, d, c, t), rank(pp - 1, d, c, t)})
                     for d in range(dp) for c in range(cp) for t in range(tp)]
    return layout


def rank_layout(
    world_size: int,
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    context_parallel_size: int = 1,
    kv_replicator: int = 1,
    expert_model_parallel_size: int = 1,
    kv_replica_layout: str = INTERLEAVED,
) -> dict[str, list[list[int]]]:
    """Global-rank lists of every group, without creating any group.

    Returns a dict with keys ``tp``, ``cp``, ``dp``, ``dp_cp`` (DP x CP), ``pp``, ``mp`` (TP x PP, the
    model-parallel group), ``kv`` (KV-shared, placed by ``kv_replica_layout``), ``ep`` (expert parallel), ``edp`` /
    ``edp_cp`` (expert data parallel, without / with CP) and ``emb`` (the first and last pipeline stage of each
    DP/CP/TP position: tied embedding weights; middle stages belong to none), each a list of sorted rank lists.

    Raises:
        ValueError: if a size is < 1, ``world_size`` is not divisible by TP*CP*PP, TP is not
            divisible by ``kv_replicator``, DP is not divisible by ``expert_model_parallel_size``, or an unknown
            ``kv_replica_layout``.
    """
    sizes = {
        "tensor_model_parallel_size": tensor_model_parallel_size,
        "pipeline_model_parallel_size": pipeline_model_parallel_size,
        "context_parallel_size": context_parallel_size,
        "kv_replicator": kv_replicator,
        "expert_model_parallel_size": expert_model_parallel_size,
    }
    for key, value in sizes.items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"distributed_strategy.{key} must be a positive integer, got {value!r}")
    model = tensor_model_parallel_size * context_parallel_size * pipeline_model_parallel_size
    if world_size % model != 0:
        raise ValueError(
            f"world size {world_size} is not divisible by tensor_model_parallel_size "
            f"({tensor_model_parallel_size}) x context_parallel_size ({context_parallel_size}) x "
            f"pipeline_model_parallel_size ({pipeline_model_parallel_size}) = {model}; change the "
            f"parallel sizes or the number of processes (trainer.devices x trainer.num_nodes)"
        )
    if tensor_model_parallel_size % kv_replicator != 0:
        raise ValueError(
            f"distributed_strategy.kv_replicator ({kv_replicator}) must divide "
            f"tensor_model_parallel_size ({tensor_model_parallel_size})"
        )
    dp = world_size // model
    if dp % expert_model_parallel_size != 0:
        raise ValueError(
            f"distributed_strategy.expert_model_parallel_size ({expert_model_parallel_size}) must divide the "
            f"data-parallel size {dp} (world {world_size} / (tensor x context x pipeline parallel = {model})): "
            f"expert parallelism is carved out of the data-parallel ranks, as in NxD"
        )
    return _layout_groups(
        tensor_model_parallel_size, context_parallel_size, dp,
        pipeline_model_parallel_size, kv_replicator, expert_model_parallel_size, kv_replica_layout,
    )


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    context_parallel_size: int = 1,
    kv_replicator: int = 1,
    expert_model_parallel_size: int = 1,
    kv_replica_layout: str = INTERLEAVED,
) -> None:
    """Create all parallel groups over the already-initialised default process group.

    Must be called by every rank with the same arguments. Without torch.distributed initialised
    only world size 1 is accepted: every size, ``kv_replicator`` included, must be 1. ``kv_replica_layout``:
    where KV replicas and their query heads live (:mod:`nxd_lc.distributed.kv_layout`; NxD's default, Trn1's, is
    ``interleaved``).

    Raises:
        ValueError: sizes that do not divide the world size (see :func:`rank_layout`).
        RuntimeError: if already initialised (call :func:`destroy_model_parallel` first).
    """
    if getattr(_STORE, "state", None) is not None:
        raise RuntimeError("initialize_model_parallel: already initialised; call destroy_model_parallel()")
    world = collectives.get_global_world_size()
    layout = rank_layout(
        world, tensor_model_parallel_size, pipeline_model_parallel_size, context_parallel_size,
        kv_replicator, expert_model_parallel_size, kv_replica_layout,
    )
    me = collectives.get_global_rank()
    groups: dict[str, ProcessGroup] = {}
    ranks: dict[str, list[int]] = {}
    by_ranks: dict[tuple[int, ...], ProcessGroup | None] = {}
    for name, rank_lists in layout.items():
        for rank_list in rank_lists:
            key = tuple(rank_list)
            if key not in by_ranks:  # every rank creates every distinct group, in the same order
                by_ranks[key] = (collectives.new_group(rank_list, mesh=rank_lists) if collectives.is_initialized()
                                 else None)
            if me in rank_list:
                groups[name], ranks[name] = by_ranks[key], rank_list
    created = [g for g in by_ranks.values() if g is not None]
    tp, cp, pp = tensor_model_parallel_size, context_parallel_size, pipeline_model_parallel_size
    _STORE.state = _State(tp, cp, world // (tp * cp * pp), pp, kv_replicator, kv_replica_layout, groups, ranks,
                          created)


def model_parallel_is_initialized() -> bool:
    """True after :func:`initialize_model_parallel` and before :func:`destroy_model_parallel`."""
    return getattr(_STORE, "state", None) is not None


def destroy_model_parallel() -> None:
    """Forget (and release) all groups; safe to call when nothing is initialised."""
    state = getattr(_STORE, "state", None)
    if state is not None and collectives.is_initialized():
        for group in state.all_groups:
            collectives.destroy_group(group)
    _STORE.state = None


def _state() -> _State | None:
    state = getattr(_STORE, "state", None)
    if state is None and collectives.is_initialized():
        raise RuntimeError(
            "nxd_lc parallel state is not initialised: call "
            "nxd_lc.distributed.parallel_state.initialize_model_parallel(...) after "
            "torch.distributed.init_process_group"
        )
    return state


def _group(name: str) -> ProcessGroup | None:
    state = _state()
    return None if state is None else state.groups[name]


def get_embedding_group() -> ProcessGroup | None:
    """First + last pipeline stage of this rank's (DP, CP, TP) position, whose tied embedding / lm-head weights
    are kept equal by summing their gradients; None on middle stages and without pipelining (one stage)."""
    state = _state()
    if state is None or state.pp == 1 or "emb" not in state.groups:
        return None
    return state.groups["emb"]


def _rank(name: str) -> int:
    state = _state()
    return 0 if state is None else state.ranks[name].index(collectives.get_global_rank())


def _size(name: str) -> int:
    state = _state()
    return 1 if state is None else len(state.ranks[name])


#: group names :func:`rank_tensor` knows, with the getter of the rank
_RANK_GETTERS = {name: (lambda name=name: _rank(name)) for name in ("tp", "cp", "kv", "dp_cp", "edp_cp")}


def rank_tensor(name: str, device: torch.device | str) -> torch.Tensor:
    """This rank's index inside group ``name`` (``'tp'``, ``'cp'``, ``'kv'``, ``'dp_cp'``, ``'edp_cp'``) as device
    data: an int64 tensor of shape ``[1]`` on ``device``, uploaded once per device and parallel state and reused.

    Rank-dependent arithmetic (a vocabulary offset, "count this part on rank 0 only") written with it traces the
    same graph on every rank; a Python int would be baked into each rank's graph as a different constant, and on
    XLA each rank would then compile (and cache) its own graph (DESIGN.md 16). Shape ``[1]`` rather than 0-dim:
    torch-xla turns a 0-dim upload of 0 into a graph constant. Without torch.distributed the rank is 0.

    Raises:
        KeyError: for another name.
    """
    getter = _RANK_GETTERS[name]
    state = _state()
    key = (name, str(torch.device(device)))
    if state is not None and key in state.rank_tensors:
        return state.rank_tensors[key]
    t = torch.tensor([getter()], dtype=torch.int64, device=device)
    if state is not None:
        state.rank_tensors[key] = t
    return t


def get_tensor_model_parallel_group() -> ProcessGroup | None:
    """TP group of this rank (contiguous global ranks); None without torch.distributed."""
    return _group("tp")


def get_tensor_model_parallel_rank() -> int:
    """Rank inside the TP group (0 without torch.distributed)."""
    return _rank("tp")


def get_tensor_model_parallel_world_size() -> int:
    """TP group size (1 without torch.distributed)."""
    return _size("tp")


def get_context_parallel_group() -> ProcessGroup | None:
    """CP group of this rank (global ranks strided by TP); None without torch.distributed."""
    return _group("cp")


def get_context_parallel_rank() -> int:
    """Rank inside the CP group."""
    return _rank("cp")


def get_context_parallel_world_size() -> int:
    """CP group size."""
    return _size("cp")


def get_data_parallel_group(with_context_parallel: bool = False) -> ProcessGroup | None:
    """DP group of this rank, or the combined DP x CP group when ``with_context_parallel``
    (the group over which gradients are averaged when CP > 1)."""
    return _group("dp_cp" if with_context_parallel else "dp")


def get_data_parallel_rank(with_context_parallel: bool = False) -> int:
    """Rank inside the DP (or DP x CP) group."""
    return _rank("dp_cp" if with_context_parallel else "dp")


def get_data_parallel_world_size(with_context_parallel: bool = False) -> int:
    """DP (or DP x CP) group size."""
    return _size("dp_cp" if with_context_parallel else "dp")


def get_pipeline_model_parallel_group() -> ProcessGroup | None:
    """PP group of this rank (global ranks strided by TP*CP*DP)."""
    return _group("pp")


def get_pipeline_model_parallel_rank() -> int:
    """Rank inside the PP group (the pipeline stage index)."""
    return _rank("pp")


def get_pipeline_model_parallel_world_size() -> int:
    """Number of pipeline stages."""
    return _size("pp")


def get_model_parallel_group() -> ProcessGroup | None:
    """TP x PP group (same DP and CP rank): the ranks that together hold one model replica's
    parameters; used to sum gradient/parameter norms."""
    return _group("mp")


def get_kv_shared_group() -> ProcessGroup | None:
    """The ``kv_replicator`` TP ranks that hold replicas of the same KV heads (placed by
    :func:`get_kv_replica_layout`)."""
    return _group("kv")


def get_kv_shared_group_rank() -> int:
    """Rank inside the KV-shared group (0 .. kv_replicator-1)."""
    return _rank("kv")


def get_kv_shared_group_size() -> int:
    """KV-shared group size (= kv_replicator)."""
    return _size("kv")


def get_kv_replicator() -> int:
    """The ``kv_replicator`` given to :func:`initialize_model_parallel` (1 without it)."""
    state = _state()
    return 1 if state is None else state.kv_replicator


def get_kv_replica_layout() -> str:
    """Where KV replicas live over the TP ranks: ``interleaved`` or ``adjacent`` (:mod:`nxd_lc.distributed.kv_layout`;
    ``interleaved``, NxD's default, before :func:`initialize_model_parallel`)."""
    state = _state()
    return INTERLEAVED if state is None else state.kv_replica_layout


def get_expert_model_parallel_group() -> ProcessGroup | None:
    """EP group of this rank: the ``expert_model_parallel_size`` consecutive DP ranks of its (PP, CP, TP)
    position, which exchange tokens (module docstring)."""
    return _group("ep")


def get_expert_model_parallel_rank() -> int:
    """Rank inside the EP group: this rank holds experts ``[rank * E/EP, (rank + 1) * E/EP)``."""
    return _rank("ep")


def get_expert_model_parallel_world_size() -> int:
    """EP group size (``expert_model_parallel_size``; 1 without torch.distributed)."""
    return _size("ep")


def get_expert_data_parallel_group(with_context_parallel: bool = False) -> ProcessGroup | None:
    """Ranks holding replicas of this rank's experts (same EP, TP, PP rank; with CP ranks too when
    ``with_context_parallel``): expert gradients are summed over it."""
    return _group("edp_cp" if with_context_parallel else "edp")


def get_expert_data_parallel_rank(with_context_parallel: bool = False) -> int:
    """Rank inside the expert-data-parallel group (x CP when ``with_context_parallel``)."""
    return _rank("edp_cp" if with_context_parallel else "edp")


def get_expert_data_parallel_world_size(with_context_parallel: bool = False) -> int:
    """Size of the expert-data-parallel group (DP / EP, times CP when ``with_context_parallel``)."""
    return _size("edp_cp" if with_context_parallel else "edp")


GROUP_NAMES = ("tp", "cp", "dp", "dp_cp", "pp", "mp", "kv", "ep", "edp", "edp_cp", "emb")


def get_group_ranks(name: str) -> list[int]:
    """Global ranks of this rank's group ``name`` (one of :data:`GROUP_NAMES`); ``[0]`` without
    torch.distributed (``[]`` for ``emb`` on a middle pipeline stage).

    Raises:
        ValueError: for an unknown group name.
    """
    if name not in GROUP_NAMES:
        raise ValueError(f"get_group_ranks: unknown group {name!r}")
    state = _state()
    return [0] if state is None else list(state.ranks.get(name, []))
