"""Gradient reductions and global norms for TP / SP / KV-replica / DP(xCP) / PP parallelism.

Call order after ``loss.backward()`` (each step, before the optimizer):

1. :func:`allreduce_sequence_parallel_gradients` - params replicated over TP whose inputs were
   sequence-split (norm weights, row biases under SP; flag ``sequence_parallel_enabled``) only saw
   ``S/tp`` tokens: their gradients are summed over TP.
2. :func:`allreduce_kv_replica_gradients` - KV heads replicated by ``kv_replicator`` (flag
   ``kv_replicated``, optionally only rows ``kv_replicated_rows=(start, stop)`` of dim 0) each saw
   the queries of one rank: the replicas' gradients are summed over the KV-shared group.
3. :func:`allreduce_data_parallel_gradients` - average over DP (x CP). Expert parameters (flag
   ``expert_model_parallel``; each EP rank holds other experts, which already received the tokens of every EP
   rank through the all-to-all) are summed over the expert-data-parallel group (x CP) and divided by DP (x CP):
   the same average of every DP rank's loss gradient.
3b. :func:`allreduce_tied_embedding_gradients` - pipeline: tied embedding and its lm-head copy summed over
   the first and last stage (the copy is then skipped by the norms).
4. :func:`clip_grad_norm_` / :func:`global_grad_norm`.

Norm convention: the global norm is that of the *unsharded, unreplicated* model, identical on
every rank: TP-sharded parameters contribute on every TP rank, TP-replicated ones only on TP rank
0, KV replicas only on KV-shared-group rank 0; the sums are all-reduced over the model-parallel
(TP x PP) group. DP (x CP) replicas hold identical gradients after step 3, so they are not
summed (unless ``data_parallel_sharded``, e.g. ZeRO-1 shards, where each DP rank holds a disjoint
part). Expert parameters differ between the ranks of an EP group: their part of the sum is all-reduced over the
EP group first. ``params`` must be ``nn.Parameter`` objects so that these attributes can be read.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from nxd_lc.config.schema import NxdConfig
from nxd_lc.distributed import collectives, parallel_state
from nxd_lc.distributed.collectives import ProcessGroup
from nxd_lc.runtime.accel import HOST

#: MiB per flattened all-reduce bucket unless the caller says otherwise (the DP reduction takes
#: ``bucket_size_collectives`` from the config, :func:`gradient_bucket_size_mb`).
DEFAULT_BUCKET_SIZE_MB = 64.0


def grad_of(param: nn.Parameter) -> torch.Tensor | None:
    """The gradient to reduce, clip and step: the fp32 ``main_grad`` accumulation buffer when the parameter has
    one (bf16 parameters under fp32 gradient accumulation, :func:`nxd_lc.optim.install_fp32_grad_accumulation`),
    else ``param.grad`` (None when the parameter got no gradient)."""
    main = getattr(param, "main_grad", None)
    return main if main is not None else param.grad


def _coalesced_all_reduce(
    tensors: list[torch.Tensor], group: ProcessGroup | None, op: str = "sum",
    bucket_size_mb: float = DEFAULT_BUCKET_SIZE_MB, reduce_dtype: torch.dtype | None = None,
) -> None:
    """All-reduce ``tensors`` in place, flattening them into buckets of at most ``bucket_size_mb``
    (per dtype/device) so the number of collectives stays small. ``reduce_dtype``: the dtype the buckets are
    reduced in (each bucket up- or down-cast for the collective, the result cast back); None: their own."""
    if collectives.group_size(group) == 1 or not tensors:
        return
    limit = max(1, int(bucket_size_mb * 1024 * 1024))
    by_kind: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        by_kind.setdefault((t.dtype, t.device), []).append(t)
    for group_tensors in by_kind.values():
        bucket: list[torch.Tensor] = []
        size = 0
        for t in group_tensors:
            bucket.append(t)
            size += t.numel() * t.element_size()
            if size >= limit:
                _reduce_bucket(bucket, group, op, reduce_dtype)
                bucket, size = [], 0
        if bucket:
            _reduce_bucket(bucket, group, op, reduce_dtype)


def _reduce_bucket(bucket: list[torch.Tensor], group: ProcessGroup | None, op: str,
                   reduce_dtype: torch.dtype | None = None) -> None:
    flat = torch.cat([t.reshape(-1) for t in bucket])
    if reduce_dtype is not None and flat.dtype != reduce_dtype:
        flat = flat.to(reduce_dtype)
    collectives.all_reduce(flat, group, op=op)
    for t, chunk in zip(bucket, flat.split([t.numel() for t in bucket])):
        t.copy_(chunk.view_as(t))


def allreduce_sequence_parallel_gradients(module: nn.Module) -> None:
    """Sum over TP the gradients of ``module``'s parameters flagged ``sequence_parallel_enabled``.
    No-op at TP size 1. Collective over the TP group."""
    grads = [grad_of(p) for p in module.parameters()
             if getattr(p, "sequence_parallel_enabled", False) and grad_of(p) is not None]
    _coalesced_all_reduce(grads, parallel_state.get_tensor_model_parallel_group())


def _kv_replica_view(param: nn.Parameter, tensor: torch.Tensor) -> torch.Tensor:
    """The replicated part of ``tensor`` (param's grad or data): the rows ``kv_replicated_rows``
    of dim 0 when set, else the whole tensor."""
    rows = getattr(param, "kv_replicated_rows", None)
    return tensor if rows is None else tensor[rows[0]:rows[1]]


def allreduce_kv_replica_gradients(module: nn.Module) -> None:
    """Sum over the KV-shared group the gradients of parameters flagged ``kv_replicated`` (only
    their ``kv_replicated_rows`` when set), so replicas stay identical and carry the full gradient.
    No-op when ``kv_replicator`` is 1. Collective over the KV-shared group."""
    views = [_kv_replica_view(p, grad_of(p)) for p in module.parameters()
             if getattr(p, "kv_replicated", False) and grad_of(p) is not None]
    _coalesced_all_reduce(views, parallel_state.get_kv_shared_group())


def allreduce_data_parallel_gradients(
    params: Iterable[nn.Parameter], with_context_parallel: bool = True, bucket_size_mb: float = DEFAULT_BUCKET_SIZE_MB,
    fp32: bool = False,
) -> None:
    """Average gradients over the DP group (DP x CP when ``with_context_parallel``), bucketed: one all-reduce per
    ``bucket_size_mb`` MiB of gradients (per dtype/device; a bucket closes once it reaches the size), so the number
    of collectives falls as the bucket grows (``bucket_size_collectives`` in training).

    With context parallelism each CP rank's loss must be normalised so that the *average* over
    DP x CP ranks is the global per-token mean (e.g. local token-sum x cp / global token count,
    or the local mean when every rank holds the same number of loss tokens).
    Parameters without a gradient are skipped (they must be the same on all ranks).

    ``fp32`` (``precision.fp32_grads_cc``): bf16 gradients are reduced in fp32 (each bucket up-cast for the
    all-reduce and rounded back once), so the sum over ranks is not rounded to bf16 at every step of the
    reduction. fp32 gradients (``main_grad`` buffers, fp32 parameters) are reduced in fp32 either way.
    """
    rd = torch.float32 if fp32 else None
    dense: list[torch.Tensor] = []
    experts: list[torch.Tensor] = []
    for p in params:
        if (g := grad_of(p)) is not None:
            (experts if getattr(p, "expert_model_parallel", False) else dense).append(g)
    group = parallel_state.get_data_parallel_group(with_context_parallel=with_context_parallel)
    _coalesced_all_reduce(dense, group, op="avg", bucket_size_mb=bucket_size_mb, reduce_dtype=rd)
    if experts:  # sum over the replicas of these experts, then the DP (x CP) mean
        edp = parallel_state.get_expert_data_parallel_group(with_context_parallel=with_context_parallel)
        _coalesced_all_reduce(experts, edp, op="sum", bucket_size_mb=bucket_size_mb, reduce_dtype=rd)
        size = parallel_state.get_data_parallel_world_size(with_context_parallel=with_context_parallel)
        for g in experts:
            g.div_(size)


def allreduce_tied_embedding_gradients(params: Iterable[nn.Parameter]) -> None:
    """Sum the gradients of parameters flagged ``pipeline_tied`` (the tied embedding on the first pipeline stage
    and its lm-head copy on the last) over the embedding group, so both copies take the same update (Megatron's
    shared-embedding all-reduce). No-op without pipelining and on middle stages. Collective over the embedding
    group: the first and last stage must both call it."""
    tied = [g for p in params if getattr(p, "pipeline_tied", False) and (g := grad_of(p)) is not None]
    _coalesced_all_reduce(tied, parallel_state.get_embedding_group())


def _norm_parts(param: nn.Parameter, tensor: torch.Tensor) -> list[tuple[torch.Tensor, str | None]]:
    """The pieces of ``tensor`` that count in a global norm (see module docstring), each with the group whose
    rank 0 alone counts it (``'tp'``: a TP-replicated parameter, ``'kv'``: a KV replica) or None (every rank).

    Every rank returns the same pieces; which ranks count a piece is decided in :func:`_global_norm` with the rank
    as device data, so the norm's graph is the same on every rank (NxD's ``force_spmd``; DESIGN.md 16).
    """
    if getattr(param, "pipeline_tied_copy", False):  # the first pipeline stage counts the tied embedding
        return []
    if not getattr(param, "tensor_model_parallel", False):
        return [(tensor, "tp")]
    if not getattr(param, "kv_replicated", False):
        return [(tensor, None)]
    rows = getattr(param, "kv_replicated_rows", None)
    if rows is None:
        return [(tensor, "kv")]
    return [(tensor[: rows[0]], None), (tensor[rows[0]:rows[1]], "kv"), (tensor[rows[1]:], None)]


def _first_rank_mask(name: str, device: torch.device) -> torch.Tensor:
    """1.0 on rank 0 of group ``name`` and 0.0 elsewhere, a float32 ``[1]`` tensor computed from the rank as
    device data (the same graph on every rank)."""
    return (parallel_state.rank_tensor(name, device) == 0).to(torch.float32)


def _global_norm(
    pairs: list[tuple[nn.Parameter, torch.Tensor]], norm_type: float, data_parallel_sharded: bool
) -> torch.Tensor:
    norm_type = float(norm_type)
    if norm_type <= 0:
        raise ValueError(f"norm_type must be > 0 or inf, got {norm_type}")
    device = pairs[0][1].device if pairs else HOST
    op = "max" if math.isinf(norm_type) else "sum"

    def reduce(norms: list[torch.Tensor]) -> torch.Tensor:
        if not norms:
            return torch.zeros(1, device=device)
        stacked = torch.stack(norms)
        return (stacked.max() if op == "max" else stacked.pow(norm_type).sum()).reshape(1)

    def local_part(selected: list[tuple[nn.Parameter, torch.Tensor]]) -> torch.Tensor:
        by_owner: dict[str | None, list[torch.Tensor]] = {None: [], "tp": [], "kv": []}
        for p, x in selected:
            for t, owner in _norm_parts(p, x):
                if t.numel() > 0:
                    by_owner[owner].append(torch.linalg.vector_norm(t, ord=norm_type, dtype=torch.float32).to(device))
        part = reduce(by_owner[None])
        for owner in ("tp", "kv"):  # counted by the group's rank 0 only: x 1 there, x 0 elsewhere (norms >= 0)
            if by_owner[owner]:
                masked = reduce(by_owner[owner]) * _first_rank_mask(owner, device)
                part = torch.maximum(part, masked) if op == "max" else part + masked
        return part

    local = local_part([(p, x) for p, x in pairs if not getattr(p, "expert_model_parallel", False)])
    experts = [(p, x) for p, x in pairs if getattr(p, "expert_model_parallel", False)]
    # every EP rank joins (a no-op without EP); norms are >= 0, so a rank without experts adds a neutral 0
    expert_part = collectives.all_reduce(local_part(experts), parallel_state.get_expert_model_parallel_group(), op=op)
    local = torch.maximum(local, expert_part) if op == "max" else local + expert_part
    mp_group = parallel_state.get_model_parallel_group()
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:  # the stages trace different graphs
        total = collectives.stage_all_reduce(local, mp_group, op=op)
    else:
        total = collectives.all_reduce(local, mp_group, op=op)
    if data_parallel_sharded:
        total = collectives.all_reduce(total, parallel_state.get_data_parallel_group(True), op=op)
    total = total[0]
    return total if math.isinf(norm_type) else total.pow(1.0 / norm_type)


def global_grad_norm(
    params: Iterable[nn.Parameter], norm_type: float = 2.0, data_parallel_sharded: bool = False
) -> torch.Tensor:
    """Norm of all gradients of the full model, identical on every rank (fp32 0-dim tensor).

    Formula: ``(sum_i ||g_i||_p^p)^(1/p)`` over unique parameter pieces, ``max_i ||g_i||_inf`` for
    ``p = inf`` (as ``torch.nn.utils.clip_grad_norm_``), counting rules in the module docstring.
    Collective over the TP x PP group (and DP x CP with ``data_parallel_sharded``): every rank
    must call it, even with no gradients.

    Raises:
        ValueError: if ``norm_type <= 0``.
    """
    pairs = [(p, g.detach()) for p in params if (g := grad_of(p)) is not None]
    return _global_norm(pairs, norm_type, data_parallel_sharded)


def global_param_norm(
    params: Iterable[nn.Parameter], norm_type: float = 2.0, data_parallel_sharded: bool = False
) -> torch.Tensor:
    """Norm of all parameters of the full model, same counting rules as :func:`global_grad_norm`."""
    pairs = [(p, p.detach()) for p in params]
    return _global_norm(pairs, norm_type, data_parallel_sharded)


def scale_grads_(params: Iterable[nn.Parameter], coef: torch.Tensor) -> None:
    """Multiply every gradient (:func:`grad_of`) of ``params`` in place by the 0-dim tensor ``coef``."""
    for p in params:
        g = grad_of(p)
        if g is not None:
            g.mul_(coef.to(device=g.device, dtype=g.dtype))


def clip_grad_norm_(
    params: Iterable[nn.Parameter], max_norm: float, norm_type: float = 2.0, data_parallel_sharded: bool = False
) -> torch.Tensor:
    """Scale all gradients in place by ``min(1, max_norm / (total_norm + 1e-6))`` (the rule of
    ``torch.nn.utils.clip_grad_norm_``) with the global norm; returns the pre-clip total norm.

    Raises:
        ValueError: if ``max_norm <= 0`` or ``norm_type <= 0``.
    """
    if max_norm <= 0:
        raise ValueError(f"clip_grad_norm_: max_norm (trainer.gradient_clip_val) must be > 0, got {max_norm}")
    params = [p for p in params if grad_of(p) is not None]
    total = global_grad_norm(params, norm_type, data_parallel_sharded)
    scale_grads_(params, torch.clamp(max_norm / (total + 1e-6), max=1.0))
    return total


def gradient_bucket_size_mb(cfg: NxdConfig) -> float:
    """MiB per bucket of the DP (x CP) gradient all-reduce: ``bucket_size_collectives``, else nxd_lc's default
    (:data:`nxd_lc.distributed.grads.DEFAULT_BUCKET_SIZE_MB`, 64)."""
    return float(cfg.bucket_size_collectives) if cfg.bucket_size_collectives is not None else DEFAULT_BUCKET_SIZE_MB
