"""LoRA adapters on the tensor-parallel projections (Hu et al. 2021, "LoRA", arXiv:2106.09685).

``y = base(x) + s * B A dropout(x)`` with ``s = lora_alpha / lora_rank``; ``A [r, in]`` starts Kaiming-uniform
(``a = sqrt(5)``, i.e. ``U(-1/sqrt(in), 1/sqrt(in))`` over the FULL fan-in, as PEFT's ``lora_A``) and ``B [out, r]``
at zero, so training starts from the base model. ``tp`` is the TP size; "full" means the TP=1 layout.

Sharding (so that ``B_local @ A_local`` is exactly the slice of the full ``B @ A`` that the base weight shard holds,
and merging is local: ``W_local += s * B_local @ A_local``):

* ColumnParallelLinear, weight ``[out/tp, in]``: ``lora_A [r, in]`` TP-replicated; ``lora_B [out/tp, r]`` with
  ``partition_dim=0`` and the base's ``partition_stride`` (``gate_up_proj``: stride 2, rows ``[gate; up]``).
* GQAQKVColumnParallelLinear (fused or not): ``lora_A [r, H]`` TP-replicated; ``lora_B [(nq_l + 2*nkv_l)*hd, r]``
  holding the layer's local q | k | v head rows, KV replicas included.
* RowParallelLinear, weight ``[out, in/tp]``: ``lora_A [r, in/tp]`` with ``partition_dim=1``; ``lora_B [out, r]``
  TP-replicated.

The qkv adapter has one ``A`` and one ``B`` over the fused ``[q; k; v]`` output rows (full ``B`` rows in HF order
``q, k, v``), also when ``fuse_qkv=False`` (``B``'s rows are split between ``weight_q/k/v``). With
``kv_replicator > 1`` the KV rows of ``B`` are replicas: flagged ``kv_replicated`` with ``kv_replicated_rows`` like
the fused base weight, so their gradients are summed over the KV-shared group and stay identical.

Forward, no extra collectives: a column layer enters the TP region once (all-gather on S under sequence
parallelism, identity otherwise) and both paths read that input (under SP ``A`` is one of the weights of
:func:`~nxd_lc.distributed.mappings.sequence_parallel_linears`, which keeps only the ``[B, S/tp, in]`` shard for the
backward, unless LoRA dropout is active); a row layer adds the low-rank partial product
``s * B (A_local x_local)`` to its own partial product BEFORE the all-reduce (or reduce-scatter on S under SP), so
the base's reduction sums it over TP; the bias is added after, as in the base.

Gradients: ``A`` of a column layer and ``B`` of a row layer are TP-replicated, yet each rank's gradient is
partial (column: only this rank's output rows reach ``A``; row: only this rank's input columns reach ``B``;
under SP also only this rank's tokens). They carry ``sequence_parallel_enabled=True`` so that
:func:`nxd_lc.distributed.grads.allreduce_sequence_parallel_gradients` sums them over TP — which must therefore
run every step whatever the SP setting (``nxd_lc.lightning.module`` does). Global norms count them once
(``tensor_model_parallel=False``).

Dropout (training only): a column layer's input is the same on every TP rank, and its mask comes from the
default RNG, which all TP ranks share (every rank is seeded with ``cfg.seed``; Megatron's convention for
replicated regions), so all ranks drop the same entries, as TP=1 would. A row layer's input is a per-rank feature
shard; its mask comes from a generator seeded by one draw of the shared CPU RNG plus the TP rank, so shards get
independent masks (Megatron's model-parallel RNG idea); ``torch.utils.checkpoint`` restores the CPU RNG, so
recomputation replays the same masks. Devices without ``torch.Generator`` support (XLA) fall back to the shared
RNG, whose masks then repeat across the shards of one layer.

In place: :func:`apply_lora` turns each target module into its LoRA subclass (``module.__class__``) and
registers ``lora_A`` / ``lora_B`` on it, so the module object, its base parameters and their names (state-dict
keys, HF loader, activation-checkpoint wrappers) are unchanged; adapters appear as ``<module>.lora_A`` /
``<module>.lora_B``. :func:`merge_lora` folds them in and restores the base class.
"""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from nxd_lc.config.peft_schema import PEFT_KEY, PeftConfig, peft_problems, target_module_problems
from nxd_lc.distributed import collectives, parallel_state
from nxd_lc.distributed.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
    sequence_parallel_linears,
)
from nxd_lc.layers.linear import (
    ColumnParallelLinear,
    RowParallelLinear,
    default_init_method,
    init_parameter,
    mark_parameter,
    merge_tensor_shards,
    partition_order,
    shard_full_parameter,
)
from nxd_lc.layers.qkv import GQAQKVColumnParallelLinear
from nxd_lc.runtime.xla import is_xla_tensor

