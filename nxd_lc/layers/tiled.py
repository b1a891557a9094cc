"""Sequence-tiled computations that never hold a whole ``[L, big]`` activation: tiled vocab-parallel
cross-entropy and tiled token-wise blocks (the MLP).

Shapes: ``L`` tokens (``B * S`` flattened; under sequence parallelism the full S of this rank's TP group,
i.e. *after* the column layer's all-gather), ``H`` hidden, ``Vl = Vp / tp`` this TP rank's vocabulary slice,
``c`` the chunk size in tokens.

* :func:`tiled_causal_lm_loss` -- summed cross-entropy of the lm head ``hidden [B, S, H] @ W[Vl, H]^T`` over
  vocab-sharded logits, computed ``c`` tokens at a time. Each chunk builds its ``[c, Vl]`` logits, runs
  :func:`~nxd_lc.layers.cross_entropy.parallel_cross_entropy` (TP collectives included) and immediately
  back-propagates the chunk's loss to ``hidden`` and ``W`` (the fused linear-cross-entropy idea of Liger-Kernel,
  Hsu et al. 2024, arXiv:2410.10989; Wijmans et al. 2024 "Cut your losses", arXiv:2411.09009). Only the
  ``[L, H]`` and ``[Vl, H]`` gradients are kept for backward, where they are scaled by the incoming scalar
  gradient. Same FLOPs as the untiled path (no recomputation) and peak logits memory ``O(c * Vl)``.
* :func:`tiled_cross_entropy` -- the per-token variant (``[B, S]`` losses, e.g. for DPO log-probs or loss by
  position): each chunk runs under ``torch.utils.checkpoint`` so its logits are recomputed in backward.
* :func:`tiled_apply` -- a token-wise function (each output row depends only on the same input row, e.g. the
  SwiGLU MLP between its column all-gather and row reduce-scatter) applied ``c`` tokens at a time; forward
  keeps only the input, backward recomputes each chunk and back-propagates it (DeepSpeed ALST ``TiledMLP``,
  Bekman et al. 2025, arXiv:2506.13996). ``fn`` must not run collectives (they would be re-run per chunk).
  Under ``torch.compile`` each chunk is a non-reentrant ``torch.utils.checkpoint`` instead (same memory
  contract; dynamo cannot trace ``autograd.grad`` inside a custom Function's backward).
* :func:`discard_tiled_outputs` -- inside an activation-checkpoint *recomputation* whose region ends with the
  tiled block (the decoder layer, the MLP module), :func:`tiled_apply` saves its input for backward but skips the
  chunk forwards: their result would be thrown away (a non-reentrant checkpoint recomputes a region only for the
  tensors it saves), and the tiled backward recomputes every chunk anyway. Full checkpointing + tiled MLP then
  runs the MLP forward twice per step instead of three times (ALST's ``TiledMLP`` under checkpointing: three).

Numerics equal the untiled path up to float summation order (chunks are summed one after another).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch.compiler import is_compiling
from torch.utils.checkpoint import checkpoint

from nxd_lc.layers.cross_entropy import parallel_cross_entropy

__all__ = [
    "check_chunk_size",
    "discard_tiled_outputs",
    "tiled_apply",
    "tiled_causal_lm_loss",
    "tiled_cross_entropy",
    "vocab_parallel_logits",
]


def check_chunk_size(chunk_size: int, key: str) -> int:
    """Return ``chunk_size`` if it is a positive int; ValueError naming config ``key`` otherwise."""
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"{key}: chunk size must be a positive number of tokens (or null to disable), "
                         f"got {chunk_size!r}")
    return chunk_size


def _spans(num_tokens: int, chunk_size: int) -> list[tuple[int, int]]:
    """``[(start, end), ...]`` covering ``range(num_tokens)`` in chunks of ``chunk_size`` (last may be shorter)."""
    return [(s, min(s + chunk_size, num_tokens)) for s in range(0, num_tokens, chunk_size)]


def vocab_parallel_logits(hidden: torch.Tensor, weight: torch.Tensor,
                          num_valid_vocab_local: int | torch.Tensor) -> torch.Tensor:
    """This rank's logits ``hidden [..., H] @ weight[Vl, H]^T -> [..., Vl]`` with padded vocab columns masked.

    Columns ``>= num_valid_vocab_local`` (vocabulary padding to a multiple of TP) are set to the dtype's lowest
    finite value, so they add ``exp(...) = 0`` to every softmax and receive no gradient. ``hidden`` must already
    be in the TP region (all-gathered under SP / ``copy_to_tensor_model_parallel_region`` otherwise).
    ``num_valid_vocab_local`` is an int, or an int64 ``[1]`` device tensor when it differs between TP ranks (the
    mask is then always applied, so every rank traces the same graph).
    """
    logits = F.linear(hidden, weight)
    if isinstance(num_valid_vocab_local, torch.Tensor):
        pad = torch.arange(logits.shape[-1], device=logits.device) >= num_valid_vocab_local
        return logits.masked_fill(pad, torch.finfo(logits.dtype).min)
    if num_valid_vocab_local < logits.shape[-1]:
        pad = torch.arange(logits.shape[-1], device=logits.device) >= num_valid_vocab_local
        logits = logits.masked_fill(pad, torch.finfo(logits.dtype).min)
    return logits


def _check_head_inputs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> None:
    if hidden.shape[:-1] != labels.shape or hidden.shape[-1] != weight.shape[-1] or weight.dim() != 2:
        raise ValueError(
            f"tiled cross-entropy: hidden [..., H] {tuple(hidden.shape)}, lm-head weight [Vl, H] "
            f"{tuple(weight.shape)} and labels [...] {tuple(labels.shape)} disagree"
        )
    if labels.dtype.is_floating_point or labels.dtype == torch.bool:
        raise ValueError(f"tiled cross-entropy: labels must be an integer (long) tensor, got {labels.dtype}")


class _TiledLinearCrossEntropySum(torch.autograd.Function):
    """``sum_t CE(hidden[t] @ W^T, labels[t])`` with the gradients computed chunk by chunk in forward."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_size: int,
                num_valid: int, ignore_index: int) -> torch.Tensor:
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.zeros_like(hidden) if need_h else None  # chunks are disjoint: no accumulation
        grad_w = torch.zeros_like(weight, dtype=torch.float32) if need_w else None  # summed over chunks
        w = weight.detach().requires_grad_(need_w)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start, end in _spans(hidden.shape[0], chunk_size):
            with torch.enable_grad():
                h = hidden[start:end].detach().requires_grad_(need_h)
                logits = vocab_parallel_logits(h, w, num_valid)  # [c, Vl]
                loss = parallel_cross_entropy(logits, labels[start:end], ignore_index).sum()
                inputs = [t for t, need in ((h, need_h), (w, need_w)) if need]
                grads = list(torch.autograd.grad(loss, inputs))
            if need_h:
                grad_h[start:end] = grads.pop(0)
            if need_w:
                grad_w += grads.pop(0)
            total += loss.detach()
        ctx.save_for_backward(grad_h, grad_w)
        ctx.weight_dtype = weight.dtype
        return total

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grad_h, grad_w = ctx.saved_tensors
        gh = grad_h * grad_loss.to(grad_h.dtype) if grad_h is not None else None
        gw = (grad_w * grad_loss.float()).to(ctx.weight_dtype) if grad_w is not None else None
        return gh, gw, None, None, None, None


