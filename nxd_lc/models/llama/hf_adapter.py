"""HF <-> nxd_lc state-dict adapter for :class:`~nxd_lc.models.llama.model.LlamaForCausalLM`.

HF Llama names (``LlamaForCausalLM.state_dict()``; shapes with ``nq``/``nkv`` heads of size ``hd``,
hidden ``H``, intermediate ``I``, vocab ``V``):

    model.embed_tokens.weight                       [V, H]        -> embed_tokens.weight   [Vp/tp, H] rows
    model.layers.N.input_layernorm.weight           [H]           -> layers.N.input_layernorm.weight (replicated)
    model.layers.N.self_attn.{q,k,v}_proj.weight    [n*hd, H]     -> layers.N.self_attn.qkv_proj.weight_qkv
                                                                     (or weight_q/k/v; or q_proj/k_proj/v_proj.weight)
    model.layers.N.self_attn.o_proj.weight          [H, nq*hd]    -> layers.N.self_attn.o_proj.weight [H, nq*hd/tp] cols
    model.layers.N.post_attention_layernorm.weight  [H]           -> layers.N.post_attention_layernorm.weight
    model.layers.N.mlp.{gate,up}_proj.weight        [I, H]        -> layers.N.mlp.gate_up_proj.weight [2I/tp, H]
    model.layers.N.mlp.down_proj.weight             [H, I]        -> layers.N.mlp.down_proj.weight [H, I/tp] cols
    model.norm.weight                               [H]           -> norm.weight
    lm_head.weight                                  [V, H]        -> lm_head.weight [Vp/tp, H] rows (absent if tied)

Biases (``attention_bias`` / ``mlp_bias``) follow their weights' rows; row-parallel biases are replicated.

Mixture-of-experts layers (:class:`~nxd_lc.models.mixtral.MixtralForCausalLM`; HF Mixtral's on-disk names, which
transformers' ``save_pretrained`` writes; ``E`` experts, ``ep`` the EP size):

    model.layers.N.block_sparse_moe.gate.weight           [E, H] -> layers.N.mlp.router.weight (replicated)
    model.layers.N.block_sparse_moe.experts.e.w1.weight   [I, H] -> layers.N.mlp.experts.gate_up_proj [E/ep, 2I/tp, H]
    model.layers.N.block_sparse_moe.experts.e.w3.weight   [I, H]    (gate rows then up rows of this TP rank, for
                                                                     this EP rank's experts)
    model.layers.N.block_sparse_moe.experts.e.w2.weight   [H, I] -> layers.N.mlp.experts.down_proj [E/ep, H, I/tp]

Export (:func:`export_hf_state_dict`) gathers each expert tensor over TP and then over EP, and writes every
expert's ``w1`` / ``w3`` / ``w2`` under the same names.

Loading (:func:`load_hf_weights`) opens the safetensors files with ``safe_open`` and reads each
tensor through ``get_slice``, so a rank reads only its own TP shard (q/k/v: only its heads, the KV
heads it replicates read once). :func:`export_hf_state_dict` all-gathers shards back to full HF
tensors (a collective over TP: every rank must call it). PP > 1 is not supported yet.

The modules behind it: :mod:`~nxd_lc.models.llama.hf_safetensors` (reading and checking safetensors files),
:mod:`~nxd_lc.models.llama.hf_mapping` (the table above and each rank's slicing) and
:mod:`~nxd_lc.models.llama.hf_reshard` (offline re-sharding, no collectives).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from nxd_lc.distributed import collectives, parallel_state
from nxd_lc.distributed.gather import gather_pipeline_stages
from nxd_lc.layers import GQAQKVColumnParallelLinear, gather_full_parameter
from nxd_lc.models.common.family import hf_export_config
from nxd_lc.models.llama.hf_mapping import Entry, hf_entries, read_entry
from nxd_lc.models.llama.hf_reshard import FullTensors, merge_tp_shards, shard_full_tensors
from nxd_lc.models.llama.hf_safetensors import INDEX_FILE, SafetensorsCheckpoint, check_safetensors_header
from nxd_lc.models.llama.model import LlamaForCausalLM
from nxd_lc.runtime import xla as xla_runtime
from nxd_lc.runtime.accel import HOST
from nxd_lc.runtime.xla import is_xla_tensor

__all__ = ["INDEX_FILE", "FullTensors", "SafetensorsCheckpoint", "check_safetensors_header", "export_hf_state_dict",
           "load_hf_weights", "merge_tp_shards", "save_hf_weights", "shard_full_tensors"]

logger = logging.getLogger(__name__)
# Tensors some HF checkpoints carry that have no parameter here (RoPE buffers are recomputed).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@torch.no_grad()
def load_hf_weights(model: LlamaForCausalLM, path: str | Path) -> None:
    """Copy an HF Llama safetensors checkpoint into ``model``'s (TP-sharded) parameters.

    Every TP rank calls it and reads only its shard of each tensor (``safe_open(...).get_slice``);
    no collective is issued. Tensors are cast to each parameter's dtype and device. Checkpoint
    tensors without a parameter (e.g. layers beyond ``num_layers``) are logged and skipped.

    Args:
        path: a directory with ``model.safetensors`` or sharded files + ``model.safetensors.index.json``,
            or a single ``.safetensors`` file.

    Raises:
        FileNotFoundError: missing path / files.
        ValueError: a tensor is missing or its shape does not match the model config (names file and tensor).
    """
    entries = hf_entries(model)
    used: set[str] = set()
    with SafetensorsCheckpoint(path) as ckpt:
        for e in entries:
            for (name, param), value in zip(e.params.items(), read_entry(ckpt, e, model.vocab_size)):
                assert tuple(value.shape) == tuple(param.shape), (name, value.shape, param.shape)
                param.copy_(value)
            used.update(e.hf_names)
        unused = sorted(n for n in ckpt.weight_map
                        if n not in used and not n.endswith(_IGNORED_SUFFIXES) and not _on_other_stage(model, n))
    if unused:
        logger.warning("load_hf_weights: %d tensors of %s have no parameter and were skipped, e.g. %s",
                       len(unused), path, unused[:5])


def _on_other_stage(model: LlamaForCausalLM, hf_name: str) -> bool:
    """Whether HF tensor ``hf_name`` belongs to a module held by another pipeline stage."""
    parts = hf_name.split(".")
    if hf_name.startswith("model.layers.") and parts[2].isdigit() and int(parts[2]) < len(model.layers):
        return int(parts[2]) not in dict(model.local_layers())
    if hf_name.startswith("model.embed_tokens."):
        return model.embed_tokens is None and (model.lm_head is None or not model.config.tie_word_embeddings)
    if hf_name.startswith(("model.norm.", "lm_head.")):
        return model.norm is None
    return False


def _export_experts(e: Entry) -> dict[str, torch.Tensor]:
    """Every expert's HF tensors of a MoE layer's ``gate_up_proj`` (``experts.<e>.w1`` / ``w3`` [I, H]) or
    ``down_proj`` (``experts.<e>.w2`` [H, I]): gathered over TP, then over EP (all E experts on every rank).
    Collective over the TP and EP groups."""
    param = next(iter(e.params.values()))
    full = collectives.all_gather(gather_full_parameter(param).contiguous(), 0,
                                  parallel_state.get_expert_model_parallel_group())  # [E, 2I, H] / [E, H, I]
    prefix = e.hf_names[0].split(".experts.")[0]
    if e.kind == "experts_down":
        return {f"{prefix}.experts.{i}.w2.weight": full[i] for i in range(full.shape[0])}
    half = full.shape[1] // 2
    out = {}
    for i in range(full.shape[0]):
        out[f"{prefix}.experts.{i}.w1.weight"] = full[i, :half]
        out[f"{prefix}.experts.{i}.w3.weight"] = full[i, half:]
    return out


def _export_entry(e: Entry, model: LlamaForCausalLM) -> list[torch.Tensor]:
    """Full HF tensors for ``e.hf_names`` (collective over TP for sharded kinds; experts:
    :func:`_export_experts`)."""
    if e.kind == "qkv":
        layer = e.module
        assert isinstance(layer, GQAQKVColumnParallelLinear)
        full = layer.gather_full_qkv_weights() if e.qkv_part == "weight" else layer.gather_full_qkv_biases()
        assert full is not None
        return list(full)
    full = gather_full_parameter(next(iter(e.params.values())))
    if e.kind == "vocab":
        return [full[: model.vocab_size]]
    if e.kind == "gate_up":
        return list(full.chunk(2, dim=0))
    return [full]


@torch.no_grad()
def export_hf_state_dict(model: LlamaForCausalLM, *, rank0_only: bool = False,
                         dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Gather ``model``'s shards into a full HF-named state dict of CPU tensors (fresh copies).

    Collective over the TP group (and the EP group for mixture-of-experts layers, whose experts are gathered from
    every EP rank): every rank must call it. KV replicas are dropped, the vocab is
    cut back to ``config.vocab_size``, and ``lm_head.weight`` is omitted when embeddings are tied.

    Args:
        rank0_only: keep the tensors only on global rank 0 (other ranks return ``{}``), so only one
            full copy stays in host memory.
        dtype: cast to this dtype (default: each parameter's dtype).
    """
    tied_copy = model.config.tie_word_embeddings and model.embed_tokens is None  # the first stage exports it
    entries = [e for e in hf_entries(model) if not (tied_copy and "lm_head.weight" in e.params)]
    # one full copy per pipeline stage, on the stage's first rank (global rank 0 for the first stage)
    keep = not rank0_only or (parallel_state.get_tensor_model_parallel_rank() == 0
                              and parallel_state.get_data_parallel_rank(with_context_parallel=True) == 0)
    lazy = is_xla_tensor(next(model.parameters()))
    # on XLA each entry's gathers run as one graph (a sync), then its reads are transfers; every rank syncs as
    # often as the stage with the most entries, so all ranks cut their graphs alike (DESIGN principle 16)
    rounds = collectives.world_max([len(entries)], tag="nxd_lc_hf_export")[0] if lazy else len(entries)
    out: dict[str, torch.Tensor] = {}
    for i in range(rounds):
        e = entries[i] if i < len(entries) else None
        named = {} if e is None else _export_experts(e) if e.kind.startswith("experts") \
            else dict(zip(e.hf_names, _export_entry(e, model)))
        if lazy:
            xla_runtime.sync()
        for name, t in named.items():  # every rank reads (a transfer on XLA); the keeping ranks keep
            host = t.to(device=HOST, dtype=dtype or t.dtype, copy=True).contiguous()
            if keep:
                out[name] = host
    return gather_pipeline_stages(out, rank0_only)


