"""Adapter to the NKI flash-attention kernel of the Neuron compiler (``neuronxcc``), with an SDPA fallback.

Shapes (B = micro batch, Hq / Hkv = query / KV heads on this rank, S = sequence, D = head dim):

    adapter input, ``transpose_nki_inputs=False``   q [B, Hq, S, D], k/v [B, Hkv, S, D]  (torch SDPA's layout)
    adapter input, ``transpose_nki_inputs=True``    q [B, Hq, D, S], k/v [B, Hkv, D, S]  (the kernel's layout)
    output (either)                                 [B, Hq, S, D]

The kernel contract (NeuronX Distributed ``kernels/flash_attn.py`` and the NKI samples' ``flash_fwd``, which
are the reference for this module; the kernel itself runs only on Trainium):

* ``fwd[grid](q, k, v, seed, use_causal_mask=, mixed_precision=, dropout_p=, softmax_scale=, config=)``
  with q and k as ``[B, H, D, S]`` and v as ``[B, Hkv, S, D]``, or as ``[B, Hkv, D, S]`` when
  ``config.should_transpose_v`` (the kernel transposes it); returns ``(o [B, Hq, S, D], lse)``.
* ``bwd[grid](q, k, v, o, dout, lse, seed, use_causal_mask=, mixed_precision=, dropout_p=, softmax_scale=)``
  with q, k, v, o and dout all ``[B, H, D, S]``; returns ``(dq, dk, dv)`` in that layout.
* ``grid`` is ``(B, Hq)`` for the single-core kernel (``trainer.lnc`` 1) and ``(B, nc(lnc) * (Hq // lnc))``
  for the sharded kernel on a logical NeuronCore of ``lnc`` = 2 physical cores (Trainium2), where
  ``nc`` is ``neuronxcc.nki.language.nc``.
* The sequence must be a multiple of 2048 (the kernel's tile); anything else is a ``ValueError`` here.

``transpose_nki_inputs`` is NxDT's ``model.transpose_nki_inputs``: True means the model already produces
q/k/v in the kernel's ``[B, H, D, S]`` layout (no transposes around the kernel); False means they come in
SDPA's ``[B, H, S, D]`` and the adapter permutes them. Off Neuron (no ``neuronxcc``),
:func:`flash_attention` runs torch SDPA instead. Tests substitute a pure-PyTorch :class:`NkiKernels`; the real
kernel has not run here (no Trainium hardware): untested on hardware.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

__all__ = ["NKI_SEQ_MULTIPLE", "NkiKernels", "flash_attention", "load_nki_kernels", "nki_flash_attention",
           "resolve_lnc"]

#: The kernel processes the sequence in tiles of 2048 tokens (NxD: "Only support sequence as multiples of 2K").
NKI_SEQ_MULTIPLE = 2048


@dataclass(frozen=True)
class NkiKernels:
    """The kernel entry points the adapter calls (the real ones, or a substitute with the same signatures).

    Attributes:
        fwd: grid-indexable forward kernel, ``fwd[grid](q, k, v, seed, **kw) -> (o, lse)`` (module doc).
        bwd: grid-indexable backward kernel, ``bwd[grid](q, k, v, o, dout, lse, seed, **kw) -> (dq, dk, dv)``.
        make_config: ``make_config(should_transpose_v=bool) -> config`` passed as the forward's ``config``
            (``neuronxcc.nki.kernels.attention.FlashConfig``).
        nc: ``nc(lnc)`` -> the logical-core grid dimension of the sharded kernel (``nki.language.nc``);
            required for ``lnc > 1``.
    """

    fwd: Any
    bwd: Any
    make_config: Callable[..., Any]
    nc: Optional[Callable[[int], Any]] = None


@functools.lru_cache(maxsize=1)
def load_nki_kernels() -> Optional[NkiKernels]:
    """The NKI flash-attention kernels from ``neuronxcc``, or None where they are not importable (off Neuron).

    Import paths as NeuronX Distributed uses them: ``neuronxcc.nki.kernels.{flash_fwd, flash_attn_bwd}``,
    ``neuronxcc.nki.kernels.attention.FlashConfig`` and ``neuronxcc.nki.language.nc``. The PyPI ``neuronxcc``
    placeholder raises ImportError, which also gives None. Cached: the attention dispatch asks on every call,
    and a failed import is not cached by Python itself.
    """
    try:
        import neuronxcc.nki.language as nl  # type: ignore[import-not-found]
        from neuronxcc.nki.kernels import flash_attn_bwd, flash_fwd  # type: ignore[import-not-found]
        from neuronxcc.nki.kernels.attention import FlashConfig  # type: ignore[import-not-found]
    except Exception:  # ImportError, or the placeholder package failing in its own way
        return None
    return NkiKernels(fwd=flash_fwd, bwd=flash_attn_bwd, make_config=FlashConfig, nc=getattr(nl, "nc", None))


def resolve_lnc(lnc: Optional[int]) -> int:
    """``trainer.lnc`` -> 1 or 2; None reads ``NEURON_LOGICAL_NC_CONFIG`` (set from the config at startup), else 1.

    Raises:
        ValueError: a value other than 1 or 2 (names ``trainer.lnc``).
    """
    if lnc is None:
        raw = os.environ.get("NEURON_LOGICAL_NC_CONFIG", "1")
        try:
            lnc = int(raw)
        except ValueError:
            raise ValueError(f"NEURON_LOGICAL_NC_CONFIG={raw!r} is not an integer; set trainer.lnc to 1 or 2") from None
    if lnc not in (1, 2):
        raise ValueError(f"trainer.lnc must be 1 (Trainium1, or one core per rank) or 2 (Trainium2), got {lnc}")
    return lnc


def _grid(kernels: NkiKernels, batch: int, heads: int, lnc: int) -> tuple[Any, Any]:
    """Launch grid: (B, Hq) on one core; (B, nc(lnc) * (Hq // lnc)) for the sharded kernel (NxD)."""
    if lnc == 1:
        return batch, heads
    if kernels.nc is None:
        raise ValueError(f"trainer.lnc={lnc} needs the sharded NKI kernel (neuronxcc.nki.language.nc), which this "
                         "neuronxcc does not provide; set trainer.lnc=1 or upgrade neuronx-cc")
    if heads % lnc:
        raise ValueError(f"trainer.lnc={lnc}: the query heads per rank ({heads}) must be divisible by lnc; change "
                         "tensor_model_parallel_size or trainer.lnc")
    return batch, kernels.nc(lnc) * (heads // lnc)


class _NkiFlashAttention(torch.autograd.Function):
    """Autograd wrapper: kernel forward, kernel backward; q, k, v arrive in the kernel layout [B, H, D, S]."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kernels: NkiKernels, scale: float,
                causal: bool, lnc: int, mixed_precision: bool) -> torch.Tensor:
        grid = _grid(kernels, q.shape[0], q.shape[1], lnc)
        # should_transpose_v: v is passed as [B, Hkv, D, S] like q and k, and the kernel transposes it.
        config = kernels.make_config(should_transpose_v=True)
        out, lse = kernels.fwd[grid](q, k, v, None, use_causal_mask=causal, mixed_precision=mixed_precision,
                                     dropout_p=0.0, softmax_scale=scale, config=config)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.kernels, ctx.grid, ctx.scale, ctx.causal, ctx.mixed_precision = kernels, grid, scale, causal, \
            mixed_precision
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ctx.kernels.bwd[ctx.grid](
            q, k, v, out.permute(0, 1, 3, 2), dout.permute(0, 1, 3, 2), lse, None, use_causal_mask=ctx.causal,
            mixed_precision=ctx.mixed_precision, dropout_p=0.0, softmax_scale=ctx.scale)
        return dq, dk, dv, None, None, None, None, None


def _check_layout(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, transpose_nki_inputs: bool) -> tuple[int, int]:
    """Validate q/k/v in the adapter's input layout; return (S, D)."""
    layout = "[B, H, D, S]" if transpose_nki_inputs else "[B, H, S, D]"
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape:
        raise ValueError(f"NKI flash attention expects 4-D q, k, v in {layout} (model.transpose_nki_inputs="
                         f"{transpose_nki_inputs}), k and v alike; got q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}")
    seq, dim = (q.shape[3], q.shape[2]) if transpose_nki_inputs else (q.shape[2], q.shape[3])
    if q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:] or q.shape[1] % k.shape[1]:
        raise ValueError(f"NKI flash attention: q {tuple(q.shape)} and k {tuple(k.shape)} must agree on batch, "
                         f"sequence and head dim in {layout}, with query heads a multiple of KV heads")
    if seq % NKI_SEQ_MULTIPLE:
        raise ValueError(f"NKI flash attention needs the sequence length to be a multiple of {NKI_SEQ_MULTIPLE}, "
                         f"got {seq} (shape {tuple(q.shape)} in {layout}); set data.seq_length / "
                         f"model.encoder_seq_length to a multiple of {NKI_SEQ_MULTIPLE} (per context-parallel rank),"
                         " or model.fusions.flash_attention=false")
    return seq, dim


def nki_flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, kernels: NkiKernels,
                        transpose_nki_inputs: bool, lnc: int = 1, scale: Optional[float] = None,
                        causal: bool = True, mixed_precision: bool = True) -> torch.Tensor:
    """Causal attention through the NKI flash kernel; input layout per ``transpose_nki_inputs`` (module doc).

    Args:
        q: ``[B, Hq, D, S]`` if ``transpose_nki_inputs`` else ``[B, Hq, S, D]``.
        k, v: as q with ``Hkv`` heads (``Hq % Hkv == 0``; the kernel groups query heads itself).
        kernels: the kernel entry points (:func:`load_nki_kernels`, or a substitute in tests).
        lnc: logical NeuronCore size (``trainer.lnc``): 1 -> single-core kernel, 2 -> sharded kernel.
        scale: softmax scale, default ``1 / sqrt(D)``.
        causal, mixed_precision: passed to the kernel (``use_causal_mask``, fp32 softmax statistics).

    Returns:
        ``[B, Hq, S, D]`` (the kernel's output layout), differentiable in q, k and v.

    Raises:
        ValueError: wrong ranks or disagreeing shapes, S not a multiple of 2048, lnc not 1 or 2, Hq not divisible
            by lnc, or lnc 2 without the sharded kernel.
    """
    _, dim = _check_layout(q, k, v, transpose_nki_inputs)
    lnc = resolve_lnc(lnc)
    if not transpose_nki_inputs:  # [B, H, S, D] -> the kernel's [B, H, D, S]
        q, k, v = (t.permute(0, 1, 3, 2) for t in (q, k, v))
    scale = 1.0 / math.sqrt(dim) if scale is None else scale
    return _NkiFlashAttention.apply(q, k, v, kernels, scale, causal, lnc, mixed_precision)


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: Optional[float] = None,
                    causal: bool = True, transpose_nki_inputs: bool = False, lnc: Optional[int] = None,
                    kernels: Optional[NkiKernels] = None) -> torch.Tensor:
    """The flash path: the NKI kernel where ``neuronxcc`` kernels are importable (or given), else torch SDPA.

    Args:
        q, k, v: as :func:`nki_flash_attention` (layout per ``transpose_nki_inputs``; the SDPA fallback accepts
            both layouts and expands GQA heads itself).
        lnc: ``trainer.lnc`` (None: ``NEURON_LOGICAL_NC_CONFIG`` or 1); used by the kernel path only.
        kernels: kernel entry points; None -> :func:`load_nki_kernels` (None off Neuron -> SDPA).

    Returns:
        ``[B, Hq, S, D]`` on both paths.

    Raises:
        ValueError: as :func:`nki_flash_attention` on the kernel path; on the SDPA path, 4-D shape mismatches.
    """
    kernels = kernels if kernels is not None else load_nki_kernels()
    if kernels is not None:
        return nki_flash_attention(q, k, v, kernels=kernels, transpose_nki_inputs=transpose_nki_inputs, lnc=lnc,
                                   scale=scale, causal=causal)
    if transpose_nki_inputs:
        q, k, v = (t.transpose(2, 3) for t in (q, k, v))
    if q.dim() != 4 or k.shape != v.shape or q.shape[1] % k.shape[1]:
        raise ValueError(f"flash attention expects q [B,Hq,S,D], k/v [B,Hkv,S,D]; got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
