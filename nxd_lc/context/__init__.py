"""Context parallelism: load-balanced batch sharding, ring attention and Ulysses all-to-all attention.

Call :func:`set_context_parallel_algo` once at startup; shard each batch with
:func:`shard_batch_for_context_parallel` at the step boundary; the attention dispatch calls
:func:`context_parallel_attention` when ``context_parallel_size > 1``.
"""

from nxd_lc.context.attention import (
    context_parallel_attention,
    get_context_parallel_algo,
    set_context_parallel_algo,
)
from nxd_lc.context.ring import ring_attention
from nxd_lc.context.sharding import (
    CP_ALGOS,
    context_parallel_loss,
    local_chunk_ranges,
    local_global_positions,
    shard_batch_for_context_parallel,
)
from nxd_lc.context.ulysses import ulysses_attention, ulysses_kv_replication

__all__ = [
    "CP_ALGOS",
    "context_parallel_attention",
    "context_parallel_loss",
    "get_context_parallel_algo",
    "local_chunk_ranges",
    "local_global_positions",
    "ring_attention",
    "set_context_parallel_algo",
    "shard_batch_for_context_parallel",
    "ulysses_attention",
    "ulysses_kv_replication",
]
