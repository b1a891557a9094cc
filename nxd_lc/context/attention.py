"""Context-parallel attention entry point: the one function the attention dispatch calls when CP > 1.

Shapes (per CP rank; ``L = S / cp`` local tokens in the layout of the chosen algorithm, see
:mod:`nxd_lc.context.sharding`):
    q            [B, Hq, L, D]
    k, v         [B, Hkv, L, D]   (un-expanded GQA KV heads)
    segment_ids  [B, L] integer or None
    output       [B, Hq, L, D]

The algorithm (``ring`` or ``ulysses``, config ``distributed_strategy.context_parallel_algo``) is a process-wide
setting: :func:`set_context_parallel_algo` is called once at startup (``nxd_lc.train``), next to
``parallel_state.initialize_model_parallel``; it must match the one used to shard the batch
(:func:`nxd_lc.context.sharding.shard_batch_for_context_parallel`), since the two layouts differ.
"""

from __future__ import annotations

import torch

from nxd_lc.context.ring import ring_attention
from nxd_lc.context.sharding import CP_ALGOS
from nxd_lc.context.ulysses import ulysses_attention

__all__ = ["context_parallel_attention", "get_context_parallel_algo", "set_context_parallel_algo"]

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
