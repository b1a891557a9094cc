"""Activation checkpointing with NxDT semantics, and the one call that applies every memory technique.

NxDT keys (``model:`` section):

* ``activations_checkpoint_granularity: null`` -- nothing is recomputed.
* ``full`` -- every decoder layer (``model.layers[i]``) is recomputed in backward: only the layer inputs
  ``[B, S(/tp), H]`` are kept between forward and backward.
* ``selective`` -- the modules whose *class name* is listed in ``activations_checkpoint_recompute`` (e.g.
  ``[CoreAttention]``, NxDT's default, ``[CoreAttention, LlamaMLP]`` or ``[LlamaRMSNorm, ActivationMultiplyMLP]``;
  NxDT's ``LlamaRMSNorm`` is nxd_lc's ``RMSNorm``) are recomputed. Unlike NxDT, a name
  that matches no module class of the decoder layers is an error (NxDT silently skips it).

``activations_checkpoint_method: block`` with ``activations_checkpoint_num_layers: N`` (NeMo's keys; Megatron-core's
``recompute_method`` / ``recompute_num_layers``) -- with ``full`` granularity only the first ``N`` decoder layers
of each pipeline stage are recomputed; the others keep their activations. A budget between full recomputation
and none: memory and recompute time both scale with ``N``. ``uniform`` (or null) checkpoints every layer.

``activations_checkpoint_save_attention: true`` (nxd_lc; default false) -- inside every checkpointed module the
attention kernel's outputs (``O [B, Hq, S, D]`` and its log-sum-exp) are kept from forward instead of recomputed:
the recomputation re-runs the cheap ops (norms, projections, RoPE) but not the ``O(S^2)`` attention. Costs one
``[B, S, H]`` (+ ``[B, Hq, S]``) per layer. Mechanism: torch's selective activation checkpointing
(``create_selective_checkpoint_contexts``, torch >= 2.4) with a policy that must-saves the attention ops
(the SDPA kernels of every backend and nxd_lc's ring attention op); as torchtitan's op-level SAC saves SDPA.
Selective checkpointing requires the recomputation to run the forward's ops, so with this key the tiled MLP's
forward is recomputed too (see :func:`nxd_lc.layers.tiled.discard_tiled_outputs`; without the key it is skipped).
Ring attention in eager mode is an autograd Function of several ops, not one kernel: it is recomputed as before.

Mechanism: the chosen modules' ``forward`` is replaced, on the instance, by
``torch.utils.checkpoint.checkpoint(type(m).forward, m, ..., use_reentrant=False)`` (Chen et al. 2016,
arXiv:1604.06174; non-reentrant checkpointing as in torch). Parameter names and the state dict are unchanged
(no wrapper module), the RNG state is restored for the recomputation, and collectives inside a recomputed
region (sequence-parallel all-gathers, reduce-scatters, context-parallel exchanges) are re-run identically on
every rank in backward. Under ``torch.no_grad`` the original forward runs.

``activations_offload: true`` (nxd_lc; with ``full``) -- each recomputed layer's input is kept in host memory
between forward and backward, and with ``activations_checkpoint_save_attention`` so are the attention kernel's
output and log-sum-exp: the device keeps no activation per layer, and the recomputation still skips the attention
(:func:`_offloaded_checkpoint`; copies on a side stream, prefetched one layer ahead:
:mod:`nxd_lc.runtime.offload`).

:func:`apply_memory_techniques` applies ``model.tiled_loss_chunk_size``, ``model.tiled_mlp_chunk_size`` and the
activation checkpointing keys to a constructed :class:`~nxd_lc.models.llama.model.LlamaForCausalLM`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from typing import TYPE_CHECKING, Any, Sequence

import torch
from torch import nn
from torch.compiler import is_compiling
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from nxd_lc.config.schema import CHECKPOINT_METHODS, checkpoint_method_problems
from nxd_lc.layers.tiled import check_chunk_size, discard_tiled_outputs
from nxd_lc.models.common.mlp import GeluMLP, LlamaMLP
from nxd_lc.runtime.offload import ActivationOffloader, OffloadGroup
from nxd_lc.runtime.xla import is_xla_tensor

if TYPE_CHECKING:
    from nxd_lc.config.schema import ModelConfig

__all__ = [
    "GRANULARITIES",
    "apply_activation_checkpointing",
    "apply_memory_techniques",
    "apply_tiled_mlp",
    "recomputable_module_names",
]

GRANULARITIES = (None, "selective", "full")
#: NxDT's module class names for ``activations_checkpoint_recompute`` that differ from nxd_lc's.
NXDT_MODULE_ALIASES = {"LlamaRMSNorm": "RMSNorm"}
_FLAG = "_nxd_activation_checkpointed"
log = logging.getLogger(__name__)


def decoder_layers(model: nn.Module) -> list[tuple[int, nn.Module]]:
    """``(index, layer)`` of the decoder layers this process holds (``model.local_layers()`` under pipelining,
    else all of ``model.layers``).

    Raises:
        ValueError: the model has no ``layers`` ModuleList.
    """
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(
            f"activation checkpointing and model.compile need a decoder with a 'layers' ModuleList (e.g. "
            f"LlamaForCausalLM); "
            f"got {type(model).__name__}"
        )
    local = getattr(model, "local_layers", None)
    return local() if callable(local) else list(enumerate(layers))


def recomputable_module_names(model: nn.Module) -> list[str]:
    """Sorted class names of the modules inside the decoder layers (layer class included): the valid entries
    of ``model.activations_checkpoint_recompute`` for this model (e.g. ``CoreAttention``, ``LlamaAttention``,
    ``LlamaDecoderLayer``, ``LlamaMLP``, ``RMSNorm``, and the parallel linear layers).

    Raises:
        ValueError: the model has no ``layers`` ModuleList.
    """
    return sorted({type(m).__name__ for _, layer in decoder_layers(model) for m in layer.modules()})


_SAVE_ATTENTION = "_nxd_checkpoint_save_attention"
_OFFLOAD = "_nxd_checkpoint_offload"
#: attention kernels whose outputs are kept with ``activations_checkpoint_save_attention`` (names of aten ops
#: that SDPA dispatches to on CPU / CUDA / PrivateUse1 devices, and nxd_lc's traced ring attention op)
_ATTENTION_OPS = ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
                  "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
                  "_scaled_dot_product_fused_attention_overrideable")


@functools.lru_cache(maxsize=1)
def _attention_ops() -> frozenset[Any]:
    """The OpOverloads of :data:`_ATTENTION_OPS` this torch build has, plus ``nxd_lc::ring_attention_fwd``."""
    import nxd_lc.context.ring  # noqa: F401  (registers nxd_lc::ring_attention_fwd)

    ops = {getattr(torch.ops.aten, name).default for name in _ATTENTION_OPS if hasattr(torch.ops.aten, name)}
    ops.add(torch.ops.nxd_lc.ring_attention_fwd.default)
    return frozenset(ops)


def _save_attention_policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Selective-checkpoint policy: keep the attention kernels' outputs, recompute everything else."""
    return CheckpointPolicy.MUST_SAVE if func in _attention_ops() else CheckpointPolicy.PREFER_RECOMPUTE


