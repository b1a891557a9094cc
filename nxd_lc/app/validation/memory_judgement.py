"""The memory estimate (:mod:`nxd_lc.app.validation.memory`) judged against the device's memory
(:func:`memory_estimate_problems`): above it the config is refused naming the keys to change, above
:data:`~nxd_lc.app.validation.memory.WARN_FRACTION` of it a warning. The activations an offload plan keeps in host
memory (``model.activations_offload``, or the plan a budget chooses) are judged the same way against this host's
memory, for the node's ``trainer.devices`` ranks together.

A model no layout of the job can hold (issue 40, item 5) is refused naming the size that makes it so --
config.json's field (with the file's path) or the ``model:`` key that set it -- instead of the layout keys, which
cannot help.

The test (:func:`unplaceable_size_problem`): the parameters, gradients, optimizer state and master weights of the
whole model (:func:`~nxd_lc.app.validation.memory.rank_tensors` at TP = PP = EP = 1, no ZeRO-1), divided over all
``trainer.devices x trainer.num_nodes`` ranks, exceed one rank's device memory. That is a lower bound of what any
layout needs per rank (activations not counted), so no parallel size, micro batch or sequence length fixes it. The
size named is the one whose value contributes most: the bytes the model would lose with that size at 1.

Where the dry run cannot know the run's device (``trainer.accelerator: auto`` off the device, as NxDT's example
configs are dry-run on a laptop), the layout is not judged, but a model whose state spread over every rank exceeds
:data:`LARGEST_DEVICE_BYTES` -- more than any device nxd_lc runs on holds -- is still refused: no device and no
layout trains it, so "valid" would be a broken promise.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from nxd_lc.app.validation.device_memory import host_memory
from nxd_lc.app.validation.memory import (
    WARN_FRACTION,
    Architecture,
    MemoryEstimate,
    architecture,
    estimate_memory,
    rank_tensors,
    size_text,
    state_bytes,
)
from nxd_lc.config.access import resolve_path
from nxd_lc.config.schema import NxdConfig

__all__ = ["LARGEST_DEVICE_BYTES", "memory_estimate_problems", "size_source", "unplaceable_size_problem"]

#: the most memory one device nxd_lc runs on has (bytes): 288 GB of HBM3e (NVIDIA B300, AMD MI355X; an H200 has
#: 141 GB, a Trainium2 chip 96 GiB over 8 NeuronCores). The bound for a device the dry run cannot know.
LARGEST_DEVICE_BYTES = 288 * 10**9
_LARGEST_DEVICE = ("the most memory any device nxd_lc runs on has (288 GB, NVIDIA B300; the run's device is not "
                   "known on this host)")

#: :class:`~nxd_lc.app.validation.memory.Architecture` field -> (config.json field, Megatron ``model:`` key)
_SIZES = {"vocab_size": ("vocab_size", None), "intermediate": ("intermediate_size", "ffn_hidden_size"),
          "hidden": ("hidden_size", "hidden_size"), "layers": ("num_hidden_layers", "num_layers"),
          "experts": ("num_local_experts", None), "heads": ("num_attention_heads", "num_attention_heads"),
          "kv_heads": ("num_key_value_heads", "num_kv_heads"), "head_dim": ("head_dim", "kv_channels")}
#: ``model:`` keys that override a config.json field (:func:`nxd_lc.app.validation.memory.architecture`)
_MODEL_KEYS = {"num_hidden_layers": "num_layers", "hidden_size": "hidden_size"}


def _config_json_path(cfg: NxdConfig) -> str:
    path = resolve_path(cfg.model.model_config or "")
    return os.path.join(path, "config.json") if os.path.isdir(path) else path


def size_source(cfg: NxdConfig, field: str) -> tuple[str, bool]:
    """``(where config.json's ``field`` of the run comes from, whether that is the file)``: ``model.<key>`` for a
    ``model:`` override or a Megatron key, ``model.hf_config_overrides.<field>``, ``model.moe`` (its experts), else
    ``config.json (<path>)``."""
    m = cfg.model
    if cfg.model_source == "megatron":
        key = next((k for f, k in _SIZES.values() if f == field), None)
        return (f"model.{key}" if key else "model.moe"), False
    if field in _MODEL_KEYS and getattr(m, _MODEL_KEYS[field]) not in (None, -1):
        return f"model.{_MODEL_KEYS[field]}", False
    if field == "num_local_experts" and m.moe is not None and m.moe.num_experts is not None:
        return "model.moe.num_experts", False
    if isinstance(m.hf_config_overrides, Mapping) and field in m.hf_config_overrides:
        return f"model.hf_config_overrides.{field}", False
    return f"config.json ({_config_json_path(cfg)})", True


def _model_state_bytes(a: Architecture, cfg: NxdConfig) -> int:
    """Parameters + gradients + optimizer state + master weights of the whole model ``a`` (one rank of TP = PP =
    EP = 1 without ZeRO-1)."""
    params, grads, state, master, _ = state_bytes(rank_tensors(a, cfg), cfg)
    return params + grads + state + master


def unplaceable_size_problem(cfg: NxdConfig, a: Architecture, device_bytes: int, device: str) -> str | None:
    """The problem naming the size of architecture ``a`` (an :class:`~nxd_lc.app.validation.memory.Architecture`)
    that makes the model's state exceed ``device_bytes`` per rank even spread over every rank of the job (module
    docstring), or None when some layout could hold it."""
    ds = cfg.distributed_strategy
    whole = dataclasses.replace(cfg, distributed_strategy=dataclasses.replace(
        ds, tensor_model_parallel_size=1, pipeline_model_parallel_size=1, virtual_pipeline_model_parallel_size=1,
        expert_model_parallel_size=1, zero1=False))
    ranks = max(1, cfg.trainer.devices * cfg.trainer.num_nodes)
    total = _model_state_bytes(a, whole)
    if total // ranks <= device_bytes:
        return None
    candidates = [attr for attr in _SIZES if isinstance(getattr(a, attr), int) and getattr(a, attr) > 1]
    if not candidates:
        return None
    attr = max(candidates, key=lambda n: total - _model_state_bytes(dataclasses.replace(a, **{n: 1}), whole))
    field = _SIZES[attr][0]
    source, is_file = size_source(cfg, field)
    value = getattr(a, attr)
    need = (f"makes the model's parameters, gradients and optimizer state {size_text(total // ranks)} per rank even "
            f"spread over all {ranks} ranks (trainer.devices x trainer.num_nodes), above {device} "
            f"({size_text(device_bytes)} per rank): no layout holds it")
    more = "or add ranks: trainer.devices, trainer.num_nodes"
    if is_file:
        return f"model.model_config: {source}: {field}={value} {need}; fix config.json's {field} ({more})"
    return f"{source}: {value} {need}; lower {source} ({more})"


def _keys_to_change(cfg: NxdConfig, est: MemoryEstimate) -> list[str]:
    """The keys that lower the estimate, the largest part's first (``data.micro_batch_size`` only above 1)."""
    ds, m = cfg.distributed_strategy, cfg.model
    model_keys = ["distributed_strategy.tensor_model_parallel_size",
                  "distributed_strategy.pipeline_model_parallel_size"]
    if not ds.zero1:
        model_keys.append("distributed_strategy.zero1")
    act_keys = (["data.micro_batch_size"] if cfg.data.micro_batch_size > 1 else []) + ["data.seq_length"]
    if m.activations_memory_budget is None and (m.activations_checkpoint_granularity != "full"
                                                or m.activations_checkpoint_method == "block"):
        act_keys.append("model.activations_checkpoint_granularity")
    act_keys.append("distributed_strategy.context_parallel_size")
    # the layer count scales both parts: named last (config.json's field, or the model: key that set it)
    layers, is_file = size_source(cfg, "num_hidden_layers")
    last = ["config.json's num_hidden_layers" if is_file else layers]
    return (act_keys + model_keys if est.activations > est.total - est.activations else model_keys + act_keys) + last


