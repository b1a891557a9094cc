"""Tensor-parallel layers: column/row linear, GQA QKV projection, vocab-parallel embedding and
cross-entropy. Shapes and sharding rules are documented in each module."""

from nxd_lc.layers.cross_entropy import parallel_cross_entropy, parallel_log_probs
from nxd_lc.layers.embedding import ParallelEmbedding
from nxd_lc.layers.linear import (
    ColumnParallelLinear,
    RowParallelLinear,
    gather_full_parameter,
    merge_tensor_shards,
    shard_full_parameter,
    split_tensor_for_rank,
)
from nxd_lc.layers.qkv import GQAQKVColumnParallelLinear, validate_gqa_sharding

__all__ = [
    "ColumnParallelLinear",
    "GQAQKVColumnParallelLinear",
    "ParallelEmbedding",
    "RowParallelLinear",
    "gather_full_parameter",
    "merge_tensor_shards",
    "parallel_cross_entropy",
    "parallel_log_probs",
    "shard_full_parameter",
    "split_tensor_for_rank",
    "validate_gqa_sharding",
]
