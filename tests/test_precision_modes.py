"""Precision modes (``precision.type``): the dtypes of params, gradients, master weights and optimizer state in a
real training step of each mode, stochastic rounding inside the optimizer step, fp32 gradient accumulation,
and the dtype TP reductions run in (``precision.parallel_layers_reduce_dtype``)."""

from __future__ import annotations

from typing import Any, Optional

import pytest
import torch
from dist_utils import run_distributed
from transformers import LlamaConfig

from nxd_lc.config.schema import NxdConfig
from nxd_lc.distributed import collectives, grads, mappings
from nxd_lc.distributed import parallel_state as ps
from nxd_lc.lightning.module import NxDLanguageModel
from nxd_lc.models.llama import LlamaForCausalLM
from nxd_lc.optim import NxDOptimizer, build_optimizer, install_fp32_grad_accumulation
from nxd_lc.precision import resolve_precision

F32, BF16 = torch.float32, torch.bfloat16


def _config() -> LlamaConfig:
    return LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


def _cfg(mode: str, optim: str = "adamw", **precision: Any) -> NxdConfig:
    cfg = NxdConfig()
    cfg.precision.type = mode
    for k, v in precision.items():
        setattr(cfg.precision, k, v)
    cfg.model.optim.name = optim
    cfg.model.optim.lr = 1e-3
    cfg.trainer.gradient_clip_val = 1.0
    cfg.exp_manager.log_gradient_norm = True
    return cfg


def _batch(seed: int = 0) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}


def _train_step(module: NxDLanguageModel, opt: torch.optim.Optimizer, micro_batches: int = 2) -> list[torch.dtype]:
    """One optimizer step as Lightning runs it (autocast from the precision plugin for ``autocast``); returns the
    dtypes of the first linear layer's outputs seen in the forward passes."""
    seen: list[torch.dtype] = []
    handle = module.model.layers[0].mlp.down_proj.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    opt.zero_grad()
    policy = module.precision_policy
    for i in range(micro_batches):
        with torch.autocast("cpu", dtype=BF16, enabled=policy.autocast_dtype is not None):
            loss = module.training_step(_batch(i), i)
        (loss / micro_batches).backward()
    module.on_before_optimizer_step(opt)
    module.configure_gradient_clipping(opt, 1.0)
    opt.step()
    handle.remove()
    return seen


# mode, optimizer, manual keys -> params, compute, gradient (accumulation), master weights, optimizer state
MODES = [
    ("fp32", "adamw", {}, F32, F32, F32, None, F32),
    ("bf16SR", "adamw", {}, BF16, BF16, BF16, None, BF16),
    ("bf16SR", "adamw_fp32OptState", {}, BF16, BF16, BF16, None, F32),
    ("mixed_precision", "adamw", {}, BF16, BF16, F32, F32, F32),
    ("mixed_precisionSR", "adamw", {}, BF16, BF16, F32, F32, F32),
    ("autocast", "adamw", {}, F32, BF16, F32, None, F32),
    ("manual", "adamw", dict(xla_downcast_bf16="1", master_weights=True, fp32_grad_acc=True,
                             neuron_rt_stochastic_rounding_en="1"), BF16, BF16, F32, F32, F32),
    ("manual", "adamw", dict(xla_use_bf16="1"), BF16, BF16, BF16, None, BF16),
    ("manual", "adamw", {}, F32, F32, F32, None, F32),
]


@pytest.mark.compat
@pytest.mark.parametrize("mode,optim,manual,param_dt,compute_dt,grad_dt,master_dt,state_dt", MODES)
def test_each_mode_trains_with_documented_dtypes(mode: str, optim: str, manual: dict, param_dt: torch.dtype,
                                                 compute_dt: torch.dtype, grad_dt: torch.dtype,
                                                 master_dt: Optional[torch.dtype], state_dt: torch.dtype) -> None:
    torch.manual_seed(0)
    module = NxDLanguageModel(_cfg(mode, optim, **manual), LlamaForCausalLM(_config()))
    before = {n: p.detach().float().clone() for n, p in module.model.named_parameters()}
    opt = module.configure_optimizers()["optimizer"]
    opt.zero_grad()
    loss = module.training_step(_batch(), 0)
    assert loss.dtype == F32  # the loss is always reduced in fp32
    loss.backward()
    for p in module.model.parameters():
        assert p.dtype == param_dt
        assert grads.grad_of(p).dtype == grad_dt
    seen = _train_step(module, opt)
    assert seen and all(d == compute_dt for d in seen)
    for n, p in module.model.named_parameters():
        assert p.dtype == param_dt and torch.isfinite(p).all(), n
    moved = {n for n, p in module.model.named_parameters() if not torch.equal(p.detach().float(), before[n])}
    # norm weights (1.0; bf16 ulp 2^-7) keep their bf16 value under a ~1e-3 step when rounded to nearest
    rne = param_dt == BF16 and not module.precision_policy.stochastic_rounding
    assert moved == ({n for n in before if "norm" not in n} if rne else set(before))
    if master_dt is None:
        assert not isinstance(opt, NxDOptimizer) or not opt.persistent or param_dt == F32
    else:
        assert isinstance(opt, NxDOptimizer) and opt.persistent
        assert all(s.work.dtype == master_dt and s.work.numel() == s.param.numel() for s in opt.slots)
        names = {id(p): n for n, p in module.model.named_parameters()}
        assert all(not torch.equal(s.work.detach().view_as(s.param), before[names[id(s.param)]]) for s in opt.slots)
    states = [v for st in opt.state.values() for k, v in st.items() if k != "step" and torch.is_tensor(v)]
    assert states and all(v.dtype == state_dt for v in states)
    assert module._grad_norm is not None and torch.isfinite(module._grad_norm)


