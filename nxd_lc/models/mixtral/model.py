"""Mixtral decoder (HF ``MixtralForCausalLM`` architecture, Jiang et al. 2024, arXiv:2401.04088): the Llama
decoder of :mod:`nxd_lc.models.llama.model` (attention, norms, RoPE, embedding, LM head, tensor / sequence
parallelism, checkpointing) with :class:`~nxd_lc.moe.layer.MoE` feed-forward blocks.

Layer ``i`` is a mixture-of-experts layer when ``i % frequency == 0`` (0-based, as NxDT's HF Mixtral; frequency
1 = every layer, HF Mixtral), else a dense :class:`~nxd_lc.models.common.mlp.LlamaMLP` of the config's
``intermediate_size``. Module names: ``layers.N.mlp.router.weight`` [E, H] and
``layers.N.mlp.experts.{gate_up_proj [E/ep, 2I/tp, H], down_proj [E/ep, H, I/tp]}`` (see
:mod:`nxd_lc.moe.layer`).

Loss: ``mean token cross-entropy + router_aux_loss_coef * aux`` when ``output_router_logits`` (transformers'
``MixtralForCausalLM``), with ``aux`` the Switch/Mixtral load-balancing loss pooled over every MoE layer's
tokens of the micro-batch (:func:`~nxd_lc.moe.routing.load_balancing_loss`). NxD's own loss module divides that
value by ``top_k``; nxd_lc follows transformers, so a coefficient tuned on NxD corresponds to ``coef / top_k``
here. :meth:`loss` folds the term into the summed loss (``+ coef * aux * num_tokens``) so that every consumer of
``(loss_sum, num_tokens)`` gets the same mean.

Pipeline parallelism: the routing statistics of the MoE layers so far travel between stages beside the hidden
states (``[assignments (E), affinity sums (E), tokens]`` fp32, ``pipeline_statistics_size = 2E + 1``; the
affinity sums carry gradients back), so the last stage computes the same pooled loss as one process.

Context parallelism: each CP rank routes its own tokens (a capacity factor limits each expert per CP rank's
tokens, as per EP / DP rank); the statistics are summed over the CP group before the loss (forward and backward,
:func:`~nxd_lc.distributed.mappings.sum_over_context_parallel_region`), so the load-balancing term is that of
the whole sequence and its gradient reaches every CP rank's router.

Not supported yet (constructor errors): router jitter noise and sliding-window attention.
"""

from __future__ import annotations

import functools
from collections.abc import Collection
from typing import Any

import torch
from torch import nn
from transformers import MixtralConfig

from nxd_lc.distributed import parallel_state
from nxd_lc.distributed.mappings import sum_over_context_parallel_region
from nxd_lc.layers.linear import InitMethod
from nxd_lc.models.common.loss import causal_lm_loss_from_hidden
from nxd_lc.models.llama.model import LlamaForCausalLM, normal_init
from nxd_lc.moe.config import MoEOptions
from nxd_lc.moe.layer import MoE
from nxd_lc.moe.routing import RouterStats, load_balancing_loss

__all__ = ["MixtralForCausalLM"]


