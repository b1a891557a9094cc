"""Device backend selection and process-group start-up (cpu -> gloo, gpu -> nccl, xla -> xla, native
neuron -> neuron).

``trainer.accelerator``: ``cpu``, ``gpu`` (CUDA), ``xla`` (torch-xla, any PJRT device: ``PJRT_DEVICE=CPU`` off
Trainium), ``neuron``, ``auto`` (neuron when ``torch_neuronx`` imports, else gpu when CUDA is available, else
cpu). ``neuron`` resolves by the installed stack (:func:`resolve_accelerator`):

* ``neuron_native``: torch >= 2.10 whose ``torch_neuronx`` registers the PrivateUse1 device ``neuron``
  (TorchNeuron, Trn2/Trn3): an eager device like CUDA, process-group backend ``neuron``
  (:mod:`nxd_lc.runtime.accel`);
* ``neuron``: torch <= 2.9 with the torch-xla based ``torch_neuronx`` (Trn1's last training stack): the XLA
  path plus the Neuron specifics.

An XLA run of one process uses a gloo group of one for host-side coordination (no collective crosses devices);
several processes use torch-xla's ``xla`` process group.

nxd_lc initialises ``torch.distributed`` itself, before the model is built (the fixed assembly order of
DESIGN.md principle 4); Lightning's strategy then finds the group already initialised. Multi-process runs are
launched by ``torchrun``, which sets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT.
"""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from nxd_lc.config.errors import ConfigError
from nxd_lc.runtime import accel
from nxd_lc.runtime import xla as xla_runtime

#: ``trainer.accelerator`` values (:func:`resolve_accelerator`).
ACCELERATORS = ("auto", "cpu", "gpu", "xla", "neuron")


@dataclass(frozen=True)
class RuntimeInfo:
    """Where this process runs."""

    accelerator: str  # 'cpu' | 'gpu' | 'xla' | 'neuron' (torch-xla based) | 'neuron_native' (PrivateUse1)
    device: torch.device  # the device tensors of this rank live on
    backend: str  # process-group backend: 'gloo' | 'nccl' | 'xla' | 'neuron'
    rank: int  # global rank
    local_rank: int  # rank within the node
    world_size: int  # number of processes


def is_xla_accelerator(accelerator: str) -> bool:
    """True for the lazy-tensor accelerators: 'xla' and the torch-xla based 'neuron' (not 'neuron_native')."""
    return accelerator in ("xla", "neuron")


def has_device_memory(accelerator: str) -> bool:
    """Whether a resolved ``trainer.accelerator`` computes in memory of its own, apart from the host's (everything
    but ``cpu``): moving activations to the host frees something there only then."""
    return accelerator != "cpu"


def neuron_resolution() -> Optional[str]:
    """What ``trainer.accelerator: neuron`` means on this host: 'neuron_native' (TorchNeuron's PrivateUse1
    device, torch >= 2.10), 'neuron' (torch-xla based torch-neuronx), or None (no usable torch-neuronx)."""
    if accel.native_neuron_available():
        return "neuron_native"
    return "neuron" if xla_runtime.neuron_available() else None


def is_lazy_config_accelerator(name: str) -> bool:
    """True when ``trainer.accelerator: name`` runs on torch-xla's lazy tensors on this host: 'xla', 'neuron'
    unless the native device is present, 'auto' when it resolves to the torch-xla based neuron."""
    if name == "xla":
        return True
    if name in ("neuron", "auto"):
        return neuron_resolution() == "neuron" or (name == "neuron" and neuron_resolution() is None)
    return False


def config_runtime(name: str) -> str:
    """What ``trainer.accelerator: name`` runs on at this host, decided without starting anything (dry run,
    environment table): ``'torch_xla'`` (:func:`is_lazy_config_accelerator`: xla, or the torch-xla based Neuron),
    ``'neuron_native'`` (TorchNeuron's PrivateUse1 device, for ``neuron`` / ``auto`` where it is present) or
    ``'host'`` (cpu, gpu, and ``auto`` resolving to either)."""
    if is_lazy_config_accelerator(name):
        return "torch_xla"
    if name in ("neuron", "auto") and neuron_resolution() == "neuron_native":
        return "neuron_native"
    return "host"


