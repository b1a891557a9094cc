"""Offline re-sharding of HF-named tensors (no collectives): :func:`merge_tp_shards` merges the TP shards of a
run with another TP size into full tensors, and :func:`shard_full_tensors` slices full tensors
(:class:`FullTensors`) for this rank with the loader's own mapping (:mod:`nxd_lc.models.llama.hf_mapping`). Used by
:mod:`nxd_lc.checkpoint.reshard` to resume at another layout.
"""

from __future__ import annotations

import torch

from nxd_lc.distributed.kv_layout import INTERLEAVED, kv_heads_of_rank, query_block_order, replication
from nxd_lc.layers import GQAQKVColumnParallelLinear, merge_tensor_shards
from nxd_lc.models.llama.hf_mapping import hf_entries, read_entry
from nxd_lc.models.llama.model import LlamaForCausalLM

__all__ = ["FullTensors", "merge_tp_shards", "shard_full_tensors"]

_TIED_ALIAS = {"lm_head.weight": "embed_tokens.weight", "embed_tokens.weight": "lm_head.weight"}


class FullTensors:
    """Full HF-named tensors held in memory, read like a
    :class:`~nxd_lc.models.llama.hf_safetensors.SafetensorsCheckpoint` (``shape``, ``read`` of a row / column
    range), so that the loader's slicing (:func:`~nxd_lc.models.llama.hf_adapter.load_hf_weights`) shards them for
    this rank.

    Args:
        tensors: HF name -> full tensor (any dtype; slices keep it).
        origin: what the tensors came from, named in shape errors (e.g. the checkpoint directory).
    """

    def __init__(self, tensors: dict[str, torch.Tensor], origin: str) -> None:
        self.tensors = tensors
        self.origin = origin

    def _get(self, name: str) -> torch.Tensor:
        if name not in self.tensors:
            raise ValueError(f"tensor {name!r} is missing from {self.origin}")
        return self.tensors[name]

    def shape(self, name: str) -> tuple[int, ...]:
        """Full shape of tensor ``name``."""
        return tuple(self._get(name).shape)

    def read(self, name: str, dim: int | None = None, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Tensor ``name``, or indices ``[start, stop)`` of dim ``dim`` (0 or 1)."""
        t = self._get(name)
        if dim is None:
            return t
        if dim not in (0, 1):
            raise ValueError(f"can only slice dim 0 or 1, got {dim}")
        return t.narrow(dim, start, (t.shape[dim] if stop is None else stop) - start)

    def file_of(self, name: str) -> str:
        """Where tensor ``name`` came from (for messages)."""
        return self.origin


def _lookup(shard: dict[str, torch.Tensor], name: str, tied: bool) -> torch.Tensor | None:
    """``shard[name]``; with tied embeddings the other copy of the tied weight when ``name`` is absent."""
    if name in shard:
        return shard[name]
    alias = _TIED_ALIAS.get(name) if tied else None
    return shard.get(alias) if alias is not None else None


def _merge_qkv(layer: GQAQKVColumnParallelLinear, locals_: list[list[torch.Tensor]], fused: bool,
               where: str, kv_layout: str) -> list[torch.Tensor]:
    """Full HF ``[q, k, v]`` from every old TP rank's local q/k/v (fused ``[qkv]`` or ``[q, k, v]``).

    Old layout (:mod:`nxd_lc.layers.qkv`, :mod:`nxd_lc.distributed.kv_layout`): TP rank ``r`` holds query block
    :func:`~nxd_lc.distributed.kv_layout.query_block_of_rank` and the KV heads
    :func:`~nxd_lc.distributed.kv_layout.kv_heads_of_rank` of the saved TP size and ``kv_layout`` (its
    replication ``K`` checked against the shapes).
    """
    tp, hd = len(locals_), layer.head_dim
    nq, nkv = layer.num_attention_heads, layer.num_key_value_heads
    nq_l = nq // tp
    q_parts, k_parts, v_parts = [], [], []
    for parts in locals_:
        if fused:
            rows = parts[0].shape[0] // hd
            nkv_l = (rows - nq_l) // 2
            q, k, v = parts[0].split([nq_l * hd, nkv_l * hd, nkv_l * hd])
        else:
            q, k, v = parts
        q_parts.append(q)
        k_parts.append(k)
        v_parts.append(v)
    nkv_l = k_parts[0].shape[0] // hd
    k_rep = nkv_l * tp // nkv
    if nq % tp or k_rep < 1 or nkv_l * tp != nkv * k_rep:
        raise ValueError(f"{where}: q/k/v shards of {tp} TP ranks with {nkv_l} KV heads each do not fit "
                         f"{nq} query / {nkv} KV heads; model.model_config must be that of the saved run")
    if k_rep != replication(tp, nkv):
        raise ValueError(f"{where}: {tp} TP ranks hold {nkv_l} KV head(s) each: KV heads replicated {k_rep} times "
                         f"where {nkv} KV heads over TP {tp} replicate {replication(tp, nkv)} times")
    rest = k_parts[0].shape[1:]
    full = []
    for parts in (k_parts, v_parts):
        out = parts[0].new_empty((nkv * hd, *rest))
        for r, t in enumerate(parts):
            for j, h in enumerate(kv_heads_of_rank(r, tp, nkv, kv_layout)):
                out[h * hd:(h + 1) * hd] = t[j * hd:(j + 1) * hd]
        full.append(out)
    return [merge_tensor_shards(q_parts, 0, order=query_block_order(tp, nkv, kv_layout)), *full]


def merge_tp_shards(model: LlamaForCausalLM, shards: list[dict[str, torch.Tensor]],
                    where: str = "checkpoint", kv_layout: str = INTERLEAVED) -> dict[str, torch.Tensor]:
    """Full HF-named tensors from the TP shards of a run with another TP size (offline; no collective).

    The inverse of this rank's loader for any TP size: column shards are concatenated along rows, row shards along
    columns, the padded vocabulary is concatenated and cut back to ``vocab_size``, ``gate_up_proj`` is split into
    its gate and up halves per rank, and GQA q/k/v shards are reassembled head by head with that run's
    ``kv_replicator`` (KV replicas dropped). Used for model weights and, with the same layout, for parameter-shaped
    optimizer state (Adam moments, master weights).

    Args:
        model: this run's model (any TP / PP layout): it gives the mapping
            (:func:`~nxd_lc.models.llama.hf_mapping.hf_entries`, this pipeline stage's parameters only), head
            counts and ``fuse_qkv``; the saved run must have the same config.
        shards: ``shards[r]``: parameter name (``layers.0.mlp.down_proj.weight``) -> TP rank ``r``'s local tensor;
            ``len(shards)`` is the saved TP size. An entry whose tensors are not all present is skipped (e.g.
            frozen parameters without optimizer state).
        where: what the shards came from, for error messages.
        kv_layout: the KV-replica layout the shards were saved with (:mod:`nxd_lc.distributed.kv_layout`): where
            the saved run's q / k / v heads and the attention output projection's input columns were.

    Returns:
        HF name -> full tensor (dtype of the shards).

    Raises:
        ValueError: shards whose shapes do not fit the model's config.
    """
    tied = bool(model.config.tie_word_embeddings)
    full: dict[str, torch.Tensor] = {}
    for e in hf_entries(model):
        locals_ = [[_lookup(s, name, tied) for name in e.params] for s in shards]
        if any(t is None for parts in locals_ for t in parts):
            continue
        firsts = [parts[0] for parts in locals_]
        if e.kind == "qkv":
            assert isinstance(e.module, GQAQKVColumnParallelLinear)
            merged = _merge_qkv(e.module, locals_, e.module.fuse_qkv, where, kv_layout)
        elif e.kind == "row" and isinstance(e.module, GQAQKVColumnParallelLinear):  # o_proj: by query block
            order = query_block_order(len(shards), e.module.num_key_value_heads, kv_layout)
            merged = [merge_tensor_shards(firsts, 1, order=order)]
        elif e.kind == "replicated":
            merged = [firsts[0]]
        elif e.kind in ("column", "row"):
            merged = [torch.cat(firsts, dim=0 if e.kind == "column" else 1)]
        elif e.kind == "vocab":
            merged = [torch.cat(firsts, dim=0)[: model.vocab_size]]
        else:  # gate_up: [gate rows of rank r; up rows of rank r]
            halves = [t.chunk(2, dim=0) for t in firsts]
            merged = [torch.cat([h[0] for h in halves], dim=0), torch.cat([h[1] for h in halves], dim=0)]
        full.update(zip(e.hf_names, merged))
    return full


def shard_full_tensors(model: LlamaForCausalLM, full: FullTensors) -> dict[str, torch.Tensor]:
    """This rank's local tensors (parameter name -> tensor in the parameter's shape, the full tensors' dtype) of the
    entries of ``model`` whose HF tensors are all in ``full``; the loader's own slicing (TP rank and size, KV
    replication and vocab padding of this run). Offline: no collective.

    Raises:
        ValueError: a full tensor's shape does not fit the model config (names it and ``full.origin``).
    """
    out: dict[str, torch.Tensor] = {}
    for e in hf_entries(model):
        if not all(n in full.tensors for n in e.hf_names):
            continue
        for (name, param), value in zip(e.params.items(), read_entry(full, e, model.vocab_size)):  # type: ignore[arg-type]
            out[name] = value.reshape(param.shape)
    return out
