"""Timing a pipeline stage from hooks, and the ideal 1F1B schedule (for :mod:`benchmarks.pipeline_bubble`).

* :class:`StageClock` measures when a stage module computes, inside a real pipeline step, with public
  ``torch.nn.Module`` / autograd hooks only (no change to library code, no patching of torch): forward start / end
  from a forward pre-hook and a forward hook; backward start from an identity autograd function the forward hook
  puts on the stage output (its backward runs as soon as the output gradient arrives); backward progress from the
  same function on the stage's floating input (the input gradient is done) and from
  ``register_post_accumulate_grad_hook`` on every parameter. A backward lasts from its start stamp to the last
  progress stamp before the next forward or backward starts (torch's ``Schedule1F1B`` runs each micro-batch's
  backward in one ``torch.autograd.backward`` call, so they do not interleave).
* :func:`simulate_1f1b` replays torch's ``Schedule1F1B`` operation order with given per-stage forward / backward
  times and free communication; :func:`formula_bubble` is the closed form for equal stages.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = ["StageClock", "formula_bubble", "simulate_1f1b"]


# ---- instrumentation ------------------------------------------------------------------------------------------
def _stamp_fn() -> type:
    """An identity autograd function that appends ``(tag, time)`` to a list when its backward runs."""
    import torch

    class _Stamp(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor, log: list[tuple[str, float]], tag: str) -> torch.Tensor:
            ctx.log, ctx.tag = log, tag
            return x.view_as(x)

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
            ctx.log.append((ctx.tag, time.perf_counter()))
            return grad, None, None

    return _Stamp


class StageClock:
    """Compute intervals of one stage module, from hooks only (module docstring).

    ``events`` collects ``(kind, perf_counter)``: ``f0`` / ``f1`` forward start / end, ``b0`` backward start (the
    output gradient arrived), ``b1`` backward progress (the input gradient, a parameter's gradient accumulated).
    Nothing is recorded while ``recording`` is False.
    """

    def __init__(self, module: nn.Module) -> None:
        self.events: list[tuple[str, float]] = []
        self.recording = False
        self._stamp = _stamp_fn()
        module.register_forward_pre_hook(self._pre, with_kwargs=True)
        module.register_forward_hook(self._post)
        for p in module.parameters():
            p.register_post_accumulate_grad_hook(self._accumulated)

    def _log(self, kind: str) -> None:
        if self.recording:
            self.events.append((kind, time.perf_counter()))

    def _pre(self, _module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        self._log("f0")
        x = args[0] if args else None
        if self.recording and x is not None and x.is_floating_point() and x.requires_grad:
            return (self._stamp.apply(x, self.events, "b1"), *args[1:]), kwargs
        return None

    def _post(self, _module: nn.Module, _args: Any, out: torch.Tensor) -> Any:
        self._log("f1")
        return self._stamp.apply(out, self.events, "b0") if self.recording else None

    def _accumulated(self, _param: torch.Tensor) -> None:
        self._log("b1")

    def take(self) -> dict[str, list[float]]:
        """Forward and backward durations (s) since the last call, in order; clears ``events``."""
        fwd: list[float] = []
        bwd: list[float] = []
        start: tuple[str, float] | None = None
        last = 0.0
        for kind, t in [*self.events, ("end", 0.0)]:
            if kind in ("f0", "b0", "end"):
                if start is not None and start[0] == "b0":
                    bwd.append(last - start[1])
                start, last = (kind, t), t
            elif kind == "f1" and start is not None:
                fwd.append(t - start[1])
                start = None
            elif kind == "b1":
                last = t
        self.events.clear()
        return {"fwd_s": fwd, "bwd_s": bwd}


# ---- the schedule's ideal -------------------------------------------------------------------------------------
def formula_bubble(p: int, m: int) -> float:
    """Idle fraction of a (non-interleaved) 1F1B or GPipe pipeline with equal stages: (p-1)/(m+p-1)."""
    return (p - 1) / (m + p - 1)


def _order_1f1b(rank: int, p: int, m: int) -> list[tuple[str, int]]:
    """Operation order of torch's ``Schedule1F1B`` on pipeline rank ``rank``: ``p - rank`` warm-up forwards,
    then (backward, forward) pairs, then the remaining backwards."""
    warmup = min(m, p - rank)
    order = [("F", k) for k in range(warmup)]
    f, b = warmup, 0
    while True:
        order.append(("B", b))
        b += 1
        if f == m:
            break
        order.append(("F", f))
        f += 1
    return order + [("B", k) for k in range(b, m)]


def simulate_1f1b(fwd_s: Sequence[float | Sequence[float]], bwd_s: Sequence[float | Sequence[float]],
                  m: int) -> dict[str, Any]:
    """Makespan and per-rank idle fraction of ``m`` micro-batches through ``len(fwd_s)`` stages under torch's 1F1B
    order with free communication. Stage ``r``'s forward / backward takes ``fwd_s[r]`` / ``bwd_s[r]`` seconds: one
    number for every micro-batch, or a list with micro-batch ``k``'s time at index ``k`` (one measured step)."""
    p = len(fwd_s)
    times = {"F": [_per_micro_batch(x, m) for x in fwd_s], "B": [_per_micro_batch(x, m) for x in bwd_s]}
    orders = [_order_1f1b(r, p, m) for r in range(p)]
    end: dict[tuple[str, int, int], float] = {}
    free, nxt = [0.0] * p, [0] * p
    while any(nxt[r] < len(orders[r]) for r in range(p)):
        progressed = False
        for r in range(p):
            if nxt[r] == len(orders[r]):
                continue
            kind, k = orders[r][nxt[r]]
            dep = ("F", r - 1, k) if kind == "F" and r > 0 else ("B", r + 1, k) if kind == "B" and r < p - 1 \
                else None
            if dep is not None and dep not in end:
                continue
            start = max(free[r], end.get(dep, 0.0) if dep else 0.0)
            free[r] = end[(kind, r, k)] = start + times[kind][r][k]
            nxt[r] += 1
            progressed = True
        assert progressed, "1F1B simulation deadlocked"
    makespan = max(free)
    bubble = [1.0 - (sum(times["F"][r]) + sum(times["B"][r])) / makespan for r in range(p)]
    return {"makespan_s": makespan, "bubble_per_rank": bubble, "bubble": sum(bubble) / p}


def _per_micro_batch(x: float | Sequence[float], m: int) -> list[float]:
    if isinstance(x, (int, float)):
        return [float(x)] * m
    if len(x) != m:
        raise ValueError(f"simulate_1f1b: {len(x)} stage times for {m} micro-batches")
    return [float(t) for t in x]
