"""Adapter to the NKI flash-attention kernel of the Neuron compiler (``neuronxcc``), with an SDPA fallback.

Shapes (B = micro batch, Hq / Hkv = query / KV heads on this rank, S = sequence, D = head dim):

    adapter input, ``transpose_nki_inputs=False``   q [B, Hq, S, D], k/v [B, Hkv, S, D]  (torch SDPA's layout)
    adapter input, ``transpose_nki_inputs=True``    q [B, Hq, D, S], k/v [B, Hkv, D, S]  (the kernel's layout)
    output (either)                                 [B, Hq, S, D]

The adapter calls the kernel as NeuronX Distributed does (aws-neuron/neuronx-distributed
``src/neuronx_distributed/kernels/flash_attn.py``, ``nki_flash_attn_func`` / ``NKIAttnFunc``, releases 2.23-2.29),
with the model side as NxDT's ``models/hf_models/modeling_llama.py`` (``repeat_kv`` before the call); the kernel
itself runs only on Trainium:

* k and v are expanded to the Hq query heads first (:func:`_expand_kv`, HF ``repeat_kv``'s head order):
  the grid runs over ``Hq`` and the kernel's backward asserts k/v heads == q heads (NKI samples
  ``flash_attn_bwd`` until GQA support, Nov 2025). Gradients reach the Hkv heads through the expansion's backward.
* ``fwd[grid](q, k, v, seed, use_causal_mask=, mixed_precision=, dropout_p=, softmax_scale=, config=)`` with q, k
  ``[B, H, D, S]`` and v ``[B, H, S, D]``, or ``[B, H, D, S]`` under ``FlashConfig(should_transpose_v=True)``
  (NxD sets it exactly when ``transpose_nki_inputs``); ``config`` is None unless a field is set; returns
  ``(o [B, H, S, D], lse [B, H, 128, S // 128])``.
* ``bwd[grid](q, k, v, o, dout, lse, seed, ...)`` with q, k, v, o, dout all ``[B, H, D, S]`` -> ``(dq, dk, dv)``.
* ``grid``: ``(B, Hq)`` for ``lnc`` 1; ``(B, nc(lnc) * (Hq // lnc))`` (sharded kernel, ``nki.language.nc``) for 2.
* ``lse_dtype`` (softmax statistics): :func:`default_lse_dtype`. ``lnc``: :func:`resolve_lnc`.
* S must be a multiple of 2048 (the kernel's ``seq_tile_size``): refused with a ``ValueError`` naming
  ``data.seq_length`` (NxD raises ``NotImplementedError``; neither falls back to SDPA).

``transpose_nki_inputs`` is NxDT's ``model.transpose_nki_inputs``. Off Neuron (no ``neuronxcc``),
:func:`flash_attention` runs torch SDPA. Tests substitute a pure-PyTorch :class:`NkiKernels`: untested on hardware.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from nxd_lc.distributed.kv_layout import ADJACENT, INTERLEAVED, KV_REPLICA_LAYOUTS

__all__ = ["AUTO", "NKI_SEQ_MULTIPLE", "NkiKernels", "default_lse_dtype", "flash_attention", "load_nki_kernels",
           "neuron_platform", "nki_flash_attention", "resolve_lnc"]

#: The kernel processes the sequence in tiles of 2048 tokens (NxD: "Only support sequence as multiples of 2K").
NKI_SEQ_MULTIPLE = 2048
#: ``lse_dtype=AUTO``: derive it from the environment and q's dtype as NxD does (:func:`default_lse_dtype`).
AUTO = "auto"


@dataclass(frozen=True)
class NkiKernels:
    """The kernel entry points the adapter calls (the real ones, or a substitute with the same signatures).

    Attributes:
        fwd: grid-indexable forward kernel, ``fwd[grid](q, k, v, seed, **kw) -> (o, lse)`` (module doc).
        bwd: grid-indexable backward kernel, ``bwd[grid](q, k, v, o, dout, lse, seed, **kw) -> (dq, dk, dv)``.
        make_config: ``make_config(**fields) -> config`` (``neuronxcc.nki.kernels.attention.FlashConfig``).
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
    placeholder raises ImportError, which also gives None. Cached: the attention dispatch asks on every call.
    """
    try:
        import neuronxcc.nki.language as nl  # type: ignore[import-not-found]
        from neuronxcc.nki.kernels import flash_attn_bwd, flash_fwd  # type: ignore[import-not-found]
        from neuronxcc.nki.kernels.attention import FlashConfig  # type: ignore[import-not-found]
    except Exception:  # ImportError, or the placeholder package failing in its own way
        return None
    return NkiKernels(fwd=flash_fwd, bwd=flash_attn_bwd, make_config=FlashConfig, nc=getattr(nl, "nc", None))


def _expand_kv(t: torch.Tensor, rep: int) -> torch.Tensor:
    """``[B, Hkv, X, Y]`` -> ``[B, Hkv * rep, X, Y]``, each KV head repeated ``rep`` times in place (HF
    ``repeat_kv``'s order: query head h reads KV head ``h // rep``); ``rep`` 1 returns ``t``."""
    return t if rep == 1 else t.repeat_interleave(rep, dim=1)


def default_lse_dtype(q_dtype: torch.dtype, environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """The ``FlashConfig.lse_dtype`` NxD passes (``kernels/flash_attn.py`` ``_flash_attn_forward``, >= 2.23).

    ``"bfloat16"`` when ``XLA_USE_BF16`` or ``XLA_DOWNCAST_BF16`` is '1', or when ``XLA_DOWNCAST_BF16`` is '0' and
    q is bf16; otherwise None: no ``lse_dtype`` is passed and the kernel keeps its default (float32 with
    ``mixed_precision``). nxd_lc sets both flags to '0' (:mod:`nxd_lc.runtime.env`), so bf16 q -> bf16 statistics,
    as under NxDT's ``autocast``; fp32 q -> float32. Unset flags read as NxD reads them (not '0': float32).
    """
    env = os.environ if environ is None else environ
    if env.get("XLA_USE_BF16") == "1" or env.get("XLA_DOWNCAST_BF16") == "1":
        return "bfloat16"
    if env.get("XLA_DOWNCAST_BF16") == "0" and q_dtype == torch.bfloat16:
        return "bfloat16"
    return None


@functools.lru_cache(maxsize=1)
def neuron_platform() -> Optional[str]:
    """'trn1' (also trn1n / inf2), 'trn2', 'trn3' from ``torch_neuronx.utils.get_platform_target()`` as NxD reads
    it (``neuronx_distributed.utils.utils.hardware``); None where torch-neuronx is absent or cannot tell."""
    try:
        from torch_neuronx.utils import get_platform_target  # type: ignore[import-not-found]

        target = get_platform_target()
    except Exception:
        return None
    name = str(getattr(target, "value", target)).lower()
    if name.startswith(("trn1", "inf2")):
        return "trn1"
    return name[:4] if name.startswith(("trn2", "trn3")) else None


def resolve_kv_replica_layout(setting: str, accelerator: str, lnc: Optional[int]) -> str:
    """``distributed_strategy.kv_replica_layout`` -> ``interleaved`` | ``adjacent``
    (:mod:`nxd_lc.distributed.kv_layout`), chosen for ``auto`` as NxD chooses, by the hardware
    (``parallel_state.initialize_kv_group``: ``hardware(get_platform_target())``): the platform torch-neuronx
    reports (Trn1: interleaved; Trn2 / Trn3: adjacent); else adjacent on TorchNeuron's native device
    (``accelerator`` ``neuron_native``: Trn2 / Trn3 only) or with a logical NeuronCore size of 2 (``trainer.lnc``,
    NxDT's trn2 files); else interleaved, NxD's default hardware (Trn1). ``accelerator``: the resolved
    ``trainer.accelerator`` (:func:`nxd_lc.runtime.device.resolve_accelerator`).

    Raises:
        ValueError: an unknown ``setting`` (names the key and the values).
    """
    if setting in KV_REPLICA_LAYOUTS:
        return setting
    if setting != "auto":
        raise ValueError(f"distributed_strategy.kv_replica_layout: {setting!r} is not one of auto, "
                         f"{', '.join(KV_REPLICA_LAYOUTS)}")
    platform = neuron_platform()
    if platform is not None:
        return INTERLEAVED if platform == "trn1" else ADJACENT
    if accelerator == "neuron_native" or lnc == 2:
        return ADJACENT
    return INTERLEAVED


def resolve_lnc(lnc: Optional[int]) -> int:
    """The logical NeuronCore size: ``trainer.lnc`` and ``NEURON_LOGICAL_NC_CONFIG`` (which startup sets from it
    unless already set, and which the Neuron runtime reads), else by platform: 2 on Trn2, 1 elsewhere (NxDT
    ``utils.get_lnc_size`` / ``HFLLamaModule._get_model``). On Trn1 it must be 1 (NxD asserts it in
    ``nki_flash_attn_func``).

    Raises:
        ValueError: not an integer, not 1 or 2, 2 on Trn1, or ``trainer.lnc`` and a preset
            ``NEURON_LOGICAL_NC_CONFIG`` that disagree (the kernel's grid and the runtime's cores would differ);
            names where the value came from.
    """
    source = "trainer.lnc"
    raw = os.environ.get("NEURON_LOGICAL_NC_CONFIG")
    if raw is not None:
        try:
            env_lnc = int(raw)
        except ValueError:
            raise ValueError(f"NEURON_LOGICAL_NC_CONFIG={raw!r} is not an integer; set trainer.lnc to 1 or 2") from None
        if lnc is not None and lnc != env_lnc:
            raise ValueError(f"trainer.lnc={lnc} but NEURON_LOGICAL_NC_CONFIG={raw} in the environment (which the "
                             "Neuron runtime uses, and which wins over the config): make them agree, or unset the "
                             "variable")
        source, lnc = "NEURON_LOGICAL_NC_CONFIG", env_lnc
    elif lnc is None:
        return 2 if neuron_platform() == "trn2" else 1
    if lnc not in (1, 2):
        raise ValueError(f"{source}={lnc}: must be 1 (Trainium1, or one core per rank) or 2 (Trainium2)")
    if lnc == 2 and neuron_platform() == "trn1":
        raise ValueError(f"{source}=2 on Trainium1: a logical NeuronCore of 2 exists only on Trainium2; set "
                         "trainer.lnc=1 (and unset NEURON_LOGICAL_NC_CONFIG)")
    return lnc


def _grid(kernels: NkiKernels, batch: int, heads: int, lnc: int) -> tuple[Any, Any]:
    """Launch grid: (B, Hq) on one core; (B, nc(lnc) * (Hq // lnc)) for the sharded kernel (NxD)."""
    if lnc == 1:
        return batch, heads
    if kernels.nc is None:
        raise ValueError(f"lnc={lnc} (trainer.lnc / NEURON_LOGICAL_NC_CONFIG) needs the sharded NKI kernel "
                         "(neuronxcc.nki.language.nc), which this neuronxcc lacks; set trainer.lnc=1 or upgrade")
    if heads % lnc:
        raise ValueError(f"trainer.lnc={lnc}: the query heads per rank ({heads}) must be divisible by lnc; change "
                         "tensor_model_parallel_size or trainer.lnc")
    return batch, kernels.nc(lnc) * (heads // lnc)


class _NkiFlashAttention(torch.autograd.Function):
    """Kernel forward and backward; q, k, v arrive as [B, H, D, S] with equal head counts (NxD's NKIAttnFunc)."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kernels: NkiKernels, scale: float,
                causal: bool, lnc: int, mixed_precision: bool, lse_dtype: Optional[str],
                transpose_v: bool) -> torch.Tensor:
        grid = _grid(kernels, q.shape[0], q.shape[1], lnc)
        fields: dict[str, Any] = {} if lse_dtype is None else {"lse_dtype": lse_dtype}
        if transpose_v:  # v handed over as [B, H, D, S]; the kernel transposes it
            fields["should_transpose_v"] = True
        config = kernels.make_config(**fields) if fields else None
        v_kernel = v if transpose_v else v.permute(0, 1, 3, 2)
        out, lse = kernels.fwd[grid](q, k, v_kernel, None, use_causal_mask=causal, mixed_precision=mixed_precision,
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
        return dq, dk, dv, None, None, None, None, None, None, None


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
                        transpose_nki_inputs: bool, lnc: Optional[int] = None, scale: Optional[float] = None,
                        causal: bool = True, mixed_precision: bool = True,
                        lse_dtype: Optional[str] = AUTO) -> torch.Tensor:
    """Attention through the NKI flash kernel, called as NxD's ``nki_flash_attn_func`` calls it (module doc).

    Args:
        q: ``[B, Hq, D, S]`` if ``transpose_nki_inputs`` else ``[B, Hq, S, D]``; S a multiple of 2048.
        k, v: as q with ``Hkv`` heads (``Hq % Hkv == 0``). Expanded to ``Hq`` heads before the kernel, whose
            backward asserts equal q and k/v head counts; dk, dv come back as ``[.., Hkv, ..]`` (summed).
        kernels: the kernel entry points (:func:`load_nki_kernels`, or a substitute in tests).
        lnc: ``trainer.lnc``; None -> :func:`resolve_lnc` (``NEURON_LOGICAL_NC_CONFIG``, else the platform).
        scale: softmax scale, default ``1 / sqrt(D)``.
        causal, mixed_precision: passed to the kernel (``use_causal_mask``; fp32 softmax arithmetic).
        lse_dtype: ``FlashConfig.lse_dtype`` of the saved softmax statistics ``[B, Hq, 128, S // 128]``:
            :data:`AUTO` -> :func:`default_lse_dtype` (NxD's rule), None -> the kernel's default, or a name of
            an ``nki.language`` dtype such as ``"bfloat16"`` / ``"float32"``.

    Returns:
        ``[B, Hq, S, D]`` (the kernel's output layout), differentiable in q, k and v.

    Raises:
        ValueError: wrong ranks or disagreeing shapes, S not a multiple of 2048 (names ``data.seq_length``; no
            SDPA fallback), lnc not 1 or 2 or 2 on Trn1, Hq not divisible by lnc, or lnc 2 without the sharded
            kernel.
    """
    _, dim = _check_layout(q, k, v, transpose_nki_inputs)
    lnc = resolve_lnc(lnc)
    if lse_dtype == AUTO:
        lse_dtype = default_lse_dtype(q.dtype)
    rep = q.shape[1] // k.shape[1]
    k, v = _expand_kv(k, rep), _expand_kv(v, rep)  # along dim 1: valid in either layout
    if not transpose_nki_inputs:  # [B, H, S, D] -> the kernel's [B, H, D, S] (v goes back to [B, H, S, D] inside)
        q, k, v = (t.permute(0, 1, 3, 2) for t in (q, k, v))
    scale = 1.0 / math.sqrt(dim) if scale is None else scale
    return _NkiFlashAttention.apply(q, k, v, kernels, scale, causal, lnc, mixed_precision, lse_dtype,
                                    transpose_nki_inputs)


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: Optional[float] = None,
                    causal: bool = True, transpose_nki_inputs: bool = False, lnc: Optional[int] = None,
                    kernels: Optional[NkiKernels] = None) -> torch.Tensor:
    """The flash path: the NKI kernel where ``neuronxcc`` kernels are importable (or given), else torch SDPA.

    Args:
        q, k, v: as :func:`nki_flash_attention` (layout per ``transpose_nki_inputs``; GQA k/v ``[.., Hkv, ..]``
            are expanded to the query heads on both paths).
        lnc: ``trainer.lnc`` (None: :func:`resolve_lnc`); used by the kernel path only.
        kernels: kernel entry points; None -> :func:`load_nki_kernels` (None off Neuron -> SDPA).

    Returns:
        ``[B, Hq, S, D]`` on both paths.

    Raises:
        ValueError: as :func:`nki_flash_attention` on the kernel path (S not a multiple of 2048 is refused there,
            not sent to SDPA); on the SDPA path, 4-D shape mismatches.
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
    k, v = _expand_kv(k, rep), _expand_kv(v, rep)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
