"""Synthetic long-dependency training data: the retrieval tasks of :mod:`nxd_lc.eval.retrieval` as packed rows.

Each ``[S + 1]`` row is filled with whole documents ``prompt + " " + answer + EOS`` (the answer of a passkey, a
needle value, all values, or the variables of a chain) of random lengths between ``min_length`` and the rest of the
row (the last document takes the rest exactly), each at a uniformly random needle depth and task. With document
masking (``data.cross_document_attention: false``) every document is its own context. Rows are a function of
``(seed, split, index)`` and the haystack: the ``train`` split draws its haystacks from the training split of the
run's corpus and the ``val`` split (another seed stream) from the held-out split, so validation never sees a
training prompt or training text.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import numpy as np

from nxd_lc.data.retrieval_tasks import TASKS, build_sample


def document(task: str, tokenizer: Any, haystack: Sequence[int], length: int, depth: float, seed: int, index: int,
             eos_id: int) -> list[int]:
    """One training document of exactly ``length`` tokens: a ``task`` prompt, its answer(s) (``", "``-separated,
    after a space, ending in ``"."``) and ``eos_id``.

    Raises:
        ValueError: ``length`` too short for the task's prompt (see :func:`nxd_lc.eval.retrieval.build_sample`).
    """
    sample = build_sample(task, tokenizer, haystack, length - 1, depth, seed, index, with_answer=True)
    return sample.input_ids + [eos_id]


def synthetic_rows(tokenizer: Any, haystack: Sequence[int], *, tasks: Sequence[str], seq_length: int,
                   num_rows: int, seed: int, split: str, min_length: int, eos_id: int) -> np.ndarray:
    """``[num_rows, seq_length + 1]`` int32 rows of synthetic documents (see the module docstring).

    Args:
        tokenizer: the run's tokenizer.
        haystack: token ids of the split's own corpus text (training split for ``train``, held-out for ``val``).
        tasks: drawn uniformly per document, of :data:`nxd_lc.eval.retrieval.TASKS`.
        seq_length: S.
        num_rows: rows to generate.
        seed: the run's seed; ``split`` selects an independent stream.
        min_length: shortest document in tokens (the last one of a row may be longer, never shorter).
        eos_id: document separator.

    Raises:
        ValueError: unknown task, ``min_length`` above S + 1, or too short for a task (names
            ``data.mixture[].min_length``).
    """
    bad = [t for t in tasks if t not in TASKS]
    if bad or not tasks:
        raise ValueError(f"data.mixture[].tasks: unknown {bad or 'none given'}; choose from {', '.join(TASKS)}")
    if not 0 < min_length <= seq_length + 1:
        raise ValueError(f"data.mixture[].min_length: must be in [1, seq_length + 1 = {seq_length + 1}], got "
                         f"{min_length}")
    if split not in ("train", "val"):
        raise ValueError(f"synthetic split must be 'train' or 'val', got {split!r}")
    stream_seed = 2 * seed + (split == "val")  # independent values for the held-out split
    out = np.empty((num_rows, seq_length + 1), dtype=np.int32)
    for r in range(num_rows):
        rng = random.Random(f"{seed}/{split}/row{r}")
        row: list[int] = []
        k = 0
        while len(row) < seq_length + 1:
            rest = seq_length + 1 - len(row)
            length = rest if rest < 2 * min_length else rng.randint(min_length, rest - min_length)
            task = rng.choice(list(tasks))
            try:
                row += document(task, tokenizer, haystack, length, rng.random(), stream_seed, r * 1000 + k, eos_id)
            except ValueError as e:
                raise ValueError(f"data.mixture[].min_length: {min_length} tokens are too few for a {task} "
                                 f"document with this tokenizer ({e}); raise min_length") from e
            k += 1
        out[r] = row
    return out
