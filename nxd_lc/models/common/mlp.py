"""Llama feed-forward block (SwiGLU, Shazeer 2020, arXiv:2002.05202), tensor parallel.

Shapes: x [B, S, H] (or [B, S/tp, H] under sequence parallelism) -> same. I = intermediate size.

``y = down_proj(silu(gate(x)) * up(x))`` (HF ``LlamaMLP``). ``gate`` and ``up`` are fused into one
:class:`~nxd_lc.layers.ColumnParallelLinear` ``gate_up_proj`` with weight ``[2*I/tp, H]`` and
``partition_stride=2``: the full (TP=1) weight is ``[gate; up]`` (``[2I, H]``) and rank ``r`` holds
``[gate rows r*I/tp:(r+1)*I/tp ; up rows r*I/tp:(r+1)*I/tp]``, so each rank splits its own output
in half and needs no communication. ``down_proj`` is a
:class:`~nxd_lc.layers.RowParallelLinear` ``[H, I/tp]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nxd_lc.layers import ColumnParallelLinear, RowParallelLinear
from nxd_lc.layers.linear import InitMethod

__all__ = ["LlamaMLP"]


class LlamaMLP(nn.Module):
    """SwiGLU MLP with fused gate/up column-parallel projection and row-parallel down projection.

    Args:
        hidden_size: H.
        intermediate_size: I (must be divisible by the TP size).
        bias: add biases (HF ``mlp_bias``).
        sequence_parallel_enabled: input and output are split on the sequence dim over TP.
        init_method: in-place init of a full weight (e.g. ``normal_(0, initializer_range)``).
        use_cpu_initialization, dtype, device: passed to the parallel layers.

    Raises:
        ValueError: (from the layers) if I is not divisible by the TP size.
    """

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
    ) -> None:
        super().__init__()
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        common = {"init_method": init_method, "dtype": dtype, "device": device,
                      "use_cpu_initialization": use_cpu_initialization}
        self.gate_up_proj = ColumnParallelLinear(
            hidden_size, 2 * intermediate_size, bias=bias, gather_output=False,
            sequence_parallel_enabled=sequence_parallel_enabled, stride=2, **common,
        )
        self.down_proj = RowParallelLinear(
            intermediate_size, hidden_size, bias=bias, input_is_parallel=True,
            sequence_parallel_enabled=sequence_parallel_enabled, **common,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, S(/tp), H] -> [B, S(/tp), H]."""
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # each [B, S, I/tp]
        return self.down_proj(F.silu(gate) * up)
