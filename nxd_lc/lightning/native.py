"""Lightning accelerator for an eager ``torch.accelerator`` device that Lightning has no accelerator for: TorchNeuron's
native ``neuron`` device (PrivateUse1; torch >= 2.10, Trn2/Trn3). One device per process, as torchrun launches it.

Lightning documents custom accelerators as the way to add a device (``pytorch_lightning.accelerators.Accelerator``);
this one speaks only ``torch.accelerator`` (device count, current index, memory statistics), so it names no device
type. It is selected by ``trainer.accelerator: neuron`` when :func:`nxd_lc.runtime.accel.native_neuron_available`
(:func:`nxd_lc.lightning.trainer._backend_kwargs`). Verified on CPU with the device mocked only: no Neuron hardware
has run it.
"""

from __future__ import annotations

from typing import Any, Union

import torch
from pytorch_lightning.accelerators import Accelerator
from pytorch_lightning.utilities.exceptions import MisconfigurationException

from nxd_lc.runtime import accel


class NxDDeviceAccelerator(Accelerator):
    """The current ``torch.accelerator`` device (e.g. ``neuron:<local_rank>``); one process per device."""

    def setup_device(self, device: torch.device) -> None:
        """Make ``device`` current.

        Raises:
            MisconfigurationException: ``device`` is not of the current accelerator's type.
        """
        expected = accel.current_accelerator_type()
        if device.type != expected:
            raise MisconfigurationException(f"NxDDeviceAccelerator: device {device} is not a {expected} device")
        if device.index is not None:
            torch.accelerator.set_device_index(device.index)

    def teardown(self) -> None:
        """Nothing to release (the process group is nxd_lc's, the device torch's)."""

    @staticmethod
    def parse_devices(devices: Union[int, str, list[int]]) -> list[int]:
        """``trainer.devices`` -> device indices on this node ('auto' / -1: all of them).

        Raises:
            ValueError: not a positive int, a digit string, 'auto', -1 or a non-empty list of indices.
        """
        count = NxDDeviceAccelerator.auto_device_count()
        if devices in ("auto", -1, "-1"):
            return list(range(count))
        if isinstance(devices, (list, tuple)) and devices:
            return [int(d) for d in devices]
        if isinstance(devices, str) and devices.strip().isdigit():
            devices = int(devices)
        if isinstance(devices, int) and not isinstance(devices, bool) and devices > 0:
            return list(range(devices))
        raise ValueError(f"trainer.devices: expected a positive number of devices per node, 'auto' or a list of "
                         f"device indices, got {devices!r}")

    @staticmethod
    def get_parallel_devices(devices: Union[int, str, list[int]]) -> list[torch.device]:
        """``torch.device(<accelerator type>, i)`` for each parsed index."""
        device_type = accel.current_accelerator_type() or accel.NEURON_DEVICE_TYPE
        return [torch.device(device_type, i) for i in NxDDeviceAccelerator.parse_devices(devices)]

    @staticmethod
    def auto_device_count() -> int:
        """``torch.accelerator.device_count()`` (0 without an accelerator)."""
        return torch.accelerator.device_count() if accel.current_accelerator_type() is not None else 0

    @staticmethod
    def is_available() -> bool:
        """True when a ``torch.accelerator`` device is present."""
        return accel.current_accelerator_type() is not None

    def get_device_stats(self, device: Union[str, torch.device]) -> dict[str, Any]:
        """``torch.accelerator.memory_stats(device)`` where the backend implements it, else ``{}``."""
        try:
            return dict(torch.accelerator.memory_stats(device))
        except (AttributeError, RuntimeError, NotImplementedError):
            return {}

    @staticmethod
    def name() -> str:
        """Registry name (not registered: pass an instance to the Trainer)."""
        return "nxd_device"