class MixtralForCausalLM(LlamaForCausalLM):
    """Tensor / sequence / expert-parallel Mixtral causal LM from an HF :class:`MixtralConfig`.

    Args:
        config: HF Mixtral config (``num_local_experts``, ``num_experts_per_tok``, ``router_aux_loss_coef``,
            ``output_router_logits`` are read from it).
        moe: :class:`MoEOptions`.
        keep_layers, keep_embedding, keep_head: this rank's part under pipeline parallelism (as Llama).
        Other arguments: as :class:`~nxd_lc.models.llama.model.LlamaForCausalLM`.

    Raises:
        ValueError: a setting not supported yet (module docstring), ``frequency`` < 1, or sizes that cannot be
            sharded (``num_local_experts`` over EP, the intermediate size over TP).
    """

    def __init__(self, config: MixtralConfig, *, moe: MoEOptions | None = None, sequence_parallel: bool = False,
                 keep_layers: Collection[int] | None = None, keep_embedding: bool = True, keep_head: bool = True,
                 **kwargs: Any) -> None:
        self.moe_options = moe or MoEOptions()
        problems = []
        if self.moe_options.frequency < 1:
            problems.append(f"model.moe.frequency must be >= 1, got {self.moe_options.frequency}")
        if float(getattr(config, "router_jitter_noise", 0.0) or 0.0) != 0.0:
            problems.append(f"router_jitter_noise {config.router_jitter_noise} in the Mixtral config is not "
                            "supported yet; set it to 0")
        if getattr(config, "sliding_window", None) is not None:
            problems.append(f"sliding_window {config.sliding_window} in the Mixtral config is not supported yet "
                            "(full causal attention only); set it to null")
        if problems:
            raise ValueError("; ".join(problems))
        if not hasattr(config, "attention_bias"):  # Mixtral's attention has no biases
            config.attention_bias = False
        self.num_experts = int(config.num_local_experts)
        self.top_k = int(config.num_experts_per_tok)
        self.output_router_logits = bool(config.output_router_logits)
        self.router_aux_loss_coef = float(config.router_aux_loss_coef)
        self.router_stats: RouterStats | None = None
        self.pipeline_statistics_size = 2 * self.num_experts + 1
        super().__init__(config, sequence_parallel=sequence_parallel, keep_layers=keep_layers,
                         keep_embedding=keep_embedding, keep_head=keep_head, **kwargs)

    def is_moe_layer(self, index: int) -> bool:
        """Whether decoder layer ``index`` (0-based) has a mixture-of-experts block."""
        return index % self.moe_options.frequency == 0

    def build_mlp(self, index: int, config: Any, sequence_parallel: bool, init_method: InitMethod,
                  layer_kw: dict[str, Any]) -> nn.Module | None:
        """:class:`MoE` for MoE layers (:meth:`is_moe_layer`), None (a dense LlamaMLP) otherwise."""
        if not self.is_moe_layer(index):
            return None
        o = self.moe_options
        return MoE(config.hidden_size, config.intermediate_size, self.num_experts, self.top_k,
                   capacity_factor=o.capacity_factor, dropless=o.dropless,
                   normalize_top_k_affinities=o.normalize_top_k_affinities, sequence_parallel=sequence_parallel,
                   init_method=init_method, dtype=layer_kw["dtype"], device=layer_kw["device"],
                   output_init_method=functools.partial(normal_init, self.options.output_init_std))

    def hidden_states(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """As :meth:`LlamaForCausalLM.hidden_states`; the MoE layers' routing statistics of this call are kept in
        ``router_stats`` (summed over layers)."""
        self.router_stats = None
        return super().hidden_states(*args, **kwargs)

    def collect_layer_statistics(self, out: torch.Tensor | tuple[torch.Tensor, Any]) -> torch.Tensor:
        """Keep a MoE layer's :class:`RouterStats` (summed into ``router_stats``); return its hidden states."""
        if not isinstance(out, tuple):
            return out
        h, stats = out
        self.router_stats = stats if self.router_stats is None else self.router_stats + stats
        return h

    def begin_pipeline_stage(self, carried: torch.Tensor | None) -> None:
        """Start a stage's ``router_stats`` from the previous stages' ``[assignments, affinity sums, tokens]``."""
        self.router_stats = None if carried is None else RouterStats.from_flat(carried, self.num_experts)

    def end_pipeline_stage(self) -> torch.Tensor:
        """This stage's accumulated ``router_stats`` packed as [2E + 1] fp32 for the next stage.

        Raises:
            RuntimeError: no MoE layer ran in this or an earlier stage (layer 0 always is one).
        """
        if self.router_stats is None:
            raise RuntimeError("pipeline stage: no mixture-of-experts layer ran before the end of the stage")
        return self.router_stats.flat()

    def add_auxiliary_loss(self, loss_sum: torch.Tensor, num_tokens: torch.Tensor) -> torch.Tensor:
        """``loss_sum + router_aux_loss_coef * aux * num_tokens`` when ``output_router_logits`` and MoE layers ran
        (module docstring), else ``loss_sum``."""
        if not self.output_router_logits or self.router_stats is None:
            return loss_sum
        return loss_sum + self.router_aux_loss_coef * self.aux_loss() * num_tokens.to(loss_sum.dtype)

    def aux_loss(self) -> torch.Tensor:
        """The load-balancing loss of the last forward's MoE layers (0-dim fp32, differentiable).

        Raises:
            RuntimeError: no forward with MoE layers ran since the model was built.
        """
        if self.router_stats is None:
            raise RuntimeError("aux_loss: no mixture-of-experts layer ran; call hidden_states / forward / loss first")
        s = self.router_stats
        if parallel_state.get_context_parallel_world_size() > 1:  # the whole sequence's statistics
            s = RouterStats.from_flat(sum_over_context_parallel_region(s.flat()), self.num_experts)
        return load_balancing_loss(s, self.num_experts)

    def loss(self, input_ids: torch.Tensor, labels: torch.Tensor, position_ids: torch.Tensor | None = None,
             ignore_index: int = -100, segment_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(loss_sum, num_tokens)`` as :meth:`LlamaForCausalLM.loss`, with ``router_aux_loss_coef * aux *
        num_tokens`` added to ``loss_sum`` when ``output_router_logits`` (module docstring)."""
        hidden = self.hidden_states(input_ids, position_ids, segment_ids)
        loss_sum, num_tokens = causal_lm_loss_from_hidden(self, hidden, labels, ignore_index)
        return self.add_auxiliary_loss(loss_sum, num_tokens), num_tokens
