"""Assembly of a run's model: the transformers config of a run (config.json + YAML overrides, or the Megatron
``model:`` keys), the sharded model for this rank, HF weights, memory techniques and LoRA; loading a checkpoint's
model weights (re-sharded when the layout differs); LoRA outputs at the end of a run. Shared by training
(:mod:`nxd_lc.app.run`), the checkpoint converters (:mod:`nxd_lc.app.convert`) and the evaluation CLIs, so all of
them build the same model.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Mapping

from nxd_lc.config.access import model_seq_length, peft_config, resolve_path, seq_length
from nxd_lc.config.peft_schema import PEFT_KEY
from nxd_lc.config.schema import NxdConfig
from nxd_lc.models.config_json import read_model_json

log = logging.getLogger("nxd_lc.train")


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


def _host_accelerator(cfg: NxdConfig) -> str:
    """``trainer.accelerator`` resolved on this host (``cpu`` when it cannot be: validation reports why)."""
    from nxd_lc.runtime.device import resolve_accelerator

    try:
        return resolve_accelerator(str(cfg.trainer.accelerator))
    except (ValueError, RuntimeError):
        return "cpu"


def decoder_compiled(cfg: NxdConfig, accelerator: str) -> bool:
    """Whether ``model.compile`` (true | false | auto) compiles the decoder layers on ``accelerator``
    (:func:`nxd_lc.models.common.compile.compile_enabled`; ``auto`` stays eager with LoRA or attention dropout)."""
    from nxd_lc.app.validation.parallel import compile_blocker
    from nxd_lc.models.common.compile import compile_enabled
    from nxd_lc.moe.config import is_moe_model

    m = cfg.model
    if m.compile is not True and m.compile != "auto":
        return compile_enabled(m.compile, accelerator)
    hf = read_model_json(cfg) or {}
    dropout = m.attention_dropout if cfg.model_source == "megatron" else hf.get("attention_dropout")
    return compile_enabled(m.compile, accelerator,
                           blocked_by=compile_blocker(cfg, float(dropout or 0.0), is_moe_model(hf)))


def build_model(cfg: NxdConfig, accelerator: str | None = None) -> tuple[Any, Any]:
    """``(transformers config, model)`` of a run: config.json + YAML overrides + ``hf_config_overrides`` (+ the
    ``model.moe`` keys for a mixture-of-experts config.json), or with ``model_source: megatron`` the ``model:``
    architecture keys and the tokenizer's vocabulary (:mod:`nxd_lc.models.megatron`), sharded for this rank, HF
    weights loaded (``model.hf_weights_dir``), memory techniques applied. The model is a
    :class:`~nxd_lc.models.llama.LlamaForCausalLM` for the dense families (llama, mistral, qwen2, qwen3) and a
    :class:`~nxd_lc.models.mixtral.MixtralForCausalLM` for ``mixtral``. Needs ``parallel_state`` initialised (or a
    single process). Shared by training, the checkpoint converter and the evaluation, so all three build the same
    model. ``accelerator``: the resolved ``trainer.accelerator`` the model will run on (None: resolved on this host),
    which decides the ``model.fusions`` kernels (:mod:`nxd_lc.layers.fusions`).

    Raises:
        RuntimeError: a parameter of the built model carries no parallel attribute
            (:func:`nxd_lc.layers.param_attrs.check_parallel_attributes`; names it).
    """
    from nxd_lc.layers.param_attrs import check_parallel_attributes
    from nxd_lc.models.common.memory_plan import apply_kernels_and_memory
    from nxd_lc.models.common.rope import warn_if_rope_scaling_is_noop
    from nxd_lc.models.hf_config import build_llama_config
    from nxd_lc.models.llama.hf_adapter import load_hf_weights
    from nxd_lc.models.llama.model import LlamaForCausalLM
    from nxd_lc.models.mixtral import MixtralForCausalLM
    from nxd_lc.moe.config import is_moe_model, moe_hf_overrides, moe_options
    from nxd_lc.precision.policy import resolve_precision

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
    accelerator = accelerator or _host_accelerator(cfg)
    policy = resolve_precision(cfg)
    m, checkpointed = apply_kernels_and_memory(
        model, m, accelerator=accelerator, compiled=decoder_compiled(cfg, accelerator),
        tokens=cfg.data.micro_batch_size * (seq_length(cfg) or 0),
        element_size=(policy.autocast_dtype or policy.param_dtype).itemsize,
        tensor_parallel=ds.tensor_model_parallel_size, sequence_parallel=ds.sequence_parallel)
    if checkpointed:
        offloaded = ""
        if m.activations_offload:
            kept = "inputs and attention outputs" if m.activations_checkpoint_save_attention else "inputs"
            offloaded = f", {kept} offloaded to host"
        log.info("activation checkpointing (%s%s): %d modules recomputed in backward",
                 m.activations_checkpoint_granularity, offloaded, len(checkpointed))
    peft = peft_config(cfg)
    if peft is not None:  # after memory techniques: LoRA changes the module classes they select by name
        _apply_peft(model, peft)
    check_parallel_attributes(model)  # every parameter as its layer marked it (DESIGN.md 17)
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
    an HF directory ``<log_dir>/hf_merged`` (adapters folded into the base weights, plus the run's saved tokenizer
    and its special token ids in ``config.json`` / ``generation_config.json``). Collective over TP (every rank
    calls it); files are written atomically (temp name + rename)."""
    from nxd_lc.alignment.lora_files import save_adapters
    from nxd_lc.data.tokenizer import load_saved_tokenizer, special_token_ids
    from nxd_lc.distributed import collectives
    from nxd_lc.layers.lora import merge_lora
    from nxd_lc.lightning.run_tokenizer import RUN_TOKENIZER_DIR, copy_tokenizer_files
    from nxd_lc.models.llama.hf_adapter import save_hf_weights

    peft = peft_config(cfg)
    save_adapters(model, peft, os.path.join(log_dir, "lora"), is_rank0)
    if peft.merge_lora:
        merge_lora(model)
        out = os.path.join(log_dir, "hf_merged")
        tok_dir = os.path.join(log_dir, RUN_TOKENIZER_DIR)  # saved by every training run (SaveRunTokenizer)
        tokenizer = load_saved_tokenizer(tok_dir, f"the run's tokenizer {tok_dir}") if os.path.isdir(tok_dir) \
            else None
        save_hf_weights(model, out,  # collective; rank 0 writes
                        token_ids=special_token_ids(tokenizer) if tokenizer is not None else None)
        if is_rank0:
            if tokenizer is not None:
                copy_tokenizer_files(tok_dir, out)
            log.info("merged model saved: %s", out)
    collectives.barrier()


