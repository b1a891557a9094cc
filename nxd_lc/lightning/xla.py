"""Lightning accelerator, precision plugin and strategy for torch-xla (Trainium via torch-neuronx, or XLA-CPU).

Lightning's stock ``XLAAccelerator`` probes for a TPU (and fails on ``PJRT_DEVICE=CPU``), and its
``XLAStrategy`` spawns its own processes, broadcasts rank 0's parameters (which would overwrite tensor-parallel
shards), reduces gradients with ``xm.reduce_gradients`` over all devices and cuts graphs in several places. The
classes here keep Lightning's XLA code paths that matter (``torch.no_grad`` instead of inference mode in
evaluation, XLA type checks) and replace the rest with nxd_lc's conventions:

* processes come from ``torchrun`` (or are one plain process); the process group and ``parallel_state`` exist
  before the Trainer (:func:`nxd_lc.runtime.device.init_distributed`), one XLA device per process;
* gradients are reduced explicitly by the LightningModule (DP mean, SP norms over TP, KV replicas), so the
  precision plugin's optimizer step is a plain ``optimizer.step(closure)``;
* the lazy graph is cut only at the module's step boundaries
  (:meth:`nxd_lc.lightning.module.NxDLanguageModel._step_boundary` -> :func:`nxd_lc.runtime.xla.sync`); in
  particular no ``MpDeviceLoader`` (which cuts a graph per batch): batches are moved by the strategy;
* checkpoints are NxD's sharded layout (:class:`nxd_lc.lightning.strategy.NxDStrategy`), written from CPU copies.

Works with pytorch-lightning 2.6 and torch-xla 2.9 (``PJRT_DEVICE=CPU`` off Trainium).
"""

from __future__ import annotations

import os
from collections.abc import Generator
from contextlib import contextmanager
from functools import partial
from typing import Any, Callable, Optional, Union

import pytorch_lightning as pl
import torch
from lightning_fabric.plugins.environments import LightningEnvironment, TorchElasticEnvironment
from lightning_utilities.core.apply_func import apply_to_collection
from pytorch_lightning.accelerators.xla import XLAAccelerator
from pytorch_lightning.plugins.precision.xla import XLAPrecision
from pytorch_lightning.strategies import XLAStrategy
from pytorch_lightning.utilities.exceptions import MisconfigurationException

from nxd_lc.lightning.strategy import NxDStrategy
from nxd_lc.runtime import xla as xla_runtime


class NxDXLAAccelerator(XLAAccelerator):
    """``XLAAccelerator`` that works on any PJRT device (CPU included): one XLA device per process."""

    @staticmethod
    def is_available() -> bool:
        """True when torch-xla imports (the PJRT device kind is torch-xla's business: PJRT_DEVICE)."""
        return xla_runtime.torch_xla_available()

    @staticmethod
    def auto_device_count() -> int:
        """Processes (= XLA devices) on this node: torchrun's LOCAL_WORLD_SIZE, 1 without torchrun."""
        return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))

    @staticmethod
    def parse_devices(devices: Union[int, str, list[int]]) -> int:
        """``trainer.devices`` -> number of processes on this node.

        Raises:
            ValueError: not a positive int, a digit string, 'auto', or a list of device indices.
        """
        if devices == "auto":
            return NxDXLAAccelerator.auto_device_count()
        if isinstance(devices, (list, tuple)) and devices:
            return len(devices)
        if isinstance(devices, str) and devices.strip().isdigit():
            devices = int(devices)
        if isinstance(devices, int) and not isinstance(devices, bool) and devices > 0:
            return devices
        raise ValueError(f"trainer.devices: expected a positive number of XLA devices per node, got {devices!r}")

    @staticmethod
    def get_parallel_devices(devices: Union[int, str, list[int]]) -> list[torch.device]:
        """Placeholders ``xla:i`` for the node's processes (each process's real device is its own ``xla:0``)."""
        return [torch.device("xla", i) for i in range(NxDXLAAccelerator.parse_devices(devices))]

    @staticmethod
    def name() -> str:
        """Registry name (not registered: pass an instance to the Trainer)."""
        return "nxd_xla"