def _recompute_without_tiled_outputs() -> tuple[contextlib.AbstractContextManager,
                                                contextlib.AbstractContextManager]:
    """``context_fn`` of the checkpoint: plain forward; recomputation under :func:`discard_tiled_outputs`."""
    return contextlib.nullcontext(), discard_tiled_outputs()


def _checkpointed_forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The class forward of ``module`` under non-reentrant checkpointing (plain call without grad).

    When the module's class sets ``tiled_output_unused_in_recompute = True`` (nothing after its tiled MLP saves a
    tensor for backward: ``LlamaDecoderLayer``, ``LlamaMLP``), the recomputation skips the tiled MLP's chunk
    forwards (see :func:`nxd_lc.layers.tiled.discard_tiled_outputs`). With
    ``activations_checkpoint_save_attention`` the attention outputs are kept (module docstring). With
    ``activations_offload`` the input (and the kept attention outputs) go to host memory
    (:func:`_offloaded_checkpoint`).
    """
    forward = type(module).forward
    if not torch.is_grad_enabled():
        return forward(module, *args, **kwargs)
    if any(isinstance(a, torch.Tensor) and is_xla_tensor(a) for a in args):
        return _xla_checkpoint(forward, module, args, kwargs)
    save_attention = bool(getattr(module, _SAVE_ATTENTION, False))
    offloader = getattr(module, _OFFLOAD, None)
    if offloader is not None:
        return _offloaded_checkpoint(forward, module, offloader, save_attention, args, kwargs)
    # traced (model.compile): dynamo accepts a context_fn only when it is selective checkpointing's, and the
    # traced tiled MLP is per-chunk checkpoints that the discard flag does not touch; selective checkpointing
    # (save_attention) needs the recomputation to run the forward's ops, so it keeps the tiled MLP's forward
    discard = (getattr(type(module), "tiled_output_unused_in_recompute", False) and not is_compiling()
               and not save_attention)
    if not (save_attention or discard):
        return checkpoint(forward, module, *args, use_reentrant=False, **kwargs)
    if save_attention:
        context_fn = functools.partial(create_selective_checkpoint_contexts, _save_attention_policy)
    else:
        context_fn = _recompute_without_tiled_outputs
    return checkpoint(forward, module, *args, use_reentrant=False, context_fn=context_fn, **kwargs)


def _xla_checkpoint(forward: Any, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The module's forward under torch-xla's checkpoint (``torch_xla.utils.checkpoint.checkpoint``): torch's
    non-reentrant checkpoint asks ``torch.xla`` for a device module, which does not exist (an AttributeError at the
    first checkpointed forward), and XLA's compiler would merge a plain recomputation with the forward it repeats
    (common-subexpression elimination) unless an optimization barrier separates them, which torch-xla's reentrant
    checkpoint inserts (NxD uses it too). Keyword arguments are bound (the reentrant form takes none); when no
    tensor input requires grad (a frozen embedding under LoRA) the first one is made a leaf that does, so the
    recomputation still gives the module's parameters their gradients (its own gradient is discarded).

    Raises:
        NotImplementedError: ``activations_checkpoint_save_attention`` or ``activations_offload`` on the module
            (torch-xla's checkpoint has no selective policy and no offload hooks; validation refuses both keys on
            torch-xla, so this is reached only through ``model.activations_memory_budget``).
    """
    if getattr(module, _SAVE_ATTENTION, False) or getattr(module, _OFFLOAD, None) is not None:
        raise NotImplementedError(
            "model.activations_checkpoint_save_attention / model.activations_offload: not supported on torch-xla "
            "(torch-xla's checkpoint recomputes whole modules, without a selective policy or offload); set them "
            "false (with model.activations_memory_budget: choose the memory keys by hand)")
    import torch_xla.utils.checkpoint as xla_checkpoint

    if not any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
        first = next(i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.is_floating_point())
        args = (*args[:first], args[first].detach().requires_grad_(), *args[first + 1:])
    return xla_checkpoint.checkpoint(functools.partial(forward, module, **kwargs), *args)


