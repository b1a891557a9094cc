"""The stand-in ``neuron`` device's process-group and compile backends (see :mod:`tests.neuron_standin`)."""

from __future__ import annotations

from typing import Any

import torch

COMPILE_BACKEND = "neuron"
#: the stock backend the ``neuron`` compile backend runs (inductor has no code generation for this device)
UNDERLYING_COMPILE_BACKEND = "aot_eager"


def _register_compile_backend() -> None:
    from torch._dynamo import list_backends, register_backend
    from torch._dynamo.backends.registry import lookup_backend

    if COMPILE_BACKEND in list_backends(exclude_tags=()):
        return

    def neuron(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        return lookup_backend(UNDERLYING_COMPILE_BACKEND)(gm, example_inputs)

    register_backend(name=COMPILE_BACKEND)(neuron)


PG_BACKEND = "neuron"
#: ProcessGroup method -> the gloo backend's method it runs (the names torch 2.9 and 2.13 dispatch to)
_PG_METHODS = {
    "allreduce": "allreduce", "allreduce_coalesced": "allreduce_coalesced", "allgather": "allgather",
    "_allgather_base": "_allgather_base", "all_gather_single": "_allgather_base",
    "allgather_into_tensor_coalesced": "allgather_into_tensor_coalesced", "reduce_scatter": "reduce_scatter",
    "_reduce_scatter_base": "_reduce_scatter_base", "reduce_scatter_single": "_reduce_scatter_base",
    "reduce_scatter_tensor_coalesced": "reduce_scatter_tensor_coalesced", "alltoall": "alltoall",
    "alltoall_base": "alltoall_base", "all_to_all_single": "alltoall_base", "broadcast": "broadcast",
    "reduce": "reduce", "gather": "gather", "scatter": "scatter", "send": "send", "recv": "recv",
    "recv_anysource": "recv_anysource", "barrier": "barrier", "monitored_barrier": "monitored_barrier",
}


def _host(ext: Any, value: Any) -> Any:
    """``value`` with every ``neuron`` tensor (also inside lists) replaced by a CPU alias of its host memory."""
    if isinstance(value, torch.Tensor):
        return ext.host_alias(value) if value.device.type == "neuron" else value
    if isinstance(value, (list, tuple)):
        return type(value)(_host(ext, v) for v in value)
    return value


def _process_group_class(ext: Any) -> type:
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import ProcessGroupGloo

    class NeuronProcessGroup(dist.ProcessGroup):
        """Process group of the ``neuron`` backend: gloo over the host memory of the device tensors (aliases, no
        copies), as TorchNeuron's ``neuron`` backend runs collectives on device tensors."""

        def __init__(self, store: Any, rank: int, size: int, timeout: Any) -> None:
            super().__init__(rank, size)
            self.gloo = ProcessGroupGloo(store, rank, size, timeout)
            # the group's name lives on its backends (torch sets it after creation; functional collectives and
            # torch.compile's traced collectives read it): gloo serves host tensors too
            self._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, self.gloo)

        def getBackendName(self) -> str:  # noqa: N802 - torch's name
            return PG_BACKEND

    def forward(gloo_name: str) -> Any:
        def method(self: Any, *args: Any, **kwargs: Any) -> Any:
            return getattr(self.gloo, gloo_name)(*(_host(ext, a) for a in args),
                                                 **{k: _host(ext, v) for k, v in kwargs.items()})

        method.__name__ = gloo_name
        return method

    for name, gloo_name in _PG_METHODS.items():
        if hasattr(dist.ProcessGroup, name):
            setattr(NeuronProcessGroup, name, forward(gloo_name))
    return NeuronProcessGroup


def _register_process_group_backend(ext: Any) -> None:
    import torch.distributed as dist

    if PG_BACKEND in getattr(dist.Backend, "backend_list", []):
        return
    cls = _process_group_class(ext)
    dist.Backend.register_backend(PG_BACKEND, cls, devices=["neuron"])  # created as cls(store, rank, size, timeout)


def register(ext: Any) -> None:
    """Register the compile backend and the ``neuron`` process-group backend (idempotent)."""
    _register_compile_backend()
    _register_process_group_backend(ext)
