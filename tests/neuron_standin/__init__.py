"""A stand-in for TorchNeuron's native ``neuron`` device (issue 51), for tests: a PrivateUse1 backend renamed
``neuron`` whose memory is host memory and whose kernels are the CPU's (``standin.cpp``, built here with
``torch.utils.cpp_extension`` and cached per torch version under ``$NXD_LC_STANDIN_CACHE`` or the checkout's
``.cache/neuron_standin``, git-ignored: a fresh clone builds it once, ~50 s of one core), registered as a device
module, so that ``torch.accelerator`` reports it,
``.to("neuron")`` makes tensors of device type ``neuron``, ``torch.autocast("neuron")`` works and the RNG calls reach
it; plus a process-group backend named ``neuron`` (gloo underneath, on the same host memory) and a
``torch.compile`` backend named ``neuron`` (``aot_eager`` underneath).

What it shows: that a path runs on a device whose type is neither ``cpu``, ``cuda`` nor ``xla`` (device moves,
parameter attributes, dtypes under autocast, RNG, collectives on device tensors, host <-> device copies, the ops a
step runs). What it cannot show: Neuron's compiler, its memory, its speed, which ops TorchNeuron runs natively and
which it falls back to the CPU for (here every op but factories, copies and views is a counted CPU fallback), its
kernels' numerics.

Use :func:`install` (idempotent) in a process that has not used another PrivateUse1 backend; the package
``tests/neuron_standin/pkgs/torch_neuronx`` does it on import, so ``PYTHONPATH=tests/neuron_standin/pkgs`` makes
nxd_lc find "TorchNeuron" as it would on Trn2 (:func:`nxd_lc.runtime.accel.native_neuron_available`).
"""

from __future__ import annotations

import os
import re
import threading
import time
import types
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "standin.cpp"
DEVICE = "neuron"
#: a PYTHONPATH entry whose ``torch_neuronx`` package installs the stand-in on import
PKGS = HERE / "pkgs"

_LOCK = threading.Lock()
_EXT: Any = None
BUILD_SECONDS: float | None = None  # how long this process's build (or cache load) took


def build_dir() -> Path:
    """The extension's build directory: one per torch version (torch's own JIT cache is keyed on the sources and
    flags, not the torch version)."""
    root = Path(os.environ.get("NXD_LC_STANDIN_CACHE", HERE.parent.parent / ".cache" / "neuron_standin"))
    return root / re.sub(r"[^0-9A-Za-z_.]", "_", torch.__version__)


def _build() -> Any:
    from torch.utils.cpp_extension import load

    global BUILD_SECONDS
    out = build_dir()
    out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    ext = load(name="nxd_lc_neuron_standin", sources=[str(SOURCE)], build_directory=str(out),
               extra_cflags=["-O1"], verbose=False)
    BUILD_SECONDS = time.monotonic() - start
    return ext


def _device_module(ext: Any) -> types.ModuleType:
    """``torch.neuron``: what torch's device-generic code calls on a PrivateUse1 device module."""
    mod = types.ModuleType("torch.neuron")

    def current_device() -> int:
        return int(torch.accelerator.current_device_index()) if hasattr(torch, "accelerator") else 0

    def set_device(device: Any) -> None:
        index = torch.device(device).index if not isinstance(device, int) else device
        if index is not None:
            torch.accelerator.set_device_index(index)

    def manual_seed(seed: int) -> None:
        ext.default_generator(current_device()).manual_seed(int(seed))

    def manual_seed_all(seed: int) -> None:
        for i in range(ext.device_count()):
            ext.default_generator(i).manual_seed(int(seed))

    def get_rng_state(device: Any = None) -> torch.Tensor:
        return ext.default_generator(_index(device)).get_state()

    def set_rng_state(state: torch.Tensor, device: Any = None) -> None:
        ext.default_generator(_index(device)).set_state(state)

    def _index(device: Any) -> int:
        if device is None:
            return current_device()
        if isinstance(device, int):
            return device
        index = torch.device(device).index
        return current_device() if index is None else index

    for name, fn in {
        "is_available": lambda: True, "device_count": lambda: int(ext.device_count()), "current_device": current_device,
        "set_device": set_device, "synchronize": lambda device=None: None, "is_initialized": lambda: True,
        "_lazy_init": lambda: None, "_is_in_bad_fork": lambda: False, "manual_seed": manual_seed,
        "manual_seed_all": manual_seed_all, "seed": lambda: ext.default_generator(current_device()).seed(),
        "initial_seed": lambda: ext.default_generator(current_device()).initial_seed(),
        "get_rng_state": get_rng_state, "set_rng_state": set_rng_state, "is_bf16_supported": lambda *a, **k: True,
        "get_amp_supported_dtype": lambda: [torch.float16, torch.bfloat16], "default_generators": None,
    }.items():
        setattr(mod, name, fn)
    mod.default_generators = tuple(ext.default_generator(i) for i in range(ext.device_count()))
    return mod


def install() -> Any:
    """Build (or load) the stand-in and register it as the ``neuron`` device, its process-group backend and its
    compile backend. Idempotent; returns the extension module (counters, op recording, :func:`host_alias`).

    Raises:
        RuntimeError: another PrivateUse1 backend is already registered under another name.
    """
    global _EXT
    with _LOCK:
        if _EXT is not None:
            return _EXT
        ext = _build()  # its static initialisers register the allocator, guard, hooks and kernels
        torch.utils.rename_privateuse1_backend(DEVICE)
        if not hasattr(torch, DEVICE):
            torch._register_device_module(DEVICE, _device_module(ext))
        if not hasattr(torch.Tensor, f"is_{DEVICE}"):
            torch.utils.generate_methods_for_privateuse1_backend(for_storage=True)
        from tests.neuron_standin import backends

        backends.register(ext)
        _EXT = ext
        return ext


def counters() -> dict[str, int]:
    """Host <-> device copies (``_copy_from`` calls, ``.item()`` reads) and CPU-fallback calls so far."""
    return dict(install().counters())


def reset_counters() -> None:
    """Set :func:`counters` to zero."""
    install().reset_counters()


class op_inventory:
    """Context manager recording the distinct ``(op, dtypes, shapes)`` of every CPU-fallback call inside it
    (:attr:`ops`: ``{(op, dtypes, shapes): calls}``); the proxy of a per-shape eager compile on Trainium."""

    def __enter__(self) -> op_inventory:
        install().record_ops(True)
        self.ops: dict[tuple[str, str, str], int] = {}
        return self

    def __exit__(self, *exc: Any) -> None:
        ext = install()
        self.ops = {(op, dt, sh): n for op, dt, sh, n in ext.recorded_ops()}
        ext.record_ops(False)
