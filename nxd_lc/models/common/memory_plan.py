"""``model.activations_memory_budget``: the memory plan chosen from a budget instead of stacked by hand (DESIGN.md 14).

On the H200 (2026-11-26) the hand-picked long-context configuration -- full recomputation + tiled MLP + tiled loss --
spent 30-40% of a step re-running a tiled MLP whose chunk memory full recomputation had already made irrelevant.
Here the user gives a budget for the activations of one micro-batch on one device, and the fastest plan whose
estimate fits is used, in this order (each recomputes more than the one before):

1. ``none``: nothing recomputed;
2. ``selective``: the norms and the MLP are recomputed, the attention's tensors are kept
   (``activations_checkpoint_granularity: selective``, ``activations_checkpoint_recompute: [RMSNorm, LlamaMLP]``);
3. ``full_save_attention``: every decoder layer recomputed except its attention kernel, whose output and
   log-sum-exp are kept with the layer input (``activations_checkpoint_granularity: full``,
   ``activations_checkpoint_save_attention: true``): the recomputation re-runs the norms, projections, RoPE and MLP
   but not the ``O(S^2)`` attention, for one ``[T, Hq]`` (+ ``[heads, T]`` fp32) more per layer than plan 4 (issue
   41: at 64k-128k the attention is most of a recomputation's time);
4. ``full_save_attention_offload``: as 3 with the tiled MLP (plan 6), and each layer's input, attention output and
   log-sum-exp are moved to host memory in forward and brought back one layer ahead of its backward, on a side
   stream (``model.activations_offload`` with ``activations_checkpoint_save_attention``): no activation stays on the
   device per layer, and the recomputation still skips the attention (issue 41, item 2; the copies overlap compute
   on CUDA, :mod:`nxd_lc.runtime.offload`);
5. ``full``: every decoder layer recomputed, only its input ``[B, S(/tp), H]`` kept;
6. ``full_tiled_mlp``: as 5, the MLP of the layer being recomputed runs ``tiled_mlp_chunk_size`` tokens at a time
   (only worth it where the MLP's ``[T, 2I]`` working set matters: long sequences);
7. ``full_offload``: as 6, and each layer's input is moved to host memory in forward and back in backward
   (``model.activations_offload``: ALST's / DeepSpeed's activation-checkpoint offload).

Plans 3, 4 and 7 are skipped where they cannot run: on torch-xla (its checkpoint has no selective policy and no
offload hooks) all three; plans 4 and 7 with compiled layers (dynamo does not trace the offload hooks) and on the CPU
(host memory is the device's: offloading frees nothing). The order is by recomputation, not measured per length:
plan 4 is placed before 5 because at 64k-128k tokens the attention is most of a layer's recomputation, and its
copies should hide behind compute: at 64k tokens of the 1B shape about 0.5 GiB per layer each way, ~10 ms at
55 GB/s (PCIe 5), against ~240 ms per layer of the baseline's measured H200 step (an estimate: not measured yet).

The loss is untiled when its logits fit in what the layers leave of the budget, else tiled
(``tiled_loss_chunk_size`` 1024) -- unless Liger's fused linear cross-entropy is the loss kernel, which never holds
the full logits.

Budget forms: a number in (0, 1] is a fraction of plan 1's estimate (the meaning of torch's
``torch._functorch.config.activation_memory_budget``: 1 keeps everything, smaller recomputes more); a string
``"<N>GiB"`` (or ``MiB``) is absolute, per device.

The estimate counts the bytes autograd keeps per token for nxd_lc's Llama layer with flash attention (no ``S x S``
tensor), from the ops of its forward (``T`` tokens of the micro-batch on this rank, ``Tn`` those outside the TP
region: ``T / tp`` under sequence parallelism; ``e`` the activation element size; local sizes
``Hq = Dh * heads/tp``, ``Hkv`` likewise, ``I = intermediate / tp``, ``Vl`` the local vocabulary):

* RMSNorm: its input and reciprocal RMS (:class:`~nxd_lc.models.common.norm.RMSNorm`'s backward recomputes the rest):
  ``Tn (e H + 4)``;
* attention: the projection input ``e H`` per token of ``Tn``; the fused q/k/v output ``e (Hq + 2 Hkv)`` (v keeps
  it alive), the rotated q and k ``e (Hq + Hkv)``, the attention output ``e Hq`` and its log-sum-exp ``4 heads/tp``,
  the o-projection input ``e Hq``: per token of ``T``;
* SwiGLU MLP: its input ``e H`` per token of ``Tn``, gate/up ``2 e I``, ``silu(gate)`` ``e I``, the product ``e I``:
  per token of ``T``;
* a recomputed layer (``full``) keeps its input ``e H`` per token of ``Tn`` and, while its backward runs, the working
  set of one layer as above (with the tiled MLP: ``chunk`` tokens of the MLP's part); ``full_save_attention`` also
  keeps the attention kernel's output ``e Hq`` and log-sum-exp ``4 heads/tp`` per token of ``T``; the offload plans
  keep nothing per layer on the device, but two layers' offloaded tensors (the one whose backward runs, the one
  prefetched) join the working set, and the host holds every layer's;
* the loss over ``[T, Vl]`` logits: the logits (``e``), their float32 copy, the softmax and its gradient (``3 x 4``),
  the gradient cast back (``e``); tiled: ``chunk`` rows of that plus the ``[T, H]`` input, its gradient and the
  gradient's scaled copy (``3 e H``) and the float32 ``[Vl, H]`` weight-gradient accumulator; Liger's
  fused linear cross-entropy: its ``ceil(V / H)`` row chunks (``e + 4`` per logit, up to twice ``T H / V`` rows
  each), the input's gradient and the float32 weight gradient (Liger-Kernel's ``fused_linear_cross_entropy``);
* the final norm's output and the RoPE tables ``2 x 4 Dh`` per token;
* backward's transient gradients of one MLP's activations (of its chunk when tiled), alive with what is saved, and
  under sequence parallelism one column layer's input ``e H`` per token of ``T``, gathered again in backward.

:func:`estimate_split` splits them by lifetime: what a micro-batch keeps from its forward to its backward (the
saved tensors of its layers, the RoPE tables; with the head, the final norm's output) and what one backward needs
once (the working set of a recomputed layer or module, the transient gradients, the loss), so that a pipeline stage
holding several micro-batches counts only the first part per micro-batch. Under ``selective`` the listed modules
(:data:`RECOMPUTE_PARTS`) keep only their inputs: the norms (``Tn e H`` each), the MLP (``Tn e H``: nxd_lc's MLP
all-gathers inside), the attention kernel (its output and log-sum-exp; q, k, v stay), the SwiGLU product's
``silu(gate)`` (``ActivationMultiplyMLP``). Under sequence parallelism the column-parallel layers keep only the
``[Tn, H]`` shard of their input for the weight gradient and gather it again in backward
(:func:`~nxd_lc.distributed.mappings.sequence_parallel_linears`, as NxD and Megatron-LM): the attention's and the
MLP's inputs count ``Tn`` tokens, and one re-gathered ``[T, H]`` input joins backward's transients (the tiled MLP
still keeps its gathered input).

It is an upper-bound model of the tensors autograd saves (tested against a FakeTensor measurement of the real step,
``tests/test_memory_plan.py``); it does not count parameters, gradients, optimizer state or allocator
fragmentation, and the MoE experts' dispatch buffers are counted as a dense MLP of the same intermediate size.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
from typing import TYPE_CHECKING, Any, Sequence

from torch import nn

from nxd_lc.distributed import parallel_state
from nxd_lc.layers.fusions import resolve_fusions
from nxd_lc.models.common.checkpointing import apply_memory_techniques
from nxd_lc.models.common.fusions import apply_fusions
from nxd_lc.runtime.device import has_device_memory, is_xla_accelerator

if TYPE_CHECKING:
    from nxd_lc.config.schema import ModelConfig

log = logging.getLogger(__name__)

__all__ = ["EAGER_ONLY_PLANS", "MAX_BUDGET_BYTES", "MemoryPlan", "OFFLOAD_PLANS", "PLAN_ORDER", "PlanShape",
           "apply_kernels_and_memory", "budget_problem", "RECOMPUTE_PARTS", "choose_memory_plan", "estimate_bytes",
           "estimate_split", "model_plan_shape", "offload_allowed", "parse_budget", "recompute_parts"]

#: the plans, fastest first (module docstring)
PLAN_ORDER = ("none", "selective", "full_save_attention", "full_save_attention_offload", "full", "full_tiled_mlp",
              "full_offload")
#: plans that need torch's selective checkpoint policy / saved-tensor hooks (not on torch-xla)
EAGER_ONLY_PLANS = frozenset({"full_save_attention", "full_save_attention_offload", "full_offload"})
#: plans that move activations to host memory (``model.activations_offload``)
OFFLOAD_PLANS = frozenset({"full_save_attention_offload", "full_offload"})
#: plans that keep the attention kernels' outputs (``model.activations_checkpoint_save_attention``)
_SAVE_ATTENTION_PLANS = frozenset({"full_save_attention", "full_save_attention_offload"})
#: plans whose MLP runs PLAN_MLP_CHUNK tokens at a time
_TILED_MLP_PLANS = frozenset({"full_tiled_mlp", "full_save_attention_offload", "full_offload"})
#: token chunk of the tiled MLP / tiled loss the planner uses
PLAN_MLP_CHUNK = 4096
PLAN_LOSS_CHUNK = 1024
_GIB = 2**30
#: ``model.activations_checkpoint_recompute`` class names -> the decoder-layer part whose saved tensors recomputing
#: that module removes (:func:`estimate_split`); NxDT's names included (``LlamaRMSNorm``)
RECOMPUTE_PARTS = {"RMSNorm": "norm", "LlamaRMSNorm": "norm", "LayerNorm": "norm", "LlamaMLP": "mlp",
                   "GeluMLP": "mlp", "MoE": "mlp", "ActivationMultiplyMLP": "act_mul",
                   "CoreAttention": "core_attention"}
_SELECTIVE = frozenset({"norm", "mlp"})  # the planner's selective plan: RMSNorm + LlamaMLP
_BUDGET_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(GiB|MiB|GB|MB)\s*$", re.IGNORECASE)
_UNITS = {"gib": 2**30, "mib": 2**20, "gb": 10**9, "mb": 10**6}
KEY = "model.activations_memory_budget"
#: The largest size budget accepted (1 EiB: above every device's memory by far; a larger or non-finite size, e.g. a
#: 400-digit number, overflowed the integer byte limit with a raw ``OverflowError``).
MAX_BUDGET_BYTES = 2**60


@dataclasses.dataclass(frozen=True)
class PlanShape:
    """What the estimate needs of one micro-batch on one rank.

    Attributes:
        tokens: ``T`` = micro batch x sequence length / context-parallel size.
        hidden: ``H``.
        head_dim: ``Dh``.
        heads_local, kv_heads_local: query / key-value heads on this TP rank (after ``kv_replicator``).
        intermediate_local: MLP intermediate size / TP.
        vocab_local: padded vocabulary / TP.
        layers: decoder layers on this rank (this pipeline stage's).
        tp: tensor-parallel size; sequence_parallel: norms and residuals hold ``T / tp`` tokens.
        element_size: bytes per activation element (2 for bf16 compute, 4 for fp32).
        fused_loss: Liger's fused linear cross-entropy is the loss (no full logits).
        head: this rank runs the final norm, lm head and loss (a pipeline stage without them: False).
    """

    tokens: int
    hidden: int
    head_dim: int
    heads_local: int
    kv_heads_local: int
    intermediate_local: int
    vocab_local: int
    layers: int
    tp: int = 1
    sequence_parallel: bool = False
    element_size: int = 2
    fused_loss: bool = False
    head: bool = True


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """A chosen plan: the ``model:`` keys it sets and its estimate.

    Attributes:
        name: one of :data:`PLAN_ORDER`.
        granularity, recompute: ``activations_checkpoint_granularity`` / ``..._recompute``.
        save_attention: ``activations_checkpoint_save_attention``.
        tiled_mlp_chunk_size, tiled_loss_chunk_size: the tiling keys (None: untiled).
        offload: ``activations_offload``.
        estimate_bytes: activation bytes on the device (module docstring); host_bytes: offloaded bytes.
        budget_bytes: the budget it was chosen under.
    """

    name: str
    granularity: str | None
    recompute: tuple[str, ...] | None
    tiled_mlp_chunk_size: int | None
    tiled_loss_chunk_size: int | None
    offload: bool
    estimate_bytes: int
    host_bytes: int
    budget_bytes: int
    save_attention: bool = False

    def model_keys(self) -> dict[str, Any]:
        """The ``model:`` (:class:`~nxd_lc.config.schema.ModelConfig`) fields this plan sets."""
        return {"activations_checkpoint_granularity": self.granularity,
                "activations_checkpoint_recompute": list(self.recompute) if self.recompute else None,
                "activations_checkpoint_save_attention": self.save_attention,
                "tiled_mlp_chunk_size": self.tiled_mlp_chunk_size, "tiled_loss_chunk_size": self.tiled_loss_chunk_size,
                "activations_offload": self.offload}

    def describe(self) -> str:
        """One log line: the plan, its estimate against the budget, and what it sets."""
        keys = ", ".join(f"{k}={v}" for k, v in self.model_keys().items())
        host = f", {self.host_bytes / _GIB:.2f} GiB on the host" if self.host_bytes else ""
        return (f"{KEY}: plan '{self.name}' (estimated activations {self.estimate_bytes / _GIB:.2f} GiB of "
                f"{self.budget_bytes / _GIB:.2f} GiB{host}): {keys}")


def parse_budget(value: Any) -> tuple[str, float]:
    """``("fraction", f)`` for a number in (0, 1], ``("bytes", n)`` for ``"<N>GiB"`` / ``MiB`` / ``GB`` / ``MB`` of at
    most :data:`MAX_BUDGET_BYTES`.

    Raises:
        ValueError: anything else, a size above :data:`MAX_BUDGET_BYTES` or not finite included (names the key and
            both forms).
    """
    shown = _shown(value)
    if isinstance(value, bool):
        raise ValueError(f"{KEY}: {shown} is not a budget; give a fraction in (0, 1] or a size like '40GiB'")
    if isinstance(value, (int, float)):
        if 0 < value <= 1:
            return "fraction", float(value)
        raise ValueError(f"{KEY}: {shown}: a number is a fraction of the no-recomputation activations and must be "
                         "in (0, 1]; give an absolute size as a string, e.g. '40GiB'")
    match = _BUDGET_RE.match(str(value))
    if not match or float(match.group(1)) <= 0:
        raise ValueError(f"{KEY}: {shown} is not a budget; give a fraction in (0, 1] or a positive size like "
                         "'40GiB' / '512MiB'")
    size = float(match.group(1)) * _UNITS[match.group(2).lower()]
    if not math.isfinite(size) or size > MAX_BUDGET_BYTES:
        raise ValueError(f"{KEY}: {shown} is more than any device's memory (the bound is {MAX_BUDGET_BYTES // 2**60} "
                         "EiB); give the budget the device has, e.g. '40GiB', or the fraction 1 to keep every "
                         "activation")
    return "bytes", size


def _shown(value: Any, limit: int = 48) -> str:
    """``repr(value)``, cut to about ``limit`` characters (a 400-digit value would fill the error line)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit - 8]}... ({len(text)} characters)"


