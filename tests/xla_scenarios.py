"""Scenarios run on the multi-device XLA test bed (:mod:`xla_testbed`), one thread per XLA device.

Each is ``fn(rank, world_size, **kwargs) -> JSON-able`` and is run by ``tests/test_xla_multidevice.py`` through
:func:`xla_testbed.run_on_xla_devices`, on N devices and on one device, and the results compared there.

:func:`train` runs nxd_lc's own training-step code (``NxDLanguageModel.training_step`` for each micro-batch,
``on_before_optimizer_step`` for the gradient reductions and the global norm, ``configure_gradient_clipping``, the
optimizer of ``configure_optimizers``) on a tiny Llama whose vocabulary (200) is padded at TP > 1, so the padded-
vocabulary mask, the vocabulary offsets, the sequence-parallel norms and the KV replicas all take part. The data of
a step is a fixed global batch split over the DP ranks; the one-device run sees all of it.
"""

from __future__ import annotations

import hashlib
import threading
import time
from typing import Any

VOCAB = 200
SEQ = 16
GLOBAL_MICRO_ROWS = 4  # rows of one micro-batch over all DP ranks
MICRO_BATCHES = 2
_BUILD_LOCK = threading.Lock()  # model construction draws from the process-global CPU generator: one at a time


def _llama_config() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                       rms_norm_eps=1e-5)


def _param_attrs(model: Any) -> dict[str, dict[str, Any]]:
    from nxd_lc.layers.param_attrs import record_parallel_attributes

    return record_parallel_attributes(model)


def train(rank: int, world: int, tp: int = 1, sp: bool = False, kv: int = 1, cp: int = 1, algo: str = "ulysses",
          zero1: bool = False, steps: int = 3, move: str = "nxd") -> dict[str, Any]:
    """``steps`` optimizer steps of :data:`MICRO_BATCHES` micro-batches each; returns the DP-averaged loss
    and the global gradient norm of every step (read after the step's cut), a digest of the norm weights'
    bytes (to compare between TP ranks) and whether every parameter kept its parallel attributes
    through the device move.

    ``move``: ``'nxd'`` moves the module with :func:`nxd_lc.layers.param_attrs.move_module` (production), ``'plain'``
    with ``module.to(device)`` (what loses the attributes on XLA).
    """
    import torch
    import torch_xla

    from nxd_lc.config.schema import NxdConfig
    from nxd_lc.context.attention import set_context_parallel_algo
    from nxd_lc.distributed import collectives
    from nxd_lc.distributed import parallel_state as ps
    from nxd_lc.layers.param_attrs import move_module
    from nxd_lc.lightning.module import NxDLanguageModel
    from nxd_lc.models.llama import LlamaForCausalLM

    cfg = NxdConfig()
    ds = cfg.distributed_strategy
    ds.tensor_model_parallel_size, ds.sequence_parallel, ds.kv_replicator = tp, sp, kv
    ds.context_parallel_size, ds.context_parallel_algo, ds.zero1 = cp, algo, zero1
    cfg.model.optim.lr = 3e-3
    cfg.trainer.gradient_clip_val = 0.5
    cfg.exp_manager.log_gradient_norm = True
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp, kv_replicator=kv)
    if cp > 1:
        set_context_parallel_algo(algo)
    device = torch_xla.device()
    with _BUILD_LOCK:
        torch.manual_seed(0)
        model = LlamaForCausalLM(_llama_config(), sequence_parallel=sp, kv_replicator=kv)
    module = NxDLanguageModel(cfg, model)
    before = _param_attrs(module.model)
    if move == "nxd":
        module = move_module(module, device)
    else:
        module = module.to(device)
    attrs_kept = _param_attrs(module.model) == before
    opt = module.configure_optimizers()["optimizer"]
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    rows = GLOBAL_MICRO_ROWS // dp
    losses, norms = [], []
    for step in range(steps):
        opt.zero_grad()
        step_loss = torch.zeros(1, device=device)
        for micro in range(MICRO_BATCHES):
            gen = torch.Generator().manual_seed(1000 * step + micro)
            ids = torch.randint(0, VOCAB, (GLOBAL_MICRO_ROWS, SEQ + 1), generator=gen)
            ids = ids[dp_rank * rows:(dp_rank + 1) * rows]
            batch = {"input_ids": ids[:, :-1].to(device), "labels": ids[:, 1:].to(device)}
            loss = module.training_step(batch, micro)
            (loss / MICRO_BATCHES).backward()
            step_loss = step_loss + loss.detach() / MICRO_BATCHES
        module.on_before_optimizer_step(opt)
        module.configure_gradient_clipping(opt, cfg.trainer.gradient_clip_val)
        opt.step()
        step_loss = collectives.all_reduce(step_loss, ps.get_data_parallel_group(with_context_parallel=True), op="avg")
        torch_xla.sync()
        losses.append(float(step_loss[0]))
        norms.append(float(module._grad_norm))
    norm_weights = {n: hashlib.sha1(p.detach().cpu().numpy().tobytes()).hexdigest()
                    for n, p in module.model.named_parameters() if n.endswith("norm.weight")}
    return {"losses": losses, "norms": norms, "attrs_kept": attrs_kept, "norm_weights": norm_weights,
            "tp_rank": ps.get_tensor_model_parallel_rank(), "dp_rank": dp_rank}


def barrier_late_rank(rank: int, world: int, delay_s: float = 2.0) -> dict[str, float]:
    """Rank ``world - 1`` reaches :func:`nxd_lc.distributed.collectives.barrier` ``delay_s`` late; every rank
    returns how long it waited inside the barrier (s)."""
    import torch_xla  # noqa: F401 -- the device thread's runtime

    from nxd_lc.distributed import collectives

    if rank == world - 1:
        time.sleep(delay_s)
    t0 = time.monotonic()
    collectives.barrier()
    return {"waited_s": time.monotonic() - t0}


def rank_dependent_graph(rank: int, world: int) -> list[float]:
    """A graph whose constant depends on the rank before a collective: the test bed must report a divergence
    (the stock multi-device set-up would deadlock, then abort)."""
    import torch
    import torch_xla

    from nxd_lc.distributed import collectives

    t = torch.ones(4, device=torch_xla.device()) * (rank + 1)  # a Python number baked into each rank's graph
    collectives.all_reduce(t, None if world == 1 else _world_group())
    return t.cpu().tolist()


def _world_group() -> Any:
    import torch.distributed as dist

    return dist.group.WORLD