__all__ = [
    "LORA_CLASSES",
    "LoraColumnParallelLinear",
    "LoraGQAQKVColumnParallelLinear",
    "LoraRowParallelLinear",
    "apply_lora",
    "convert_to_lora",
    "is_lora_key",
    "load_lora_state_dict",
    "lora_disabled",
    "lora_dropout",
    "lora_modules",
    "lora_scale",
    "lora_state_dict",
    "merge_lora",
]


def is_lora_key(key: str) -> bool:
    """True for the adapter entries of a state dict (``...lora_A`` / ``...lora_B``), as :func:`lora_state_dict`
    writes them."""
    return key.rsplit(".", 1)[-1] in ("lora_A", "lora_B")


def lora_scale(lora_alpha: float, lora_rank: int) -> float:
    """``lora_alpha / lora_rank``: the scaling of ``B @ A`` (Hu et al. 2021, section 4.1)."""
    return float(lora_alpha) / float(lora_rank)


def lora_dropout(x: torch.Tensor, p: float, training: bool, sharded: bool) -> torch.Tensor:
    """Inverted dropout (``x * mask / (1 - p)``) of the adapter input; identity when ``p == 0`` or not training.

    ``sharded=False``: ``x`` is identical on every TP rank -> ``F.dropout`` with the shared default RNG.
    ``sharded=True``: ``x`` is this TP rank's shard -> a mask from a generator seeded by one draw of the CPU RNG
    plus the TP rank (independent per shard; see the module docstring). Same shape and dtype as ``x``.
    """
    if p == 0.0 or not training:
        return x
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if not sharded or tp == 1 or is_xla_tensor(x):  # no device generators on torch-xla's lazy tensors
        return F.dropout(x, p, training=True)
    seed = int(torch.randint(0, 2**31 - 1, (1,)).item())
    gen = torch.Generator(device=x.device)
    gen.manual_seed(seed + 1_000_003 * (1 + parallel_state.get_tensor_model_parallel_rank()))
    keep = torch.empty_like(x).bernoulli_(1.0 - p, generator=gen)
    return x * keep / (1.0 - p)


def _enter_tp_region(x: torch.Tensor, sequence_parallel: bool) -> torch.Tensor:
    """Input of a column layer into the TP region, as the base layers do: ``[B, S/tp, H]`` -> ``[B, S, H]``
    (all-gather, backward reduce-scatter) under SP; identity (backward all-reduce) otherwise."""
    if sequence_parallel:
        return gather_from_sequence_parallel_region(x, to_model_parallel=True)
    return copy_to_tensor_model_parallel_region(x)


def _gather_like(t: torch.Tensor, param: nn.Parameter) -> torch.Tensor:
    """All-gather ``t`` (laid out like ``param``: a shard, or a TP-replicated tensor) into a new full tensor."""
    t = t.detach()
    world = parallel_state.get_tensor_model_parallel_world_size()
    if not getattr(param, "tensor_model_parallel", False) or world == 1:
        return t.clone()
    dim, stride = param.partition_dim, getattr(param, "partition_stride", 1)
    gathered = collectives.all_gather(t.contiguous(), dim, parallel_state.get_tensor_model_parallel_group())
    return merge_tensor_shards(gathered.chunk(world, dim=dim), dim, stride, partition_order(param))


def _zeros(t: torch.Tensor) -> object:
    return nn.init.zeros_(t)