def budget_problem(value: Any) -> str | None:
    """The problem of a ``model.activations_memory_budget`` value, or None (null, or valid)."""
    if value is None:
        return None
    try:
        parse_budget(value)
    except ValueError as e:
        return str(e)
    return None


def _norm(s: PlanShape, tokens: int) -> int:
    return tokens * (s.element_size * s.hidden + 4)


def _attention(s: PlanShape, tokens: int) -> int:
    """The attention's saved tensors over ``tokens`` tokens; its projection input over ``Tn`` (the SP shard)."""
    e, hq, hkv = s.element_size, s.heads_local * s.head_dim, s.kv_heads_local * s.head_dim
    return (_outside_tokens(s) * e * s.hidden
            + tokens * (e * (hq + 2 * hkv) + e * (hq + hkv) + 2 * e * hq + 4 * s.heads_local))


def _mlp(s: PlanShape, tokens: int, input_tokens: int | None = None) -> int:
    """The MLP's saved tensors over ``tokens`` tokens, its input over ``input_tokens`` (default: the untiled MLP's
    ``Tn``, the SP shard its column layer keeps)."""
    inputs = _outside_tokens(s) if input_tokens is None else input_tokens
    return s.element_size * (inputs * s.hidden + tokens * 4 * s.intermediate_local)


