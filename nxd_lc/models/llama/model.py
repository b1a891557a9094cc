"""Llama decoder (Llama 2 / 3, HF ``LlamaForCausalLM`` architecture) built from tensor-parallel layers.

Shapes (batch-first): ``B`` micro batch, ``S`` sequence, ``H`` hidden, ``V`` vocabulary,
``Vp`` padded vocabulary (multiple of TP), ``tp`` TP size.

    input_ids, position_ids, labels  [B, S] int64
    hidden states                     [B, S, H], or [B, S/tp, H] under sequence parallelism
    logits_local                      [B, S, Vp/tp]  (this TP rank's vocab slice, full S)

Sequence parallelism (Korthikanti et al. 2022, arXiv:2205.05198): the embedding reduce-scatters its
output along S; norms and residual adds run on ``S/tp`` tokens; each column layer (qkv, gate_up,
lm_head) all-gathers its input and each row layer (o_proj, down_proj) reduce-scatters its output.
Norm weights are flagged ``sequence_parallel_enabled`` so their grads get all-reduced over TP.

Vocabulary padding: ``Vp = ceil(V / tp) * tp``. The padded embedding rows are zero-initialised and
never looked up by valid ids (< V). The padded lm_head columns are masked in :meth:`forward` to the
dtype's lowest finite value, so they add exp(...) = 0 to every softmax and get no gradient: they
cannot affect the loss. Labels must still be < V (or ``ignore_index``).

Module names follow NxDT's HF Llama: ``embed_tokens``, ``layers[i].{input_layernorm,
self_attn.{qkv_proj | q_proj,k_proj,v_proj, o_proj, core_attention}, post_attention_layernorm,
mlp.{gate_up_proj, down_proj}}``, ``norm``, ``lm_head``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Collection, Iterable
from typing import Any, ClassVar

import torch
from torch import nn
from transformers import LlamaConfig

from nxd_lc.context.local import cached_attention
from nxd_lc.distributed import parallel_state
from nxd_lc.distributed.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
)
from nxd_lc.layers import (
    ColumnParallelLinear,
    GQAQKVColumnParallelLinear,
    ParallelEmbedding,
    RowParallelLinear,
)
from nxd_lc.layers.dropout import sharded_dropout
from nxd_lc.layers.linear import InitMethod
from nxd_lc.layers.tiled import vocab_parallel_logits
from nxd_lc.models.common.attention import CoreAttention
from nxd_lc.models.common.family import DecoderOptions, decoder_options
from nxd_lc.models.common.kv_cache import KVCache, LayerKVCache
from nxd_lc.models.common.loss import causal_lm_loss_from_hidden
from nxd_lc.models.common.mlp import GeluMLP, LlamaMLP
from nxd_lc.models.common.norm import RMSNorm, build_norm
from nxd_lc.models.common.rope import (
    RotaryEmbedding,
    apply_rotary_pos_emb,
    rope_spec_from_config,
)

__all__ = [
    "LlamaAttention",
    "LlamaDecoderLayer",
    "LlamaForCausalLM",
    "RemoteLayer",
    "pad_vocab_size",
]


def pad_vocab_size(vocab_size: int, tp: int) -> int:
    """Smallest multiple of ``tp`` >= ``vocab_size`` (so the vocab shards evenly over TP)."""
    return -(-vocab_size // tp) * tp


def normal_init(std: float, tensor: torch.Tensor) -> object:
    return nn.init.normal_(tensor, 0.0, std)


class LlamaAttention(nn.Module):
    """Causal self-attention with GQA and RoPE; heads sharded over TP.

    ``forward(x [B, S(/tp), H], cos, sin [B, S, Dr]) -> [B, S(/tp), H]`` (``Dr`` the rotary dims, ``D`` with
    ``rotary_percentage`` 1; cos / sin None: no RoPE, learned absolute positions). With ``qkv_linear`` the
    projection is one :class:`GQAQKVColumnParallelLinear` ``qkv_proj`` (supports ``kv_replicator``,
    ``fuse_qkv``); otherwise three ColumnParallelLinear ``q_proj``/``k_proj``/``v_proj``, which need
    ``num_key_value_heads % tp == 0`` (``fuse_qkv`` then has no effect).

    Family parts (:class:`~nxd_lc.models.common.family.DecoderOptions`): q/k/v and o biases, per-head q / k RMSNorm
    ``q_norm`` / ``k_norm`` [D] before RoPE (Qwen3; replicated weights whose gradients are summed over TP, as each
    rank normalises only its heads), the layer's sliding window and the attention dropout.

    Raises:
        ValueError: head counts that cannot be sharded over TP (message names the key to change).
    """

    def __init__(self, config: LlamaConfig, *, sequence_parallel: bool, kv_replicator: int, fuse_qkv: bool,
                 qkv_linear: bool, flash_attention: bool, init_method: InitMethod,
                 options: DecoderOptions | None = None, layer_index: int = 0,
                 output_init_method: InitMethod | None = None, **layer_kw: Any) -> None:
        super().__init__()
        opts = options or decoder_options(config)
        tp = parallel_state.get_tensor_model_parallel_world_size()
        nq, nkv, h = config.num_attention_heads, config.num_key_value_heads, config.hidden_size
        self.head_dim = getattr(config, "head_dim", None) or h // nq
        hd, sp = self.head_dim, sequence_parallel
        kw = dict(init_method=init_method, **layer_kw)
        if qkv_linear:
            self.qkv_proj = GQAQKVColumnParallelLinear(
                h, nq, nkv, hd, bias=opts.qkv_bias, kv_replicator=kv_replicator, fuse_qkv=fuse_qkv,
                sequence_parallel_enabled=sp, **kw)
        else:
            if nkv % tp or nq % tp or kv_replicator != 1:
                raise ValueError(
                    f"model.qkv_linear=False needs num_attention_heads ({nq}) and num_key_value_heads ({nkv}) "
                    f"divisible by tensor_model_parallel_size ({tp}) and kv_replicator=1 (got {kv_replicator}); "
                    f"set model.qkv_linear: True to use kv_replicator"
                )
            self.q_proj = ColumnParallelLinear(h, nq * hd, bias=opts.qkv_bias, sequence_parallel_enabled=sp, **kw)
            self.k_proj = ColumnParallelLinear(h, nkv * hd, bias=opts.qkv_bias, sequence_parallel_enabled=sp, **kw)
            self.v_proj = ColumnParallelLinear(h, nkv * hd, bias=opts.qkv_bias, sequence_parallel_enabled=sp, **kw)
        self.qkv_linear = qkv_linear
        self.q_norm = self.k_norm = None
        if opts.qk_norm:  # TP region: each rank normalises its own heads, so the shared weights' grads sum over TP
            norm_kw = {"dtype": layer_kw["dtype"], "device": layer_kw["device"]}
            self.q_norm = RMSNorm(hd, opts.norm_eps, sequence_parallel_enabled=tp > 1, **norm_kw)
            self.k_norm = RMSNorm(hd, opts.norm_eps, sequence_parallel_enabled=tp > 1, **norm_kw)
        # its input columns are this rank's query heads: their block under the KV-replica layout
        order = self.qkv_proj.output_partition_order() if qkv_linear else None
        self.o_proj = RowParallelLinear(nq * hd, h, bias=opts.o_bias, input_is_parallel=True,
                                        sequence_parallel_enabled=sp, partition_order=order,
                                        **{**kw, "init_method": output_init_method or init_method})
        self.core_attention = CoreAttention(flash_attention=flash_attention, window=opts.window(layer_index),
                                            dropout=opts.attention_dropout)
        #: RoPE kernel, ``torch`` or ``liger`` (:func:`nxd_lc.models.common.fusions.apply_fusions`)
        self.rope_kernel = "torch"

    def forward(self, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None,
                segment_ids: torch.Tensor | None = None, kv_cache: LayerKVCache | None = None) -> torch.Tensor:
        """x [B, S(/tp), H], cos/sin [B, S, Dr] fp32 (None: no RoPE), segment_ids [B, S] or None -> [B, S(/tp), H].

        With ``kv_cache`` (inference): the S positions follow the cached ones; their keys / values are appended
        and they attend every cached position (:func:`cached_attention`); ``segment_ids`` must be None."""
        if self.qkv_linear:
            q, k, v = self.qkv_proj(x)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        b, s = q.shape[:2]
        q, k, v = (t.view(b, s, -1, self.head_dim) for t in (q, k, v))  # [B, S, heads, D]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, heads, S, D]
        if cos is not None:
            q, k = _rotate(q, k, cos, sin, self.rope_kernel)
        if kv_cache is not None:
            k, v = kv_cache.append(k, v)
            out = cached_attention(q, k, v, window=self.core_attention.window)
        else:
            out = self.core_attention(q, k, v, segment_ids)  # [B, heads_local, S, D]
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


def _rotate(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            kernel: str = "torch") -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE on the first ``Dr = cos.shape[-1]`` dims of each head of q / k [B, heads, S, D]; the other ``D - Dr``
    pass through (partial rotary, GPT-NeoX / Megatron ``rotary_percent``; always the ``torch`` kernel)."""
    dr = cos.shape[-1]
    if dr == q.shape[-1]:
        return apply_rotary_pos_emb(q, k, cos, sin, kernel)
    q_rot, k_rot = apply_rotary_pos_emb(q[..., :dr], k[..., :dr], cos, sin)
    return torch.cat([q_rot, q[..., dr:]], dim=-1), torch.cat([k_rot, k[..., dr:]], dim=-1)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block: ``h = x + drop(attn(norm1(x))); out = h + drop(mlp(norm2(h)))``; [B, S(/tp), H] -> same.

    ``drop`` is the hidden dropout (:class:`~nxd_lc.models.common.family.DecoderOptions`; identity at 0 or in
    eval), with a TP-layout-independent mask (:func:`~nxd_lc.layers.dropout.sharded_dropout`)."""

    #: nothing after the MLP saves a tensor for backward (the residual add does not): a checkpoint recomputation
    #: of this layer may skip the tiled MLP's chunk forwards (``nxd_lc.layers.tiled.discard_tiled_outputs``)
    tiled_output_unused_in_recompute: ClassVar[bool] = True

    def __init__(self, config: LlamaConfig, *, sequence_parallel: bool, init_method: InitMethod,
                 attn_kw: dict[str, Any], mlp: nn.Module | None = None, options: DecoderOptions | None = None,
                 layer_index: int = 0, output_init_method: InitMethod | None = None, **layer_kw: Any) -> None:
        super().__init__()
        opts = options or decoder_options(config)
        h, sp = config.hidden_size, sequence_parallel
        norm_kw = {"dtype": layer_kw["dtype"], "device": layer_kw["device"], "sequence_parallel_enabled": sp}
        self.input_layernorm = build_norm(opts.norm, h, opts.norm_eps, **norm_kw)
        self.self_attn = LlamaAttention(config, sequence_parallel=sp, init_method=init_method, options=opts,
                                        layer_index=layer_index, output_init_method=output_init_method,
                                        **attn_kw, **layer_kw)
        self.post_attention_layernorm = build_norm(opts.norm, h, opts.norm_eps, **norm_kw)
        self.hidden_dropout = opts.hidden_dropout
        self.sequence_parallel = sp
        mlp_kw = {"sequence_parallel_enabled": sp, "init_method": init_method, "ffn_dropout": opts.ffn_dropout,
                  "output_init_method": output_init_method, **layer_kw}
        # the feed-forward block: a given one (e.g. nxd_lc.moe.MoE for a mixture-of-experts layer), else the family's
        if mlp is not None:
            self.mlp = mlp
        elif opts.activation == "gelu":
            self.mlp = GeluMLP(h, config.intermediate_size, bias=opts.mlp_bias, **mlp_kw)
        else:
            self.mlp = LlamaMLP(h, config.intermediate_size, bias=opts.mlp_bias, **mlp_kw)

    def _drop(self, y: torch.Tensor) -> torch.Tensor:
        """Hidden dropout of a residual branch's output y [B, S(/tp), H] (sequence-sharded under SP)."""
        if not self.hidden_dropout or not self.training:
            return y
        return hidden_dropout(y, self.hidden_dropout, self.sequence_parallel)

    def forward(self, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None,
                segment_ids: torch.Tensor | None = None,
                kv_cache: LayerKVCache | None = None) -> torch.Tensor | tuple[torch.Tensor, Any]:
        """x [B, S(/tp), H], segment_ids [B, S] or None (see :class:`LlamaForCausalLM`), this layer's
        ``kv_cache`` or None -> [B, S(/tp), H]; ``(output, statistics)`` when the feed-forward block returns
        statistics too (a mixture-of-experts layer's :class:`~nxd_lc.moe.routing.RouterStats`)."""
        h = x + self._drop(self.self_attn(self.input_layernorm(x), cos, sin, segment_ids, kv_cache))
        y = self.mlp(self.post_attention_layernorm(h))
        if isinstance(y, tuple):
            y, stats = y
            return h + self._drop(y), stats
        return h + self._drop(y)


