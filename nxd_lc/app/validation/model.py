"""Cross-field rules of the model: memory techniques and RoPE overrides, decoder-family parts, the Megatron
source keys, mixture of experts."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from nxd_lc.app.validation.parallel import lazy_neuron_or_xla
from nxd_lc.config.access import data_parallel_size, model_seq_length
from nxd_lc.config.schema import CHECKPOINT_METHODS, NxdConfig, checkpoint_method_problems
from nxd_lc.layers.fusions import FUSION_KEYS, fusion_problems
from nxd_lc.models.common.memory_plan import budget_problem
from nxd_lc.models.common.rope import rope_scaling_problems
from nxd_lc.models.megatron import MEGATRON_KEYS, megatron_problems
from nxd_lc.moe.config import expert_parallel_problems, moe_problems


def memory_problems(cfg: NxdConfig) -> list[str]:
    p: list[str] = []
    m = cfg.model
    overrides = m.hf_config_overrides or {}
    if not isinstance(overrides, Mapping):
        p.append("model.hf_config_overrides: must be a mapping of config.json keys to values")
    elif isinstance(overrides.get("rope_scaling"), Mapping):
        rs = dict(overrides["rope_scaling"])
        orig, s = rs.get("original_max_position_embeddings"), model_seq_length(cfg)
        if rs.get("rope_type") == "yarn" and isinstance(orig, int) and s is not None and s <= orig:
            # a no-op (unscaled RoPE, with a warning at build time): a ${div:seq,orig} factor < 1 is fine
            rs["factor"] = max(1.0, float(rs.get("factor") or 1.0))
        p.extend(rope_scaling_problems(rs))
    for key in ("tiled_loss_chunk_size", "tiled_mlp_chunk_size"):
        v = getattr(m, key)
        if v is not None and v < 1:
            p.append(f"model.{key}: must be >= 1 tokens (or null to disable), got {v}")
    if m.activations_checkpoint_granularity == "selective" and not m.activations_checkpoint_recompute:
        p.append("model.activations_checkpoint_recompute: 'selective' granularity needs module names to "
                 "recompute, e.g. [CoreAttention]")
    if m.activations_checkpoint_save_attention and m.activations_checkpoint_granularity is None:
        p.append("model.activations_checkpoint_save_attention: true keeps attention outputs inside checkpointed "
                 "modules, but model.activations_checkpoint_granularity is null (nothing is checkpointed); set "
                 "the granularity to full (or selective) or the key to false")
    if m.activations_checkpoint_method in CHECKPOINT_METHODS:
        p.extend(checkpoint_method_problems(m.activations_checkpoint_granularity, m.activations_checkpoint_method,
                                            m.activations_checkpoint_num_layers))
    p.extend(budget_and_offload_problems(cfg))
    p.extend(cuda_graph_problems(cfg))
    if m.weight_init_only and not cfg.exp_manager.resume_from_checkpoint:
        p.append("model.weight_init_only: needs exp_manager.resume_from_checkpoint (the checkpoint whose model "
                 "weights initialise this run)")
    return p


def cuda_graph_problems(cfg: NxdConfig) -> list[str]:
    """``model.enable_cuda_graph`` (:func:`nxd_lc.models.common.compile.compile_decoder_layers`): compiled decoder
    layers on CUDA (``trainer.accelerator`` gpu, or auto; ``model.compile`` true, or auto that the run would not
    keep eager), and not yet with tensor, context or pipeline parallelism (collectives and the pipeline's
    send / receive inside captured graphs have not been checked)."""
    m, ds = cfg.model, cfg.distributed_strategy
    if not m.enable_cuda_graph:
        return []
    key = "model.enable_cuda_graph: true"
    if cfg.trainer.accelerator not in ("gpu", "auto"):
        return [f"{key} needs CUDA (trainer.accelerator gpu), not {cfg.trainer.accelerator}; set it false"]
    p = []
    if m.compile is False:
        p.append(f"{key} replays the compiled decoder layers as CUDA graphs, but model.compile is false; set "
                 "model.compile: true (or auto) or enable_cuda_graph: false")
    elif m.compile == "auto":
        from nxd_lc.app.build import decoder_compiled

        if not decoder_compiled(cfg, "gpu"):  # auto keeps the layers eager for a feature not checked under compile
            p.append(f"{key}: model.compile auto keeps the decoder layers eager for this configuration (see the "
                     "dry run's log), so there is nothing to capture; set enable_cuda_graph: false")
    sizes = {"tensor_model_parallel_size": ds.tensor_model_parallel_size,
             "context_parallel_size": ds.context_parallel_size,
             "pipeline_model_parallel_size": ds.pipeline_model_parallel_size}
    for name, size in sizes.items():
        if size > 1:
            p.append(f"not supported yet: {key} with distributed_strategy.{name} {size} (collectives inside "
                     "captured graphs are not checked); set it false")
    return p


def budget_and_offload_problems(cfg: NxdConfig) -> list[str]:
    """``model.activations_memory_budget`` (:mod:`nxd_lc.models.common.memory_plan`): a valid budget, and the memory
    keys it chooses not also set by hand (one of the two would be ignored); not with pipeline parallelism (the
    schedule keeps several micro-batches' activations, which the estimate does not model).
    ``model.activations_offload``: whole recomputed layers (``full``; with ``..._save_attention`` their attention
    outputs go to the host too), not with ``model.compile: true`` (dynamo does not trace the offload hooks)."""
    m, p = cfg.model, []
    budget = m.activations_memory_budget
    if budget is not None:
        problem = budget_problem(budget)
        if problem:
            p.append(problem)
        chosen = {"activations_checkpoint_granularity": m.activations_checkpoint_granularity,
                  "activations_checkpoint_recompute": m.activations_checkpoint_recompute,
                  "activations_checkpoint_save_attention": m.activations_checkpoint_save_attention or None,
                  "tiled_mlp_chunk_size": m.tiled_mlp_chunk_size, "tiled_loss_chunk_size": m.tiled_loss_chunk_size,
                  "activations_offload": m.activations_offload or None}
        for key, value in chosen.items():
            if value is not None:
                p.append(f"model.{key}: {value!r} is chosen by model.activations_memory_budget ({budget!r}); set "
                         f"model.{key}: null (false) to let the budget choose, or remove the budget")
        if cfg.distributed_strategy.pipeline_model_parallel_size > 1:
            p.append("not supported yet: model.activations_memory_budget with pipeline_model_parallel_size > 1 (the "
                     "estimate does not model the micro-batches a pipeline schedule keeps); set the memory keys by "
                     "hand")
    elif m.activations_offload:
        if m.activations_checkpoint_granularity != "full":
            p.append("model.activations_offload: true offloads the inputs of whole recomputed layers: it needs "
                     "model.activations_checkpoint_granularity: full")
    if lazy_neuron_or_xla(cfg.trainer.accelerator):  # torch-xla's checkpoint: whole modules, reentrant
        for key in ("activations_checkpoint_save_attention", "activations_offload"):
            if getattr(m, key):
                p.append(f"not supported yet: model.{key}: true on trainer.accelerator {cfg.trainer.accelerator} "
                         "(torch-xla's activation checkpoint recomputes whole modules: no selective policy, no "
                         "offload hooks); set it false")
    if m.activations_offload and m.compile is True:
        p.append("model.activations_offload: not supported with model.compile: true (torch.compile does not trace "
                 "the offload's saved-tensor hooks); set model.compile: auto or false")
    return p


def fusion_config_problems(cfg: NxdConfig) -> list[str]:
    """``model.fusions.rms_norm | rope | swiglu | cross_entropy`` (:mod:`nxd_lc.layers.fusions`): a known kernel
    choice, and ``liger`` only where Liger-Kernel can run (CUDA, importable; the loss at TP 1 without the tiled
    loss). ``trainer.accelerator: auto`` is judged on this host."""
    from nxd_lc.runtime.device import resolve_accelerator

    fusions = cfg.model.fusions
    values = {k: getattr(fusions, k, "auto") for k in FUSION_KEYS}
    if all(v in ("auto", "torch") for v in values.values()):
        return []  # nothing device-dependent to check
    accelerator = str(cfg.trainer.accelerator)
    if accelerator not in ("cpu", "gpu", "xla"):
        try:
            accelerator = resolve_accelerator(accelerator)
        except (ValueError, RuntimeError):
            return []  # trainer.accelerator's own rule reports it
    return fusion_problems(values, accelerator, cfg.distributed_strategy.tensor_model_parallel_size,
                           cfg.model.tiled_loss_chunk_size is not None)


def family_problems(cfg: NxdConfig, hf: dict[str, Any] | None) -> list[str]:
    """Decoder-family parts not supported yet: sliding-window attention shorter than the sequence (mistral's
    ``sliding_window``, qwen2 / qwen3 ``use_sliding_window``, Megatron ``sliding_window_size``) with context
    parallelism (the ring / Ulysses kernels have no window); attention dropout (a config.json's, or Megatron's
    ``attention_dropout``) with context or pipeline parallelism (shared masks) or with ``model.compile`` (its
    per-rank seed is a host read)."""
    if hf is None:
        return []
    kind, p, ds = hf.get("model_type", "llama"), [], cfg.distributed_strategy
    window = hf.get("sliding_window") if kind == "mistral" or (
        kind in ("qwen2", "qwen3") and hf.get("use_sliding_window")) else None
    seq = model_seq_length(cfg)
    source = "model.sliding_window_size" if cfg.model_source == "megatron" else f"sliding_window of {kind} config.json"
    if window and ds.context_parallel_size > 1 and (seq is None or window < seq):
        p.append(f"not supported yet: sliding-window attention ({source} {window} < sequence {seq}) with "
                 "distributed_strategy.context_parallel_size > 1; set context_parallel_size: 1")
    dropout = float(hf.get("attention_dropout") or 0.0)
    key = "model.attention_dropout" if cfg.model_source == "megatron" else f"attention_dropout of {kind} config.json"
    if dropout > 0 and cfg.model_source != "megatron" and (ds.context_parallel_size > 1
                                                           or ds.pipeline_model_parallel_size > 1):
        p.append(f"not supported yet: attention dropout ({key} {dropout}) with context_parallel_size > 1 or "
                 "pipeline_model_parallel_size > 1; set it to 0")  # megatron: megatron_problems covers every dropout
    if dropout > 0 and cfg.model.compile is True:  # auto stays eager instead (compile_blocker)
        p.append(f"not supported yet: attention dropout ({key} {dropout}) with model.compile; set one of them off")
    return p


def megatron_source_problems(cfg: NxdConfig) -> list[str]:
    """The ``model_source: megatron`` architecture keys (:func:`nxd_lc.models.megatron.megatron_problems`), and
    dropout (those keys', or an HF config.json's attention_dropout) with pipeline or context parallelism."""
    p = megatron_problems(cfg.model, cfg.model_source)
    tok = cfg.data.tokenizer
    if cfg.model_source == "megatron" and (cfg.model.position_embedding_type or MEGATRON_KEYS[
            "position_embedding_type"]) != "rope":
        for i, stage in enumerate(cfg.data.curriculum or []):
            if isinstance(stage, Mapping) and stage.get("rope_scaling") is not None:
                p.append(f"data.curriculum[{i}].rope_scaling: the model has learned absolute positions "
                         "(model.position_embedding_type), no RoPE to scale; remove it")
    if cfg.model_source == "megatron" and tok.type == "bytelevel_bpe" and tok.library is None:
        p.append("data.tokenizer.type: bytelevel_bpe is trained from the corpus at data setup, but model_source: "
                 "megatron sizes its vocabulary from the tokenizer before; give an HF tokenizer directory or GPT-2 "
                 "vocab_file / merge_file (library: megatron, type: GPT2BPETokenizer)")
    ds = cfg.distributed_strategy
    if cfg.model_source == "megatron" and (ds.pipeline_model_parallel_size > 1 or ds.context_parallel_size > 1):
        for key in ("hidden_dropout", "attention_dropout", "ffn_dropout"):
            value = getattr(cfg.model, key)
            if (MEGATRON_KEYS[key] if value is None else value) > 0:
                p.append(f"not supported yet: model.{key} > 0 with pipeline_model_parallel_size > 1 or "
                         "context_parallel_size > 1 (every stage / CP rank would draw the same dropout masks); "
                         f"set model.{key}: 0")
    return p


def moe_layout_problems(cfg: NxdConfig, hf: dict[str, Any] | None) -> list[str]:
    """``model.moe`` and ``distributed_strategy.expert_model_parallel_size`` (:mod:`nxd_lc.moe.config`)."""
    return moe_problems(cfg, hf) + expert_parallel_problems(cfg, hf, data_parallel_size(cfg))
