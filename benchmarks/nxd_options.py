"""How the benchmark builds nxd_lc's side: the model, its memory configuration, and its loss.

nxd_lc runs with its best memory configuration, set through the same :class:`nxd_lc.config.schema.ModelConfig`
keys a training YAML uses and applied by the same call the trainer makes
(:func:`nxd_lc.models.common.checkpointing.apply_memory_techniques`):

* ``activations_checkpoint_granularity: full`` -- every decoder layer is recomputed in backward; only the layer
  inputs ``[1, L, H]`` are kept between forward and backward;
* ``tiled_loss_chunk_size`` -- the vocab-parallel cross-entropy never holds more than ``[chunk, V]`` logits;
* ``tiled_mlp_chunk_size`` -- the SwiGLU MLP runs ``chunk`` tokens at a time;
* ``fusions.flash_attention: true`` -- causal attention through ``scaled_dot_product_attention``'s fused kernel
  (no L x L tensor).

Any of these can be changed per run with ``--nxd-opts '{"tiled_loss_chunk_size": null, ...}'`` (JSON); the keys
are the ModelConfig field names plus ``flash_attention`` (``"compile": true`` compiles each decoder layer with
inductor, as ``model.compile`` does in training; ``"fusions": {...}`` picks kernels; ``"activations_memory_budget"``
lets the planner choose the memory keys). The benchmark default is ``compile: false`` (the trainer's is ``auto``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["NXD_BEST", "build_nxd_model", "nxd_loss"]

#: nxd_lc's best memory configuration (ModelConfig field names + flash_attention).
NXD_BEST: dict[str, Any] = {
    "activations_checkpoint_granularity": "full",
    "activations_checkpoint_recompute": None,
    "tiled_loss_chunk_size": 1024,
    "tiled_mlp_chunk_size": 4096,
    "flash_attention": True,
}


def build_nxd_model(hf_dir: str, opts: dict[str, Any], load_weights: bool = True, accelerator: str = "cpu",
                    tokens: int | None = None, element_size: int = 2) -> Any:
    """nxd_lc ``LlamaForCausalLM`` from ``<hf_dir>/config.json`` (+ its safetensors when ``load_weights``).

    Args:
        hf_dir: an HF checkpoint directory (``save_pretrained`` output).
        opts: overrides of :data:`NXD_BEST` (unknown keys are an error); ``fusions`` is a mapping of
            ``model.fusions`` keys (``rms_norm``, ``rope``, ``swiglu``, ``cross_entropy``: auto | torch | liger);
            ``compile`` true | false | auto; ``activations_memory_budget`` replaces the memory keys by the plan
            chosen for ``tokens`` (set the hand-picked keys to None with it, as the trainer requires).
        load_weights: False under FakeTensorMode (the values do not matter for a memory estimate).
        accelerator: the resolved ``trainer.accelerator`` the model will run on (``cpu`` / ``gpu``): decides the
            ``auto`` kernels and ``compile: auto``, as in training.
        tokens: micro batch x sequence length, needed with ``activations_memory_budget``.
        element_size: bytes per activation element the plan assumes (2 = bf16 compute).

    Returns:
        The model (fp32, CPU), kernels chosen, memory techniques applied, decoder layers compiled when asked.

    Raises:
        ValueError: an unknown option key (names the valid ones), or a bad option value (from
            ``apply_memory_techniques`` / the kernel and plan choices).
    """
    from nxd_lc.config.schema import FusionsConfig, ModelConfig
    from nxd_lc.models.common.compile import compile_backend, compile_decoder_layers, compile_enabled
    from nxd_lc.models.common.memory_plan import apply_kernels_and_memory
    from nxd_lc.models.hf_config import build_llama_config
    from nxd_lc.models.llama.hf_adapter import load_hf_weights
    from nxd_lc.models.llama.model import LlamaForCausalLM

    merged = {"compile": False, **NXD_BEST, **opts}
    valid = {f.name for f in dataclasses.fields(ModelConfig)} | {"flash_attention"}
    unknown = sorted(set(merged) - valid)
    if unknown:
        raise ValueError(f"--nxd-opts: unknown key(s) {unknown}; valid keys are ModelConfig fields "
                         f"and 'flash_attention'")
    flash = bool(merged.pop("flash_attention"))
    merged["fusions"] = FusionsConfig(**dict(merged.get("fusions") or {}))
    model_cfg = ModelConfig(model_config=hf_dir, **merged)
    model = LlamaForCausalLM(build_llama_config(hf_dir), flash_attention=flash)
    if load_weights:
        load_hf_weights(model, hf_dir)
    if model_cfg.activations_memory_budget is not None and tokens is None:
        raise ValueError("build_nxd_model: activations_memory_budget needs tokens (micro batch x length)")
    compiled = compile_enabled(model_cfg.compile, accelerator)
    apply_kernels_and_memory(model, model_cfg, accelerator=accelerator, compiled=compiled, tokens=tokens or 0,
                             element_size=element_size)  # a budget's plan is kept as model.memory_plan
    if compiled:  # the trainer's regional compilation (inductor on CPU / CUDA)
        compile_decoder_layers(model, compile_backend(accelerator), cuda_graphs=model_cfg.enable_cuda_graph)
    return model


def nxd_loss(model: Any, batch: dict[str, Any]) -> Any:
    """The training loss of one micro-batch, as ``nxd_lc.lightning.module`` computes it: the token mean over all
    CP ranks (:func:`nxd_lc.context.sharding.context_parallel_loss`, the plain mean without CP).

    Args:
        batch: ``input_ids``, ``labels`` (shifted, -100 = no loss), ``position_ids``, all int64 [1, L(/cp)].

    Returns:
        fp32 scalar tensor (differentiable).
    """
    from nxd_lc.context.sharding import context_parallel_loss

    loss_sum, num_tokens = model.loss(batch["input_ids"], batch["labels"], batch["position_ids"])
    return context_parallel_loss(loss_sum, num_tokens)
