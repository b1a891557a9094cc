"""Per-sequence log-probabilities of labelled tokens from vocab-parallel logits (DPO / ORPO inputs).

Shapes: ``B`` sequences (for DPO: chosen and rejected concatenated on the batch dim, ``B = 2 * pairs``), ``S`` the
local sequence length (``S_global / cp`` under context parallelism), ``V/tp`` this TP rank's vocabulary slice.
``labels [B, S]`` are already shifted by the data pipeline (``labels[:, t]`` is the target of position ``t``) and
``-100`` marks tokens without a target (prompt tokens, padding).

The per-token log-probabilities come from :func:`nxd_lc.layers.cross_entropy.parallel_log_probs`: each TP rank
holds only ``[B, S, V/tp]`` and three scalar-per-token all-reduces over TP (max, target logit, sum of exps) give
``log p(label)``; the full vocabulary is never gathered. Its backward is ``onehot - softmax`` on the local slice.

Context parallelism (CP): each CP rank holds a shard of every sequence (the head-tail or contiguous split of
:func:`nxd_lc.context.shard_batch_for_context_parallel`, applied to ``labels`` too). A sequence's log-probability
is the sum of its token log-probabilities, so the full-sequence values are the per-shard sums all-reduced (summed)
over the CP group. That all-reduce is differentiable with an identity backward (the conjugate pair of Megatron's
``reduce_from_tensor_model_parallel_region``): every CP rank then holds the same full-sequence values and
computes the same (replicated) DPO loss, and each rank's gradient w.r.t. its own logits shard is exactly the
single-process gradient restricted to that shard. The parameter gradients of the CP ranks are partial sums; the
DP x CP gradient all-reduce (:func:`nxd_lc.distributed.grads.allreduce_data_parallel_gradients`) *averages* over
``dp * cp``, so the training step must multiply the replicated loss by ``cp`` before backward (the same
convention as :func:`nxd_lc.context.context_parallel_loss`).
"""

from __future__ import annotations

from typing import Any

import torch

from nxd_lc.distributed import collectives, parallel_state
from nxd_lc.layers.cross_entropy import parallel_log_probs

__all__ = [
    "all_reduce_context_parallel",
    "mean_log_probs",
    "sequence_log_probs",
    "split_chosen_rejected",
]


class _AllReduceCP(torch.autograd.Function):
    """Sum over the CP group in forward; identity in backward (the consumer is replicated over CP)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        group = parallel_state.get_context_parallel_group()
        if collectives.group_size(group) == 1:
            return x.clone()
        return collectives.all_reduce(x.contiguous().clone(), group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


def all_reduce_context_parallel(x: torch.Tensor) -> torch.Tensor:
    """Differentiable sum of ``x`` over the context-parallel group (any shape, same on every CP rank).

    Forward: all-reduce SUM over ``parallel_state.get_context_parallel_group()`` (a copy; ``x`` is not
    modified). Backward: identity, because every CP rank applies the same function to the summed value, so
    ``d loss / d x_r = d loss / d sum`` on each rank r (see the module docstring for the ``cp`` loss factor).
    A copy of ``x`` when the CP size is 1 or torch.distributed is not initialised.
    """
    return _AllReduceCP.apply(x)


def sequence_log_probs(logits_local: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100,
                       reduce_context_parallel: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of ``log p(label)`` over each sequence's labelled tokens, and their count.

    Args:
        logits_local: ``[B, S, V/tp]`` any float dtype, this TP rank's vocabulary slice (the output of a
            ``ColumnParallelLinear`` lm head, e.g. ``LlamaForCausalLM.forward``); under CP this rank's shard
            of the sequence.
        labels: ``[B, S]`` integer, global vocabulary ids, already shifted; ``ignore_index`` marks positions that
            are not counted (they get no gradient). Sharded over CP exactly like the logits' tokens.
        ignore_index: the label of positions without a target (``-100``).
        reduce_context_parallel: sum the per-shard values over the CP group (differentiable, see
            :func:`all_reduce_context_parallel`) so every CP rank returns the full-sequence values. ``False``
            returns this shard's partial sums (reduce them yourself before any non-linear function).

    Returns:
        ``(sum_logps, num_tokens)``: ``sum_logps [B]`` fp32 (differentiable w.r.t. ``logits_local``), identical on
        every TP rank (and every CP rank when reduced); ``num_tokens [B]`` int64, the number of labelled tokens
        per sequence (no gradient, no host synchronisation). A row without labelled tokens has ``0`` and ``0``.

    Raises:
        ValueError: ``logits_local`` is not 3-D, ``labels`` is not ``logits_local.shape[:2]`` or not an integer
            tensor.
    """
    if logits_local.dim() != 3:
        raise ValueError(f"sequence_log_probs: logits_local must be [B, S, V/tp], got shape "
                         f"{tuple(logits_local.shape)}")
    per_token = parallel_log_probs(logits_local, labels, ignore_index)  # [B, S] fp32, 0 where ignored
    valid = labels != ignore_index
    sum_logps = per_token.masked_fill(~valid, 0.0).sum(dim=1)
    num_tokens = valid.sum(dim=1)
    if reduce_context_parallel:
        sum_logps = all_reduce_context_parallel(sum_logps)
        group = parallel_state.get_context_parallel_group()
        num_tokens = collectives.all_reduce(num_tokens.clone(), group)
    return sum_logps, num_tokens


def mean_log_probs(sum_logps: torch.Tensor, num_tokens: torch.Tensor) -> torch.Tensor:
    """Length-normalised log-probabilities ``sum_logps / num_tokens`` (``[B]`` fp32; 0 for rows without tokens).

    The average per-token log-probability used by ORPO (Hong et al. 2024, arXiv:2403.07691, eq. 4) and by TRL's
    IPO. Pass the CP-reduced values of :func:`sequence_log_probs`.

    Raises:
        ValueError: the shapes differ.
    """
    if sum_logps.shape != num_tokens.shape:
        raise ValueError(f"mean_log_probs: sum_logps {tuple(sum_logps.shape)} and num_tokens "
                         f"{tuple(num_tokens.shape)} must have the same shape [B]")
    return sum_logps / num_tokens.to(sum_logps.dtype).clamp(min=1.0)


def split_chosen_rejected(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Split a ``[2P, ...]`` tensor of a concatenated preference batch into ``(chosen [P, ...], rejected [P, ...])``.

    Convention: the DPO/ORPO micro-batch holds the ``P`` chosen sequences first, then the ``P`` rejected ones in
    the same pair order (one forward pass for both, as in TRL's ``concatenated_forward``).

    Raises:
        ValueError: ``values`` is 0-D or its first dim is odd.
    """
    if values.dim() == 0 or values.shape[0] % 2:
        raise ValueError(f"split_chosen_rejected: expected [2 * pairs, ...] (chosen rows then rejected rows), "
                         f"got shape {tuple(values.shape)}")
    pairs = values.shape[0] // 2
    return values[:pairs], values[pairs:]
