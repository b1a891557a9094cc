"""torch-xla runtime: availability probes, the XLA device, THE step synchronisation, and graph statistics.

On Trainium nxd_lc runs on torch-xla: tensors are lazy, operations are recorded into a graph, and the graph is
compiled (a Neuron compile: minutes) and executed when the step is cut by :func:`sync`. Every distinct graph costs
one compile, so the training step must produce a fixed set of graphs (static-graph discipline, README "XLA").

* :func:`sync` is the only place in nxd_lc that cuts a graph (``torch_xla.sync()``, torch-xla >= 2.6, else
  ``xm.mark_step()``); the XLA Lightning strategy (:mod:`nxd_lc.lightning.xla`) calls it at the step boundaries.
* torch-xla is an optional dependency (the ``xla`` extra): nothing here imports it at module import time, so the
  module imports on the default CPU/CUDA stack, and the probes return False there.
* ``neuron`` = xla + the Neuron specifics, when ``torch_neuronx`` is importable. The ``torch-neuronx`` wheels on
  PyPI are placeholders whose import raises ImportError; the real ones come from the Neuron repository.

Graph statistics come from ``torch_xla.debug.metrics``: the ``CompileTime`` metric's sample count is the number
of graphs compiled by this process, ``ExecuteTime``'s the number of graph executions, and
``TransferFromDeviceTime``'s the number of device -> host read-backs (``.item()``, ``.cpu()``, printing).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)


@functools.lru_cache(maxsize=1)
def torch_xla_available() -> bool:
    """True when ``torch_xla`` imports (the ``xla`` extra, or torch-neuronx's stack on Trainium)."""
    if importlib.util.find_spec("torch_xla") is None:
        return False
    try:
        importlib.import_module("torch_xla")
    except (ImportError, RuntimeError, OSError) as e:  # a broken install is "not available", with a reason
        log.warning("torch_xla is installed but does not import (%s); XLA backends are unavailable", e)
        return False
    return True


@functools.lru_cache(maxsize=1)
def neuron_available() -> bool:
    """True when ``torch_neuronx`` imports (real Neuron SDK). PyPI's placeholder raises ImportError -> False."""
    if importlib.util.find_spec("torch_neuronx") is None:
        return False
    try:
        importlib.import_module("torch_neuronx")
    except (ImportError, RuntimeError, OSError):
        return False
    return torch_xla_available()


def require_torch_xla(what: str) -> None:
    """Raise a clear error when torch-xla is missing.

    Raises:
        ModuleNotFoundError: naming ``what`` needed it and how to install it.
    """
    if not torch_xla_available():
        raise ModuleNotFoundError(
            f"{what} needs torch-xla: install the xla extra into a torch 2.9 environment "
            "(pip install -c constraints-xla.txt -e '.[xla]') and set PJRT_DEVICE (CPU off Trainium, NEURON on it)"
        )


def xla_device() -> torch.device:
    """This process's XLA device (``xla:0`` under torchrun / PJRT: one device per process).

    Raises:
        ModuleNotFoundError: torch-xla is not installed.
    """
    require_torch_xla("the XLA device")
    import torch_xla

    if hasattr(torch_xla, "device"):  # torch-xla >= 2.5
        return torch_xla.device()
    import torch_xla.core.xla_model as xm

    return xm.xla_device()


def xla_hardware() -> str:
    """The hardware behind torch-xla's devices in this process: ``'CPU'``, ``'NEURON'``, ``'TPU'``, ``'CUDA'``
    (``torch_xla.runtime.device_type()``: PJRT's device type, from ``PJRT_DEVICE``).

    Raises:
        ModuleNotFoundError: torch-xla is not installed.
    """
    require_torch_xla("the XLA hardware type")
    import torch_xla.runtime as xr

    return str(xr.device_type() or "").upper()


def device_type_name(t: torch.Tensor) -> str:
    """The element type ``t`` has *on the XLA device*, as XLA names it (``'f32'``, ``'bf16'``, ``'f64'``, ``'s32'``,
    ...): what ``t.dtype`` does not say under ``XLA_USE_BF16`` / ``XLA_DOWNCAST_BF16`` (float32 is then ``'bf16'``).
    Reads the lazy IR's shape, not the data: nothing is executed or transferred.

    Raises:
        ModuleNotFoundError: torch-xla is not installed.
        ValueError: ``t`` is not an XLA tensor.
    """
    require_torch_xla("the on-device type of a tensor")
    import torch_xla

    if not is_xla_tensor(t):
        raise ValueError(f"device_type_name: {t.device} is not an XLA device")
    xlac = torch_xla._XLAC
    if hasattr(xlac, "_get_xla_tensor_shape_type"):
        return str(xlac._get_xla_tensor_shape_type(t))
    text = xlac._get_xla_tensors_text([t])  # '... = bf16[3]{0} ..., ROOT=0'
    root = [line for line in text.splitlines() if "ROOT=" in line][-1]
    return root.split("=", 1)[1].strip().split("[", 1)[0]


def stream_seed(seed: int, *indices: int) -> int:
    """A seed for the device's random stream mixed from the run's ``seed`` and ``indices`` (SplitMix64 rounds): a
    different stream per index tuple, in ``[2, 2**63)`` (torch-xla turns the scalars 0 and 1 into graph constants, so
    a seed of 0 / 1 would trace a graph of its own)."""
    x = seed & 0xFFFFFFFFFFFFFFFF
    for i in indices:
        x = (x ^ (i & 0xFFFFFFFFFFFFFFFF)) + 0x9E3779B97F4A7C15 & 0xFFFFFFFFFFFFFFFF
        x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        x = (x ^ (x >> 27)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
        x ^= x >> 31
    return 2 + x % (2**63 - 2)


def seed_device_stream(seed: int) -> None:
    """Restart this thread's XLA device random stream (``torch.rand`` & co. on the device: dropout masks, stochastic
    rounding) at ``seed``.

    torch-xla's stream is not seeded by ``torch.manual_seed`` (every process starts at the same default state), and
    it advances at every graph cut (``torch_xla.sync`` / ``mark_step``) as well as at every random op; a run whose
    layout takes more cuts (a barrier at TP > 1, a host read) would otherwise draw other masks than one device. The
    seed becomes device data when a random op next needs it (no new graph, no transfer otherwise).

    Raises:
        ModuleNotFoundError: torch-xla is not installed.
    """
    require_torch_xla("seeding the XLA device's random stream")
    import torch_xla.core.xla_model as xm

    xm.set_rng_state(seed)


def is_xla_tensor(t: torch.Tensor) -> bool:
    """True when ``t`` lives on an XLA device (lazy tensor)."""
    return t.device.type == "xla"


def sync(wait: bool = False) -> None:
    """Cut the pending lazy graph, compile it (once per distinct graph) and launch its execution.

    The single step-synchronisation point of nxd_lc (module docstring). A no-op without torch-xla.

    Args:
        wait: block until the execution has finished (used before timing or host-side checkpoint reads).
    """
    if not torch_xla_available():
        return
    import torch_xla

    if hasattr(torch_xla, "sync"):  # torch-xla >= 2.6
        torch_xla.sync(wait=wait)
        return
    import torch_xla.core.xla_model as xm

    xm.mark_step(wait=wait)


def xla_process_group_backend() -> str:
    """Register torch-xla's ``xla`` torch.distributed backend and return its name ('xla').

    The ``xla`` process group runs collectives as XLA collective ops inside the graph (multi-device XLA:
    Trainium, TPU). On XLA-CPU only one device exists, so multi-process XLA-CPU is not possible.

    Raises:
        ModuleNotFoundError: torch-xla is not installed.
    """
    require_torch_xla("the 'xla' process-group backend")
    importlib.import_module("torch_xla.distributed.xla_backend")  # registers the backend with torch.distributed
    return "xla"


@dataclass(frozen=True)
class GraphStats:
    """Counters of this process's lazy-graph activity (from ``torch_xla.debug.metrics``)."""

    compiles: int  # graphs compiled (``CompileTime`` samples); each is a Neuron compile on Trainium
    executions: int  # graph executions (``ExecuteTime`` samples)
    transfers_from_device: int  # device -> host read-backs (``TransferFromDeviceTime`` samples)
    cached_compiles: int  # graphs found in the in-memory compile cache (``CachedCompile`` counter)

    def __sub__(self, other: GraphStats) -> GraphStats:
        """Counter differences ``self - other`` (activity between two snapshots)."""
        return GraphStats(self.compiles - other.compiles, self.executions - other.executions,
                          self.transfers_from_device - other.transfers_from_device,
                          self.cached_compiles - other.cached_compiles)


def _metric_count(met: object, name: str) -> int:
    data = met.metric_data(name)  # type: ignore[attr-defined]
    return int(data[0]) if data else 0


def graph_stats() -> GraphStats:
    """Snapshot of :class:`GraphStats` for this process.

    Raises:
        ModuleNotFoundError: torch-xla is not installed.
    """
    require_torch_xla("graph statistics")
    import torch_xla.debug.metrics as met

    return GraphStats(compiles=_metric_count(met, "CompileTime"), executions=_metric_count(met, "ExecuteTime"),
                      transfers_from_device=_metric_count(met, "TransferFromDeviceTime"),
                      cached_compiles=int(met.counter_value("CachedCompile") or 0))


@functools.lru_cache(maxsize=1)
def _bitcast_ops() -> tuple[object, object]:
    """The two XLA bit-cast operations (float32 <-> int32), registered once with ``xla_op_registry``."""
    require_torch_xla("bit casts")
    import torch_xla.core.xla_builder as xb
    import torch_xla.core.xla_op_registry as xor

    return (xor.register("nxd_lc_f32_to_i32_bits", lambda x: x.bitcast(xb.Type.S32)),
            xor.register("nxd_lc_i32_bits_to_f32", lambda x: x.bitcast(xb.Type.F32)))


def bitcast_float32_int32(x: torch.Tensor, to_int: bool = True) -> torch.Tensor:
    """Reinterpret the bits of an XLA tensor: float32 -> int32 (``to_int``) or int32 -> float32, same shape.

    ``Tensor.view(dtype)`` has no XLA lowering in torch-xla 2.9: it runs as a CPU fallback
    (``aten::view_copy.dtype``: the tensor goes to the host and back, 3 transfers, and the step waits for the
    device). This is XLA's ``BitcastConvert`` as a user computation (``torch_xla.core.xla_op_registry``): part of
    the graph, nothing read back.

    Raises:
        ModuleNotFoundError: torch-xla is not installed.
        ValueError: ``x`` is not float32 (``to_int``) / int32 (not ``to_int``).
    """
    want = torch.float32 if to_int else torch.int32
    if x.dtype != want:
        raise ValueError(f"bitcast_float32_int32: expected a {want} tensor, got {x.dtype}")
    to_i32, to_f32 = _bitcast_ops()
    return to_i32(x) if to_int else to_f32(x)  # type: ignore[operator]


def all_to_all(tensor: torch.Tensor, split_dim: int, concat_dim: int, split_count: int,
               groups: list[list[int]]) -> torch.Tensor:
    """XLA ``AllToAll`` inside each replica group of ``groups`` (global device ordinals, every group of the
    partition, the same list on every device): ``tensor`` split along ``split_dim`` into ``split_count`` chunks,
    chunk ``j`` sent to the group's ``j``-th device, the received chunks concatenated along ``concat_dim`` in group
    order. A lazy op.

    Raises:
        ModuleNotFoundError: torch-xla is not installed.
    """
    require_torch_xla("all_to_all")
    import torch_xla.core.xla_model as xm

    return xm.all_to_all(tensor, split_dim, concat_dim, split_count, groups=groups, pin_layout=False)


def collective_permute(tensor: torch.Tensor, pairs: list[tuple[int, int]]) -> torch.Tensor:
    """XLA ``CollectivePermute``: device ``target`` receives ``tensor`` of device ``source`` for each
    ``(source, target)`` pair (global device ordinals = torch.distributed ranks on torch-xla); a device that no
    pair targets receives zeros. Every device of the pairs must trace the same call (the same pairs, shape and
    dtype) in the same graph. A lazy op: nothing runs until the graph is cut.

    Raises:
        RuntimeError: torch-xla is not installed.
    """
    require_torch_xla("collective_permute")
    import torch_xla.core.xla_model as xm

    return xm.collective_permute(tensor, [list(p) for p in pairs])