class _Offloaded:
    """Stands, in what a checkpoint saves, for the tensor of index ``index`` in its :class:`OffloadGroup`."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


def _offloadable(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel() > 0


class _KeepAttentionOffloaded(TorchDispatchMode):
    """Forward context of an offloading checkpoint with ``activations_checkpoint_save_attention``: each attention
    kernel's floating-point outputs (the output ``O``, its log-sum-exp) go to the layer's offload group, and
    ``kept`` records ``(op, output structure, leaves)`` in call order (the other leaves, e.g. CUDA's
    random-number seed and offset, as they are) for :class:`_ReplayAttention`."""

    def __init__(self, group: OffloadGroup, kept: list[tuple[Any, Any, list[Any]]]) -> None:
        super().__init__()
        self.group, self.kept = group, kept

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func in _attention_ops():
            leaves, spec = tree_flatten(out)
            self.kept.append((func, spec, [_Offloaded(self.group.offload(x)) if _offloadable(x) else x
                                           for x in leaves]))
        return out


class _ReplayAttention(TorchDispatchMode):
    """Recompute context matching :class:`_KeepAttentionOffloaded`: the n-th attention kernel call returns the
    n-th kept outputs, fetched back from the host, instead of running.

    Raises:
        RuntimeError: the recomputation calls an attention kernel the forward did not (a different kernel, or
            more calls): the region is not deterministic in its choice of kernel.
    """

    def __init__(self, group: OffloadGroup, kept: list[tuple[Any, Any, list[Any]]]) -> None:
        super().__init__()
        self.group, self.kept, self.next = group, kept, 0

    def __enter__(self) -> _ReplayAttention:
        self.next = 0  # each recomputation (a retain_graph backward runs it again) replays from the start
        return super().__enter__()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func not in _attention_ops():
            return func(*args, **(kwargs or {}))
        if self.next >= len(self.kept) or self.kept[self.next][0] is not func:
            ran = self.kept[self.next][0] if self.next < len(self.kept) else "nothing"
            raise RuntimeError(f"activation offload with activations_checkpoint_save_attention: the recomputation "
                               f"calls {func} as attention kernel {self.next} where the forward called {ran}")
        _, spec, leaves = self.kept[self.next]
        self.next += 1
        return tree_unflatten([self.group.get(x.index) if isinstance(x, _Offloaded) else x for x in leaves], spec)


def _offloaded_checkpoint(forward: Any, module: nn.Module, offloader: ActivationOffloader, save_attention: bool,
                          args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``model.activations_offload``: the layer under non-reentrant checkpointing whose saved input goes to host
    memory (DeepSpeed's ``cpu_checkpointing``; ALST, arXiv:2506.13996, section 3), in one
    :class:`~nxd_lc.runtime.offload.OffloadGroup` per call.

    The input is offloaded by saved-tensor hooks around the checkpoint call: the checkpoint saves its tensor
    inputs under them (torch 2.9: ``_NoopSaveInputs.save_for_backward``; 2.13: ``_make_saved_tensor``), and what
    its region saves is the checkpoint's own (discarded). Only floating-point inputs that require grad move (the
    hidden states); the RoPE tables, position and segment ids that every layer shares stay. With
    ``save_attention`` the attention kernels' outputs join the group (:class:`_KeepAttentionOffloaded`) and the
    recomputation returns them instead of running the kernels (:class:`_ReplayAttention`). The first tensor
    backward unpacks brings back the group, and starts bringing back the one before it.
    """
    group = offloader.group()
    packed: list[int] = []

    def pack(t: torch.Tensor) -> Any:
        if not (_offloadable(t) and t.requires_grad):
            return t
        packed.append(group.offload(t))
        return _Offloaded(packed[-1])

    def unpack(x: Any) -> torch.Tensor:
        return group.get(x.index) if isinstance(x, _Offloaded) else x

    discard = getattr(type(module), "tiled_output_unused_in_recompute", False)
    kept: list[tuple[Any, Any, list[Any]]] = []

    def contexts() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
        recompute: list[Any] = []
        if save_attention:
            replay = _ReplayAttention(group, kept)
            recompute.append(lambda: replay)
        if discard:
            recompute.append(discard_tiled_outputs)
        forward_context = _KeepAttentionOffloaded(group, kept) if save_attention else contextlib.nullcontext()
        return forward_context, _Contexts(recompute)

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        out = checkpoint(forward, module, *args, use_reentrant=False, context_fn=contexts, **kwargs)
    if not packed and not _WARNED and any(_offloadable(a) and a.requires_grad for a in (*args, *kwargs.values())):
        _WARNED.append(True)
        log.warning("model.activations_offload: torch's checkpoint saved the layer input outside the offload hooks "
                    "(torch %s); the inputs stay on the device", torch.__version__)
    return out


