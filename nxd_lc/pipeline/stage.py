"""One pipeline stage of a (plain, pipeline-cut) :class:`~nxd_lc.models.llama.LlamaForCausalLM`.

Shapes: ``B`` micro batch, ``S`` this rank's sequence (``S / cp`` under context parallelism), ``H`` hidden,
``tp`` TP size. The activation passed between stages is the residual stream ``[B, S(/tp), H]`` (``S/tp`` under
sequence parallelism), in the parameters' dtype.

    first stage:  forward(input_ids [B, S], position_ids, segment_ids, labels) -> h [B, S(/tp), H]
    middle stage: forward(h,                position_ids, segment_ids, labels) -> h [B, S(/tp), H]
    last stage:   forward(h,                position_ids, segment_ids, labels) -> loss [1] fp32

A model whose layers return statistics (mixture of experts: ``model.pipeline_statistics_size`` > 0) sends them
on beside the hidden states: non-first stages take ``(h, stats)``, non-last stages return ``(h, stats
[pipeline_statistics_size] fp32)``, and the last stage's causal-LM loss adds the model's auxiliary term
(``model.add_auxiliary_loss``, e.g. the load-balancing loss over every MoE layer of the micro-batch).

The last stage returns the micro-batch's token-mean loss (under CP this rank's share scaled by CP, see
:func:`nxd_lc.context.context_parallel_loss`) as a ``[1]`` tensor, so the schedule can stack the per-micro-batch
values. A :class:`StageObjective` set on the stage (``stage.objective``) replaces that causal-LM loss: it maps
(rank model, lm-head input ``[B, S, H]``, the micro-batch's keyword tensors) to (the loss to back-propagate,
detached metric tensors), e.g. the DPO / ORPO losses of :mod:`nxd_lc.alignment`; extra keyword tensors
(``sample_index``, reference log-probs, ...) reach every stage and are used by the objective only.

The model is not rewritten per stage: the stage registers the rank model's own modules (embedding, its layers,
final norm, lm head), so parameters, checkpoints and the optimizer stay those of the rank model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import nn

from nxd_lc.context import context_parallel_loss

#: (rank model, lm-head input hidden [B, S, H], the micro-batch's keyword tensors) -> (scalar fp32 loss to
#: back-propagate, {name: detached metric tensor})
ObjectiveFn = Callable[[nn.Module, torch.Tensor, dict[str, torch.Tensor]],
                       tuple[torch.Tensor, dict[str, torch.Tensor]]]


@dataclass(frozen=True)
class StageObjective:
    """The last stage's objective in place of the causal-LM token-mean loss.

    Attributes:
        fn: see :data:`ObjectiveFn`. ``hidden`` is :meth:`LlamaForCausalLM.head_input` of the last layer's output
            (TP-region input of the lm head; use ``model.logits_from_hidden``). The loss is what the schedule
            back-propagates (divided by ``num_microbatches``): it must already carry any CP factor.
        metric_shapes: name -> shape of each metric the function returns per micro-batch (``()`` for scalars);
            the engine needs them to take part in the PP all-reduce on ranks without the last stage.
    """

    fn: ObjectiveFn
    metric_shapes: dict[str, tuple[int, ...]]


def causal_lm_objective(model: nn.Module, hidden: torch.Tensor,
                        kwargs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The last stage's default objective: the micro-batch's token-mean causal-LM loss (this CP rank's share,
    scaled by CP, :func:`nxd_lc.context.context_parallel_loss`), with its ``[loss_sum, num_tokens]`` (fp32 ``[2]``,
    before any DP / CP reduction) as the metric ``sums``."""
    from nxd_lc.models.common.loss import causal_lm_loss_from_hidden

    loss_sum, num_tokens = causal_lm_loss_from_hidden(model, hidden, kwargs["labels"])
    loss_sum = model.add_auxiliary_loss(loss_sum, num_tokens)
    sums = torch.stack([loss_sum.detach().float(), num_tokens.detach().float()])
    return context_parallel_loss(loss_sum, num_tokens), {"sums": sums}


#: the causal-LM objective with its per-micro-batch sums recorded (``PipelineEngine.eval_step``)
CAUSAL_LM_SUMS = StageObjective(causal_lm_objective, {"sums": (2,)})


