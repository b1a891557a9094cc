"""Cross-field rules of the parallel layout: world size and degrees, heads and KV replication, context
parallelism (ring / Ulysses), pipeline stages, and what the XLA / lazy Neuron devices cannot run."""

from __future__ import annotations

import difflib
from typing import Any

from nxd_lc.config.access import (
    data_parallel_size,
    microbatch_problem,
    num_microbatches,
    peft_config,
    resolve_path,
    seq_length,
)
from nxd_lc.config.schema import NxdConfig
from nxd_lc.distributed.kv_layout import KV_REPLICA_LAYOUTS
from nxd_lc.pipeline.split import split_problems
from nxd_lc.runtime.device import is_lazy_config_accelerator


def parallel_problems(cfg: NxdConfig, world_size: int | None) -> list[str]:
    p: list[str] = []
    ds, tr = cfg.distributed_strategy, cfg.trainer
    for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                "kv_replicator", "virtual_pipeline_model_parallel_size"):
        if getattr(ds, key) < 1:
            p.append(f"distributed_strategy.{key}: must be >= 1, got {getattr(ds, key)}")
    for key, value in (("distributed_strategy.kv_replica_layout", ds.kv_replica_layout),
                       ("exp_manager.checkpoint_kv_replica_layout", cfg.exp_manager.checkpoint_kv_replica_layout)):
        if value not in ("auto", *KV_REPLICA_LAYOUTS):
            p.append(f"{key}: {value!r} is not one of auto, {', '.join(KV_REPLICA_LAYOUTS)} (interleaved: NxD's "
                     f"KV-replica layout on Trn1; adjacent: on Trn2 / Trn3)")
    if tr.devices < 1 or tr.num_nodes < 1:
        p.append("trainer.devices / trainer.num_nodes: must be >= 1")
        return p
    world = tr.devices * tr.num_nodes
    if world_size is not None and world_size != world:
        p.append(f"trainer.devices: launched world size is {world_size} but trainer.devices * trainer.num_nodes"
                 f" = {tr.devices} * {tr.num_nodes} = {world}; set trainer.devices to the processes per node "
                 f"(torchrun --nproc_per_node) and trainer.num_nodes to the node count")
    mp = ds.tensor_model_parallel_size * ds.pipeline_model_parallel_size * ds.context_parallel_size
    if mp >= 1 and world % mp != 0:
        p.append(f"distributed_strategy.tensor_model_parallel_size: world size {world} is not divisible by "
                 f"TP * PP * CP = {ds.tensor_model_parallel_size} * {ds.pipeline_model_parallel_size} * "
                 f"{ds.context_parallel_size} = {mp}; world = TP x PP x CP x DP")
    cb = cfg.exp_manager.checkpoint_callback_params
    expected_mp = ds.tensor_model_parallel_size * ds.pipeline_model_parallel_size
    if cb.model_parallel_size is not None and cb.model_parallel_size != expected_mp:
        p.append(f"exp_manager.checkpoint_callback_params.model_parallel_size: {cb.model_parallel_size} != TP * PP"
                 f" = {expected_mp}; use ${{multiply:${{distributed_strategy.tensor_model_parallel_size}}, "
                 f"${{distributed_strategy.pipeline_model_parallel_size}}}}")
    return p


def ring_attention_problems(cfg: NxdConfig) -> list[str]:
    """CP > 1: NxDT's ``model.fusions.ring_attention`` (its CP switch) must agree with ``context_parallel_algo``:
    true selects ring (the default algorithm), false leaves only ulysses."""
    ring, algo = cfg.model.fusions.ring_attention, cfg.distributed_strategy.context_parallel_algo
    if ring is True and algo != "ring":
        return [f"model.fusions.ring_attention: true selects ring attention but distributed_strategy."
                f"context_parallel_algo is {algo!r}; remove one of them (ulysses: set ring_attention: false)"]
    if ring is False and algo == "ring":
        return ["model.fusions.ring_attention: false but distributed_strategy.context_parallel_algo is 'ring' (the "
                "default) with context_parallel_size > 1; set ring_attention: true, or context_parallel_algo: "
                "ulysses"]
    return []


def lazy_neuron_or_xla(accelerator: str) -> bool:
    """``trainer.accelerator`` 'xla', or 'neuron' unless this host has the native (PrivateUse1) Neuron device,
    which is eager (:func:`nxd_lc.runtime.device.is_lazy_config_accelerator`): where torch-xla's lazy tensors run."""
    if accelerator not in ("xla", "neuron"):
        return False
    return is_lazy_config_accelerator(accelerator)