def hidden_dropout(y: torch.Tensor, p: float, sequence_parallel: bool) -> torch.Tensor:
    """Training-mode dropout of activations y [B, S(/tp), H] outside the TP region, the mask independent of the
    TP layout (sliced along S under sequence parallelism; see :mod:`nxd_lc.layers.dropout`)."""
    sp = sequence_parallel and parallel_state.get_tensor_model_parallel_world_size() > 1
    if not sp:
        return sharded_dropout(y, p, True)
    return sharded_dropout(y, p, True, shard_dim=1, num_shards=parallel_state.get_tensor_model_parallel_world_size(),
                           shard_index=parallel_state.rank_tensor("tp", y.device))


class RemoteLayer(nn.Module):
    """Placeholder for decoder layer ``index`` held by another pipeline stage (no parameters; keeps the layer
    indices, hence the parameter names ``layers.<i>.*``, identical at every pipeline split)."""

    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Always raises RuntimeError: the layer's weights are on another pipeline stage."""
        raise RuntimeError(f"decoder layer {self.index} lives on another pipeline stage; run it there "
                           "(nxd_lc.pipeline) instead of calling the full model on this rank")


class LlamaForCausalLM(nn.Module):
    """Tensor/sequence-parallel Llama causal LM from an HF :class:`LlamaConfig`.

    Args:
        config: HF config (see :func:`build_llama_config`); kept as ``self.config`` (unpadded vocab).
        sequence_parallel: split activations outside the TP regions along S (needs S % tp == 0).
        kv_replicator: KV-head replication when num_key_value_heads < TP (must match
            ``parallel_state``'s); see :class:`GQAQKVColumnParallelLinear`.
        fuse_qkv: one fused ``[q; k; v]`` weight in ``qkv_proj``.
        qkv_linear: use ``GQAQKVColumnParallelLinear``; False -> separate q/k/v column layers.
        flash_attention: torch SDPA (True) or the eager reference attention (False).
        use_cpu_initialization: initialise full weights on CPU and slice (TP-size independent).
        dtype, device: of the parameters.
        keep_layers: decoder-layer indices this pipeline stage holds (None: all); the others become
            :class:`RemoteLayer` placeholders.
        keep_embedding, keep_head: whether this stage holds the embedding (first stage) and the final norm +
            lm head (last stage); the dropped modules are ``None``.

    Weights are initialised as HF does (``normal(0, initializer_range)`` for linear and embedding
    weights, ones for norms, zero biases); padded embedding rows are zeroed. With
    ``tie_word_embeddings`` the lm_head shares the embedding's Parameter (same ``[Vp/tp, H]`` layout).

    Raises:
        ValueError: on head / size combinations that cannot be sharded over TP.
    """

    def __init__(self, config: LlamaConfig, *, sequence_parallel: bool = False, kv_replicator: int = 1,
                 fuse_qkv: bool = True, qkv_linear: bool = True, flash_attention: bool = True,
                 use_cpu_initialization: bool = True, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None, keep_layers: Collection[int] | None = None,
                 keep_embedding: bool = True, keep_head: bool = True) -> None:
        super().__init__()
        self.config = config
        self.options = opts = decoder_options(config)
        self.sequence_parallel = sequence_parallel
        tp = parallel_state.get_tensor_model_parallel_world_size()
        self.vocab_size = config.vocab_size
        self.padded_vocab_size = pad_vocab_size(config.vocab_size, tp * opts.make_vocab_size_divisible_by)
        init = functools.partial(normal_init, opts.init_std)
        output_init = functools.partial(normal_init, opts.output_init_std)
        layer_kw = {"dtype": dtype, "device": device, "use_cpu_initialization": use_cpu_initialization}
        attn_kw = {"kv_replicator": kv_replicator, "fuse_qkv": fuse_qkv, "qkv_linear": qkv_linear,
                       "flash_attention": flash_attention}
        self.embed_tokens = ParallelEmbedding(self.padded_vocab_size, config.hidden_size,
                                              sequence_parallel_enabled=sequence_parallel, init_method=init,
                                              **layer_kw)
        self.embed_positions = self._position_table(init, dtype, device)
        # Every layer is built (so the seeded initialisation is the same at every pipeline split), and a layer
        # of another pipeline stage is dropped at once: peak memory is this stage's layers plus one.
        keep = set(range(config.num_hidden_layers)) if keep_layers is None else set(keep_layers)
        self.layers = nn.ModuleList()
        for i in range(config.num_hidden_layers):
            layer = LlamaDecoderLayer(config, sequence_parallel=sequence_parallel, init_method=init,
                                      attn_kw=attn_kw, mlp=self.build_mlp(i, config, sequence_parallel, init, layer_kw),
                                      options=opts, layer_index=i, output_init_method=output_init, **layer_kw)
            self.layers.append(layer if i in keep else RemoteLayer(i))
            del layer
        self.norm = build_norm(opts.norm, config.hidden_size, opts.norm_eps,
                               sequence_parallel_enabled=sequence_parallel, dtype=dtype, device=device)
        self.lm_head = ColumnParallelLinear(config.hidden_size, self.padded_vocab_size, bias=False,
                                            gather_output=False, sequence_parallel_enabled=sequence_parallel,
                                            init_method=init, **layer_kw)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary_emb = self._rotary()
        vocab_local = self.padded_vocab_size // tp
        first = parallel_state.get_tensor_model_parallel_rank() * vocab_local
        self.num_valid_vocab_local = max(0, min(vocab_local, config.vocab_size - first))
        self._zero_padded_embedding_rows()
        self._keep_pipeline_part(keep_embedding, keep_head)
        # tokens per chunk of the tiled CE in loss(); None: untiled (set by apply_memory_techniques)
        self.tiled_loss_chunk_size: int | None = None
        # the loss kernel, torch or liger (model.fusions.cross_entropy; nxd_lc.models.common.fusions.apply_fusions)
        self.cross_entropy_kernel = "torch"

    def _position_table(self, init: InitMethod, dtype: torch.dtype,
                        device: torch.device | str | None) -> nn.Embedding | None:
        """Learned absolute positions ``[max_position_embeddings, H]`` (replicated over TP; under sequence
        parallelism each rank adds the rows of its S/tp positions, so the weight's gradient is summed over TP),
        or None with RoPE."""
        if self.options.position_embedding != "learned_absolute":
            return None
        weight = torch.empty(self.config.max_position_embeddings, self.config.hidden_size, dtype=torch.float32)
        init(weight)  # on the host with the seeded generator, as the parallel layers' use_cpu_initialization
        table = nn.Embedding(*weight.shape, _weight=weight.to(dtype=dtype, device=device))
        table.weight.sequence_parallel_enabled = self.sequence_parallel
        return table

    def _rotary(self) -> RotaryEmbedding | None:
        """RoPE over the first ``rotary_percentage`` of each head's dims (None with learned positions)."""
        if self.options.position_embedding != "rope":
            return None
        spec = rope_spec_from_config(self.config)
        rotary_dim = int(spec.head_dim * self.options.rotary_percentage)
        if rotary_dim != spec.head_dim:
            spec = dataclasses.replace(spec, head_dim=rotary_dim)
        return RotaryEmbedding(spec)

    def embed(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """Token embedding (+ learned positions, + hidden dropout when training): input_ids, position_ids [B, S]
        -> [B, S(/tp), H] (sequence-sharded under SP, as the decoder layers take it)."""
        h = self.embed_tokens(input_ids)  # [B, S(/tp), H]
        if self.embed_positions is not None:
            pos = position_ids
            tp = parallel_state.get_tensor_model_parallel_world_size()
            if self.sequence_parallel and tp > 1:  # this rank's S/tp positions (the same graph on every rank)
                pos = scatter_to_sequence_parallel_region(pos)
            h = h + self.embed_positions(pos).to(h.dtype)
        if self.options.hidden_dropout and self.training:
            h = hidden_dropout(h, self.options.hidden_dropout, self.sequence_parallel)
        return h

    def position_encoding(self, position_ids: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """RoPE ``(cos, sin)`` [B, S, Dr] fp32 for the decoder layers, or ``(None, None)`` with learned positions."""
        if self.rotary_emb is None:
            return None, None
        return self.rotary_emb(position_ids)

    def build_mlp(self, index: int, config: LlamaConfig, sequence_parallel: bool, init_method: InitMethod,
                  layer_kw: dict[str, Any]) -> nn.Module | None:
        """The feed-forward block of decoder layer ``index``, or None for the dense :class:`LlamaMLP` (what
        Llama uses everywhere; families with other blocks, e.g. mixture-of-experts layers, override this)."""
        return None

    def _keep_pipeline_part(self, keep_embedding: bool, keep_head: bool) -> None:
        """Drop the embedding and position table (not on the first pipeline stage) and the final norm + lm head
        (not on the last).

        With tied embeddings split over two stages, the last stage's lm head gets its own copy of the (already
        initialised) embedding weight; both are flagged ``pipeline_tied`` and their gradients are summed over the
        embedding group (:func:`nxd_lc.distributed.grads.allreduce_tied_embedding_gradients`); the copy is also
        flagged ``pipeline_tied_copy`` so global norms count the weight once (Megatron's shared embedding).
        """
        tied = bool(self.config.tie_word_embeddings)
        if keep_head and not keep_embedding and tied:
            self.lm_head.weight = nn.Parameter(self.embed_tokens.weight.detach().clone())
            for attr, value in vars(self.embed_tokens.weight).items():  # TP layout flags
                setattr(self.lm_head.weight, attr, value)
            self.lm_head.weight.pipeline_tied = True
            self.lm_head.weight.pipeline_tied_copy = True
        if keep_embedding and not keep_head and tied:
            self.embed_tokens.weight.pipeline_tied = True
        if not keep_embedding:
            self.embed_tokens = None
            self.embed_positions = None
        if not keep_head:
            self.norm = None
            self.lm_head = None

    def local_layers(self) -> list[tuple[int, LlamaDecoderLayer]]:
        """``(index, layer)`` of the decoder layers held by this process (all of them without pipelining)."""
        return [(i, layer) for i, layer in enumerate(self.layers) if not isinstance(layer, RemoteLayer)]

    @torch.no_grad()
    def _zero_padded_embedding_rows(self) -> None:
        """Zero the embedding rows of padded vocab ids (only on the last TP rank(s))."""
        if self.embed_tokens is not None:
            self.embed_tokens.weight[self.num_valid_vocab_local:].zero_()

    def _check_inputs(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None) -> torch.Tensor:
        """Validate [B, S] ids; return position_ids (default ``arange(S)`` per row)."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, S], got shape {tuple(input_ids.shape)}")
        b, s = input_ids.shape
        tp = parallel_state.get_tensor_model_parallel_world_size()
        if self.sequence_parallel and s % tp:
            raise ValueError(
                f"sequence length {s} is not divisible by tensor_model_parallel_size {tp}, which sequence "
                f"parallelism requires; pad the sequence (data.seq_length) to a multiple of {tp}"
            )
        if position_ids is None:
            return torch.arange(s, device=input_ids.device).unsqueeze(0).expand(b, s)
        if tuple(position_ids.shape) != (b, s):
            raise ValueError(f"position_ids shape {tuple(position_ids.shape)} must equal input_ids' {(b, s)}")
        return position_ids

    def kv_cache_unsupported(self) -> str | None:
        """Why this model cannot run with a :class:`KVCache` at the current layout, or None when it can.

        Context parallelism can: a forward with a cache attends locally (no CP collective in attention), so every
        CP rank runs the whole unsharded sequence (the weights are replicated over CP) and holds the whole cache
        (:mod:`nxd_lc.models.common.kv_cache`)."""
        if self.sequence_parallel and parallel_state.get_tensor_model_parallel_world_size() > 1:
            return "sequence parallelism splits every forward's positions over the TP ranks"
        if any(isinstance(layer, RemoteLayer) for layer in self.layers):
            return "pipeline parallelism holds the layers on several ranks"
        return None

    def new_kv_cache(self) -> KVCache:
        """An empty :class:`KVCache` for :meth:`hidden_states` / :meth:`forward` (inference).

        Raises:
            ValueError: the layout cannot use one (:meth:`kv_cache_unsupported`).
        """
        why = self.kv_cache_unsupported()
        if why is not None:
            raise ValueError(f"KV cache not available: {why}")
        return KVCache(len(self.layers))

    def hidden_states(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                      segment_ids: torch.Tensor | None = None, kv_cache: KVCache | None = None) -> torch.Tensor:
        """input_ids [B, S], position_ids [B, S] or None (0..S-1) -> lm-head input [B, S, H].

        The final norm's output, entered into the TP region exactly as the lm head's column layer does:
        all-gathered to the full S under sequence parallelism (backward: reduce-scatter), identity otherwise
        (backward: all-reduce over TP). Whatever consumes it must therefore be a TP-sharded computation such
        as :meth:`logits_from_hidden` or :func:`causal_lm_loss_from_hidden` (each rank's gradient is partial).

        ``segment_ids`` [B, S] integer (packed-document index of each token, non-decreasing along S) restricts
        attention to each document (see :func:`nxd_lc.context.attention.core_attention`); None or all
        zeros attends causally over the whole row.

        ``kv_cache`` (from :meth:`new_kv_cache`; inference, no gradient): ``input_ids`` continue the cached
        positions (``position_ids`` default ``cache.length + arange(S)``) and are appended to the cache.

        Raises:
            ValueError: bad input shapes (names the tensor), or decreasing / non-integer segment_ids;
                ``segment_ids`` together with a ``kv_cache``.
        """
        if kv_cache is not None:
            if segment_ids is not None:
                raise ValueError("hidden_states: segment_ids (packed documents) cannot be used with a kv_cache")
            if position_ids is None:
                b, s = input_ids.shape
                position_ids = (kv_cache.length + torch.arange(s, device=input_ids.device)).unsqueeze(0).expand(b, s)
        position_ids = self._check_inputs(input_ids, position_ids)
        self._check_segment_ids(segment_ids, input_ids)
        cos, sin = self.position_encoding(position_ids)  # [B, S, Dr] fp32 (None: learned positions)
        h = self.embed(input_ids, position_ids)  # [B, S(/tp), H]
        h = self.run_layers(h, range(len(self.layers)), cos, sin, segment_ids, kv_cache)
        return self.head_input(h)

    @staticmethod
    def _check_segment_ids(segment_ids: torch.Tensor | None, input_ids: torch.Tensor) -> None:
        if segment_ids is not None and segment_ids.shape != input_ids.shape:
            raise ValueError(f"segment_ids shape {tuple(segment_ids.shape)} must equal input_ids' "
                             f"{tuple(input_ids.shape)}")

    def run_layers(self, h: torch.Tensor, layer_ids: Iterable[int], cos: torch.Tensor, sin: torch.Tensor,
                   segment_ids: torch.Tensor | None = None, kv_cache: KVCache | None = None) -> torch.Tensor:
        """Decoder layers ``layer_ids`` in order: h [B, S(/tp), H] -> [B, S(/tp), H]; cos/sin [B, S, D] fp32;
        ``kv_cache``: see :meth:`hidden_states`.

        Raises:
            RuntimeError: a layer of ``layer_ids`` lives on another pipeline stage.
        """
        for i in layer_ids:
            if kv_cache is None:
                out = self.layers[i](h, cos, sin, segment_ids)
            else:
                out = self.layers[i](h, cos, sin, segment_ids, kv_cache.layers[i])
            h = self.collect_layer_statistics(out)
        return h

    #: fp32 values of per-layer statistics that travel between pipeline stages beside the hidden states (0: none;
    #: a family whose layers return statistics, e.g. mixture of experts, sets it and overrides the methods below)
    pipeline_statistics_size: int = 0

    def begin_pipeline_stage(self, carried: torch.Tensor | None) -> None:
        """A pipeline stage starts: ``carried`` [pipeline_statistics_size] fp32 from the previous stage (None on
        the first). Llama carries nothing."""

    def end_pipeline_stage(self) -> torch.Tensor:
        """A (non-last) pipeline stage ends: the statistics to send on, [pipeline_statistics_size] fp32."""
        raise NotImplementedError(f"{type(self).__name__} carries no statistics between pipeline stages")

    def add_auxiliary_loss(self, loss_sum: torch.Tensor, num_tokens: torch.Tensor) -> torch.Tensor:
        """``loss_sum`` of the micro-batch's token losses plus any auxiliary term, times ``num_tokens`` so that
        ``loss_sum / num_tokens`` adds the term once (Llama: none; mixture of experts: the load-balancing loss)."""
        return loss_sum

    def collect_layer_statistics(self, out: torch.Tensor | tuple[torch.Tensor, Any]) -> torch.Tensor:
        """A decoder layer's output -> its hidden states [B, S(/tp), H]. Llama layers return only those; a
        family whose layers also return statistics (mixture of experts) overrides this to keep them."""
        if isinstance(out, tuple):
            raise TypeError(f"{type(self).__name__}: a decoder layer returned statistics this model does not "
                            "collect (a mixture-of-experts block in a Llama model?)")
        return out

    def head_input(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm of the last layer's output h [B, S(/tp), H], entered into the TP region -> [B, S, H]
        (see :meth:`hidden_states`)."""
        h = self.norm(h)  # [B, S(/tp), H]
        if self.lm_head.sequence_parallel_enabled:
            return gather_from_sequence_parallel_region(h, to_model_parallel=True)  # [B, S, H]
        return copy_to_tensor_model_parallel_region(h)

    def logits_from_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """lm-head input [B, S, H] (from :meth:`hidden_states`) -> logits_local [B, S, Vp/tp].

        Padded vocab columns hold the dtype's lowest finite value (see the module docstring).
        """
        return vocab_parallel_logits(hidden, self.lm_head.weight, self.valid_vocab_local(hidden.device))

    def valid_vocab_local(self, device: torch.device) -> int | torch.Tensor:
        """Real (unpadded) vocabulary entries in this TP rank's lm-head slice: the int ``num_valid_vocab_local``
        when every rank has the same count (TP 1, or no vocabulary padding), else that count as an int64 ``[1]``
        tensor on ``device`` computed from the TP rank as device data, so every TP rank masks its padded columns in
        the same graph (DESIGN.md 16)."""
        tp = parallel_state.get_tensor_model_parallel_world_size()
        if tp == 1 or self.padded_vocab_size == self.config.vocab_size:
            return self.num_valid_vocab_local
        vocab_local = self.padded_vocab_size // tp
        first = parallel_state.rank_tensor("tp", device) * vocab_local
        return (self.config.vocab_size - first).clamp(0, vocab_local)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                segment_ids: torch.Tensor | None = None, kv_cache: KVCache | None = None) -> torch.Tensor:
        """input_ids [B, S] (+ position_ids, segment_ids, kv_cache as :meth:`hidden_states`) -> logits_local
        [B, S, Vp/tp].

        ``logits_from_hidden(hidden_states(...))``: the lm head of the model's ``lm_head`` weight.
        """
        return self.logits_from_hidden(self.hidden_states(input_ids, position_ids, segment_ids, kv_cache))

    def loss(self, input_ids: torch.Tensor, labels: torch.Tensor, position_ids: torch.Tensor | None = None,
             ignore_index: int = -100, segment_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(loss_sum, num_tokens)`` of the micro-batch; see :func:`causal_lm_loss_from_hidden`.

        With ``tiled_loss_chunk_size`` set the [B, S, Vp/tp] logits are never materialised.
        """
        hidden = self.hidden_states(input_ids, position_ids, segment_ids)
        return causal_lm_loss_from_hidden(self, hidden, labels, ignore_index)


