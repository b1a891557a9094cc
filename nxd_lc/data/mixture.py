"""Weighted mixture of packed datasets with a deterministic schedule (exact resume) and ProLong-style length
upsampling of long documents.

Schedule (the blending of Megatron-LM's ``BlendableDataset``): sample ``i`` of the mixture comes from the source
whose count so far is furthest below its share, ``argmax_k (w_k (i + 1) - c_k)`` (ties: the first), and is that
source's next row (``c_k mod len_k``: small sources repeat). The schedule depends only on the weights and the
sizes, so a resumed run that skips ``consumed_samples`` sees exactly the samples it would have seen; the
training sampler still shuffles the mixture's rows per epoch (:class:`nxd_lc.data.sampler.PretrainingSampler`).
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import torch


class MixtureDataset(torch.utils.data.Dataset):
    """Rows of several datasets (each ``dataset[i]`` an ``[S + 1]`` row of the same S) in weighted proportion.

    Args:
        datasets: the sources (non-empty each).
        weights: one positive weight per source (normalised here).
        num_samples: length of the mixture; default the sum of the sources' lengths.

    Raises:
        ValueError: no sources, lengths that differ from the weights', a non-positive weight, an empty source,
            or sources of different row lengths.
    """

    def __init__(self, datasets: Sequence[Any], weights: Sequence[float], num_samples: int | None = None) -> None:
        if not datasets or len(datasets) != len(weights):
            raise ValueError(f"mixture: {len(datasets)} datasets but {len(weights)} weights")
        if any(w <= 0 for w in weights):
            raise ValueError(f"data.mixture[].weight: weights must be > 0, got {list(weights)}")
        sizes = [len(d) for d in datasets]
        if min(sizes) == 0:
            raise ValueError(f"mixture: source {sizes.index(0)} has no samples")
        widths = {len(d[0]) for d in datasets}
        if len(widths) != 1:
            raise ValueError(f"mixture: sources have rows of different lengths {sorted(widths)}")
        self.datasets = list(datasets)
        total = float(sum(weights))
        self.weights = [w / total for w in weights]
        n = int(num_samples if num_samples is not None else sum(sizes))
        self.source, self.row = blend_schedule(self.weights, sizes, n)
        self.num_samples = n
        self.seq_length = next(iter(widths)) - 1

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> np.ndarray:
        return np.asarray(self.datasets[int(self.source[index])][int(self.row[index])])

    def counts(self) -> list[int]:
        """Rows taken from each source."""
        return np.bincount(self.source, minlength=len(self.datasets)).tolist()


def blend_schedule(weights: Sequence[float], sizes: Sequence[int], num_samples: int) -> tuple[np.ndarray, np.ndarray]:
    """``(source, row)`` int64 arrays of length ``num_samples``: sample ``i`` is row ``row[i]`` of source
    ``source[i]`` (see the module docstring; ``weights`` normalised)."""
    w = np.asarray(weights, dtype=np.float64)
    w = w / w.sum()
    counts = np.zeros(len(w), dtype=np.int64)
    source = np.empty(num_samples, dtype=np.int64)
    row = np.empty(num_samples, dtype=np.int64)
    for i in range(num_samples):
        k = int(np.argmax(w * (i + 1) - counts))
        source[i] = k
        row[i] = counts[k] % sizes[k]
        counts[k] += 1
    return source, row


def upsample_long_documents(docs: Iterable[np.ndarray], min_tokens: int, factor: float,
                            seed: int) -> Iterator[np.ndarray]:
    """Every document, then extra copies of those with ``>= min_tokens`` tokens (ProLong's length upsampling: Gao
    et al. 2024, "How to Train Long-Context Language Models (Effectively)"), in a seeded random order so that a
    copy never follows its original. A document gets ``factor - 1`` extra copies on average: the integer part
    always, the fraction with that probability (seeded).

    Raises:
        ValueError: ``factor < 1`` or ``min_tokens < 1`` (names ``data.length_upsampling``).
    """
    if factor < 1 or min_tokens < 1:
        raise ValueError(f"data.length_upsampling: need min_tokens >= 1 and factor >= 1, got {min_tokens}, {factor}")
    rng = random.Random(f"length-upsampling/{seed}")
    extra: list[np.ndarray] = []
    whole, frac = int(factor) - 1, factor - int(factor)
    for doc in docs:
        yield doc
        if len(doc) >= min_tokens:
            extra += [doc] * (whole + (rng.random() < frac))
    rng.shuffle(extra)
    yield from extra
