"""Applying ``model.fusions.*`` kernel choices (:mod:`nxd_lc.layers.fusions`) to a built decoder: each RMSNorm,
each attention's RoPE, each SwiGLU product and the model's loss get the kernel name they run with."""

from __future__ import annotations

import logging
from collections.abc import Mapping

from torch import nn

from nxd_lc.layers.fusions import FUSION_KEYS
from nxd_lc.models.common.mlp import ActivationMultiplyMLP
from nxd_lc.models.common.norm import RMSNorm

log = logging.getLogger(__name__)

__all__ = ["apply_fusions"]


def apply_fusions(model: nn.Module, kernels: Mapping[str, str]) -> dict[str, int]:
    """Set the kernel of every fused-op site of ``model`` in place.

    Args:
        model: a decoder (:class:`~nxd_lc.models.llama.LlamaForCausalLM` or subclass); its ``RMSNorm`` modules get
            ``kernel = kernels["rms_norm"]``, modules with a ``rope_kernel`` attribute (attention) get
            ``kernels["rope"]``, :class:`ActivationMultiplyMLP` modules ``kernels["swiglu"]`` and the model's
            ``cross_entropy_kernel`` ``kernels["cross_entropy"]``.
        kernels: ``{key: "torch" | "liger"}`` from :func:`nxd_lc.layers.fusions.resolve_fusions`.

    Returns:
        How many sites of each key were set (``{"rms_norm": n, "rope": n, "swiglu": n, "cross_entropy": 0 | 1}``).

    Raises:
        ValueError: a value other than ``torch`` / ``liger``.
    """
    bad = {k: v for k, v in kernels.items() if v not in ("torch", "liger")}
    if bad:
        raise ValueError(f"apply_fusions: resolved kernels must be 'torch' or 'liger', got {bad}")
    counts = dict.fromkeys(FUSION_KEYS, 0)
    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.kernel = kernels["rms_norm"]
            counts["rms_norm"] += 1
        elif isinstance(module, ActivationMultiplyMLP):
            module.kernel = kernels["swiglu"]
            counts["swiglu"] += 1
        elif hasattr(module, "rope_kernel"):
            module.rope_kernel = kernels["rope"]
            counts["rope"] += 1
    if hasattr(model, "cross_entropy_kernel"):
        model.cross_entropy_kernel = kernels["cross_entropy"]
        counts["cross_entropy"] = 1
    log.info("model.fusions: %s", ", ".join(f"{k} {kernels[k]} ({counts[k]} sites)" for k in counts))
    return counts

