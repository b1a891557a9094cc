"""Device backend selection and process-group start-up (cpu -> gloo, gpu -> nccl).

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


@dataclass(frozen=True)
class RuntimeInfo:
    """Where this process runs."""

    accelerator: str  # 'cpu' | 'gpu'
    device: torch.device  # the device tensors of this rank live on
    backend: str  # process-group backend: 'gloo' | 'nccl'
    rank: int  # global rank
    local_rank: int  # rank within the node
    world_size: int  # number of processes


def resolve_accelerator(name: str) -> str:
    """``trainer.accelerator`` -> 'cpu' or 'gpu' ('auto' picks gpu when CUDA is available).

    Raises:
        ConfigError: 'gpu' requested without CUDA.
    """
    if name == "auto":
        return "gpu" if torch.cuda.is_available() else "cpu"
    if name == "gpu" and not torch.cuda.is_available():
        raise ConfigError(["trainer.accelerator: 'gpu' requested but CUDA is not available; use 'cpu' or 'auto'"])
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
        accelerator: 'cpu' or 'gpu' (already resolved).
        timeout_s: collective timeout, seconds.
    """
    if "RANK" not in os.environ:  # plain `python train.py`: a group of one, as Lightning would make
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device_type = "cuda" if accelerator == "gpu" else "cpu"
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    backend = collectives.default_backend(device_type)
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s))
    return RuntimeInfo(accelerator, device, backend, rank, local_rank, world)
