"""Memory per rank at validation (issue 32, item 1): an estimate of what one rank holds while it trains, judged
against the device's memory when the dry run knows it.

The estimate, per rank (the pipeline rank that needs the most), in bytes:

* **parameters**: this rank's shards of the decoder built from the run's architecture (config.json + ``model:``
  overrides + ``hf_config_overrides`` + ``model.moe``, or the Megatron ``model:`` keys): the embedding and the
  untied lm head ``[Vp/tp, H]`` (``Vp`` the vocabulary padded as the model pads it), per decoder layer the two
  norms, q/k/v ``(nq + 2 nkv K) hd / tp`` rows of ``H`` (``K`` = ``kv_replicator``), ``o_proj``, the MLP
  (``gate_up`` ``2I/tp x H`` and ``down``; GeLU: ``up`` and ``down``) or the mixture of experts (router
  ``[E, H]`` fp32, ``E/ep`` experts of ``2I/tp x H`` + ``H x I/tp``) with biases and q/k norms as the family has
  them; the layers of the pipeline stage, the embedding on the first stage and the head on the last (a tied head
  split from its embedding is a copy). In the precision mode's parameter dtype (the router stays fp32). With LoRA
  (``model_alignment_strategy.peft``) the adapters ``r (in + out)`` per target module are added and only they are
  trained.
* **gradients**: one per trainable element, in the parameter dtype, or fp32 ``main_grad`` buffers with fp32
  gradient accumulation (:mod:`nxd_lc.precision.policy`).
* **optimizer state**: per trainable element, the optimizer's state tensors (Adam / AdamW: 2 moments, 3 with
  ``amsgrad``; SGD: 1 with momentum; Adafactor: factored row and column statistics; see :data:`_STATE_TENSORS`)
  in the mode's state dtype; **master weights**: an fp32 copy per element where the optimizer keeps one
  (:class:`~nxd_lc.optim.wrapper.NxDOptimizer`: ``mixed_precision*``, and any ZeRO-1 run). Under ZeRO-1
  (``distributed_strategy.zero1``) both are divided over DP x CP (expert parameters over their expert-DP x CP
  group), each tensor rounded up as the wrapper pads it. The wrapper's step also holds fp32 copies of one bucket
  (64 MiB of fp32 elements) at a time.
* **activations**: :func:`nxd_lc.models.common.memory_plan.estimate_split` (the tensors autograd keeps for one
  micro-batch, an upper bound tested against a measured step) for the configured recomputation: ``null`` ->
  plan ``none``, ``selective`` -> the listed modules' parts recomputed (norms, MLP, the attention kernel, the SwiGLU
  product: :data:`~nxd_lc.models.common.memory_plan.RECOMPUTE_PARTS`; other names counted as not recomputed, an
  upper bound, with a note), ``full`` -> ``full`` (with a tiled MLP ``full_tiled_mlp``, with offload
  ``full_offload``, with ``activations_checkpoint_save_attention`` ``full_save_attention``, with both
  ``full_save_attention_offload``), ``block`` with N
  layers -> N layers ``full`` and the rest ``none``; a memory budget (``activations_memory_budget``) -> the plan it
  chooses. ``T`` = micro batch x sequence / CP tokens (x 2 for DPO /
  ORPO pairs). What a micro-batch keeps from its forward to its backward counts once per micro-batch in flight,
  what one backward needs (a recomputation's working set, transient gradients, the loss on the last stage) once:
  the first pipeline rank keeps 1F1B's ``min(micro-batches, PP)`` micro-batches in flight; on torch-xla (the
  lockstep schedule, :mod:`nxd_lc.pipeline.lockstep`) each stage ``k`` of ``S = PP x V`` keeps ``min(m, S - k)``
  of its own layers (the same at ``V = 1``).
* a frozen **reference** copy of the parameters for DPO without precomputed reference log-probabilities.

Not counted: allocator fragmentation, the runtime's own memory (CUDA context, Neuron runtime), communication
buffers, the data loader; the MoE dispatch buffers are counted as a dense MLP. Hence the thresholds: above the
device's memory the config is refused, above :data:`WARN_FRACTION` of it a warning names the keys to change.

The device memory is known for ``trainer.accelerator: cpu`` (the host's RAM, shared by the node's
``trainer.devices`` ranks), for CUDA (``gpu``, or ``auto`` resolving to it on this host: the device's total
memory) and for ``xla`` / ``neuron`` (and ``auto`` resolving to a Neuron device): the HBM of the NeuronCore a rank
runs on, 16 GiB on Trn1 and 12 GiB x lnc on Trn2 (:func:`neuron_core_memory`; off Trainium a config for torch-xla
is judged as on Trn1 unless ``trainer.lnc`` is 2). For ``auto`` resolving to the CPU (a config written for an
accelerator, judged on another host) it is unknown and the estimate is only reported.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from nxd_lc.app.validation.device_memory import NEURON_HBM_PER_CORE, device_memory, neuron_core_memory
from nxd_lc.config.access import data_parallel_size, num_microbatches, seq_length
from nxd_lc.config.schema import NxdConfig
from nxd_lc.models.common.memory_plan import (
    PLAN_MLP_CHUNK,
    PlanShape,
    choose_memory_plan,
    estimate_split,
    offload_allowed,
    recompute_parts,
)
from nxd_lc.runtime.device import has_device_memory

__all__ = ["NEURON_HBM_PER_CORE", "WARN_FRACTION", "Architecture", "MemoryEstimate", "architecture", "device_memory",
           "estimate_memory", "layer_kinds", "neuron_core_memory", "optimizer_state_bytes",
           "position_problems", "rank_tensors", "size_text", "state_bytes"]

#: above this share of the device's memory the estimate is a warning (above 1: a config error)
WARN_FRACTION = 0.9
_GIB = 2**30
_BUCKET_BYTES = 64 * 2**20  # NxDOptimizer's step bucket of fp32 working data
#: per optimizer: (state tensors of the parameter's size, scalar state tensors) -- amsgrad / momentum / centered
#: and Adafactor's factored statistics are added in :func:`optimizer_state_bytes`
_STATE_TENSORS: dict[str, tuple[int, int]] = {
    "adamw": (2, 1), "adamw_fp32OptState": (2, 1), "adam": (2, 1), "adamax": (2, 1), "adadelta": (2, 1),
    "rprop": (2, 1), "adagrad": (1, 1), "rmsprop": (1, 1), "sgd": (0, 0), "novograd": (1, 0), "adafactor": (0, 1),
}


@dataclasses.dataclass(frozen=True)
class Architecture:
    """The sizes of the decoder a run builds (HF names); ``vocab_size`` None when only the tokenizer knows it
    (``model_source: megatron``)."""

    vocab_size: int | None
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    tied: bool
    norm_bias: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    gelu: bool = False
    learned_positions: int = 0
    vocab_multiple: int = 1
    experts: int = 0
    moe_frequency: int = 1


@dataclasses.dataclass(frozen=True)
class _Tensor:
    """``count`` parameters of ``shape`` on this rank; ``fp32``: kept in fp32 whatever the mode; ``expert``:
    sharded over expert-DP under ZeRO-1; ``trainable``: has gradients and optimizer state."""

    shape: tuple[int, ...]
    count: int = 1
    fp32: bool = False
    expert: bool = False
    trainable: bool = True

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one rank holds while training (module docstring), and the device memory it is judged against.

    Attributes:
        parameters, gradients, optimizer_state, master_weights, step_buffers, activations, reference: bytes.
        pipeline_rank: the pipeline rank the numbers are of (the largest total).
        device_bytes: the memory available to one rank (None: unknown); device: what it is, in words.
        host_offload: activation bytes the rank keeps in host memory (``model.activations_offload``; not in
            ``total``; on ``trainer.accelerator: cpu`` they are counted in ``activations`` instead).
    """

    parameters: int
    gradients: int
    optimizer_state: int
    master_weights: int
    step_buffers: int
    activations: int
    reference: int
    pipeline_rank: int
    device_bytes: int | None
    device: str
    notes: tuple[str, ...] = ()
    host_offload: int = 0

    @property
    def total(self) -> int:
        """Bytes per rank."""
        return (self.parameters + self.gradients + self.optimizer_state + self.master_weights + self.step_buffers
                + self.activations + self.reference)

    def describe(self) -> list[str]:
        """The dry run's lines: the total, its parts, and the share of the device's memory (or that it is
        unknown)."""
        parts = [("parameters", self.parameters), ("gradients", self.gradients),
                 ("optimizer state", self.optimizer_state), ("master weights", self.master_weights),
                 ("optimizer step buffers", self.step_buffers), ("activations", self.activations),
                 ("reference model", self.reference)]
        where = f" (pipeline rank {self.pipeline_rank}, the largest)" if self.pipeline_rank else ""
        lines = [f"memory estimate per rank{where}: {size_text(self.total)} = "
                 + " + ".join(f"{name} {size_text(b)}" for name, b in parts if b)]
        if self.device_bytes:
            lines.append(f"  {100 * self.total / self.device_bytes:.0f}% of {self.device} "
                         f"({size_text(self.device_bytes)} per rank)")
        else:
            lines.append(f"  device memory unknown ({self.device}): not judged")
        if self.host_offload:
            lines.append(f"  activations offloaded to host memory: {size_text(self.host_offload)} per rank")
        return lines + [f"  {n}" for n in self.notes]


