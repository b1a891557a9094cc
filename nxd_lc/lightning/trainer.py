"""Assemble Lightning's Trainer from the typed config."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import pytorch_lightning as pl

from nxd_lc.config.access import data_parallel_size, peft_config, seq_length
from nxd_lc.config.access import num_microbatches as microbatches_of
from nxd_lc.config.run_record import run_record_files
from nxd_lc.config.schema import NxdConfig
from nxd_lc.data.curriculum import curriculum_stages, stage_at
from nxd_lc.lightning.callbacks import MetricsPrinter, ThroughputLogger
from nxd_lc.lightning.exp_manager import ExpPaths, build_checkpoint_callback, build_loggers
from nxd_lc.lightning.preemption import PreemptionCallback, checkpoint_callback_saver, install_step_boundary_epoch_loop
from nxd_lc.lightning.progress import OptimizerStepProgressBar
from nxd_lc.lightning.run_tokenizer import SaveRunTokenizer
from nxd_lc.lightning.strategy import NxDStrategy
from nxd_lc.precision import resolve_precision
from nxd_lc.runtime.device import RuntimeInfo, is_xla_accelerator


def num_microbatches(cfg: NxdConfig) -> int:
    """global_batch_size / (micro_batch_size * DP) — validated to be an integer (NxD's num_microbatches)."""
    return microbatches_of(cfg.data.global_batch_size, cfg.data.micro_batch_size, data_parallel_size(cfg))


def gradient_accumulation_steps(cfg: NxdConfig) -> int:
    """Lightning's ``accumulate_grad_batches``: :func:`num_microbatches`, or 1 under pipeline parallelism, where
    each training batch holds all micro-batches of a step and the pipeline schedule accumulates them."""
    return 1 if cfg.distributed_strategy.pipeline_model_parallel_size > 1 else num_microbatches(cfg)


def _backend_kwargs(cfg: NxdConfig, runtime: RuntimeInfo) -> dict[str, Any]:
    """``accelerator`` / ``strategy`` / precision arguments: NxD strategy on CPU/CUDA, its XLA variant with the
    XLA accelerator and precision plugin on xla / torch-xla based neuron (:mod:`nxd_lc.lightning.xla`), the NxD
    strategy with :class:`~nxd_lc.lightning.native.NxDDeviceAccelerator` on the native neuron device."""
    em = cfg.exp_manager
    ckpt = dict(save_xser=em.save_xser, load_xser=em.load_xser, save_bf16=em.save_bf16,
                use_master_weights_in_ckpt=em.checkpoint_callback_params.use_master_weights_in_ckpt,
                zero1=cfg.distributed_strategy.zero1, ckpt_ptl_version=em.ckpt_ptl_version,
                async_checkpointing=em.async_checkpointing, run_files=run_record_files(cfg),
                lora_only=peft_config(cfg) is not None and not peft_config(cfg).save_lora_base)
    autocast = resolve_precision(cfg).autocast_dtype is not None
    if is_xla_accelerator(runtime.accelerator):
        from nxd_lc.lightning.xla import NxDXLAAccelerator, NxDXLAPrecision, NxDXLAStrategy

        return dict(accelerator=NxDXLAAccelerator(), strategy=NxDXLAStrategy(**ckpt),
                    plugins=[NxDXLAPrecision(autocast=autocast)])
    strategy = NxDStrategy(**ckpt, process_group_backend=runtime.backend)
    if runtime.accelerator == "neuron_native":  # TorchNeuron's eager PrivateUse1 device: Lightning has no accelerator
        from pytorch_lightning.plugins.precision import MixedPrecision

        from nxd_lc.lightning.native import NxDDeviceAccelerator

        out: dict[str, Any] = dict(accelerator=NxDDeviceAccelerator(), strategy=strategy)
        if autocast:  # torch.autocast on the device's own type ('neuron')
            return dict(out, plugins=[MixedPrecision("bf16-mixed", device=runtime.device.type)])
        return dict(out, precision="32-true")
    # precision.type autocast: Lightning's bf16 autocast plugin; bf16 parameters are the module's (precision policy)
    return dict(accelerator=runtime.accelerator, strategy=strategy, precision="bf16-mixed" if autocast else "32-true")


def build_trainer(cfg: NxdConfig, runtime: RuntimeInfo, paths: ExpPaths,
                  preemption: Optional[PreemptionCallback] = None, extra_callbacks: Sequence[pl.Callback] = (),
                  **overrides: Any) -> pl.Trainer:
    """A ``pl.Trainer`` honouring ``trainer.*`` and ``exp_manager.*``.

    Gradient accumulation comes from ``global_batch_size``; Lightning's distributed sampler is off (the data
    module slices by DP rank); Lightning's precision is "32-true", or "bf16-mixed" (autocast) for
    ``precision.type: autocast``; parameter dtypes, master weights and rounding are the module's
    (:mod:`nxd_lc.precision`). On xla/neuron the
    accelerator, strategy and precision plugin are nxd_lc's XLA ones (:func:`_backend_kwargs`). When SIGTERM is
    among ``exp_manager.preemption_signals`` (the default), the training-epoch loop is
    :class:`~nxd_lc.lightning.preemption.StepBoundaryEpochLoop`: Lightning's per-micro-batch SIGTERM broadcast (a
    device tensor read back by the host on every micro-batch of a distributed run) is skipped, since the
    preemption callback's step-boundary vote handles SIGTERM; otherwise Lightning's loop and SIGTERM handling stay.

    Args:
        cfg: validated config.
        runtime: the initialised device/process-group info.
        paths: run directories from :func:`experiment_paths`.
        preemption: the run's :class:`PreemptionCallback` when it was created (and its handlers installed)
            before the Trainer; a new one otherwise. Its ``save`` is set to the checkpoint callback's.
        extra_callbacks: more callbacks (e.g. the recovery-time instrumentation).
        **overrides: extra ``pl.Trainer`` keyword arguments (tests).
    """
    t = cfg.trainer
    stages = curriculum_stages(cfg)
    schedule = None if stages is None else (
        lambda step: (stage_at(stages, step).global_batch_size, stage_at(stages, step).seq_length))
    callbacks: list[pl.Callback] = [ThroughputLogger(cfg.data.global_batch_size, seq_length(cfg) or 0, schedule),
                                    MetricsPrinter(t.log_every_n_steps, t.max_steps)]
    ckpt = build_checkpoint_callback(cfg, paths)
    if ckpt is not None:
        callbacks.append(ckpt)
    # flag-only signal handlers + the per-step vote (preemption save, parent death, async-save publication)
    preemption = preemption or PreemptionCallback(list(cfg.exp_manager.preemption_signals))
    preemption.save = checkpoint_callback_saver(ckpt) if ckpt is not None else None
    callbacks.append(preemption)
    if cfg.exp_manager.retrieval_eval.every_n_steps > 0:  # passkey / NIAH accuracy while training
        from nxd_lc.lightning.retrieval_callback import RetrievalEvalCallback

        callbacks.append(RetrievalEvalCallback(cfg.exp_manager.retrieval_eval, seq_length(cfg) or 0,
                                               cfg.distributed_strategy.context_parallel_algo))
    # <log_dir>/tokenizer: what exports of its checkpoints use; a resume keeps it and the recorded corpus
    callbacks.append(SaveRunTokenizer(paths.log_dir, cfg.exp_manager.resume_allow_changed_corpus))
    if t.enable_progress_bar:  # counts optimizer steps out of max_steps (Lightning's counts micro-batches)
        callbacks.append(OptimizerStepProgressBar())
    callbacks.extend(extra_callbacks)
    loggers = build_loggers(cfg, paths)
    accumulation = gradient_accumulation_steps(cfg)
    # NxDT counts an int val_check_interval in optimizer steps; Lightning counts training batches (micro-batches)
    val_check = t.val_check_interval * accumulation if isinstance(t.val_check_interval, int) else t.val_check_interval
    kwargs: dict[str, Any] = dict(
        **_backend_kwargs(cfg, runtime), devices=t.devices, num_nodes=t.num_nodes,
        max_epochs=t.max_epochs, max_steps=t.max_steps, log_every_n_steps=t.log_every_n_steps,
        val_check_interval=val_check, check_val_every_n_epoch=t.check_val_every_n_epoch,
        num_sanity_val_steps=t.num_sanity_val_steps, limit_val_batches=t.limit_val_batches,
        limit_test_batches=t.limit_test_batches, gradient_clip_val=t.gradient_clip_val,
        accumulate_grad_batches=accumulation,
        logger=loggers if loggers else False, callbacks=callbacks, enable_checkpointing=ckpt is not None,
        use_distributed_sampler=False, enable_progress_bar=t.enable_progress_bar,
        enable_model_summary=False, default_root_dir=paths.log_dir,
    )
    kwargs.update(overrides)
    trainer = pl.Trainer(**kwargs)
    if preemption.owns_sigterm:  # no per-micro-batch SIGTERM broadcast (a host read on XLA): the vote is ours
        install_step_boundary_epoch_loop(trainer)
    return trainer
