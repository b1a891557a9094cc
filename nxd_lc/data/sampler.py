"""Megatron-style pretraining batch sampler: seeded per-epoch order, DP slices, exact resume.

Semantics follow Megatron-LM's ``MegatronPretrainingRandomSampler`` / ``MegatronPretrainingSampler``
(``megatron/legacy/data/data_samplers.py``): the sampler is driven by ``consumed_samples``, the number of
samples consumed so far by ALL data-parallel ranks together, which is what a checkpoint stores;
``epoch = consumed_samples // samples_per_epoch``; the order of an epoch is ``torch.randperm`` with a
``torch.Generator`` seeded with ``seed + epoch`` (``arange`` when not shuffled).

One difference from Megatron's random sampler, which first cuts the dataset into one contiguous bucket per DP rank
and permutes inside each bucket: here one permutation covers the whole epoch and global micro-batch step ``j``
takes ``order[j*M*D : (j+1)*M*D]`` (M = micro batch, D = DP size), of which DP rank ``r`` takes
``[r*M : (r+1)*M]``. The global sample order therefore does not depend on the DP size, and DP ranks' batches at
a step are disjoint and together cover that step's global micro-batch.

Epochs are trimmed to a whole number of global steps (``global_batch_size`` when given, else ``M*D``), so each
epoch ends on an optimizer-step boundary. One ``__iter__`` yields from the sampler's current position to the end
of that epoch and advances the position; the next ``__iter__`` (Lightning's next epoch) continues with the next
epoch. ``__len__`` is the number of micro-batches per rank in one full epoch.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from nxd_lc.config.errors import ConfigError


class PretrainingSampler:
    """Batch sampler yielding this DP rank's micro-batches of dataset indices.

    Args:
        total_samples: dataset size (packed samples).
        consumed_samples: samples consumed so far over all DP ranks (resume point); a multiple of
            ``micro_batch_size * data_parallel_size``.
        micro_batch_size: M, samples per rank per forward pass.
        data_parallel_rank: r in [0, D).
        data_parallel_size: D.
        seed: base seed; epoch e is shuffled with ``seed + e``.
        shuffle: False = sequential order every epoch.
        global_batch_size: optional; epochs are trimmed to a multiple of it (default ``M * D``).
        rewind: every ``__iter__`` starts again at the given ``consumed_samples`` (a validation set: each pass reads
            the same batches, however far the previous pass got, as NeMo / Megatron validate on a fixed set); False
            (training): a later ``__iter__`` continues where the previous one stopped.
    Yields:
        ``list[int]`` of length M.
    Raises:
        ValueError: non-positive sizes, rank out of range, ``global_batch_size`` not a multiple of ``M * D``,
            or ``consumed_samples`` not on a step boundary.
        ConfigError: a dataset smaller than one global step (names ``data.global_batch_size`` and the bound; the
            launch prints it: the size of tokenized text is known only once it is built).
    """

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 data_parallel_rank: int, data_parallel_size: int, seed: int, shuffle: bool = True,
                 global_batch_size: int | None = None, rewind: bool = False) -> None:
        if micro_batch_size < 1 or data_parallel_size < 1:
            raise ValueError(f"micro_batch_size ({micro_batch_size}) and data_parallel_size "
                             f"({data_parallel_size}) must be >= 1")
        if not 0 <= data_parallel_rank < data_parallel_size:
            raise ValueError(f"data_parallel_rank {data_parallel_rank} not in [0, {data_parallel_size})")
        self.step_size = micro_batch_size * data_parallel_size
        unit = global_batch_size or self.step_size
        if unit % self.step_size != 0:
            raise ValueError(f"data.global_batch_size {unit} is not a multiple of micro_batch_size x DP = "
                             f"{self.step_size}")
        self.samples_per_epoch = (total_samples // unit) * unit
        if self.samples_per_epoch == 0:
            fits = total_samples // self.step_size * self.step_size
            fix = (f"lower data.global_batch_size to at most {fits} (a multiple of micro_batch_size x DP = "
                   f"{self.step_size}), add data or lower data.seq_length" if fits else
                   f"it holds fewer than micro_batch_size x DP = {self.step_size}: add data or lower data.seq_length")
            raise ConfigError([f"data.global_batch_size: the dataset has {total_samples} samples, fewer than one "
                               f"global batch ({unit}); {fix}"])
        if consumed_samples < 0 or consumed_samples % self.step_size != 0:
            raise ValueError(f"consumed_samples {consumed_samples} must be a non-negative multiple of "
                             f"micro_batch_size x DP = {self.step_size}")
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.rewind_to = consumed_samples if rewind else None
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.data_parallel_size = data_parallel_size
        self.seed = seed
        self.shuffle = shuffle

    @property
    def epoch(self) -> int:
        """Epoch of the next sample: ``consumed_samples // samples_per_epoch``."""
        return self.consumed_samples // self.samples_per_epoch

    def __len__(self) -> int:
        """Micro-batches this rank yields in one full epoch: ``samples_per_epoch // (M * D)``."""
        return self.samples_per_epoch // self.step_size

    def epoch_order(self, epoch: int) -> torch.Tensor:
        """Dataset indices of one epoch in sampling order, int64 ``[samples_per_epoch]``.

        Shuffled: ``randperm(total_samples)`` from a generator seeded with ``seed + epoch``, truncated to
        ``samples_per_epoch``; otherwise ``arange``.
        """
        if not self.shuffle:
            return torch.arange(self.samples_per_epoch)
        gen = torch.Generator()
        gen.manual_seed(self.seed + epoch)
        return torch.randperm(self.total_samples, generator=gen)[: self.samples_per_epoch]

    def __iter__(self) -> Iterator[list[int]]:
        """Yield this rank's micro-batches from ``consumed_samples`` to the end of its epoch.

        ``consumed_samples`` advances by ``M * D`` as each batch is yielded, so a later ``__iter__`` continues
        where this one stopped (with the next epoch after a whole one), unless the sampler rewinds.
        """
        if self.rewind_to is not None:
            self.consumed_samples = self.rewind_to
        epoch = self.epoch
        order = self.epoch_order(epoch)
        start = self.consumed_samples - epoch * self.samples_per_epoch
        lo = self.data_parallel_rank * self.micro_batch_size
        for step_start in range(start, self.samples_per_epoch, self.step_size):
            batch = order[step_start + lo: step_start + lo + self.micro_batch_size].tolist()
            self.consumed_samples += self.step_size
            yield batch


class GroupedBatchSampler:
    """Concatenates every ``num_micro_batches`` consecutive micro-batches of a batch sampler into one batch.

    Pipeline parallelism runs all micro-batches of an optimizer step in one schedule call, so its data loader
    yields ``num_microbatches x micro_batch_size`` rows per batch: exactly the rows that gradient accumulation
    would have seen over the step's micro-batches, in the same order.

    Raises:
        ValueError: ``num_micro_batches < 1``.
    """

    def __init__(self, sampler: Any, num_micro_batches: int) -> None:
        if num_micro_batches < 1:
            raise ValueError(f"GroupedBatchSampler: num_micro_batches must be >= 1, got {num_micro_batches}")
        self.sampler, self.num_micro_batches = sampler, num_micro_batches

    def __iter__(self) -> Iterator[list[int]]:
        group: list[int] = []
        count = 0
        for batch in self.sampler:
            group.extend(batch)
            count += 1
            if count == self.num_micro_batches:
                yield group
                group, count = [], 0

    def __len__(self) -> int:
        return len(self.sampler) // self.num_micro_batches
