"""The training job: validated config -> runtime/env -> parallel state -> model -> weights -> data -> fit.

``train.py`` at the repository root is a thin ``@hydra.main`` that calls :func:`run`. The assembly order is fixed
(DESIGN.md principle 4) and nothing in the config is changed from environment variables.

Dry run: ``python train.py --config-name X +dry_run=true`` validates the config (schema and cross-field rules for
its own world size ``trainer.devices * trainer.num_nodes``), prints a summary (layout, precision, memory estimate,
the environment it would set) and what a launch on this host would stop with (keys not supported yet, the launch
checks of :func:`nxd_lc.app.validation.path_problems`), writes the resolved config to a file whose path it prints,
and exits without building anything. Exit status (``train.py``): 0 the launch would pass its checks, 2 the config is
invalid (the error lists every problem), 3 the config is valid but a launch on this host would stop (listed).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import sys
import tempfile
from typing import Any, Mapping, Optional

import pytorch_lightning as pl
from omegaconf import DictConfig, OmegaConf

from nxd_lc.app.build import (
    build_model,
    decoder_compiled,
    load_model_weights,
    run_kv_layout,
    save_lora_outputs,
    set_checkpoint_kv_layout,
)
from nxd_lc.app.validation import check_supported, load_config, memory_report, path_problems, unsupported_features
from nxd_lc.checkpoint.xser import set_weights_only
from nxd_lc.config.access import data_parallel_size, peft_config, seq_length
from nxd_lc.config.errors import ConfigError
from nxd_lc.config.run_record import config_differences, resolved_config_yaml
from nxd_lc.config.schema import NxdConfig
from nxd_lc.distributed.startup import check_same_config
from nxd_lc.precision import resolve_precision
from nxd_lc.runtime.env import apply_env, format_env_table

log = logging.getLogger("nxd_lc.train")

#: the run directory's folder of DPO reference log-prob caches (``model_alignment_strategy.dpo.
#: precompute_ref_log_probs``): a resume finds them, the user's data directory is never written to
REFERENCE_CACHE_DIR = "ref_logps"


def _setup_console_logging() -> None:
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="[%(asctime)s %(name)s] %(message)s", stream=sys.stdout)
    logging.getLogger("nxd_lc").setLevel(logging.INFO)


class LaunchWouldStop(ConfigError):
    """A dry run of a valid config found what a launch on this host would stop with (``problems``); ``train.py``
    exits with status 3 (:func:`hydra_task`) after the report is printed."""


class DryRunReport(str):
    """The dry run's report (the text printed) with ``launch_problems``: what a launch on this host would stop with
    (empty: it would pass its checks)."""

    launch_problems: list[str]

    def __new__(cls, text: str, launch_problems: list[str]) -> DryRunReport:
        report = super().__new__(cls, text)
        report.launch_problems = list(launch_problems)
        return report


def dry_run(cfg: NxdConfig) -> DryRunReport:
    """Report for ``+dry_run=true`` (module docstring): the summary first (layout, precision, memory estimate,
    environment table), then the file the resolved config was written to (:func:`write_resolved_config`), then what
    a launch on this host would stop with. Builds nothing and changes no environment variable.

    Returns:
        The report text, with its ``launch_problems`` (:class:`DryRunReport`).
    """
    env = dict(os.environ)  # a copy: the dry run changes nothing
    table = format_env_table(apply_env(cfg, environ=env))
    ds = cfg.distributed_strategy
    problems = unsupported_features(cfg) + [f"at launch: {p}" for p in path_problems(cfg)]
    headline = ("# nxd_lc dry run: config is valid" if not problems else
                f"# nxd_lc dry run: config is valid, but launching it on this host would stop ({len(problems)} "
                "problem(s), listed at the end; exit status 3)")
    lines = [headline,
             f"# world size {cfg.trainer.devices * cfg.trainer.num_nodes} = TP {ds.tensor_model_parallel_size} x "
             f"PP {ds.pipeline_model_parallel_size} x CP {ds.context_parallel_size} x DP {data_parallel_size(cfg)};"
             f" seq_length {seq_length(cfg)}", *_kv_layout_note(cfg),
             f"# {resolve_precision(cfg).describe()}", *(f"# {line}" for line in _device_precision(cfg, env)),
             *(f"# {line}" for line in memory_report(cfg)), *_compile_note(cfg),
             "# environment it would set (variables already set in the environment win):", table,
             write_resolved_config(cfg)]
    if problems:
        lines.append("# launching this config would stop with:")
        lines += [f"#   - {p}" for p in problems]
    return DryRunReport("\n".join(lines), problems)


def write_resolved_config(cfg: NxdConfig, directory: Optional[str] = None) -> str:
    """Write the resolved config (:func:`~nxd_lc.config.run_record.resolved_config_yaml`: every key, defaults
    included, the text a launch records as ``run_config.yaml``) to ``<directory>/nxd_lc-dry-run-<name>-<sha12>.yaml``
    (``directory`` default: the system's temporary directory; the name's characters other than letters, digits,
    ``.``, ``_`` and ``-`` become ``_``; ``sha12``: the text's SHA-256, so a rerun of the same config rewrites the same
    file) and return the dry run's line naming it. A file that cannot be written is said in the line, not raised:
    the dry run's answer does not depend on it."""
    text = resolved_config_yaml(cfg)
    name = re.sub(r"[^A-Za-z0-9._-]", "_", str(cfg.name))[:64] or "config"
    path = os.path.join(directory or tempfile.gettempdir(),
                        f"nxd_lc-dry-run-{name}-{hashlib.sha256(text.encode()).hexdigest()[:12]}.yaml")
    try:
        partial = f"{path}.{os.getpid()}.tmp"
        with open(partial, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(partial, path)
    except OSError as e:
        return f"# resolved config ({text.count(chr(10))} lines): not written to {path} ({e.strerror or e})"
    return f"# resolved config ({text.count(chr(10))} lines, every key with its default): {path}"


def _kv_layout_note(cfg: NxdConfig) -> list[str]:
    """The dry run's line on where KV replicas would live (``kv_replicator`` > 1 only), judged on this host as the
    launch judges it (:func:`nxd_lc.app.build.run_kv_layout`)."""
    ds = cfg.distributed_strategy
    if ds.kv_replicator <= 1:
        return []
    return [f"# KV replicas (kv_replicator {ds.kv_replicator}) laid out {run_kv_layout(cfg)} "
            f"(distributed_strategy.kv_replica_layout: {ds.kv_replica_layout}; interleaved is NxD's Trn1 layout, "
            "adjacent its Trn2 / Trn3 one)"]


def _compile_note(cfg: NxdConfig) -> list[str]:
    """The dry run's line on ``model.compile: auto`` (the same on every host; the decision itself is taken at
    launch on the resolved device: :func:`nxd_lc.models.common.compile.compile_enabled`)."""
    from nxd_lc.models.common.compile import AUTO_EAGER_NATIVE

    if cfg.model.compile != "auto":
        return []
    return ["# model.compile: auto compiles the decoder layers on gpu (CUDA) only, eager on cpu and torch-xla; "
            f"{AUTO_EAGER_NATIVE}"]


def _device_precision(cfg: NxdConfig, env: Mapping[str, str]) -> list[str]:
    """The precision line of the tensors' on-device dtypes on xla / neuron (none on cpu / gpu, where a dtype is what
    it says), under the run's environment ``env``: :meth:`~nxd_lc.precision.PrecisionPolicy.describe_on_device`."""
    from nxd_lc.runtime.device import is_lazy_config_accelerator, neuron_resolution

    acc = cfg.trainer.accelerator
    if is_lazy_config_accelerator(acc):
        platform = "xla" if acc == "xla" else "neuron"
    elif acc in ("neuron", "auto") and neuron_resolution() == "neuron_native":
        platform = "neuron_native"
    else:
        return []
    return [f"{cfg.precision.type} {resolve_precision(cfg).describe_on_device(platform, env)}"]


def run(raw: DictConfig | Mapping[str, Any], trainer_overrides: Optional[dict[str, Any]] = None) -> Any:
    """Run the job described by ``raw`` (a composed Hydra config). Returns the Trainer (None on dry run).

    Raises:
        ConfigError: any config problem, all listed, before anything is built.
        LaunchWouldStop: a dry run (printed first) that found what a launch on this host would stop with.
    """
    _setup_console_logging()
    from nxd_lc.runtime.device import launched_world_size

    is_dry = bool(OmegaConf.select(OmegaConf.create(raw) if not isinstance(raw, DictConfig) else raw,
                                   "dry_run", default=False))
    cfg = load_config(raw, world_size=None if is_dry else launched_world_size(), check_paths=not is_dry)
    if cfg.dry_run:
        report = dry_run(cfg)
        print(report)
        if report.launch_problems:  # after the report: train.py exits 3 (hydra_task)
            raise LaunchWouldStop(report.launch_problems)
        return None
    check_supported(cfg)
    check_processes_per_node(cfg)
    set_weights_only(cfg.exp_manager.checkpoint_weights_only)  # before any checkpoint / adapter / cache is read
    from nxd_lc.lightning.preemption import PreemptionCallback

    # from here on the preemption signals only set a flag, acted on at a step boundary (nxd_lc.lightning.preemption)
    preemption = PreemptionCallback(list(cfg.exp_manager.preemption_signals))
    preemption.install()
    recovery = None
    if cfg.exp_manager.enable_recovery_time_instrumentation:
        from nxd_lc.runtime.recovery_timing import RecoveryTimer

        recovery = RecoveryTimer()
        recovery.mark("startup_s")
    try:
        from nxd_lc.runtime.prewarm import extracting_graphs, run_prewarm

        # graph-extraction pass (+prewarm=true, or under neuron_parallel_compile): nxd_lc.runtime.prewarm
        if cfg.prewarm or extracting_graphs():
            return run_prewarm(cfg, lambda c: _fit(c, trainer_overrides or {}, preemption, recovery))
        return _fit(cfg, trainer_overrides or {}, preemption, recovery)
    finally:
        preemption.restore()
        from nxd_lc.lightning.exp_manager import release_run_dir

        release_run_dir()


def _fit(cfg: NxdConfig, trainer_overrides: dict[str, Any], preemption: Any, recovery: Any = None) -> pl.Trainer:
    """Build everything and train. ``preemption``: the run's :class:`~nxd_lc.lightning.preemption.PreemptionCallback`
    (handlers already installed); ``recovery``: a :class:`~nxd_lc.runtime.recovery_timing.RecoveryTimer` when
    ``exp_manager.enable_recovery_time_instrumentation`` (phase marks are taken here)."""
    def mark(phase: str) -> None:
        if recovery is not None:
            recovery.mark(phase)

    from nxd_lc.context import set_context_parallel_algo
    from nxd_lc.context.local import set_nki_options
    from nxd_lc.distributed import parallel_state as ps
    from nxd_lc.lightning import exp_manager
    from nxd_lc.lightning.trainer import build_trainer
    from nxd_lc.runtime.device import init_distributed, resolve_accelerator
    from nxd_lc.runtime.prewarm import begin_graph_recording, end_graph_recording

    env_entries = apply_env(cfg)  # before any runtime initialises
    accelerator = resolve_accelerator(cfg.trainer.accelerator)
    # xla/neuron: record the compiled graphs (prewarm manifest, or the check against it), before the first compile
    graph_record = begin_graph_recording(cfg, accelerator, int(os.environ.get("RANK", "0")))
    runtime = init_distributed(accelerator)
    # one job, one config: every rank's resolved config against rank 0's, before anything is built
    config_sha = check_same_config(resolved_config_yaml(cfg), config_differences)
    ds = cfg.distributed_strategy
    kv_layout = run_kv_layout(cfg, accelerator)
    ps.initialize_model_parallel(tensor_model_parallel_size=ds.tensor_model_parallel_size,
                                 pipeline_model_parallel_size=ds.pipeline_model_parallel_size,
                                 context_parallel_size=ds.context_parallel_size, kv_replicator=ds.kv_replicator,
                                 expert_model_parallel_size=ds.expert_model_parallel_size,
                                 kv_replica_layout=kv_layout)
    set_checkpoint_kv_layout(cfg)
    set_context_parallel_algo(ds.context_parallel_algo)
    mark("distributed_init_s")
    set_nki_options(cfg.model.transpose_nki_inputs, cfg.trainer.lnc)
    paths = exp_manager.experiment_paths(cfg)
    exp_manager.lock_run_dir(paths, is_global_zero=runtime.rank == 0)  # before anything is written there
    exp_manager.setup_log_files(cfg, paths, runtime.rank, runtime.local_rank)
    if runtime.rank == 0:
        log.info("effective environment:\n%s", format_env_table(env_entries))
        log.info("%s", resolve_precision(cfg).describe())
        for line in _device_precision(cfg, os.environ):
            log.info("%s", line)
        log.info("log dir: %s", paths.log_dir)
        log.info("config sha256 %s, the same on all %d ranks", config_sha[:12], runtime.world_size)
        if ds.kv_replicator > 1:
            log.info("KV replicas (kv_replicator %d) laid out %s (distributed_strategy.kv_replica_layout: %s)",
                     ds.kv_replicator, kv_layout, ds.kv_replica_layout)
    pl.seed_everything(cfg.seed, workers=True)
    hf_config, model = _build_and_move(cfg, runtime)
    mark("model_build_s")
    data = _data_module(cfg, hf_config.vocab_size)
    module = _lightning_module(cfg, model, data)
    mark("data_setup_s")
    exp_manager.cleanup_interrupted_saves(paths, is_global_zero=runtime.rank == 0)
    ckpt_path, weights_path = exp_manager.resume_plan(cfg, paths)
    if weights_path:
        load_model_weights(model, weights_path)
    if runtime.rank == 0 and (ckpt_path or weights_path):
        log.info("resuming from %s" if ckpt_path else "initialising weights from %s", ckpt_path or weights_path)
    if hasattr(module, "prepare_reference"):  # DPO: reference log-probs of the initial policy, before any resume
        module.prepare_reference(data, cache_dir=os.path.join(paths.log_dir, REFERENCE_CACHE_DIR))
    if recovery is not None:
        recovery.resumed_from = ckpt_path
    trainer = build_trainer(cfg, runtime, paths, preemption, extra_callbacks=[recovery] if recovery else [],
                            **trainer_overrides)
    trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    end_graph_recording(cfg, graph_record, trainer.global_step)  # writes the manifest (prewarm) or checks it
    if peft_config(cfg) is not None and not cfg.prewarm:
        from nxd_lc.layers.param_attrs import move_module

        # Lightning's teardown moved the module to the CPU; the exports' TP gathers run on the process group's
        # device (XLA's and nccl's groups take no host tensors)
        save_lora_outputs(cfg, move_module(model, runtime.device), paths.log_dir, runtime.rank == 0)
    return trainer


def check_processes_per_node(cfg: NxdConfig, environ: Optional[Mapping[str, str]] = None) -> None:
    """The processes torchrun started on this node (``LOCAL_WORLD_SIZE``) must be ``trainer.devices``: the world
    size check alone passes 4 processes on one node for ``num_nodes: 2, devices: 2`` (4 = 2 x 2), which Lightning
    then fails on (``IndexError`` in its device list).

    Raises:
        ConfigError: naming both numbers and the fix.
    """
    local = (os.environ if environ is None else environ).get("LOCAL_WORLD_SIZE")
    if local is not None and local.strip().isdigit() and int(local) != cfg.trainer.devices:
        raise ConfigError([f"trainer.devices: {cfg.trainer.devices} processes per node, but torchrun started "
                           f"{local} on this node (LOCAL_WORLD_SIZE); launch torchrun --nproc_per_node="
                           f"{cfg.trainer.devices} on each of trainer.num_nodes={cfg.trainer.num_nodes} nodes, or "
                           f"set trainer.devices={local}"])


def _build_and_move(cfg: NxdConfig, runtime: Any) -> tuple[Any, Any]:
    """:func:`build_model`, the move to the device and ``model.compile`` (:mod:`nxd_lc.models.common.compile`), in
    waves of ``trainer.sequential_move_factor`` ranks per
    node (:mod:`nxd_lc.distributed.startup`). The move keeps the parameters' parallel attributes and ties
    (:func:`nxd_lc.layers.param_attrs.move_module`: ``.to()`` drops them on XLA and PrivateUse1 devices)."""
    from nxd_lc.distributed.startup import run_in_waves
    from nxd_lc.layers.param_attrs import move_module

    def build() -> tuple[Any, Any]:
        hf_config, model = build_model(cfg, runtime.accelerator)
        model = move_module(model, runtime.device)
        if decoder_compiled(cfg, runtime.accelerator):  # regional torch.compile of each decoder layer (training only)
            from nxd_lc.models.common.compile import compile_backend, compile_decoder_layers

            compile_decoder_layers(model, compile_backend(runtime.accelerator),
                                   cuda_graphs=cfg.model.enable_cuda_graph)
        return hf_config, model

    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", cfg.trainer.devices))
    return run_in_waves(build, cfg.trainer.sequential_move_factor, runtime.local_rank, local_world)


def _data_module(cfg: NxdConfig, vocab_size: int) -> Any:
    """Pretraining data, or SFT / DPO / ORPO records with ``model_alignment_strategy`` (sharded by DP rank)."""
    from nxd_lc.data.datamodule import PretrainingDataModule
    from nxd_lc.distributed import parallel_state as ps

    kwargs = dict(seq_length=seq_length(cfg) or 0, seed=cfg.seed, model_vocab_size=vocab_size,
                  data_parallel_rank=ps.get_data_parallel_rank(),
                  data_parallel_size=ps.get_data_parallel_world_size(), global_batch_size=cfg.data.global_batch_size)
    if cfg.model_alignment_strategy is None and cfg.data.curriculum:
        from nxd_lc.data.curriculum import CurriculumDataModule

        data = CurriculumDataModule(cfg.data, **kwargs)
    elif cfg.model_alignment_strategy is None:
        data = PretrainingDataModule(cfg.data, **kwargs)
    else:
        from nxd_lc.data.alignment_datamodule import ModelAlignmentDataModule

        data = ModelAlignmentDataModule(cfg.data, cfg.model_alignment_strategy, **kwargs)
    if ps.get_pipeline_model_parallel_world_size() > 1:  # one batch = all micro-batches of a step (schedule)
        from nxd_lc.lightning.trainer import num_microbatches

        data.micro_batches_per_batch = num_microbatches(cfg)
    return data


def _lightning_module(cfg: NxdConfig, model: Any, data: Any) -> Any:
    """The LightningModule: causal-LM loss (pretraining, SFT) or the preference objective (DPO, ORPO)."""
    from nxd_lc.lightning.module import NxDLanguageModel

    kwargs = dict(consumed_samples_fn=lambda: data.consumed_samples, advance_samples_fn=data.advance)
    strategy = cfg.model_alignment_strategy
    if strategy is None or strategy.algorithm == "sft":
        return NxDLanguageModel(cfg, model, **kwargs)
    from nxd_lc.alignment.module import NxDPreferenceModel

    return NxDPreferenceModel(cfg, model, **kwargs)


def hydra_defaults() -> list[str]:
    """Hydra overrides nxd_lc adds unless given: no output sub-dir, no chdir, no Hydra log files.

    The run directory is ``exp_manager``'s; Hydra's own per-run directory would be a second, per-rank one.
    """
    return ["hydra.output_subdir=null", "hydra.run.dir=.", "hydra/job_logging=none", "hydra/hydra_logging=none"]


def _shutdown_distributed() -> None:
    """Release nxd_lc's process groups and the default one (local, not collective): the process then exits
    without gloo / NCCL threads still running during interpreter shutdown, which aborted a rank with
    "terminate called without an active exception" (exit status -6 after a finished run)."""
    import torch.distributed as dist

    from nxd_lc.distributed import parallel_state as ps

    if dist.is_available() and dist.is_initialized():
        ps.destroy_model_parallel()
        dist.destroy_process_group()


def _preemption_exit_status(trainer: Any) -> int:
    """The exit status a finished ``trainer`` asks for: :attr:`PreemptionCallback.exit_status` (0 without a
    preemption stop, or without a trainer: the dry run)."""
    from nxd_lc.lightning.preemption import PreemptionCallback

    for callback in getattr(trainer, "callbacks", None) or []:
        if isinstance(callback, PreemptionCallback):
            return callback.exit_status
    return 0


def hydra_task(raw: DictConfig) -> None:
    """The ``@hydra.main`` body (``train.py``): run, turning a dry run that found launch problems
    (:class:`LaunchWouldStop`) into exit status 3, a ConfigError into a message and exit status 2 and a
    preemption signal before the first step into exit status 128 + signum (:class:`StartupInterrupted`); the
    process groups are released at the end, whatever the outcome."""
    from nxd_lc.lightning.preemption import StartupInterrupted

    try:
        trainer = run(raw)
        status = _preemption_exit_status(trainer)
        if status:
            log.warning("stopped by a preemption after its checkpoint was saved: exit status %d (128 + signal)",
                        status)
            raise SystemExit(status)
    except LaunchWouldStop as e:
        print(f"error: the dry run found {len(e.problems)} problem(s) a launch on this host would stop with (listed "
              "above); exit status 3", file=sys.stderr)
        raise SystemExit(3) from None
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    except StartupInterrupted as e:
        log.warning("%s", e)
        raise SystemExit(128 + e.signum) from None
    finally:
        _shutdown_distributed()