def _outside_tokens(s: PlanShape) -> int:
    return -(-s.tokens // s.tp) if s.sequence_parallel and s.tp > 1 else s.tokens


def _layer_bytes(s: PlanShape, mlp_tokens: int | None = None) -> int:
    """Everything one layer keeps without recomputation (``mlp_tokens``: the tiled MLP's chunk)."""
    if mlp_tokens:  # the tiled MLP keeps the gathered [T, H] input and a chunk's tensors while recomputing
        chunk = min(s.tokens, mlp_tokens)
        mlp = _mlp(s, chunk, chunk) + s.tokens * s.element_size * s.hidden
    else:
        mlp = _mlp(s, s.tokens)
    return 2 * _norm(s, _outside_tokens(s)) + _attention(s, s.tokens) + mlp


def _loss_bytes(s: PlanShape, chunk: int | None) -> int:
    e = s.element_size
    if s.fused_loss:  # Liger: ceil(V / H) row chunks (power-of-two rows), the input's gradient, fp32 weight gradient
        chunks = -(-s.vocab_local // s.hidden)
        rows = min(s.tokens, 2 * -(-s.tokens // chunks))
        return rows * s.vocab_local * (e + 4) + s.tokens * e * s.hidden + 4 * s.vocab_local * s.hidden
    rows = s.tokens if chunk is None else min(s.tokens, chunk)
    # tiled (nxd_lc.layers.tiled): the input, its gradient (input dtype) and that gradient scaled in backward;
    # the fp32 weight-gradient accumulator [Vl, H]
    tiled_extra = 3 * s.tokens * e * s.hidden + 4 * s.vocab_local * s.hidden if chunk is not None else 0
    return rows * s.vocab_local * (2 * e + 12) + tiled_extra


def _selective_layer(s: PlanShape, parts: frozenset[str]) -> tuple[int, int]:
    """``(bytes one layer keeps, working bytes of its recomputation)`` with the decoder-layer ``parts``
    (:data:`RECOMPUTE_PARTS` values) recomputed: a recomputed module keeps only its input; nxd_lc's norms take and
    its MLP takes the ``[Tn, H]`` stream (the MLP all-gathers inside under sequence parallelism)."""
    e, tn, t = s.element_size, _outside_tokens(s), s.tokens
    kept, working = _attention(s, t), 0
    if "norm" in parts:  # each norm keeps its input, no reciprocal RMS
        kept += 2 * tn * e * s.hidden
        working += 2 * _norm(s, tn)
    else:
        kept += 2 * _norm(s, tn)
    if "core_attention" in parts:  # the kernel's output and log-sum-exp (its q / k / v are kept as inputs)
        core = t * (e * s.heads_local * s.head_dim + 4 * s.heads_local)
        kept, working = kept - core, working + core
    if "mlp" in parts:
        kept += tn * e * s.hidden
        working += _mlp(s, t)
    else:
        act_mul = t * e * s.intermediate_local if "act_mul" in parts else 0  # silu(gate), recomputed
        kept, working = kept + _mlp(s, t) - act_mul, working + act_mul
    return kept, working


def recompute_parts(names: Sequence[str] | None) -> tuple[frozenset[str], list[str]]:
    """The decoder-layer parts (:data:`RECOMPUTE_PARTS`) ``model.activations_checkpoint_recompute`` names, and the
    names the estimate does not model (counted as not recomputed: an upper bound)."""
    names = list(names or [])
    return (frozenset(RECOMPUTE_PARTS[n] for n in names if n in RECOMPUTE_PARTS),
            [n for n in names if n not in RECOMPUTE_PARTS])


def estimate_split(s: PlanShape, plan: str, loss_chunk: int | None = None,
                   recompute: frozenset[str] | None = None) -> tuple[int, int, int]:
    """The activations of one micro-batch under ``plan`` (module docstring), split by lifetime:
    ``(kept, once, host)`` bytes. ``kept``: saved from the micro-batch's forward to its backward (a pipeline stage
    holds it once per micro-batch in flight); ``once``: alive only while one backward runs (a recomputation's
    working set, backward's transient gradients, the loss over the logits; a rank needs it once whatever the
    number of micro-batches in flight); ``host``: offloaded bytes per micro-batch. ``recompute``: the recomputed
    parts of a ``selective`` plan (:func:`recompute_parts`; default norms and MLP, the planner's plan 2).

    Raises:
        ValueError: an unknown plan name.
    """
    if plan not in PLAN_ORDER:
        raise ValueError(f"unknown memory plan {plan!r}; one of {PLAN_ORDER}")
    e, tn = s.element_size, _outside_tokens(s)
    # RoPE tables; on the rank with the head: the final norm's output and its all-gather
    shared = s.tokens * 8 * s.head_dim + (2 * s.tokens * e * s.hidden if s.head else 0)
    layer_input = tn * e * s.hidden
    host = 0
    if plan == "none":
        kept, once = s.layers * _layer_bytes(s), 0
    elif plan == "selective":  # keeps the inputs of the recomputed modules and everything else
        per_layer, once = _selective_layer(s, _SELECTIVE if recompute is None else recompute)
        kept = s.layers * per_layer
    else:
        tiled = PLAN_MLP_CHUNK if plan in _TILED_MLP_PLANS else None
        once = _layer_bytes(s, tiled)  # the working set of the layer being recomputed
        attention = s.tokens * (e * s.heads_local * s.head_dim + 4 * s.heads_local)  # output + log-sum-exp
        if plan == "full_offload":  # two layer inputs in flight on the device, the rest on the host
            kept, once, host = 0, once + 2 * layer_input, s.layers * layer_input
        elif plan == "full_save_attention_offload":  # two layers' inputs and attention outputs in flight
            kept, once, host = 0, once + 2 * (layer_input + attention), s.layers * (layer_input + attention)
        elif plan == "full_save_attention":  # the attention kernel's output and log-sum-exp kept with the input
            kept = s.layers * (layer_input + attention)
        else:
            kept = s.layers * layer_input
    mlp_tokens = min(s.tokens, PLAN_MLP_CHUNK) if plan in _TILED_MLP_PLANS else s.tokens
    # backward's gradients of one MLP's activations (its input's: [T, H] before the reduce-scatter), alive with
    # its saved ones; under SP also a column layer's input gathered again for its weight gradient
    regathered = s.tokens * e * s.hidden if tn < s.tokens else 0
    transient = _mlp(s, mlp_tokens, mlp_tokens) + regathered
    loss = _loss_bytes(s, loss_chunk) if s.head else 0
    return kept + shared, once + transient + loss, host


def estimate_bytes(s: PlanShape, plan: str, loss_chunk: int | None = None) -> tuple[int, int]:
    """``(device bytes, host bytes)`` of the activations of one micro-batch under ``plan`` (module docstring;
    :func:`estimate_split`'s kept + once).

    Raises:
        ValueError: an unknown plan name.
    """
    kept, once, host = estimate_split(s, plan, loss_chunk)
    return kept + once, host


def _plan(name: str, loss_chunk: int | None, device: int, host: int, budget: int) -> MemoryPlan:
    granularity = {"none": None, "selective": "selective"}.get(name, "full")
    return MemoryPlan(name=name, granularity=granularity, save_attention=name in _SAVE_ATTENTION_PLANS,
                      recompute=("RMSNorm", "LlamaMLP") if name == "selective" else None,
                      tiled_mlp_chunk_size=PLAN_MLP_CHUNK if name in _TILED_MLP_PLANS else None,
                      tiled_loss_chunk_size=loss_chunk, offload=name in OFFLOAD_PLANS, estimate_bytes=device,
                      host_bytes=host, budget_bytes=budget)


def choose_memory_plan(s: PlanShape, budget: Any, *, allow_offload: bool = True, lazy: bool = False) -> MemoryPlan:
    """The fastest plan of :data:`PLAN_ORDER` whose estimate fits ``budget`` (module docstring).

    Args:
        s: the micro-batch's shape on this rank.
        budget: ``model.activations_memory_budget`` (:func:`parse_budget`).
        allow_offload: False where activation offload cannot run or frees nothing (compiled layers, the CPU): the
            plans of :data:`OFFLOAD_PLANS` are not considered.
        lazy: the run is on torch-xla (``xla`` / torch-xla ``neuron``): the plans of :data:`EAGER_ONLY_PLANS` are
            not considered (torch-xla's checkpoint recomputes whole modules).

    Returns:
        The plan; each plan is tried with the untiled loss first, then the tiled one
        (``tiled_loss_chunk_size`` :data:`PLAN_LOSS_CHUNK`) unless the loss is Liger's fused one.

    Raises:
        ValueError: a bad budget; no plan fits (names the smallest estimate and what to change).
    """
    kind, amount = parse_budget(budget)
    reference = estimate_bytes(s, "none")[0]
    limit = int(amount * reference) if kind == "fraction" else int(amount)
    smallest = None
    for name in PLAN_ORDER:
        if (name in OFFLOAD_PLANS and not allow_offload) or (lazy and name in EAGER_ONLY_PLANS):
            continue
        for loss_chunk in ((None,) if s.fused_loss else (None, PLAN_LOSS_CHUNK)):
            device, host = estimate_bytes(s, name, loss_chunk)
            if smallest is None or device < smallest:
                smallest = device
            if device <= limit:
                return _plan(name, loss_chunk, device, host, limit)
    raise ValueError(f"{KEY}: {budget!r} ({limit / _GIB:.2f} GiB of activations) is below the smallest plan's "
                     f"estimate ({smallest / _GIB:.2f} GiB: full recomputation, tiled MLP and loss"
                     f"{', offloaded layer inputs' if allow_offload and not lazy else ''}); raise the budget, shorten "
                     "data.seq_length or add context parallelism (distributed_strategy.context_parallel_size)")


def offload_allowed(accelerator: str, compiled: bool) -> bool:
    """Whether the planner may choose an offload plan: eager layers on an accelerator with its own memory (not
    ``cpu``, whose host memory is the device's; not compiled layers, whose graphs dynamo cannot trace with the
    offload hooks; torch-xla is excluded by ``lazy``)."""
    return not compiled and has_device_memory(accelerator)


def model_plan_shape(model: nn.Module, tokens: int, *, sequence_parallel: bool, element_size: int,
                     fused_loss: bool = False) -> PlanShape:
    """The :class:`PlanShape` of a built decoder (:class:`~nxd_lc.models.llama.LlamaForCausalLM` or subclass) on this
    rank: local heads from its qkv projection, its local layers and padded vocabulary, TP from ``parallel_state``.

    Args:
        tokens: micro batch x sequence length (the whole sequence; divided here by the context-parallel size).
        sequence_parallel, element_size, fused_loss: as :class:`PlanShape`.
    """
    tp, cp = parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_context_parallel_world_size()
    config, local = model.config, model.local_layers()
    attn = local[0][1].self_attn if local else None
    qkv = getattr(attn, "qkv_proj", None)
    return PlanShape(tokens=tokens // cp, hidden=config.hidden_size,
                     head_dim=attn.head_dim if attn is not None else config.hidden_size // config.num_attention_heads,
                     heads_local=getattr(qkv, "num_heads_local", config.num_attention_heads // tp),
                     kv_heads_local=getattr(qkv, "num_kv_heads_local", max(1, config.num_key_value_heads // tp)),
                     intermediate_local=config.intermediate_size // tp, vocab_local=model.padded_vocab_size // tp,
                     layers=len(local), tp=tp, sequence_parallel=sequence_parallel, element_size=element_size,
                     fused_loss=fused_loss)


def apply_kernels_and_memory(model: nn.Module, model_cfg: ModelConfig, *, accelerator: str, compiled: bool,
                             tokens: int, element_size: int, tensor_parallel: int = 1,
                             sequence_parallel: bool = False) -> tuple[ModelConfig, list[str]]:
    """The ``model.fusions`` kernels, then the memory keys (chosen from ``model.activations_memory_budget`` when it
    is set, logged), applied to a built decoder: the one sequence training (:func:`nxd_lc.app.build.build_model`)
    and the benchmarks run.

    Args:
        model: the decoder, weights loaded.
        model_cfg: its ``model:`` config.
        accelerator: the resolved ``trainer.accelerator`` it will run on; compiled: its decoder layers will be
            compiled (``model.compile`` resolved).
        tokens: micro batch x sequence length (the plan's length); element_size: bytes per activation element.
        tensor_parallel, sequence_parallel: the layout (the loss kernel and the plan depend on it).

    Returns:
        ``(model_cfg with the plan's keys, names of the checkpointed modules)``; with a budget the chosen
        :class:`MemoryPlan` is also kept as ``model.memory_plan``.

    Raises:
        ValueError: a kernel the device cannot run, a budget below every plan, a bad memory key (each names its key).
    """
    kernels = resolve_fusions(vars(model_cfg.fusions), accelerator, tensor_parallel=tensor_parallel,
                              tiled_loss=model_cfg.tiled_loss_chunk_size is not None, compiled=compiled)
    apply_fusions(model, kernels)
    if model_cfg.activations_memory_budget is not None:  # validation: no memory key is also set by hand
        shape = model_plan_shape(model, tokens, sequence_parallel=sequence_parallel, element_size=element_size,
                                 fused_loss=kernels["cross_entropy"] == "liger")
        plan = choose_memory_plan(shape, model_cfg.activations_memory_budget,
                                  allow_offload=offload_allowed(accelerator, compiled),
                                  lazy=is_xla_accelerator(accelerator))
        log.info(plan.describe())
        model_cfg = dataclasses.replace(model_cfg, **plan.model_keys())
        model.memory_plan = plan
    return model_cfg, apply_memory_techniques(model, model_cfg)
