"""The attention dispatch, :func:`core_attention` (context parallel or local), and the context-parallel entry
point, :func:`context_parallel_attention`, the one function the dispatch calls when CP > 1.

Shapes (per CP rank; ``L = S / cp`` local tokens in the layout of the chosen algorithm, see
:mod:`nxd_lc.context.sharding`):
    q            [B, Hq, L, D]
    k, v         [B, Hkv, L, D]   (un-expanded GQA KV heads)
    segment_ids  [B, L] integer or None
    output       [B, Hq, L, D]

The algorithm (``ring`` or ``ulysses``, config ``distributed_strategy.context_parallel_algo``) is a process-wide
setting: :func:`set_context_parallel_algo` is called once at startup (:mod:`nxd_lc.app.run`), next to
``parallel_state.initialize_model_parallel``; it must match the one used to shard the batch
(:func:`nxd_lc.context.sharding.shard_batch_for_context_parallel`), since the two layouts differ.
"""

from __future__ import annotations

import math

import torch

from nxd_lc.context.local import check_shapes, local_attention
from nxd_lc.context.ring import ring_attention
from nxd_lc.context.sharding import CP_ALGOS
from nxd_lc.context.ulysses import ulysses_attention
from nxd_lc.distributed import parallel_state

__all__ = ["context_parallel_attention", "core_attention", "get_context_parallel_algo", "set_context_parallel_algo"]

_ALGO = "ring"


def set_context_parallel_algo(algo: str) -> None:
    """Select the context-parallel attention algorithm for this process (``ring`` | ``ulysses``).

    Raises:
        ValueError: an unknown name (names ``distributed_strategy.context_parallel_algo``).
    """
    global _ALGO
    if algo not in CP_ALGOS:
        raise ValueError(
            f"distributed_strategy.context_parallel_algo: unknown value {algo!r}; expected one of {list(CP_ALGOS)}"
        )
    _ALGO = algo


def get_context_parallel_algo() -> str:
    """The algorithm chosen by :func:`set_context_parallel_algo` (default ``ring``)."""
    return _ALGO


def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                               segment_ids: torch.Tensor | None, scale: float | None,
                               algo: str | None = None, flash_attention: bool = True) -> torch.Tensor:
    """Causal attention of this CP rank's queries over the whole (CP-sharded) sequence.

    Args:
        q, k, v, segment_ids: see the module docstring; sharded like the batch (ring: head-tail chunks,
            ulysses: contiguous).
        scale: score scale, default ``1 / sqrt(D)``.
        algo: ``ring`` | ``ulysses``; None -> the process-wide setting (:func:`get_context_parallel_algo`).
        flash_attention: for Ulysses, the local kernel (SDPA or the eager reference); the ring always runs its
            own fp32 tiled kernel.

    Returns:
        ``[B, Hq, L, D]`` in q's dtype. Collective over the CP group.

    Raises:
        ValueError: unknown ``algo``; shape errors of :func:`ring_attention` / :func:`ulysses_attention`.
    """
    algo = _ALGO if algo is None else algo
    if algo == "ring":
        return ring_attention(q, k, v, segment_ids=segment_ids, scale=scale)
    if algo == "ulysses":
        return ulysses_attention(q, k, v, segment_ids=segment_ids, scale=scale, flash_attention=flash_attention)
    raise ValueError(
        f"distributed_strategy.context_parallel_algo: unknown value {algo!r}; expected one of {list(CP_ALGOS)}"
    )


def core_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    flash_attention: bool = True,
    causal: bool = True,
    scale: float | None = None,
    segment_ids: torch.Tensor | None = None,
    window: int | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Attention over q [B,Hq,S,D], k/v [B,Hkv,S,D] -> [B,Hq,S,D]; the one dispatch point (module doc).

    Args:
        flash_attention: True -> torch SDPA (fused kernel, no mask tensor); False -> eager reference.
        causal: apply the causal (lower-triangular) mask; position t attends to positions <= t.
        scale: score scale, default ``1 / sqrt(D)``.
        segment_ids: [B, S] integer document index of each token (non-decreasing along S); tokens attend only
            to tokens of the same document. None (or one document per row) -> plain attention over the row.
        window: sliding-window size in keys (causal only; query t attends keys ``t - window < j <= t``); None:
            unlimited.
        dropout_p: dropout probability of the attention weights (pass 0 in eval).

    Raises:
        ValueError: inconsistent shapes, Hq not a multiple of Hkv, non-integer or decreasing segment_ids,
            ``causal=False`` under context parallelism or with a window, a window < 1, or a window / dropout
            under context parallelism (not supported yet).
    """
    check_shapes(q, k, v, segment_ids)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if window is not None and (window < 1 or not causal):
        raise ValueError(f"sliding-window attention needs causal=True and a window >= 1, got {window}")
    if parallel_state.get_context_parallel_world_size() > 1:
        if window is not None and window >= q.shape[2] * parallel_state.get_context_parallel_world_size():
            window = None  # covers the whole (CP-sharded) sequence: plain causal attention
        if not causal:
            raise ValueError("context parallel attention is causal only; got causal=False with "
                             "distributed_strategy.context_parallel_size > 1")
        if window is not None or dropout_p:
            raise ValueError("not supported yet: sliding-window attention or attention dropout with "
                             "distributed_strategy.context_parallel_size > 1")
        return context_parallel_attention(q, k, v, segment_ids=segment_ids, scale=scale,
                                          flash_attention=flash_attention)
    return local_attention(q, k, v, scale=scale, causal=causal, flash_attention=flash_attention,
                           segment_ids=segment_ids, window=window, dropout_p=dropout_p)
