"""Autograd-aware collectives over the tensor-parallel (TP) group.

Each function is the forward half of a conjugate pair (Megatron-LM ``mappings.py``, NxD
``parallel_layers/mappings.py``): the backward applies the adjoint collective so that gradients
are exact. Layout: activations are batch-first ``[B, S, H]``; the "TP region" split is on the
last dim (features) and the sequence-parallel split is on dim 1 (sequence), giving
``[B, S/tp, H]`` on each rank. Every function is the identity when the TP world size is 1.

| function                                   | forward                  | backward               |
|--------------------------------------------|--------------------------|------------------------|
| copy_to_tensor_model_parallel_region       | identity                 | all-reduce             |
| reduce_from_tensor_model_parallel_region   | all-reduce               | identity               |
| scatter_to_tensor_model_parallel_region    | keep own last-dim chunk  | all-gather last dim    |
| gather_from_tensor_model_parallel_region   | all-gather last dim      | keep own chunk         |
| scatter_to_sequence_parallel_region        | keep own dim-1 chunk     | all-gather dim 1       |
| gather_from_sequence_parallel_region       | all-gather dim 1         | reduce-scatter dim 1 * |
| reduce_scatter_to_sequence_parallel_region | reduce-scatter dim 1     | all-gather dim 1       |
| sequence_parallel_linears                  | all-gather dim 1, linears| all-gather dim 1 again,|
|                                            | (keeps only the shard)   | reduce-scatter dim 1   |

(*) when ``to_model_parallel=True`` (the consumer is a TP column layer, so every rank's gradient
is a partial sum); with ``False`` the backward just keeps the own chunk.

:func:`sequence_parallel_linears` is the input of every column-parallel linear under sequence parallelism: it
keeps the ``[B, S/tp, H]`` shard for the weight gradients instead of the gathered ``[B, S, H]`` (NxD
``LinearWithAsyncCommunication``, Megatron-LM ``LinearWithGradAccumulationAndAsyncCommunication``).

Reductions (all-reduce, reduce-scatter) run in the *reduce dtype* (:func:`set_reduce_dtype`, from
``precision.parallel_layers_reduce_dtype``; NxD's ``reduce_dtype``, default fp32): a bf16 activation or gradient
is cast up, summed and cast back, so TP partial sums of bf16 layers are accumulated in fp32 unless bf16 is asked
for. Gathers and scatters move data unchanged.

Context parallelism adds one pair over the CP group: :func:`all_to_all_context_parallel_region`
(all-to-all forward, the inverse all-to-all backward; Ulysses' sequence <-> head exchange).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from nxd_lc.distributed import collectives, parallel_state

_SEQ_DIM = 1
_REDUCE_DTYPE: torch.dtype = torch.float32


def set_reduce_dtype(dtype: torch.dtype) -> None:
    """Set the dtype TP/SP reductions run in (``precision.parallel_layers_reduce_dtype``; fp32 or bf16).

    Raises:
        ValueError: a dtype other than float32 / bfloat16.
    """
    global _REDUCE_DTYPE
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"precision.parallel_layers_reduce_dtype must be fp32 or bf16, got {dtype}")
    _REDUCE_DTYPE = dtype


def get_reduce_dtype() -> torch.dtype:
    """The dtype TP/SP reductions run in (default float32)."""
    return _REDUCE_DTYPE


def _in_reduce_dtype(x: torch.Tensor, reduce: Any) -> torch.Tensor:
    """``reduce(x)`` computed in the reduce dtype and returned in x's dtype (non-float x: unchanged dtype)."""
    if not x.is_floating_point() or x.dtype == _REDUCE_DTYPE:
        return reduce(x)
    return reduce(x.to(_REDUCE_DTYPE)).to(x.dtype)