def length_divisibility_problems(cfg: NxdConfig, s: int, key: str, *, sequence_parallel: bool = True,
                                  context_parallel: bool = True) -> list[str]:
    """A training length ``s`` (named ``key``) against the layout: divisible by TP under sequence parallelism, by
    the CP chunks (ring: 2 x CP load-balanced chunks; ulysses: CP), and per CP rank by TP under sequence
    parallelism."""
    ds, p = cfg.distributed_strategy, []
    cp, tp = ds.context_parallel_size, ds.tensor_model_parallel_size
    if sequence_parallel and ds.sequence_parallel and tp >= 1 and s % tp != 0:
        p.append(f"{key}: {s} must be divisible by tensor_model_parallel_size {tp} when "
                 f"distributed_strategy.sequence_parallel is true")
    if not context_parallel or cp <= 1 or tp < 1 or ds.context_parallel_algo not in ("ring", "ulysses"):
        return p
    chunks = 2 * cp if ds.context_parallel_algo == "ring" else cp
    if s % chunks != 0:
        p.append(f"{key}: {s} must be divisible by {chunks} for context_parallel_size {cp} with "
                 f"context_parallel_algo {ds.context_parallel_algo}"
                 + (" (load-balanced ring: 2 x CP chunks)" if ds.context_parallel_algo == "ring" else ""))
    elif ds.sequence_parallel and (s // cp) % tp != 0:
        p.append(f"{key}: the per-CP-rank sequence {s // cp} must be divisible by "
                 f"tensor_model_parallel_size {tp} under sequence_parallel")
    return p


def context_parallel_problems(cfg: NxdConfig, hf: dict[str, Any] | None) -> list[str]:
    """CP layout rules: ring needs 2*cp chunks, Ulysses needs heads divisible by cp, SP splits the CP shard."""
    p: list[str] = []
    ds, s = cfg.distributed_strategy, seq_length(cfg)
    cp, tp = ds.context_parallel_size, ds.tensor_model_parallel_size
    if ds.context_parallel_algo not in ("ring", "ulysses"):
        near = difflib.get_close_matches(ds.context_parallel_algo, ["ring", "ulysses"], n=1)
        hint = f"did you mean '{near[0]}'? " if near else ""
        p.append(f"distributed_strategy.context_parallel_algo: unknown value {ds.context_parallel_algo!r}; "
                 f"{hint}choose ring or ulysses")
        return p
    if cp > 1:
        p += ring_attention_problems(cfg)
    if cp <= 1 or s is None or tp < 1:
        return p
    p += length_divisibility_problems(cfg, s, "data.seq_length", sequence_parallel=False)
    if hf and ds.context_parallel_algo == "ulysses":
        heads = int(hf.get("num_attention_heads", 0))
        if tp >= 1 and heads % tp == 0 and (heads // tp) % cp != 0:
            p.append(f"distributed_strategy.context_parallel_size: Ulysses needs the query heads per TP rank "
                     f"({heads} / TP {tp} = {heads // tp}) divisible by context_parallel_size {cp}; use ring or "
                     f"change the degrees")
    return p


def head_problems(cfg: NxdConfig, hf: dict[str, Any] | None) -> list[str]:
    p: list[str] = []
    m, ds = cfg.model, cfg.distributed_strategy
    if cfg.model_source == "megatron" and hf is None:
        return p  # the model: keys' own problems are reported by megatron_problems
    if not m.model_config and cfg.model_source != "megatron":
        return ["model.model_config: required; path to an HF config.json (e.g. conf/tiny_llama_config.json)"]
    if hf is None:
        return [f"model.model_config: file not found: {resolve_path(m.model_config)}"]
    tp, rep = ds.tensor_model_parallel_size, ds.kv_replicator
    if tp < 1 or rep < 1:
        return p  # reported by parallel_problems
    heads = int(hf.get("num_attention_heads", 0))
    kv = int(hf.get("num_key_value_heads") or heads)
    hidden = m.hidden_size or int(hf.get("hidden_size", 0))
    if heads <= 0 or hidden <= 0:
        return [f"model.model_config: {m.model_config} lacks num_attention_heads / hidden_size"]
    if heads % tp != 0:
        p.append(f"distributed_strategy.tensor_model_parallel_size: {tp} must divide num_attention_heads {heads}"
                 f" (from {m.model_config})")
    if hidden % heads != 0 and "head_dim" not in hf:
        p.append(f"model.hidden_size: {hidden} is not divisible by num_attention_heads {heads}")
    if heads % kv != 0:
        p.append(f"model.model_config: num_attention_heads {heads} not divisible by num_key_value_heads {kv}")
    if not m.qkv_linear:
        if kv % tp != 0:
            p.append(f"model.qkv_linear: false needs num_key_value_heads {kv} divisible by TP {tp}; set "
                     f"model.qkv_linear: true and distributed_strategy.kv_replicator: {max(1, tp // kv)}")
        if rep != 1:
            p.append("distributed_strategy.kv_replicator: only used with model.qkv_linear: true; set it to 1")
    elif (kv * rep) % tp != 0:
        fix = tp // kv if tp % kv == 0 else None
        p.append(f"distributed_strategy.kv_replicator: num_key_value_heads {kv} x kv_replicator {rep} must be "
                 f"divisible by tensor_model_parallel_size {tp}" + (f"; use kv_replicator: {fix}" if fix else ""))
    elif kv >= tp and rep != 1 and kv % tp == 0:
        p.append(f"distributed_strategy.kv_replicator: {rep} replicates KV heads needlessly ({kv} KV heads already"
                 f" divide TP {tp}); set it to 1")
    return p


def pipeline_problems(cfg: NxdConfig, hf: dict[str, Any] | None) -> list[str]:
    """Pipeline rules (NxD): a valid stage split; V > 1 needs PP > 1 and ``num_microbatches % PP == 0``."""
    ds, d = cfg.distributed_strategy, cfg.data
    pp, vpp = ds.pipeline_model_parallel_size, ds.virtual_pipeline_model_parallel_size
    p: list[str] = []
    if pp < 1 or vpp < 1:
        return p
    smf = cfg.trainer.sequential_move_factor
    if smf is not None and smf < 1:
        p.append(f"trainer.sequential_move_factor: must be >= 1 (ranks per node that build / move the model at a "
                 f"time) or null, got {smf}")
    if vpp > 1 and pp == 1:
        p.append(f"distributed_strategy.virtual_pipeline_model_parallel_size: {vpp} needs "
                 "pipeline_model_parallel_size > 1; set it to 1 or raise pipeline_model_parallel_size")
    dp = data_parallel_size(cfg)
    if vpp > 1 and pp > 1 and microbatch_problem(d.global_batch_size, d.micro_batch_size, dp) is None:
        n = num_microbatches(d.global_batch_size, d.micro_batch_size, dp)
        if n % pp:
            p.append(f"data.global_batch_size: interleaved pipeline (virtual_pipeline_model_parallel_size {vpp}) "
                     f"needs num_microbatches = global_batch_size / (micro_batch_size x DP) = {n} divisible by "
                     f"pipeline_model_parallel_size {pp}; change global_batch_size or the parallel sizes")
    layers = cfg.model.num_layers if cfg.model.num_layers not in (None, -1) else (hf or {}).get("num_hidden_layers")
    if isinstance(layers, int) and layers > 0:
        p += split_problems(layers, pp, vpp, cfg.model.pipeline_cuts)
    return p + compile_on_xla_problems(cfg)


def compile_on_xla_problems(cfg: NxdConfig) -> list[str]:
    """``model.compile`` is torch.compile of eager devices (CPU, CUDA, TorchNeuron's native device); torch-xla
    records and compiles lazy graphs itself (:mod:`nxd_lc.models.common.compile`). LoRA adapters have not been
    traced and checked: refused until they are."""
    if not (isinstance(cfg.model.compile, bool) or cfg.model.compile == "auto"):
        return [f"model.compile: {cfg.model.compile!r} is not one of true, false, auto (auto: compiled on CUDA and "
                "the native Neuron device, eager on CPU and torch-xla)"]
    if cfg.model.compile is not True:  # auto compiles only where it can (compile_blocker)
        return []
    p = []
    if peft_config(cfg) is not None:
        p.append("model.compile: not supported yet with model_alignment_strategy.peft (LoRA adapters are not "
                 "checked under torch.compile); set model.compile: false")
    acc = cfg.trainer.accelerator
    if acc not in ("xla", "neuron") or not lazy_neuron_or_xla(acc):
        return p
    return p + [f"model.compile: not available on trainer.accelerator {acc} (torch-xla compiles its lazy graphs "
            "itself); set model.compile: false, or use the native neuron device (torch-neuronx >= 2.10)"]


def compile_blocker(cfg: NxdConfig, attention_dropout: float, moe: bool = False) -> str | None:
    """What keeps ``model.compile: auto`` eager on an accelerator where it would compile (None: nothing): LoRA
    adapters, attention dropout, mixture-of-experts layers (``moe``) and activation offload, which
    ``model.compile: true`` refuses (:func:`compile_on_xla_problems`,
    :func:`nxd_lc.app.validation.model.family_problems`). ``attention_dropout``: the model's (config.json's, or
    Megatron's ``model.attention_dropout``)."""
    if peft_config(cfg) is not None:
        return "model_alignment_strategy.peft (LoRA)"
    if attention_dropout > 0:
        return f"attention dropout {attention_dropout}"
    if moe:
        return "mixture-of-experts layers"
    if cfg.model.activations_offload:  # a memory budget under compile never chooses offload instead
        return "model.activations_offload"
    return None
