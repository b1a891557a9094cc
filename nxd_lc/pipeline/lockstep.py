"""Pipeline schedules for torch-xla: every rank of a pipeline group steps through the same phases, and stage-to-stage
traffic is one collective permute per direction and phase, in a graph of its own.

Why not :mod:`torch.distributed.pipelining` there: its schedules send activations point to point
(``batch_isend_irecv``), which the torch-xla process group does not offer, and on XLA a collective must be in a graph
that is identical on every rank of its replica group, or the ranks load different executables and hang (NxD isolates
each of its pipeline send / receive collectives in a graph of its own for that reason). Pipeline stages trace
different graphs (embedding on the first, loss on the last), so the exchange cannot ride in a stage's graph.

The schedule (``S = PP x V`` stages, stage ``k`` on pipeline rank ``k mod PP``, ``m`` micro-batches) runs in
*phases* (half-ticks): in each phase a stage runs at most one unit of work, and an exchange follows every phase in
which anything moves, so a hop between neighbouring stages costs one phase. Training (1F1B's steady state, stages
of even and odd index alternating):

* stage ``k < S - 1`` runs the forward of micro-batch ``i`` in phase ``k + 2i`` and its backward in phase
  ``2S - 1 - k + 2i`` (forwards in the phases of ``k``'s parity, backwards in the others);
* the last stage runs forward, loss and backward of micro-batch ``i`` together in phase ``S + 2i`` (its input
  arrived after phase ``S - 2 + 2i`` and waits one phase; its loss is back-propagated divided by ``m``, as the 1F1B
  path does);
* forward only (evaluation): stage ``k`` runs the forward of micro-batch ``i`` in phase ``k + i``.

So stage ``k`` holds the activations of at most ``min(m, S - k)`` micro-batches (:func:`lockstep_in_flight`), as
1F1B does (micro-batch ``i`` is saved from phase ``k + 2i`` to phase ``2S - 1 - k + 2i``, in which window the
stage starts ``S - k`` forwards); the earlier one-tick schedule (a forward and a backward per stage and tick, a hop
per tick) held ``2 (S - 1 - k) + 1``. Training takes ``2 (m + S - 1)`` phases, forward only ``m + S - 1``.

After a phase's compute the graph is cut, every rank contributes one buffer per direction (its stages' outputs of
the phase, zeros where it has none, stacked over its ``V`` stages, made in the compute graph) to a
``collective_permute`` (forward: pipeline rank ``r`` -> ``r + 1``; backward: ``r`` -> ``r - 1``; a ring when
``V > 1``, so the last rank's output reaches stage ``k + 1`` on rank 0), and the graph is cut again. A phase in
which no stage sends anything (known from the plan, so the same on every rank) has no exchange and no cut: its
compute joins the next phase's graph.

**Graphs per call** (the same on every rank): ``E`` exchanges (:attr:`LockstepPlan.num_exchanges`), ``2E`` cuts, so
``2E + 1`` graphs: ``E`` exchange graphs and ``E + 1`` compute segments, the last of which joins whatever the
caller runs next. Training: ``E = 2m + 2S - 3`` for ``S >= 3`` and ``m >= 2`` (every phase but the last exchanges);
``E = m + 1`` for ``S = 2`` (only even phases send); ``E = 2S - 2`` for ``m = 1``. Forward only: ``E = m + S - 2``.
Against the one-tick schedule (``m + 2S - 3`` exchanges) that is ``m`` more exchanges at ``S >= 3`` and the same
at ``S = 2``. Graphs *compiled*: the steady state's phases repeat, so their graphs are shared, provided each
micro-batch's inputs are tensors of their own and not slices of one device tensor (a slice's offset is part of
every graph reading it): :class:`~nxd_lc.pipeline.engine.PipelineEngine` passes copies (16 graphs in the first
call at PP 2, 26 at PP 4, whatever ``m``; docs/trainium.md).

Gradients, losses and objective records equal those of the 1F1B path
(:class:`torch.distributed.pipelining.Schedule1F1B`): the same micro-batches, the same loss scaling, only the order
in which micro-batch gradients are summed differs (fp32 rounding).

What it costs against 1F1B on an eager device: every phase lasts as long as the busiest rank's unit, and in the
steady state half the stages run a backward, so a micro-batch takes two backward-long phases (``2 max(F, B)``
against 1F1B's ``F + B``); the fill and drain take ``2 (S - 1)`` phases. With ``V > 1`` the lockstep does not
shorten the bubble as interleaved 1F1B does. Listed in docs/limitations.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
from torch import nn

#: (payload [V, ...] on this rank, pairs of (source, target) global ranks) -> what this rank receives [V, ...]
#: (zeros where no pair targets it). Collective over every rank of the pairs; all ranks pass the same pairs.
Exchange = Callable[[torch.Tensor, list[tuple[int, int]]], torch.Tensor]


def lockstep_in_flight(num_stages: int, stage: int, num_microbatches: int) -> int:
    """Micro-batches whose activations stage ``stage`` holds at once, at most, under the training schedule of this
    module: ``min(m, S - k)`` (1F1B's figure; module docstring). Used by the dry run's memory estimate.

    Args:
        num_stages: ``S = PP x V``; stage: ``k`` in ``[0, S)``; num_microbatches: ``m >= 1``.
    """
    return max(0, min(num_microbatches, num_stages - stage))


@dataclass(frozen=True)
class LockstepPlan:
    """The phase plan of one schedule call (pure arithmetic, the same on every rank; module docstring).

    Attributes:
        num_stages: ``S = PP x V``.
        num_microbatches: ``m``.
        train: forward and backward (else forward only).
    """

    num_stages: int
    num_microbatches: int
    train: bool

    @property
    def num_phases(self) -> int:
        """``2 (m + S - 1)`` (training) or ``m + S - 1`` (forward only)."""
        n = self.num_microbatches + self.num_stages - 1
        return 2 * n if self.train else n

    def forward_of(self, stage: int, phase: int) -> Optional[int]:
        """The micro-batch whose forward stage ``stage`` runs in ``phase``, or None. When training, the last stage
        runs forward, loss and backward together: its forward phase is its backward phase."""
        if self.train and stage == self.num_stages - 1:
            return self.backward_of(stage, phase)
        step = 2 if self.train else 1
        offset = phase - stage
        if offset < 0 or offset % step:
            return None
        i = offset // step
        return i if i < self.num_microbatches else None

    def backward_of(self, stage: int, phase: int) -> Optional[int]:
        """The micro-batch whose backward stage ``stage`` runs in ``phase`` (training only), or None."""
        if not self.train:
            return None
        offset = phase - (2 * self.num_stages - 1 - stage)
        if offset < 0 or offset % 2:
            return None
        j = offset // 2
        return j if j < self.num_microbatches else None

    def sends_forward(self, phase: int) -> bool:
        """Whether any stage sends an activation after ``phase`` (every stage but the last, after a forward)."""
        return any(self.forward_of(k, phase) is not None for k in range(self.num_stages - 1))

    def sends_backward(self, phase: int) -> bool:
        """Whether any stage sends an input gradient after ``phase`` (every stage but the first, after a
        backward; the last stage's backward is that of its own forward in the same phase)."""
        return self.train and any(self.backward_of(k, phase) is not None for k in range(1, self.num_stages))

    @property
    def num_exchanges(self) -> int:
        """``E``: the phases followed by an exchange; a call cuts ``2E`` graphs (module docstring)."""
        return sum(1 for p in range(self.num_phases) if self.sends_forward(p) or self.sends_backward(p))


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
            cut: called before and after each phase's exchange (a graph cut on torch-xla), so that the exchange's
                graph holds the permutes alone and is the same on every rank: ``2E`` calls
                (:attr:`LockstepPlan.num_exchanges`).
        Returns:
            the last stage's loss of each micro-batch divided by ``m`` (fp32 scalars, detached, in order; their sum
            is the step's mean loss); empty on ranks without the last stage.

        Raises:
            RuntimeError: the plan left an activation or a received tensor unused (a schedule arithmetic error).
        """
        plan = LockstepPlan(self.num_stages, num_microbatches, train)
        # (local stage v, micro-batch) -> what arrived for it / what its forward saved for the backward
        inbox_fwd: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}
        inbox_bwd: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}
        saved: dict[tuple[int, int], tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]] = {}
        losses: list[torch.Tensor] = []
        for phase in range(plan.num_phases):
            send_fwd: list[Optional[tuple[torch.Tensor, ...]]] = [None] * self.virtual
            send_bwd: list[Optional[tuple[torch.Tensor, ...]]] = [None] * self.virtual
            for v, module in enumerate(self.modules):
                i = plan.forward_of(module.stage_index, phase)
                if i is not None:
                    send_fwd[v], send_bwd[v] = self._forward(module, v, i, train, first_inputs, kwargs, inbox_fwd,
                                                             saved, losses, num_microbatches)
                j = plan.backward_of(module.stage_index, phase)
                if j is not None and not module.is_last:
                    inputs, outs = saved.pop((v, j))
                    pairs = [(o, g) for o, g in zip(outs, inbox_bwd.pop((v, j))) if o.requires_grad]
                    if pairs:
                        torch.autograd.backward([o for o, _ in pairs], [g.to(o.dtype) for o, g in pairs])
                    if not module.is_first:
                        send_bwd[v] = self._input_grads(inputs)
            fwd, bwd = plan.sends_forward(phase), plan.sends_backward(phase)
            if fwd or bwd:
                # the buffers are made in the compute graph; the exchange graph holds the permutes alone
                packed_fwd = self._pack(send_fwd) if fwd else []
                packed_bwd = self._pack(send_bwd) if bwd else []
                cut()
                got_fwd = [self.exchange(b, self.forward_pairs) for b in packed_fwd]
                got_bwd = [self.exchange(b, self.backward_pairs) for b in packed_bwd]
                cut()  # before any rank-specific view of what arrived joins the graph
                self._deliver(plan, phase, got_fwd, got_bwd, inbox_fwd, inbox_bwd)
        if saved or inbox_fwd or inbox_bwd:  # a schedule arithmetic error, never a user error
            raise RuntimeError(f"pipeline (lockstep): activations {sorted(saved)} never back-propagated, inputs "
                               f"{sorted(inbox_fwd)} / gradients {sorted(inbox_bwd)} never used")
        return losses

    def _forward(self, module: nn.Module, v: int, i: int, train: bool, first_inputs: Sequence[torch.Tensor],
                 kwargs: Sequence[dict[str, torch.Tensor]], inbox: dict, saved: dict, losses: list[torch.Tensor],
                 n: int) -> tuple[Optional[tuple[torch.Tensor, ...]], Optional[tuple[torch.Tensor, ...]]]:
        """Micro-batch ``i``'s forward through local stage ``v`` (the last stage: with loss and backward);
        returns what it sends ``(forward, backward)``."""
        if module.is_first:
            inputs: tuple[torch.Tensor, ...] = ()
            args: tuple[torch.Tensor, ...] = (first_inputs[i],)
        else:
            inputs = tuple(x.detach().requires_grad_(train and x.is_floating_point()) for x in inbox.pop((v, i)))
            args = inputs
        out = module(*args, **kwargs[i])
        if module.is_last:
            scaled = out.float().sum() / n  # as the 1F1B path's loss_fn: the step loss is their sum
            losses.append(scaled.detach())
            if not train:
                return None, None
            scaled.backward()
            return None, (None if module.is_first else self._input_grads(inputs))
        outs = out if isinstance(out, tuple) else (out,)
        if train:
            saved[(v, i)] = (inputs, outs)
        return outs, None

    def _deliver(self, plan: LockstepPlan, phase: int, got_fwd: list[torch.Tensor], got_bwd: list[torch.Tensor],
                 inbox_fwd: dict, inbox_bwd: dict) -> None:
        """File what arrived after ``phase`` under the micro-batch the plan says its sender worked on (a stage may
        use it phases later: the last stage's input waits one phase); zeros from a sender that sent nothing are
        dropped."""
        received_fwd = self._unpack(got_fwd, forward=True) if got_fwd else None
        received_bwd = self._unpack(got_bwd, forward=False) if got_bwd else None
        for v, module in enumerate(self.modules):
            k = module.stage_index
            if received_fwd is not None and k > 0 and (i := plan.forward_of(k - 1, phase)) is not None:
                inbox_fwd[(v, i)] = received_fwd[v]
            if received_bwd is not None and not module.is_last and (j := plan.backward_of(k + 1, phase)) is not None:
                inbox_bwd[(v, j)] = received_bwd[v]