def _split(x: torch.Tensor, dim: int) -> torch.Tensor:
    """This TP rank's chunk of ``x`` along ``dim`` (requires divisibility), gathered by an index computed from the
    rank as device data (:func:`~nxd_lc.distributed.parallel_state.rank_tensor`): every TP rank traces the same graph
    (DESIGN.md 16; a Python ``chunk(...)[rank]`` bakes each rank's offset into its graph)."""
    world = parallel_state.get_tensor_model_parallel_world_size()
    if world == 1:
        return x
    if x.shape[dim] % world != 0:
        raise ValueError(
            f"cannot split dim {dim} of size {x.shape[dim]} over tensor_model_parallel_size {world}; "
            f"the sequence length / feature size must be a multiple of {world}"
        )
    n = x.shape[dim] // world
    index = parallel_state.rank_tensor("tp", x.device) * n + torch.arange(n, device=x.device)
    return x.index_select(dim, index)


def _all_reduce(x: torch.Tensor) -> torch.Tensor:
    group = parallel_state.get_tensor_model_parallel_group()
    if collectives.group_size(group) == 1:
        return x
    return _in_reduce_dtype(x, lambda t: collectives.all_reduce(t.contiguous().clone(), group))


def _gather(x: torch.Tensor, dim: int) -> torch.Tensor:
    return collectives.all_gather(x, dim, parallel_state.get_tensor_model_parallel_group())


