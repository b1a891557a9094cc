"""The training job: validated config -> runtime/env -> parallel state -> model -> weights -> data -> fit.

``train.py`` at the repository root is a thin ``@hydra.main`` that calls :func:`run`. The assembly order is fixed
(DESIGN.md principle 4) and nothing in the config is changed from environment variables.

Dry run: ``python train.py --config-name X +dry_run=true`` validates the config (schema and cross-field rules for
its own world size ``trainer.devices * trainer.num_nodes``), prints the resolved config, the environment it would
set and any key whose feature is not supported yet, and exits without building anything.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import asdict
from typing import Any, Mapping, Optional

import pytorch_lightning as pl
from omegaconf import DictConfig, OmegaConf

from nxd_lc.app.validation import check_supported, load_config, path_problems, unsupported_features
from nxd_lc.config.access import data_parallel_size, model_seq_length, peft_config, resolve_path, seq_length
from nxd_lc.config.errors import ConfigError
from nxd_lc.config.peft_schema import PEFT_KEY
from nxd_lc.config.schema import NxdConfig
from nxd_lc.models.config_json import read_model_json
from nxd_lc.precision import resolve_precision
from nxd_lc.runtime.env import apply_env, format_env_table

log = logging.getLogger("nxd_lc.train")


def _setup_console_logging() -> None:
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="[%(asctime)s %(name)s] %(message)s", stream=sys.stdout)
    logging.getLogger("nxd_lc").setLevel(logging.INFO)


def dry_run(cfg: NxdConfig) -> str:
    """Report for ``+dry_run=true``: resolved config, environment table, not-yet-supported keys, missing paths."""
    env = dict(os.environ)  # a copy: the dry run changes nothing
    table = format_env_table(apply_env(cfg, environ=env))
    ds = cfg.distributed_strategy
    lines = ["# nxd_lc dry run: config is valid", OmegaConf.to_yaml(OmegaConf.structured(asdict(cfg))),
             f"# world size {cfg.trainer.devices * cfg.trainer.num_nodes} = TP {ds.tensor_model_parallel_size} x "
             f"PP {ds.pipeline_model_parallel_size} x CP {ds.context_parallel_size} x DP {data_parallel_size(cfg)};"
             f" seq_length {seq_length(cfg)}",
             f"# {resolve_precision(cfg).describe()}",
             "# environment it would set (variables already set in the environment win):", table]
    problems = unsupported_features(cfg) + [f"at launch: {p}" for p in path_problems(cfg)]
    if problems:
        lines.append("# launching this config would stop with:")
        lines += [f"#   - {p}" for p in problems]
    return "\n".join(lines)


def _drop_yarn_override(hf_overrides: dict[str, Any], rope_theta: Any, seq: int, original: int) -> dict[str, Any]:
    """A YaRN ``hf_config_overrides.rope_scaling`` at ``seq_length <= original_max_position_embeddings`` extends
    nothing: it is dropped, with a warning (its ``rope_theta`` is kept). config.json's own rope_scaling, if any, then
    applies as it is: a pretrained model's scaling is never removed (transformers applies it at every length)."""
    log.warning("rope_scaling: the yarn override is a no-op at seq_length %d <= original_max_position_embeddings %d "
                "and is dropped (config.json's own rope_scaling, if any, is used); raise model.encoder_seq_length "
                "above %d or drop the override", seq, original, original)
    out = {k: v for k, v in hf_overrides.items() if k != "rope_scaling"}
    if rope_theta is not None:
        out["rope_theta"] = rope_theta
    return out


