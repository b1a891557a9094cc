"""Dropout whose mask does not depend on the tensor-parallel layout.

A tensor that is sharded over TP (along the sequence under sequence parallelism, or along the MLP's intermediate
dim) gets the mask of the *full* tensor, drawn from the random stream every TP rank shares (the run's seed; every
rank draws the same numbers), sliced to this rank's shard. So a model with dropout gives the same activations and
gradients at TP 1 and at TP 2 with or without sequence parallelism (tested), and the replicated activations outside
the TP region (no sequence parallelism) get the identical mask on every TP rank, which their equality requires.
Megatron-LM gets the second property from its "model-parallel RNG tracker"; drawing the full mask costs ``tp``
times the random numbers of the shard, paid only while training with a non-zero probability.

Activation checkpointing recomputes the same masks: ``torch.utils.checkpoint`` restores the random state.

On torch-xla the shard's offset is device data (``shard_index`` as a tensor: every rank traces the same graph), and
the device stream the masks come from is seeded per micro-batch by the LightningModule
(:func:`nxd_lc.runtime.xla.seed_device_stream`): torch-xla's stream ignores ``torch.manual_seed`` and advances at
every graph cut, which differ in number between layouts.
"""

from __future__ import annotations

import torch

__all__ = ["sharded_dropout"]


def sharded_dropout(x: torch.Tensor, p: float, training: bool, *, shard_dim: int | None = None, num_shards: int = 1,
                    shard_index: int | torch.Tensor = 0) -> torch.Tensor:
    """Inverted dropout (Srivastava et al. 2014): ``x * keep / (1 - p)``, ``keep ~ Bernoulli(1 - p)``.

    Args:
        x: this rank's shard, any shape; the full tensor is ``x`` with ``shape[shard_dim] * num_shards`` along
            ``shard_dim`` (None: ``x`` is the full tensor).
        p: drop probability in [0, 1).
        training: False (eval) returns ``x`` unchanged.
        shard_dim, num_shards, shard_index: where ``x`` sits in the full tensor (contiguous blocks in rank order).
            ``shard_index`` as an int64 ``[1]`` device tensor (:func:`~nxd_lc.distributed.parallel_state.rank_tensor`)
            keeps the graph the same on every rank (DESIGN.md 16): the shard is then gathered by index instead of
            narrowed at a Python offset, which XLA would bake into each rank's graph as a different constant.

    Returns:
        Tensor of x's shape and dtype.

    Raises:
        ValueError: ``p`` outside [0, 1).
    """
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability must be in [0, 1), got {p}")
    if not training or p == 0.0:
        return x
    shape = list(x.shape)
    if shard_dim is not None and num_shards > 1:
        shape[shard_dim] *= num_shards
    keep = torch.rand(shape, device=x.device) >= p
    if shard_dim is not None and num_shards > 1:
        n = x.shape[shard_dim]
        if isinstance(shard_index, torch.Tensor):
            index = shard_index.reshape(1).to(keep.device) * n + torch.arange(n, device=keep.device)
            keep = keep.index_select(shard_dim, index)
        else:
            keep = keep.narrow(shard_dim, shard_index * n, n)
    return x * keep.to(x.dtype) / (1.0 - p)
