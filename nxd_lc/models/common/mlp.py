"""Feed-forward blocks, tensor parallel: Llama's SwiGLU (Shazeer 2020, arXiv:2002.05202) and GPT-2 / Megatron's
GeLU MLP (Hendrycks & Gimpel 2016, arXiv:1606.08415).

Shapes: x [B, S, H] (or [B, S/tp, H] under sequence parallelism) -> same. I = intermediate size.

``y = down_proj(silu(gate(x)) * up(x))`` (HF ``LlamaMLP``). ``gate`` and ``up`` are fused into one
:class:`~nxd_lc.layers.ColumnParallelLinear` ``gate_up_proj`` with weight ``[2*I/tp, H]`` and
``partition_stride=2``: the full (TP=1) weight is ``[gate; up]`` (``[2I, H]``) and rank ``r`` holds
``[gate rows r*I/tp:(r+1)*I/tp ; up rows r*I/tp:(r+1)*I/tp]``, so each rank splits its own output
in half and needs no communication. ``down_proj`` is a
:class:`~nxd_lc.layers.RowParallelLinear` ``[H, I/tp]``.

Tiled MLP (``tiled_chunk_size``, config ``model.tiled_mlp_chunk_size``; DeepSpeed ALST ``TiledMLP``,
arXiv:2506.13996): the input enters the TP region once (all-gather on S under sequence parallelism, identity
otherwise), the purely local ``down(silu(gate) * up)`` runs ``c`` tokens at a time through
:func:`~nxd_lc.layers.tiled.tiled_apply` (recomputed per chunk in backward, so the ``[B*S, 2I/tp]`` activations
are never all alive), and the partial sums leave the TP region once (reduce-scatter under SP, all-reduce
otherwise), exactly the collectives of the untiled layers. Gradients equal the untiled path.

``ffn_dropout`` (NeMo / Megatron ``ffn_dropout``): dropout on the activation between the two projections, with a
TP-layout-independent mask (:func:`~nxd_lc.layers.dropout.sharded_dropout`); not with the tiled MLP.

:class:`GeluMLP`: ``y = down_proj(gelu(up_proj(x)))`` with the exact (erf) GeLU, Megatron's ``F.gelu`` (GPT-2's
checkpoints use the tanh approximation ``gelu_new``); ``up_proj`` column-parallel ``[I/tp, H]``, ``down_proj``
row-parallel ``[H, I/tp]``.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from nxd_lc.distributed import parallel_state
from nxd_lc.distributed.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from nxd_lc.layers import ColumnParallelLinear, RowParallelLinear
from nxd_lc.layers.dropout import sharded_dropout
from nxd_lc.layers.fusions import liger_swiglu
from nxd_lc.layers.linear import InitMethod
from nxd_lc.layers.tiled import check_chunk_size, tiled_apply

__all__ = ["ActivationMultiplyMLP", "GeluMLP", "LlamaMLP"]


class ActivationMultiplyMLP(nn.Module):
    """``silu(gate) * up`` ([..., I/tp] each -> [..., I/tp]): the SwiGLU product as its own module, under NxDT's
    name, so ``model.activations_checkpoint_recompute: [ActivationMultiplyMLP]`` can recompute it (it has no
    parameters). ``kernel`` (``model.fusions.swiglu``, :mod:`nxd_lc.layers.fusions`): ``torch`` (two element-wise
    ops) or ``liger`` (Liger-Kernel's fused SiLU-multiply)."""

    def __init__(self) -> None:
        super().__init__()
        self.kernel = "torch"

    def forward(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.kernel == "liger":
            return liger_swiglu(gate, up)
        return F.silu(gate) * up


class LlamaMLP(nn.Module):
    """SwiGLU MLP with fused gate/up column-parallel projection and row-parallel down projection.

    Args:
        hidden_size: H.
        intermediate_size: I (must be divisible by the TP size).
        bias: add biases (HF ``mlp_bias``).
        sequence_parallel_enabled: input and output are split on the sequence dim over TP.
        init_method: in-place init of a full weight (e.g. ``normal_(0, initializer_range)``).
        use_cpu_initialization, dtype, device: passed to the parallel layers.
        tiled_chunk_size: tokens per chunk of the tiled MLP (see the module docstring), None = untiled. An
            attribute, so it can be set after construction (``apply_memory_techniques`` does).
        ffn_dropout: dropout probability on ``silu(gate) * up`` while training (module docstring).
        output_init_method: init of ``down_proj``'s weight (default ``init_method``).

    Raises:
        ValueError: (from the layers) if I is not divisible by the TP size; a non-positive tiled_chunk_size.
    """

    #: the tiled block is last (then only the row reduction and bias add, which save nothing): a checkpoint
    #: recomputation of this module may skip its chunk forwards (``nxd_lc.layers.tiled.discard_tiled_outputs``)
    tiled_output_unused_in_recompute: ClassVar[bool] = True

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        bias: bool = False,
        sequence_parallel_enabled: bool = False,
        init_method: InitMethod | None = None,
        use_cpu_initialization: bool = True,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        tiled_chunk_size: int | None = None,
        ffn_dropout: float = 0.0,
        output_init_method: InitMethod | None = None,
    ) -> None:
        super().__init__()
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.ffn_dropout = ffn_dropout
        if tiled_chunk_size is not None:
            check_chunk_size(tiled_chunk_size, "model.tiled_mlp_chunk_size")
        self.tiled_chunk_size = tiled_chunk_size
        common = {"init_method": init_method, "dtype": dtype, "device": device,
                      "use_cpu_initialization": use_cpu_initialization}
        self.gate_up_proj = ColumnParallelLinear(
            hidden_size, 2 * intermediate_size, bias=bias, gather_output=False,
            sequence_parallel_enabled=sequence_parallel_enabled, stride=2, **common,
        )
        self.down_proj = RowParallelLinear(
            intermediate_size, hidden_size, bias=bias, input_is_parallel=True,
            sequence_parallel_enabled=sequence_parallel_enabled,
            **{**common, "init_method": output_init_method or init_method},
        )
        self.act_mul = ActivationMultiplyMLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, S(/tp), H] -> [B, S(/tp), H]; tiled over tokens when ``tiled_chunk_size`` is set."""
        if self.tiled_chunk_size is not None:
            if self.ffn_dropout and self.training:
                raise ValueError("model.ffn_dropout > 0 is not supported with model.tiled_mlp_chunk_size")
            return self._tiled_forward(x)
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # each [B, S, I/tp]
        return self.down_proj(_ffn_dropout(self.act_mul(gate, up), self.ffn_dropout, self.training))

    def _local_mlp(self, x: torch.Tensor) -> torch.Tensor:
        """Rank-local part, no communication: x [N, H] (in the TP region) -> partial sums [N, H]."""
        gate, up = F.linear(x, self.gate_up_proj.weight, self.gate_up_proj.bias).chunk(2, dim=-1)  # [N, I/tp]
        return F.linear(self.act_mul(gate, up), self.down_proj.weight)

    def _tiled_forward(self, x: torch.Tensor) -> torch.Tensor:
        """Same as the untiled forward (same collectives), with the local part tiled over tokens."""
        col, row = self.gate_up_proj, self.down_proj
        if col.sequence_parallel_enabled:
            x = gather_from_sequence_parallel_region(x, to_model_parallel=True)  # [B, S, H]
        else:
            x = copy_to_tensor_model_parallel_region(x)
        params = [p for p in (col.weight, col.bias, row.weight) if p is not None]
        y = tiled_apply(self._local_mlp, x, self.tiled_chunk_size, params)  # [B, S, H] partial over TP
        if row.sequence_parallel_enabled:
            y = reduce_scatter_to_sequence_parallel_region(y)  # [B, S/tp, H]
        else:
            y = reduce_from_tensor_model_parallel_region(y)
        return y + row.bias if row.bias is not None else y


def _ffn_dropout(a: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """Dropout on the MLP activation a [..., I/tp] (this rank's contiguous block of the intermediate dim)."""
    if not p or not training:
        return a
    return sharded_dropout(a, p, training, shard_dim=a.dim() - 1,
                           num_shards=parallel_state.get_tensor_model_parallel_world_size(),
                           shard_index=parallel_state.rank_tensor("tp", a.device))


class GeluMLP(nn.Module):
    """GPT-2 / Megatron MLP: ``down_proj(dropout(gelu(up_proj(x))))`` (module docstring).

    Args:
        hidden_size, intermediate_size, bias, sequence_parallel_enabled, init_method, use_cpu_initialization,
            dtype, device, ffn_dropout, output_init_method: as :class:`LlamaMLP`.

    Raises:
        ValueError: (from the layers) if I is not divisible by the TP size.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = True,
                 sequence_parallel_enabled: bool = False, init_method: InitMethod | None = None,
                 use_cpu_initialization: bool = True, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None, ffn_dropout: float = 0.0,
                 output_init_method: InitMethod | None = None) -> None:
        super().__init__()
        self.hidden_size, self.intermediate_size, self.ffn_dropout = hidden_size, intermediate_size, ffn_dropout
        common = {"dtype": dtype, "device": device, "use_cpu_initialization": use_cpu_initialization}
        self.up_proj = ColumnParallelLinear(hidden_size, intermediate_size, bias=bias, gather_output=False,
                                            sequence_parallel_enabled=sequence_parallel_enabled,
                                            init_method=init_method, **common)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias, input_is_parallel=True,
                                           sequence_parallel_enabled=sequence_parallel_enabled,
                                           init_method=output_init_method or init_method, **common)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, S(/tp), H] -> [B, S(/tp), H]."""
        a = F.gelu(self.up_proj(x))  # [B, S, I/tp]
        return self.down_proj(_ffn_dropout(a, self.ffn_dropout, self.training))
