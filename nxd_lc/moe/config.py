"""NxDT's ``model.moe`` keys and ``distributed_strategy.expert_model_parallel_size``: validation and resolution.

A mixture-of-experts model is selected by its HF config.json (``model_type: mixtral``); ``model.moe`` then sets
what config.json does not say (``frequency``, ``capacity_factor``, ``dropless``, ``normalize_top_k_affinities``)
and overrides what it does (``num_experts`` -> ``num_local_experts``, ``top_k`` -> ``num_experts_per_tok``,
``output_router_logits``, ``router_aux_loss_coef``), as NxDT's HF Mixtral model writes its ``moe`` keys into the
HF config. A key left null keeps config.json's value. Without ``model.moe`` a Mixtral config.json trains as
transformers' ``MixtralForCausalLM`` (every layer MoE, no token dropping).

Dispatch (NxDT's comment in its Mixtral examples): ``dropless: true`` never drops a token; ``dropless: false``
with a ``capacity_factor`` > 0 drops the tokens beyond ``ceil(cf * T * k / E)`` per expert; ``dropless: false``
without a capacity factor (null or <= 0) computes every routed token (NxDT's ``all_experts`` path), which is
dropless too.

``router_activation``, ``sinkhorn_iterations`` and ``sinkhorn_tol`` belong to NxD's Sinkhorn router (not supported
yet): NxD's top-k router (``neuronx_distributed.modules.moe.routing.RouterTopK``) always takes softmax affinities,
so with ``routing_algorithm: top_k`` they change nothing there or here (a ``sigmoid`` is logged as such).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from nxd_lc.config.schema import MoEConfig, NxdConfig

log = logging.getLogger(__name__)

__all__ = ["MOE_MODEL_TYPES", "MoEOptions", "expert_parallel_problems", "moe_hf_overrides", "moe_options",
           "moe_problems"]

#: config.json model types whose feed-forward blocks are mixtures of experts.
MOE_MODEL_TYPES = ("mixtral",)

#: ``model.moe`` key -> the HF Mixtral config.json field it overrides.
_HF_FIELDS = {"num_experts": "num_local_experts", "top_k": "num_experts_per_tok",
              "output_router_logits": "output_router_logits", "router_aux_loss_coef": "router_aux_loss_coef"}


@dataclass(frozen=True)
class MoEOptions:
    """NxDT's ``model.moe`` keys that are not in the HF config.json (defaults: HF Mixtral's behaviour).

    Attributes:
        frequency: every ``frequency``-th layer (0-based index divisible by it) is a MoE layer.
        capacity_factor: slots per expert relative to a uniform load; None / <= 0: no limit.
        dropless: never drop tokens (overrides ``capacity_factor``).
        normalize_top_k_affinities: renormalise the kept top-k affinities (Mixtral: true).
    """

    frequency: int = 1
    capacity_factor: float | None = None
    dropless: bool = True
    normalize_top_k_affinities: bool = True


def is_moe_model(hf: Mapping[str, Any] | None) -> bool:
    """Whether an HF config.json dict describes a mixture-of-experts model (:data:`MOE_MODEL_TYPES`)."""
    return (hf or {}).get("model_type") in MOE_MODEL_TYPES


def moe_hf_overrides(moe: MoEConfig | None) -> dict[str, Any]:
    """The config.json fields ``model.moe`` sets (its non-null keys of :data:`_HF_FIELDS`), for
    :func:`nxd_lc.models.hf_config.build_llama_config`'s ``hf_config_overrides``."""
    if moe is None:
        return {}
    return {field: getattr(moe, key) for key, field in _HF_FIELDS.items() if getattr(moe, key) is not None}


def moe_options(moe: MoEConfig | None) -> MoEOptions:
    """:class:`MoEOptions` of ``model.moe`` (HF Mixtral's behaviour when None): a
    ``capacity_factor`` only limits experts when ``dropless`` is false and it is > 0 (module docstring)."""
    if moe is None:
        return MoEOptions()
    if moe.router_activation != "softmax" and moe.routing_algorithm == "top_k" and os.environ.get("RANK", "0") == "0":
        log.warning("model.moe.router_activation: %s applies to the sinkhorn router only; the top_k router uses "
                    "softmax affinities, as NxD's RouterTopK does", moe.router_activation)
    cf = moe.capacity_factor if (not moe.dropless and moe.capacity_factor is not None
                                 and moe.capacity_factor > 0) else None
    return MoEOptions(frequency=moe.frequency, capacity_factor=cf, dropless=cf is None,
                      normalize_top_k_affinities=moe.normalize_top_k_affinities)


