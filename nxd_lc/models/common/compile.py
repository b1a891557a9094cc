"""``model.compile``: regional ``torch.compile`` of each decoder layer.

Each decoder layer this process holds is compiled in place with ``nn.Module.compile`` (the module's call is
compiled; parameter names and the state dict are unchanged, so checkpoints, re-sharding and the optimizer see
the same model), with ``fullgraph=True``: a graph break is an error, not a silent fallback. Identical layers
share one compiled graph (torch inlines ``nn.Module`` calls and passes parameters as graph inputs), so the
compile cost is paid once per distinct layer signature, not once per layer ("regional compilation" in the
PyTorch tutorials).

What makes the layer traceable without breaks (tested at TP 1, TP 2 + sequence parallel, CP 2 ring and Ulysses,
with and without packed-document ``segment_ids``, in tests/test_compile.py):

* tensor / sequence parallel collectives: torch.distributed calls that dynamo rewrites into functional
  collectives;
* Ulysses' all-to-all: :func:`nxd_lc.distributed.collectives.all_to_all` uses
  ``torch.distributed._functional_collectives.all_to_all_single`` when traced;
* ring attention (point-to-point sends, host-side tile bounds): one ``torch.library`` custom op with its own
  backward op (:mod:`nxd_lc.context.ring`);
* document-masked attention (host-side document lengths, data-dependent shapes in eager): the tiled ring kernel
  on this rank alone, as the same custom op (:func:`nxd_lc.context.local.local_attention`).

Backend by device (:func:`compile_backend`): ``inductor`` on CPU and CUDA, ``neuron`` on TorchNeuron's native
device; the XLA lane traces lazy graphs itself and rejects ``model.compile`` at validation.
"""

from __future__ import annotations

import logging

from torch import nn

log = logging.getLogger(__name__)

#: Why ``model.compile: auto`` stays eager on TorchNeuron's native device (logged there, printed by the dry run).
AUTO_EAGER_NATIVE = ("auto stays eager on TorchNeuron's native neuron device until a run shows that "
                     "torch.compile(backend='neuron') compiles nxd_lc's decoder layers (no run has yet, and a compile "
                     "failure is fatal there by default: no eager fallback); set model.compile: true to try it")


def compile_enabled(setting: object, accelerator: str, *, blocked_by: str | None = None) -> bool:
    """Whether the decoder layers are compiled for ``model.compile: setting`` on a resolved ``trainer.accelerator``.

    ``auto`` (the default): compiled on ``gpu`` (CUDA, inductor), where a step of many small eager kernels is
    launch-bound (H200 profile, DESIGN.md 13); eager on ``cpu`` (compile time is not repaid on short CPU runs), on
    torch-xla (``xla``, ``neuron``), which compiles its own lazy graphs, and on TorchNeuron's native device
    (``neuron_native``, logged: :data:`AUTO_EAGER_NATIVE`) until a run there shows that ``backend="neuron"``
    compiles nxd_lc's layers; also eager when ``blocked_by`` names a feature not yet checked under compile
    (logged). ``True`` / ``False`` are obeyed (validation refuses ``True`` where it cannot work).

    Raises:
        ValueError: another value (names ``model.compile`` and the choices).
    """
    if isinstance(setting, bool):
        return setting
    if not isinstance(setting, str) or setting != "auto":
        raise ValueError(f"model.compile: {setting!r} is not one of true, false, auto")
    if accelerator == "neuron_native":
        log.info("model.compile: %s", AUTO_EAGER_NATIVE)
        return False
    if accelerator != "gpu":
        return False
    if blocked_by:
        log.info("model.compile: auto stays eager on %s: %s is not supported under compile yet", accelerator,
                 blocked_by)
        return False
    return True


def compile_backend(accelerator: str) -> str:
    """The ``torch.compile`` backend for a resolved ``trainer.accelerator``
    (:func:`nxd_lc.runtime.device.resolve_accelerator`).

    Raises:
        ValueError: a lazy-tensor accelerator (``xla``, torch-xla based ``neuron``), which compiles lazy graphs
            itself (names ``model.compile``).
    """
    from nxd_lc.runtime.device import is_xla_accelerator

    if is_xla_accelerator(accelerator):
        raise ValueError(f"model.compile: not available on trainer.accelerator {accelerator!r} (torch-xla compiles "
                         "its lazy graphs itself); set model.compile: false there")
    return "neuron" if accelerator == "neuron_native" else "inductor"  # TorchNeuron's dynamo backend, else inductor


def compile_decoder_layers(model: nn.Module, backend: str, fullgraph: bool = True, cuda_graphs: bool = False) -> int:
    """Compile every decoder layer ``model`` holds, in place (``layer.compile(backend=..., fullgraph=...)``).

    Args:
        model: a decoder with a ``layers`` ModuleList (e.g. ``LlamaForCausalLM``); under pipeline parallelism
            only this stage's layers (``model.local_layers()``) are compiled.
        backend: a ``torch.compile`` backend (:func:`compile_backend`; tests use ``aot_eager``).
        fullgraph: True (default) makes any graph break an error at the first call.
        cuda_graphs: ``model.enable_cuda_graph``: inductor's ``mode="reduce-overhead"``, which records each
            compiled forward and backward graph as a CUDA graph per input shape and replays it (one launch instead
            of a graph's kernels; CUDA graph trees share one memory pool across the layers). Inductor skips it,
            logging why, for a graph it cannot capture (CPU tensors inside, e.g. host-side document lengths, or
            dynamic shapes it would have to re-record); a training step starts with
            :func:`mark_cuda_graph_step` so that the previous step's replayed outputs may be overwritten.

    Returns:
        The number of layers compiled.

    Raises:
        ValueError: the model has no ``layers`` ModuleList; ``cuda_graphs`` with a backend other than inductor
            (names ``model.enable_cuda_graph``).
    """
    from nxd_lc.models.common.checkpointing import decoder_layers

    if cuda_graphs and backend != "inductor":
        raise ValueError(f"model.enable_cuda_graph: needs the inductor backend (CUDA), not {backend!r}; set it false")
    layers = decoder_layers(model)
    mode = {"mode": "reduce-overhead"} if cuda_graphs else {}
    for _, layer in layers:
        layer.compile(backend=backend, fullgraph=fullgraph, **mode)
    log.info("model.compile: %d decoder layers compiled (backend %s, fullgraph %s%s)", len(layers), backend, fullgraph,
             ", CUDA graphs" if cuda_graphs else "")
    return len(layers)


def mark_cuda_graph_step() -> None:
    """Tell CUDA graph trees that a new training step (micro-batch) begins: the outputs the previous one's replays
    left in the shared pool may be overwritten (``torch.compiler.cudagraph_mark_step_begin``, torch >= 2.1). Called
    at each training step when ``model.enable_cuda_graph`` is on."""
    import torch

    torch.compiler.cudagraph_mark_step_begin()
