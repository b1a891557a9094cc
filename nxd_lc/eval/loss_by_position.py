"""Held-out loss of a causal LM split by token position: does a long-context model use its long context?

Per-token next-token loss on packed held-out sequences, averaged within position buckets given by ``edges``
(``[e0, e1), [e1, e2), ...``; e.g. ``0, 2048, 8192`` separates positions inside the original training length of
a model from the extended ones). The position of a token is its RoPE ``position_ids`` entry: the number of
preceding tokens of its own context. With document-masked packing (``data.cross_document_attention: false``)
that is the offset inside its document; with cross-document attention it is the offset in the packed row.
Tokens whose label is ``ignore_index`` are not counted.

Shapes: batches are dicts of ``[B, S]`` tensors (``input_ids``, ``labels`` already shifted, ``position_ids``,
``segment_ids``), as :mod:`nxd_lc.data.datamodule` yields them. The model maps ``(input_ids, position_ids,
segment_ids)`` to this TP rank's vocab-parallel logits ``[B, S, Vp/tp]``; per-token losses come from
:func:`nxd_lc.layers.parallel_cross_entropy` (exact over TP). Under context parallelism each batch is sharded
once with :func:`nxd_lc.context.shard_batch_for_context_parallel` (positions follow the shard, so bucketing the
local tokens is exact), and the bucket sums and counts are all-reduced over the DP x CP group.

Command line (single process, or torchrun at the config's ``TP x CP`` (x DP) layout)::

    python -m nxd_lc.cli.loss_by_position --config-name cpu_tiny_llama_yarn_config \\
        --hf-dir nxd_lc_runs/hf/cpu_tiny_llama --edges 0,2048,8192 --num-samples 8 --json out.json --png out.png
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Sequence
from typing import Any, Callable

import torch

from nxd_lc.distributed import collectives
from nxd_lc.distributed import parallel_state as ps
from nxd_lc.layers import parallel_cross_entropy

log = logging.getLogger("nxd_lc.eval.loss_by_position")

Batch = dict[str, torch.Tensor]
ModelFn = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


def parse_edges(text: str | Sequence[int]) -> list[int]:
    """Bucket edges from ``"0,2048,8192"`` (or a sequence of ints): at least two, strictly increasing, >= 0.

    Raises:
        ValueError: not integers, fewer than two, negative, or not strictly increasing (names ``--edges``).
    """
    try:
        edges = [int(x) for x in (text.split(",") if isinstance(text, str) else text)]
    except (TypeError, ValueError) as e:
        raise ValueError(f"--edges: expected comma-separated integers like 0,2048,8192, got {text!r}") from e
    if len(edges) < 2 or edges[0] < 0 or any(b <= a for a, b in zip(edges, edges[1:])):
        raise ValueError(f"--edges: need >= 2 strictly increasing non-negative integers (e.g. 0,2048,8192), "
                         f"got {edges}")
    return edges


def bucket_label(lo: int, hi: int) -> str:
    """``"[lo, hi)"``: the name of a bucket in results and tables."""
    return f"[{lo}, {hi})"


def per_token_loss(model: ModelFn, batch: Batch, ignore_index: int = -100) -> torch.Tensor:
    """fp32 ``[B, S]`` next-token loss of every token of ``batch`` (0 where ``labels == ignore_index``).

    ``model(input_ids, position_ids, segment_ids)`` returns logits_local ``[B, S, Vp/tp]`` (vocab-parallel;
    full vocab at TP = 1). Runs without gradient.
    """
    with torch.no_grad():
        logits = model(batch["input_ids"], batch["position_ids"], batch.get("segment_ids"))
        loss = parallel_cross_entropy(logits, batch["labels"], ignore_index=ignore_index).float()
    return loss.masked_fill(batch["labels"] == ignore_index, 0.0)


def bucket_sums(loss: torch.Tensor, labels: torch.Tensor, position_ids: torch.Tensor, edges: Sequence[int],
                ignore_index: int = -100) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-bucket ``(loss sum fp64 [K], token count int64 [K])`` for ``K = len(edges) - 1`` buckets.

    Token ``t`` falls in bucket ``k`` when ``edges[k] <= position_ids[t] < edges[k+1]``; tokens outside all
    buckets and tokens with ``labels == ignore_index`` are skipped. ``loss``, ``labels``, ``position_ids``:
    ``[B, S]``.
    """
    valid = (labels != ignore_index).reshape(-1)
    pos = position_ids.reshape(-1)[valid].to(torch.int64)
    vals = loss.reshape(-1)[valid].to(torch.float64)
    bounds = torch.as_tensor(list(edges), dtype=torch.int64, device=pos.device)
    idx = torch.bucketize(pos, bounds, right=True) - 1  # edges[k] <= p < edges[k+1] -> k
    inside = (idx >= 0) & (idx < len(edges) - 1)
    k = len(edges) - 1
    sums = torch.zeros(k, dtype=torch.float64, device=pos.device).index_add_(0, idx[inside], vals[inside])
    counts = torch.bincount(idx[inside], minlength=k)[:k].to(torch.int64)
    return sums.cpu(), counts.cpu()


