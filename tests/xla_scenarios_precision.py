"""Precision modes on XLA devices (issue 38): a few optimizer steps of each ``precision.type`` under the run's own
environment, what moved in the master weights, and the element type every tensor class has *on the device*.

:func:`precision_steps` runs on the multi-device XLA test bed (:mod:`xla_testbed`, one thread per device) and, with
``device="cpu"``, in one gloo process as the reference (:func:`cpu_reference`). It runs nxd_lc's own step code as
``tests/xla_scenarios.py``'s ``train`` does (``NxDLanguageModel.training_step`` per micro-batch,
``on_before_optimizer_step``, clipping, the optimizer of ``configure_optimizers``), with a constant learning rate
(no scheduler), AdamW without weight decay, on a tiny Llama.

Master elements that moved: for modes with persistent fp32 working tensors (master weights; fp32 parameters) the
optimizer's working tensors, otherwise (bf16SR) the parameters; counted once over the ranks -- TP-replicated
tensors on TP rank 0 only, full (non-ZeRO-1) tensors on DP rank 0 only -- so the sum over ranks compares with one
device's count.
"""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

VOCAB = 200
SEQ = 16
GLOBAL_MICRO_ROWS = 4
MICRO_BATCHES = 2


def _cfg(mode: str, tp: int, sp: bool, zero1: bool, lr: float, manual: dict[str, Any]) -> Any:
    from nxd_lc.config.schema import NxdConfig

    cfg = NxdConfig()
    cfg.precision.type = mode
    for k, v in manual.items():
        setattr(cfg.precision, k, v)
    ds = cfg.distributed_strategy
    ds.tensor_model_parallel_size, ds.sequence_parallel, ds.zero1 = tp, sp, zero1
    cfg.model.optim.name = "adamw"
    cfg.model.optim.lr = lr
    cfg.model.optim.weight_decay = 0.0
    cfg.trainer.gradient_clip_val = 1.0
    cfg.exp_manager.log_gradient_norm = True
    return cfg


def _type_name(t: Any) -> str:
    """XLA's element type of ``t`` on its device ('f32', 'bf16', ...); on CPU the torch dtype in the same names."""
    import torch

    if t.device.type == "xla":
        from nxd_lc.runtime.xla import device_type_name

        return device_type_name(t)
    return {torch.float32: "f32", torch.bfloat16: "bf16", torch.float64: "f64"}.get(t.dtype, str(t.dtype))


def precision_steps(rank: int, world: int, mode: str, tp: int = 1, sp: bool = False, zero1: bool = False,
                    steps: int = 5, lr: float = 1e-6, manual: dict[str, Any] | None = None,
                    device: str = "xla") -> dict[str, Any]:
    """``steps`` optimizer steps of :data:`MICRO_BATCHES` micro-batches in precision ``mode`` (``manual``: the
    precision keys of ``precision.type: manual``); returns per-step losses, gradient and parameter norms, the
    number of master elements that moved (module docstring) and their total, and the on-device element types of
    the tensor classes (read after the first step)."""
    import torch
    from xla_scenarios import _BUILD_LOCK, _llama_config

    from nxd_lc.distributed import collectives, grads
    from nxd_lc.distributed import parallel_state as ps
    from nxd_lc.layers.param_attrs import move_module
    from nxd_lc.lightning.module import NxDLanguageModel
    from nxd_lc.models.llama import LlamaForCausalLM

    cfg = _cfg(mode, tp, sp, zero1, lr, manual or {})
    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    if device == "xla":
        import torch_xla

        dev = torch_xla.device()
        cut = torch_xla.sync
    else:
        dev, cut = torch.device("cpu"), (lambda: None)
    with _BUILD_LOCK:
        torch.manual_seed(0)
        built = LlamaForCausalLM(_llama_config(2), sequence_parallel=sp)
    dp, dp_rank, tp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank(), \
        ps.get_tensor_model_parallel_rank()
    rows = GLOBAL_MICRO_ROWS // dp
    cfg.data.micro_batch_size = rows
    module = move_module(NxDLanguageModel(cfg, built), dev)
    opt = module.configure_optimizers()["optimizer"]
    policy = module.precision_policy

    # fp32 parameters without ZeRO-1 are stepped by the plain torch optimizer: the parameters are the masters
    wrapped = hasattr(opt, "slots")
    slots = opt.slots if wrapped else [SimpleNamespace(param=p, work=p) for p in module.trainable_parameters()]
    persistent = opt.persistent if wrapped else True

    def counted(slot: Any) -> tuple[torch.Tensor, bool]:
        """(the tensor whose movement counts for ``slot``, whether this rank counts it)."""
        sharded_tp = bool(getattr(slot.param, "tensor_model_parallel", False))
        if wrapped and opt.persistent:  # fp32 working tensors: this rank's ZeRO-1 shard, or all of it
            return slot.work, (sharded_tp or tp_rank == 0) and (zero1 or dp_rank == 0)
        return slot.param, (sharded_tp or tp_rank == 0) and dp_rank == 0

    start = [counted(s)[0].detach().cpu().clone() for s in slots]
    losses, norms, param_norms, types = [], [], [], {}
    for step in range(steps):
        opt.zero_grad()
        step_loss = torch.zeros(1, device=dev)
        for micro in range(MICRO_BATCHES):
            gen = torch.Generator().manual_seed(1000 * step + micro)
            ids = torch.randint(0, VOCAB, (GLOBAL_MICRO_ROWS, SEQ + 1), generator=gen)[dp_rank * rows:(dp_rank + 1)
                                                                                      * rows]
            batch = {"input_ids": ids[:, :-1].to(dev), "labels": ids[:, 1:].to(dev)}
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=policy.autocast_dtype is not None):
                loss = module.training_step(batch, micro)
            (loss / MICRO_BATCHES).backward()
            step_loss = step_loss + loss.detach().float() / MICRO_BATCHES
        module.on_before_optimizer_step(opt)
        if step == 0:
            p0 = slots[0].param
            acc = getattr(p0, "main_grad", None)
            types.update(parameters=_type_name(p0), loss=_type_name(loss),
                         grad_accumulation=_type_name(acc if acc is not None else p0.grad))
        module.configure_gradient_clipping(opt, cfg.trainer.gradient_clip_val)
        opt.step()
        if step == 0:
            state = getattr(opt, "inner", opt).state.get(slots[0].work, {})
            types["optimizer_state"] = _type_name(state["exp_avg"]) if "exp_avg" in state else None
            types["master_weights"] = _type_name(slots[0].work) if policy.master_weights else None
        step_loss = collectives.all_reduce(step_loss, ps.get_data_parallel_group(with_context_parallel=True), op="avg")
        pnorm = grads.global_param_norm(module.trainable_parameters())
        cut()
        losses.append(float(step_loss[0]))
        norms.append(float(module._grad_norm))
        param_norms.append(float(pnorm))
    moved = total = 0
    for s, before in zip(slots, start):
        now, mine = counted(s)
        if mine:
            moved += int((now.detach().cpu() != before).sum())
            total += before.numel()
    return {"losses": losses, "norms": norms, "param_norms": param_norms, "moved": moved, "total": total,
            "types": types, "persistent": persistent}


def cpu_reference(rank: int, world: int, out: str, kwargs: dict[str, Any]) -> None:
    """:func:`precision_steps` on CPU in a gloo process of ``tests/dist_utils.run_distributed``; rank 0 writes the
    result as JSON to ``out``."""
    result = precision_steps(rank, world, device="cpu", **kwargs)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)