def resolve_accelerator(name: str) -> str:
    """``trainer.accelerator`` -> 'cpu' | 'gpu' | 'xla' | 'neuron' | 'neuron_native'.

    'auto': neuron (native first, then torch-xla based), then gpu (CUDA), then cpu. 'neuron':
    :func:`neuron_resolution`.

    Raises:
        ConfigError: 'gpu' without CUDA, 'xla' without torch-xla, 'neuron' without a usable torch-neuronx.
    """
    if name == "auto":
        neuron = neuron_resolution()
        if neuron is not None:
            return neuron
        return "gpu" if torch.cuda.is_available() else "cpu"
    if name == "gpu" and not torch.cuda.is_available():
        raise ConfigError(["trainer.accelerator: 'gpu' requested but CUDA is not available; use 'cpu' or 'auto'"])
    if name == "xla" and not xla_runtime.torch_xla_available():
        raise ConfigError(["trainer.accelerator: 'xla' requested but torch_xla does not import; install the xla "
                           "extra (pip install -c constraints-xla.txt -e '.[xla]', torch 2.9) or use 'cpu'"])
    if name == "neuron":
        neuron = neuron_resolution()
        if neuron is None:
            raise ConfigError(["trainer.accelerator: 'neuron' requested but torch_neuronx does not import (the PyPI "
                               "package is a placeholder; install the Neuron SDK: torch-neuronx >= 2.10 for the "
                               "native device on Trn2/Trn3, torch-neuronx 2.9 + torch-xla on Trn1); use 'xla' "
                               "for plain torch-xla"])
        return neuron
    return name


def launched_world_size() -> int:
    """WORLD_SIZE set by torchrun, or 1 for a plain ``python train.py``."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_distributed(accelerator: str, timeout_s: float = 1800.0) -> RuntimeInfo:
    """Initialise the default process group from torchrun's environment (a 1-process group without torchrun).

    Args:
        accelerator: 'cpu', 'gpu', 'xla', 'neuron' or 'neuron_native' (already resolved).
        timeout_s: collective timeout, seconds.

    Raises:
        RuntimeError: an accelerator run whose LOCAL_RANK has no device (:func:`accel.accelerator_device`).
        ValueError: no process-group backend is registered for the device type.
    """
    if "RANK" not in os.environ:  # plain `python train.py`: a group of one, as Lightning would make
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    timeout = datetime.timedelta(seconds=timeout_s)
    if is_xla_accelerator(accelerator):
        device = xla_runtime.xla_device()
        # one process: a host-side group of one (every collective is a no-op); several: torch-xla's group
        backend = default_backend("xla") if world > 1 else default_backend("cpu")
        if not dist.is_initialized():
            init_method = "xla://" if backend == "xla" else None
            dist.init_process_group(backend=backend, init_method=init_method, rank=rank, world_size=world,
                                    timeout=timeout)
        return RuntimeInfo(accelerator, device, backend, rank, local_rank, world)
    # gpu / neuron_native: the torch.accelerator device of this local rank (CUDA, or TorchNeuron's 'neuron')
    device = accel.HOST if accelerator == "cpu" else accel.accelerator_device(local_rank)
    backend = default_backend(device.type)
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, rank=rank, world_size=world, timeout=timeout)
    return RuntimeInfo(accelerator, device, backend, rank, local_rank, world)


def default_backend(device_type: str) -> str:
    """Return the torch.distributed backend for a device type: ``'xla'`` for xla (registers torch-xla's backend
    with torch.distributed first), else the backend torch registers for it (``'gloo'`` for cpu, ``'nccl'`` for
    cuda, ``'neuron'`` for TorchNeuron's device: :func:`nxd_lc.runtime.accel.process_group_backend`).

    Raises:
        ValueError: no backend is registered for the device type.
        ModuleNotFoundError: ``'xla'`` without torch-xla installed.
    """
    if device_type == "xla":
        return xla_runtime.xla_process_group_backend()
    try:
        return accel.process_group_backend(device_type)
    except ValueError as e:
        raise ValueError(f"default_backend: unsupported device type {device_type!r}: {e}") from None
