"""Start-up in waves: ``trainer.sequential_move_factor`` (NxDT).

On a node of ``L`` ranks (``trainer.devices``), building the model and moving it to the device happens in
``ceil(L / f)`` waves of ``f = sequential_move_factor`` ranks: local ranks ``[w f, (w + 1) f)`` work in wave ``w``
while the others wait at a barrier. With ``use_cpu_initialization`` each rank first materialises full layer
weights on the host before keeping its shard, and on Trainium the host copy is freed once the model is on the
device, so at most ``f`` ranks of a node hold start-up host memory at the same time (NxD moves the model to the
XLA device in the same grouped order). Every rank passes the same number of barriers, so all nodes (same
``trainer.devices``) stay in step. ``None`` (the default) builds on every rank at once.

The wave barrier must really wait: torch-xla's process group returns from ``barrier`` at once (its
``ProcessGroupXla.barrier`` is a completed no-op), so on the ``xla`` backend the waves meet at
``xm.rendezvous`` instead, as Lightning's XLA strategy does. Written from torch-xla's source: multi-process XLA
cannot run on the development machines, so that branch is untested here.
"""

from __future__ import annotations

import logging
import math
from typing import Callable, Optional, TypeVar

from nxd_lc.distributed import collectives

T = TypeVar("T")
log = logging.getLogger(__name__)


def wave_of(local_rank: int, factor: Optional[int]) -> int:
    """The wave (0-based) in which local rank ``local_rank`` builds; 0 for every rank without a factor."""
    return 0 if not factor else local_rank // factor


def run_in_waves(fn: Callable[[], T], factor: Optional[int], local_rank: int, local_world_size: int) -> T:
    """Call ``fn`` on this rank in its wave (see the module docstring) and return its result.

    Collective over the world group (``ceil(local_world_size / factor)`` barriers on every rank).

    Raises:
        ValueError: ``factor`` < 1 (``trainer.sequential_move_factor``).
    """
    if factor is None:
        return fn()
    if factor < 1:
        raise ValueError(f"trainer.sequential_move_factor must be >= 1, got {factor}")
    waves = math.ceil(local_world_size / factor)
    result: Optional[T] = None
    for wave in range(waves):
        if wave == wave_of(local_rank, factor):
            log.info("sequential_move_factor %d: local rank %d builds its model in wave %d of %d", factor,
                     local_rank, wave + 1, waves)
            result = fn()
        _wave_barrier(wave)
    return result  # type: ignore[return-value]


def _wave_barrier(wave: int) -> None:
    """All ranks meet: ``dist.barrier`` (gloo / nccl), or ``xm.rendezvous`` on the xla backend (module doc)."""
    import torch.distributed as dist

    if dist.is_initialized() and str(dist.get_backend()) == "xla":
        import torch_xla.core.xla_model as xm

        xm.rendezvous(f"nxd_lc_startup_wave_{wave}")
        return
    collectives.barrier()