def tiled_causal_lm_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *, chunk_size: int,
                         num_valid_vocab_local: int | torch.Tensor,
                         ignore_index: int = -100) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed next-token cross-entropy of a vocab-parallel lm head, ``chunk_size`` tokens at a time.

    Equals ``causal_lm_loss(vocab_parallel_logits(hidden, weight, nv), labels)`` (loss and gradients of
    ``hidden`` and ``weight``) without ever holding more than ``[chunk_size, Vl]`` logits. The gradients are
    computed during forward (one ``[c, Vl]`` chunk alive at a time) and scaled by the incoming gradient in
    backward; under ``no_grad`` only the loss is computed. Each chunk runs the three TP all-reduces of
    :func:`parallel_cross_entropy` (max, target logit, sum of exp), so very small chunks cost latency at TP > 1.

    Args:
        hidden: ``[B, S, H]`` (or ``[L, H]``) lm-head input already in the TP region (see
            :func:`vocab_parallel_logits`), any float dtype.
        weight: ``[Vl, H]`` this rank's lm-head shard (``ColumnParallelLinear.weight``).
        labels: ``[B, S]`` long, already shifted; ``ignore_index`` marks tokens without loss.
        chunk_size: tokens per chunk (``model.tiled_loss_chunk_size``).
        num_valid_vocab_local: real (unpadded) vocab entries in this rank's slice.

    Returns:
        ``(loss_sum, num_tokens)``: fp32 scalar and int64 scalar count of labelled tokens (no host sync).

    Raises:
        ValueError: shapes disagree, labels not integer, or ``chunk_size`` not a positive int.
    """
    check_chunk_size(chunk_size, "model.tiled_loss_chunk_size")
    _check_head_inputs(hidden, weight, labels)
    flat_h, flat_y = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1).long()
    num_tokens = (flat_y != ignore_index).sum()
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        loss = _TiledLinearCrossEntropySum.apply(flat_h, weight, flat_y, chunk_size, num_valid_vocab_local,
                                                 ignore_index)
        return loss, num_tokens
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    for start, end in _spans(flat_h.shape[0], chunk_size):
        logits = vocab_parallel_logits(flat_h[start:end], weight, num_valid_vocab_local)
        total = total + parallel_cross_entropy(logits, flat_y[start:end], ignore_index).sum()
    return total, num_tokens


def _chunk_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, num_valid: int,
                         ignore_index: int) -> torch.Tensor:
    return parallel_cross_entropy(vocab_parallel_logits(hidden, weight, num_valid), labels, ignore_index)


def tiled_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *, chunk_size: int,
                        num_valid_vocab_local: int | torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Per-token cross-entropy ``[B, S]`` fp32 of a vocab-parallel lm head, ``chunk_size`` tokens at a time.

    Each chunk's ``[c, Vl]`` logits are recomputed in backward (``torch.utils.checkpoint``, non-reentrant),
    so at most one chunk of logits is alive in forward and in backward. Arguments as
    :func:`tiled_causal_lm_loss`; 0 where ``labels == ignore_index``. Costs one extra lm-head matmul per
    chunk in backward; prefer :func:`tiled_causal_lm_loss` when only the sum is needed.

    Raises:
        ValueError: shapes disagree, labels not integer, or ``chunk_size`` not a positive int.
    """
    check_chunk_size(chunk_size, "model.tiled_loss_chunk_size")
    _check_head_inputs(hidden, weight, labels)
    flat_h, flat_y = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1).long()
    grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    pieces = []
    for start, end in _spans(flat_h.shape[0], chunk_size):
        args = (flat_h[start:end], weight, flat_y[start:end], num_valid_vocab_local, ignore_index)
        pieces.append(checkpoint(_chunk_cross_entropy, *args, use_reentrant=False) if grad
                      else _chunk_cross_entropy(*args))
    return torch.cat(pieces).view(labels.shape)