@pytest.mark.compat
def test_mixed_precision_master_weights_track_fp32_exactly() -> None:
    """bf16 params + fp32 masters: the masters follow the fp32 optimizer bit for bit on the same gradients, and
    the bf16 parameter is the master rounded to nearest."""
    torch.manual_seed(0)
    full = torch.randn(256)
    p = torch.nn.Parameter(full.to(BF16))
    ref = torch.nn.Parameter(full.to(BF16).float())  # the master starts from the bf16 value
    cfg = _cfg("mixed_precision", "sgd")
    opt = build_optimizer([("w", p)], cfg.model.optim, True, policy=resolve_precision(cfg))
    ref_opt = torch.optim.SGD([ref], lr=cfg.model.optim.lr, weight_decay=cfg.model.optim.weight_decay)
    for i in range(50):
        g = torch.randn(256, generator=torch.Generator().manual_seed(i)) * 1e-2
        p.grad, ref.grad = g.to(BF16), g.to(BF16).float()
        opt.step()
        ref_opt.step()
    master = opt.slots[0].work.detach()
    assert torch.equal(master, ref.detach())
    assert torch.equal(p.detach(), master.to(BF16))


def _tiny_update_run(mode: str, sr: str, steps: int) -> torch.Tensor:
    """``steps`` SGD steps of lr * grad = 1e-4 (1/78 of a bf16 ulp at 1.0) on bf16 ones."""
    p = torch.nn.Parameter(torch.ones(4096, dtype=BF16))
    cfg = _cfg(mode, "sgd", xla_use_bf16="1", neuron_rt_stochastic_rounding_en=sr)
    cfg.model.optim.lr = 1e-4
    opt = build_optimizer([("w", p)], cfg.model.optim, True, policy=resolve_precision(cfg), seed=3)
    for _ in range(steps):
        p.grad = torch.ones_like(p)
        opt.step()
    return p.detach().float()


@pytest.mark.compat
def test_stochastic_rounding_in_the_optimizer_step_does_not_stall() -> None:
    """bf16SR: 2,000 updates of -1e-4 move bf16 ones to 0.8 on average (the fp32 result); round-to-nearest
    (manual bf16 without stochastic rounding) never moves."""
    steps = 2000
    expected = 1.0 - steps * 1e-4
    sr = _tiny_update_run("bf16SR", "1", steps)
    rne = _tiny_update_run("manual", "0", steps)
    assert torch.equal(rne, torch.ones_like(rne))
    assert abs(sr.mean().item() - expected) / expected < 2e-3
    assert abs(_tiny_update_run("manual", "1", steps).mean().item() - expected) / expected < 2e-3


def test_fp32_gradient_accumulation_is_exact() -> None:
    """main_grad holds the fp32 sum of the bf16 micro-batch gradients; .grad is freed after each backward."""
    p = torch.nn.Parameter(torch.ones(8, dtype=BF16))
    install_fp32_grad_accumulation([p])
    parts = [torch.full((8,), 1.0 + 2.0 ** -7, dtype=BF16) * (i + 1) for i in range(4)]
    for part in parts:
        (p * part).sum().backward()
        assert p.grad is None
    expected = sum(part.float() for part in parts)
    assert p.main_grad.dtype == F32 and torch.equal(p.main_grad, expected)
    assert not torch.equal(sum(parts[1:], parts[0]).float(), expected)  # a bf16 accumulation would round


def test_unsupported_combinations_are_config_errors() -> None:
    from nxd_lc.precision.rules import precision_problems

    cfg = _cfg("bf16SR")
    cfg.exp_manager.checkpoint_callback_params.use_master_weights_in_ckpt = True
    cfg.precision.parallel_layers_reduce_dtype = "fp16"
    cfg.precision.master_weights = True
    problems = "\n".join(precision_problems(cfg))
    assert "precision.parallel_layers_reduce_dtype: unknown value 'fp16'" in problems
    assert "use_master_weights_in_ckpt: precision.type bf16SR keeps no fp32 master weights" in problems
    assert "precision.master_weights: true contradicts precision.type bf16SR" in problems


def _reduce_dtype_worker(rank: int, world: int, name: Optional[str], expected: str) -> None:
    torch.set_num_threads(1)
    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    cfg = _cfg("mixed_precision")
    cfg.precision.parallel_layers_reduce_dtype = name
    NxDLanguageModel(cfg, torch.nn.Linear(2, 2))  # applies the policy (reduce dtype is process-wide)
    seen: list[torch.dtype] = []
    real = collectives.all_reduce

    def spy(t: torch.Tensor, group: Any, op: str = "sum") -> torch.Tensor:
        seen.append(t.dtype)
        return real(t, group, op)

    collectives.all_reduce = spy  # our own module, observed for the test
    try:
        x = torch.full((4,), 1.0 + 2.0 ** -8 * (rank + 1), dtype=BF16)
        out = mappings.reduce_from_tensor_model_parallel_region(x)
    finally:
        collectives.all_reduce = real
    assert out.dtype == BF16 and seen == [getattr(torch, expected)]


@pytest.mark.distributed
@pytest.mark.parametrize("name,expected", [(None, "float32"), ("fp32", "float32"), ("bf16", "bfloat16")])
def test_parallel_layers_reduce_dtype(name: Optional[str], expected: str) -> None:
    run_distributed(_reduce_dtype_worker, 2, name, expected)