class NxDXLAPrecision(XLAPrecision):
    """fp32 XLA precision whose optimizer step neither reduces gradients nor cuts the graph.

    Gradient reduction is the module's (``on_before_optimizer_step``), the graph cut the module's step boundary.
    With ``autocast`` the forward runs under ``torch.autocast('xla', bfloat16)`` (``precision.type: autocast``).
    bf16 parameters are explicit casts (:func:`nxd_lc.precision.apply_precision`), not this plugin's and not torch-xla's
    ``XLA_USE_BF16`` / ``XLA_DOWNCAST_BF16``, which the run sets to 0 (:mod:`nxd_lc.runtime.env`).
    """

    def __init__(self, autocast: bool = False) -> None:
        super().__init__("32-true")
        self.autocast = autocast

    @contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        """``torch.autocast('xla', bfloat16)`` around forward/loss for ``precision.type: autocast``."""
        if not self.autocast:
            yield
            return
        with torch.autocast("xla", dtype=torch.bfloat16):
            yield

    def optimizer_step(self, optimizer: Any, model: pl.LightningModule, closure: Callable[[], Any],
                       **kwargs: Any) -> Any:
        """``optimizer.step(closure)`` with Lightning's closure wrapping (runs ``on_before_optimizer_step``).

        Raises:
            MisconfigurationException: ``training_step`` returned None under automatic optimization.
        """
        closure = partial(self._wrap_closure, model, optimizer, closure)
        result = optimizer.step(closure=closure, **kwargs)
        if model.automatic_optimization and result is None:
            raise MisconfigurationException("training_step returned None: skipping a step is not supported on "
                                            "XLA (it would change the graph); return the loss")
        return result

    def teardown(self) -> None:
        """Leave XLA_USE_BF16 / XLA_DOWNCAST_BF16 alone: they belong to the run's environment table."""


def _to_cpu(t: torch.Tensor) -> torch.Tensor:
    return t.cpu() if t.device.type == "xla" else t


class NxDXLAStrategy(NxDStrategy, XLAStrategy):
    """:class:`NxDStrategy` (NxD checkpoints, explicit gradient reduction) on an XLA device.

    Args:
        save_xser / load_xser / save_bf16 / zero1 / use_master_weights_in_ckpt / lora_only: as
            :class:`NxDStrategy`.
        **kwargs: passed on (accelerator, parallel_devices, ...).
    """

    strategy_name = "nxd_xla"

    def __init__(self, *, save_xser: bool = True, load_xser: bool = True, save_bf16: bool = False,
                 zero1: bool = False, use_master_weights_in_ckpt: bool = False, lora_only: bool = False,
                 **kwargs: Any) -> None:
        xla_runtime.require_torch_xla("NxDXLAStrategy")
        super().__init__(save_xser=save_xser, load_xser=load_xser, save_bf16=save_bf16, zero1=zero1,
                         use_master_weights_in_ckpt=use_master_weights_in_ckpt, lora_only=lora_only,
                         sync_module_states=False, **kwargs)
        # torchrun (or the single-process variables set by init_distributed), not XLA's own launcher
        self.cluster_environment = (TorchElasticEnvironment() if TorchElasticEnvironment.detect()
                                    else LightningEnvironment())

    def _configure_launcher(self) -> None:
        self._launcher = None  # processes are started by torchrun, not spawned by Lightning

    @property
    def root_device(self) -> torch.device:
        """This process's XLA device."""
        return xla_runtime.xla_device()

    def setup_distributed(self) -> None:
        """World ranks from the cluster environment; the process group already exists (init_distributed)."""
        super(XLAStrategy, self).setup_distributed()

    def set_world_ranks(self) -> None:
        """Global rank / world size from torchrun's variables (Lightning's DDP logic)."""
        super(XLAStrategy, self).set_world_ranks()

    def process_dataloader(self, dataloader: object) -> object:
        """The loader unchanged: batches are moved by ``batch_to_device`` (MpDeviceLoader would cut graphs)."""
        return dataloader

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Rank ``src``'s ``obj`` on every rank, exchanged on the host (``xm.mesh_reduce`` of pickled CPU copies);
        identity for one process.

        Lightning's ``XLAStrategy.broadcast`` pickles the object into a device tensor and broadcasts that: the
        tensor's size is each rank's own pickle's, so ranks whose objects differ (what a broadcast is for) trace
        different graphs, and on XLA a collective whose ranks run different graphs hangs (seen on the multi-device
        test bed when a run resumes). A tensor comes back on its original device.
        """
        if self.world_size == 1:
            return obj
        import torch_xla.core.xla_model as xm

        device = obj.device if isinstance(obj, torch.Tensor) else None
        value = xm.mesh_reduce("nxd_lc_broadcast", obj if self.global_rank == src else None, lambda objs: objs[src])
        return value.to(device) if device is not None else value

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """Host-side vote (``xm.mesh_reduce`` over Python ints): no device tensor, no graph."""
        if self.world_size == 1:
            return decision
        import torch_xla.core.xla_model as xm

        votes = xm.mesh_reduce("nxd_lc_bool_decision", int(bool(decision)), sum)
        return votes == self.world_size if all else votes > 0

    def barrier(self, name: Optional[str] = None, *args: Any, **kwargs: Any) -> None:
        """``xm.rendezvous`` across processes; nothing for one process."""
        if self.world_size > 1:
            super().barrier(name, *args, **kwargs)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any,
                        storage_options: Optional[Any] = None) -> None:
        """NxD sharded save of CPU copies of the state (the step boundary has already computed them)."""
        checkpoint = apply_to_collection(checkpoint, torch.Tensor, _to_cpu)
        super().save_checkpoint(checkpoint, filepath, storage_options)