_STATE = threading.local()  # the autograd engine runs a recomputation in one thread, enter to exit


@contextlib.contextmanager
def discard_tiled_outputs() -> Iterator[None]:
    """While active (in this thread), :func:`tiled_apply` with gradients returns an *uninitialised* ``[L, H']``
    tensor instead of running ``fn``: it still saves ``x`` and builds the same backward.

    Only for the recomputation pass of a non-reentrant ``torch.utils.checkpoint`` region in which nothing after
    the tiled call saves a tensor for backward (then the region's outputs are discarded and the early stop of
    the recomputation ends it at the tiled call's saved input). :mod:`nxd_lc.models.common.checkpointing` enters
    it for modules whose class sets ``tiled_output_unused_in_recompute = True``.
    """
    prev = getattr(_STATE, "discard", False)
    _STATE.discard = True
    try:
        yield
    finally:
        _STATE.discard = prev


class _TiledTokenwise(torch.autograd.Function):
    """``fn`` applied to row chunks of ``x [L, H]``; backward recomputes and back-propagates chunk by chunk."""

    @staticmethod
    def forward(ctx: Any, fn: Callable[[torch.Tensor], torch.Tensor], chunk_size: int, x: torch.Tensor,
                *params: torch.Tensor) -> torch.Tensor:
        spans = _spans(x.shape[0], chunk_size)
        if getattr(_STATE, "discard", False):  # checkpoint recomputation: only the saved x matters
            proto = fn(x[:0])  # [0, H'] in fn's output dtype (autocast included)
            out = proto.new_empty((x.shape[0], proto.shape[-1]))
        else:
            out = torch.cat([fn(x[s:e]) for s, e in spans])  # grad mode is off in forward: no graph is kept
        ctx.fn, ctx.spans, ctx.params = fn, spans, params
        ctx.save_for_backward(x)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (x,) = ctx.saved_tensors
        need_x = ctx.needs_input_grad[2]
        need_p = list(ctx.needs_input_grad[3:])
        params = [p for p, need in zip(ctx.params, need_p) if need]
        grad_x = torch.empty_like(x) if need_x else None
        acc = [torch.zeros_like(p, dtype=torch.float32) for p in params]  # summed over chunks in fp32
        for s, e in ctx.spans:
            with torch.enable_grad():
                xc = x[s:e].detach().requires_grad_(need_x)
                y = ctx.fn(xc)
                inputs = ([xc] if need_x else []) + params
                grads = list(torch.autograd.grad(y, inputs, grad_out[s:e]))
            if need_x:
                grad_x[s:e] = grads.pop(0)
            for a, g in zip(acc, grads):
                a += g
        it = iter(acc)
        grad_params = [next(it).to(p.dtype) if need else None for p, need in zip(ctx.params, need_p)]
        return (None, None, grad_x, *grad_params)