_WARNED: list[bool] = []  # the warning above, once per process


class _Contexts(contextlib.AbstractContextManager):
    """Enters a fresh context from each factory, in order, every time it is entered (a recomputation context is
    entered once per recomputation; a ``retain_graph`` backward recomputes again)."""

    def __init__(self, factories: Sequence[Any]) -> None:
        self._factories = list(factories)
        self._stacks: list[contextlib.ExitStack] = []

    def __enter__(self) -> _Contexts:
        stack = contextlib.ExitStack()
        for factory in self._factories:
            stack.enter_context(factory())
        self._stacks.append(stack)
        return self

    def __exit__(self, *exc: Any) -> bool:
        return bool(self._stacks.pop().__exit__(*exc))


def _wrap(module: nn.Module, save_attention: bool = False, offloader: ActivationOffloader | None = None) -> bool:
    """Route ``module``'s forward through :func:`_checkpointed_forward`; False if it already was."""
    setattr(module, _SAVE_ATTENTION, save_attention)
    setattr(module, _OFFLOAD, offloader)
    if getattr(module, _FLAG, False):
        return False
    # a partial of a module-level function (not a closure): deepcopy / pickle re-bind it to the copied module
    module.forward = functools.partial(_checkpointed_forward, module)
    setattr(module, _FLAG, True)
    return True