def summarize(sums: torch.Tensor, counts: torch.Tensor, edges: Sequence[int]) -> dict[str, Any]:
    """Result dict from bucket sums/counts: ``{"edges", "buckets": {label: {"loss", "ppl", "num_tokens"}},
    "overall": {...}}``; ``loss`` is the mean nat loss (NaN for an empty bucket), ``ppl = exp(loss)``."""

    def entry(s: float, n: int) -> dict[str, Any]:
        loss = s / n if n else float("nan")
        return {"loss": loss, "ppl": math.exp(loss) if n and loss < 700 else float("nan"), "num_tokens": n}

    buckets = {bucket_label(lo, hi): entry(float(sums[i]), int(counts[i]))
               for i, (lo, hi) in enumerate(zip(edges, edges[1:]))}
    return {"edges": list(edges), "buckets": buckets, "overall": entry(float(sums.sum()), int(counts.sum()))}


def loss_by_position(model: ModelFn, batches: Iterable[Batch], edges: Sequence[int], *,
                     ignore_index: int = -100, context_parallel_algo: str = "ring",
                     device: torch.device | str | None = None) -> dict[str, Any]:
    """Mean next-token loss per position bucket over ``batches`` (see the module docstring).

    Collective when ``parallel_state`` is initialised: every rank of the model-parallel layout calls it with its
    own DP slice of the data (TP and CP ranks of one replica with the same full batches). Under CP > 1 each batch
    is sharded here (``context_parallel_algo``) and totals are all-reduced over the DP x CP group; TP ranks
    compute identical per-token losses. Single process: no collective.

    Args:
        model: ``(input_ids, position_ids, segment_ids) -> logits_local [B, S, Vp/tp]``, e.g. an nxd_lc
            :class:`~nxd_lc.models.llama.model.LlamaForCausalLM` (put it in eval mode).
        batches: full-length ``[B, S]`` batches (``input_ids``, ``labels``, ``position_ids``, optional
            ``segment_ids``).
        edges: bucket edges, see :func:`parse_edges`.
        device: where batches are moved before the forward (default: left where they are).

    Returns:
        :func:`summarize`'s dict, identical on every rank.

    Raises:
        ValueError: bad edges, or a batch without ``input_ids`` / ``labels`` / ``position_ids``.
    """
    edges = parse_edges(edges)
    k = len(edges) - 1
    sums, counts = torch.zeros(k, dtype=torch.float64), torch.zeros(k, dtype=torch.int64)
    cp = ps.get_context_parallel_world_size() if ps.model_parallel_is_initialized() else 1
    for i, batch in enumerate(batches):
        missing = [key for key in ("input_ids", "labels", "position_ids") if key not in batch]
        if missing:
            raise ValueError(f"loss_by_position: batch {i} lacks {missing}; batches come from the data module's "
                             "collate (input_ids, labels, position_ids, segment_ids)")
        if device is not None:
            batch = {key: v.to(device) if isinstance(v, torch.Tensor) else v for key, v in batch.items()}
        if cp > 1:
            from nxd_lc.context import shard_batch_for_context_parallel

            batch = shard_batch_for_context_parallel(batch, ps.get_context_parallel_rank(), cp,
                                                     context_parallel_algo)
        loss = per_token_loss(model, batch, ignore_index)
        s, n = bucket_sums(loss, batch["labels"], batch["position_ids"], edges, ignore_index)
        sums += s
        counts += n
    if ps.model_parallel_is_initialized() and collectives.is_initialized():
        group = ps.get_data_parallel_group(with_context_parallel=True)
        total = collectives.all_reduce(torch.cat([sums, counts.to(torch.float64)]), group)
        sums, counts = total[:k], total[k:].round().to(torch.int64)
    return summarize(sums, counts, edges)


def format_table(result: dict[str, Any], title: str = "") -> str:
    """A fixed-width text table of a :func:`loss_by_position` result (one row per bucket, then all)."""
    rows = [(label, r) for label, r in result["buckets"].items()] + [("all", result["overall"])]
    lines = [title] if title else []
    lines.append(f"{'positions':>18} | {'loss':>8} | {'ppl':>10} | {'tokens':>9}")
    lines.append("-" * len(lines[-1]))
    for label, r in rows:
        lines.append(f"{label:>18} | {r['loss']:8.4f} | {r['ppl']:10.2f} | {r['num_tokens']:9d}")
    return "\n".join(lines)

