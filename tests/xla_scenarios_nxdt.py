"""NxDT's example configs trained shrunk through ``train.py``'s path on the multi-device XLA test bed (issue 39).

:func:`example_job` runs one composed example (the file unchanged, shrinking overrides) in a device thread of
:mod:`xla_testbed` through :func:`xla_scenarios.nxdt_job` (``nxd_lc.app.run.run``, the Lightning Trainer, the
file's precision mode) and adds the parallel layout the run actually built (from nxd_lc's parallel state), so that
a test can tell a run at the shrunk layout from one that silently fell back to another.

:func:`pretrained_checkpoint` writes the checkpoint NxDT's alignment examples start from
(``exp_manager.resume_from_checkpoint`` + ``model.weight_init_only``): the example's own model, built on CPU in
gloo processes (``tests/dist_utils.run_distributed``) from another seed than the runs', saved in nxd_lc's
checkpoint format, once per TP layout (a LoRA run cannot re-shard its starting checkpoint).
"""

from __future__ import annotations

import threading
from typing import Any


def _layout() -> dict[str, int]:
    """TP, PP, CP, EP and DP of this rank's nxd_lc parallel state."""
    from nxd_lc.distributed import parallel_state as ps

    return {"tp": ps.get_tensor_model_parallel_world_size(), "pp": ps.get_pipeline_model_parallel_world_size(),
            "cp": ps.get_context_parallel_world_size(), "ep": ps.get_expert_model_parallel_world_size(),
            "dp": ps.get_data_parallel_world_size()}


_CAPTURE = threading.local()  # this device thread's LightningModule of the last run
_CAPTURE_LOCK = threading.Lock()


def _install_module_capture() -> None:
    """Once per process: ``nxd_lc.app.run`` hands the LightningModule it builds to :data:`_CAPTURE` (per thread)."""
    import nxd_lc.app.run as run_module

    with _CAPTURE_LOCK:
        if hasattr(run_module._lightning_module, "_capture"):
            return
        original = run_module._lightning_module

        def capture(*args: Any, **kwargs: Any) -> Any:
            _CAPTURE.module = original(*args, **kwargs)
            return _CAPTURE.module

        capture._capture = True  # type: ignore[attr-defined]
        run_module._lightning_module = capture


def example_job(rank: int, world: int, config_dir: str, config_name: str, overrides: list[str]) -> dict[str, Any]:
    """``config_dir/config_name.yaml`` composed with ``overrides`` and run through ``train.py``'s code path in this
    device thread (:func:`xla_scenarios.nxdt_job`). Returns its recorded steps (loss, gradient norm, learning
    rate), validation losses and step reached, plus ``layout``: the TP / PP / CP / EP / DP sizes the run built
    (nxd_lc's parallel state outlives ``run``), and ``tiled``: the model's tiled-loss chunk size and how many MLPs
    run tiled (what ``model.tiled_*_chunk_size`` turned on)."""
    from xla_scenarios import nxdt_job

    _install_module_capture()
    out = nxdt_job(rank, world, config_dir, config_name, overrides)
    out["layout"] = _layout()
    model = _CAPTURE.module.model
    out["tiled"] = {"loss_chunk": getattr(model, "tiled_loss_chunk_size", None),
                    "mlps": sum(getattr(m, "tiled_chunk_size", None) is not None for m in model.modules())}
    return out


def pretrained_checkpoint(rank: int, world: int, config_dir: str, config_name: str, overrides: list[str],
                          ckpt_root: str, seed: int) -> None:
    """Build the model of ``config_name`` (composed with ``overrides``, at their TP layout over ``world`` CPU
    processes) with ``seed`` and save this rank's shard in the checkpoint ``<ckpt_root>/pretrained`` (model weights
    only, no LoRA adapters: a base model, nxd_lc's sharded format). nxd_lc initialises the full tensors and slices
    them, so every TP layout holds the same weights."""
    import dataclasses

    import torch
    from hydra import compose, initialize_config_dir

    from nxd_lc.app.build import build_model
    from nxd_lc.app.validation import load_config
    from nxd_lc.checkpoint import sharded
    from nxd_lc.config.resolvers import register_resolvers
    from nxd_lc.distributed import parallel_state as ps
    from nxd_lc.layers.lora import is_lora_key

    register_resolvers()
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        raw = compose(config_name=config_name, overrides=overrides)
    cfg = dataclasses.replace(load_config(raw, world_size=world), seed=seed)
    ds = cfg.distributed_strategy
    ps.initialize_model_parallel(tensor_model_parallel_size=ds.tensor_model_parallel_size,
                                 kv_replicator=ds.kv_replicator)
    torch.manual_seed(seed)
    _, model = build_model(cfg, "cpu")
    state = {f"model.{k}": v for k, v in model.state_dict().items() if not is_lora_key(k)}
    dp_rank = ps.get_data_parallel_rank()
    sharded.save_checkpoint(ckpt_root, "pretrained", model_state=state, optim_state=None, user_content={},
                            dp_rank=dp_rank, tp_rank=ps.get_tensor_model_parallel_rank(), pp_rank=0,
                            is_global_zero=rank == 0, write_model=dp_rank == 0, write_optim=False,
                            use_xser=cfg.exp_manager.save_xser)


