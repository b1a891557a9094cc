"""Local (single-device) core attention: score / softmax / value over the heads and sequence this rank holds.

The dispatch point is :func:`nxd_lc.context.attention.core_attention`: context parallelism (ring / Ulysses) or
:func:`local_attention` (this module), which Ulysses also calls for its local heads.

Shapes (batch-first heads-major, as in HF transformers and torch SDPA):
    q            [B, Hq, S, D]
    k, v         [B, Hkv, S, D]   Hq % Hkv == 0 (grouped-query attention, Ainslie et al. 2023, arXiv:2305.13245)
    segment_ids  [B, S] integer   index of the packed document each token belongs to, non-decreasing along S
    output       [B, Hq, S, D]    same dtype as q

Query head ``h`` attends with KV head ``h // (Hq / Hkv)`` (HF ``repeat_kv`` order); the KV heads are
expanded locally, i.e. on the heads this rank holds, so no communication is involved.

Dispatch (in :func:`nxd_lc.context.attention.core_attention` and :func:`local_attention`, in this order):

1. Context parallel (``parallel_state.get_context_parallel_world_size() > 1``): the sequence is sharded over
   the CP group; :func:`nxd_lc.context.attention.context_parallel_attention` (ring / Ulysses) receives the
   un-expanded ``k``/``v`` (``Hkv`` heads), the local ``segment_ids`` shard and ``flash_attention`` (Ulysses'
   local kernel).
2. ``flash_attention=True``: :func:`torch.nn.functional.scaled_dot_product_attention` with ``is_causal=True``
   and no ``attn_mask``, so torch takes its flash kernel on CPU and CUDA and no ``S x S`` tensor exists.
   Document masking (packed documents attend only within themselves, as ProLong, Gao et al. 2024,
   arXiv:2410.02660) runs SDPA once per document: q/k/v are split along S at the boundaries read from
   ``segment_ids``. Reading the boundaries is one device -> host copy of ``segment_ids`` per call (fine on
   CPU/CUDA). Memory stays O(S) per document; FLOPs drop to ``sum(len_doc^2)``.
   On XLA (q on an ``xla`` device) that copy would be a host sync and the split shapes would change the graph
   with every batch, so document masking is one SDPA call with a boolean ``[B, 1, S, S]`` mask built on the
   device from ``segment_ids`` (``same document AND causal``): fixed shapes, no host sync, one graph for any
   document lengths (:func:`document_mask`).
3. ``flash_attention=False``: the explicit reference ``softmax(Q K^T * scale + mask) V`` (Vaswani et al.
   2017) with the softmax in float32, as HF's ``eager_attention_forward``; it materialises the
   ``[B, Hq, S, S]`` scores and the ``[B, 1, S, S]`` causal/document mask.

Both local paths give the same result as running each document alone (no cross-document leakage; every
query sees at least itself, so no row of the softmax is empty).

Sliding-window attention (``window``, Mistral; Beltagy et al. 2020, arXiv:2004.05150): query t attends keys
``t - window < j <= t`` (transformers' ``sliding_window_overlay``). When the window is shorter than the sequence,
the flash path runs one SDPA call with a boolean ``[B|1, 1, S, S]`` band mask (and'ed with the document mask for
packed batches; O(S^2) memory, the price of a mask on CPU SDPA); a window >= S is plain causal attention.
Attention dropout (``dropout_p``) is SDPA's ``dropout_p`` on the flash paths and a dropout of the probabilities on
the eager path; :class:`CoreAttention` draws it from a per-TP-rank seeded stream (:meth:`CoreAttention._dropout_rng`).
Neither is supported yet under context parallelism or on the traced (compiled) document path.
"""

from __future__ import annotations

import logging
import math

import torch
import torch.nn.functional as F
from torch.compiler import is_compiling

from nxd_lc.runtime.accel import HOST, compiles_per_shape

log = logging.getLogger(__name__)

__all__ = ["band_mask", "cached_attention", "document_lengths", "local_attention", "repeat_kv"]