def moe_problems(cfg: NxdConfig, hf: Mapping[str, Any] | None) -> list[str]:
    """Problems of ``model.moe`` against the model config.json ``hf`` (None: not readable; only the keys' own
    values are checked then), each naming the key and the fix; ``not supported yet`` for NxDT values nxd_lc does
    not implement (sinkhorn routing, MoE dropout) and for MoE with ``model.compile`` or a DPO / ORPO objective
    (their losses would drop the load-balancing term)."""
    moe, p = cfg.model.moe, []
    if hf is not None and moe is not None and not is_moe_model(hf):
        p.append(f"model.moe: {cfg.model.model_config} has model_type {hf.get('model_type', 'llama')!r}, a dense "
                 f"model; point model.model_config at a mixture-of-experts config.json (model_type "
                 f"{' / '.join(MOE_MODEL_TYPES)}) or remove model.moe")
        return p
    if moe is not None:
        if moe.frequency < 1:
            p.append(f"model.moe.frequency: must be >= 1 (every n-th layer is a MoE layer), got {moe.frequency}")
        if moe.routing_algorithm != "top_k":
            p.append(f"not supported yet: model.moe.routing_algorithm={moe.routing_algorithm!r} (only top_k; "
                     "NxDT's HF Mixtral implements top_k only as well)")
        if moe.router_activation not in ("softmax", "sigmoid"):
            p.append(f"model.moe.router_activation: {moe.router_activation!r} is not one of softmax, sigmoid")
        if moe.dropout != 0.0:
            p.append(f"not supported yet: model.moe.dropout={moe.dropout} (NxDT's HF Mixtral passes it as attention "
                     "dropout); set it to 0.0")
    if hf is None or not is_moe_model(hf):
        return p
    for field, value in moe_hf_overrides(moe).items():  # model.moe wins (NxDT); a disagreement is said, not silent
        if field in hf and hf[field] != value and os.environ.get("RANK", "0") == "0":
            key = next(k for k, f in _HF_FIELDS.items() if f == field)
            log.warning("model.moe.%s: %r overrides %s=%r of %s (model.moe wins, as in NxDT); remove one of the "
                        "two if they are not meant to differ", key, value, field, hf[field], cfg.model.model_config)
    experts = (moe.num_experts if moe and moe.num_experts is not None else hf.get("num_local_experts"))
    top_k = (moe.top_k if moe and moe.top_k is not None else hf.get("num_experts_per_tok"))
    where = "model.moe.num_experts" if moe and moe.num_experts is not None else \
        f"num_local_experts of {cfg.model.model_config}"
    if not isinstance(experts, int) or experts < 1:
        p.append(f"{where}: the number of experts must be an int >= 1, got {experts!r}")
        return p
    if not isinstance(top_k, int) or not 1 <= top_k <= experts:
        key = "model.moe.top_k" if moe and moe.top_k is not None else f"num_experts_per_tok of {cfg.model.model_config}"
        p.append(f"{key}: experts per token must be an int in [1, {experts}] (num_experts), got {top_k!r}")
    ds = cfg.distributed_strategy
    ep = ds.expert_model_parallel_size
    if ep >= 1 and experts % ep:
        p.append(f"distributed_strategy.expert_model_parallel_size: {experts} experts ({where}) are not divisible "
                 f"by EP {ep}; choose an EP that divides the number of experts")
    align = cfg.model_alignment_strategy
    if align is not None and (align.dpo is not None or align.orpo is not None):
        p.append("not supported yet: model_alignment_strategy dpo / orpo with a mixture-of-experts model (the "
                 "preference losses do not add the load-balancing term); use sft or a dense model")
    if cfg.model.compile is True:  # auto stays eager with MoE layers (nxd_lc.app.validation.parallel.compile_blocker)
        p.append("not supported yet: model.compile with mixture-of-experts layers (token dispatch reads expert "
                 "loads on the host); set model.compile false")
    return p


def expert_parallel_problems(cfg: NxdConfig, hf: Mapping[str, Any] | None, data_parallel: int) -> list[str]:
    """``distributed_strategy.expert_model_parallel_size`` (EP): >= 1, dividing DP (EP is carved from the
    data-parallel ranks, NxD's layout), and > 1 only for a mixture-of-experts model."""
    ep = cfg.distributed_strategy.expert_model_parallel_size
    key = "distributed_strategy.expert_model_parallel_size"
    if ep < 1:
        return [f"{key}: must be >= 1, got {ep}"]
    p = []
    if ep > 1 and data_parallel % ep:
        p.append(f"{key}: {ep} must divide the data-parallel size {data_parallel} (world / (TP x PP x CP)); EP "
                 "ranks are carved from the DP ranks, as in NxD")
    if ep > 1 and hf is not None and not is_moe_model(hf):
        p.append(f"{key}: {ep} needs a mixture-of-experts model (model_type {' / '.join(MOE_MODEL_TYPES)}); "
                 f"{cfg.model.model_config} is {hf.get('model_type', 'llama')!r}; set it to 1")
    return p