def build_model(cfg: NxdConfig) -> tuple[Any, Any]:
    """``(transformers config, model)`` of a run: config.json + YAML overrides + ``hf_config_overrides`` (+ the
    ``model.moe`` keys for a mixture-of-experts config.json), or with ``model_source: megatron`` the ``model:``
    architecture keys and the tokenizer's vocabulary (:mod:`nxd_lc.models.megatron`), sharded for this rank, HF
    weights loaded (``model.hf_weights_dir``), memory techniques applied. The model is a
    :class:`~nxd_lc.models.llama.LlamaForCausalLM` for the dense families (llama, mistral, qwen2, qwen3) and a
    :class:`~nxd_lc.models.mixtral.MixtralForCausalLM` for ``mixtral``. Needs ``parallel_state`` initialised (or a
    single process). Shared by training, the checkpoint converter and the evaluation, so all three build the same
    model.
    """
    from nxd_lc.models.common.checkpointing import apply_memory_techniques
    from nxd_lc.models.common.rope import warn_if_rope_scaling_is_noop
    from nxd_lc.models.llama.hf_adapter import load_hf_weights
    from nxd_lc.models.llama.model import LlamaForCausalLM, build_llama_config
    from nxd_lc.models.mixtral import MixtralForCausalLM
    from nxd_lc.moe.config import is_moe_model, moe_hf_overrides, moe_options

    m, ds = cfg.model, cfg.distributed_strategy
    overrides = {"num_layers": m.num_layers, "hidden_size": m.hidden_size, "rope_theta": m.rope_theta,
                 "max_position_embeddings": m.max_position_embeddings, "encoder_seq_length": m.encoder_seq_length}
    yaml_overrides = {k: v for k, v in overrides.items() if v is not None}
    path, seq = resolve_path(m.model_config or ""), model_seq_length(cfg) or 0  # RoPE is judged at the model's length
    hf_overrides = dict(m.hf_config_overrides or {})
    rs = hf_overrides.get("rope_scaling")
    if isinstance(rs, Mapping) and rs.get("rope_type") == "yarn" and seq <= int(
            rs.get("original_max_position_embeddings") or seq):
        hf_overrides = _drop_yarn_override(hf_overrides, rs.get("rope_theta"), seq,
                                           rs["original_max_position_embeddings"])
    moe = is_moe_model(read_model_json(cfg))
    if moe:  # model.moe keys set the HF config's expert fields (NxDT's HF Mixtral does the same)
        hf_overrides = {**hf_overrides, **moe_hf_overrides(m.moe)}
    if cfg.model_source == "megatron":  # the architecture from the model: keys, the vocabulary from the tokenizer
        from nxd_lc.data.tokenizer import tokenizer_vocab_size
        from nxd_lc.models.megatron import build_megatron_config

        hf_config = build_megatron_config(m, tokenizer_vocab_size(cfg.data.tokenizer))
    else:
        hf_config = build_llama_config(path, yaml_overrides, hf_config_overrides=hf_overrides or None)
    warn_if_rope_scaling_is_noop(hf_config, seq)  # config.json's own scaling stays applied, with a warning
    common = {"sequence_parallel": ds.sequence_parallel, "kv_replicator": ds.kv_replicator, "fuse_qkv": m.fuse_qkv,
              "qkv_linear": m.qkv_linear, "flash_attention": m.fusions.flash_attention,
              "use_cpu_initialization": m.use_cpu_initialization, **_pipeline_part(cfg, hf_config)}
    model = MixtralForCausalLM(hf_config, moe=moe_options(m.moe), **common) if moe else \
        LlamaForCausalLM(hf_config, **common)
    if m.hf_weights_dir:
        _load_hf_weights(cfg, model, resolve_path(m.hf_weights_dir), load_hf_weights)
    checkpointed = apply_memory_techniques(model, m)
    if checkpointed:
        log.info("activation checkpointing (%s): %d modules recomputed in backward",
                 m.activations_checkpoint_granularity, len(checkpointed))
    peft = peft_config(cfg)
    if peft is not None:  # after memory techniques: LoRA changes the module classes they select by name
        _apply_peft(model, peft)
    return hf_config, model