def run_kv_layout(cfg: NxdConfig, accelerator: str | None = None) -> str:
    """The run's KV-replica layout (``distributed_strategy.kv_replica_layout``, ``auto`` resolved as NxD resolves
    it: :func:`nxd_lc.context.nki.resolve_kv_replica_layout`); ``accelerator``: the resolved
    ``trainer.accelerator`` (default: the configured value)."""
    from nxd_lc.context.nki import resolve_kv_replica_layout

    return resolve_kv_replica_layout(cfg.distributed_strategy.kv_replica_layout,
                                     accelerator or cfg.trainer.accelerator, cfg.trainer.lnc)


def set_checkpoint_kv_layout(cfg: NxdConfig) -> None:
    """Start-up: the KV-replica layout of loaded checkpoints that record none
    (``exp_manager.checkpoint_kv_replica_layout``; :func:`nxd_lc.checkpoint.nxd_format.set_unrecorded_kv_layout`)."""
    from nxd_lc.checkpoint.nxd_format import set_unrecorded_kv_layout

    value = cfg.exp_manager.checkpoint_kv_replica_layout
    set_unrecorded_kv_layout(None if value == "auto" else value)


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
    from nxd_lc.checkpoint.nxd_format import MODEL_PREFIX, key_mismatch_message
    from nxd_lc.checkpoint.reshard import reshard_model_state, reshard_reason, saved_layout
    from nxd_lc.distributed import parallel_state as ps
    from nxd_lc.layers.lora import is_lora_key

    root, tag = os.path.split(os.path.abspath(checkpoint_path))
    saved = saved_layout(os.path.join(root, tag))
    reason = reshard_reason(model, os.path.join(root, tag), saved)
    moves = reason is not None
    ep = ps.get_expert_model_parallel_world_size()
    if saved.ep != ep or (moves and ep > 1):
        raise ValueError(f"exp_manager.resume_from_checkpoint {checkpoint_path} (model.weight_init_only): saved with "
                         f"TP {saved.tp}, PP {saved.pp}, EP {saved.ep} ({reason or 'another EP size'}); re-sharding "
                         "experts is not supported yet: use the saved tensor / pipeline / expert_model_parallel "
                         "sizes and model.pipeline_cuts")
    if moves:
        log.warning("exp_manager.resume_from_checkpoint %s (model.weight_init_only) is re-sharded: %s",
                    checkpoint_path, reason)
    state, _, _ = sharded.load_checkpoint(root, tag, dp_rank=ps.get_data_parallel_rank(),
                                          tp_rank=ps.get_tensor_model_parallel_rank(),
                                          pp_rank=ps.get_pipeline_model_parallel_rank(), load_optim=False,
                                          read_model=not moves,
                                          ep_rank=ps.get_expert_model_parallel_rank() if ep > 1 else None)
    prefix = MODEL_PREFIX
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
        expected = [prefix + k for k in model.state_dict() if not is_lora_key(k)]
        raise ValueError("exp_manager.resume_from_checkpoint (model.weight_init_only): " + key_mismatch_message(
            checkpoint_path, expected, state, KeyError(f"{len(missing)} missing, {len(result.unexpected_keys)} "
                                                       "unexpected")))
