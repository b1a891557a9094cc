"""The LightningModule for preference optimisation (DPO and ORPO) over tensor/sequence/context-parallel layers.

Batch layout (:class:`~nxd_lc.data.alignment_datamodule.ModelAlignmentDataModule`, DPO / ORPO): ``input_ids``,
``labels``, ``position_ids``, ``segment_ids`` each ``[2B, S]`` (rows ``0..B-1`` prompt + chosen, rows
``B..2B-1`` prompt + rejected of the same pairs; labels -100 on prompt and padding) and ``sample_index [B]`` (the
pairs' dataset indices). A step shards the batch over CP once (:meth:`_context_parallel_shard`), runs the policy
once on all ``2B`` rows, and takes per-sequence log-probs from the vocab-parallel logits
(:func:`~nxd_lc.alignment.logprobs.sequence_log_probs`, CP-reduced, so every TP/CP rank holds the full-sequence
values and the same loss).

Losses: DPO family (:func:`~nxd_lc.alignment.losses.dpo_loss`: ``sigmoid`` / ``hinge`` / ``ipo`` / ``sft``
term; ``ipo`` on length-normalised log-probs) against the reference of :mod:`nxd_lc.alignment.reference`, or ORPO
(:func:`~nxd_lc.alignment.losses.orpo_loss`, no reference). The loss is the mean over the micro-batch's pairs,
the same on every CP rank; the step returns ``loss * cp`` because the DP x CP gradient all-reduce averages the
CP ranks' partial gradients (see :mod:`nxd_lc.alignment.logprobs`).

Metrics, as the base module's loss: device tensors accumulated over the micro-batches of an optimizer step, then
averaged over micro-batches and DP ranks and logged at the optimizer step without reading them back
(``rewards/chosen``, ``rewards/rejected``, ``rewards/accuracies``, ``rewards/margins`` and the loss's other
metrics, e.g. ``logps/chosen``, ``nll_loss``, ``log_odds_ratio``). ``reduced_train_loss`` keeps its meaning: the
DP mean of the micro-batch mean of the (unscaled) loss. Validation logs ``val_loss``,
``val_rewards/accuracies`` and ``val_rewards/margins``: means over all validation pairs of all DP ranks.

Pipeline parallelism (``pipeline_model_parallel_size > 1``): a training batch holds the step's micro-batches; it
is CP-sharded, given its reference log-probs (DPO: the precomputed table, looked up by ``sample_index``) and
re-laid out once per step (:func:`~nxd_lc.alignment.pipeline.interleave_pairs_by_microbatch`), then the engine's
schedule runs the pairs micro-batch by micro-batch with the preference loss on the last stage
(:func:`~nxd_lc.alignment.pipeline.preference_objective`); the metrics are the same micro-batch means as above, on
every rank. The reference table itself is computed through the pipeline, forward only
(:func:`~nxd_lc.alignment.pipeline.reference_rows_objective`). A per-step reference forward (frozen copy or LoRA
base, ``precompute_ref_log_probs: false``) is not available under PP (rejected by config validation).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import torch

from nxd_lc.alignment.logprobs import mean_log_probs, sequence_log_probs, split_chosen_rejected
from nxd_lc.alignment.losses import dpo_loss, orpo_loss, parse_dpo_loss_type, uses_length_normalised_log_probs
from nxd_lc.alignment.pipeline import (
    REF_COUNTS,
    REF_SUMS,
    interleave_pairs_by_microbatch,
    preference_objective,
    reference_rows_objective,
)
from nxd_lc.alignment.reference import (
    FrozenReference,
    compute_reference_table,
    load_reference_tables,
    lookup_reference,
    reference_cache_path,
    reference_fingerprint,
    reference_forward,
    save_reference_tables,
)
from nxd_lc.config.schema import NxdConfig
from nxd_lc.distributed import collectives
from nxd_lc.distributed import parallel_state as ps
from nxd_lc.layers.lora import lora_modules
from nxd_lc.lightning.module import NxDLanguageModel
from nxd_lc.runtime import xla as xla_runtime
from nxd_lc.runtime.prewarm import extracting_graphs

log = logging.getLogger(__name__)

__all__ = ["NxDPreferenceModel"]

_VAL_METRICS = ("val_loss", "val_rewards/accuracies", "val_rewards/margins")


class NxDPreferenceModel(NxDLanguageModel):
    """DPO / ORPO training of a TP/SP/CP decoder (``forward(input_ids, position_ids, segment_ids)`` ->
    ``logits_local [B, S, V/tp]``), e.g. :class:`nxd_lc.models.llama.LlamaForCausalLM`.

    Args:
        cfg: the validated run config; ``cfg.model_alignment_strategy`` must select ``dpo`` or ``orpo``.
        model, consumed_samples_fn, advance_samples_fn: as :class:`~nxd_lc.lightning.module.NxDLanguageModel`
            (LoRA, when used, is applied to ``model`` before construction).

    DPO needs :meth:`prepare_reference` once, after the initial weights are loaded and before ``trainer.fit``.

    Attributes:
        reference_source: ``"computed"`` / ``"cache"`` (precomputed table, this run / from the cache file),
            ``"frozen_copy"``, ``"lora_base"`` (adapters disabled), or None (ORPO, or not prepared yet).
        reference_cache_file: the table's cache path (precompute only).

    Raises:
        ValueError: no dpo / orpo section, or an invalid ``dpo.loss_type`` (names the key).
    """

    def __init__(self, cfg: NxdConfig, model: torch.nn.Module,
                 consumed_samples_fn: Callable[[], int] = lambda: 0,
                 advance_samples_fn: Callable[[int], None] = lambda n: None) -> None:
        super().__init__(cfg, model, consumed_samples_fn, advance_samples_fn)
        strategy = cfg.model_alignment_strategy
        algorithm = strategy.algorithm if strategy is not None else None
        if algorithm not in ("dpo", "orpo"):
            raise ValueError(f"model_alignment_strategy: NxDPreferenceModel trains dpo or orpo, got "
                             f"{algorithm or 'none'}; set model_alignment_strategy.dpo / .orpo, or use "
                             "NxDLanguageModel for sft and pretraining")
        self.algorithm: str = algorithm
        self.alignment_cfg = getattr(strategy, algorithm)
        self._loss_type: Any = None
        self._length_normalised = False
        if algorithm == "dpo":
            lt = self.alignment_cfg.loss_type
            self._loss_type = lt if isinstance(lt, str) else list(lt)
            parse_dpo_loss_type(self._loss_type)  # fail at construction, naming the key
            self._length_normalised = uses_length_normalised_log_probs(self._loss_type)
        self.reference_source: Optional[str] = None
        self.reference_cache_file: Optional[str] = None
        self._frozen: Optional[FrozenReference] = None  # a plain attribute: outside the module tree
        self._frozen_pipeline: Any = None  # PP: the pipeline engine over the frozen copy's stages
        self._ref_tables: dict[str, torch.Tensor] = {}  # split -> [N, 4] float32 (CPU master copy)
        self._ref_tables_device: dict[str, torch.Tensor] = {}
        self._metric_names: tuple[str, ...] = ()
        self._metric_acc: Optional[torch.Tensor] = None  # sum over micro-batches of the stacked metrics
        self._val_acc: Optional[torch.Tensor] = None  # [loss, accuracy, margin, 1] x pairs, summed
        if self.pipeline is not None:
            self._metric_names = self._loss_metric_names()
            self.pipeline.objective = preference_objective(
                self._loss_from_log_probs, self._metric_names, uses_reference=algorithm == "dpo",
                loss_factor=float(ps.get_context_parallel_world_size()))

    def _pipeline_micro_batch_rows(self) -> int:
        """A pipeline micro-batch of ``data.micro_batch_size`` pairs has twice as many rows."""
        return 2 * self.cfg.data.micro_batch_size

    def _loss_metric_names(self) -> tuple[str, ...]:
        """The names of :meth:`_loss_from_log_probs`'s metrics (from a loss of two dummy rows on the CPU)."""
        sums, counts = torch.zeros(2), torch.ones(2, dtype=torch.long)
        _, metrics = self._loss_from_log_probs(sums, counts, (sums, counts) if self.algorithm == "dpo" else None)
        return tuple(metrics)

    # ---- the reference ----------------------------------------------------------------------------------------
    def _param_device(self) -> torch.device:
        return next(self.model.parameters()).device

    def prepare_reference(self, datamodule: Any = None, cache_dir: Optional[str] = None) -> None:
        """Set up the DPO reference from the CURRENT weights (the initial policy); a no-op for ORPO.

        Call once on every rank after the weights are loaded (HF weights, ``weight_init_only``, LoRA applied)
        and before ``trainer.fit`` (Lightning restores a resumed checkpoint before ``on_fit_start``, so the
        reference could not be taken there). Idempotent per run: a second call does nothing.

        * ``dpo.precompute_ref_log_probs: true`` -- load the table cached in ``cache_dir`` when its key
          matches, else compute it over the train and val pairs (no_grad, eval mode, LoRA disabled, the policy's
          autocast, CP sharding and TP log-probs as in training, split over DP and all-gathered) and cache it
          (:mod:`nxd_lc.alignment.reference`).
        * ``false`` -- with LoRA adapters the base model (adapters disabled) is the reference; otherwise a frozen
          deep copy of the policy (:class:`~nxd_lc.alignment.reference.FrozenReference`: ``param_bytes / tp``
          more memory per rank, no optimizer state, not in checkpoints).

        Args:
            datamodule: the :class:`~nxd_lc.data.alignment_datamodule.ModelAlignmentDataModule` (set up here if
                needed); required for precompute.
            cache_dir: directory of the cache file (``train.py``: ``<log_dir>/ref_logps``, so the data's
                directory is never written to); None: the one holding ``data.train_dir``.
        Raises:
            ValueError: precompute without a data module. Collective over all ranks (precompute).
        """
        if self.algorithm != "dpo" or self.reference_source is not None:
            return
        if not self.alignment_cfg.precompute_ref_log_probs:
            if lora_modules(self.model):
                self.reference_source = "lora_base"
                return
            self._frozen = FrozenReference(self.model)
            self._frozen_pipeline = self._build_pipeline(self._frozen.model)  # PP: the copy's own stages
            self.reference_source = "frozen_copy"
            log.info("DPO reference: frozen copy of the policy, %.1f MiB on this rank",
                     self._frozen.num_bytes / 2**20)
            return
        if datamodule is None:
            raise ValueError("model_alignment_strategy.dpo.precompute_ref_log_probs: true needs the data module: "
                             "call prepare_reference(datamodule) (or set it to false for a frozen reference)")
        datamodule.setup("fit")
        self._ref_tables = self._load_or_compute_tables(datamodule, cache_dir)
        self._ref_tables_device = {}

    def _load_or_compute_tables(self, datamodule: Any, cache_dir: Optional[str]) -> dict[str, torch.Tensor]:
        from nxd_lc.data.alignment_datamodule import collate_pairs

        policy = self.precision_policy
        precision = {"param_dtype": str(policy.param_dtype), "autocast": str(policy.autocast_dtype)}
        key = reference_fingerprint(datamodule, self.model, hf_weights_dir=self.cfg.model.hf_weights_dir,
                                    precision=precision)
        path = reference_cache_path(datamodule.cfg.train_dir, key, cache_dir)
        self.reference_cache_file = path
        splits = {"train": datamodule.train_dataset, "val": datamodule.val_dataset}
        splits = {k: v for k, v in splits.items() if v is not None}
        tables = load_reference_tables(path, key, {k: len(v) for k, v in splits.items()}, self._param_device())
        if tables is not None:
            self.reference_source = "cache"
            log.info("DPO reference log-probs: loaded %s", path)
            return tables
        tables = {k: compute_reference_table(ds, self._reference_table_rows, collate_pairs,
                                             datamodule.cfg.micro_batch_size, self._sync_if_xla)
                  for k, ds in splits.items()}
        if extracting_graphs():  # neuron_parallel_compile: the tables hold garbage, never cache them
            log.info("DPO reference log-probs: not cached (graph extraction, the values are not real)")
        else:
            save_reference_tables(path, key, tables)
        self.reference_source = "computed"
        return tables

    def _sync_if_xla(self) -> None:
        if self._param_device().type == "xla":
            xla_runtime.sync()

    def _reference_table_rows(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Precompute: a collated CPU micro-batch -> ``[B, 4]`` (chosen sum, count, rejected sum, count)."""
        device = self._param_device()
        shard = self._context_parallel_shard({k: v.to(device) for k, v in batch.items()})
        if self.pipeline is not None:  # one micro-batch, forward only through the stages; rows on every rank
            pairs = shard["input_ids"].shape[0] // 2
            with reference_forward(self.model, self.precision_policy.autocast_dtype):
                out = self.pipeline.run_objective(shard, train=False, objective=reference_rows_objective(pairs))
            return out.metrics["rows"].reshape(pairs, 4)
        with reference_forward(self.model, self.precision_policy.autocast_dtype):
            sums, counts = self._sequence_log_probs(self.model, shard)
        (cs, rs), (cc, rc) = split_chosen_rejected(sums), split_chosen_rejected(counts.float())
        return torch.stack([cs, cc, rs, rc], dim=1)

    def on_fit_start(self) -> None:
        """Keep the frozen reference on the policy's device (it is outside the module tree Lightning moves)."""
        super().on_fit_start()
        if self._frozen is not None:
            self._frozen.to(self._param_device())

    def _reference_log_probs(self, shard: dict[str, torch.Tensor],
                             split: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Reference ``(sums [2B] fp32, counts [2B] int64)`` of the (CP-sharded) micro-batch, without gradient."""
        if self._ref_tables:
            if split not in self._ref_tables:
                raise RuntimeError(f"DPO reference log-probs were precomputed without a {split} split; set "
                                   "data.val_dir before prepare_reference()")
            if "sample_index" not in shard:
                raise ValueError("DPO batch has no 'sample_index' (the pairs' dataset indices), needed to look up "
                                 "precomputed reference log-probs; use ModelAlignmentDataModule's collate_pairs")
            table = self._ref_tables_device.get(split)
            device = shard["input_ids"].device
            if table is None or table.device != device:
                table = self._ref_tables_device[split] = self._ref_tables[split].to(device)
            return lookup_reference(table, shard["sample_index"])
        if self.reference_source == "lora_base":
            model, engine = self.model, self.pipeline
        elif self._frozen is not None:
            model, engine = self._frozen.model, self._frozen_pipeline
        else:
            raise RuntimeError("the DPO reference is not set up: call module.prepare_reference(datamodule) after "
                               "loading the weights and before trainer.fit")
        with reference_forward(model):
            if engine is None:
                return self._sequence_log_probs(model, shard)
            return self._pipelined_reference(engine, shard)

    def _pipelined_reference(self, engine: Any, shard: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """PP, live reference: the step's ``N`` micro-batches of ``P`` pairs (``shard``, rows chosen first) once
        through ``engine``'s forward-only schedule (the reference's stages; no grad, inside
        :func:`reference_forward`), each micro-batch's rows ``[P, 4]`` from the last stage; returns
        ``(sums [2NP] fp32, counts [2NP] int64)`` in the batch's row layout, the same on every pipeline rank (as
        :func:`lookup_reference` returns for the precomputed table)."""
        n = shard["input_ids"].shape[0] // self._pipeline_micro_batch_rows()
        pairs = self.cfg.data.micro_batch_size
        out = engine.run_objective(interleave_pairs_by_microbatch(shard, n), train=False,
                                   objective=reference_rows_objective(pairs))
        rows = out.metrics["rows"].reshape(n * pairs, 4)  # pair order: micro-batch i holds pairs iP..(i+1)P-1
        return torch.cat([rows[:, 0], rows[:, 2]]), torch.cat([rows[:, 1], rows[:, 3]]).round().long()

    # ---- loss ---------------------------------------------------------------------------------------------------
    @staticmethod
    def _sequence_log_probs(model: torch.nn.Module,
                            shard: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        logits = model(shard["input_ids"], shard.get("position_ids"), segment_ids=shard.get("segment_ids"))
        return sequence_log_probs(logits, shard["labels"])

    def _preference_loss(self, batch: dict[str, torch.Tensor],
                         split: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(fp32 scalar loss, identical on every TP/CP rank; detached fp32 scalar metrics) of a micro-batch."""
        shard = self._context_parallel_shard(batch)
        ref = self._reference_log_probs(shard, split) if self.algorithm == "dpo" else None
        sums, counts = self._sequence_log_probs(self.model, shard)  # [2B] each, full-sequence values
        return self._loss_from_log_probs(sums, counts, ref)

    def _loss_from_log_probs(self, sums: torch.Tensor, counts: torch.Tensor,
                             ref: Optional[tuple[torch.Tensor, torch.Tensor]]
                             ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """DPO / ORPO loss (fp32 scalar, mean over the pairs) and detached scalar metrics from the policy's
        ``sums [2B]`` fp32 / ``counts [2B]`` int64 and the reference's (DPO; None for ORPO), chosen rows first."""
        means = mean_log_probs(sums, counts)
        chosen_nll = -split_chosen_rejected(means)[0]
        if ref is None:
            chosen_mean, rejected_mean = split_chosen_rejected(means)
            return orpo_loss(chosen_mean, rejected_mean, chosen_nll, self.alignment_cfg.beta)
        ref_sums, ref_counts = ref
        policy = means if self._length_normalised else sums
        reference = mean_log_probs(ref_sums.float(), ref_counts) if self._length_normalised else ref_sums.float()
        (pc, pr), (rc, rr) = split_chosen_rejected(policy), split_chosen_rejected(reference)
        c = self.alignment_cfg
        return dpo_loss(pc, pr, rc, rr, beta=c.kl_beta, loss_type=self._loss_type, label_smoothing=c.label_smoothing,
                        chosen_nll=chosen_nll, sft_loss_weight=c.sft_loss_weight)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        """``loss * cp`` of the micro-batch (fp32 scalar; the mean over its pairs, see the module docstring)."""
        if self.pipeline is not None:
            self._zero_grad_before_pipeline()
            loss, metrics = self._pipeline_loss(batch, "train", train=True)
        else:
            loss, metrics = self._preference_loss(batch, "train")
        self._accumulate_loss(loss)
        if not self._metric_names:
            self._metric_names = tuple(metrics)
        stacked = torch.stack([metrics[k].float() for k in self._metric_names])
        self._metric_acc = stacked if self._metric_acc is None else self._metric_acc + stacked
        return loss * ps.get_context_parallel_world_size()

    def _pipeline_loss(self, batch: dict[str, torch.Tensor], split: str,
                       train: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """All micro-batches of ``batch`` through the pipeline (forward and backward when ``train``).

        Returns:
            (the mean over micro-batches of the micro-batch loss, fp32 scalar, detached and without the CP factor;
            each metric's mean over micro-batches), the same on every rank of the PP group.
        """
        shard = self._context_parallel_shard(batch)
        if self.algorithm == "dpo":
            ref_sums, ref_counts = self._reference_log_probs(shard, split)  # [2NP] rows, chosen first
            shard = {**shard, REF_SUMS: ref_sums.float(), REF_COUNTS: ref_counts}
        n = shard["input_ids"].shape[0] // self._pipeline_micro_batch_rows()
        out = self.pipeline.run_objective(interleave_pairs_by_microbatch(shard, n), train=train)
        cp = ps.get_context_parallel_world_size()
        return out.loss / cp, {k: v.mean(0) for k, v in out.metrics.items()}

    # ---- step metrics -------------------------------------------------------------------------------------------
    def reduced_step_metrics(self) -> dict[str, torch.Tensor]:
        """The accumulated training metrics, each the mean over the step's micro-batches and over DP ranks
        (device fp32 scalars; one all-reduce over DP x CP, where CP ranks hold equal values); resets them.
        Empty before the first training step."""
        if self._metric_acc is None:
            return {}
        mean = self._data_parallel_mean(self._metric_acc / max(self._loss_count, 1))
        self._metric_acc = None
        return {name: mean[i] for i, name in enumerate(self._metric_names)}

    def _log_step_metrics(self, optimizer: Any) -> None:
        """The base metrics (``reduced_train_loss``, lr, ...) plus the reward metrics, as device tensors."""
        metrics = self.reduced_step_metrics()  # before the base resets the micro-batch count
        super()._log_step_metrics(optimizer)
        for name, value in metrics.items():
            self.log(name, value, prog_bar=False, rank_zero_only=False)

    # ---- validation ---------------------------------------------------------------------------------------------
    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        """Accumulate pair-weighted loss, reward accuracy and margin; reduced in :meth:`on_validation_epoch_end`."""
        if self.pipeline is not None:
            loss, metrics = self._pipeline_loss(batch, "val", train=False)
        else:
            loss, metrics = self._preference_loss(batch, "val")
        pairs = batch["input_ids"].shape[0] // 2
        row = torch.stack([loss.detach().float(), metrics["rewards/accuracies"], metrics["rewards/margins"],
                           torch.ones_like(loss, dtype=torch.float32)]) * pairs
        self._val_acc = row if self._val_acc is None else self._val_acc + row
        self._step_boundary()

    def on_validation_epoch_start(self) -> None:
        super().on_validation_epoch_start()
        self._val_acc = None

    def validation_metrics(self) -> dict[str, torch.Tensor]:
        """``val_loss``, ``val_rewards/accuracies``, ``val_rewards/margins``: means over all validation pairs of
        all DP ranks (device fp32 scalars; sums all-reduced over DP x CP, where CP ranks hold equal values)."""
        acc = self._val_acc if self._val_acc is not None else torch.zeros(4, device=self._param_device())
        acc = collectives.all_reduce(acc.clone(), ps.get_data_parallel_group(with_context_parallel=True))
        means = acc[:3] / torch.clamp(acc[3], min=1.0)
        return {name: means[i] for i, name in enumerate(_VAL_METRICS)}

    def on_validation_epoch_end(self) -> None:
        """Log :meth:`validation_metrics` (``val_loss`` on the progress bar, as the base module)."""
        for name, value in self.validation_metrics().items():
            self.log(name, value, prog_bar=name == "val_loss", rank_zero_only=False, sync_dist=False)
        self.log_logger_step(int(self.trainer.global_step))  # TensorBoard's step: the optimizer step, as the base
