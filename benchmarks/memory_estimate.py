"""Peak tensor memory of a training step without running it: FakeTensorMode + a live-bytes dispatch tracker.

Under :class:`torch._subclasses.fake_tensor.FakeTensorMode` every tensor carries shape, dtype, strides and a
(fake) storage but no data, and every ATen op runs only its meta function: no FLOPs, no allocation. Stacked
inside it, :class:`LiveBytesTracker` (a :class:`torch.utils._python_dispatch.TorchDispatchMode`) sees every op
that reaches ATen -- forward, autograd's backward ops, the optimizer's -- and, for each tensor an op returns,
registers its untyped storage once (views share their base's storage, so they add nothing) with a
``weakref`` whose callback subtracts the storage's bytes when Python frees it. ``live`` is then the sum of the
storages alive right now, and ``peak`` its maximum: what a perfect caching-free allocator would need.

This is the approach of torch's own ``torch.distributed._tools.mem_tracker.MemTracker`` (which also runs under
FakeTensorMode); it is written here in a few lines so that the benchmark depends only on public dispatch APIs.

What it does not see: memory outside tensors (the interpreter, torch's libraries, the allocator's caches and
fragmentation, kernel scratch buffers that never become tensors). The harness therefore estimates a process's
peak RSS as ``RSS after imports + tracker peak`` and reports the measured / estimated ratio wherever both exist.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["LiveBytesTracker", "estimate_peak_bytes"]


class LiveBytesTracker(TorchDispatchMode):
    """Tracks the bytes of all live tensor storages created by ATen ops inside the mode (module docstring).

    Attributes:
        live: bytes of storages alive now (int).
        peak: maximum of ``live`` since construction or the last :meth:`reset_peak` (int).
    """

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._refs: dict[int, weakref.ref[Any]] = {}

    def reset_peak(self) -> None:
        """Restart the peak from the bytes live now."""
        self.peak = self.live

    def _register(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = id(storage)
        if key in self._refs:
            return
        nbytes = storage.nbytes()

        def _freed(_ref: weakref.ref[Any], key: int = key, nbytes: int = nbytes) -> None:
            self.live -= nbytes
            self._refs.pop(key, None)

        self._refs[key] = weakref.ref(storage, _freed)
        self.live += nbytes
        self.peak = max(self.peak, self.live)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        """Run ``func`` (under the fake mode below this one) and register every tensor it returns."""
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._register(t)
        return out


def estimate_peak_bytes(build: Callable[[], Any], step: Callable[[Any, int], Any],
                        lengths: list[int], fake: bool = True) -> tuple[int, list[int]]:
    """Peak live tensor bytes of ``step`` at each length, all under one FakeTensorMode.

    With ``fake=False`` the same accounting runs on real tensors (the steps really execute): comparing the two
    at a small length validates that the fake run allocates exactly what the real run allocates.

    Args:
        build: creates the state (model, optimizer) inside the fake mode; its tensors are counted
            (parameters: their bytes stay live for the whole run).
        step: ``step(state, seq_len)`` runs one full training step (it builds its own fake batch).
        lengths: sequence lengths, run in order (e.g. the warm-up length first, then the measured one).

    Returns:
        ``(bytes live after build, [peak bytes during each step])``; each peak is the maximum of the live bytes
        during that step, including everything alive before it (parameters, optimizer state, ...).

    Raises:
        Whatever ``build`` / ``step`` raise (e.g. a data-dependent op that fake tensors cannot run:
        ``torch._subclasses.fake_tensor.DataDependentOutputException``).
    """
    peaks: list[int] = []
    with FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext(), \
            LiveBytesTracker() as tracker:
        state = build()
        after_build = tracker.live
        for seq_len in lengths:
            tracker.reset_peak()
            step(state, seq_len)
            peaks.append(tracker.peak)
    return after_build, peaks
