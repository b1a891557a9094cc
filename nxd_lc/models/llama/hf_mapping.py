"""The HF <-> nxd_lc name and shard mapping of every decoder family (the table in
:mod:`nxd_lc.models.llama.hf_adapter`'s docstring), read in both directions: :func:`hf_entries` lists a model's
mappings, :func:`read_entry` reads this rank's shard of one mapping from a checkpoint (a
:class:`~nxd_lc.models.llama.hf_safetensors.SafetensorsCheckpoint`, or in-memory full tensors:
:class:`~nxd_lc.models.llama.hf_reshard.FullTensors`). Export and offline re-sharding walk the same entries.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from nxd_lc.distributed import parallel_state
from nxd_lc.layers import GQAQKVColumnParallelLinear
from nxd_lc.layers.linear import partition_order
from nxd_lc.models.common.mlp import GeluMLP
from nxd_lc.models.llama.hf_safetensors import SafetensorsCheckpoint
from nxd_lc.models.llama.model import LlamaForCausalLM
from nxd_lc.moe.layer import MoE

__all__ = ["Entry", "hf_entries", "read_entry"]


@dataclass
class Entry:
    """One HF <-> nxd mapping. kinds: vocab (rows, padded), column (rows), row (cols), replicated,
    gate_up (rows of gate and up, stride 2), qkv (GQA heads; ``params`` maps local names). ``module``: the GQA
    projection of a qkv entry, and of the attention output projection's row entry (its input columns follow that
    projection's query blocks: :mod:`nxd_lc.distributed.kv_layout`)."""

    kind: str
    hf_names: list[str]
    params: dict[str, nn.Parameter]
    module: nn.Module | None = None
    qkv_part: str = "weight"


def _linear_entries(prefix: str, hf: str, module: nn.Module, kind: str) -> list[Entry]:
    """Entries for a Column/RowParallelLinear: weight as ``kind``; bias follows (row bias replicated)."""
    out = [Entry(kind, [f"{hf}.weight"], {f"{prefix}.weight": module.weight})]
    if getattr(module, "bias", None) is not None:
        bias_kind = "replicated" if kind == "row" else kind
        out.append(Entry(bias_kind, [f"{hf}.bias"], {f"{prefix}.bias": module.bias}))
    return out


def _attention_entries(p: str, hp: str, attn: nn.Module) -> list[Entry]:
    out: list[Entry] = []
    if attn.qkv_linear:
        qkv: GQAQKVColumnParallelLinear = attn.qkv_proj
        for part in ("weight", "bias"):
            names = ["qkv"] if qkv.fuse_qkv else ["q", "k", "v"]
            params = {f"{p}.qkv_proj.{part}_{n}": getattr(qkv, f"{part}_{n}") for n in names}
            if all(v is not None for v in params.values()):
                hf = [f"{hp}.{n}_proj.{part}" for n in "qkv"]
                out.append(Entry("qkv", hf, params, module=qkv, qkv_part=part))
    else:
        for n in "qkv":
            out += _linear_entries(f"{p}.{n}_proj", f"{hp}.{n}_proj", getattr(attn, f"{n}_proj"), "column")
    for name in ("q_norm", "k_norm"):  # Qwen3's per-head norms
        if getattr(attn, name) is not None:
            out += _norm_entries(f"{p}.{name}", f"{hp}.{name}", getattr(attn, name))
    o_proj = _linear_entries(f"{p}.o_proj", f"{hp}.o_proj", attn.o_proj, "row")
    if attn.qkv_linear:
        o_proj[0].module = attn.qkv_proj
    return out + o_proj


