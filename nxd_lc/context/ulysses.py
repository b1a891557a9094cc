"""Ulysses context parallelism: all-to-all from sequence sharding to head sharding and back.

Shapes (``cp`` = CP degree, ``L = S / cp`` local tokens in the contiguous layout of
:mod:`nxd_lc.context.sharding`; heads are those of this TP rank):
    q            [B, Hq, L, D]    ->  [B, Hq / cp, S, D]    (all-to-all: scatter heads, gather sequence)
    k, v         [B, Hkv, L, D]   ->  [B, Hkv' / cp, S, D]  (Hkv' = Hkv * rep, see below)
    segment_ids  [B, L]           ->  [B, S]                (all-gather over CP, no gradient)
    output       [B, Hq, L, D]    <-  [B, Hq / cp, S, D]    (the inverse all-to-all)

Algorithm: DeepSpeed-Ulysses (Jacobs et al. 2023, arXiv:2309.14509). Each CP rank runs ordinary causal
(document-masked) attention over the full sequence for ``Hq / cp`` of the heads, through the single-device
attention paths of :mod:`nxd_lc.context.local` (SDPA flash kernel / per-document SDPA / eager).
Because the sequence shards are contiguous and concatenated in CP-rank order, the gathered sequence is in
natural order and the causal mask needs no permutation.

GQA: the CP ranks must each receive whole KV heads for their query heads. With ``Hkv % cp != 0`` (e.g. KV
heads < CP degree) every KV head is repeated ``rep = cp / gcd(Hkv, cp)`` times in place (HF ``repeat_kv``
order) before the all-to-all; ``Hq`` divisible by both ``cp`` and ``Hkv`` makes it divisible by
``lcm(Hkv, cp) = Hkv * rep``, so query head ``h`` still meets its KV head ``h // (Hq / Hkv)``. The repeat's
backward sums the replicas' gradients.
"""

from __future__ import annotations

import math

import torch

from nxd_lc.context import local as local_attention
from nxd_lc.distributed import collectives, parallel_state
from nxd_lc.distributed.mappings import all_to_all_context_parallel_region

__all__ = ["ulysses_attention", "ulysses_kv_replication"]

_HEAD_DIM, _SEQ_DIM = 1, 2


def ulysses_kv_replication(num_query_heads: int, num_kv_heads: int, cp_size: int) -> int:
    """How many times each KV head is repeated so every CP rank gets whole KV heads: ``cp / gcd(Hkv, cp)``
    (1 when ``Hkv % cp == 0``).

    Raises:
        ValueError: ``num_query_heads`` (per TP rank) not divisible by ``cp_size``, naming
            ``distributed_strategy.context_parallel_size`` and ``num_attention_heads``; or not a multiple of
            ``num_kv_heads``.
    """
    if num_query_heads % cp_size:
        raise ValueError(
            f"Ulysses context parallelism needs the query heads of each TP rank ({num_query_heads} = "
            f"num_attention_heads / tensor_model_parallel_size) divisible by "
            f"distributed_strategy.context_parallel_size ({cp_size}); change context_parallel_size, "
            f"num_attention_heads or tensor_model_parallel_size, or use context_parallel_algo: ring"
        )
    if num_query_heads % num_kv_heads:
        raise ValueError(f"query heads ({num_query_heads}) must be a multiple of KV heads ({num_kv_heads})")
    return cp_size // math.gcd(num_kv_heads, cp_size)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segment_ids: torch.Tensor | None, scale: float,
            flash_attention: bool) -> torch.Tensor:
    """Single-device causal attention of the head-sharded, full-sequence q/k/v (the non-CP branches of
    :func:`nxd_lc.context.attention.core_attention`, which would re-dispatch to CP itself)."""
    return local_attention.local_attention(q, k, v, scale=scale, causal=True, flash_attention=flash_attention,
                                           segment_ids=segment_ids)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, segment_ids: torch.Tensor | None = None,
                      scale: float | None = None, flash_attention: bool = True) -> torch.Tensor:
    """Causal attention of sequence-sharded q/k/v via head-sharded attention over the full sequence.

    Args:
        q: ``[B, Hq, L, D]`` this CP rank's contiguous sequence shard (``L = S / cp``).
        k, v: ``[B, Hkv, L, D]`` (not expanded to Hq heads).
        segment_ids: ``[B, L]`` integer packed-document ids of the local tokens, or None.
        scale: score scale, default ``1 / sqrt(D)``.
        flash_attention: SDPA (True) or the eager fp32-softmax reference (False) for the local attention.

    Returns:
        ``[B, Hq, L, D]``, equal to full-sequence attention restricted to the local rows. Collective over the
        CP group (all-to-all forward and backward, all-gather of segment_ids).

    Raises:
        ValueError: ``Hq`` not divisible by the CP degree (see :func:`ulysses_kv_replication`) or shapes that
            disagree.
    """
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:]:
        raise ValueError(f"ulysses_attention expects q [B,Hq,L,D], k and v [B,Hkv,L,D]; got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    cp = parallel_state.get_context_parallel_world_size()
    rep = ulysses_kv_replication(q.shape[1], k.shape[1], cp)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    k, v = local_attention.repeat_kv(k, rep), local_attention.repeat_kv(v, rep)
    q, k, v = (all_to_all_context_parallel_region(t, _HEAD_DIM, _SEQ_DIM) for t in (q, k, v))
    if segment_ids is not None:
        segment_ids = collectives.all_gather(segment_ids, 1, parallel_state.get_context_parallel_group())
    out = _attend(q, k, v, segment_ids, scale, flash_attention)  # [B, Hq / cp, S, D]
    return all_to_all_context_parallel_region(out, _SEQ_DIM, _HEAD_DIM)