def _split_shards(state: dict[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    """Greedy split in insertion order into dicts of at most ``max_bytes`` (a bigger tensor gets its own)."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in state.items():
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += n
    return shards


def save_hf_weights(model: LlamaForCausalLM, path: str | Path, *, dtype: torch.dtype | None = None,
                    max_shard_bytes: int = 5 * 2**30, token_ids: Mapping[str, int | None] | None = None) -> None:
    """Write ``model`` as an HF checkpoint: safetensors (+ index when sharded) and ``config.json``.

    Collective: every rank calls it; global rank 0 writes, then all ranks meet at a barrier. Files:
    ``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` + ``model.safetensors.index.json``
    when the weights exceed ``max_shard_bytes``. ``config.json`` is ``model.config`` (unpadded vocab)
    with its dtype set to the saved tensors' dtype, loadable with ``transformers.AutoModelForCausalLM.from_pretrained``.

    Args:
        token_ids: the special token ids of the tokenizer the model was trained with (``bos_token_id``,
            ``eos_token_id``, ``pad_token_id``; None values are written as null): they replace the source
            config.json's in ``config.json``, and ``generation_config.json`` is written with them (``generate``
            stops at that eos; its pad is the tokenizer's, else the eos). None: the model config's ids are kept
            and no ``generation_config.json`` is written.

    Raises:
        ValueError: a Megatron-source architecture HF has no class for (:func:`hf_export_config`), or a token id
            outside ``[0, vocab_size)``; on every rank.
    """
    config = hf_export_config(model.config)  # on every rank, before any collective: fails everywhere or nowhere
    for name, value in (token_ids or {}).items():
        if name not in _TOKEN_ID_FIELDS:
            raise ValueError(f"token_ids: {name!r} is not one of {', '.join(_TOKEN_ID_FIELDS)}")
        if value is not None and not 0 <= int(value) < config.vocab_size:
            raise ValueError(f"the tokenizer's {name} {value} is outside the model's vocabulary (vocab_size "
                             f"{config.vocab_size}): the tokenizer is not the model's")
        setattr(config, name, None if value is None else int(value))
    state = export_hf_state_dict(model, rank0_only=True, dtype=dtype)
    if collectives.get_global_rank() == 0:
        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        shards = _split_shards(state, max_shard_bytes)
        if len(shards) == 1:
            save_file(shards[0], str(out / "model.safetensors"), metadata={"format": "pt"})
        else:
            weight_map: dict[str, str] = {}
            for i, shard in enumerate(shards, start=1):
                fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
                save_file(shard, str(out / fname), metadata={"format": "pt"})
                weight_map.update(dict.fromkeys(shard, fname))
            total = sum(t.numel() * t.element_size() for t in state.values())
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (out / INDEX_FILE).write_text(json.dumps(index, indent=2))
        saved_dtype = dtype or next(iter(state.values())).dtype
        setattr(config, "dtype" if hasattr(config, "dtype") else "torch_dtype", saved_dtype)
        config.save_pretrained(str(out))
        if token_ids is not None:
            _save_generation_config(config, out)
    collectives.barrier()


#: the special-token fields of an HF config that :func:`save_hf_weights` takes from the run's tokenizer
_TOKEN_ID_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def _save_generation_config(config: Any, out: Path) -> None:
    """``generation_config.json`` of ``config`` (transformers' ``GenerationConfig.from_model_config``: its bos / eos /
    pad ids), with the pad id falling back to the eos id, as transformers' ``generate`` would at run time."""
    from transformers import GenerationConfig

    gen = GenerationConfig.from_model_config(config)
    if gen.pad_token_id is None:
        gen.pad_token_id = gen.eos_token_id
    gen.save_pretrained(str(out))

