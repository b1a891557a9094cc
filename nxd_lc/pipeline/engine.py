"""Pipeline-parallel training and evaluation steps on ``torch.distributed.pipelining``.

One optimizer step of a pipeline-parallel run processes this DP rank's whole share of the global batch,
``num_microbatches = global_batch_size / (micro_batch_size x DP)`` micro-batches of ``micro_batch_size`` rows
(NxD's rule), in one schedule call: :class:`torch.distributed.pipelining.Schedule1F1B` (one stage per rank) or
:class:`~torch.distributed.pipelining.ScheduleInterleaved1F1B` (``V = virtual_pipeline_model_parallel_size``
stages per rank, stage ``r + k x PP`` on pipeline rank ``r``). Activations and their gradients travel between
the ranks of each PP group (same DP, CP and TP rank) by point-to-point send / receive.

Loss and gradients match the non-pipelined run with gradient accumulation: each micro-batch's loss is its token
mean (CP-normalised), and the loss that is back-propagated is that value divided by ``num_microbatches``
(``scale_grads=False``: the scaling lives in the loss, so fp32 ``main_grad`` accumulation buffers are scaled too).
The step's loss is the sum of those scaled values, i.e. the mean over micro-batches; the last stage holds it and
it is summed over the PP group (zeros elsewhere), so every rank logs the same number.

Other objectives (:class:`~nxd_lc.pipeline.stage.StageObjective`, e.g. DPO / ORPO): :meth:`PipelineEngine.run_objective`
runs the same schedules with the objective on the last stage; every other tensor of the batch (``sample_index``,
reference log-probs, ...) travels as a schedule keyword argument, so torch chunks it along dim 0 with the
micro-batches. The objective's loss is back-propagated divided by ``num_microbatches`` as above, and its metrics
are returned per micro-batch, summed over the PP group (zeros on the ranks without the last stage), so every rank
holds the same values.

Every rank builds the schedule lazily for the first batch of a given shape and keeps it (one per shape / dtype).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
from torch import nn

from nxd_lc.distributed import collectives
from nxd_lc.distributed import parallel_state as ps
from nxd_lc.distributed.collectives import stage_all_reduce
from nxd_lc.pipeline.lockstep import LockstepRunner
from nxd_lc.pipeline.split import stages_of_rank
from nxd_lc.pipeline.stage import (
    CAUSAL_LM_SUMS,
    PipelineStageModule,
    StageObjective,
    meta_like,
    stage_activation_shape,
)
from nxd_lc.runtime.xla import collective_permute, is_xla_tensor
from nxd_lc.runtime.xla import sync as xla_sync

#: batch keys the stages take by name; any other tensor of the batch is an objective's extra keyword argument
_STAGE_KEYS = ("input_ids", "labels", "position_ids", "segment_ids")



@dataclass(frozen=True)
class PipelineOutput:
    """The result of :meth:`PipelineEngine.run_objective`, the same on every rank of the PP group.

    Attributes:
        loss: fp32 scalar (detached), the mean over micro-batches of the objective's loss.
        metrics: name -> fp32 ``[num_microbatches, *shape]`` (detached), each micro-batch's metric values.
    """

    loss: torch.Tensor
    metrics: dict[str, torch.Tensor]


def _schedule_kwargs(cls: type) -> dict[str, Any]:
    """``scale_grads=False`` where the schedule class takes it (torch >= 2.6; torch 2.9-2.13 all do). Older
    schedules never scaled, which is the same behaviour."""
    return {"scale_grads": False} if "scale_grads" in inspect.signature(cls.__init__).parameters else {}


class PipelineEngine:
    """Runs the rank's pipeline stages of a pipeline-cut Llama.

    Args:
        model: the rank model (``LlamaForCausalLM`` built with this rank's ``keep_layers`` / ``keep_embedding`` /
            ``keep_head``).
        layer_ranges: decoder layers of every stage (:func:`nxd_lc.pipeline.split.stage_layer_ranges`).
        virtual_size: ``V``, stages per pipeline rank.
        micro_batch_size: rows per micro-batch (a preference micro-batch of ``P`` pairs has ``2P`` rows).
        sequence_parallel: activations between stages are ``[B, S/tp, H]``.
        objective: the default objective of :meth:`run_objective` (None: the causal-LM loss everywhere).
    """

    def __init__(self, model: nn.Module, layer_ranges: Sequence[range], *, virtual_size: int,
                 micro_batch_size: int, sequence_parallel: bool,
                 objective: Optional[StageObjective] = None) -> None:
        self.pp = ps.get_pipeline_model_parallel_world_size()
        self.num_stages = self.pp * virtual_size
        if len(layer_ranges) != self.num_stages:
            raise ValueError(f"pipeline: {len(layer_ranges)} stage layer ranges for {self.num_stages} stages")
        self.virtual_size = virtual_size
        self.micro_batch_size = micro_batch_size
        self.sequence_parallel = sequence_parallel
        self.model = model
        stage_ids = stages_of_rank(ps.get_pipeline_model_parallel_rank(), self.pp, virtual_size)
        self.stage_modules = [PipelineStageModule(model, layer_ranges[s], s, self.num_stages) for s in stage_ids]
        self._schedules: dict[tuple[Any, ...], Any] = {}
        self.objective = objective

    # ---- schedule construction -------------------------------------------------------------------------------
    def _activation_dtype(self) -> torch.dtype:
        """dtype of the residual stream between stages: that of the parameters (fp32 under autocast, where
        the residual adds promote bf16 outputs back to fp32)."""
        layer = self.stage_modules[0].layers[0]
        return layer.input_layernorm.weight.dtype

    def _pipeline_stage(self, module: PipelineStageModule, seq_local: int, device: torch.device) -> Any:
        from nxd_lc.compat import pipeline_stage_class

        hidden = self.model.config.hidden_size
        tp = ps.get_tensor_model_parallel_world_size()
        act = stage_activation_shape(self.micro_batch_size, seq_local, hidden, tp, self.sequence_parallel)
        dtype = self._activation_dtype()
        carried = self.model.pipeline_statistics_size  # e.g. MoE routing statistics beside the hidden states
        stream: Any = (meta_like(act, dtype, device), meta_like((carried,), torch.float32, device)) if carried \
            else meta_like(act, dtype, device)
        inputs = meta_like((self.micro_batch_size, seq_local), torch.long, device) if module.is_first else stream
        outputs = meta_like((1,), torch.float32, device) if module.is_last else stream
        return pipeline_stage_class()(module, module.stage_index, self.num_stages, device, input_args=inputs,
                             output_args=outputs, group=ps.get_pipeline_model_parallel_group())

    def _schedule(self, num_microbatches: int, seq_local: int, device: torch.device, train: bool) -> Any:
        """The schedule for this batch shape: training 1F1B (one stage per rank; GPipe when there are fewer
        micro-batches than stages, which torch's 1F1B does not take) or interleaved 1F1B; evaluation runs
        forward only through GPipe / looped breadth-first order (any number of micro-batches)."""
        key = (num_microbatches, seq_local, str(device), self._activation_dtype(), train)
        if key not in self._schedules:
            from torch.distributed import pipelining as pl

            stages = [self._pipeline_stage(m, seq_local, device) for m in self.stage_modules]

            def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
                return output.sum() / num_microbatches

            if self.virtual_size == 1:
                use_1f1b = train and num_microbatches >= self.num_stages
                cls: type = pl.Schedule1F1B if use_1f1b else pl.ScheduleGPipe
                schedule = cls(stages[0], num_microbatches, loss_fn=loss_fn, **_schedule_kwargs(cls))
            else:
                cls = pl.ScheduleInterleaved1F1B if train else pl.ScheduleLoopedBFS
                schedule = cls(stages, num_microbatches, loss_fn=loss_fn, **_schedule_kwargs(cls))
            self._schedules[key] = schedule
        return self._schedules[key]

    # ---- steps ----------------------------------------------------------------------------------------------
    def _num_microbatches(self, rows: int) -> int:
        if rows % self.micro_batch_size:
            raise ValueError(f"pipeline: a batch of {rows} rows is not a whole number of micro-batches of "
                             f"{self.micro_batch_size} rows (data.micro_batch_size)")
        return rows // self.micro_batch_size

    def _run(self, batch: dict[str, torch.Tensor], train: bool, extra_kwargs: bool = False) -> torch.Tensor:
        input_ids, labels = batch["input_ids"], batch["labels"]
        rows, seq_local = input_ids.shape
        n = self._num_microbatches(rows)
        if train and self.virtual_size > 1 and n % self.pp:
            raise ValueError(f"pipeline: interleaved 1F1B needs num_microbatches ({n}) divisible by "
                             f"pipeline_model_parallel_size ({self.pp})")
        positions = batch.get("position_ids")
        if positions is None:
            positions = torch.arange(seq_local, device=input_ids.device).unsqueeze(0).expand(rows, seq_local)
        kwargs = {"position_ids": positions.contiguous(), "labels": labels}
        if batch.get("segment_ids") is not None:
            kwargs["segment_ids"] = batch["segment_ids"]
        if extra_kwargs:
            for key, value in batch.items():
                if key in _STAGE_KEYS or not torch.is_tensor(value):
                    continue
                if value.dim() == 0 or value.shape[0] % n:
                    raise ValueError(f"pipeline: batch tensor {key!r} of shape {tuple(value.shape)} does not split "
                                     f"into {n} micro-batches along dim 0")
                kwargs[key] = value
        losses: list[torch.Tensor] = []
        if is_xla_tensor(input_ids):  # no point-to-point on the XLA process group: the lockstep schedule
            firsts, per_micro = self._materialized_microbatches(input_ids, kwargs, n)
            losses = self._lockstep(seq_local, input_ids.device).run(n, train, firsts, per_micro, cut=xla_sync)
        else:
            schedule = self._schedule(n, seq_local, input_ids.device, train)
            args = (input_ids,) if any(m.is_first for m in self.stage_modules) else ()
            run = schedule.step if train else schedule.eval
            run(*args, target=labels, losses=losses, **kwargs)
        # ranks without the last stage add zeros, uploaded (device data: on XLA a zeros made on the device would be
        # a constant in the reduction's graph, which would then differ from the last stage's)
        local = torch.stack([x.detach().float().reshape(()) for x in losses]).sum().reshape(1) if losses else \
            torch.zeros(1).to(input_ids.device)
        return stage_all_reduce(local, ps.get_pipeline_model_parallel_group())[0]

    def _materialized_microbatches(self, input_ids: torch.Tensor, kwargs: dict[str, torch.Tensor], n: int
                                   ) -> tuple[list[torch.Tensor], list[dict[str, torch.Tensor]]]:
        """The ``n`` micro-batches of ``input_ids`` ``[n x B, S]`` and of every ``kwargs`` tensor (dim 0 split into
        ``n`` equal blocks) as tensors of their own, for the lockstep schedule on XLA.

        A slice ``t.chunk(n)[i]`` of one device tensor carries its offset ``i`` into every graph that reads it, so
        each phase graph compiled once per micro-batch index (17 / 25 / 41 graphs in step 1 at PP 2 for m = 4 / 8
        / 16, 43 / 67 / 211 at PP 4 for m = 8 / 16 / 64; on Neuron each is a neuronx-cc compile). Copies of the
        blocks are made here, before phase 0, so that they join the graph of phase 0's compute (cut before its
        exchange: the schedule's first cut) and are device data from then on: every later phase reads inputs of
        the same shape whatever ``i``, and the steady state's phases share their graphs (18 graphs at PP 2, 26 at
        PP 4, for any m; ``tests/test_xla_pipeline.py``). No graph execution is added. ``input_ids`` only on ranks
        holding the first stage (its only reader)."""
        firsts: list[torch.Tensor] = []
        if any(m.is_first for m in self.stage_modules):
            firsts = [c.clone() for c in input_ids.chunk(n)]
        per_micro = [{k: v.chunk(n)[i].clone() for k, v in kwargs.items()} for i in range(n)]
        return firsts, per_micro

    def _lockstep(self, seq_local: int, device: torch.device) -> LockstepRunner:
        """The torch-xla schedule (:mod:`nxd_lc.pipeline.lockstep`) for this sequence length, built for the first
        batch of a shape and kept (as the torch schedules)."""
        key = ("lockstep", seq_local, str(device), self._activation_dtype())
        if key not in self._schedules:
            self._schedules[key] = self._build_lockstep(seq_local, device)
        return self._schedules[key]

    def _build_lockstep(self, seq_local: int, device: torch.device) -> LockstepRunner:
        hidden = self.model.config.hidden_size
        tp = ps.get_tensor_model_parallel_world_size()
        stream = [(stage_activation_shape(self.micro_batch_size, seq_local, hidden, tp, self.sequence_parallel),
                   self._activation_dtype())]
        if self.model.pipeline_statistics_size:
            stream.append(((self.model.pipeline_statistics_size,), torch.float32))
        groups = ps.rank_layout(collectives.get_global_world_size(), ps.get_tensor_model_parallel_world_size(),
                                self.pp, ps.get_context_parallel_world_size())["pp"]
        return LockstepRunner(self.stage_modules, pipeline_size=self.pp,
                              pipeline_rank=ps.get_pipeline_model_parallel_rank(), stream=stream,
                              forward_pairs=collectives.shift_pairs(groups, 1, ring=self.virtual_size > 1),
                              backward_pairs=collectives.shift_pairs(groups, -1, ring=self.virtual_size > 1),
                              exchange=collective_permute, device=device)

    def train_step(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Forward and backward of every micro-batch of ``batch`` (``[num_microbatches x micro_batch_size, S]``
        tensors, already CP-sharded); gradients accumulate into the parameters (``.grad`` / ``main_grad``).

        Returns:
            The mean over micro-batches of the micro-batch losses (fp32 scalar, detached), the same on every
            pipeline rank. Collective over the PP group.

        Raises:
            ValueError: rows not a multiple of ``micro_batch_size``, or an interleaved schedule with
                ``num_microbatches % PP != 0``.
        """
        return self._run(batch, train=True)

    @torch.no_grad()
    def eval_step(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Forward only (the schedule's ``eval``) over the micro-batches of ``batch``.

        Returns:
            fp32 ``[2]``: this rank's ``[sum of token losses, number of labelled tokens]`` over the micro-batches
            (as ``LlamaForCausalLM.loss`` gives them, before any DP / CP reduction), the same on every pipeline
            rank. Collective over the PP group.
        """
        stage_batch = {k: batch[k] for k in _STAGE_KEYS if batch.get(k) is not None}
        return self.run_objective(stage_batch, train=False, objective=CAUSAL_LM_SUMS).metrics["sums"].sum(0)

    def run_objective(self, batch: dict[str, torch.Tensor], *, train: bool,
                      objective: Optional[StageObjective] = None) -> PipelineOutput:
        """All micro-batches of ``batch`` with ``objective`` (default :attr:`objective`) on the last stage:
        forward and backward (``train``; gradients accumulate as in :meth:`train_step`) or forward only.

        Args:
            batch: ``input_ids`` / ``labels`` (+ ``position_ids``, ``segment_ids``) ``[num_microbatches x
                micro_batch_size, S]`` (already CP-sharded and laid out so that each consecutive block of
                ``micro_batch_size`` rows is one micro-batch), plus any tensors for the objective whose dim 0
                splits into ``num_microbatches`` equal chunks (e.g. ``sample_index [num_microbatches x P]``).
            train: run the training schedule (backward included); else the forward-only one, without grad.
            objective: overrides :attr:`objective` for this call.
        Returns:
            :class:`PipelineOutput`, the same on every pipeline rank. Collective over the PP group.
        Raises:
            ValueError: no objective, or a batch that does not split into micro-batches.
        """
        objective = objective or self.objective
        if objective is None:
            raise ValueError("pipeline: run_objective needs a StageObjective (engine.objective or objective=)")
        n = self._num_microbatches(batch["input_ids"].shape[0])
        batch = self._pad_for_forward_only(batch, n, train)
        last = [m for m in self.stage_modules if m.is_last]
        for m in last:
            m.objective, m.objective_records = objective, []
        try:
            with torch.set_grad_enabled(train and torch.is_grad_enabled()):
                self._run(batch, train=train, extra_kwargs=True)
            records = [r for m in last for r in (m.objective_records or [])]
        finally:
            for m in last:
                m.objective, m.objective_records = None, None
        return self._reduce_records(records[:n], objective, n, batch["input_ids"].device)

    def _pad_for_forward_only(self, batch: dict[str, torch.Tensor], n: int, train: bool) -> dict[str, torch.Tensor]:
        """On torch < 2.10 a forward-only run of fewer than ``num_stages`` micro-batches is padded with copies of
        the first micro-batch (their records are dropped): GPipe refuses fewer, and looped BFS (interleaved stages)
        returns garbage (NaN losses, seen in tests) with fewer."""
        from nxd_lc.compat import pipeline_eval_needs_stage_count_microbatches

        if train or n >= self.num_stages or not pipeline_eval_needs_stage_count_microbatches():
            return batch
        pad = self.num_stages - n
        out = dict(batch)
        for key, value in batch.items():
            if torch.is_tensor(value) and value.dim() > 0:
                first = value[: value.shape[0] // n]
                out[key] = torch.cat([value, *([first] * pad)])
        return out

    @staticmethod
    def _reduce_records(records: list[dict[str, torch.Tensor]], objective: StageObjective, n: int,
                        device: torch.device) -> PipelineOutput:
        """The last stage's per-micro-batch records -> :class:`PipelineOutput` (one all-reduce over PP)."""
        shapes: dict[str, tuple[int, ...]] = {"loss": (), **{k: tuple(v) for k, v in objective.metric_shapes.items()}}
        sizes = [int(torch.Size(s).numel()) for s in shapes.values()]
        if records:
            local = torch.cat([torch.stack([r[k].reshape(-1) for r in records]) for k in shapes], dim=1)
        else:
            local = torch.zeros(n, sum(sizes), dtype=torch.float32).to(device)  # device data (see _run)
        total = stage_all_reduce(local.contiguous(), ps.get_pipeline_model_parallel_group())  # [n, sum]
        parts = dict(zip(shapes, torch.split(total, sizes, dim=1)))
        metrics = {k: parts[k].reshape(n, *shape) for k, shape in shapes.items()}
        return PipelineOutput(loss=metrics.pop("loss").mean(), metrics=metrics)

    def parameters(self) -> list[nn.Parameter]:
        """Parameters of this rank's stages (those of the rank model)."""
        return [p for m in self.stage_modules for p in m.parameters()]


def build_engine(model: nn.Module, layer_ranges: Sequence[range], *, virtual_size: int, micro_batch_size: int,
                 sequence_parallel: bool, objective: Optional[StageObjective] = None) -> Optional[PipelineEngine]:
    """A :class:`PipelineEngine` when pipeline parallelism is on (PP > 1), else None."""
    if ps.get_pipeline_model_parallel_world_size() == 1:
        return None
    return PipelineEngine(model, layer_ranges, virtual_size=virtual_size, micro_batch_size=micro_batch_size,
                          sequence_parallel=sequence_parallel, objective=objective)
