"""The LightningModule for causal-LM pretraining over tensor/sequence-parallel Llama layers.

Batch layout (from :mod:`nxd_lc.data`): ``input_ids``, ``labels``, ``position_ids``, each ``[B, S]`` long, where
``labels[b, t]`` is the target of position ``t`` (already shifted) and ``-100`` marks tokens without a loss.

Per micro-batch the loss is the mean over its labelled tokens; Lightning divides it by the number of
accumulation steps, and gradients are averaged over the data-parallel group in :meth:`on_before_optimizer_step`
(NxD semantics: mean over micro-batches and DP ranks). Before that hook, sequence-parallel norm gradients are
all-reduced over TP and replicated KV-head gradients over the KV-shared group.

Context parallelism (``context_parallel_size > 1``): each micro-batch is sharded over the CP group once, at the
step boundary (:meth:`_context_parallel_shard`, ring head-tail or Ulysses contiguous layout), and each CP rank's
loss is ``local token-loss sum x cp / all CP ranks' token count``, so the DP x CP gradient average is the
gradient of the micro-batch's token mean (:func:`nxd_lc.context.context_parallel_loss`).

Pipeline parallelism (``pipeline_model_parallel_size > 1``): a training batch holds all micro-batches of the step
(``num_microbatches x micro_batch_size`` rows) and :meth:`training_step` runs them through the
:class:`~nxd_lc.pipeline.PipelineEngine` schedule, forward and backward; Lightning's gradient zeroing (between
``training_step`` and ``backward``) and ``backward`` are therefore skipped (:meth:`optimizer_zero_grad`,
:meth:`backward`) and gradients are zeroed before the schedule instead. The reductions, clipping and the optimizer
step are the same as without pipelining (plus the tied-embedding all-reduce over the first and last stage).

Length curriculum (``data.curriculum``, :mod:`nxd_lc.data.curriculum`): before each training batch and each
validation the stage of the current optimizer step is made active (:meth:`_enter_stage`: its RoPE, set in place on
the model's rotary embedding), and each step advances ``consumed_samples`` by its stage's global batch.

Static graphs (torch-xla / Neuron; README "XLA"): nothing in a step reads a device value back to the host
(no ``.item()``, no printing, no Python branch on a tensor value), and metric tensors are computed inside the
step and logged without ``prog_bar`` (Lightning converts progress-bar values to Python numbers every batch).
Loggers and :class:`~nxd_lc.lightning.callbacks.MetricsPrinter` read them back only every
``log_every_n_steps``. On XLA the lazy graph is cut at three step boundaries, all through
:meth:`NxDLanguageModel._step_boundary` (the one caller of :func:`nxd_lc.runtime.xla.sync`): after each
micro-batch's backward, after the optimizer step and its metrics, and after each validation step.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import pytorch_lightning as pl
import torch

from nxd_lc.config.schema import NxdConfig
from nxd_lc.context import context_parallel_loss, get_context_parallel_algo, shard_batch_for_context_parallel
from nxd_lc.data.curriculum import CurriculumStage, curriculum_stages, stage_at
from nxd_lc.distributed import collectives, grads
from nxd_lc.distributed import parallel_state as ps
from nxd_lc.distributed.grads import gradient_bucket_size_mb
from nxd_lc.lightning.callbacks import write_step_metrics
from nxd_lc.lightning.nonfinite import NonFiniteStepGuard
from nxd_lc.models.common.compile import mark_cuda_graph_step
from nxd_lc.optim import build_optimizer, build_scheduler, install_fp32_grad_accumulation
from nxd_lc.precision import apply_precision, resolve_precision
from nxd_lc.runtime import xla as xla_runtime

_log = logging.getLogger(__name__)


class NxDLanguageModel(pl.LightningModule):
    """Wraps a TP/SP decoder (``forward(input_ids, position_ids) -> logits_local [B, S, V/tp]``) for training.

    Args:
        cfg: the validated run config.
        model: the decoder, already sharded for this rank.
        consumed_samples_fn: returns the data module's consumed-sample count (logged, used in checkpoint names).
        advance_samples_fn: called with the step's global batch (:meth:`step_global_batch_size`) after each
            optimizer step.
    """

    def __init__(self, cfg: NxdConfig, model: torch.nn.Module,
                 consumed_samples_fn: Callable[[], int] = lambda: 0,
                 advance_samples_fn: Callable[[int], None] = lambda n: None) -> None:
        super().__init__()
        self.cfg = cfg
        self.precision_policy = resolve_precision(cfg)
        self.model = apply_precision(model, self.precision_policy)
        self._grad_acc_hooks: Optional[list[Any]] = None
        self._consumed_samples_fn = consumed_samples_fn
        self._advance_samples_fn = advance_samples_fn
        self._loss_acc: Optional[torch.Tensor] = None  # sum of micro-batch losses since the last step
        self._loss_count = 0
        self._grad_norm: Optional[torch.Tensor] = None
        # trainer.check_for_nan_in_loss_and_grad: a NaN / inf step is not applied; the run stops after N in a row
        self.nonfinite_guard = (NonFiniteStepGuard(cfg.trainer.max_consecutive_nonfinite_steps)
                                if cfg.trainer.check_for_nan_in_loss_and_grad else None)
        self._guard_checked_step = -1
        self._val_loss_sum: Optional[torch.Tensor] = None
        self._schedule_base_lrs: Optional[list[float]] = None  # peak lr per group, from configure_optimizers
        self.pipeline = self._build_pipeline()
        self.curriculum = curriculum_stages(cfg)  # data.curriculum: RoPE and global batch per stage
        self._stage: Optional[CurriculumStage] = None
        rotary = getattr(model, "rotary_emb", None)
        self._model_rope = rotary.spec if rotary is not None else None

    def _build_pipeline(self, model: Optional[torch.nn.Module] = None) -> Any:
        """The :class:`~nxd_lc.pipeline.PipelineEngine` of this rank's stages at PP > 1, else None: over
        ``model`` (default: the policy, :attr:`model`; another model must have the policy's layers, e.g. a frozen
        copy of it)."""
        if ps.get_pipeline_model_parallel_world_size() == 1:
            return None
        from nxd_lc.pipeline import PipelineEngine, stage_layer_ranges

        model = self.model if model is None else model
        ds = self.cfg.distributed_strategy
        ranges = stage_layer_ranges(len(self.model.layers), ds.pipeline_model_parallel_size,
                                    ds.virtual_pipeline_model_parallel_size, self.cfg.model.pipeline_cuts)
        return PipelineEngine(model, ranges, virtual_size=ds.virtual_pipeline_model_parallel_size,
                              micro_batch_size=self._pipeline_micro_batch_rows(),
                              sequence_parallel=ds.sequence_parallel)

    def _pipeline_micro_batch_rows(self) -> int:
        """Rows of one pipeline micro-batch: ``data.micro_batch_size`` (preference batches: twice that)."""
        return self.cfg.data.micro_batch_size

    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: torch.optim.Optimizer) -> None:
        """Lightning zeroes gradients between ``training_step`` and ``backward``; under pipeline parallelism the
        backward already ran inside ``training_step``, so gradients are zeroed there, before the schedule."""
        if self.pipeline is None:
            super().optimizer_zero_grad(epoch, batch_idx, optimizer)

    def _zero_grad_before_pipeline(self) -> None:
        """Zero the gradients before a pipeline schedule accumulates the step's: through the trainer's optimizers
        (which also clear fp32 ``main_grad`` buffers / ZeRO-1 state), or the model's ``.grad`` without a trainer."""
        if self._trainer is None:
            self.model.zero_grad(set_to_none=True)
            return
        for optimizer in self.trainer.optimizers:
            optimizer.zero_grad(set_to_none=True)

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """``loss.backward()``, except under pipeline parallelism, where the schedule has already run every
        micro-batch's backward inside :meth:`training_step`."""
        if self.pipeline is None:
            super().backward(loss, *args, **kwargs)

    # ---- lazy-graph step boundaries -------------------------------------------------------------------------
    def _step_boundary(self) -> None:
        """Cut the lazy graph on XLA (:func:`nxd_lc.runtime.xla.sync`); a no-op on CPU/CUDA."""
        if self.device.type == "xla":
            xla_runtime.sync()

    def on_after_backward(self) -> None:
        """Micro-batch boundary: forward + backward (+ gradient accumulation) form one graph."""
        self._step_boundary()

    # ---- forward / loss -------------------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Logits shard ``[B, S, V/tp]`` for ``input_ids [B, S]``."""
        return self.model(input_ids, position_ids)

    def _loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(sum of per-token losses fp32 scalar, number of labelled tokens) of one micro-batch.

        Through ``model.loss`` (:meth:`nxd_lc.models.llama.LlamaForCausalLM.loss`), so the tiled cross-entropy
        (``model.tiled_loss_chunk_size``) never materialises the ``[B, S, V/tp]`` logits.
        """
        return self.model.loss(batch["input_ids"], batch["labels"], batch.get("position_ids"),
                               segment_ids=batch.get("segment_ids"))

    def _context_parallel_shard(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This CP rank's share of the micro-batch (the one place a batch is split over CP; identity at CP 1).

        Missing ``position_ids`` are filled with ``0..S-1`` first, so RoPE positions follow the shard.
        """
        cp = ps.get_context_parallel_world_size()
        if cp == 1:
            return batch
        if batch.get("position_ids") is None:
            ids = batch["input_ids"]
            positions = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0).expand_as(ids)
            batch = {**batch, "position_ids": positions}
        algo = self.cfg.distributed_strategy.context_parallel_algo
        if algo != get_context_parallel_algo():
            raise RuntimeError(
                f"distributed_strategy.context_parallel_algo is {algo!r} but the attention uses "
                f"{get_context_parallel_algo()!r}: call nxd_lc.context.set_context_parallel_algo(...) at startup"
            )
        return shard_batch_for_context_parallel(batch, ps.get_context_parallel_rank(), cp, algo)

    # ---- data.curriculum ---------------------------------------------------------------------------------------
    def _enter_stage(self) -> None:
        """Make the curriculum stage of the current optimizer step the active one: its RoPE on the model (a
        stage's ``rope_scaling``, else the model's own; :meth:`RotaryEmbedding.set_spec`, in place)."""
        if self.curriculum is None:
            return
        stage = stage_at(self.curriculum, int(self.trainer.global_step))
        if stage is self._stage:
            return
        if self.model.rotary_emb is None:  # learned positions: no RoPE to set (validation refuses rope_scaling)
            self._stage = stage
            return
        from nxd_lc.models.common.rope import rope_spec_with_scaling

        spec = rope_spec_with_scaling(self._model_rope, stage.rope_scaling,
                                      key=f"data.curriculum[{stage.index}].rope_scaling")
        if self.model.rotary_emb.spec != spec:
            self.model.rotary_emb.set_spec(spec)
        self._stage = stage

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._enter_stage()
        self._seed_device_stream()

    def _seed_device_stream(self) -> None:
        """On XLA, every micro-batch draws its random numbers (dropout masks) from a stream seeded by ``seed``, the
        optimizer step and the micro-batch's index in it (:func:`nxd_lc.runtime.xla.seed_device_stream`): the masks
        then follow the run's seed, repeat after a resume, and do not depend on how many graph cuts the layout took
        before (so a TP layout draws the masks of one device: :mod:`nxd_lc.layers.dropout`)."""
        if self.device.type != "xla":
            return
        step = int(self._trainer.global_step) if self._trainer is not None else 0
        xla_runtime.seed_device_stream(xla_runtime.stream_seed(self.cfg.seed, step, self._loss_count))

    def on_validation_start(self) -> None:
        self._enter_stage()

    def step_global_batch_size(self) -> int:
        """Samples of the current optimizer step over all DP ranks: the curriculum stage's global batch, else
        ``data.global_batch_size``."""
        return self._stage.global_batch_size if self._stage is not None else self.cfg.data.global_batch_size

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        """Token-mean loss of the micro-batch (fp32 scalar); under CP, this rank's share of the mean over all
        CP ranks' tokens, scaled by CP (see :func:`nxd_lc.context.context_parallel_loss`). Under PP the batch is
        the whole step and the returned value is the (detached) mean micro-batch loss, gradients already
        computed by the schedule."""
        batch = self._context_parallel_shard(batch)
        if self.cfg.model.enable_cuda_graph:  # the compiled layers' CUDA graphs may overwrite the last step's outputs
            mark_cuda_graph_step()
        if self.pipeline is not None:  # all micro-batches of the step, forward and backward (1F1B)
            self._zero_grad_before_pipeline()
            loss = self.pipeline.train_step(batch)
        else:
            loss_sum, num_tokens = self._loss(batch)
            loss = context_parallel_loss(loss_sum, num_tokens)
        self._accumulate_loss(loss)
        return loss

    def _accumulate_loss(self, loss: torch.Tensor) -> None:
        """Add a micro-batch's loss (detached) to the step's sum behind ``reduced_train_loss``."""
        detached = loss.detach()
        self._loss_acc = detached if self._loss_acc is None else self._loss_acc + detached
        self._loss_count += 1

    @staticmethod
    def _data_parallel_mean(value: torch.Tensor) -> torch.Tensor:
        """Mean of ``value`` over the DP x CP group (a new tensor; one all-reduce)."""
        total = collectives.all_reduce(value.clone(), ps.get_data_parallel_group(with_context_parallel=True))
        return total / ps.get_data_parallel_world_size(with_context_parallel=True)

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        """Accumulate token-weighted validation loss; reduced over DP x CP in :meth:`on_validation_epoch_end`."""
        batch = self._context_parallel_shard(batch)
        if self.pipeline is not None:
            pair = self.pipeline.eval_step(batch)
        else:
            loss_sum, num_tokens = self._loss(batch)
            tokens = torch.as_tensor(num_tokens, dtype=torch.float32, device=loss_sum.device)
            pair = torch.stack([loss_sum.detach().float(), tokens])
        self._val_loss_sum = pair if self._val_loss_sum is None else self._val_loss_sum + pair
        self._step_boundary()

    def on_validation_epoch_start(self) -> None:
        self._val_loss_sum = None

    def on_validation_epoch_end(self) -> None:
        """Log ``val_loss``: token-weighted mean over all validation batches of all DP ranks."""
        pair = self._val_loss_sum if self._val_loss_sum is not None else torch.zeros(2, device=self.device)
        pair = collectives.all_reduce(pair.clone(), ps.get_data_parallel_group(with_context_parallel=True))
        val_loss = pair[0] / torch.clamp(pair[1], min=1.0)
        self.log("val_loss", val_loss, prog_bar=True, rank_zero_only=False, sync_dist=False)
        self.log_logger_step(int(self.trainer.global_step))

    def log_logger_step(self, step: int) -> None:
        """Log ``step``, the number of optimizer steps done (``trainer.global_step`` once Lightning has counted the
        current one): Lightning's logger connector takes a logged ``step`` as the loggers' x-axis instead of its
        0-based count of finished steps, so TensorBoard's step is the optimizer step as printed and as in the
        checkpoint names (1-based; a validation after step 45 at 45). Called in :meth:`_log_step_metrics` (inside
        ``optimizer_step``, before Lightning counts the step: ``global_step + 1``; so before any
        ``on_train_batch_end`` hook reads or writes the step's values) and in ``on_validation_epoch_end``. A CPU
        tensor: nothing is read from the device. ``ModelCheckpoint`` reads the same value for ``{step}`` and
        ``monitor: step``."""
        self.log("step", torch.tensor(float(step)), rank_zero_only=False, sync_dist=False)

    # ---- optimizer step -------------------------------------------------------------------------------------
    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        """Parameters with ``requires_grad`` (the ones reduced, clipped and stepped)."""
        return [p for p in self.model.parameters() if p.requires_grad]

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Reduce gradients (SP norms over TP, KV replicas, then DP mean) and compute the global grad norm."""
        grads.allreduce_sequence_parallel_gradients(self.model)
        grads.allreduce_kv_replica_gradients(self.model)
        params = self.trainable_parameters()
        if self.pipeline is not None and getattr(self.model.config, "tie_word_embeddings", False):
            with collectives.stage_isolated(self.device):  # first + last stage: a graph of its own on XLA
                grads.allreduce_tied_embedding_gradients(params)  # embedding (first stage) + lm head (last)
        grads.allreduce_data_parallel_gradients(params, with_context_parallel=True,
                                                bucket_size_mb=gradient_bucket_size_mb(self.cfg),
                                                fp32=self.cfg.precision.fp32_grads_cc)
        need_norm = (self.cfg.exp_manager.log_gradient_norm or self.cfg.trainer.gradient_clip_val
                     or self.nonfinite_guard is not None)
        self._grad_norm = grads.global_grad_norm(params) if need_norm else None
        if self.nonfinite_guard is not None and self._grad_norm is not None:
            step = int(self.trainer.global_step) + 1 if self._trainer is not None else None
            self.nonfinite_guard.before_step(self._grad_norm, step, optimizer, params)

    def configure_gradient_clipping(self, optimizer: torch.optim.Optimizer,
                                    gradient_clip_val: Optional[float] = None,
                                    gradient_clip_algorithm: Optional[str] = None) -> None:
        """Clip by the global 2-norm over TP/PP/DP computed in :meth:`on_before_optimizer_step`.

        Parameters replicated over TP are counted once (see :func:`nxd_lc.distributed.grads.global_grad_norm`);
        the coefficient is ``max_norm / (norm + 1e-6)`` as in ``torch.nn.utils.clip_grad_norm_``.
        """
        if not gradient_clip_val or self._grad_norm is None:
            return
        grads.scale_grads_(self.trainable_parameters(), torch.clamp(gradient_clip_val / (self._grad_norm + 1e-6),
                                                                     max=1.0))

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any,
                       optimizer_closure: Optional[Callable[[], Any]] = None) -> None:
        """Step, then advance consumed samples and log the step's metrics (device tensors, not read back here),
        then cut the lazy graph on XLA so that callbacks reading metrics find them computed."""
        super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)
        if self.nonfinite_guard is not None:
            self.nonfinite_guard.after_step(optimizer)
        self._advance_samples_fn(self.step_global_batch_size())
        self._log_step_metrics(optimizer)
        self._step_boundary()

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        """After the last step (``trainer.max_steps``), write its logged values to the loggers, as at every
        ``log_every_n_steps``-th step (:func:`~nxd_lc.lightning.callbacks.write_step_metrics`; Lightning writes only
        at those steps, so a run of 7 steps logging every 5 printed step 7 but never wrote it to TensorBoard).

        On XLA, at an optimizer-step boundary where the host reads the device anyway (a logging step, the last
        step), read the non-finite counters (:meth:`NonFiniteStepGuard.check`; raises when the limit was reached).
        Checkpoint saves check in :meth:`on_save_checkpoint`."""
        guard, trainer = self.nonfinite_guard, self.trainer
        step = int(trainer.global_step)
        if 0 < int(trainer.max_steps) <= step:  # the console prints the last step: TensorBoard gets it too
            write_step_metrics(trainer)
        if guard is None or not guard.in_graph or step == self._guard_checked_step:
            return
        if step % max(int(self.cfg.trainer.log_every_n_steps), 1) == 0 or step >= int(trainer.max_steps):
            self._guard_checked_step = step
            guard.check()

    def on_train_start(self) -> None:
        """After Lightning restored a checkpoint: the learning rate of the next step is this run's schedule's
        (:meth:`apply_run_schedule`)."""
        self.apply_run_schedule()

    def apply_run_schedule(self) -> None:
        """Make each step scheduler follow this run's ``model.optim.sched`` from the restored step on.

        Lightning restores the scheduler's state (step count, peak learning rates) and the optimizer's groups
        (their ``lr``, ``initial_lr``) from the checkpoint, so the first step after a resume ran at the learning
        rate the *saved* run's schedule gave (after a resume with a larger ``trainer.max_steps``, the old
        schedule's value at the restored step), and the following ones combined the saved peaks with this run's
        schedule. Here every ``LambdaLR`` gets this run's peaks back (``base_lrs`` and each group's
        ``initial_lr``, as :meth:`configure_optimizers` built them) and each group's ``lr`` becomes
        ``peak x factor(restored step)`` of this run's schedule; one log line names a learning rate that changed.
        A fresh start is left as it is (the same values). Other schedulers are not touched.
        """
        peaks = self._schedule_base_lrs
        if self._trainer is None or peaks is None:
            return
        for config in self.trainer.lr_scheduler_configs:
            sched = config.scheduler
            if not isinstance(sched, torch.optim.lr_scheduler.LambdaLR) or len(sched.lr_lambdas) != len(peaks):
                continue
            step = int(sched.last_epoch)
            lrs = [peak * factor(step) for factor, peak in zip(sched.lr_lambdas, peaks)]
            groups = sched.optimizer.param_groups
            before = [float(g["lr"]) for g in groups]
            sched.base_lrs = list(peaks)
            for group, lr, peak in zip(groups, lrs, peaks):
                group["initial_lr"] = peak
                if isinstance(group["lr"], torch.Tensor):  # a capturable optimizer's device learning rate
                    group["lr"].fill_(lr)
                else:
                    group["lr"] = lr
            sched._last_lr = [g["lr"] for g in groups]
            if self.trainer.is_global_zero and any(abs(a - b) > 1e-12 * max(abs(a), abs(b), 1.0)
                                                   for a, b in zip(before, lrs)):
                _log.info("lr schedule: step %d resumes at lr %.4e of this run's model.optim.sched (max_steps %s; "
                          "the checkpoint's schedule gave %.4e)", step + 1, lrs[0],
                          self.cfg.model.optim.sched.max_steps or self.cfg.trainer.max_steps, before[0])

    def on_train_end(self) -> None:
        """The run ends: non-finite steps since the last read stop it with an error (XLA; see
        :meth:`on_train_batch_end`)."""
        if self.nonfinite_guard is not None:
            self.nonfinite_guard.check()

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Before any checkpoint file is written: a run that reached ``trainer.max_consecutive_nonfinite_steps``
        on XLA (not read back yet) stops here instead of saving (:class:`~nxd_lc.lightning.nonfinite.
        NonFiniteTrainingError`)."""
        if self.nonfinite_guard is not None:
            self.nonfinite_guard.check()

    def _log_step_metrics(self, optimizer: Any) -> None:
        """Log the step's metrics. Device tensors (loss, norms) stay on the device and off the progress bar;
        host values (lr, consumed samples, step) are CPU tensors, so logging them never touches the device."""
        em = self.cfg.exp_manager
        if self._loss_acc is not None:
            loss = self._data_parallel_mean(self._loss_acc / max(self._loss_count, 1))
            self.log("reduced_train_loss", loss, prog_bar=False, rank_zero_only=False)
        self._loss_acc, self._loss_count = None, 0
        self.log("lr", torch.tensor(optimizer.param_groups[0]["lr"]), prog_bar=True, rank_zero_only=False)
        self.log("consumed_samples", torch.tensor(float(self._consumed_samples_fn())), prog_bar=False,
                 rank_zero_only=False)
        done = int(self.trainer.global_step) + 1  # Lightning counts this step once optimizer_step has returned
        self.log("global_step", torch.tensor(float(done)), rank_zero_only=False)  # as printed (was 1 less)
        self.log_logger_step(done)
        if em.log_gradient_norm and self._grad_norm is not None:
            self.log("gradient_norm", self._grad_norm, prog_bar=False, rank_zero_only=False)
        if em.log_parameter_norm:
            self.log("parameter_norm", grads.global_param_norm(self.trainable_parameters()), rank_zero_only=False)

    def configure_optimizers(self) -> dict[str, Any]:
        """Optimizer and per-step LR scheduler from ``model.optim`` (NeMo names), wrapped for bf16 parameters and
        ZeRO-1 (:class:`~nxd_lc.optim.NxDOptimizer`); fp32 gradient accumulation buffers are installed here,
        after Lightning has moved the model to its device."""
        m = self.cfg.model
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        if self.precision_policy.fp32_grad_acc and self._grad_acc_hooks is None:
            self._grad_acc_hooks = install_fp32_grad_accumulation([p for _, p in named])
        optimizer = build_optimizer(named, m.optim, m.do_layer_norm_weight_decay, policy=self.precision_policy,
                                    zero1=self.cfg.distributed_strategy.zero1, seed=self.cfg.seed)
        scheduler = build_scheduler(optimizer, m.optim.sched, self.cfg.trainer.max_steps)
        self._schedule_base_lrs = [float(b) for b in scheduler.base_lrs]  # this run's peaks (a restore replaces them)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