def size_text(n: int) -> str:
    """``n`` bytes in GiB (MiB below 1 GiB), for messages."""
    return f"{n / _GIB:.2f} GiB" if n >= _GIB else f"{n / 2**20:.1f} MiB"


def _int(hf: Mapping[str, Any], key: str, default: int | None = None) -> int | None:
    value = hf.get(key, default)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def architecture(cfg: NxdConfig, hf: Mapping[str, Any] | None) -> Architecture | None:
    """The run's :class:`Architecture` from its config.json dict (:func:`nxd_lc.models.config_json.read_model_json`)
    with the ``model:`` overrides the build applies, or None when a size is missing or not a positive integer."""
    if not isinstance(hf, Mapping):
        return None
    m = cfg.model
    hf = dict(hf)
    if cfg.model_source != "megatron":
        if isinstance(m.hf_config_overrides, Mapping):
            hf.update(m.hf_config_overrides)
        hf.update({k: v for k, v in (("num_hidden_layers", m.num_layers), ("hidden_size", m.hidden_size))
                   if v is not None and v != -1})
    moe = hf.get("model_type") == "mixtral"
    if moe and m.moe is not None:
        from nxd_lc.moe.config import moe_hf_overrides

        hf.update(moe_hf_overrides(m.moe))
    sizes = {k: _int(hf, k) for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                      "intermediate_size")}
    if None in sizes.values():
        return None
    heads, hidden = sizes["num_attention_heads"], sizes["hidden_size"]
    kv, head_dim = _int(hf, "num_key_value_heads", heads), _int(hf, "head_dim") or hidden // heads
    vocab = _int(hf, "vocab_size")
    if kv is None or head_dim < 1 or (vocab is None and cfg.model_source != "megatron"):
        return None
    from nxd_lc.models.common.family import DecoderOptions, decoder_options

    try:
        opts = decoder_options(_Attrs({"model_type": "llama", "rms_norm_eps": 1e-6, **hf,
                                       "num_hidden_layers": sizes["num_hidden_layers"]}))
    except (ValueError, TypeError):
        opts = DecoderOptions()
    experts = (_int(hf, "num_local_experts") or 0) if moe else 0
    return Architecture(
        vocab_size=vocab, hidden=hidden, layers=sizes["num_hidden_layers"], heads=heads, kv_heads=kv,
        head_dim=head_dim, intermediate=sizes["intermediate_size"], tied=bool(hf.get("tie_word_embeddings")),
        norm_bias=opts.norm == "layernorm", qkv_bias=opts.qkv_bias, o_bias=opts.o_bias, mlp_bias=opts.mlp_bias,
        qk_norm=opts.qk_norm, gelu=opts.activation == "gelu",
        learned_positions=(_int(hf, "max_position_embeddings") or 0) if opts.position_embedding != "rope" else 0,
        vocab_multiple=max(1, int(opts.make_vocab_size_divisible_by)), experts=experts,
        moe_frequency=max(1, int(getattr(m.moe, "frequency", 1) or 1)) if m.moe is not None else 1)


