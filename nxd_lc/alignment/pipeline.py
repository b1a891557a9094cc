"""DPO / ORPO under pipeline parallelism: the micro-batch layout and the last pipeline stage's objectives.

Shapes: ``N`` micro-batches of ``P`` pairs (``data.micro_batch_size``), ``S`` this rank's sequence (after the CP
split). Under PP the data module yields one batch per optimizer step, the ``N`` micro-batches collated together
(:class:`~nxd_lc.data.sampler.GroupedBatchSampler` + ``collate_pairs``): ``[2NP, S]`` row tensors with the ``NP``
chosen rows first, then the ``NP`` rejected rows of the same pairs, and ``sample_index [NP]``. The pipeline
schedule cuts every tensor into ``N`` equal chunks along dim 0, so :func:`interleave_pairs_by_microbatch`
re-lays the rows out once, at the step boundary: chunk ``i`` (``2P`` rows) holds the chosen rows of pairs
``iP..(i+1)P-1`` followed by their rejected rows -- the layout of one non-pipelined micro-batch -- and
``sample_index`` (already in pair order) chunks along its own dim 0 into the same pairs.

Objectives (:class:`~nxd_lc.pipeline.StageObjective`, run by the last stage on the lm-head input ``[2P, S, H]``):

* :func:`preference_objective` -- the policy's per-row sequence log-probs (vocab-parallel, CP-reduced, as
  :func:`~nxd_lc.alignment.logprobs.sequence_log_probs`) into the module's DPO / ORPO loss; the reference
  log-probs (DPO) travel with the batch as the row tensors :data:`REF_SUMS` / :data:`REF_COUNTS`.
* :func:`reference_rows_objective` -- forward only: the rows ``[P, 4]`` of the precomputed reference table
  (:data:`~nxd_lc.alignment.reference.REFERENCE_COLUMNS`) as a metric; its loss is zero.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

from nxd_lc.alignment.logprobs import sequence_log_probs, split_chosen_rejected
from nxd_lc.pipeline import StageObjective

__all__ = ["REF_COUNTS", "REF_SUMS", "interleave_pairs_by_microbatch", "preference_objective",
           "reference_rows_objective"]

#: batch keys of the reference log-probs under PP: ``[2NP]`` fp32 sums and int64 counts, rows as ``input_ids``
REF_SUMS, REF_COUNTS = "ref_sums", "ref_counts"

#: (policy sums [2P] fp32, counts [2P] int64, reference (sums, counts) or None) -> (loss, metrics)
LossFromLogProbs = Callable[[torch.Tensor, torch.Tensor, Optional[tuple[torch.Tensor, torch.Tensor]]],
                            tuple[torch.Tensor, dict[str, torch.Tensor]]]


def interleave_pairs_by_microbatch(batch: dict[str, torch.Tensor], num_microbatches: int) -> dict[str, torch.Tensor]:
    """Re-lay a grouped preference batch out so that each of its ``num_microbatches`` dim-0 chunks is one
    micro-batch (chosen rows of its pairs, then their rejected rows); see the module docstring.

    Args:
        batch: row tensors ``[2NP, ...]`` (chosen rows ``0..NP-1``, rejected rows ``NP..2NP-1``) and pair tensors
            ``[NP, ...]`` (``sample_index``); non-tensor values pass through.
        num_microbatches: ``N``.
    Returns:
        A new dict: row tensors permuted (row ``i*2P + j`` is chosen row ``i*P + j`` for ``j < P``, rejected row
        ``i*P + j - P`` otherwise), pair tensors unchanged. The identity for ``N = 1``.
    Raises:
        ValueError: ``NP`` not divisible by ``N``, or a tensor whose dim 0 is neither ``2NP`` nor ``NP``.
    """
    rows = batch["input_ids"].shape[0]
    pairs = rows // 2
    if rows % 2 or num_microbatches < 1 or pairs % num_microbatches:
        raise ValueError(f"preference batch of {rows} rows: expected 2 x pairs rows with the pairs divisible by "
                         f"num_microbatches {num_microbatches}")
    p = pairs // num_microbatches
    order = torch.arange(rows, device=batch["input_ids"].device).view(2, num_microbatches, p)
    order = order.transpose(0, 1).reshape(rows)  # chunk i: chosen i*P.., then rejected NP + i*P..
    out: dict[str, torch.Tensor] = {}
    for key, value in batch.items():
        if not torch.is_tensor(value) or value.dim() == 0 or value.shape[0] == pairs:
            out[key] = value
        elif value.shape[0] == rows:
            out[key] = value.index_select(0, order.to(value.device))
        else:
            raise ValueError(f"preference batch tensor {key!r} of shape {tuple(value.shape)}: dim 0 must be the "
                             f"{rows} rows or the {pairs} pairs")
    return out


def preference_objective(loss_from_log_probs: LossFromLogProbs, metric_names: tuple[str, ...], *,
                         uses_reference: bool, loss_factor: float) -> StageObjective:
    """The DPO / ORPO objective of the last stage.

    Args:
        loss_from_log_probs: the module's loss from the policy's and the reference's per-row log-probs.
        metric_names: the scalar metrics it returns (all of them are kept).
        uses_reference: read :data:`REF_SUMS` / :data:`REF_COUNTS` from the micro-batch (DPO).
        loss_factor: multiplies the back-propagated loss (``cp``: the DP x CP gradient average, see
            :mod:`nxd_lc.alignment.logprobs`).
    """

    def fn(model: nn.Module, hidden: torch.Tensor,
           kwargs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        sums, counts = sequence_log_probs(model.logits_from_hidden(hidden), kwargs["labels"])  # [2P] each
        ref = (kwargs[REF_SUMS], kwargs[REF_COUNTS]) if uses_reference else None
        loss, metrics = loss_from_log_probs(sums, counts, ref)
        return loss * loss_factor, {k: metrics[k] for k in metric_names}

    return StageObjective(fn, dict.fromkeys(metric_names, ()))


def reference_rows_objective(pairs_per_microbatch: int) -> StageObjective:
    """Forward-only objective: metric ``"rows"`` ``[P, 4]`` fp32 (chosen sum, count, rejected sum, count) of
    each micro-batch of ``P`` pairs; loss zero."""

    def fn(model: nn.Module, hidden: torch.Tensor,
           kwargs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        sums, counts = sequence_log_probs(model.logits_from_hidden(hidden), kwargs["labels"])
        (cs, rs), (cc, rc) = split_chosen_rejected(sums.float()), split_chosen_rejected(counts.float())
        return sums.new_zeros(()), {"rows": torch.stack([cs, cc, rs, rc], dim=1)}

    return StageObjective(fn, {"rows": (pairs_per_microbatch, 4)})