def hf_entries(model: LlamaForCausalLM) -> list[Entry]:
    """All mappings of ``model``'s parameters (this pipeline stage's), in a fixed order (identical on every rank).

    Raises:
        RuntimeError: the mapping does not cover exactly the model's parameters (an internal invariant).
    """
    out = []
    if model.embed_tokens is not None:  # None on pipeline stages other than the first
        out.append(Entry("vocab", ["model.embed_tokens.weight"], {"embed_tokens.weight": model.embed_tokens.weight}))
    if model.embed_positions is not None:  # learned absolute positions (Megatron-source GPT)
        out.append(Entry("replicated", ["model.embed_positions.weight"],
                          {"embed_positions.weight": model.embed_positions.weight}))
    for i, layer in model.local_layers():
        p, hp = f"layers.{i}", f"model.layers.{i}"
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out += _norm_entries(f"{p}.{norm}", f"{hp}.{norm}", getattr(layer, norm))
        out += _attention_entries(f"{p}.self_attn", f"{hp}.self_attn", layer.self_attn)
        if isinstance(layer.mlp, MoE):
            out += _moe_entries(f"{p}.mlp", f"{hp}.block_sparse_moe", layer.mlp)
            continue
        if isinstance(layer.mlp, GeluMLP):
            out += _linear_entries(f"{p}.mlp.up_proj", f"{hp}.mlp.up_proj", layer.mlp.up_proj, "column")
            out += _linear_entries(f"{p}.mlp.down_proj", f"{hp}.mlp.down_proj", layer.mlp.down_proj, "row")
            continue
        gate_up = layer.mlp.gate_up_proj
        for part in ("weight", "bias"):
            if getattr(gate_up, part, None) is not None:
                hf = [f"{hp}.mlp.gate_proj.{part}", f"{hp}.mlp.up_proj.{part}"]
                out.append(Entry("gate_up", hf, {f"{p}.mlp.gate_up_proj.{part}": getattr(gate_up, part)}))
        out += _linear_entries(f"{p}.mlp.down_proj", f"{hp}.mlp.down_proj", layer.mlp.down_proj, "row")
    if model.norm is not None:  # None on pipeline stages other than the last
        out += _norm_entries("norm", "model.norm", model.norm)
    if model.lm_head is not None and not model.config.tie_word_embeddings:
        out.append(Entry("vocab", ["lm_head.weight"], {"lm_head.weight": model.lm_head.weight}))
    elif model.lm_head is not None and model.embed_tokens is None:  # tied, embedding on the first stage
        out.append(Entry("vocab", ["model.embed_tokens.weight"], {"lm_head.weight": model.lm_head.weight}))
    _check_coverage(model, out)
    return out


def _norm_entries(p: str, hp: str, norm: nn.Module) -> list[Entry]:
    """A norm's weight (and a LayerNorm's bias), replicated."""
    return [Entry("replicated", [f"{hp}.{part}"], {f"{p}.{part}": getattr(norm, part)})
            for part in ("weight", "bias") if getattr(norm, part, None) is not None]


def _moe_entries(p: str, hp: str, moe: MoE) -> list[Entry]:
    """Router (replicated) and this EP rank's experts (HF per-expert w1 / w3 / w2, module docstring)."""
    experts = range(moe.experts.first_expert, moe.experts.first_expert + moe.experts.num_local_experts)
    gate_up = [f"{hp}.experts.{e}.{w}.weight" for e in experts for w in ("w1", "w3")]
    return [Entry("replicated", [f"{hp}.gate.weight"], {f"{p}.router.weight": moe.router.weight}),
            Entry("experts_gate_up", gate_up, {f"{p}.experts.gate_up_proj": moe.experts.gate_up_proj}),
            Entry("experts_down", [f"{hp}.experts.{e}.w2.weight" for e in experts],
                   {f"{p}.experts.down_proj": moe.experts.down_proj})]


