"""Device-agnostic accelerator helpers: which accelerator this process has, its device, backend and RNG.

nxd_lc's model and runtime code names no accelerator device type (no ``"cuda"`` literal): the accelerator comes
from ``torch.accelerator`` (torch >= 2.6; nxd_lc needs >= 2.9), which reports CUDA, XPU, and out-of-tree
PrivateUse1 backends alike. Host memory is :data:`HOST`: nxd_lc computes a few things there on purpose
(RoPE frequency tables and full-size initialisation masters, bit-identical on every device; checkpoint files).

The native Neuron device ("TorchNeuron", ``torch-neuronx`` >= 2.10 on Trn2/Trn3; public beta in Neuron SDK 2.33
with torch 2.13/2.14) registers Trainium through PyTorch's PrivateUse1 mechanism as device type ``neuron``, with
the process-group backend ``neuron`` and ``torch.compile(backend="neuron")`` (AWS Neuron documentation, "What is
TorchNeuron?" and "How to use torch.distributed on Neuron", 2026). Older ``torch-neuronx`` (torch <= 2.9) is
torch-xla based: :mod:`nxd_lc.runtime.xla`. Nothing here has run on Neuron hardware; the selection logic is
tested with the detection mocked (tests/test_accelerator.py).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import logging
from collections.abc import Iterator
from typing import Optional

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

HOST = torch.device("cpu")  # host memory (not an accelerator choice: where host-side tables and files live)
NEURON_DEVICE_TYPE = "neuron"  # TorchNeuron's PrivateUse1 device type
NATIVE_NEURON_MIN_TORCH = (2, 10)  # the first torch with a native (non-XLA) torch-neuronx


def torch_version() -> tuple[int, int]:
    """(major, minor) of the running torch, e.g. (2, 13) for ``2.13.0+cpu``."""
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def current_accelerator_type() -> Optional[str]:
    """The device type of this process's accelerator (``'cuda'``, ``'xpu'``, ``'neuron'``, ...), or None.

    ``torch.accelerator.current_accelerator()`` (torch >= 2.6); a torch without it falls back to CUDA's probe.
    torch-xla's lazy ``xla`` device is not a ``torch.accelerator`` (see :mod:`nxd_lc.runtime.xla`).
    """
    acc = getattr(torch, "accelerator", None)
    if acc is not None and hasattr(acc, "current_accelerator"):
        if not acc.is_available():
            return None
        dev = acc.current_accelerator()
        return None if dev is None else dev.type
    return "cuda" if torch.cuda.is_available() else None  # torch < 2.6 (not supported, kept for safety)


def _torch_neuronx_imports() -> bool:
    if importlib.util.find_spec("torch_neuronx") is None:
        return False
    try:
        importlib.import_module("torch_neuronx")  # registers the PrivateUse1 'neuron' device on torch >= 2.10
    except (ImportError, RuntimeError, OSError):  # PyPI's placeholder raises ImportError
        return False
    return True


@functools.lru_cache(maxsize=1)
def native_neuron_available() -> bool:
    """True when the native Neuron device is usable: torch >= 2.10, ``torch_neuronx`` imports, and the current
    ``torch.accelerator`` is the PrivateUse1 device type ``neuron``. False on every torch-xla based stack."""
    if torch_version() < NATIVE_NEURON_MIN_TORCH:
        return False
    return _torch_neuronx_imports() and current_accelerator_type() == NEURON_DEVICE_TYPE


def compiles_per_shape(device: torch.device) -> bool:
    """True on TorchNeuron's native device (type ``neuron``): eager, but each ATen op is compiled per (op, dtype,
    shape) and cached (Neuron documentation, "What is TorchNeuron?"), so code that would give an op a data-dependent
    shape (a per-document attention split, a host read deciding a size) takes the fixed-shape path there, as on
    torch-xla. False elsewhere (CPU and CUDA run any shape at no extra cost; XLA is decided by its own checks)."""
    return device.type == NEURON_DEVICE_TYPE


def accelerator_device(local_rank: int) -> torch.device:
    """Select and return this process's accelerator device, index ``local_rank`` (one device per process).

    Raises:
        RuntimeError: no ``torch.accelerator`` is available, or ``local_rank`` is not below its device count.
    """
    device_type = current_accelerator_type()
    if device_type is None:
        raise RuntimeError("no accelerator is available (torch.accelerator.is_available() is False)")
    count = torch.accelerator.device_count()
    if local_rank >= count:
        raise RuntimeError(f"LOCAL_RANK {local_rank} but this node has {count} {device_type} device(s); launch at "
                           f"most {count} processes per node (torchrun --nproc_per_node)")
    torch.accelerator.set_device_index(local_rank)
    return torch.device(device_type, local_rank)


def current_device() -> torch.device:
    """The current accelerator device (after :func:`accelerator_device`), else :data:`HOST`."""
    device_type = current_accelerator_type()
    if device_type is None:
        return HOST
    return torch.device(device_type, torch.accelerator.current_device_index())


def process_group_backend(device_type: str) -> str:
    """The torch.distributed backend registered for ``device_type`` (``cpu`` -> gloo, ``cuda`` -> nccl, and a
    PrivateUse1 backend's own, e.g. ``neuron`` -> ``neuron`` once ``torch_neuronx`` is imported), read from
    ``torch.distributed.Backend.default_device_backend_map``.

    Raises:
        ValueError: no backend is registered for that device type.
    """
    backend = dist.Backend.default_device_backend_map.get(device_type)
    if backend is None or backend == "fake":
        raise ValueError(f"no torch.distributed backend is registered for device type {device_type!r} "
                         f"(registered: {dict(dist.Backend.default_device_backend_map)})")
    return str(backend)


@contextlib.contextmanager
def fork_accelerator_rng(enabled: bool = True) -> Iterator[None]:
    """``torch.random.fork_rng`` over the CPU RNG and every device RNG of this process's accelerator (if any):
    the RNG state is restored on exit, so a draw inside does not shift the run's random stream."""
    device_type = current_accelerator_type()
    if device_type is None:
        with torch.random.fork_rng(devices=[], enabled=enabled):
            yield
        return
    devices = list(range(torch.accelerator.device_count()))
    with torch.random.fork_rng(devices=devices, enabled=enabled, device_type=device_type):
        yield