def _reduce_scatter(x: torch.Tensor, dim: int) -> torch.Tensor:
    group = parallel_state.get_tensor_model_parallel_group()
    return _in_reduce_dtype(x, lambda t: collectives.reduce_scatter(t, dim, group))


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return _all_reduce(grad)


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return _all_reduce(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return _split(x, -1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return _gather(grad, -1)


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return _gather(x, -1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return _split(grad, -1)


class _ScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return _split(x, _SEQ_DIM)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return _gather(grad, _SEQ_DIM)


class _GatherFromSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, to_model_parallel: bool) -> torch.Tensor:
        ctx.to_model_parallel = to_model_parallel
        return _gather(x, _SEQ_DIM)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        if ctx.to_model_parallel:
            return _reduce_scatter(grad, _SEQ_DIM), None
        return _split(grad, _SEQ_DIM), None


class _ReduceScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return _reduce_scatter(x, _SEQ_DIM)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return _gather(grad, _SEQ_DIM)


def copy_to_tensor_model_parallel_region(x: torch.Tensor) -> torch.Tensor:
    """Identity forward, TP all-reduce of the gradient (input of a column-parallel layer)."""
    return _CopyToTP.apply(x)


def reduce_from_tensor_model_parallel_region(x: torch.Tensor) -> torch.Tensor:
    """TP all-reduce (sum) forward, identity backward (output of a row-parallel layer)."""
    return _ReduceFromTP.apply(x)


def scatter_to_tensor_model_parallel_region(x: torch.Tensor) -> torch.Tensor:
    """``[..., F]`` -> this rank's ``[..., F/tp]``; backward all-gathers the last dim.

    Raises:
        ValueError: if ``F`` is not divisible by the TP size.
    """
    return _ScatterToTP.apply(x)


def gather_from_tensor_model_parallel_region(x: torch.Tensor) -> torch.Tensor:
    """``[..., F/tp]`` -> ``[..., F]`` (ranks concatenated in order); backward keeps own chunk."""
    return _GatherFromTP.apply(x)


def scatter_to_sequence_parallel_region(x: torch.Tensor) -> torch.Tensor:
    """``[B, S, H]`` -> this rank's ``[B, S/tp, H]``; backward all-gathers dim 1.

    Raises:
        ValueError: if ``S`` is not divisible by the TP size.
    """
    return _ScatterToSP.apply(x)


def gather_from_sequence_parallel_region(x: torch.Tensor, to_model_parallel: bool = True) -> torch.Tensor:
    """``[B, S/tp, H]`` -> ``[B, S, H]``.

    Backward: reduce-scatter along dim 1 when ``to_model_parallel`` (the gathered tensor feeds a
    TP-sharded computation, so each rank holds a partial gradient of the full sequence);
    otherwise each rank already holds the full gradient and just keeps its own chunk.
    """
    return _GatherFromSP.apply(x, to_model_parallel)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor) -> torch.Tensor:
    """``[B, S, H]`` partial sums -> summed ``[B, S/tp, H]`` (output of a row-parallel layer under
    sequence parallelism); backward all-gathers dim 1.

    Raises:
        ValueError: if ``S`` is not divisible by the TP size.
    """
    return _ReduceScatterToSP.apply(x)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a linear on ``x`` computes in: the autocast dtype where autocast is on for x's device, else x's."""
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return x.dtype


def _cast(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return t if t is None or t.dtype == dtype or not t.is_floating_point() else t.to(dtype)


class _SequenceParallelLinears(torch.autograd.Function):
    """``[B, S/tp, in]`` -> all-gather on S -> one ``F.linear`` per weight; saves the shard, not ``[B, S, in]``.

    Inputs: ``x``, ``n`` (number of weights), then ``n`` weights ``[out_i, in]`` and ``n`` biases ``[out_i]`` or
    None. Backward: the input gradient ``sum_i dy_i W_i`` ``[B, S, in]`` is reduce-scattered on S (in the reduce
    dtype); the shard is all-gathered again for ``dW_i = dy_i^T x`` and only when a weight needs a gradient.
    Under autocast the operands are cast to the autocast dtype as ``F.linear`` would (the shard before the
    gather) and each gradient returned in its input's dtype.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, num_weights: int, *params: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        weights, biases = params[:num_weights], params[num_weights:]
        dtype = _compute_dtype(x)
        ctx.num_weights, ctx.dtype, ctx.x_dtype = num_weights, dtype, x.dtype
        ctx.bias_dtypes = tuple(None if b is None else b.dtype for b in biases)
        x = _cast(x, dtype)
        x_full = _gather(x, _SEQ_DIM)  # [B, S, in]: used here, not kept
        ctx.save_for_backward(x, *weights)
        return tuple(F.linear(x_full, _cast(w, dtype), _cast(b, dtype)) for w, b in zip(weights, biases))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, *weights = ctx.saved_tensors
        n = ctx.num_weights
        need_x, need_w, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[2:2 + n], ctx.needs_input_grad[2 + n:]
        x_full = _gather(x, _SEQ_DIM).reshape(-1, x.shape[-1]) if any(need_w) else None  # [B*S, in]
        grad_x = None
        grad_w: list[torch.Tensor | None] = []
        grad_b: list[torch.Tensor | None] = []
        for g, w, nw, nb, b_dtype in zip(grads, weights, need_w, need_b, ctx.bias_dtypes):
            g = g.to(ctx.dtype)
            if need_x:
                part = g.matmul(_cast(w, ctx.dtype))  # [B, S, in]
                grad_x = part if grad_x is None else grad_x + part
            g2 = g.reshape(-1, g.shape[-1])  # [B*S, out_i]
            grad_w.append(g2.t().matmul(x_full).to(w.dtype) if nw else None)
            grad_b.append(g2.sum(0).to(b_dtype) if nb else None)
        if grad_x is not None:
            grad_x = _reduce_scatter(grad_x, _SEQ_DIM).to(ctx.x_dtype)  # [B, S/tp, in]
        return (grad_x, None, *grad_w, *grad_b)


def sequence_parallel_linears(
    x: torch.Tensor, weights: Sequence[torch.Tensor], biases: Sequence[torch.Tensor | None] | None = None,
) -> tuple[torch.Tensor, ...]:
    """Column-parallel linears on a sequence-parallel input that keep only its shard for the backward.

    ``x [B, S/tp, in]`` is all-gathered over TP on dim 1 to ``[B, S, in]`` and ``y_i = x W_i^T + b_i`` returned
    for each weight ``W_i [out_i/tp, in]`` -> ``y_i [B, S, out_i/tp]``. The same as
    ``gather_from_sequence_parallel_region(x, to_model_parallel=True)`` followed by ``F.linear`` per weight (same
    outputs and gradients within rounding), except that autograd keeps ``x [B, S/tp, in]`` instead of the
    gathered ``[B, S, in]``: backward all-gathers it again for the weight gradients and reduce-scatters the input
    gradient on dim 1 (one collective more per backward, ``tp`` times less activation memory; NxD
    ``layers_utils.LinearWithAsyncCommunication``, Megatron-LM ``LinearWithGradAccumulationAndAsyncCommunication``
    with ``sequence_parallel``; Korthikanti et al. 2022, arXiv:2205.05198, section 4.2.2).

    Args:
        biases: one per weight (None entries for none); None for no biases at all.

    Raises:
        ValueError: if ``S`` is not divisible by the TP size (from the backward's reduce-scatter).
    """
    biases = [None] * len(weights) if biases is None else list(biases)
    if len(biases) != len(weights):
        raise ValueError(f"sequence_parallel_linears: {len(weights)} weights but {len(biases)} biases")
    return _SequenceParallelLinears.apply(x, len(weights), *weights, *biases)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scatter_dim: int, gather_dim: int, group: Any) -> torch.Tensor:
        ctx.dims, ctx.group = (scatter_dim, gather_dim), group
        return collectives.all_to_all(x, scatter_dim, gather_dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        scatter_dim, gather_dim = ctx.dims
        return collectives.all_to_all(grad.contiguous(), gather_dim, scatter_dim, ctx.group), None, None, None


def all_to_all_context_parallel_region(x: torch.Tensor, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """All-to-all over the context-parallel (CP) group (DeepSpeed-Ulysses, Jacobs et al. 2023, arXiv:2309.14509).

    Forward: split ``x`` along ``scatter_dim`` into ``cp`` chunks, send chunk ``r`` to CP rank ``r`` and
    concatenate the received chunks along ``gather_dim`` in CP-rank order, e.g. ``[B, H, S/cp, D]`` with
    ``scatter_dim=1, gather_dim=2`` -> ``[B, H/cp, S, D]``. Backward: the adjoint all-to-all (dims swapped).
    Identity when the CP size is 1.

    Raises:
        ValueError: if ``x.shape[scatter_dim]`` is not divisible by the CP size.
    """
    return _AllToAll.apply(x, scatter_dim, gather_dim, parallel_state.get_context_parallel_group())


class _AllReduceBoth(torch.autograd.Function):
    """Sum over ``group`` forward, and the gradients summed over ``group`` backward: the adjoint of a sum whose
    result every rank of the group uses in its own (different) loss."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return collectives.all_reduce(x.contiguous().clone(), group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return collectives.all_reduce(grad.contiguous().clone(), ctx.group), None


def sum_over_context_parallel_region(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the context-parallel group, gradients summed over it too (identity at CP size 1).

    For statistics pooled over every CP rank's tokens that each CP rank then puts into its own loss share (e.g.
    the mixture-of-experts load-balancing loss): with losses ``L_r(S)`` of ``S = sum_r s_r``, the gradient of
    ``sum_r L_r`` with respect to rank r's ``s_r`` is ``sum_r' dL_r'/dS``, the all-reduce of the backward.
    """
    group = parallel_state.get_context_parallel_group()
    if collectives.group_size(group) == 1:
        return x
    return _AllReduceBoth.apply(x, group)


def all_to_all_expert_parallel_region(x: torch.Tensor, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """All-to-all over the expert-parallel (EP) group, as :func:`all_to_all_context_parallel_region` over CP:
    e.g. expert-major token slots ``[E, C, H]`` with ``scatter_dim=0, gather_dim=1`` -> ``[E/ep, ep*C, H]``
    (each rank receives its experts' slots from every EP rank, in EP-rank order). Backward: the adjoint
    all-to-all. Identity when the EP size is 1.

    Raises:
        ValueError: if ``x.shape[scatter_dim]`` is not divisible by the EP size.
    """
    return _AllToAll.apply(x, scatter_dim, gather_dim, parallel_state.get_expert_model_parallel_group())