def position_problems(cfg: NxdConfig, hf: Mapping[str, Any] | None) -> list[str]:
    """``model.encoder_seq_length`` beyond the model's positions (``model.max_position_embeddings``, else
    config.json's): the model build refuses it (:func:`nxd_lc.models.hf_config.build_llama_config`), so validation
    does, before anything is built."""
    m = cfg.model
    if cfg.model_source == "megatron" or not isinstance(hf, Mapping) or m.encoder_seq_length in (None, -1):
        return []
    if m.max_position_embeddings not in (None, -1):
        limit, source = m.max_position_embeddings, "model.max_position_embeddings"
    else:
        overrides = m.hf_config_overrides if isinstance(m.hf_config_overrides, Mapping) else {}
        limit, source = overrides.get("max_position_embeddings", hf.get("max_position_embeddings")), \
            f"max_position_embeddings of {m.model_config}"
    if isinstance(limit, int) and not isinstance(limit, bool) and m.encoder_seq_length > limit:
        return [f"model.encoder_seq_length: {m.encoder_seq_length} exceeds {source} ({limit}); set "
                f"model.max_position_embeddings >= {m.encoder_seq_length} or shorten model.encoder_seq_length"]
    return []


class _Attrs:
    """A config.json dict read as attributes (what :func:`decoder_options` reads)."""

    def __init__(self, d: Mapping[str, Any]) -> None:
        self.__dict__.update(d)


