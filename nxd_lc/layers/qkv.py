"""GQA-aware fused/unfused Q, K, V column-parallel projection (NxD ``GQAQKVColumnParallelLinear``).

Heads: ``nq`` query heads, ``nkv`` key/value heads, ``hd`` head dim, hidden size ``H``, TP size
``tp``, ``K = kv_replicator``. HF layout of the full weights: ``q [nq*hd, H]``, ``k``/``v``
``[nkv*hd, H]``; query head ``h`` attends with KV head ``h // (nq / nkv)``.

Sharding: when ``nkv >= tp`` (``K = 1``) rank ``r`` holds query heads ``[r*nq/tp, (r+1)*nq/tp)`` and KV heads
``[r*nkv/tp, (r+1)*nkv/tp)``. When ``nkv < tp`` every KV head is replicated ``K = tp / nkv`` times and each rank
holds one KV head and the block of ``nq/tp`` query heads that attend with it, placed as NxD places them on the
platform (:mod:`nxd_lc.distributed.kv_layout`, :func:`nxd_lc.distributed.parallel_state.get_kv_replica_layout`):
``interleaved`` (Trn1: ``K0 K1 .. K0 K1 ..``, rank ``r`` holds KV head ``r % nkv`` and query block
``(r % nkv) K + r // nkv``) or ``adjacent`` (Trn2 / Trn3: ``K0 K0 .. K1 K1 ..``, KV head ``r // K``, query block
``r``). Either way local attention is ordinary GQA with ``nq_local / nkv_local`` queries per KV head, and the
attention's output projection takes the input columns of the same query block
(:meth:`GQAQKVColumnParallelLinear.output_partition_order`). Per-rank KV heads = ``nkv * K / tp``.

Parameters: ``fuse_qkv=True`` keeps ``weight_qkv [(nq_l + 2*nkv_l)*hd, H]`` (rows: local q, then
local k, then local v); ``fuse_qkv=False`` keeps ``weight_q``, ``weight_k``, ``weight_v``. All are
``tensor_model_parallel`` with ``partition_dim=0``. With ``K > 1`` the KV replicas carry
``kv_replicated=True``; on the fused weight only rows ``kv_replicated_rows = (start, stop)`` are
replicas (the q rows are not). Replica gradients must be summed over the KV-shared group
(:func:`nxd_lc.distributed.grads.allreduce_kv_replica_gradients`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nxd_lc.distributed import collectives, parallel_state
from nxd_lc.distributed.kv_layout import kv_heads_of_rank, query_block_of_rank, query_block_order
from nxd_lc.distributed.mappings import (
    copy_to_tensor_model_parallel_region,
    sequence_parallel_linears,
)
from nxd_lc.layers.linear import InitMethod, default_init_method, mark_parameter, merge_tensor_shards
from nxd_lc.runtime.accel import fork_accelerator_rng


def validate_gqa_sharding(num_attention_heads: int, num_key_value_heads: int, kv_replicator: int, tp: int) -> None:
    """Check the head counts can be sharded over ``tp`` ranks with ``kv_replicator``.

    Raises:
        ValueError: naming ``kv_replicator`` / the head counts and the value that would work.
    """
    nq, nkv, k = num_attention_heads, num_key_value_heads, kv_replicator
    if nkv < 1 or nq % nkv != 0:
        raise ValueError(f"num_attention_heads ({nq}) must be a positive multiple of num_key_value_heads ({nkv})")
    if nq % tp != 0:
        raise ValueError(f"num_attention_heads ({nq}) must be divisible by tensor_model_parallel_size ({tp})")
    if nkv >= tp:
        if k != 1 or nkv % tp != 0:
            raise ValueError(
                f"kv_replicator must be 1 and num_key_value_heads ({nkv}) divisible by "
                f"tensor_model_parallel_size ({tp}) when num_key_value_heads >= TP; got kv_replicator={k}"
            )
        return
    if tp % nkv != 0 or k != tp // nkv:
        raise ValueError(
            f"kv_replicator ({k}) must equal tensor_model_parallel_size / num_key_value_heads "
            f"({tp} / {nkv}) so that every rank holds one whole KV head"
            + (f"; set distributed_strategy.kv_replicator: {tp // nkv}" if tp % nkv == 0 else
               f"; TP must be a multiple of num_key_value_heads ({nkv})")
        )


class GQAQKVColumnParallelLinear(nn.Module):
    """Q/K/V projection for grouped-query attention, column-parallel over heads.

    Forward: ``x [B, S, H]`` (``[B, S/tp, H]`` with ``sequence_parallel_enabled``) ->
    ``(q [B, S, nq_local*hd], k [B, S, nkv_local*hd], v [B, S, nkv_local*hd])``. Under SP the input is
    all-gathered here and only its ``[B, S/tp, H]`` shard is kept for the weight gradients
    (:func:`~nxd_lc.distributed.mappings.sequence_parallel_linears`).

    Initialisation follows :mod:`nxd_lc.layers.linear`: with ``use_cpu_initialization`` the full
    HF-layout q/k/v weights are initialised on CPU (q, then k, then v, from the current RNG) and
    sharded with :meth:`shard_qkv_weights`, so any TP size gives the TP=1 weights.

    Raises:
        ValueError: see :func:`validate_gqa_sharding`; also if ``kv_replicator`` differs from the
            one given to ``initialize_model_parallel`` (the KV-shared group would be wrong).
    """

    def __init__(
        self, hidden_size: int, num_attention_heads: int, num_key_value_heads: int, head_dim: int,
        bias: bool = False, kv_replicator: int = 1, fuse_qkv: bool = True,
        sequence_parallel_enabled: bool = False, init_method: InitMethod | None = None,
        dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
        use_cpu_initialization: bool = True,
    ) -> None:
        super().__init__()
        tp = parallel_state.get_tensor_model_parallel_world_size()
        validate_gqa_sharding(num_attention_heads, num_key_value_heads, kv_replicator, tp)
        if kv_replicator > 1 and kv_replicator != parallel_state.get_kv_replicator():
            raise ValueError(
                f"kv_replicator ({kv_replicator}) differs from the kv_replicator given to "
                f"initialize_model_parallel ({parallel_state.get_kv_replicator()}); use the same "
                f"distributed_strategy.kv_replicator for both"
            )
        self.hidden_size, self.head_dim = hidden_size, head_dim
        self.num_attention_heads, self.num_key_value_heads = num_attention_heads, num_key_value_heads
        self.kv_replicator, self.fuse_qkv = kv_replicator, fuse_qkv
        self.kv_replica_layout = parallel_state.get_kv_replica_layout()
        self.sequence_parallel_enabled = sequence_parallel_enabled
        self.num_heads_local = num_attention_heads // tp
        self.num_kv_heads_local = num_key_value_heads * kv_replicator // tp
        self.q_size_local = self.num_heads_local * head_dim
        self.kv_size_local = self.num_kv_heads_local * head_dim
        self._create_parameters(bias, dtype, device)
        self._initialize(init_method or default_init_method(hidden_size), use_cpu_initialization, bias)

    def _create_parameters(self, bias: bool, dtype: torch.dtype, device: torch.device | str | None) -> None:
        dev = torch.device(device) if device is not None else torch.get_default_device()
        q, kv, h = self.q_size_local, self.kv_size_local, self.hidden_size
        rows = {"q": q, "k": kv, "v": kv}
        names = ["qkv"] if self.fuse_qkv else ["q", "k", "v"]
        for name in names:
            n = q + 2 * kv if name == "qkv" else rows[name]
            self._add(f"weight_{name}", torch.empty(n, h, dtype=dtype, device=dev))
            if bias:
                self._add(f"bias_{name}", torch.empty(n, dtype=dtype, device=dev))
            else:
                self.register_parameter(f"bias_{name}", None)

    def _add(self, name: str, data: torch.Tensor) -> None:
        param = mark_parameter(nn.Parameter(data), 0)
        kind = name.split("_")[1]
        if self.kv_replicator > 1 and kind in ("k", "v"):
            param.kv_replicated = True
        elif self.kv_replicator > 1 and kind == "qkv":
            param.kv_replicated = True
            param.kv_replicated_rows = (self.q_size_local, self.q_size_local + 2 * self.kv_size_local)
        self.register_parameter(name, param)

    def _initialize(self, init_method: InitMethod, use_cpu_initialization: bool, bias: bool) -> None:
        """Fill the parameters: full HF-layout init on CPU then shard, or direct local init."""
        nq, nkv, hd, h = self.num_attention_heads, self.num_key_value_heads, self.head_dim, self.hidden_size
        if use_cpu_initialization:
            full = [torch.empty(n * hd, h, dtype=torch.float32) for n in (nq, nkv, nkv)]
            for w in full:
                init_method(w)
            zeros = [torch.zeros(w.shape[0]) for w in full] if bias else [None, None, None]
            self.load_full_qkv_weights(*full, *zeros)
            return
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        # replicas of one KV head must start identical: seed by the KV head, not the TP rank
        kv_index = self._kv_head_ids()[0]
        base = int(torch.randint(0, 2**31 - 1, (1,)).item())
        with torch.no_grad(), fork_accelerator_rng():
            for name, param in self._local_params().items():
                seed_rank = kv_index if name in ("k", "v") and self.kv_replicator > 1 else tp_rank
                torch.manual_seed(base + 7919 * (1 + seed_rank) + {"q": 0, "k": 1, "v": 2}[name])
                init_method(param)
            for b in (self.bias_qkv,) if self.fuse_qkv else (self.bias_q, self.bias_k, self.bias_v):
                if b is not None:
                    b.zero_()

    def _local_params(self) -> dict[str, torch.Tensor]:
        """Views of the local q, k, v weights (into ``weight_qkv`` when fused)."""
        if self.fuse_qkv:
            q, k, v = self.weight_qkv.data.split([self.q_size_local, self.kv_size_local, self.kv_size_local])
            return {"q": q, "k": k, "v": v}
        return {"q": self.weight_q.data, "k": self.weight_k.data, "v": self.weight_v.data}

    def _kv_head_ids(self) -> list[int]:
        """Original (HF) KV head index of each local KV head, in local order."""
        return kv_heads_of_rank(parallel_state.get_tensor_model_parallel_rank(),
                                parallel_state.get_tensor_model_parallel_world_size(), self.num_key_value_heads,
                                self.kv_replica_layout)

    def query_block(self) -> int:
        """The block of ``nq / tp`` consecutive (HF-order) query heads this rank holds."""
        return query_block_of_rank(parallel_state.get_tensor_model_parallel_rank(),
                                   parallel_state.get_tensor_model_parallel_world_size(), self.num_key_value_heads,
                                   self.kv_replica_layout)

    def output_partition_order(self) -> tuple[int, ...]:
        """``order[r]``: the query block of TP rank ``r``, which is also the block of the attention output
        projection's input columns it must hold (``RowParallelLinear(partition_order=...)``)."""
        return query_block_order(parallel_state.get_tensor_model_parallel_world_size(), self.num_key_value_heads,
                                 self.kv_replica_layout)

    def shard_qkv_weights(
        self, q_full: torch.Tensor, k_full: torch.Tensor, v_full: torch.Tensor,
        q_bias: torch.Tensor | None = None, k_bias: torch.Tensor | None = None,
        v_bias: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        """This rank's local parameters from FULL HF-layout tensors.

        Args:
            q_full: ``[nq*hd, H]``; k_full, v_full: ``[nkv*hd, H]``; biases ``[nq*hd]`` / ``[nkv*hd]``.

        Returns:
            ``{"weight_qkv": ..., "bias_qkv": ...}`` (fused) or ``{"weight_q", "weight_k", "weight_v",
            "bias_q", ...}``, bias keys only when biases are given, tensors in the input dtype/device.

        Raises:
            ValueError: if a shape does not match the layer's config.
        """
        nq, nkv, hd, h = self.num_attention_heads, self.num_key_value_heads, self.head_dim, self.hidden_size
        expect = {"q_full": (nq * hd, h), "k_full": (nkv * hd, h), "v_full": (nkv * hd, h)}
        for name, t in zip(expect, (q_full, k_full, v_full)):
            if tuple(t.shape) != expect[name]:
                raise ValueError(f"shard_qkv_weights: {name} has shape {tuple(t.shape)}, expected {expect[name]}")
        block = self.query_block()
        heads = self._kv_head_ids()

        def local(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> list[torch.Tensor]:
            q_loc = q.reshape(nq, hd, *q.shape[1:])[block * self.num_heads_local:(block + 1) * self.num_heads_local]
            k_loc = k.reshape(nkv, hd, *k.shape[1:])[heads]
            v_loc = v.reshape(nkv, hd, *v.shape[1:])[heads]
            return [t.reshape(-1, *q.shape[1:]) for t in (q_loc, k_loc, v_loc)]

        out = {"weight": local(q_full, k_full, v_full)}
        if q_bias is not None and k_bias is not None and v_bias is not None:
            out["bias"] = local(q_bias, k_bias, v_bias)
        result: dict[str, torch.Tensor] = {}
        for kind, (q, k, v) in out.items():
            if self.fuse_qkv:
                result[f"{kind}_qkv"] = torch.cat([q, k, v], dim=0)
            else:
                result.update({f"{kind}_q": q, f"{kind}_k": k, f"{kind}_v": v})
        return result

    @torch.no_grad()
    def load_full_qkv_weights(
        self, q_full: torch.Tensor, k_full: torch.Tensor, v_full: torch.Tensor,
        q_bias: torch.Tensor | None = None, k_bias: torch.Tensor | None = None,
        v_bias: torch.Tensor | None = None,
    ) -> None:
        """Copy FULL HF-layout weights (and biases) into the local parameters (see :meth:`shard_qkv_weights`)."""
        for name, t in self.shard_qkv_weights(q_full, k_full, v_full, q_bias, k_bias, v_bias).items():
            param = getattr(self, name)
            if param is None:
                raise ValueError(f"load_full_qkv_weights: got {name} but the layer was built with bias=False")
            param.copy_(t)

    def _gather_full(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
        group = parallel_state.get_tensor_model_parallel_group()
        tp = parallel_state.get_tensor_model_parallel_world_size()
        blocks = collectives.all_gather(q.contiguous(), 0, group).chunk(tp, dim=0)  # rank r's query block
        q_full = merge_tensor_shards(blocks, 0, order=self.output_partition_order())
        # the first rank holding each HF KV head, and that head's position in its local heads
        holder = {}
        for r in range(tp):
            for j, h in enumerate(kv_heads_of_rank(r, tp, self.num_key_value_heads, self.kv_replica_layout)):
                holder.setdefault(h, r * self.num_kv_heads_local + j)
        picks = [holder[h] for h in range(self.num_key_value_heads)]
        kv = []
        for t in (k, v):
            replicated = collectives.all_gather(t.contiguous(), 0, group)  # [tp*nkv_l*hd, ...]
            per_head = replicated.reshape(tp * self.num_kv_heads_local, self.head_dim, *t.shape[1:])
            kv.append(per_head[picks].reshape(-1, *t.shape[1:]))
        return q_full, kv[0], kv[1]

    @torch.no_grad()
    def gather_full_qkv_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """All-gather over TP and return the FULL HF-layout ``(q [nq*hd, H], k [nkv*hd, H], v [nkv*hd, H])``
        (replicas dropped). Collective: every TP rank must call it."""
        p = self._local_params()
        return self._gather_full(p["q"], p["k"], p["v"])  # type: ignore[return-value]

    @torch.no_grad()
    def gather_full_qkv_biases(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Like :meth:`gather_full_qkv_weights` for the biases (``None`` when built without bias)."""
        if self.fuse_qkv:
            if self.bias_qkv is None:
                return None
            q, k, v = self.bias_qkv.data.split([self.q_size_local, self.kv_size_local, self.kv_size_local])
        else:
            if self.bias_q is None:
                return None
            q, k, v = self.bias_q.data, self.bias_k.data, self.bias_v.data
        return self._gather_full(q, k, v)  # type: ignore[return-value]

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``[B, S, H]`` (``[B, S/tp, H]`` under SP) -> ``(q, k, v)`` of ``[B, S, n_local*hd]``."""
        ws, bs = self.base_weights_and_biases()
        if self.sequence_parallel_enabled:  # keeps x [B, S/tp, H] for the backward, not the gathered input
            ys = sequence_parallel_linears(x, ws, bs)
        else:
            x = copy_to_tensor_model_parallel_region(x)
            ys = tuple(F.linear(x, w, b) for w, b in zip(ws, bs))
        if self.fuse_qkv:
            q, k, v = ys[0].split([self.q_size_local, self.kv_size_local, self.kv_size_local], dim=-1)
            return q, k, v
        return ys[0], ys[1], ys[2]

    def base_weights_and_biases(self) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        """The projection's weights and biases in output order: ``[weight_qkv]`` fused, else q, k, v."""
        if self.fuse_qkv:
            return [self.weight_qkv], [self.bias_qkv]
        return [self.weight_q, self.weight_k, self.weight_v], [self.bias_q, self.bias_k, self.bias_v]

    def extra_repr(self) -> str:
        return (f"hidden={self.hidden_size}, heads={self.num_attention_heads}, kv_heads={self.num_key_value_heads}, "
                f"head_dim={self.head_dim}, local_heads={self.num_heads_local}, "
                f"local_kv_heads={self.num_kv_heads_local}, kv_replicator={self.kv_replicator}, "
                f"kv_replica_layout={self.kv_replica_layout}, "
                f"fuse_qkv={self.fuse_qkv}")
