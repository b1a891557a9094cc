"""The causal-LM loss of every decoder (Llama-family, Mixtral) and of the last pipeline stage: summed next-token
cross-entropy over vocab-parallel logits, or tiled from the lm-head input (:mod:`nxd_lc.layers.tiled`)."""

from __future__ import annotations

import torch
from torch import nn

from nxd_lc.layers import parallel_cross_entropy
from nxd_lc.layers.fusions import liger_fused_linear_cross_entropy_sum
from nxd_lc.layers.tiled import tiled_causal_lm_loss

__all__ = ["causal_lm_loss", "causal_lm_loss_from_hidden"]


def causal_lm_loss_from_hidden(model: nn.Module, hidden: torch.Tensor, labels: torch.Tensor,
                               ignore_index: int = -100) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed next-token cross-entropy from the lm-head input: Liger-Kernel's fused linear cross-entropy when
    ``model.cross_entropy_kernel`` is ``liger`` (``model.fusions.cross_entropy``, TP 1 only), tiled when
    ``model.tiled_loss_chunk_size`` is set, else over the full logits.

    Args:
        model: the decoder (:class:`~nxd_lc.models.llama.model.LlamaForCausalLM` or a subclass; its
            ``lm_head.weight`` [Vp/tp, H], ``num_valid_vocab_local``, ``tiled_loss_chunk_size`` and
            ``logits_from_hidden`` are used).
        hidden: [B, S, H] from :meth:`~nxd_lc.models.llama.model.LlamaForCausalLM.hidden_states`.
        labels: [B, S] int64, already shifted; ``ignore_index`` marks positions without a target.

    Returns:
        ``(loss_sum, num_tokens)`` as :func:`causal_lm_loss`. Untiled: ``causal_lm_loss`` of the full logits.
        Tiled (:func:`nxd_lc.layers.tiled.tiled_causal_lm_loss`): same loss and gradients, computed
        ``tiled_loss_chunk_size`` tokens at a time, never holding more than ``[chunk, Vp/tp]`` logits.

    Raises:
        ValueError: shapes disagree or labels are not integers.
    """
    if model.cross_entropy_kernel == "liger":  # model.fusions.cross_entropy (TP 1)
        valid = labels != ignore_index
        loss_sum = liger_fused_linear_cross_entropy_sum(
            hidden.reshape(-1, hidden.shape[-1]), model.lm_head.weight[:model.num_valid_vocab_local],
            labels.reshape(-1), ignore_index)
        return loss_sum, valid.sum()
    if model.tiled_loss_chunk_size is None:
        return causal_lm_loss(model.logits_from_hidden(hidden), labels, ignore_index)
    return tiled_causal_lm_loss(hidden, model.lm_head.weight, labels, chunk_size=model.tiled_loss_chunk_size,
                                num_valid_vocab_local=model.valid_vocab_local(hidden.device), ignore_index=ignore_index)


def causal_lm_loss(logits_local: torch.Tensor, labels: torch.Tensor,
                   ignore_index: int = -100) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed next-token cross-entropy over vocab-parallel logits.

    Args:
        logits_local: [B, S, Vp/tp] from :meth:`~nxd_lc.models.llama.model.LlamaForCausalLM.forward`.
        labels: [B, S] int64, already shifted by the data pipeline (``labels[:, t]`` is the target of
            position t); ``ignore_index`` marks positions without a target.

    Returns:
        ``(loss_sum, num_tokens)``: fp32 scalar sum of per-token losses over non-ignored positions
        and an int64 scalar tensor counting them (no host sync). The mean is ``loss_sum / num_tokens``
        (reduce both over DP/CP first for a global token-weighted mean).

    Raises:
        ValueError: (from :func:`parallel_cross_entropy`) if the shapes disagree or labels are not integers.
    """
    per_token = parallel_cross_entropy(logits_local, labels, ignore_index=ignore_index)  # [B, S] fp32
    valid = labels != ignore_index
    return per_token.masked_fill(~valid, 0.0).sum(), valid.sum()
