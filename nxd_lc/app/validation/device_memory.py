"""How much memory one rank's device has, as the dry run knows it before launch (:func:`device_memory`): this
host's RAM per rank on ``cpu``, the CUDA device's total memory, and a NeuronCore's HBM on ``xla`` / ``neuron``
(:func:`neuron_core_memory`). :mod:`nxd_lc.app.validation.memory` judges its estimate against it."""

from __future__ import annotations

import os

from nxd_lc.config.schema import NxdConfig

__all__ = ["NEURON_HBM_PER_CORE", "device_memory", "host_memory", "neuron_core_memory"]

_GIB = 2**30
#: HBM per *physical* NeuronCore (bytes), the chip's HBM over its NeuronCores: Trn1 32 GiB per Trainium chip of 2
#: NeuronCore-v2 = 16 GiB, Trn2 96 GiB per Trainium2 chip of 8 NeuronCore-v3 = 12 GiB, Trn3 144 GiB per Trainium3
#: chip of 8 NeuronCore-v4 = 18 GiB. Source: the Neuron documentation's architecture pages
#: (about-neuron/arch/neuron-hardware/trainium, trainium2, trainium3; re-read 2026-12-01,
#: ../shared/reference/neuron_platform.md). A rank runs on one logical NeuronCore of ``lnc`` physical ones and has
#: this x lnc (:func:`neuron_core_memory`): 24 GiB at Trn2's default lnc 2, 36 GiB on Trn3.
NEURON_HBM_PER_CORE = {"trn1": 16 * _GIB, "trn2": 12 * _GIB, "trn3": 18 * _GIB}


def host_memory() -> int | None:
    """This host's physical memory in bytes (None where the system does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def device_memory(cfg: NxdConfig) -> tuple[int | None, str]:
    """``(bytes available to one rank, what it is)``; None where the dry run cannot know (module docstring).

    ``cpu``: this host's RAM over ``trainer.devices``; ``xla`` / ``neuron`` (and ``auto`` resolving to a Neuron
    device on this host): :func:`neuron_core_memory`; ``gpu`` (and ``auto`` resolving to CUDA): the CUDA device's
    total memory."""
    from nxd_lc.runtime.device import is_lazy_config_accelerator, neuron_resolution

    name = str(cfg.trainer.accelerator)
    if name == "cpu":
        ram = host_memory()
        if ram is None:
            return None, "host memory not readable on this system"
        ranks = max(1, cfg.trainer.devices)
        return ram // ranks, f"this host's memory shared by trainer.devices={ranks} ranks"
    if is_lazy_config_accelerator(name):
        return neuron_core_memory(cfg, native=False)
    if name in ("neuron", "auto") and neuron_resolution() == "neuron_native":
        return neuron_core_memory(cfg, native=True)
    if name in ("gpu", "auto"):
        import torch

        if torch.cuda.is_available() and (name == "gpu" or _auto_is_gpu()):
            # the total (not the currently free) memory, from the device properties: no CUDA context is created
            props = torch.cuda.get_device_properties(0)
            return int(props.total_memory), f"CUDA device memory ({props.name})"
        if name == "auto":
            return None, "trainer.accelerator auto: the run's device is not known on this host"
    return None, f"trainer.accelerator {name}: no device memory size is known before launch"


def neuron_core_memory(cfg: NxdConfig, native: bool) -> tuple[int | None, str]:
    """``(HBM bytes of the logical NeuronCore one rank runs on, what it is)`` (None for a platform whose HBM is not
    in :data:`NEURON_HBM_PER_CORE`).

    One rank per logical NeuronCore of ``lnc`` physical cores (:func:`nxd_lc.context.nki.resolve_lnc`); its HBM is
    :data:`NEURON_HBM_PER_CORE` (per physical core) x lnc: 16 GiB on Trn1 (lnc 1 only), 12 GiB x lnc on Trn2
    (24 GiB at its default lnc 2), 18 GiB x lnc on Trn3 (36 GiB at lnc 2).

    The platform, before launch: the one torch-neuronx reports on this host (a Trainium instance,
    :func:`~nxd_lc.context.nki.neuron_platform`); else Trn2 when the logical NeuronCore size is 2
    (``trainer.lnc`` / ``NEURON_LOGICAL_NC_CONFIG``: it exists only on Trn2 / Trn3 and Trn1 is the other training
    platform of torch-xla); else, on TorchNeuron's native device (``native``: Trn2 / Trn3 only), Trn2's 12 GiB x
    lnc, the smaller of the two at any lnc; else Trn1, torch-xla's Neuron training platform (a config dry-run off
    Trainium for torch-xla is judged as on Trn1; ``trainer.lnc: 2`` says Trn2).
    """
    from nxd_lc.context.nki import neuron_platform, resolve_lnc

    detected = neuron_platform()
    try:
        lnc = resolve_lnc(cfg.trainer.lnc)
    except ValueError:  # an lnc the NKI rules refuse (reported where the kernel is built): the configured value
        lnc = cfg.trainer.lnc or 1
    if detected is not None:
        platform, how = detected, "the platform torch-neuronx reports"
    elif lnc == 2:
        platform, how = "trn2", "Trn2: the logical NeuronCore size (trainer.lnc / NEURON_LOGICAL_NC_CONFIG) is 2"
    elif native:  # the smaller of the two per logical core at any lnc (12 < 18 GiB per physical core)
        platform, how = "trn2", "TorchNeuron's native device runs on Trn2 / Trn3: Trn2's is the smaller"
    else:
        platform, how = "trn1", "Trn1 assumed off Trainium; trainer.lnc=2 means Trn2"
    per_core = NEURON_HBM_PER_CORE.get(platform)
    if per_core is None:  # a platform torch-neuronx reports that nxd_lc does not know
        return None, f"{platform}: its HBM per NeuronCore is not known to nxd_lc"
    cores = f", lnc {lnc}" if platform != "trn1" else ""
    return per_core * (lnc if platform != "trn1" else 1), f"a {platform.capitalize()} NeuronCore's HBM{cores} ({how})"


def _auto_is_gpu() -> bool:
    from nxd_lc.runtime.device import resolve_accelerator

    try:
        return resolve_accelerator("auto") == "gpu"
    except (ValueError, RuntimeError):
        return False
