"""Device backend selection and process-group start-up (cpu -> gloo, gpu -> nccl, xla/neuron -> xla).

``trainer.accelerator``: ``cpu``, ``gpu`` (CUDA), ``xla`` (torch-xla, any PJRT device: ``PJRT_DEVICE=CPU`` off
Trainium), ``neuron`` (xla plus the Neuron specifics; needs ``torch_neuronx``), ``auto`` (neuron when
``torch_neuronx`` imports, else gpu when CUDA is available, else cpu). An XLA run of one process uses a gloo
group of one for host-side coordination (no collective crosses devices); several processes use torch-xla's
``xla`` process group.

nxd_lc initialises ``torch.distributed`` itself, before the model is built (the fixed assembly order of
DESIGN.md principle 4); Lightning's strategy then finds the group already initialised. Multi-process runs are
launched by ``torchrun``, which sets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT.
"""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from nxd_lc.config.validate import ConfigError
from nxd_lc.distributed import collectives
from nxd_lc.runtime import xla as xla_runtime


@dataclass(frozen=True)
class RuntimeInfo:
    """Where this process runs."""

    accelerator: str  # 'cpu' | 'gpu' | 'xla' | 'neuron'
    device: torch.device  # the device tensors of this rank live on
    backend: str  # process-group backend: 'gloo' | 'nccl' | 'xla'
    rank: int  # global rank
    local_rank: int  # rank within the node
    world_size: int  # number of processes


def is_xla_accelerator(accelerator: str) -> bool:
    """True for the lazy-tensor accelerators ('xla', 'neuron')."""
    return accelerator in ("xla", "neuron")


def resolve_accelerator(name: str) -> str:
    """``trainer.accelerator`` -> 'cpu' | 'gpu' | 'xla' | 'neuron' ('auto': neuron, then gpu, then cpu).

    Raises:
        ConfigError: 'gpu' without CUDA, 'xla' without torch-xla, 'neuron' without torch-neuronx.
    """
    if name == "auto":
        if xla_runtime.neuron_available():
            return "neuron"
        return "gpu" if torch.cuda.is_available() else "cpu"
    if name == "gpu" and not torch.cuda.is_available():
        raise ConfigError(["trainer.accelerator: 'gpu' requested but CUDA is not available; use 'cpu' or 'auto'"])
    if name == "xla" and not xla_runtime.torch_xla_available():
        raise ConfigError(["trainer.accelerator: 'xla' requested but torch_xla does not import; install the xla "
                           "extra (pip install -c constraints-xla.txt -e '.[xla]', torch 2.9) or use 'cpu'"])
    if name == "neuron" and not xla_runtime.neuron_available():
        raise ConfigError(["trainer.accelerator: 'neuron' requested but torch_neuronx does not import (the PyPI "
                           "package is a placeholder; install the Neuron SDK); use 'xla' for plain torch-xla"])
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
        accelerator: 'cpu', 'gpu', 'xla' or 'neuron' (already resolved).
        timeout_s: collective timeout, seconds.
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
        backend = collectives.default_backend("xla") if world > 1 else collectives.default_backend("cpu")
        if not dist.is_initialized():
            init_method = "xla://" if backend == "xla" else None
            dist.init_process_group(backend=backend, init_method=init_method, rank=rank, world_size=world,
                                    timeout=timeout)
        return RuntimeInfo(accelerator, device, backend, rank, local_rank, world)
    device_type = "cuda" if accelerator == "gpu" else "cpu"
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    backend = collectives.default_backend(device_type)
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, rank=rank, world_size=world, timeout=timeout)
    return RuntimeInfo(accelerator, device, backend, rank, local_rank, world)