def _load_hf_weights(cfg: NxdConfig, model: Any, hf_dir: str, convert: Any) -> None:
    """``model.hf_weights_dir`` into ``model``: through the conversion cache (:mod:`nxd_lc.models.llama.hf_cache`)
    when ``model.hf_conversion_cache``, else converted directly."""
    from nxd_lc.distributed import parallel_state as ps
    from nxd_lc.lightning.exp_manager import experiment_paths
    from nxd_lc.models.llama import hf_cache

    m = cfg.model
    if not m.hf_conversion_cache:
        convert(model, hf_dir)
        return
    cache_dir = resolve_path(m.hf_conversion_cache_dir) if m.hf_conversion_cache_dir else os.path.join(
        experiment_paths(cfg).log_dir, "hf_converted")
    key = hf_cache.cache_key(cfg, hf_dir, ps.get_tensor_model_parallel_world_size(),
                             ps.get_pipeline_model_parallel_world_size())
    ep = ps.get_expert_model_parallel_rank() if ps.get_expert_model_parallel_world_size() > 1 else None
    hf_cache.load_or_convert(model, hf_dir, cache_dir, key, ps.get_tensor_model_parallel_rank(),
                             ps.get_pipeline_model_parallel_rank(), force=m.force_reconvert_from_hf, convert=convert,
                             ep_rank=ep)


def _pipeline_part(cfg: NxdConfig, hf_config: Any) -> dict[str, Any]:
    """This rank's share of the model under pipeline parallelism (``keep_layers`` / ``keep_embedding`` /
    ``keep_head``, :func:`nxd_lc.pipeline.rank_model_part`); empty at PP 1 (the whole model)."""
    from nxd_lc.distributed import parallel_state as ps
    from nxd_lc.pipeline import rank_model_part

    ds = cfg.distributed_strategy
    if ps.get_pipeline_model_parallel_world_size() == 1:
        return {}
    return rank_model_part(hf_config.num_hidden_layers, ps.get_pipeline_model_parallel_world_size(),
                           ps.get_pipeline_model_parallel_rank(), ds.virtual_pipeline_model_parallel_size,
                           cfg.model.pipeline_cuts)


def _apply_peft(model: Any, peft: Any) -> None:
    """Wrap ``model_alignment_strategy.peft.target_modules`` with LoRA adapters (only they train); load saved
    adapters if asked (:func:`nxd_lc.alignment.lora_files.load_adapters`)."""
    from nxd_lc.alignment.lora_files import load_adapters
    from nxd_lc.layers.lora import apply_lora

    wrapped = apply_lora(model, peft)
    log.info("LoRA rank %d alpha %g on %d modules (%s); %d trainable parameters on this rank", peft.lora_rank,
             peft.lora_alpha, len(wrapped), ", ".join(sorted(peft.target_modules)),
             sum(p.numel() for p in model.parameters() if p.requires_grad))
    if peft.lora_verbose:
        log.info("LoRA adapters on: %s", ", ".join(wrapped))
    if peft.load_lora_from_ckpt:
        if not peft.lora_ckpt_path:
            raise ValueError(f"{PEFT_KEY}.load_lora_from_ckpt: set {PEFT_KEY}.lora_ckpt_path to an adapter file")
        load_adapters(model, peft, resolve_path(peft.lora_ckpt_path))


def save_lora_outputs(cfg: NxdConfig, model: Any, log_dir: str, is_rank0: bool) -> None:
    """End of a LoRA run: the adapters under ``<log_dir>/lora/`` (``adapters.pt``, full and TP-independent, or
    per-rank shards with ``merge_sharded_lora: false``; load with ``load_lora_from_ckpt``; see
    :mod:`nxd_lc.alignment.lora_files`), and with ``model_alignment_strategy.peft.merge_lora`` the merged model as
    an HF directory ``<log_dir>/hf_merged`` (adapters folded into the base weights, plus the tokenizer when it is
    an HF dir). Collective over TP (every rank calls it); files are written atomically (temp name + rename)."""
    from nxd_lc.alignment.lora_files import save_adapters
    from nxd_lc.distributed import collectives
    from nxd_lc.layers.lora import merge_lora
    from nxd_lc.models.llama.hf_adapter import save_hf_weights

    peft = peft_config(cfg)
    save_adapters(model, peft, os.path.join(log_dir, "lora"), is_rank0)
    if peft.merge_lora:
        merge_lora(model)
        out = os.path.join(log_dir, "hf_merged")
        save_hf_weights(model, out)  # collective; rank 0 writes
        tok = cfg.data.tokenizer.type
        if is_rank0 and tok and os.path.isdir(resolve_path(tok)):
            from transformers import AutoTokenizer

            AutoTokenizer.from_pretrained(resolve_path(tok)).save_pretrained(out)
            log.info("merged model saved: %s", out)
    collectives.barrier()