def apply_activation_checkpointing(model: nn.Module, granularity: str | None,
                                   recompute: Sequence[str] | None = None, save_attention: bool = False,
                                   method: str | None = None, num_layers: int | None = None,
                                   offload: bool = False) -> list[str]:
    """Make ``model`` recompute activations in backward per NxDT's granularity (see the module docstring).

    Args:
        model: the decoder (a module with a ``layers`` ModuleList), after construction (and weight loading).
        granularity: ``None`` | ``"selective"`` | ``"full"`` (``model.activations_checkpoint_granularity``).
        recompute: class names for ``selective`` (``model.activations_checkpoint_recompute``); ignored
            (must be a list or None) for the other granularities, as in NxDT.
        save_attention: keep the attention kernels' outputs inside the checkpointed modules
            (``model.activations_checkpoint_save_attention``; module docstring).
        method: ``None`` / ``"uniform"`` (every layer) or ``"block"`` (the first ``num_layers`` layers this
            process holds, i.e. per pipeline stage) with ``full`` granularity
            (``model.activations_checkpoint_method``; module docstring).
        num_layers: ``model.activations_checkpoint_num_layers``.
        offload: ``model.activations_offload``: with ``full`` granularity, each checkpointed layer's input (with
            ``save_attention`` also its attention outputs) is kept in host memory between forward and backward
            (:func:`_offloaded_checkpoint`); the layers share one
            :class:`~nxd_lc.runtime.offload.ActivationOffloader`.

    Returns:
        Qualified names of the modules now checkpointed (empty for ``None``). Applying twice is a no-op.

    Raises:
        ValueError: unknown granularity or method; ``selective`` with no names; a name that is not a module
            class of the decoder layers (the message lists the valid names); a method / num_layers combination
            :func:`~nxd_lc.config.schema.checkpoint_method_problems` rejects.
    """
    if granularity not in GRANULARITIES:
        raise ValueError(f"model.activations_checkpoint_granularity: unknown value {granularity!r}; choose "
                         f"null, selective or full")
    if method not in CHECKPOINT_METHODS:
        raise ValueError(f"model.activations_checkpoint_method: unknown value {method!r}; choose null, uniform "
                         "or block")
    problems = checkpoint_method_problems(granularity, method, num_layers)
    if problems:
        raise ValueError("; ".join(problems))
    if offload and granularity != "full":
        raise ValueError("model.activations_offload: true needs model.activations_checkpoint_granularity full (it "
                         "offloads the inputs of whole recomputed layers)")
    if granularity is None:
        if save_attention:
            raise ValueError("model.activations_checkpoint_save_attention: true needs "
                             "model.activations_checkpoint_granularity full or selective (it is null)")
        return []
    layers = decoder_layers(model)
    if granularity == "full":
        if method == "block":  # Megatron's recompute_method 'block': the first N layers of this stage
            layers = layers[:num_layers]
        targets = [(f"layers.{i}", layer) for i, layer in layers]
    else:
        targets = _selective_targets(model, layers, list(recompute or []))
    offloader = ActivationOffloader() if offload else None
    return [name for name, module in targets if _wrap(module, save_attention, offloader)]


