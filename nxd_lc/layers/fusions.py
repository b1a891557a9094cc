"""``model.fusions.*`` kernel choices for the element-wise parts of a decoder step: RMSNorm, RoPE application, the
SwiGLU product and the causal-LM cross-entropy.

Why (DESIGN.md 13; the H200 profile of 2026-11-26): every element-wise op of a layer is one kernel launch on CUDA
(a graph node on Neuron); nxd_lc's eager step launched ~2x the kernels of transformers + Liger-Kernel and stalled on a
full launch queue. Two ways fix it, both selected here:

* a compiled region (``model.compile``): inductor / the neuron backend fuse the plain ``torch`` code of a whole
  decoder layer, on any device;
* a well-kept fused kernel library in eager mode: Liger-Kernel's Triton kernels on CUDA (Hsu et al. 2024,
  arXiv:2410.10989): ``liger_rms_norm``, ``liger_rope``, ``liger_swiglu`` and ``liger_fused_linear_cross_entropy``
  (the lm head and the loss in row chunks, never the full ``[T, V]`` logits).

Choices per key (``model.fusions.rms_norm | rope | swiglu | cross_entropy``):

* ``torch``: the device-agnostic eager reference (:mod:`nxd_lc.models.common`), what compiled regions trace;
* ``liger``: Liger-Kernel; only on ``trainer.accelerator: gpu`` with ``liger_kernel`` importable, and for
  ``cross_entropy`` only at ``tensor_model_parallel_size: 1`` (the vocab-parallel tiled loss stays for TP > 1) and
  without ``model.tiled_loss_chunk_size`` (both tile the same logits: one has to be chosen);
* ``auto`` (default): ``liger`` where that is allowed and the op runs eagerly (``rms_norm``, ``rope``, ``swiglu``
  inside compiled decoder layers stay ``torch``: inductor fuses them itself), else ``torch``.

NKI (Trainium): neuronxcc's kernel library ships flash attention (``model.fusions.flash_attention``,
:mod:`nxd_lc.context.nki`), not these four ops; on the native Neuron device they are fused by
``torch.compile(backend="neuron")`` (``model.compile``). Asking for another kernel name is a configuration error.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Mapping

import torch

__all__ = [
    "FUSION_CHOICES",
    "FUSION_KEYS",
    "fusion_problems",
    "liger_fused_linear_cross_entropy_sum",
    "liger_rms_norm",
    "liger_rope",
    "liger_swiglu",
    "liger_unavailable_reason",
    "resolve_fusions",
]

#: the ``model.fusions`` keys that select a kernel implementation
FUSION_KEYS: tuple[str, ...] = ("rms_norm", "rope", "swiglu", "cross_entropy")
#: the values each of them takes
FUSION_CHOICES: tuple[str, ...] = ("auto", "torch", "liger")


@functools.lru_cache(maxsize=1)
def liger_unavailable_reason() -> str | None:
    """None when ``liger_kernel.transformers.functional`` imports (Liger-Kernel + Triton present), else why not."""
    try:
        importlib.import_module("liger_kernel.transformers.functional")
    except Exception as e:  # noqa: BLE001 - ImportError, or Triton failing to initialise without a GPU
        return f"liger_kernel does not import here ({type(e).__name__}: {str(e)[:160]}); pip install liger-kernel"
    return None


def _liger_problem(key: str, accelerator: str, tensor_parallel: int, tiled_loss: bool) -> str | None:
    """Why ``model.fusions.<key>: liger`` cannot be used here (None: it can)."""
    if accelerator != "gpu":
        return (f"model.fusions.{key}: liger needs trainer.accelerator gpu (Liger-Kernel's Triton kernels run on "
                f"CUDA), not {accelerator!r}; set model.fusions.{key}: auto or torch")
    if key == "cross_entropy" and tensor_parallel > 1:
        return (f"model.fusions.cross_entropy: liger needs tensor_model_parallel_size 1 (the logits are "
                f"vocab-parallel at TP {tensor_parallel}: nxd_lc's own tiled loss handles that); set it to auto or "
                "torch")
    if key == "cross_entropy" and tiled_loss:
        return ("model.fusions.cross_entropy: liger and model.tiled_loss_chunk_size both tile the lm head + loss; "
                "set model.tiled_loss_chunk_size: null to use Liger's fused linear cross-entropy, or "
                "model.fusions.cross_entropy: torch to keep the tiled loss")
    reason = liger_unavailable_reason()
    if reason is not None:
        return f"model.fusions.{key}: liger: {reason}; or set model.fusions.{key}: auto or torch"
    return None


def fusion_problems(fusions: Mapping[str, object], accelerator: str, tensor_parallel: int = 1,
                    tiled_loss: bool = False) -> list[str]:
    """Configuration problems of the kernel keys (empty: none), each naming its key and the fix.

    Args:
        fusions: the ``model.fusions`` mapping (other keys are ignored).
        accelerator: the resolved ``trainer.accelerator`` (``cpu | gpu | xla | neuron | neuron_native``).
        tensor_parallel: ``tensor_model_parallel_size``.
        tiled_loss: ``model.tiled_loss_chunk_size`` is set.
    """
    problems = []
    for key in FUSION_KEYS:
        value = fusions.get(key, "auto")
        if value not in FUSION_CHOICES:
            problems.append(f"model.fusions.{key}: {value!r} is not a kernel choice; use one of "
                            f"{list(FUSION_CHOICES)} (NKI kernels exist for flash attention only: "
                            "model.fusions.flash_attention)")
        elif value == "liger":
            why = _liger_problem(key, accelerator, tensor_parallel, tiled_loss)
            if why:
                problems.append(why)
    return problems


def resolve_fusions(fusions: Mapping[str, object], accelerator: str, *, tensor_parallel: int = 1,
                    tiled_loss: bool = False, compiled: bool = False) -> dict[str, str]:
    """The kernel (``torch`` or ``liger``) each of :data:`FUSION_KEYS` runs with (module docstring).

    Args:
        fusions, accelerator, tensor_parallel, tiled_loss: as :func:`fusion_problems`.
        compiled: the decoder layers are compiled (``model.compile`` resolved on): ``auto`` keeps the in-layer ops
            ``torch`` there, for inductor / the neuron backend to fuse.

    Returns:
        ``{key: "torch" | "liger"}`` for every key.

    Raises:
        ValueError: :func:`fusion_problems` found a problem (all of them in one message).
    """
    problems = fusion_problems(fusions, accelerator, tensor_parallel, tiled_loss)
    if problems:
        raise ValueError("; ".join(problems))
    chosen = {}
    for key in FUSION_KEYS:
        value = fusions.get(key, "auto")
        if value == "auto":
            in_layer = key != "cross_entropy"
            usable = _liger_problem(key, accelerator, tensor_parallel, tiled_loss) is None
            value = "liger" if usable and not (compiled and in_layer) else "torch"
        chosen[key] = str(value)
    return chosen


def _liger() -> object:
    return importlib.import_module("liger_kernel.transformers.functional")


def liger_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Liger's RMSNorm, x [..., H] -> [..., H] in x's dtype; Llama casting (fp32 statistics, cast back, then the
    weight), not in place (our residual stream reuses no gradient buffer in place)."""
    return _liger().liger_rms_norm(x, weight, eps, offset=0.0, casting_mode="llama", in_place=False)


