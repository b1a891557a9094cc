"""Vocab-parallel cross-entropy and log-probabilities (never gathers the full vocabulary).

Logits are sharded on the vocab dim over TP: ``logits_local [B, S, V/tp]``, rank ``r`` holding
vocab ids ``[r*V/tp, (r+1)*V/tp)`` (the output of a ``ColumnParallelLinear`` LM head). Per token
(Megatron-LM ``_VocabParallelCrossEntropy``, NxD ``parallel_cross_entropy``), in fp32:

    m      = max_v logits            (all-reduce MAX over TP)
    z_t    = logits[target] - m      (only the owning rank contributes; all-reduce SUM)
    sumexp = sum_v exp(logits - m)   (all-reduce SUM)
    loss   = log(sumexp) - z_t

Backward: ``d loss / d logits = softmax(logits) - onehot(target)`` times the incoming gradient,
computed from the saved local softmax; returned in the logits' dtype.
"""

from __future__ import annotations

from typing import Any

import torch

from nxd_lc.distributed import collectives, parallel_state


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, ignore_index: int) -> torch.Tensor:
        group = parallel_state.get_tensor_model_parallel_group()
        vocab_local = logits.shape[-1]
        # this rank's first vocabulary id as device data ([1]): the same graph on every TP rank (DESIGN.md 16)
        start = (parallel_state.rank_tensor("tp", target.device) * vocab_local
                 if collectives.group_size(group) > 1 else 0)
        x = logits.float()  # a copy when logits are not fp32; never modify the caller's tensor
        x = x - collectives.all_reduce(x.detach().amax(dim=-1), group, op="max").unsqueeze(-1)

        outside = (target < start) | (target >= start + vocab_local)
        local_target = (target - start).masked_fill(outside, 0)
        target_logit = x.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        collectives.all_reduce(target_logit, group)

        probs = x.exp_()  # reuse the shifted-logits buffer for exp
        sum_exp = collectives.all_reduce(probs.sum(dim=-1), group)
        ignored = target == ignore_index
        loss = (sum_exp.log() - target_logit).masked_fill(ignored, 0.0)

        probs.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(probs, local_target, outside, ignored)
        ctx.logits_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        probs, local_target, outside, ignored = ctx.saved_tensors
        grad = probs  # in place: the graph cannot be back-propagated twice (no retain_graph)
        onehot_sub = (~outside).to(grad.dtype).unsqueeze(-1)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -onehot_sub)
        scale = grad_loss.float().masked_fill(ignored, 0.0).unsqueeze(-1)
        grad.mul_(scale)
        return grad.to(ctx.logits_dtype), None, None


def parallel_cross_entropy(
    logits_local: torch.Tensor, target: torch.Tensor, ignore_index: int = -100
) -> torch.Tensor:
    """Per-token cross-entropy over vocab-sharded logits.

    Args:
        logits_local: ``[B, S, V/tp]`` any float dtype (this TP rank's vocab slice).
        target: ``[B, S]`` long, global vocab ids or ``ignore_index``.
        ignore_index: targets equal to it get loss 0 and no gradient.

    Returns:
        ``[B, S]`` fp32 loss, identical on every TP rank; 0 where ``target == ignore_index``.

    Raises:
        ValueError: if ``target``'s shape is not ``logits_local.shape[:-1]`` or it is not an
            integer tensor.
    """
    if tuple(target.shape) != tuple(logits_local.shape[:-1]):
        raise ValueError(
            f"parallel_cross_entropy: target shape {tuple(target.shape)} must equal the logits shape "
            f"without the vocab dim, {tuple(logits_local.shape[:-1])}"
        )
    if target.dtype.is_floating_point or target.dtype == torch.bool:
        raise ValueError(f"parallel_cross_entropy: target must be an integer (long) tensor, got {target.dtype}")
    return _VocabParallelCrossEntropy.apply(logits_local, target.long(), ignore_index)


def parallel_log_probs(
    logits_local: torch.Tensor, target: torch.Tensor, ignore_index: int = -100
) -> torch.Tensor:
    """Per-token log-probability ``log p(target)`` over vocab-sharded logits (DPO/ORPO).

    Shapes as :func:`parallel_cross_entropy`; returns ``[B, S]`` fp32 equal to minus the
    cross-entropy, 0 where ``target == ignore_index`` (mask those positions when summing).
    """
    return -parallel_cross_entropy(logits_local, target, ignore_index)