class PipelineStageModule(nn.Module):
    """Stage ``stage_index`` of ``num_stages``: decoder layers ``layer_ids`` of ``model`` (plus the embedding on
    the first stage and final norm + lm head + loss on the last).

    Args:
        model: the rank's pipeline-cut ``LlamaForCausalLM`` (built with ``keep_layers`` / ``keep_embedding`` /
            ``keep_head``); must hold every module this stage needs.
        layer_ids: decoder-layer indices of this stage, in order.
        stage_index, num_stages: position of the stage in the pipeline.

    Raises:
        ValueError: ``model`` lacks a module this stage needs (a layer of another stage, the embedding on the
            first stage, the head on the last).
    """

    def __init__(self, model: nn.Module, layer_ids: Sequence[int], stage_index: int, num_stages: int) -> None:
        super().__init__()
        self.stage_index, self.num_stages = stage_index, num_stages
        self.is_first, self.is_last = stage_index == 0, stage_index == num_stages - 1
        local = dict(model.local_layers())
        missing = [i for i in layer_ids if i not in local]
        if missing or (self.is_first and model.embed_tokens is None) or (self.is_last and model.lm_head is None):
            raise ValueError(f"pipeline stage {stage_index}: the rank model lacks layers {missing} or its "
                             "embedding / head; build it with the stage's keep_layers / keep_embedding / keep_head")
        self.layer_ids = list(layer_ids)
        self.layers = nn.ModuleList(local[i] for i in self.layer_ids)
        self.embed_tokens = model.embed_tokens if self.is_first else None
        self.embed_positions = model.embed_positions if self.is_first else None  # learned positions (or None)
        self.rotary_emb = model.rotary_emb
        self._model = [model]  # a list: the rank model is not a child (its parameters are not this stage's)
        #: replaces the causal-LM loss of the last stage when set (see :class:`StageObjective`)
        self.objective: StageObjective | None = None
        #: when a list, the last stage appends ``{"loss": detached loss, **metrics}`` of each micro-batch (objective)
        self.objective_records: list[dict[str, torch.Tensor]] | None = None

    @property
    def model(self) -> nn.Module:
        """The rank model this stage belongs to."""
        return self._model[0]

    def forward(self, x: torch.Tensor, *carried: torch.Tensor, position_ids: torch.Tensor | None = None,
                segment_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                **extra: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """See the module docstring; ``carried``: the previous stage's statistics (models that carry some);
        ``labels`` [B, S] (shifted, -100 = no target) is used by the last stage; ``extra`` keyword tensors
        (chunked per micro-batch along dim 0) are passed to the objective only.

        Raises:
            ValueError: bad shapes (first stage: as ``LlamaForCausalLM.hidden_states``), or no labels on the
                last stage.
        """
        model = self.model
        if self.is_first:
            position_ids = model._check_inputs(x, position_ids)
            model._check_segment_ids(segment_ids, x)
            h = model.embed(x, position_ids)
        else:
            h = x
        if position_ids is None:
            raise ValueError(f"pipeline stage {self.stage_index}: position_ids are required after the first stage")
        cos, sin = model.position_encoding(position_ids)
        stats = model.pipeline_statistics_size > 0
        if stats:
            model.begin_pipeline_stage(None if self.is_first else carried[0])
        for layer in self.layers:
            h = model.collect_layer_statistics(layer(h, cos, sin, segment_ids))
        if not self.is_last:
            return (h, model.end_pipeline_stage()) if stats else h
        if labels is None:
            raise ValueError("pipeline: the last stage needs the micro-batch's labels")
        if self.objective is not None:
            kwargs = {"position_ids": position_ids, "segment_ids": segment_ids, "labels": labels, **extra}
            return self._objective_output(model.head_input(h), kwargs)
        return causal_lm_objective(model, model.head_input(h), {"labels": labels})[0].reshape(1)

    def _objective_output(self, hidden: torch.Tensor, kwargs: dict[str, torch.Tensor | None]) -> torch.Tensor:
        """Run :attr:`objective` on the lm-head input ``[B, S, H]``; record loss and metrics; the loss as ``[1]``."""
        assert self.objective is not None
        loss, metrics = self.objective.fn(self.model, hidden, {k: v for k, v in kwargs.items() if v is not None})
        missing = set(self.objective.metric_shapes) - set(metrics)
        if missing:
            raise ValueError(f"pipeline objective: metrics {sorted(missing)} declared in metric_shapes are missing")
        if self.objective_records is not None:
            record = {k: metrics[k].detach().float() for k in self.objective.metric_shapes}
            self.objective_records.append({"loss": loss.detach().float().reshape(()), **record})
        return loss.float().reshape(1)

    def extra_repr(self) -> str:
        return f"stage={self.stage_index}/{self.num_stages}, layers={self.layer_ids[0]}..{self.layer_ids[-1]}"


def stage_activation_shape(batch_rows: int, seq_local: int, hidden: int, tp: int,
                           sequence_parallel: bool) -> tuple[int, ...]:
    """Shape of the activation sent between stages: ``[B, S/tp, H]`` under sequence parallelism, else
    ``[B, S, H]`` (``S`` = this rank's sequence after the CP split)."""
    return (batch_rows, seq_local // tp if sequence_parallel else seq_local, hidden)


def meta_like(shape: Sequence[int], dtype: torch.dtype, device: Any) -> torch.Tensor:
    """An uninitialised tensor of ``shape`` / ``dtype`` on ``device``: a shape/dtype template for
    ``PipelineStage``. Floating templates require grad (activations whose gradients travel back between stages;
    torch's pipelining derives the gradient buffers from that flag)."""
    return torch.empty(tuple(shape), dtype=dtype, device=device, requires_grad=dtype.is_floating_point)