def _selective_targets(model: nn.Module, layers: list[tuple[int, nn.Module]],
                       names: list[str]) -> list[tuple[str, nn.Module]]:
    """(qualified name, module) of every module in ``layers`` whose class name is in ``names``."""
    valid = recomputable_module_names(model)
    names = [NXDT_MODULE_ALIASES.get(n, n) for n in names]
    if not names:
        raise ValueError("model.activations_checkpoint_recompute: 'selective' granularity needs module class "
                         f"names to recompute, e.g. [CoreAttention]; valid names: {valid}")
    unknown = [n for n in names if n not in valid]
    if unknown:
        raise ValueError(f"model.activations_checkpoint_recompute: unknown module name(s) {unknown}; valid "
                         f"names for this model: {valid}")
    return [(f"layers.{i}.{sub}" if sub else f"layers.{i}", m)
            for i, layer in layers for sub, m in layer.named_modules()
            if type(m).__name__ in names]


def apply_tiled_mlp(model: nn.Module, chunk_size: int | None) -> int:
    """Set ``tiled_chunk_size`` on every :class:`LlamaMLP` in ``model``; returns how many were set.

    Raises:
        ValueError: ``chunk_size`` is not None or a positive int (names ``model.tiled_mlp_chunk_size``); a chunk
            size for a model with GeLU MLPs (the tiled MLP is SwiGLU's only).
    """
    if chunk_size is not None:
        check_chunk_size(chunk_size, "model.tiled_mlp_chunk_size")
        if any(isinstance(m, GeluMLP) for m in model.modules()):
            raise ValueError("model.tiled_mlp_chunk_size: not supported yet with GeLU MLPs (model.activation: gelu); "
                             "set it to null")
    mlps = [m for m in model.modules() if isinstance(m, LlamaMLP)]
    for mlp in mlps:
        mlp.tiled_chunk_size = chunk_size
    return len(mlps)


def apply_memory_techniques(model: nn.Module, model_cfg: ModelConfig) -> list[str]:
    """Apply the ``model:`` config's memory keys to a built decoder (e.g. ``LlamaForCausalLM``):

    * ``tiled_loss_chunk_size`` -> ``model.tiled_loss_chunk_size`` (used by ``LlamaForCausalLM.loss``),
    * ``tiled_mlp_chunk_size`` -> every ``LlamaMLP.tiled_chunk_size``,
    * ``activations_checkpoint_granularity`` / ``activations_checkpoint_recompute`` ->
      :func:`apply_activation_checkpointing`.

    Call once, after construction and weight loading, before the optimizer is built (parameters are not
    changed, so the order relative to the optimizer does not matter for correctness).

    Returns:
        The qualified names of the checkpointed modules.

    Raises:
        ValueError: a bad chunk size or checkpointing key (each names its config key); the model has no
            ``tiled_loss_chunk_size`` attribute while a loss chunk size is set.
    """
    loss_chunk = model_cfg.tiled_loss_chunk_size
    if loss_chunk is not None:
        check_chunk_size(loss_chunk, "model.tiled_loss_chunk_size")
        if not hasattr(model, "tiled_loss_chunk_size"):
            raise ValueError(f"model.tiled_loss_chunk_size: {type(model).__name__} has no tiled loss; "
                             "use LlamaForCausalLM or set it to null")
    if hasattr(model, "tiled_loss_chunk_size"):
        model.tiled_loss_chunk_size = loss_chunk
    apply_tiled_mlp(model, model_cfg.tiled_mlp_chunk_size)
    return apply_activation_checkpointing(model, model_cfg.activations_checkpoint_granularity,
                                          model_cfg.activations_checkpoint_recompute,
                                          model_cfg.activations_checkpoint_save_attention,
                                          model_cfg.activations_checkpoint_method,
                                          model_cfg.activations_checkpoint_num_layers,
                                          model_cfg.activations_offload)
