"""Where replicated KV heads and their query heads live over the TP ranks: NxD's two KV-replica layouts.

With ``nkv`` KV heads, ``nq`` query heads and TP size ``tp > nkv``, every KV head is replicated ``K = tp / nkv``
times (``kv_replicator``, NxD's ``kv_size_multiplier``) so that each TP rank holds one whole KV head and the
``nq / tp`` query heads that attend with it. Query heads come in ``tp`` blocks of ``nq / tp`` consecutive heads;
block ``b`` attends with KV head ``b // K`` (HF's GQA: query head ``h`` uses KV head ``h // (nq / nkv)``). NxD lays
the replicas out in one of two ways, chosen by the hardware (``neuronx_distributed.parallel_layers.parallel_state.
arrange_kv_groups``, ``modules/qkv_linear.py`` ``_initialize_parameter``, ``scripts/checkpoint_converter.py``):

* ``interleaved`` (Trn1): the KV weight is ``repeat``-ed, ``K0 K1 .. K(nkv-1) K0 K1 ..``: TP rank ``r`` holds KV
  head ``r % nkv`` and query block ``(r % nkv) * K + r // nkv`` (the converter's query reordering); the KV-shared
  groups (ranks holding the same KV head, whose gradients are summed) are ``{j, j + nkv, j + 2 nkv, ..}``. At TP 4
  with 2 KV heads: ranks 0..3 hold K0 K1 K0 K1 and query blocks 0 2 1 3, groups {0, 2} and {1, 3}.
* ``adjacent`` (Trn2 / Trn3): ``repeat_interleave``-d, ``K0 K0 .. K1 K1 ..``: rank ``r`` holds KV head ``r // K``
  and query block ``r``; groups ``{g K .. g K + K - 1}``.

Without replication (``nkv >= tp``, ``K = 1``) both are the plain split: rank ``r`` holds query block ``r`` and
KV heads ``[r nkv / tp, (r + 1) nkv / tp)``.
"""

from __future__ import annotations

__all__ = ["ADJACENT", "INTERLEAVED", "KV_REPLICA_LAYOUTS", "kv_heads_of_rank", "kv_shared_group_index",
           "query_block_of_rank", "query_block_order", "replication"]

INTERLEAVED = "interleaved"
ADJACENT = "adjacent"
KV_REPLICA_LAYOUTS = (INTERLEAVED, ADJACENT)


def _check(layout: str) -> None:
    if layout not in KV_REPLICA_LAYOUTS:
        raise ValueError(f"KV-replica layout {layout!r}: use one of {KV_REPLICA_LAYOUTS} "
                         f"(distributed_strategy.kv_replica_layout)")


def replication(tp: int, nkv: int) -> int:
    """``K``: how many TP ranks hold each KV head (``tp / nkv`` when ``nkv < tp``, else 1)."""
    return tp // nkv if nkv < tp else 1


def kv_heads_of_rank(rank: int, tp: int, nkv: int, layout: str) -> list[int]:
    """HF indices of the KV heads TP rank ``rank`` holds, in local order (module docstring).

    Raises:
        ValueError: an unknown ``layout``.
    """
    _check(layout)
    k = replication(tp, nkv)
    if k == 1:
        per = nkv // tp
        return list(range(rank * per, (rank + 1) * per))
    return [rank % nkv if layout == INTERLEAVED else rank // k]


def query_block_of_rank(rank: int, tp: int, nkv: int, layout: str) -> int:
    """The block of ``nq / tp`` consecutive query heads TP rank ``rank`` holds (module docstring).

    Raises:
        ValueError: an unknown ``layout``.
    """
    _check(layout)
    k = replication(tp, nkv)
    if k == 1 or layout == ADJACENT:
        return rank
    return (rank % nkv) * k + rank // nkv


def query_block_order(tp: int, nkv: int, layout: str) -> tuple[int, ...]:
    """``order[r]``: the query block of TP rank ``r``; also the block of ``o_proj``'s input columns it holds."""
    return tuple(query_block_of_rank(r, tp, nkv, layout) for r in range(tp))


def kv_shared_group_index(rank: int, tp: int, kv_replicator: int, layout: str) -> int:
    """Which KV-shared group TP rank ``rank`` belongs to: the KV head it holds (``kv_replicator`` ranks each)."""
    _check(layout)
    if kv_replicator <= 1:
        return rank
    nkv = tp // kv_replicator
    return rank % nkv if layout == INTERLEAVED else rank // kv_replicator