def repeat_kv(x: torch.Tensor, num_rep: int) -> torch.Tensor:
    """[B, Hkv, S, D] -> [B, Hkv * num_rep, S, D], each KV head repeated ``num_rep`` times in place order."""
    if num_rep == 1:
        return x
    b, h, s, d = x.shape
    return x[:, :, None].expand(b, h, num_rep, s, d).reshape(b, h * num_rep, s, d)


def check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segment_ids: torch.Tensor | None) -> int:
    """Validate q/k/v (and segment_ids) shapes; return the GQA group size Hq // Hkv."""
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4:
        raise ValueError(
            f"core_attention expects q [B,Hq,S,D], k and v [B,Hkv,S,D]; got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} disagree on batch, sequence or head_dim")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of KV heads ({k.shape[1]})")
    if segment_ids is not None:
        if tuple(segment_ids.shape) != (q.shape[0], q.shape[2]):
            raise ValueError(f"segment_ids must be [B, S] = {(q.shape[0], q.shape[2])} like the queries, got "
                             f"{tuple(segment_ids.shape)}")
        if segment_ids.is_floating_point() or segment_ids.dtype == torch.bool:
            raise ValueError(f"segment_ids must be an integer tensor, got {segment_ids.dtype}")
    return q.shape[1] // k.shape[1]


def document_lengths(segment_ids: torch.Tensor) -> list[list[int]]:
    """Lengths of the runs of equal ids in each row of ``segment_ids [B, S]`` (host lists; sum of a row = S).

    One device -> host copy of ``segment_ids`` (a synchronisation on CUDA).

    Raises:
        ValueError: ``segment_ids`` is not 2-D, or decreases along S in some row (documents are contiguous,
            numbered in order; see the batch contract in ``nxd_lc.data.packing``).
    """
    if segment_ids.dim() != 2:
        raise ValueError(f"segment_ids must be [B, S], got shape {tuple(segment_ids.shape)}")
    seg = segment_ids.detach().to(HOST, torch.int64)  # host read (a graph break under torch.compile)
    if seg.shape[1] > 1:
        bad = (seg[:, 1:] < seg[:, :-1]).nonzero()
        if bad.numel():
            row, col = bad[0].tolist()
            raise ValueError(f"segment_ids must be non-decreasing along the sequence; row {row} goes from "
                             f"{int(seg[row, col])} to {int(seg[row, col + 1])} at position {col + 1}")
    return [torch.unique_consecutive(row, return_counts=True)[1].tolist() for row in seg]


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool,
          dropout_p: float = 0.0) -> torch.Tensor:
    """Fused SDPA without a mask tensor (flash / memory-efficient kernel); k, v already expanded to Hq heads."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, dropout_p=dropout_p)


def _sdpa_split(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int], scale: float,
                causal: bool, dropout_p: float = 0.0) -> torch.Tensor:
    """SDPA on each S-segment of ``lengths`` separately (views, no copies), concatenated back along S."""
    if len(lengths) == 1:
        return _sdpa(q, k, v, scale, causal, dropout_p)
    parts = zip(q.split(lengths, dim=2), k.split(lengths, dim=2), v.split(lengths, dim=2))
    return torch.cat([_sdpa(qi, ki, vi, scale, causal, dropout_p) for qi, ki, vi in parts], dim=2)


def _flash_documents(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segment_ids: torch.Tensor,
                     scale: float, causal: bool, dropout_p: float = 0.0) -> torch.Tensor:
    """Document-masked attention as one SDPA call per document (per batch row unless all rows agree)."""
    rows = document_lengths(segment_ids)
    if all(r == rows[0] for r in rows):
        return _sdpa_split(q, k, v, rows[0], scale, causal, dropout_p)
    outs = [_sdpa_split(q[b:b + 1], k[b:b + 1], v[b:b + 1], lengths, scale, causal, dropout_p)
            for b, lengths in enumerate(rows)]
    return torch.cat(outs, dim=0)


def band_mask(s: int, window: int, device: torch.device) -> torch.Tensor:
    """Boolean ``[S, S]`` sliding-window causal mask: True where key j may be attended by query t
    (``t - window < j <= t``)."""
    idx = torch.arange(s, device=device)
    diff = idx[:, None] - idx[None, :]  # t - j
    return (diff >= 0) & (diff < window)


def _allowed_mask(s: int, device: torch.device, segment_ids: torch.Tensor | None, causal: bool,
                  window: int | None) -> torch.Tensor | None:
    """The boolean "may attend" mask ``[B|1, 1, S, S]`` of the eager and masked-SDPA paths (None: no mask);
    device tensor ops only (no host sync)."""
    allowed: torch.Tensor | None = None
    if window is not None:
        allowed = band_mask(s, window, device)[None, None]
    elif causal:
        allowed = torch.ones(s, s, dtype=torch.bool, device=device).tril()[None, None]
    if segment_ids is not None:
        same_doc = (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]  # [B, 1, S, S]
        allowed = same_doc if allowed is None else allowed & same_doc
    return allowed


def document_mask(segment_ids: torch.Tensor, causal: bool) -> torch.Tensor:
    """Boolean ``[B, 1, S, S]`` "may attend" mask from ``segment_ids [B, S]``: same document (and key <= query
    when ``causal``). Built with device tensor ops only (no host sync, shape independent of the documents)."""
    mask = _allowed_mask(segment_ids.shape[1], segment_ids.device, segment_ids, causal, None)
    assert mask is not None
    return mask


def _sdpa_masked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segment_ids: torch.Tensor, scale: float,
                 causal: bool) -> torch.Tensor:
    """Document-masked SDPA in one call with a boolean mask (the XLA path: static shapes, no host sync)."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=document_mask(segment_ids, causal), scale=scale)