def _layer_tensors(a: Architecture, cfg: NxdConfig, moe: bool, tp: int, ep: int) -> list[_Tensor]:
    """The parameters of one decoder layer on this rank: a mixture-of-experts layer when ``moe``, else dense."""
    ds, h, hd = cfg.distributed_strategy, a.hidden, a.head_dim
    norm = [_Tensor((h,))] + ([_Tensor((h,))] if a.norm_bias else [])
    kv_local = a.kv_heads * (ds.kv_replicator if a.kv_heads < tp else 1) // tp
    q_rows, kv_rows = a.heads * hd // tp, kv_local * hd
    out = norm + norm
    if cfg.model.qkv_linear and cfg.model.fuse_qkv:
        out += [_Tensor((q_rows + 2 * kv_rows, h))] + ([_Tensor((q_rows + 2 * kv_rows,))] if a.qkv_bias else [])
    else:
        out += [_Tensor((r, h)) for r in (q_rows, kv_rows, kv_rows)]
        out += [_Tensor((r,)) for r in (q_rows, kv_rows, kv_rows)] if a.qkv_bias else []
    out += [_Tensor((h, q_rows))] + ([_Tensor((h,))] if a.o_bias else [])
    out += [_Tensor((hd,)), _Tensor((hd,))] if a.qk_norm else []
    i_local = a.intermediate // tp
    if moe:
        e = a.experts // ep
        return out + [_Tensor((a.experts, h), fp32=True), _Tensor((e, 2 * i_local, h), expert=True),
                      _Tensor((e, h, i_local), expert=True)]
    up = i_local if a.gelu else 2 * i_local
    out += [_Tensor((up, h)), _Tensor((h, i_local))]
    return out + ([_Tensor((up,)), _Tensor((h,))] if a.mlp_bias else [])


