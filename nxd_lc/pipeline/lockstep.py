"""Pipeline schedules for torch-xla: every rank of a pipeline group steps through the same ticks, and stage-to-stage
traffic is one collective permute per direction and tick, in a graph of its own.

Why not :mod:`torch.distributed.pipelining` there: its schedules send activations point to point
(``batch_isend_irecv``), which the torch-xla process group does not offer, and on XLA a collective must be in a graph
that is identical on every rank of its replica group, or the ranks load different executables and hang (NxD isolates
each of its pipeline send / receive collectives in a graph of its own for that reason). Pipeline stages trace
different graphs (embedding on the first, loss on the last), so the exchange cannot ride in a stage's graph.

The schedule (``S = PP x V`` stages, stage ``k`` on pipeline rank ``k mod PP``, ``m`` micro-batches), in ticks:

* at tick ``t`` stage ``k`` runs the forward of micro-batch ``t - k`` and, when training, the backward of
  micro-batch ``t - (2S - 2 - k)`` (each when ``0 <= index < m``); the last stage runs forward, loss and backward
  of the same micro-batch in its tick (its loss is back-propagated divided by ``m``, as the 1F1B path does);
* after the tick's compute, the graph is cut, every rank contributes one buffer per direction (its outputs of the
  tick, zeros where it has none, stacked over its ``V`` stages, made in the compute graph) to a
  ``collective_permute`` (forward: pipeline rank ``r`` -> ``r + 1``; backward: ``r`` -> ``r - 1``; a ring when
  ``V > 1``, so the last rank's output reaches stage ``k + 1`` on rank 0), and the graph is cut again. A tick in which
  no stage of the pipeline sends anything (known from the schedule, so the same on every rank) has no exchange and
  no cut: its compute joins the next tick's graph.

Training takes ``m + 2S - 2`` ticks, forward-only ``m + S - 1``; every tick but the last exchanges, so a training
call cuts ``2 (m + 2S - 3)`` graphs, the same on every rank. Gradients, losses and objective records equal those
of the 1F1B path (:class:`torch.distributed.pipelining.Schedule1F1B`): the same micro-batches, the same loss
scaling, only the order in which micro-batch gradients are summed differs (fp32 rounding).

What it costs against 1F1B on an eager device: stage ``k`` holds the activations of up to ``2 (S - 1 - k) + 1``
micro-batches (1F1B: ``S - k``), because each hop takes one tick; with ``V > 1`` the tick-level lockstep does not
shorten the bubble as interleaved 1F1B does (each tick lasts as long as the busiest rank's work). Both are listed
in docs/limitations.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
from torch import nn

#: (payload [V, ...] on this rank, pairs of (source, target) global ranks) -> what this rank receives [V, ...]
#: (zeros where no pair targets it). Collective over every rank of the pairs; all ranks pass the same pairs.
Exchange = Callable[[torch.Tensor, list[tuple[int, int]]], torch.Tensor]


@dataclass(frozen=True)
class LockstepPlan:
    """The tick plan of one schedule call (pure arithmetic, the same on every rank).

    Attributes:
        num_stages: ``S = PP x V``.
        num_microbatches: ``m``.
        train: forward and backward (else forward only).
    """

    num_stages: int
    num_microbatches: int
    train: bool

    @property
    def num_ticks(self) -> int:
        """``m + 2S - 2`` (training) or ``m + S - 1`` (forward only)."""
        s, m = self.num_stages, self.num_microbatches
        return m + (2 * s - 2 if self.train else s - 1)

    def forward_of(self, stage: int, tick: int) -> Optional[int]:
        """The micro-batch whose forward stage ``stage`` runs at ``tick``, or None."""
        i = tick - stage
        return i if 0 <= i < self.num_microbatches else None

    def backward_of(self, stage: int, tick: int) -> Optional[int]:
        """The micro-batch whose backward stage ``stage`` runs at ``tick`` (training only), or None."""
        if not self.train:
            return None
        j = tick - (2 * self.num_stages - 2 - stage)
        return j if 0 <= j < self.num_microbatches else None

    def sends_forward(self, tick: int) -> bool:
        """Whether any stage sends an activation after ``tick`` (every stage but the last, after a forward)."""
        return any(self.forward_of(k, tick) is not None for k in range(self.num_stages - 1))

    def sends_backward(self, tick: int) -> bool:
        """Whether any stage sends an input gradient after ``tick`` (every stage but the first, after a
        backward; the last stage's backward is that of its own forward in the same tick)."""
        if not self.train:
            return False
        return any(self.backward_of(k, tick) is not None for k in range(1, self.num_stages))


class LockstepRunner:
    """Runs the :class:`LockstepPlan` for this rank's stage modules.

    Args:
        stage_modules: this rank's :class:`~nxd_lc.pipeline.stage.PipelineStageModule`, one per virtual stage, in
            the order of :func:`~nxd_lc.pipeline.split.stages_of_rank` (stage ``r + v PP`` at index ``v``).
        pipeline_size: ``PP``.
        pipeline_rank: this rank's index in its pipeline group.
        stream: ``[(shape, dtype)]`` of the tensors a stage passes on (the residual stream ``[B, S(/tp), H]``, then
            any carried statistics); their gradients travel back with the same shapes.
        forward_pairs, backward_pairs: ``(source, target)`` global ranks of the two directions over every
            pipeline group (:func:`nxd_lc.distributed.collectives.shift_pairs`: +1 and -1, a ring when ``V > 1``, so
            stage ``k`` on the last rank feeds stage ``k + 1`` on the first).
        exchange: the collective (:data:`Exchange`); on torch-xla a ``collective_permute``.
        device: where the zero buffers live.
    """

    def __init__(self, stage_modules: Sequence[nn.Module], *, pipeline_size: int, pipeline_rank: int,
                 stream: Sequence[tuple[tuple[int, ...], torch.dtype]], forward_pairs: list[tuple[int, int]],
                 backward_pairs: list[tuple[int, int]], exchange: Exchange, device: torch.device) -> None:
        self.modules = list(stage_modules)
        self.pp, self.rank, self.virtual = pipeline_size, pipeline_rank, len(self.modules)
        self.num_stages = self.pp * self.virtual
        self.stream = [(tuple(s), d) for s, d in stream]
        self.forward_pairs, self.backward_pairs = forward_pairs, backward_pairs
        self.exchange, self.device = exchange, device

    # ---- payloads ----------------------------------------------------------------------------------------------
    def _pack(self, per_stage: list[Optional[tuple[torch.Tensor, ...]]]) -> list[torch.Tensor]:
        """One ``[V, *shape]`` buffer per stream tensor: stage ``v``'s tensor or zeros."""
        packed = []
        for s, (shape, dtype) in enumerate(self.stream):
            parts = []
            for tensors in per_stage:
                t = None if tensors is None else tensors[s]
                parts.append(t.detach().to(dtype) if t is not None else torch.zeros(shape, dtype=dtype,
                                                                                     device=self.device))
            packed.append(torch.stack(parts))
        return packed

    def _unpack(self, received: list[torch.Tensor], forward: bool) -> list[tuple[torch.Tensor, ...]]:
        """Per local stage ``v``, the stream tensors that arrived for it. Forward: from rank ``r - 1``'s stage
        ``v`` (rank 0: from the last rank's stage ``v - 1``, the ring); backward: from rank ``r + 1``'s stage ``v``
        (the last rank: from rank 0's stage ``v + 1``)."""
        out = []
        for v in range(self.virtual):
            if forward:
                src = v - 1 if self.rank == 0 else v
            else:
                src = v + 1 if self.rank == self.pp - 1 else v
            out.append(tuple(buf[src] for buf in received) if 0 <= src < self.virtual else ())
        return out

    @staticmethod
    def _input_grads(inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """The gradients of a stage's received inputs after its backward (zeros for an input nothing depended on)."""
        return tuple(x.grad if x.grad is not None else torch.zeros_like(x) for x in inputs)

    # ---- the schedule ------------------------------------------------------------------------------------------
    def run(self, num_microbatches: int, train: bool, first_inputs: Sequence[torch.Tensor],
            kwargs: Sequence[dict[str, torch.Tensor]], cut: Callable[[], None]) -> list[torch.Tensor]:
        """Forward (and backward when ``train``) of every micro-batch through this rank's stages.

        Args:
            num_microbatches: ``m``.
            train: run the backward; gradients accumulate into the parameters.
            first_inputs: the first stage's input ``[B, S]`` of each micro-batch (used when this rank holds stage 0).
            kwargs: each micro-batch's keyword tensors for the stages (``position_ids``, ``labels``, ...).
            cut: called before and after each tick's exchange (a graph cut on torch-xla), so that the exchange's
                graph holds the permutes alone and is the same on every rank.
        Returns:
            the last stage's loss of each micro-batch divided by ``m`` (fp32 scalars, detached, in order; their sum
            is the step's mean loss); empty on ranks without the last stage.
        """
        plan = LockstepPlan(self.num_stages, num_microbatches, train)
        n = num_microbatches
        received_fwd: list[tuple[torch.Tensor, ...]] = [() for _ in self.modules]
        received_bwd: list[tuple[torch.Tensor, ...]] = [() for _ in self.modules]
        saved: dict[tuple[int, int], tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]] = {}
        losses: list[torch.Tensor] = []
        for tick in range(plan.num_ticks):
            send_fwd: list[Optional[tuple[torch.Tensor, ...]]] = [None] * self.virtual
            send_bwd: list[Optional[tuple[torch.Tensor, ...]]] = [None] * self.virtual
            for v, module in enumerate(self.modules):
                k = module.stage_index
                i = plan.forward_of(k, tick)
                if i is not None:
                    if module.is_first:
                        inputs: tuple[torch.Tensor, ...] = ()
                        args: tuple[torch.Tensor, ...] = (first_inputs[i],)
                    else:
                        inputs = tuple(x.detach().requires_grad_(train and x.is_floating_point())
                                       for x in received_fwd[v])
                        args = inputs
                    out = module(*args, **kwargs[i])
                    if module.is_last:
                        scaled = out.float().sum() / n  # as the 1F1B path's loss_fn: the step loss is their sum
                        losses.append(scaled.detach())
                        if train:
                            scaled.backward()
                            if not module.is_first:
                                send_bwd[v] = self._input_grads(inputs)
                    else:
                        outs = out if isinstance(out, tuple) else (out,)
                        send_fwd[v] = outs
                        if train:
                            saved[(v, i)] = (inputs, outs)
                j = plan.backward_of(k, tick)
                if j is not None and not module.is_last:
                    inputs, outs = saved.pop((v, j))
                    pairs = [(o, g) for o, g in zip(outs, received_bwd[v]) if o.requires_grad]
                    if pairs:
                        torch.autograd.backward([o for o, _ in pairs], [g.to(o.dtype) for o, g in pairs])
                    if not module.is_first:
                        send_bwd[v] = self._input_grads(inputs)
            fwd, bwd = plan.sends_forward(tick), plan.sends_backward(tick)
            if fwd or bwd:
                # the buffers are made in the compute graph; the exchange graph holds the permutes alone
                packed_fwd = self._pack(send_fwd) if fwd else []
                packed_bwd = self._pack(send_bwd) if bwd else []
                cut()
                got_fwd = [self.exchange(b, self.forward_pairs) for b in packed_fwd]
                got_bwd = [self.exchange(b, self.backward_pairs) for b in packed_bwd]
                cut()  # before any rank-specific view of what arrived joins the graph
                if fwd:
                    received_fwd = self._unpack(got_fwd, forward=True)
                if bwd:
                    received_bwd = self._unpack(got_bwd, forward=False)
        if saved:  # a schedule arithmetic error, never a user error
            raise RuntimeError(f"pipeline (lockstep): activations of {sorted(saved)} were never back-propagated")
        return losses
