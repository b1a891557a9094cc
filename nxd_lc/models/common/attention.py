"""The attention module of the decoder layers, :class:`CoreAttention`: a parameter-free wrapper of the attention
dispatch :func:`nxd_lc.context.attention.core_attention` (local kernels in :mod:`nxd_lc.context.local`, ring /
Ulysses under context parallelism), named after NxDT's ``activations_checkpoint_recompute: [CoreAttention]`` so
selective activation checkpointing can target it by class name. Shapes: as :func:`core_attention`
(q ``[B, Hq, S, D]``, k / v ``[B, Hkv, S, D]``, output ``[B, Hq, S, D]``)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from nxd_lc.context.attention import core_attention
from nxd_lc.distributed import parallel_state
from nxd_lc.runtime.accel import HOST

__all__ = ["CoreAttention"]


class CoreAttention(nn.Module):
    """Module wrapper of :func:`core_attention` (no parameters).

    Named after NxDT's ``activations_checkpoint_recompute: [CoreAttention]`` so selective activation
    checkpointing can target it by class name. ``forward(q, k, v, segment_ids=None) -> [B, Hq, S, D]``.
    """

    def __init__(self, flash_attention: bool = True, causal: bool = True, scale: float | None = None,
                 window: int | None = None, dropout: float = 0.0) -> None:
        super().__init__()
        self.flash_attention = flash_attention
        self.causal = causal
        self.scale = scale
        self.window = window
        self.dropout = dropout

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                segment_ids: torch.Tensor | None = None) -> torch.Tensor:
        """See :func:`core_attention`; ``segment_ids`` [B, S] restricts attention to each packed document;
        ``dropout`` applies while training only (:meth:`_dropout_rng`)."""
        kw = {"flash_attention": self.flash_attention, "causal": self.causal, "scale": self.scale,
              "segment_ids": segment_ids, "window": self.window}
        if not (self.dropout and self.training) or q.device.type == "xla":
            return core_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, **kw)
        with self._dropout_rng(q.device):
            return core_attention(q, k, v, dropout_p=self.dropout, **kw)

    @staticmethod
    @contextlib.contextmanager
    def _dropout_rng(device: torch.device) -> Iterator[None]:
        """The attention-probability masks' random stream: one 62-bit seed drawn from the host generator every rank
        shares (the same single draw at any layout, so the masks drawn after it, e.g. the hidden dropout, do not
        depend on the TP size), offset by the TP rank (each rank's heads get their own masks, the decorrelation
        Megatron-LM's model-parallel RNG tracker gives), used in a forked RNG state that is restored afterwards.
        Activation checkpointing restores the host generator, so the recomputation draws the same seed."""
        seed = int(torch.randint(0, 2**62, (1,), device=HOST).item()) + 1_000_003 * \
            parallel_state.get_tensor_model_parallel_rank()
        with torch.random.fork_rng(devices=[device] if device.type != HOST.type else [], device_type=device.type):
            torch.manual_seed(seed)
            yield

    def extra_repr(self) -> str:
        """Printed in ``repr(model)``."""
        extra = (f", window={self.window}" if self.window is not None else "") + (
            f", dropout={self.dropout}" if self.dropout else "")
        return f"flash_attention={self.flash_attention}, causal={self.causal}{extra}"