def dropout_step(rank: int, world: int, tp: int, hidden: float, ffn: float, extra_syncs: int = 0,
                 micro_batches: int = 2) -> dict[str, Any]:
    """``micro_batches`` training micro-batches of a tiny Megatron GPT (learned positions, gelu MLP, biases) with
    hidden and ffn dropout at TP ``tp`` + sequence parallelism, through nxd_lc's LightningModule hooks
    (``on_train_batch_start``, ``training_step``), after ``extra_syncs`` graph cuts (a layout that takes more cuts
    before training, as a TP > 1 run's barriers do). Returns the micro-batches' losses, the sum of squares of the
    replicated weights' gradients (the position table, the final norm) and the graphs compiled per micro-batch after
    the first: equal at every TP layout and cut count when the dropout masks depend on neither
    (:mod:`nxd_lc.layers.dropout`, ``NxDLanguageModel._seed_device_stream``). Found by NxDT's
    ``megatron_gpt_config`` (hidden / ffn dropout 0.1)."""
    import torch
    import torch_xla
    from xla_scenarios import _BUILD_LOCK
    from xla_testbed import _compiles

    from nxd_lc.config.schema import ModelConfig, NxdConfig
    from nxd_lc.distributed import parallel_state as ps
    from nxd_lc.distributed.grads import allreduce_sequence_parallel_gradients
    from nxd_lc.layers.param_attrs import move_module
    from nxd_lc.lightning.module import NxDLanguageModel
    from nxd_lc.models.llama import LlamaForCausalLM
    from nxd_lc.models.megatron import build_megatron_config

    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    keys = {"num_layers": 2, "hidden_size": 32, "ffn_hidden_size": 128, "num_attention_heads": 4,
            "encoder_seq_length": 16, "normalization": "layernorm", "layernorm_epsilon": 1e-5,
            "position_embedding_type": "learned_absolute", "activation": "gelu", "has_bias": True,
            "share_embeddings_and_output_weights": True, "hidden_dropout": hidden, "ffn_dropout": ffn,
            "attention_dropout": 0.0, "make_vocab_size_divisible_by": 8}
    cfg = NxdConfig()
    cfg.distributed_strategy.tensor_model_parallel_size = tp
    cfg.distributed_strategy.sequence_parallel = True
    device = torch_xla.device()
    with _BUILD_LOCK:
        torch.manual_seed(5)
        model = LlamaForCausalLM(build_megatron_config(ModelConfig(**keys), 128), sequence_parallel=True)
    module = move_module(NxDLanguageModel(cfg, model), device).train()
    for _ in range(extra_syncs):
        torch_xla.sync()
    losses, compiles = [], []
    for micro in range(micro_batches):
        ids = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(3 + micro))
        batch = {"input_ids": ids[:, :-1].to(device), "labels": ids[:, 1:].to(device)}
        before = _compiles()
        module.on_train_batch_start(batch, micro)
        loss = module.training_step(batch, micro)
        (loss / micro_batches).backward()
        torch_xla.sync()
        compiles.append(_compiles() - before)
        losses.append(float(loss))
    allreduce_sequence_parallel_gradients(module.model)
    replicated = {n: float(p.grad.float().pow(2).sum()) for n, p in module.model.named_parameters()
                  if n in ("embed_positions.weight", "norm.weight")}
    return {"losses": losses, "grads": replicated, "compiles_after_first": compiles[1:]}


def dropless_moe_steps(rank: int, world: int, batches: int = 3) -> dict[str, Any]:
    """A dropless MoE layer (8 experts, top 2) on one XLA device and on the CPU with the same weights: forward and
    backward of ``batches`` inputs whose expert loads differ. Returns the largest differences of outputs and input
    gradients (relative to the largest CPU value), and per batch after the first the graphs compiled and the
    device-to-host reads: 0 and 0 when the capacity does not depend on the load (found by NxDT's Mixtral dropless
    files under PP 2 on the test bed: a host read of the largest load in every MoE layer broke the stages'
    ordered cuts)."""
    import copy

    import torch
    import torch_xla

    from nxd_lc.distributed import parallel_state as ps
    from nxd_lc.layers.param_attrs import move_module
    from nxd_lc.moe.layer import MoE
    from nxd_lc.runtime.xla import graph_stats

    ps.initialize_model_parallel()
    torch.manual_seed(0)
    cpu = MoE(32, 48, 8, 2, dropless=True, init_method=lambda w: torch.nn.init.normal_(w, 0.0, 0.2))
    xla = move_module(copy.deepcopy(cpu), torch_xla.device())
    out, grads, compiles, reads = 0.0, 0.0, [], []
    for b in range(batches):
        x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(b)) * (1 + b)
        xc, xx = x.clone().requires_grad_(), x.to(torch_xla.device()).requires_grad_()
        before = graph_stats()
        yx = xla(xx)[0]
        yx.pow(2).sum().backward()
        torch_xla.sync()
        after = graph_stats()
        compiles.append(after.compiles - before.compiles)
        reads.append(after.transfers_from_device - before.transfers_from_device)
        yc = cpu(xc)[0]
        yc.pow(2).sum().backward()
        out = max(out, float((yx.cpu() - yc.detach()).abs().max() / yc.detach().abs().max()))
        grads = max(grads, float((xx.grad.cpu() - xc.grad).abs().max() / xc.grad.abs().max()))
    return {"out": out, "grads": grads, "compiles_after_first": compiles[1:], "reads_after_first": reads[1:]}