def load_model_weights(model: Any, checkpoint_path: str) -> None:
    """Load only the model weights of an nxd_lc checkpoint ``<root>/<tag>`` into ``model`` (this rank's shard).

    Used by ``model.weight_init_only``. A checkpoint saved at another TP / PP layout is re-sharded on load
    (:func:`nxd_lc.checkpoint.reshard.reshard_model_state`). LoRA adapters of the model
    (``model_alignment_strategy.peft``) may be absent from it: fine-tuning a pretrained checkpoint starts them fresh
    (B = 0); every base weight must be there.

    Raises:
        FileNotFoundError: the shard for this rank is missing (names the TP/PP sizes found).
        ValueError: the checkpoint's weights do not fit the model (names the keys and the config keys to check).
    """
    from nxd_lc.checkpoint import sharded
    from nxd_lc.checkpoint.reshard import reshard_model_state, saved_layout
    from nxd_lc.distributed import parallel_state as ps
    from nxd_lc.layers.lora import is_lora_key

    root, tag = os.path.split(os.path.abspath(checkpoint_path))
    saved = saved_layout(os.path.join(root, tag))
    moves = (saved.tp, saved.pp) != (ps.get_tensor_model_parallel_world_size(),
                                     ps.get_pipeline_model_parallel_world_size())
    ep = ps.get_expert_model_parallel_world_size()
    if saved.ep != ep or (moves and ep > 1):
        raise ValueError(f"exp_manager.resume_from_checkpoint {checkpoint_path} (model.weight_init_only): saved with "
                         f"TP {saved.tp}, PP {saved.pp}, EP {saved.ep}; re-sharding experts is not supported yet: "
                         "use the saved tensor / pipeline / expert_model_parallel sizes")
    state, _, _ = sharded.load_checkpoint(root, tag, dp_rank=ps.get_data_parallel_rank(),
                                          tp_rank=ps.get_tensor_model_parallel_rank(),
                                          pp_rank=ps.get_pipeline_model_parallel_rank(), load_optim=False,
                                          read_model=not moves,
                                          ep_rank=ps.get_expert_model_parallel_rank() if ep > 1 else None)
    prefix = "model."
    if moves:  # saved at another TP / PP layout: this rank's weights are rebuilt from the saved shards
        template = {prefix + k: v for k, v in model.state_dict().items() if not is_lora_key(k)}
        state = reshard_model_state(model, template, os.path.join(root, tag))
    local = {k[len(prefix):] if k.startswith(prefix) else k: v for k, v in state.items()}
    try:
        result = model.load_state_dict(local, strict=False)
    except RuntimeError as e:  # shapes
        raise ValueError(f"exp_manager.resume_from_checkpoint {checkpoint_path} (model.weight_init_only): the "
                         f"weights do not fit the model: {e}") from e
    missing = [k for k in result.missing_keys if not is_lora_key(k)]
    if missing or result.unexpected_keys:
        raise ValueError(f"exp_manager.resume_from_checkpoint {checkpoint_path} (model.weight_init_only): the "
                         f"checkpoint lacks {missing[:4]} and has unexpected {list(result.unexpected_keys)[:4]}; "
                         "model.model_config, fuse_qkv, qkv_linear and the TP / PP sizes must be those of the run "
                         "that saved it")


