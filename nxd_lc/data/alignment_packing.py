"""Truncation, best-fit-decreasing packing and fixed-length rows for alignment data.

Row layout (every tensor ``[S]``, S = seq_length; the collate functions stack them to ``[B, S]``):

* ``input_ids`` int64: the tokens; padding is ``pad_id``;
* ``labels`` int64, already shifted: ``labels[t] = input_ids[t + 1]`` when token ``t + 1`` belongs to the same
  example and is a target (assistant / output token), else -100. The last token of each example has no label
  (its successor is another example or padding), so a packed row's loss is the sum of its examples' losses;
* ``position_ids`` int64: restart at 0 at each example (and at the padding);
* ``segment_ids`` int32: example index within the row (0, 1, ...), padding one more; the model's document
  masking (``nxd_lc.context.local``) keeps attention inside each example. Unpacked rows are all 0:
  padding sits after the only example, which causal attention never lets it see.

Over-long records (more than S tokens) are truncated to S tokens (``truncation_mode``: ``keep_start`` keeps
the first S, ``keep_end`` the last S) or, with ``drop_overlong``, dropped; examples without any target token
(empty strings, no assistant turn) or left without one by truncation are dropped too. All of it is counted in
:class:`TruncationStats` (each cause apart), never silent.

Preference pairs (DPO / ORPO) follow TRL's rule: when ``prompt + longer response > S``, the prompt is cut to
``max_prompt_length`` tokens (``keep_start``: its first tokens, ``keep_end``: its last); if that is still too
long, both responses keep their first ``S - prompt`` tokens.

Packing (``sft.packing: true``) is best-fit-decreasing bin packing (D. S. Johnson, "Near-optimal bin packing
algorithms", 1973; the best-fit packing of Ding et al. 2024, "Fewer Truncations Improve Language Modeling"):
examples sorted by length, longest first, each placed in the open row with the least free space that still
holds it, else in a new row. Like first-fit-decreasing it needs asymptotically at most 11/9 of the optimal
number of rows; :func:`fill_ratio` reports the achieved share of non-padding tokens (the datamodule logs it).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from nxd_lc.config.alignment_schema import TRUNCATION_MODES
from nxd_lc.data.alignment_format import Encoded, EncodedPair

IGNORE_INDEX = -100
#: one example ready for rows: (input_ids int32 [L], labels int32 [L]) with labels shifted (module doc)
Example = tuple[np.ndarray, np.ndarray]


#: how many records without targets :class:`TruncationStats` names (file:line)
NUM_EMPTY_NAMED = 3


@dataclass
class TruncationStats:
    """What happened to the records of one split (counts of records)."""

    num_records: int = 0  # records read
    num_kept: int = 0  # examples (SFT) or pairs (DPO / ORPO) in the dataset
    num_truncated: int = 0  # over-long records that were truncated (and kept)
    num_dropped_overlong: int = 0  # over-long records dropped (sft.drop_overlong)
    num_dropped_no_target: int = 0  # records whose target tokens were all truncated away
    num_dropped_empty: int = 0  # records without any target token even uncut (empty strings, no assistant turn)
    empty_records: list[str] = field(default_factory=list)  # where the first NUM_EMPTY_NAMED of those are

    @property
    def num_dropped(self) -> int:
        """All dropped records."""
        return self.num_dropped_overlong + self.num_dropped_no_target + self.num_dropped_empty

    def count_empty(self, where: str) -> None:
        """Count a record dropped for having no target token at all; keep ``where`` among the first few."""
        self.num_dropped_empty += 1
        if where and len(self.empty_records) < NUM_EMPTY_NAMED:
            self.empty_records.append(where)


def shifted_labels(input_ids: np.ndarray, target_mask: np.ndarray) -> np.ndarray:
    """int32 ``[L]``: ``input_ids[t + 1]`` where ``target_mask[t + 1]``, else -100 (and -100 at ``L - 1``)."""
    labels = np.full(input_ids.shape[0], IGNORE_INDEX, dtype=np.int32)
    labels[:-1] = np.where(target_mask[1:], input_ids[1:], IGNORE_INDEX)
    return labels


def _check_mode(mode: str, key: str) -> None:
    if mode not in TRUNCATION_MODES:
        raise ValueError(f"{key}: {mode!r} is not one of {list(TRUNCATION_MODES)}")


def _cut(arr: np.ndarray, n: int, mode: str) -> np.ndarray:
    return arr[:n] if mode == "keep_start" else arr[arr.shape[0] - n:]


def _has_target(target_mask: np.ndarray, after_prompt: bool = False) -> bool:
    """Whether some token is predicted: a target token with a token before it (``after_prompt``: the sequence
    follows a non-empty prompt). A record whose only target is its first token (EOS after an empty prompt and
    output) has none."""
    return bool(target_mask[0 if after_prompt else 1:].any())


def prepare_sft_example(enc: Encoded, seq_length: int, truncation_mode: str, drop_overlong: bool,
                        stats: TruncationStats, where: str = "") -> Example | None:
    """Truncate (or drop) one SFT example to ``seq_length`` tokens and shift its labels; update ``stats``.

    Args:
        where: the record (file:line), kept in ``stats.empty_records`` when it has no target token at all.
    Returns:
        ``(input_ids, labels)`` int32 ``[L <= seq_length]``, or None when dropped (counted in ``stats``).
    Raises:
        ValueError: unknown ``truncation_mode`` (names ``model_alignment_strategy.sft.truncation_mode``).
    """
    _check_mode(truncation_mode, "model_alignment_strategy.sft.truncation_mode")
    stats.num_records += 1
    ids, mask = enc.input_ids, enc.target_mask
    if not _has_target(mask):
        stats.count_empty(where)
        return None
    if ids.shape[0] > seq_length:
        if drop_overlong:
            stats.num_dropped_overlong += 1
            return None
        ids, mask = _cut(ids, seq_length, truncation_mode), _cut(mask, seq_length, truncation_mode)
        stats.num_truncated += 1
    labels = shifted_labels(ids, mask)
    if not (labels != IGNORE_INDEX).any():
        stats.num_dropped_no_target += 1
        return None
    stats.num_kept += 1
    return ids.astype(np.int32), labels


def prepare_pair(pair: EncodedPair, seq_length: int, max_prompt_length: int, truncation_mode: str,
                 stats: TruncationStats, key: str = "model_alignment_strategy.dpo",
                 where: str = "") -> tuple[Example, Example] | None:
    """Truncate a preference pair (module doc) into ``(chosen, rejected)`` examples sharing the prompt.

    Each example is ``prompt + response`` with targets on the response's assistant tokens only.

    Args:
        where: the record (file:line), kept in ``stats.empty_records`` when a response has no target token at all.
    Returns:
        ``((chosen_ids, chosen_labels), (rejected_ids, rejected_labels))`` int32, each ``[<= seq_length]``, or
        None when a response has or is left without targets (counted in ``stats``).
    Raises:
        ValueError: unknown ``truncation_mode`` or ``max_prompt_length`` not in ``[1, seq_length)``
            (naming ``<key>.truncation_mode`` / ``<key>.max_prompt_length``).
    """
    _check_mode(truncation_mode, f"{key}.truncation_mode")
    if not 1 <= max_prompt_length < seq_length:
        raise ValueError(f"{key}.max_prompt_length: {max_prompt_length} must be in [1, data.seq_length = "
                         f"{seq_length})")
    stats.num_records += 1
    prompt_ids = pair.prompt.input_ids
    if not all(_has_target(r.target_mask, prompt_ids.shape[0] > 0) for r in (pair.chosen, pair.rejected)):
        stats.count_empty(where)
        return None
    longest = max(pair.chosen.input_ids.shape[0], pair.rejected.input_ids.shape[0])
    budget = None
    if prompt_ids.shape[0] + longest > seq_length:
        stats.num_truncated += 1
        if prompt_ids.shape[0] > max_prompt_length:
            prompt_ids = _cut(prompt_ids, max_prompt_length, truncation_mode)
        budget = seq_length - prompt_ids.shape[0]
    out = []
    for resp in (pair.chosen, pair.rejected):
        ids, mask = resp.input_ids[:budget], resp.target_mask[:budget]
        full_mask = np.concatenate([np.zeros(prompt_ids.shape[0], dtype=bool), mask])
        full_ids = np.concatenate([prompt_ids, ids]).astype(np.int32)
        labels = shifted_labels(full_ids, full_mask)
        if not (labels != IGNORE_INDEX).any():
            stats.num_dropped_no_target += 1
            return None
        out.append((full_ids, labels))
    stats.num_kept += 1
    return out[0], out[1]


def best_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Pack items of ``lengths`` into bins of ``capacity`` by best-fit-decreasing (module doc).

    Returns:
        Bins in creation order, each the item indices it holds (longest first; ties by index); deterministic.
    Raises:
        ValueError: an item longer than ``capacity`` or ``capacity < 1``.
    """
    if capacity < 1:
        raise ValueError(f"packing capacity must be >= 1, got {capacity}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (free space, bin index), sorted; full bins are removed
    for i in order:
        n = int(lengths[i])
        if n > capacity:
            raise ValueError(f"item {i} has length {n} > capacity {capacity}; truncate it first")
        pos = bisect.bisect_left(free, (n, -1))
        if pos < len(free):
            room, b = free.pop(pos)
        else:
            room, b = capacity, len(bins)
            bins.append([])
        bins[b].append(i)
        if room - n > 0:
            bisect.insort(free, (room - n, b))
    return bins


def fill_ratio(lengths: Sequence[int], rows: Sequence[Sequence[int]], seq_length: int) -> float:
    """Non-padding share of the packed tokens: ``sum(lengths) / (len(rows) * seq_length)`` (0 when empty)."""
    return float(sum(int(lengths[i]) for row in rows for i in row)) / (len(rows) * seq_length) if rows else 0.0


def build_row(examples: Sequence[Example], seq_length: int, pad_id: int, packed: bool) -> dict[str, np.ndarray]:
    """One ``[S]`` row from examples placed one after another, then padding (module doc).

    Args:
        examples: ``(input_ids, labels)`` pairs whose lengths sum to at most ``seq_length``.
        pad_id: token id of the padding.
        packed: True gives each example (and the padding) its own segment; False leaves segment_ids 0.
    Returns:
        ``{input_ids, labels, position_ids}`` int64 and ``segment_ids`` int32, each ``[seq_length]``.
    Raises:
        ValueError: the examples do not fit.
    """
    used = sum(ids.shape[0] for ids, _ in examples)
    if used > seq_length:
        raise ValueError(f"examples of {used} tokens do not fit a row of seq_length {seq_length}")
    input_ids = np.full(seq_length, pad_id, dtype=np.int64)
    labels = np.full(seq_length, IGNORE_INDEX, dtype=np.int64)
    position_ids = np.empty(seq_length, dtype=np.int64)
    segment_ids = np.zeros(seq_length, dtype=np.int32)
    start = 0
    for k, (ids, lab) in enumerate(examples):
        end = start + ids.shape[0]
        input_ids[start:end], labels[start:end] = ids, lab
        position_ids[start:end] = np.arange(end - start)
        segment_ids[start:end] = k if packed else 0
        start = end
    position_ids[start:] = np.arange(seq_length - start)
    segment_ids[start:] = len(examples) if packed else 0
    return {"input_ids": input_ids, "labels": labels, "position_ids": position_ids, "segment_ids": segment_ids}