def _read_experts(ckpt: SafetensorsCheckpoint, e: Entry, param: torch.Tensor) -> torch.Tensor:
    """``[E/ep, 2I/tp, H]`` (each expert's gate rows then up rows of this TP rank) or ``[E/ep, H, I/tp]``
    (each expert's down-projection columns of this TP rank), stacked over this EP rank's experts."""
    if e.kind == "experts_gate_up":
        half = torch.Size([param.shape[1] // 2, param.shape[2]])
        pairs = zip(e.hf_names[0::2], e.hf_names[1::2])
        return torch.stack([torch.cat([_read_shard(ckpt, w1, half, 0), _read_shard(ckpt, w3, half, 0)])
                            for w1, w3 in pairs])
    return torch.stack([_read_shard(ckpt, w2, param.shape[1:], 1) for w2 in e.hf_names])


def _check_coverage(model: nn.Module, entries: list[Entry]) -> None:
    """Internal invariant: the mappings cover exactly the model's parameters."""
    mapped = {name for e in entries for name in e.params}
    actual = {name for name, _ in model.named_parameters()}
    if mapped != actual:
        raise RuntimeError(f"hf_adapter mapping out of date: unmapped {sorted(actual - mapped)}, "
                           f"unknown {sorted(mapped - actual)}")


def _tp() -> tuple[int, int]:
    return parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size()


def _expect_shape(ckpt: SafetensorsCheckpoint, name: str, expected: tuple[int, ...]) -> None:
    """Raise ValueError naming file and tensor when the checkpoint's full shape is not ``expected``."""
    shape = ckpt.shape(name)
    if shape != tuple(expected):
        raise ValueError(
            f"tensor {name!r} in {ckpt.file_of(name)} has shape {shape}, but the model config expects "
            f"{tuple(expected)}; the checkpoint does not match model.model_config (or its overrides)"
        )


def _read_shard(ckpt: SafetensorsCheckpoint, name: str, local_shape: torch.Size, dim: int,
                order: tuple[int, ...] | None = None) -> torch.Tensor:
    """This rank's contiguous block of ``name`` along ``dim`` (column: 0, row: 1): block ``order[rank]`` when
    the parameter has a ``partition_order``, else block ``rank``."""
    rank, tp = _tp()
    full = list(local_shape)
    full[dim] *= tp
    _expect_shape(ckpt, name, tuple(full))
    n = local_shape[dim]
    piece = rank if order is None else order[rank]
    return ckpt.read(name, dim, piece * n, (piece + 1) * n)


def _read_vocab(ckpt: SafetensorsCheckpoint, name: str, param: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Rows of the padded vocab this rank owns; rows >= vocab_size are zero."""
    rank, _ = _tp()
    _expect_shape(ckpt, name, (vocab_size, *param.shape[1:]))
    n = param.shape[0]
    start, stop = rank * n, min((rank + 1) * n, vocab_size)
    rows = ckpt.read(name, 0, start, max(stop, start))  # 0 rows on a rank holding padding only (for the dtype)
    out = torch.zeros(param.shape, dtype=rows.dtype)
    out[: rows.shape[0]] = rows
    return out


def _read_gate_up(ckpt: SafetensorsCheckpoint, e: Entry, param: torch.Tensor) -> torch.Tensor:
    """``[gate rows of this rank; up rows of this rank]`` (stride-2 layout of ``gate_up_proj``)."""
    half = param.shape[0] // 2
    local_shape = torch.Size([half, *param.shape[1:]])
    return torch.cat([_read_shard(ckpt, name, local_shape, 0) for name in e.hf_names], dim=0)


def _read_qkv(ckpt: SafetensorsCheckpoint, e: Entry) -> list[torch.Tensor]:
    """Local q (this rank's query block) and k, v (its KV heads; both placed by the layer's KV-replica layout),
    reading only those heads' rows; returns ``[qkv]`` (fused) or ``[q, k, v]``, like the params."""
    layer = e.module
    assert isinstance(layer, GQAQKVColumnParallelLinear)
    hd, nq_l, nkv_l = layer.head_dim, layer.num_heads_local, layer.num_kv_heads_local
    rest = (layer.hidden_size,) if e.qkv_part == "weight" else ()
    q_name, k_name, v_name = e.hf_names
    _expect_shape(ckpt, q_name, (layer.num_attention_heads * hd, *rest))
    qb = layer.query_block()
    q = ckpt.read(q_name, 0, qb * nq_l * hd, (qb + 1) * nq_l * hd)
    heads = layer._kv_head_ids()
    lo, hi = min(heads), max(heads) + 1

    def read_kv(name: str) -> torch.Tensor:
        _expect_shape(ckpt, name, (layer.num_key_value_heads * hd, *rest))
        block = ckpt.read(name, 0, lo * hd, hi * hd).reshape(hi - lo, hd, *rest)
        return block[[h - lo for h in heads]].reshape(nkv_l * hd, *rest)

    k, v = read_kv(k_name), read_kv(v_name)
    return [torch.cat([q, k, v], dim=0)] if layer.fuse_qkv else [q, k, v]


def read_entry(ckpt: SafetensorsCheckpoint, e: Entry, vocab_size: int) -> list[torch.Tensor]:
    """Local tensors for ``e.params`` (same order), read from the checkpoint: this rank's TP (and EP) shard of
    each HF tensor, the vocabulary padded to the parameter's rows with zeros.

    Raises:
        ValueError: a tensor is missing or its full shape does not fit the model config (names file and tensor).
    """
    params = list(e.params.values())
    if e.kind == "qkv":
        return _read_qkv(ckpt, e)
    p = params[0]
    if e.kind == "vocab":
        return [_read_vocab(ckpt, e.hf_names[0], p, vocab_size)]
    if e.kind == "gate_up":
        return [_read_gate_up(ckpt, e, p)]
    if e.kind in ("experts_gate_up", "experts_down"):
        return [_read_experts(ckpt, e, p)]
    if e.kind == "replicated":
        _expect_shape(ckpt, e.hf_names[0], tuple(p.shape))
        return [ckpt.read(e.hf_names[0])]
    return [_read_shard(ckpt, e.hf_names[0], p.shape, 0 if e.kind == "column" else 1, partition_order(p))]