class _LoraLayer:
    """Shared adapter bookkeeping of the LoRA subclasses (not an ``nn.Module`` itself).

    Attributes set by :meth:`init_lora`: ``lora_A``, ``lora_B`` (``nn.Parameter``), ``lora_rank``,
    ``lora_scale`` (float), ``lora_dropout_p`` (float), ``lora_base_class`` (the class to restore on merge).
    """

    lora_A: nn.Parameter
    lora_B: nn.Parameter
    lora_rank: int
    lora_scale: float
    lora_dropout_p: float
    lora_base_class: type
    training: bool

    def _register_adapters(self, a: nn.Parameter, b: nn.Parameter, cfg: PeftConfig, partial_grad: str) -> None:
        """Register ``a``/``b`` as ``lora_A``/``lora_B``; flag the TP-replicated one with partial grads."""
        self.register_parameter("lora_A", a)  # type: ignore[attr-defined]
        self.register_parameter("lora_B", b)  # type: ignore[attr-defined]
        (a if partial_grad == "lora_A" else b).sequence_parallel_enabled = True
        self.lora_rank = int(cfg.lora_rank)
        self.lora_scale = lora_scale(cfg.lora_alpha, cfg.lora_rank)
        self.lora_dropout_p = float(cfg.lora_dropout)

    def _column_forward(self, x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor | None],
                        ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """A column layer's base outputs ``x W_i^T + b_i`` ``[B, S, out_i/tp]`` and its low-rank delta ``[B, S,
        sum_i out_i/tp]`` from one entry into the TP region. Under SP without active dropout ``A`` joins the base
        weights in :func:`~nxd_lc.distributed.mappings.sequence_parallel_linears`, so only the ``[B, S/tp, in]``
        shard is kept for every weight gradient; with dropout the gathered input is kept as before (``A``'s
        input is the dropped copy of the gathered tensor)."""
        if self.sequence_parallel_enabled and not (self.lora_dropout_p and self.training):  # type: ignore[attr-defined]
            *ys, u = sequence_parallel_linears(x, [*weights, self.lora_A], [*biases, None])  # u [B, S, r]
            return ys, F.linear(u * self.lora_scale, self.lora_B)
        x = _enter_tp_region(x, self.sequence_parallel_enabled)  # type: ignore[attr-defined]
        return [F.linear(x, w, b) for w, b in zip(weights, biases)], self._low_rank(x, sharded_input=False)

    def _low_rank(self, x: torch.Tensor, sharded_input: bool) -> torch.Tensor:
        """``s * B A dropout(x)``: ``x [..., in(_local)]`` -> ``[..., out(_local)]`` (scale applied at rank r)."""
        x = lora_dropout(x, self.lora_dropout_p, self.training, sharded_input)
        return F.linear(F.linear(x, self.lora_A) * self.lora_scale, self.lora_B)

    @torch.no_grad()
    def lora_delta_weight(self) -> torch.Tensor:
        """``s * B_local @ A_local`` in fp32: this rank's slice of the full update, laid out like the base weight
        (``[out/tp, in]`` column / qkv rows, ``[out, in/tp]`` row)."""
        return (self.lora_B.float() @ self.lora_A.float()) * self.lora_scale

    def gather_full_lora(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Full ``(A [r, in], B [out, r])`` from local tensors laid out like ``lora_A``/``lora_B`` (values or
        grads). Collective over TP."""
        return _gather_like(a, self.lora_A), _gather_like(b, self.lora_B)

    def shard_full_lora(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's ``(A, B)`` from full ones. Raises ValueError on a shape mismatch."""
        return shard_full_parameter(a, self.lora_A), shard_full_parameter(b, self.lora_B)

    @torch.no_grad()
    def merge_lora_(self) -> None:
        """``weight += s * B @ A`` (local), then drop the adapters and restore ``lora_base_class``."""
        self.weight.add_(self.lora_delta_weight().to(self.weight.dtype))  # type: ignore[attr-defined]
        self._drop_adapters()

    def _drop_adapters(self) -> None:
        """Remove ``lora_A``/``lora_B`` and restore the base class (after a merge)."""
        del self.lora_A, self.lora_B  # nn.Module.__delattr__ unregisters the parameters
        for name in ("lora_rank", "lora_scale", "lora_dropout_p"):
            self.__dict__.pop(name, None)
        self.__class__ = self.lora_base_class  # type: ignore[assignment]


class LoraColumnParallelLinear(_LoraLayer, ColumnParallelLinear):
    """:class:`ColumnParallelLinear` + LoRA: ``lora_A [r, in]`` TP-replicated, ``lora_B [out/tp, r]`` sharded
    like ``weight`` (same ``partition_stride``, so a fused ``[gate; up]`` B follows the base's strided rows).

    ``forward``: ``x [B, S(/tp), in]`` -> ``[B, S, out/tp]`` (``[B, S, out]`` with ``gather_output``), equal to
    the base layer with weight ``W + s * B @ A``. Made by :func:`apply_lora`.
    """

    lora_base_class = ColumnParallelLinear

    def init_lora(self, cfg: PeftConfig) -> None:
        """Create the adapters (``A`` Kaiming-uniform on the full fan-in from the CPU RNG, same on every TP rank;
        ``B`` zero) in the base weight's dtype and device."""
        w, r = self.weight, int(cfg.lora_rank)
        a = init_parameter((r, self.input_size), None, default_init_method(self.input_size), w.dtype, w.device, True)
        b = init_parameter((self.output_size, r), 0, _zeros, w.dtype, w.device, True,
                           getattr(w, "partition_stride", 1))
        self._register_adapters(a, b, cfg, partial_grad="lora_A")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, S, in]`` (``[B, S/tp, in]`` under SP) -> ``[B, S, out/tp]`` (``[B, S, out]`` gathered)."""
        (y,), delta = self._column_forward(x, [self.weight], [self.bias])
        y = y + delta
        return gather_from_tensor_model_parallel_region(y) if self.gather_output else y



class LoraRowParallelLinear(_LoraLayer, RowParallelLinear):
    """:class:`RowParallelLinear` + LoRA: ``lora_A [r, in/tp]`` sharded like ``weight`` (``partition_dim=1``),
    ``lora_B [out, r]`` TP-replicated.

    ``forward``: ``x [B, S, in/tp]`` -> ``[B, S, out]`` (``[B, S/tp, out]`` under SP), equal to the base layer
    with weight ``W + s * B @ A``: the low-rank partial product joins the base's before its reduction.
    """

    lora_base_class = RowParallelLinear

    def init_lora(self, cfg: PeftConfig) -> None:
        """Create the adapters (``A``: full ``[r, in]`` Kaiming-uniform on CPU, this rank keeps its columns, so
        any TP size gives the TP=1 values; ``B`` zero) in the base weight's dtype and device."""
        w, r = self.weight, int(cfg.lora_rank)
        a = init_parameter((r, self.input_size), 1, default_init_method(self.input_size), w.dtype, w.device, True,
                           order=partition_order(w))  # A's columns follow the base weight's (its input's)
        b = init_parameter((self.output_size, r), None, _zeros, w.dtype, w.device, True)
        self._register_adapters(a, b, cfg, partial_grad="lora_B")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, S, in/tp]`` -> ``[B, S, out]`` (``[B, S/tp, out]`` under SP)."""
        if not self.input_is_parallel:
            x = scatter_to_tensor_model_parallel_region(x)
        y = F.linear(x, self.weight) + self._low_rank(x, sharded_input=True)  # partial sums over TP
        if self.sequence_parallel_enabled:
            y = reduce_scatter_to_sequence_parallel_region(y)
        else:
            y = reduce_from_tensor_model_parallel_region(y)
        return y + self.bias if self.bias is not None else y



class LoraGQAQKVColumnParallelLinear(_LoraLayer, GQAQKVColumnParallelLinear):
    """:class:`GQAQKVColumnParallelLinear` + LoRA over the fused ``[q; k; v]`` outputs: ``lora_A [r, H]``
    TP-replicated, ``lora_B [(nq_l + 2*nkv_l)*hd, r]`` with the layer's local head rows (see the module docstring).

    ``forward``: as the base layer with ``[W_q; W_k; W_v] + s * B @ A`` -> ``(q, k, v)`` of ``[B, S, n_local*hd]``.
    """

    lora_base_class = GQAQKVColumnParallelLinear

    def _split_sizes(self) -> list[int]:
        return [self.q_size_local, self.kv_size_local, self.kv_size_local]

    def init_lora(self, cfg: PeftConfig) -> None:
        """Create the adapters (``A`` Kaiming-uniform from the CPU RNG, same on every rank; ``B`` zero), flagging
        ``B``'s KV rows as replicas when ``kv_replicator > 1``."""
        w, r, h = (self.weight_qkv if self.fuse_qkv else self.weight_q), int(cfg.lora_rank), self.hidden_size
        a = init_parameter((r, h), None, default_init_method(h), w.dtype, w.device, True)
        b = mark_parameter(nn.Parameter(torch.zeros(sum(self._split_sizes()), r, dtype=w.dtype, device=w.device)), 0)
        if self.kv_replicator > 1:
            b.kv_replicated = True
            b.kv_replicated_rows = (self.q_size_local, self.q_size_local + 2 * self.kv_size_local)
        self._register_adapters(a, b, cfg, partial_grad="lora_A")

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``[B, S, H]`` (``[B, S/tp, H]`` under SP) -> ``(q, k, v)`` of ``[B, S, n_local*hd]``."""
        ys, delta = self._column_forward(x, *self.base_weights_and_biases())  # delta [B, S, (nq_l + 2*nkv_l)*hd]
        if self.fuse_qkv:
            q, k, v = (ys[0] + delta).split(self._split_sizes(), dim=-1)
            return q, k, v
        dq, dk, dv = delta.split(self._split_sizes(), dim=-1)
        return ys[0] + dq, ys[1] + dk, ys[2] + dv

    def gather_full_lora(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Full ``(A [r, H], B [(nq + 2*nkv)*hd, r])`` (HF q, k, v row order, KV replicas dropped) from local
        tensors (values or grads). Collective over TP."""
        q, k, v = self._gather_full(*b.detach().split(self._split_sizes()))
        return a.detach().clone(), torch.cat([q, k, v])

    def shard_full_lora(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's ``(A, B)`` from full ones (``B`` rows: HF q, k, v). Raises ValueError on a bad shape."""
        nq, nkv, hd, r = self.num_attention_heads, self.num_key_value_heads, self.head_dim, self.lora_rank
        if tuple(a.shape) != tuple(self.lora_A.shape) or tuple(b.shape) != ((nq + 2 * nkv) * hd, r):
            raise ValueError(f"qkv LoRA: expected full A {tuple(self.lora_A.shape)} and B {((nq + 2 * nkv) * hd, r)}, "
                             f"got {tuple(a.shape)} and {tuple(b.shape)}; check lora_rank and the model config")
        q, k, v = b.split([nq * hd, nkv * hd, nkv * hd])
        block, heads = self.query_block(), self._kv_head_ids()
        q_loc = q.reshape(nq, hd, r)[block * self.num_heads_local:(block + 1) * self.num_heads_local]
        k_loc, v_loc = k.reshape(nkv, hd, r)[heads], v.reshape(nkv, hd, r)[heads]
        return a, torch.cat([t.reshape(-1, r) for t in (q_loc, k_loc, v_loc)])

    @torch.no_grad()
    def merge_lora_(self) -> None:
        """``[W_q; W_k; W_v] += s * B @ A`` (local rows), then drop the adapters and restore the base class."""
        delta = self.lora_delta_weight()
        if self.fuse_qkv:
            self.weight_qkv.add_(delta.to(self.weight_qkv.dtype))
        else:
            for w, d in zip((self.weight_q, self.weight_k, self.weight_v), delta.split(self._split_sizes())):
                w.add_(d.to(w.dtype))
        self._drop_adapters()


#: base class -> its LoRA subclass (exact types: subclasses of the bases are not converted silently).
LORA_CLASSES: dict[type, type] = {
    ColumnParallelLinear: LoraColumnParallelLinear,
    RowParallelLinear: LoraRowParallelLinear,
    GQAQKVColumnParallelLinear: LoraGQAQKVColumnParallelLinear,
}

LoraLayer = (LoraColumnParallelLinear, LoraRowParallelLinear, LoraGQAQKVColumnParallelLinear)


def convert_to_lora(module: nn.Module, cfg: PeftConfig) -> nn.Module:
    """Turn ``module`` (a ColumnParallelLinear, RowParallelLinear or GQAQKVColumnParallelLinear) into its LoRA
    subclass in place and create its adapters; returns the same object.

    Raises:
        ValueError: the module already has adapters, or its type has no LoRA subclass.
    """
    if isinstance(module, LoraLayer):
        raise ValueError(f"{type(module).__name__} already has LoRA adapters; merge_lora first to apply again")
    cls = LORA_CLASSES.get(type(module))
    if cls is None:
        raise ValueError(f"LoRA supports {', '.join(c.__name__ for c in LORA_CLASSES)}; got {type(module).__name__}")
    module.__class__ = cls
    module.init_lora(cfg)  # type: ignore[operator]
    return module


# ---- whole-model API --------------------------------------------------------------------------------------------
_TARGET_KEY = f"{PEFT_KEY}.target_modules"
#: target name -> module leaf names it covers (``qkv_proj`` also covers model.qkv_linear: false's q/k/v_proj)
_LEAF_NAMES = {"qkv_proj": ("qkv_proj", "q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
               "gate_up_proj": ("gate_up_proj",), "down_proj": ("down_proj",)}
_TILED_GUARD = "_lora_tiled_mlp_guard"


def _reject_tiled_mlp(mlp: nn.Module, args: tuple) -> None:
    """Forward pre-hook on an MLP whose projections carry adapters: its tiled path reads the raw weights."""
    if getattr(mlp, "tiled_chunk_size", None) is not None:
        raise ValueError("model.tiled_mlp_chunk_size: the tiled MLP computes with the raw gate_up_proj/down_proj "
                         "weights and would skip their LoRA adapters; set it to null or remove gate_up_proj and "
                         f"down_proj from {_TARGET_KEY}")


def _find_targets(model: nn.Module, target_modules: list[str]) -> list[tuple[str, nn.Module]]:
    """``(qualified name, module)`` of every module ``target_modules`` names (see :func:`apply_lora`)."""
    problems = target_module_problems(target_modules, _TARGET_KEY)
    if problems:
        raise ValueError("; ".join(problems))
    found: list[tuple[str, nn.Module]] = []
    hit: set[str] = set()
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        target = next((t for t in target_modules if leaf in _LEAF_NAMES[t]), None)
        if target is None or not isinstance(module, tuple(LORA_CLASSES)):
            continue
        if isinstance(module, LoraLayer):
            raise ValueError(f"{name} already has LoRA adapters; call merge_lora(model) before apply_lora again")
        found.append((name, module))
        hit.add(target)
    missing = [t for t in target_modules if t not in hit]
    if missing:
        raise ValueError(f"{_TARGET_KEY}: the model has no parallel linear module named {missing}; valid names: "
                         f"{', '.join(_LEAF_NAMES)}")
    return found


def apply_lora(model: nn.Module, peft_cfg: PeftConfig) -> list[str]:
    """Add LoRA adapters to the target projections in place and freeze everything else. ``A``'s initial values
    are a function of the CPU RNG's state at the call and the module's qualified name: the same at every TP / PP
    layout (a pipeline stage holds only its layers).

    Call after the model is built, its weights loaded and ``apply_memory_techniques`` ran, and BEFORE the
    optimizer is created (only parameters with ``requires_grad`` are optimised).

    Args:
        model: e.g. :class:`nxd_lc.models.llama.LlamaForCausalLM`, any TP size / SP / ``kv_replicator``.
        peft_cfg: ``model_alignment_strategy.peft`` (:class:`nxd_lc.config.peft_schema.PeftConfig`): ``lora_rank``,
            ``lora_alpha``, ``lora_dropout``, ``target_modules`` (subset of qkv_proj, o_proj, gate_up_proj,
            down_proj).

    Returns:
        Qualified names of the modules that now carry adapters, in ``named_modules`` order.

    Raises:
        ValueError: invalid ``peft_cfg`` values (every problem, each naming its ``model_alignment_strategy.peft``
            key), a target name that is unknown or matches no module (naming its ``target_modules`` and the valid
            names), adapters already present, or gate_up_proj / down_proj targeted while the MLP is tiled.
    """
    problems = peft_problems(peft_cfg)
    if problems:
        raise ValueError("; ".join(problems))
    targets = _find_targets(model, list(peft_cfg.target_modules))
    mlps = {id(p): p for p in (model.get_submodule(n.rsplit(".", 1)[0]) for n, _ in targets
                               if n.endswith(("gate_up_proj", "down_proj")) and "." in n)
            if hasattr(p, "tiled_chunk_size")}
    for mlp in mlps.values():
        _reject_tiled_mlp(mlp, ())  # fails before anything is changed
    for mlp in mlps.values():
        if not hasattr(mlp, _TILED_GUARD):
            setattr(mlp, _TILED_GUARD, mlp.register_forward_pre_hook(_reject_tiled_mlp))
    for p in model.parameters():
        p.requires_grad_(False)
    # A's initial values depend on the module's name, not on which modules this rank holds: one draw of the CPU
    # RNG (in the same state on every rank) seeds each module's own stream, so any PP split (a stage holds only
    # its layers) and any TP size give the values of one device
    base_seed = int(torch.randint(0, 2**31 - 1, (1,)).item())
    for name, module in targets:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(base_seed + zlib.crc32(name.encode()))
            convert_to_lora(module, peft_cfg)
    return [name for name, _ in targets]


def lora_modules(model: nn.Module) -> dict[str, nn.Module]:
    """``{qualified name: module}`` of every module of ``model`` that carries LoRA adapters."""
    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}


@contextlib.contextmanager
def lora_disabled(model: nn.Module) -> Iterator[None]:
    """Within the block the adapters contribute nothing (scale 0): the model computes the frozen base model, e.g.
    DPO's reference log-probs without a second model copy. Restores the scales on exit, also on error."""
    modules = list(lora_modules(model).values())
    saved = [m.lora_scale for m in modules]
    try:
        for m in modules:
            m.lora_scale = 0.0
        yield
    finally:
        for m, scale in zip(modules, saved):
            m.lora_scale = scale


def merge_lora(model: nn.Module) -> list[str]:
    """Fold every adapter into its base weight (``W += lora_alpha / lora_rank * B @ A``, shard by shard, no
    communication), remove the adapters and restore the base classes, in place. The base parameters keep
    ``requires_grad=False``. Returns the names of the merged modules (empty when there were none).

    Merged logits equal adapter logits up to rounding in the weights' dtype.
    """
    merged = lora_modules(model)
    for module in merged.values():
        module.merge_lora_()  # type: ignore[operator]
    for module in model.modules():
        handle = module.__dict__.pop(_TILED_GUARD, None)
        if handle is not None:
            handle.remove()
    return list(merged)


def lora_state_dict(model: nn.Module, full: bool = False) -> dict[str, torch.Tensor]:
    """The adapters alone: ``{"<module>.lora_A": A, "<module>.lora_B": B}`` (the keys of ``model.state_dict()``).

    Args:
        full: False -> this rank's local tensors (detached, shared storage; per-rank checkpoint shards).
            True -> new full TP-independent tensors (``A [r, in]``, ``B [out, r]``; qkv ``B`` rows HF ``q, k, v``
            without KV replicas; gate_up ``B`` rows ``[gate; up]``), identical on every rank, loadable at any
            TP size. Collective over TP: every TP rank must call it.
    """
    out: dict[str, torch.Tensor] = {}
    for name, m in lora_modules(model).items():
        a, b = (m.gather_full_lora(m.lora_A, m.lora_B) if full  # type: ignore[operator]
                else (m.lora_A.detach(), m.lora_B.detach()))
        out[f"{name}.lora_A"], out[f"{name}.lora_B"] = a, b
    return out


@torch.no_grad()
def load_lora_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor], full: bool = False) -> None:
    """Copy adapters from ``state_dict`` (as written by :func:`lora_state_dict` with the same ``full``) into the
    model's adapters, in place (values cast to the adapters' dtype and device). No communication.

    Raises:
        ValueError: the model has no adapters (call :func:`apply_lora` first); keys missing or unexpected (both
            listed); a tensor whose shape does not fit (naming the key; check lora_rank / TP size / ``full``).
    """
    modules = lora_modules(model)
    if not modules:
        raise ValueError("load_lora_state_dict: the model has no LoRA adapters; call apply_lora(model, cfg) first")
    expected = {f"{n}.lora_{x}" for n in modules for x in "AB"}
    missing, unexpected = sorted(expected - set(state_dict)), sorted(set(state_dict) - expected)
    if missing or unexpected:
        raise ValueError(f"load_lora_state_dict: missing keys {missing[:8]}, unexpected keys {unexpected[:8]} "
                         f"({len(missing)} / {len(unexpected)} in all); check {_TARGET_KEY}")
    for name, m in modules.items():
        a, b = state_dict[f"{name}.lora_A"], state_dict[f"{name}.lora_B"]
        if full:
            try:
                a, b = m.shard_full_lora(a, b)  # type: ignore[operator]
            except ValueError as e:
                raise ValueError(f"load_lora_state_dict: {name}: {e}") from e
        for key, dst, src in ((f"{name}.lora_A", m.lora_A, a), (f"{name}.lora_B", m.lora_B, b)):
            if tuple(dst.shape) != tuple(src.shape):
                raise ValueError(f"load_lora_state_dict: {key} has shape {tuple(src.shape)}, the model's adapter is "
                                 f"{tuple(dst.shape)}; check lora_rank, the TP size and full={full}")
            dst.copy_(src)
