"""Context-parallel batch sharding, applied once at the step boundary.

Shapes: every batch tensor is ``[B, S]`` (``input_ids``, ``labels``, ``position_ids``, ``segment_ids``); after
sharding each CP rank holds ``[B, S / cp]`` of it. ``c`` below is the chunk length.

Layouts (one per ``context_parallel_algo``):

* ``ring`` -- causal load balancing ("head-tail", Megatron-LM ``get_batch_on_this_cp_rank``, torchtitan
  ``context_parallel`` with the round-robin load balancer): S is cut into ``2 * cp`` chunks of ``c = S / (2 cp)``
  tokens and rank ``r`` keeps chunks ``r`` and ``2 cp - 1 - r``, concatenated in that order. Under a causal mask
  chunk ``i`` attends to ``i + 1`` chunks, so every rank does the same ``2 cp + 1`` chunk-pairs of work.
* ``ulysses`` -- contiguous: rank ``r`` keeps tokens ``[r S/cp, (r+1) S/cp)``. Ulysses all-to-alls the sequence
  back to full length (in rank order) before attention, so the attention cost is already balanced and a
  contiguous split keeps the gathered sequence in natural order with no permutation.

Labels are shifted by the data pipeline *before* sharding (``labels[t]`` is the target of position ``t``), so a
chunk edge never separates a token from its target; ``position_ids`` are sharded with the tokens, so RoPE angles
follow the shard. :func:`local_global_positions` gives the global position of each local token (what the ring
attention's causal mask compares).
"""

from __future__ import annotations

import torch

from nxd_lc.distributed import collectives, parallel_state

__all__ = [
    "CP_ALGOS",
    "context_parallel_loss",
    "local_chunk_ranges",
    "local_global_positions",
    "shard_batch_for_context_parallel",
]

CP_ALGOS = ("ring", "ulysses")


def _check(seq_len: int, cp_rank: int, cp_size: int, algo: str) -> int:
    """Validate the arguments; return the number of chunks S is cut into (2 cp for ring, cp for ulysses)."""
    if algo not in CP_ALGOS:
        raise ValueError(
            f"distributed_strategy.context_parallel_algo: unknown value {algo!r}; expected one of {list(CP_ALGOS)}"
        )
    if cp_size < 1 or not 0 <= cp_rank < cp_size:
        raise ValueError(f"context parallel rank {cp_rank} is not in [0, context_parallel_size={cp_size})")
    chunks = 2 * cp_size if algo == "ring" and cp_size > 1 else cp_size
    if seq_len % chunks:
        detail = f"2 x context_parallel_size = {chunks} (load-balanced ring)" if algo == "ring" else (
            f"context_parallel_size = {chunks}")
        raise ValueError(
            f"data.seq_length: sequence length {seq_len} is not divisible by {detail}; set data.seq_length "
            f"to a multiple of {chunks}"
        )
    return chunks


def local_chunk_ranges(seq_len: int, cp_rank: int, cp_size: int, algo: str) -> list[tuple[int, int]]:
    """Global ``[start, stop)`` token ranges this CP rank holds, in local order.

    ``ring``: ``[(r c, (r+1) c), ((2cp-1-r) c, (2cp-r) c)]`` with ``c = S / (2 cp)``; ``ulysses``:
    ``[(r S/cp, (r+1) S/cp)]``. With ``cp_size == 1`` the single range ``(0, S)``.

    Raises:
        ValueError: unknown ``algo``, a rank outside ``[0, cp_size)``, or ``seq_len`` not divisible by the number
            of chunks (the message names ``data.seq_length``).
    """
    chunks = _check(seq_len, cp_rank, cp_size, algo)
    if cp_size == 1:
        return [(0, seq_len)]
    c = seq_len // chunks
    if algo == "ulysses":
        return [(cp_rank * c, (cp_rank + 1) * c)]
    tail = 2 * cp_size - 1 - cp_rank
    return [(cp_rank * c, (cp_rank + 1) * c), (tail * c, (tail + 1) * c)]


def local_global_positions(seq_len: int, cp_rank: int, cp_size: int, algo: str,
                           device: torch.device | str | None = None) -> torch.Tensor:
    """Global token index of every local token: int64 ``[S / cp]`` (the concatenation of
    :func:`local_chunk_ranges`). These are indices into the packed sequence, not the (per-document) RoPE
    ``position_ids``. Raises as :func:`local_chunk_ranges`."""
    ranges = local_chunk_ranges(seq_len, cp_rank, cp_size, algo)
    return torch.cat([torch.arange(a, b, device=device) for a, b in ranges])