def memory_estimate_problems(cfg: NxdConfig, hf: Mapping[str, Any] | None) -> tuple[list[str], list[str]]:
    """``(problems, warnings)`` of the memory estimate of a config that passed every other rule: a problem when it
    exceeds the device's memory, a warning above :data:`WARN_FRACTION` of it; each names the keys to change,
    the largest part's first -- or, for a model no layout of the job holds, the size that makes it so
    (:func:`unplaceable_size_problem`: config.json's field, or its ``model:``
    key)."""
    est = estimate_memory(cfg, hf)
    if est is None:
        return [], []
    host_problems, host_warnings = _host_offload_problems(cfg, est)
    device_problems, device_warnings = _device_problems(cfg, hf, est)
    return host_problems + device_problems, host_warnings + device_warnings


def _host_offload_problems(cfg: NxdConfig, est: MemoryEstimate) -> tuple[list[str], list[str]]:
    """The activations an offload plan keeps in host memory, for every rank of this node (``trainer.devices``),
    against this host's memory: a problem above it, a warning above :data:`WARN_FRACTION` of it (the host also
    holds the processes, the data and the checkpoints' staging)."""
    ram = host_memory()
    if not est.host_offload or not ram:
        return [], []
    ranks = max(1, cfg.trainer.devices)
    node = est.host_offload * ranks
    share = node / ram
    if share <= WARN_FRACTION:
        return [], []
    key = ("model.activations_memory_budget" if cfg.model.activations_memory_budget is not None
           else "model.activations_offload")
    text = (f"{key}: the activations offloaded to host memory, {size_text(est.host_offload)} per rank x "
            f"trainer.devices={ranks}, are {100 * share:.0f}% of this host's memory ({size_text(ram)}); shorten "
            "data.seq_length, add context parallelism (distributed_strategy.context_parallel_size) or "
            + ("raise the budget" if key.endswith("budget") else "set model.activations_offload: false"))
    return ([text], []) if share > 1 else ([], [text + " (above 90%)"])


def _device_problems(cfg: NxdConfig, hf: Mapping[str, Any] | None,
                     est: MemoryEstimate) -> tuple[list[str], list[str]]:
    """:func:`memory_estimate_problems`' judgement of the device's memory."""
    if not est.device_bytes:  # device unknown: only a model no device and no layout holds is refused
        a = architecture(cfg, hf)
        problem = unplaceable_size_problem(cfg, a, LARGEST_DEVICE_BYTES, _LARGEST_DEVICE) if a is not None else None
        return ([problem] if problem else []), []
    share = est.total / est.device_bytes
    if share <= WARN_FRACTION:
        return [], []
    if share > 1:  # a model no layout holds: name its size (config.json's field or the model: key)
        a = architecture(cfg, hf)
        problem = unplaceable_size_problem(cfg, a, est.device_bytes, est.device) if a is not None else None
        if problem is not None:
            return [problem], []
    keys = _keys_to_change(cfg, est)
    text = (f"{keys[0]}: the estimated memory per rank, {est.describe()[0].split(': ', 1)[1]}, is "
            f"{100 * share:.0f}% of {est.device} ({size_text(est.device_bytes)} per rank); change {', '.join(keys)}")
    return ([text], []) if share > 1 else ([], [text + " (above 90%: allocator and runtime overheads are not "
                                                  "counted)"])