def _eager_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool,
                     segment_ids: torch.Tensor | None, window: int | None = None,
                     dropout_p: float = 0.0) -> torch.Tensor:
    """Reference path: materialises the [B, Hq, S, S] scores and a [B|1, 1, S, S] boolean mask; fp32 softmax."""
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale
    allowed = _allowed_mask(q.shape[2], q.device, segment_ids, causal, window)
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    if dropout_p:
        probs = F.dropout(probs, dropout_p)
    return torch.matmul(probs, v)


def local_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, causal: bool = True,
                    flash_attention: bool = True, segment_ids: torch.Tensor | None = None,
                    window: int | None = None, dropout_p: float = 0.0) -> torch.Tensor:
    """The single-device branches of :func:`core_attention` (no context-parallel dispatch): shapes as there.

    Context-parallel Ulysses calls this on its head-sharded, full-sequence q/k/v; everything else should call
    :func:`core_attention`.
    """
    num_rep = q.shape[1] // k.shape[1]
    k, v = repeat_kv(k, num_rep), repeat_kv(v, num_rep)
    if window is not None and window >= q.shape[2]:
        window = None  # the window covers every earlier position: plain causal attention
    if not flash_attention:
        return _eager_attention(q, k, v, scale, causal, segment_ids, window, dropout_p)
    if window is not None:
        mask = _allowed_mask(q.shape[2], q.device, segment_ids, causal, window)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, dropout_p=dropout_p)
    if q.device.type == "xla":
        if dropout_p:
            mask = _allowed_mask(q.shape[2], q.device, segment_ids, causal, None)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, dropout_p=dropout_p)
        return _xla_flash(q, k, v, segment_ids, scale, causal)
    if segment_ids is None:
        return _sdpa(q, k, v, scale, causal, dropout_p)
    if compiles_per_shape(q.device):
        # TorchNeuron's eager device compiles each op per shape: the per-document split below would read document
        # lengths on the host and give every new document length its own compile; one masked SDPA keeps the
        # step's shapes fixed (as on XLA), at O(S^2) mask memory
        mask = _allowed_mask(q.shape[2], q.device, segment_ids, causal, None) if dropout_p else \
            document_mask(segment_ids, causal)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, dropout_p=dropout_p)
    if is_compiling() and causal:
        if dropout_p:
            raise ValueError("not supported yet: attention dropout with model.compile on packed documents")
        # traced: the per-document split reads document lengths on the host and has data-dependent shapes; the
        # tiled, document-masked ring kernel on this rank alone (one custom op with its own backward op,
        # O(S) memory) replaces it in the graph
        from nxd_lc.context.ring import ring_attention

        return ring_attention(q, k, v, segment_ids=segment_ids, scale=scale, over_context_parallel=False)
    return _flash_documents(q, k, v, segment_ids, scale, causal, dropout_p)


def cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None,
                     window: int | None = None) -> torch.Tensor:
    """Attention of the newest ``S`` positions over all ``T >= S`` positions of a KV cache (inference).

    q [B, Hq, S, D] are the last S of the T positions of k / v [B, Hkv, T, D] (GQA: Hq a multiple of Hkv): query i
    (absolute position T - S + i) attends keys ``<= T - S + i`` (a bottom-right-aligned causal mask; none for
    S = 1, the plain causal one for S = T), and with ``window`` only the keys ``> T - S + i - window``. Runs torch
    SDPA on any device.

    Raises:
        ValueError: S > T, or Hq not a multiple of Hkv.
    """
    s, t = q.shape[2], k.shape[2]
    if s > t or q.shape[1] % k.shape[1]:
        raise ValueError(f"cached_attention: q {tuple(q.shape)} must be the last positions of k {tuple(k.shape)} "
                         "with query heads a multiple of KV heads")
    rep = q.shape[1] // k.shape[1]
    k, v = repeat_kv(k, rep), repeat_kv(v, rep)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if window is not None and window < t:
        mask = torch.ones(s, t, dtype=torch.bool, device=q.device)
        mask = mask.tril(t - s) & ~mask.tril(t - s - window)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    if s == t:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    mask = None if s == 1 else torch.ones(s, t, dtype=torch.bool, device=q.device).tril(t - s)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


_NKI_OPTIONS: dict[str, object] = {"transpose_nki_inputs": True, "lnc": None}
_warned_nki_documents = False


def set_nki_options(transpose_nki_inputs: bool, lnc: int | None) -> None:
    """Set ``model.transpose_nki_inputs`` and ``trainer.lnc`` for the NKI kernel path (called once at startup);
    ``lnc`` None leaves it to :func:`nxd_lc.context.nki.resolve_lnc` (``NEURON_LOGICAL_NC_CONFIG``, else 2 on
    Trn2, 1 elsewhere)."""
    _NKI_OPTIONS.update(transpose_nki_inputs=bool(transpose_nki_inputs), lnc=lnc)


def _xla_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segment_ids: torch.Tensor | None, scale: float,
               causal: bool) -> torch.Tensor:
    """XLA flash path: the NKI kernel on Neuron (``neuronxcc`` importable), else one SDPA call.

    q, k, v [B, H, S, D] -> [B, H, S, D]: :func:`local_attention` has expanded k/v to the query heads (``repeat_kv``),
    as NxDT's model does before calling NxD's kernel, whose backward asserts equal head counts (the kernel path,
    :func:`nxd_lc.context.nki.flash_attention`, expands any GQA k/v itself too). A sequence that is not a multiple
    of 2048 is refused there with a ValueError (no SDPA fallback).

    Lazy tensors: no host read of document boundaries and no data-dependent shapes. Document masking uses a
    boolean [B,1,S,S] mask built on the device (the NKI kernel takes no segment ids, so on Neuron a packed batch
    with document masking falls back to that masked SDPA, with a one-time warning).
    """
    global _warned_nki_documents
    from nxd_lc.context import nki

    kernels = nki.load_nki_kernels()
    if segment_ids is not None:
        if kernels is not None and not _warned_nki_documents:
            _warned_nki_documents = True
            log.warning("NKI flash attention has no document masking: packed batches use masked SDPA (O(L^2) "
                        "memory); set data.cross_document_attention: true to use the NKI kernel")
        return _sdpa_masked(q, k, v, segment_ids, scale, causal)
    if kernels is None:
        return _sdpa(q, k, v, scale, causal)
    transpose = bool(_NKI_OPTIONS["transpose_nki_inputs"])
    if transpose:  # the kernel's [B, H, D, S] layout, as NxD's model hands it over
        q, k, v = (t.transpose(2, 3) for t in (q, k, v))
    return nki.flash_attention(q, k, v, scale=scale, causal=causal, transpose_nki_inputs=transpose,
                               lnc=_NKI_OPTIONS["lnc"], kernels=kernels)  # type: ignore[arg-type]