def shard_batch_for_context_parallel(batch: dict[str, torch.Tensor], cp_rank: int, cp_size: int,
                                     algo: str) -> dict[str, torch.Tensor]:
    """This CP rank's share of every ``[B, S]`` tensor of ``batch`` (a new dict; other entries copied as is).

    Args:
        batch: ``input_ids``, ``labels`` (already shifted), ``position_ids``, ``segment_ids`` and any other
            tensors whose dim 1 is the sequence (all ``[B, S]`` with the same ``S``); non-tensor values and
            tensors with fewer than 2 dims are passed through unchanged.
        cp_rank, cp_size: this rank's index in the CP group and the CP degree (from ``parallel_state``).
        algo: ``ring`` (head-tail load balancing) or ``ulysses`` (contiguous); see the module docstring.

    Returns:
        dict with each sequence tensor ``[B, S / cp]`` (contiguous); identical to ``batch`` when ``cp_size == 1``.

    Raises:
        ValueError: the sequence tensors disagree on ``S``, or ``S`` is not divisible by ``2 cp`` (ring) /
            ``cp`` (ulysses) (the message names ``data.seq_length``), or an unknown ``algo``.
    """
    seq_keys = [k for k, v in batch.items() if isinstance(v, torch.Tensor) and v.dim() >= 2]
    lengths = {k: batch[k].shape[1] for k in seq_keys}
    if len(set(lengths.values())) > 1:
        raise ValueError(f"context-parallel sharding: batch tensors disagree on the sequence length (dim 1): "
                         f"{lengths}; every [B, S] tensor must have the same S")
    if not seq_keys:
        return dict(batch)
    seq_len = next(iter(lengths.values()))
    ranges = local_chunk_ranges(seq_len, cp_rank, cp_size, algo)
    out = dict(batch)
    if cp_size == 1:
        return out
    index = _shard_index(ranges, batch[seq_keys[0]].device)
    for key in seq_keys:
        out[key] = batch[key].index_select(1, index)
    return out


_INDEX_CACHE: dict[tuple[tuple[tuple[int, int], ...], str], torch.Tensor] = {}


def _shard_index(ranges: list[tuple[int, int]], device: torch.device) -> torch.Tensor:
    """The sequence positions of ``ranges`` as an int64 ``[S / cp]`` tensor on ``device``, uploaded once per
    (ranges, device): a rank's shard is then selected by device data rather than by slice offsets that differ
    between CP ranks, so every CP rank traces the same graph on XLA (DESIGN.md 16)."""
    key = (tuple(ranges), str(device))
    index = _INDEX_CACHE.get(key)
    if index is None:
        index = torch.cat([torch.arange(a, b) for a, b in ranges]).to(device)
        if len(_INDEX_CACHE) > 64:  # a few (length, rank, device) combinations per run; never grows unbounded
            _INDEX_CACHE.clear()
        _INDEX_CACHE[key] = index
    return index


def context_parallel_loss(loss_sum: torch.Tensor, num_tokens: torch.Tensor) -> torch.Tensor:
    """This CP rank's training loss, normalised so that averaging gradients over DP x CP gives the gradient of
    the per-token mean over the whole (unsharded) micro-batch.

    ``loss = loss_sum * cp / N`` with ``N`` = labelled tokens summed over the CP group (clamped to >= 1).
    :func:`nxd_lc.distributed.grads.allreduce_data_parallel_gradients` divides the summed gradients by
    ``dp * cp``; the ``cp`` factor cancels, leaving ``(1 / dp) * sum_dp grad(sum_r loss_sum_r / N)``, i.e. the
    DP mean of each micro-batch's token mean (NxD semantics). The DP x CP average of the returned values is
    the same mean, so it can be logged as is. Identity scaling (``loss_sum / num_tokens``) at CP size 1.

    Args:
        loss_sum: fp32 scalar, sum of this rank's per-token losses (e.g. from ``causal_lm_loss``).
        num_tokens: integer scalar tensor, this rank's labelled tokens.

    Returns:
        fp32 scalar (differentiable in ``loss_sum``). Collective over the CP group (all-reduce of the count).
    """
    group = parallel_state.get_context_parallel_group()
    total = collectives.all_reduce(num_tokens.detach().reshape(1).to(torch.float32).clone(), group)[0]
    cp = collectives.group_size(group)
    return loss_sum * cp / torch.clamp(total.to(loss_sum.device), min=1.0)