def _lora(tensors: list[_Tensor], a: Architecture, cfg: NxdConfig, tp: int, layers: int) -> list[_Tensor]:
    """Base tensors frozen, plus the adapters ``lora_A [r, in(/tp)]`` / ``lora_B [out(/tp), r]`` of every target
    module of the ``layers`` decoder layers (:mod:`nxd_lc.layers.lora`)."""
    peft = cfg.model_alignment_strategy.peft if cfg.model_alignment_strategy is not None else None
    if peft is None:
        return tensors
    r, h, hd = peft.lora_rank, a.hidden, a.head_dim
    kv_local = a.kv_heads * (cfg.distributed_strategy.kv_replicator if a.kv_heads < tp else 1) // tp
    i_local = a.intermediate // tp
    shapes = {"qkv_proj": ((r, h), ((a.heads // tp + 2 * kv_local) * hd, r)),
              "o_proj": ((r, a.heads * hd // tp), (h, r)),
              "gate_up_proj": ((r, h), ((i_local if a.gelu else 2 * i_local), r)),
              "down_proj": ((r, i_local), (h, r))}
    frozen = [dataclasses.replace(t, trainable=False) for t in tensors]
    adapters = [_Tensor(s, count=layers) for name in peft.target_modules if name in shapes for s in shapes[name]]
    return frozen + adapters


def _rank_part(a: Architecture, cfg: NxdConfig, pipeline_rank: int) -> tuple[list[range], bool, bool]:
    """``(the decoder-layer ranges of the rank's stages, holds the embedding, holds the head)`` of pipeline rank
    ``pipeline_rank`` (:func:`nxd_lc.pipeline.rank_model_part`'s split, as ranges: never enumerated).

    Raises:
        ValueError: a pipeline split that cannot be made (:func:`nxd_lc.pipeline.stage_layer_ranges`).
    """
    ds = cfg.distributed_strategy
    if ds.pipeline_model_parallel_size == 1:
        return [range(a.layers)], True, True
    from nxd_lc.pipeline import stage_layer_ranges, stages_of_rank

    ranges = stage_layer_ranges(a.layers, ds.pipeline_model_parallel_size, ds.virtual_pipeline_model_parallel_size,
                                cfg.model.pipeline_cuts)
    stages = stages_of_rank(pipeline_rank, ds.pipeline_model_parallel_size, ds.virtual_pipeline_model_parallel_size)
    return [ranges[s] for s in stages], 0 in stages, len(ranges) - 1 in stages


def layer_kinds(a: Architecture, ranges: list[range]) -> list[tuple[bool, int]]:
    """``[(moe, number of layers)]`` of the decoder layers in ``ranges``: the MoE layers are those whose index is a
    multiple of ``model.moe.frequency`` (:class:`~nxd_lc.moe.config`), counted in closed form, so the estimate's
    cost does not depend on the layer count (issue 40: 10^7 layers took gigabytes when enumerated)."""
    total = sum(len(r) for r in ranges)
    f = a.moe_frequency
    moe = sum(-(-r.stop // f) - -(-r.start // f) for r in ranges if len(r)) if a.experts else 0
    return [(kind, n) for kind, n in ((True, moe), (False, total - moe)) if n]


def rank_tensors(a: Architecture, cfg: NxdConfig, pipeline_rank: int = 0) -> list[_Tensor]:
    """The parameters one rank of pipeline rank ``pipeline_rank`` holds (module docstring), the decoder layers'
    per layer kind with their ``count`` (:func:`layer_kinds`).

    Raises:
        ValueError: a pipeline split that cannot be made (:func:`nxd_lc.pipeline.rank_model_part`).
    """
    ds = cfg.distributed_strategy
    tp, ep = ds.tensor_model_parallel_size, ds.expert_model_parallel_size
    ranges, embedding, head = _rank_part(a, cfg, pipeline_rank)
    out = [dataclasses.replace(t, count=t.count * n) for moe, n in layer_kinds(a, ranges)
           for t in _layer_tensors(a, cfg, moe, tp, ep)]
    out = _lora(out, a, cfg, tp, sum(len(r) for r in ranges))
    frozen = not (cfg.model_alignment_strategy is not None and cfg.model_alignment_strategy.peft is not None)
    if a.vocab_size is not None:
        mult = tp * a.vocab_multiple
        vocab_local = -(-a.vocab_size // mult) * mult // tp
        if embedding:
            out.append(_Tensor((vocab_local, a.hidden), trainable=frozen))
        if head and (not a.tied or not embedding):
            out.append(_Tensor((vocab_local, a.hidden), trainable=frozen))
    if embedding and a.learned_positions:
        out.append(_Tensor((a.learned_positions, a.hidden), trainable=frozen))
    if head:
        out += [_Tensor((a.hidden,), trainable=frozen)] * (2 if a.norm_bias else 1)
    return out


def optimizer_state_bytes(t: _Tensor, cfg: NxdConfig, numel: int, dtype_bytes: int) -> int:
    """Bytes of the optimizer state of one tensor ``t`` of which this rank steps ``numel`` elements (its ZeRO-1
    shard, or all), the state stored in ``dtype_bytes`` per element; scalar ``step`` counters are fp32."""
    o = cfg.model.optim
    full, scalars = _STATE_TENSORS.get(o.name, (2, 1))
    if o.name in ("adamw", "adamw_fp32OptState", "adam") and o.amsgrad:
        full += 1
    if o.name == "novograd":
        scalars += 1 + int(bool(o.amsgrad))  # per-tensor second moments (and their maximum); its step is an int
    if o.name in ("sgd", "rmsprop") and o.momentum:
        full += 1
    if o.name == "rmsprop" and o.centered:
        full += 1
    size = full * numel * dtype_bytes + scalars * 4
    if o.name == "adafactor":  # factored statistics of matrices (rows + columns), the full variance of vectors
        shape = t.shape if numel == t.numel else (numel,)
        factored = numel // shape[-1] + numel // shape[-2] if len(shape) > 1 else numel
        size += factored * dtype_bytes
    return size


def _zero1_share(cfg: NxdConfig, expert: bool) -> int:
    ds = cfg.distributed_strategy
    if not ds.zero1:
        return 1
    dp_cp = data_parallel_size(cfg) * ds.context_parallel_size
    return max(1, dp_cp // ds.expert_model_parallel_size) if expert else dp_cp


def state_bytes(tensors: list[_Tensor], cfg: NxdConfig) -> tuple[int, int, int, int, int]:
    """``(parameters, gradients, optimizer state, master weights, step buffers)`` bytes of ``tensors`` (one rank's,
    :func:`rank_tensors`) under the run's precision mode, optimizer and ZeRO-1 (module docstring)."""
    from nxd_lc.precision.policy import resolve_precision

    policy = resolve_precision(cfg)
    low = policy.low_precision_params
    param_b = policy.param_dtype.itemsize
    wrapped = low or cfg.distributed_strategy.zero1
    state_b = policy.optim_state_dtype.itemsize if wrapped else param_b
    persistent = wrapped and (policy.master_weights or not low)
    params = grads = state = master = stepped = 0
    for t in tensors:
        own_b = 4 if t.fp32 else param_b
        params += t.count * t.numel * own_b
        if not t.trainable:
            continue
        grad_b = 4 if (t.fp32 or policy.fp32_grad_acc) else own_b
        share = _zero1_share(cfg, t.expert)
        numel = -(-t.numel // share) if share > 1 else t.numel
        grads += t.count * t.numel * grad_b
        state += t.count * optimizer_state_bytes(t, cfg, numel, 4 if t.fp32 and not wrapped else state_b)
        master += t.count * numel * 4 if persistent else 0
        stepped += t.count * numel
    # the wrapper's step: fp32 working copies (bf16SR), fp32 gradient shards and fp32 state of one bucket at a time
    copies = int(not persistent) + int(_zero1_shards(cfg) or (low and not policy.fp32_grad_acc)) + int(state_b != 4)
    step = min(_BUCKET_BYTES, 4 * stepped) * copies if wrapped else 0
    return params, grads, state, master, step


def _zero1_shards(cfg: NxdConfig) -> bool:
    """Whether ZeRO-1 shards anything (gradients are then sliced into fp32 shards at the step)."""
    return cfg.distributed_strategy.zero1 and _zero1_share(cfg, False) > 1


def _activation_split(a: Architecture, cfg: NxdConfig, layers: int, head: bool,
                      full_layers: int | None = None) -> tuple[int, int, int, str | None]:
    """``(kept per micro-batch, once, offloaded to the host per micro-batch, note)`` activation bytes of a rank or
    stage holding ``layers`` decoder layers
    (and the final norm, head and loss when ``head``): :func:`~nxd_lc.models.common.memory_plan.estimate_split`
    for the configured recomputation; ``full_layers``: of them, those recomputed by ``block`` checkpointing (None:
    ``model.activations_checkpoint_num_layers``)."""
    from nxd_lc.precision.policy import resolve_precision

    m, ds = cfg.model, cfg.distributed_strategy
    tp, cp = ds.tensor_model_parallel_size, ds.context_parallel_size
    policy = resolve_precision(cfg)
    pairs = 2 if cfg.model_alignment_strategy is not None and (cfg.model_alignment_strategy.dpo is not None
                                                               or cfg.model_alignment_strategy.orpo is not None) else 1
    vocab = 0
    if a.vocab_size is not None:
        mult = tp * a.vocab_multiple
        vocab = -(-a.vocab_size // mult) * mult // tp
    kv_local = a.kv_heads * (ds.kv_replicator if a.kv_heads < tp else 1) // tp
    shape = PlanShape(tokens=max(1, pairs * cfg.data.micro_batch_size * (seq_length(cfg) or 0) // cp),
                      hidden=a.hidden, head_dim=a.head_dim, heads_local=max(1, a.heads // tp),
                      kv_heads_local=max(1, kv_local), intermediate_local=max(1, a.intermediate // tp),
                      vocab_local=vocab, layers=layers, tp=tp, sequence_parallel=ds.sequence_parallel and tp > 1,
                      element_size=(policy.autocast_dtype or policy.param_dtype).itemsize, head=head)
    plan, loss_chunk, note, parts = _plan_name(cfg)
    if m.activations_memory_budget is not None:
        chosen = choose_memory_plan(shape, m.activations_memory_budget, allow_offload=_offload_allowed(cfg),
                                    lazy=_runs_lockstep(cfg))
        plan, loss_chunk, parts = chosen.name, chosen.tiled_loss_chunk_size, None
    if plan == "block":
        n = min(layers, m.activations_checkpoint_num_layers or 0) if full_layers is None else full_layers
        full = estimate_split(dataclasses.replace(shape, layers=n), "full", loss_chunk)
        none_all = estimate_split(shape, "none", loss_chunk)
        none_n = estimate_split(dataclasses.replace(shape, layers=n), "none", loss_chunk)
        once = full[1] if n else none_all[1]
        return full[0] + none_all[0] - none_n[0], once, 0, note
    kept, once, host = estimate_split(shape, plan, loss_chunk, parts)
    return kept, once, host, note


def _rank_activations(a: Architecture, cfg: NxdConfig, pipeline_rank: int,
                      num_micro: int) -> tuple[int, int, str | None]:
    """Activation bytes of pipeline rank ``pipeline_rank`` at its peak on the device and in host memory (offload),
    and a note: the micro-batches in flight
    times what one keeps, plus what one backward needs once. In flight (``S = PP x V`` stages, ``m`` micro-batches):
    1F1B's ``min(m, PP - r)`` micro-batches of the rank's layers on eager devices; on torch-xla (the lockstep
    schedule, :func:`nxd_lc.pipeline.lockstep.lockstep_in_flight`) ``min(m, S - k)`` of stage ``k``'s layers for
    each stage ``k`` of the rank (the same at ``V = 1``)."""
    ds = cfg.distributed_strategy
    pp, virtual = ds.pipeline_model_parallel_size, ds.virtual_pipeline_model_parallel_size
    ranges, _, head = _rank_part(a, cfg, pipeline_rank)
    if pp == 1 or virtual == 1 or not _runs_lockstep(cfg):
        kept, once, host, note = _activation_split(a, cfg, sum(len(r) for r in ranges), head)
        in_flight = min(num_micro, pp - pipeline_rank) if pp > 1 else 1
        return in_flight * kept + once, in_flight * host, note
    from nxd_lc.pipeline import stage_layer_ranges, stages_of_rank
    from nxd_lc.pipeline.lockstep import lockstep_in_flight

    ranges = stage_layer_ranges(a.layers, pp, virtual, cfg.model.pipeline_cuts)
    stages = stages_of_rank(pipeline_rank, pp, virtual)
    full_left = cfg.model.activations_checkpoint_num_layers or 0  # block: the rank's first local layers
    total, once, note = 0, 0, None
    for k in stages:
        n = len(ranges[k])
        kept, stage_once, _, note = _activation_split(a, cfg, n, k == len(ranges) - 1,
                                                      full_layers=min(n, full_left))
        full_left = max(0, full_left - n)
        total += lockstep_in_flight(len(ranges), k, num_micro) * kept
        once = max(once, stage_once)
    return total + once, 0, note  # torch-xla: no offload


def _runs_lockstep(cfg: NxdConfig) -> bool:
    """Whether the run's pipeline takes the torch-xla lockstep schedule (``trainer.accelerator`` on torch-xla)."""
    from nxd_lc.runtime.device import is_lazy_config_accelerator

    return is_lazy_config_accelerator(str(cfg.trainer.accelerator))


def _offload_allowed(cfg: NxdConfig) -> bool:
    """Whether the run's planner may choose an offload plan (:func:`~nxd_lc.models.common.memory_plan.
    offload_allowed` on ``trainer.accelerator`` resolved on this host, with ``model.compile`` decided as the run
    decides it)."""
    from nxd_lc.app.build import decoder_compiled
    from nxd_lc.runtime.device import resolve_accelerator

    accelerator = str(cfg.trainer.accelerator)
    try:
        accelerator = resolve_accelerator(accelerator)
    except (ValueError, RuntimeError):  # reported by the device checks; the configured name is the best guess
        pass
    return offload_allowed(accelerator, decoder_compiled(cfg, accelerator))


def _plan_name(cfg: NxdConfig) -> tuple[str, int | None, str | None, frozenset[str] | None]:
    """The :mod:`~nxd_lc.models.common.memory_plan` plan that bounds the configured recomputation (module
    docstring), the tiled loss chunk, a note where the bound is loose, and a selective plan's recomputed parts."""
    m = cfg.model
    granularity, chunk = m.activations_checkpoint_granularity, m.tiled_loss_chunk_size
    if granularity == "full":
        if m.activations_checkpoint_method == "block" and m.activations_checkpoint_num_layers:
            return "block", chunk, None, None
        if m.activations_offload:
            return ("full_save_attention_offload" if m.activations_checkpoint_save_attention else "full_offload"), \
                chunk, None, None
        if m.activations_checkpoint_save_attention:  # with a tiled MLP: its untiled working set, an upper bound
            return "full_save_attention", chunk, None, None
        tiled = m.tiled_mlp_chunk_size is not None and m.tiled_mlp_chunk_size <= PLAN_MLP_CHUNK
        return ("full_tiled_mlp" if tiled else "full"), chunk, None, None
    if granularity == "selective":
        parts, unknown = recompute_parts(m.activations_checkpoint_recompute)
        note = (f"activations: {', '.join(unknown)} counted as not recomputed (an upper bound)" if unknown else None)
        return ("selective" if parts else "none"), chunk, note, parts
    return "none", chunk, None, None


def estimate_memory(cfg: NxdConfig, hf: Mapping[str, Any] | None) -> MemoryEstimate | None:
    """The :class:`MemoryEstimate` of a validated config (None when the architecture is unknown: no config.json).

    Raises:
        ValueError: a pipeline split or memory budget that cannot be made (validation reports those first).
    """
    a = architecture(cfg, hf)
    if a is None:
        return None
    ds = cfg.distributed_strategy
    pp = ds.pipeline_model_parallel_size
    try:
        mbs = num_microbatches(cfg.data.global_batch_size, cfg.data.micro_batch_size, data_parallel_size(cfg))
    except ValueError:
        mbs = 1
    best: MemoryEstimate | None = None
    device_bytes, device = device_memory(cfg)
    notes = [] if a.vocab_size is not None else [
        "the vocabulary is the tokenizer's (not read before launch): embedding and lm head not counted"]
    for rank in range(pp):
        tensors = rank_tensors(a, cfg, rank)
        params, grads, state, master, step = state_bytes(tensors, cfg)
        acts, host, note = _rank_activations(a, cfg, rank, mbs)
        if not has_device_memory(str(cfg.trainer.accelerator)):  # the host's memory is the device's: offload frees none
            acts, host = acts + host, 0
        dpo = cfg.model_alignment_strategy.dpo if cfg.model_alignment_strategy is not None else None
        reference = params if dpo is not None and not dpo.precompute_ref_log_probs else 0
        est = MemoryEstimate(params, grads, state, master, step, acts, reference, rank, device_bytes, device,
                             tuple(notes + ([note] if note else [])), host)
        if best is None or est.total > best.total:
            best = est
    return best