def liger_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Liger's RoPE: q [B, Hq, S, D], k [B, Hkv, S, D], cos / sin [B, S, D] (cast to q's dtype, as HF Llama does)
    -> rotated (q, k), half-split rotation (HF ``rotate_half``)."""
    return _liger().liger_rope(q, k, cos.to(q.dtype), sin.to(q.dtype))


def liger_swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Liger's ``silu(gate) * up`` for gate, up [..., I]; its kernel needs contiguous rows, so the two halves of
    the fused gate/up projection are made contiguous first."""
    return _liger().liger_swiglu(gate.contiguous(), up.contiguous())


def liger_fused_linear_cross_entropy_sum(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                                         ignore_index: int = -100) -> torch.Tensor:
    """Summed next-token cross-entropy of ``hidden @ weight.T`` without materialising the logits (Liger's fused
    linear cross-entropy, row chunks).

    Args:
        hidden: [N, H] lm-head input (all tokens of the micro-batch, TP 1).
        weight: [V, H] lm-head weight restricted to the valid vocabulary rows.
        labels: [N] int64 targets, ``ignore_index`` = no target.

    Returns:
        fp32 scalar: the sum of the per-token losses over non-ignored positions.
    """
    loss = _liger().liger_fused_linear_cross_entropy(hidden, weight, labels, ignore_index=ignore_index,
                                                     reduction="sum")
    return loss.float()