def tiled_apply(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, chunk_size: int,
                params: Sequence[torch.Tensor]) -> torch.Tensor:
    """Apply a token-wise ``fn`` to ``x [..., H] -> [..., H']`` ``chunk_size`` tokens at a time.

    Forward keeps only ``x``; backward recomputes ``fn`` per chunk and back-propagates it, so activations
    inside ``fn`` (e.g. the ``[L, 2I/tp]`` gate/up output of the MLP) exist for one chunk at a time (ALST
    ``TiledMLP``). Gradients of ``x`` and of ``params`` equal those of ``fn(x)`` up to summation order.

    Args:
        fn: maps ``[c, H] -> [c, H']`` row by row; must not run collectives or use randomness.
        x: input, flattened to ``[L, H]`` tokens (contiguous views are free).
        chunk_size: tokens per chunk (``model.tiled_mlp_chunk_size``).
        params: every tensor ``fn`` uses that needs a gradient (the module's parameters); their gradients are
            returned through autograd (accumulated in fp32 over chunks, cast to the parameter dtype).

    Raises:
        ValueError: ``chunk_size`` not a positive int, or ``x`` is a scalar.
    """
    check_chunk_size(chunk_size, "model.tiled_mlp_chunk_size")
    if x.dim() < 1:
        raise ValueError("tiled_apply: x must have at least one dimension (tokens x features)")
    flat = x.reshape(-1, x.shape[-1])
    grad = torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in params))
    spans = _spans(flat.shape[0], chunk_size)
    if not grad:
        out = torch.cat([fn(flat[s:e]) for s, e in spans])
    elif is_compiling():
        # traced (model.compile): dynamo cannot trace autograd.grad inside _TiledTokenwise.backward; per-chunk
        # non-reentrant checkpoints keep the same memory contract (only the chunk inputs are saved, each chunk
        # is recomputed alone in backward) and trace as torch's checkpoint higher-order op
        out = torch.cat([checkpoint(fn, flat[s:e], use_reentrant=False) for s, e in spans])
    else:
        out = _TiledTokenwise.apply(fn, chunk_size, flat, *params)
    return out.view(*x.shape[:-1], out.shape[-1])