def run(raw: DictConfig | Mapping[str, Any], trainer_overrides: Optional[dict[str, Any]] = None) -> Any:
    """Run the job described by ``raw`` (a composed Hydra config). Returns the Trainer (None on dry run).

    Raises:
        ConfigError: any config problem, all listed, before anything is built.
    """
    _setup_console_logging()
    from nxd_lc.runtime.device import launched_world_size

    is_dry = bool(OmegaConf.select(OmegaConf.create(raw) if not isinstance(raw, DictConfig) else raw,
                                   "dry_run", default=False))
    cfg = load_config(raw, world_size=None if is_dry else launched_world_size(), check_paths=not is_dry)
    if cfg.dry_run:
        print(dry_run(cfg))
        return None
    check_supported(cfg)
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
        if cfg.prewarm:  # graph-extraction pass, manifest beside the compile cache (nxd_lc.runtime.prewarm)
            from nxd_lc.runtime.prewarm import run_prewarm

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
    from nxd_lc.distributed import parallel_state as ps
    from nxd_lc.lightning import exp_manager
    from nxd_lc.lightning.trainer import build_trainer
    from nxd_lc.models.common.attention import set_nki_options
    from nxd_lc.runtime.device import init_distributed, resolve_accelerator
    from nxd_lc.runtime.prewarm import begin_graph_recording, end_graph_recording

    env_entries = apply_env(cfg)  # before any runtime initialises
    accelerator = resolve_accelerator(cfg.trainer.accelerator)
    # xla/neuron: record the compiled graphs (prewarm manifest, or the check against it), before the first compile
    graph_record = begin_graph_recording(cfg, accelerator, int(os.environ.get("RANK", "0")))
    runtime = init_distributed(accelerator)
    ds = cfg.distributed_strategy
    ps.initialize_model_parallel(tensor_model_parallel_size=ds.tensor_model_parallel_size,
                                 pipeline_model_parallel_size=ds.pipeline_model_parallel_size,
                                 context_parallel_size=ds.context_parallel_size, kv_replicator=ds.kv_replicator,
                                 expert_model_parallel_size=ds.expert_model_parallel_size)
    set_context_parallel_algo(ds.context_parallel_algo)
    mark("distributed_init_s")
    set_nki_options(cfg.model.transpose_nki_inputs, cfg.trainer.lnc)
    paths = exp_manager.experiment_paths(cfg)
    exp_manager.lock_run_dir(paths, is_global_zero=runtime.rank == 0)  # before anything is written there
    exp_manager.setup_log_files(cfg, paths, runtime.rank, runtime.local_rank)
    if runtime.rank == 0:
        log.info("effective environment:\n%s", format_env_table(env_entries))
        log.info("%s", resolve_precision(cfg).describe())
        log.info("log dir: %s", paths.log_dir)
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
        module.prepare_reference(data)
    if recovery is not None:
        recovery.resumed_from = ckpt_path
    trainer = build_trainer(cfg, runtime, paths, preemption, extra_callbacks=[recovery] if recovery else [],
                            **trainer_overrides)
    trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    end_graph_recording(cfg, graph_record, trainer.global_step)  # writes the manifest (prewarm) or checks it
    if peft_config(cfg) is not None and not cfg.prewarm:
        save_lora_outputs(cfg, model, paths.log_dir, runtime.rank == 0)
    return trainer


def _build_and_move(cfg: NxdConfig, runtime: Any) -> tuple[Any, Any]:
    """:func:`build_model`, the move to the device and ``model.compile`` (:mod:`nxd_lc.models.common.compile`), in
    waves of ``trainer.sequential_move_factor`` ranks per
    node (:mod:`nxd_lc.runtime.startup`)."""
    from nxd_lc.runtime.startup import run_in_waves

    def build() -> tuple[Any, Any]:
        hf_config, model = build_model(cfg)
        model = model.to(runtime.device)
        if cfg.model.compile:  # regional torch.compile of each decoder layer (training only; eval stays eager)
            from nxd_lc.models.common.compile import compile_backend, compile_decoder_layers

            compile_decoder_layers(model, compile_backend(runtime.accelerator))
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


def hydra_task(raw: DictConfig) -> None:
    """The ``@hydra.main`` body (``train.py``): run, turning a ConfigError into a message and exit status 2; the
    process groups are released at the end, whatever the outcome."""
    try:
        run(raw)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    finally:
        _shutdown_distributed()
