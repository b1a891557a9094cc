"""Vocab-parallel token embedding (NxD ``ParallelEmbedding``, Megatron ``VocabParallelEmbedding``).

Weight ``[V/tp, H]`` (``partition_dim=0``): TP rank ``r`` owns token ids ``[r*V/tp, (r+1)*V/tp)``.
Forward: ids ``[B, S]`` (long) -> ``[B, S, H]``, or ``[B, S/tp, H]`` with sequence parallelism.
Each rank looks up the ids it owns, writes zeros for the others, and the partial results are
all-reduced over TP (reduce-scattered along the sequence dim under sequence parallelism), so
exactly one rank contributes each row.

``V`` must be divisible by the TP size: the model pads its vocabulary (e.g. to a multiple of
``128 * tp``) before building this layer; padded rows are never looked up for real token ids.
Ids outside ``[0, V)`` raise at TP=1 (``F.embedding``) but give a zero row at TP>1: validate
token ids in the data pipeline.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nxd_lc.distributed import parallel_state
from nxd_lc.distributed.mappings import (
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from nxd_lc.layers.linear import InitMethod, init_parameter


def _normal_init(w: torch.Tensor) -> object:
    return nn.init.normal_(w, 0.0, 1.0)


class ParallelEmbedding(nn.Module):
    """Embedding table sharded over the vocabulary across the TP group.

    Args:
        num_embeddings: full (padded) vocabulary size ``V``.
        embedding_dim: hidden size ``H``.
        sequence_parallel_enabled: output ``[B, S/tp, H]`` via reduce-scatter on dim 1.
        init_method: in-place init of the full ``[V, H]`` table (default ``N(0, 1)`` like
            ``nn.Embedding``); with ``use_cpu_initialization`` the full table is initialised on CPU
            and sliced, so any TP size gives the TP=1 table.

    Raises:
        ValueError: if ``num_embeddings`` is not divisible by the TP size (pad the vocab).
    """

    def __init__(
        self, num_embeddings: int, embedding_dim: int, sequence_parallel_enabled: bool = False,
        init_method: InitMethod | None = None, dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None, use_cpu_initialization: bool = True,
    ) -> None:
        super().__init__()
        tp = parallel_state.get_tensor_model_parallel_world_size()
        if num_embeddings % tp != 0:
            raise ValueError(
                f"ParallelEmbedding: vocabulary size {num_embeddings} is not divisible by "
                f"tensor_model_parallel_size {tp}; pad the vocabulary to a multiple of {tp} "
                f"(the model's vocab padding) before building the embedding"
            )
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.sequence_parallel_enabled = sequence_parallel_enabled
        rank = parallel_state.get_tensor_model_parallel_rank()
        self.num_embeddings_local = num_embeddings // tp
        self.vocab_start_index = rank * self.num_embeddings_local
        self.vocab_end_index = self.vocab_start_index + self.num_embeddings_local
        self.weight = init_parameter(
            (num_embeddings, embedding_dim), 0, init_method or _normal_init, dtype, device, use_cpu_initialization
        )

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """ids ``[B, S]`` -> ``[B, S, H]`` (``[B, S/tp, H]`` under sequence parallelism)."""
        tp = parallel_state.get_tensor_model_parallel_world_size()
        if tp == 1:
            return F.embedding(input_ids, self.weight)
        # the offset as device data ([1]), not a Python int: every TP rank traces the same graph (DESIGN.md 16)
        start = parallel_state.rank_tensor("tp", input_ids.device) * self.num_embeddings_local
        local_ids = input_ids - start
        outside = (local_ids < 0) | (local_ids >= self.num_embeddings_local)
        local_ids = local_ids.masked_fill(outside, 0)
        out = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel_enabled:
            return reduce_scatter_to_sequence_parallel_region(out)
        return reduce_from_tensor_model_parallel_region(out)

    def extra_repr(self) -> str:
        return (f"vocab={self.num_embeddings}, dim={self.embedding_dim}, "
                f"local_rows=[{self.vocab_start_index}, {self.vocab_end_index}), "
                f"sequence_parallel={self.sequence_parallel_enabled}")
