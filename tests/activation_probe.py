"""A measurement of pipeline activation memory for the tests: per pipeline stage, how many micro-batches' saved
activations are alive at once, at the peak.

Independent of the schedule's own bookkeeping: each stage module's forward runs under
:func:`torch.autograd.graph.saved_tensors_hooks` whose pack hook wraps every tensor autograd saves in a holder
tagged with (stage, forward call); a finalizer on the holder marks it freed when autograd drops it (after that
micro-batch's backward, ``retain_graph=False``). After each forward call the stage's count of forward calls with a
live holder is its number of micro-batches in flight; the peak over the run is reported. Works on any device
(CPU, XLA): it only sees autograd's saved tensors, never their storage.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections import defaultdict
from typing import Any

import torch
from torch import nn


class _Held:
    """What autograd keeps instead of a saved tensor (until the graph frees it)."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class ActivationProbe:
    """Wrap stage modules (with ``stage_index``) with :meth:`watch`; read :attr:`peak` (stage -> micro-batches)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.live: dict[int, dict[int, int]] = defaultdict(dict)  # stage -> forward call -> live saved tensors
        self.peak: dict[int, int] = defaultdict(int)
        self._calls = itertools.count()

    def _free(self, stage: int, call: int) -> None:
        with self.lock:
            left = self.live[stage][call] - 1
            if left:
                self.live[stage][call] = left
            else:
                del self.live[stage][call]

    def watch(self, module: nn.Module) -> None:
        """Replace ``module.forward`` (on the instance) by one that runs the original under the counting hooks."""
        original, stage, probe = module.forward, int(module.stage_index), self

        def forward(*args: Any, **kwargs: Any) -> Any:
            call = next(probe._calls)

            def pack(t: torch.Tensor) -> _Held:
                held = _Held(t)
                with probe.lock:
                    probe.live[stage][call] = probe.live[stage].get(call, 0) + 1
                weakref.finalize(held, probe._free, stage, call)
                return held

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda held: held.tensor):
                out = original(*args, **kwargs)
            with probe.lock:
                probe.peak[stage] = max(probe.peak[stage], len(probe.live[stage]))
            return out

        module.forward = forward

    def leaked(self) -> dict[int, int]:
        """Stages with saved tensors still alive (after a complete training call: none)."""
        with self.lock:
            return {s: len(calls) for s, calls in self.live.items() if calls}
