"""The evaluation command lines' process-group scope: the layout a run config is evaluated under (the run's TP x
CP (x DP) under torchrun, TP = CP = 1 alone), its initialisation and its teardown."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

from nxd_lc.distributed import parallel_state as ps
from nxd_lc.runtime.device import init_distributed


def eval_layout(cfg: Any, world: int) -> Any:
    """The config with the layout to evaluate under: the run's TP x CP (x DP) under torchrun, TP = CP = 1 alone.

    Raises:
        ValueError: the launched world size is not a multiple of TP x CP (x PP must be 1).
    """
    ds = cfg.distributed_strategy
    if world == 1:
        ds = dataclasses.replace(ds, tensor_model_parallel_size=1, context_parallel_size=1, kv_replicator=1,
                                 sequence_parallel=False, pipeline_model_parallel_size=1)
        return dataclasses.replace(cfg, distributed_strategy=ds)
    mp = ds.tensor_model_parallel_size * ds.context_parallel_size
    if ds.pipeline_model_parallel_size != 1 or world % mp:
        raise ValueError(f"launched {world} processes for TP {ds.tensor_model_parallel_size} x CP "
                         f"{ds.context_parallel_size} x PP {ds.pipeline_model_parallel_size}; run with "
                         f"--nproc_per_node a multiple of TP x CP (PP must be 1), or as one process")
    return cfg


def init_eval_layout(cfg: Any) -> None:
    """Initialise the process group (CPU: gloo, a group of one without torchrun) and ``parallel_state`` at ``cfg``'s
    TP x CP layout (:func:`eval_layout`), with its context-parallel algorithm. The caller tears them down."""
    from nxd_lc.context.nki import resolve_kv_replica_layout

    init_distributed("cpu")
    ds = cfg.distributed_strategy
    ps.initialize_model_parallel(tensor_model_parallel_size=ds.tensor_model_parallel_size,
                                 context_parallel_size=ds.context_parallel_size, kv_replicator=ds.kv_replicator,
                                 kv_replica_layout=resolve_kv_replica_layout(ds.kv_replica_layout, "cpu",
                                                                            cfg.trainer.lnc))
    if ds.context_parallel_size > 1:
        from nxd_lc.context import set_context_parallel_algo

        set_context_parallel_algo(ds.context_parallel_algo)


@contextlib.contextmanager
def eval_session() -> Iterator[None]:
    """The evaluation CLIs' process-group scope: on leaving (also by an error) ``parallel_state`` is torn down, and
    the default process group if it was created inside the block."""
    import torch.distributed as dist

    created = not dist.is_initialized()
    try:
        yield
    finally:
        ps.destroy_model_parallel()
        if created and dist.is_initialized():
            dist.destroy_process_group()
