"""Optimizer registry, weight-decay groups and LR schedules (nxd_lc.optim) against hand-computed values."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn

from nxd_lc.app.validation import check_supported, load_config
from nxd_lc.config.schema import OptimConfig, SchedConfig
from nxd_lc.optim import (
    OPTIMIZER_BUILDERS,
    OPTIMIZER_NAMES,
    SCHEDULE_NAMES,
    Novograd,
    build_optimizer,
    build_scheduler,
    constant_lr,
    cosine_annealing_lr,
    exponential_lr,
    is_no_decay_param,
    linear_annealing_with_warmup_lr,
    noam_annealing_lr,
    param_groups,
    step_lr,
)

pytestmark = pytest.mark.compat  # torch-2.9 compatibility subset (lane 2; docs/testing.md)

TINY_JSON = Path(__file__).resolve().parents[1] / "conf" / "tiny_llama_config.json"  # hidden 256


class _Block(nn.Module):
    """Llama-like names: a 2-D weight, a biased projection, norms (1-D), and a frozen buffer-like param."""

    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(5, 3)
        self.input_layernorm = nn.Module()
        self.input_layernorm.weight = nn.Parameter(torch.ones(3))
        self.o_proj = nn.Linear(3, 3, bias=True)
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.ones(3))
        self.frozen = nn.Parameter(torch.ones(3, 3), requires_grad=False)


DECAYED = {"embed_tokens.weight", "o_proj.weight"}
NOT_DECAYED = {"input_layernorm.weight", "o_proj.bias", "norm.weight"}


def _names(group: dict) -> set[str]:
    return set(group["param_names"])


def _lr_trajectory(sched_cfg: SchedConfig, max_steps: int, num_steps: int, lr: float = 1.0) -> list[float]:
    """lr of group 0 after 0, 1, ..., num_steps scheduler steps."""
    model = _Block()
    opt = build_optimizer(model.named_parameters(), OptimConfig(name="sgd", lr=lr), False)
    sched = build_scheduler(opt, sched_cfg, max_steps)
    lrs = [opt.param_groups[0]["lr"]]
    for _ in range(num_steps):
        opt.step()
        sched.step()
        assert opt.param_groups[0]["lr"] == pytest.approx(opt.param_groups[-1]["lr"])
        lrs.append(opt.param_groups[0]["lr"])
    return lrs


# ---------------------------------------------------------------------------------------------- param groups

@pytest.mark.parametrize("name,shape,expected", [
    ("layers.0.input_layernorm.weight", (4,), True),
    ("layers.0.post_attention_layernorm.weight", (4,), True),
    ("model.norm.weight", (4,), True),
    ("encoder.LayerNorm.weight", (4,), True),
    ("layers.0.self_attn.o_proj.bias", (4,), True),
    ("ln_f.weight", (4,), True),  # 1-D
    ("layers.0.self_attn.o_proj.weight", (4, 4), False),
    ("embed_tokens.weight", (8, 4), False),
    ("lm_head.weight", (8, 4), False),
])
def test_is_no_decay_param(name: str, shape: tuple[int, ...], expected: bool) -> None:
    assert is_no_decay_param(name, torch.empty(shape)) is expected


def test_groups_exclude_norms_and_biases_only_when_flag_false() -> None:
    model = _Block()
    groups = param_groups(model.named_parameters(), 0.1, do_layer_norm_weight_decay=False)
    by_name = {g["group_name"]: g for g in groups}
    assert _names(by_name["decay"]) == DECAYED and by_name["decay"]["weight_decay"] == 0.1
    assert _names(by_name["no_decay"]) == NOT_DECAYED and by_name["no_decay"]["weight_decay"] == 0.0

    groups = param_groups(model.named_parameters(), 0.1, do_layer_norm_weight_decay=True)
    assert len(groups) == 1
    assert _names(groups[0]) == DECAYED | NOT_DECAYED and groups[0]["weight_decay"] == 0.1  # frozen excluded


def test_groups_dedupe_tied_and_drop_empty() -> None:
    shared = nn.Parameter(torch.ones(2, 2))
    groups = param_groups([("a.weight", shared), ("b.weight", shared)], 0.01, False)
    assert len(groups) == 1 and groups[0]["param_names"] == ["a.weight"]


def test_no_trainable_params_errors() -> None:
    frozen = nn.Parameter(torch.ones(2), requires_grad=False)
    with pytest.raises(ValueError, match="no parameter requires grad"):
        build_optimizer([("w", frozen)], OptimConfig(), False)


# ----------------------------------------------------------------------------------------------- optimizers

def _one_step_zero_grad(name: str, do_ln_wd: bool) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """(before, after) per param for one step with zero grads, lr 0.1, weight_decay 0.5 (only decay moves them)."""
    torch.manual_seed(0)
    model = _Block()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.rand_like(p) + 0.5)  # positive, away from 0
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    cfg = OptimConfig(name=name, lr=0.1, weight_decay=0.5, momentum=0.9 if name == "sgd" else 0.0)
    opt = build_optimizer(model.named_parameters(), cfg, do_ln_wd)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    return {n: (before[n], p.detach()) for n, p in model.named_parameters()}


@pytest.mark.parametrize("name", ["adamw", "adamw_fp32OptState", "sgd"])
def test_weight_decay_applied_per_group(name: str) -> None:
    # AdamW (decoupled): p *= 1 - lr * wd = 0.95 with a zero grad. SGD (L2, first momentum step): grad = wd * p,
    # p -= lr * wd * p -> 0.95 p as well. No-decay params do not move.
    out = _one_step_zero_grad(name, do_ln_wd=False)
    for n in DECAYED:
        before, after = out[n]
        torch.testing.assert_close(after, before * 0.95)
    for n in NOT_DECAYED:
        before, after = out[n]
        torch.testing.assert_close(after, before)
    out = _one_step_zero_grad(name, do_ln_wd=True)
    for n in DECAYED | NOT_DECAYED:
        before, after = out[n]
        torch.testing.assert_close(after, before * 0.95)


def test_adam_weight_decay_is_l2() -> None:
    # Adam, L2: grad = wd * p > 0; first bias-corrected step is lr * g / (|g| + eps) ~= lr.
    out = _one_step_zero_grad("adam", do_ln_wd=False)
    for n in DECAYED:
        before, after = out[n]
        torch.testing.assert_close(after, before - 0.1, atol=1e-6, rtol=0)
    for n in NOT_DECAYED:
        before, after = out[n]
        torch.testing.assert_close(after, before)


def test_capturable_is_not_passed_for_cpu_parameters() -> None:
    """NxDT's Mixtral examples set ``capturable: True`` (graph capture on XLA); torch refuses it for CPU tensors at
    the first step, so CPU parameters get an optimizer without it (and it steps)."""
    model = _Block()
    opt = build_optimizer(model.named_parameters(), OptimConfig(name="adamw", capturable=True), False)
    assert opt.param_groups[0]["capturable"] is False
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()


def test_optimizer_types_and_hyperparameters() -> None:
    model = _Block()
    cfg = OptimConfig(name="adamw_fp32OptState", lr=1.5e-4, weight_decay=0.01, betas=[0.8, 0.95], eps=1e-6)
    opt = build_optimizer(model.named_parameters(), cfg, False)
    assert type(opt) is torch.optim.AdamW
    g = opt.param_groups[0]
    assert (g["lr"], g["betas"], g["eps"], g["capturable"]) == (1.5e-4, (0.8, 0.95), 1e-6, False)
    assert type(build_optimizer(model.named_parameters(), OptimConfig(name="adam"), False)) is torch.optim.Adam
    sgd = build_optimizer(model.named_parameters(), OptimConfig(name="sgd", momentum=0.9), False)
    assert type(sgd) is torch.optim.SGD and sgd.param_groups[0]["momentum"] == 0.9


def test_adamw_fp32_opt_state_keeps_fp32_state_and_refuses_bf16() -> None:
    model = _Block()
    opt = build_optimizer(model.named_parameters(), OptimConfig(name="adamw_fp32OptState"), False)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    state = opt.state[model.o_proj.weight]
    assert state["exp_avg"].dtype == torch.float32 and state["exp_avg_sq"].dtype == torch.float32
    bf16 = nn.Parameter(torch.ones(2, 2, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="adamw_fp32OptState: parameter 'w' is torch.bfloat16"):
        build_optimizer([("w", bf16)], OptimConfig(name="adamw_fp32OptState"), False)


#: NeMo's optimizer names (nemo.core.optim.optimizers.AVAILABLE_OPTIMIZERS, those with a torch / NeMo class) plus
#: NxD's adamw_fp32OptState, and NeMo's LR schedule names (nemo.core.optim.lr_scheduler.AVAILABLE_SCHEDULERS, the
#: ones NxDT's docs list): written here from those sources, not read from nxd_lc.
NEMO_OPTIMIZERS = {"adamw", "adamw_fp32OptState", "adam", "sgd", "adadelta", "adamax", "adagrad", "rmsprop",
                   "rprop", "novograd", "adafactor"}
NEMO_SCHEDULERS = {"LinearAnnealingWithWarmUp", "CosineAnnealing", "Constant", "WarmupPolicy", "WarmupHoldPolicy",
                   "SquareAnnealing", "NoamAnnealing", "WarmupAnnealing", "StepLR", "ExponentialLR"}


def test_every_nemo_name_is_implemented() -> None:
    assert OPTIMIZER_NAMES == tuple(OPTIMIZER_BUILDERS)  # one list: validation reads OPTIMIZER_NAMES
    assert set(OPTIMIZER_NAMES) == NEMO_OPTIMIZERS
    assert set(SCHEDULE_NAMES) == NEMO_SCHEDULERS


def test_unknown_optimizer_and_unusable_settings_error() -> None:
    params = list(_Block().named_parameters())
    with pytest.raises(ValueError, match="unknown optimizer 'adamww'; choose one of adamw"):
        build_optimizer(params, OptimConfig(name="adamww"), False)
    with pytest.raises(ValueError, match="model.optim.momentum"):
        build_optimizer(params, OptimConfig(name="adamw", momentum=0.9), False)
    with pytest.raises(ValueError, match="model.optim.capturable"):
        build_optimizer(params, OptimConfig(name="sgd", capturable=True), False)
    with pytest.raises(ValueError, match="model.optim.betas"):
        build_optimizer(params, OptimConfig(name="adam", betas=[0.9]), False)
    with pytest.raises(ValueError, match="must be >= 0"):
        build_optimizer(params, OptimConfig(name="adam", lr=-1.0), False)


# ------------------------------------------------------------------------------------------------ schedules

def test_linear_annealing_with_warmup_key_steps() -> None:
    # W = 10, M = 110, lr = 1: warm-up step / 10, then (110 - step) / 100 (NxDT / transformers formula).
    lrs = _lr_trajectory(SchedConfig(name="LinearAnnealingWithWarmUp", warmup_steps=10), 110, 120)
    expected = {0: 0.0, 5: 0.5, 9: 0.9, 10: 1.0, 35: 0.75, 60: 0.5, 109: 0.01, 110: 0.0, 120: 0.0}
    for step, value in expected.items():
        assert lrs[step] == pytest.approx(value, abs=1e-12), step


def test_linear_annealing_min_lr_floor_and_sched_max_steps_override() -> None:
    # sched.max_steps = 110 overrides the 999 passed in; min_lr 0.1: 0.1 + 0.9 * (110 - step) / 100.
    cfg = SchedConfig(name="LinearAnnealingWithWarmUp", warmup_steps=10, max_steps=110, min_lr=0.1)
    lrs = _lr_trajectory(cfg, 999, 115)
    expected = {0: 0.0, 5: 0.5, 10: 1.0, 60: 0.55, 110: 0.1, 115: 0.1}
    for step, value in expected.items():
        assert lrs[step] == pytest.approx(value, abs=1e-12), step


def test_cosine_annealing_without_constant_steps() -> None:
    # NeMo branch 1: W = 9, M = 109, min_lr 0.1. Warm-up (step+1)/10; decay 0.1 + 0.45 (1 + cos(pi (s-9)/100)).
    cfg = SchedConfig(name="CosineAnnealing", warmup_steps=9, min_lr=0.1)
    lrs = _lr_trajectory(cfg, 109, 120)
    expected = {0: 0.1, 4: 0.5, 9: 1.0, 34: 0.1 + 0.45 * (1 + math.sqrt(0.5)), 59: 0.55,
                84: 0.1 + 0.45 * (1 - math.sqrt(0.5)), 109: 0.1, 110: 0.1, 120: 0.1}
    for step, value in expected.items():
        assert lrs[step] == pytest.approx(value, abs=1e-12), step


def test_cosine_annealing_with_constant_steps_at_end() -> None:
    # NeMo branch 2: W = 10, C = 20, M = 130 -> D = 100 decay steps, then C steps held at min_lr.
    cfg = SchedConfig(name="CosineAnnealing", warmup_steps=10, constant_steps=20, min_lr=0.1)
    lrs = _lr_trajectory(cfg, 130, 140)
    expected = {0: 0.0, 5: 0.5, 10: 1.0, 60: 0.55, 110: 0.1, 111: 0.1, 120: 0.1, 130: 0.1, 140: 0.1}
    for step, value in expected.items():
        assert lrs[step] == pytest.approx(value, abs=1e-12), step


def test_constant_schedule() -> None:
    # NeMo WarmupPolicy: W = 4 -> (step+1)/5 up to step 4, then lr; past M = 50 -> min_lr.
    lrs = _lr_trajectory(SchedConfig(name="Constant", warmup_steps=4, min_lr=0.0), 50, 55, lr=0.5)
    expected = {0: 0.1, 2: 0.3, 4: 0.5, 20: 0.5, 50: 0.5, 51: 0.0, 55: 0.0}
    for step, value in expected.items():
        assert lrs[step] == pytest.approx(value, abs=1e-12), step


def test_pure_functions_match_scheduler() -> None:
    assert linear_annealing_with_warmup_lr(0, 2.0, 0, 10) == 2.0  # no warm-up: start at lr
    assert cosine_annealing_lr(0, 2.0, 0, 10) == 2.0
    assert cosine_annealing_lr(10, 2.0, 0, 10) == pytest.approx(0.0)
    assert constant_lr(3, 2.0, 0, 10) == 2.0
    cfg = SchedConfig(name="CosineAnnealing", warmup_steps=3, constant_steps=2, min_lr=0.01)
    lrs = _lr_trajectory(cfg, 20, 25, lr=0.3)
    for step, value in enumerate(lrs):
        assert value == pytest.approx(cosine_annealing_lr(step, 0.3, 3, 20, 0.01, 2), abs=1e-12)


def test_scheduler_resume_takes_step_from_state_and_schedule_from_config() -> None:
    cfg = SchedConfig(name="LinearAnnealingWithWarmUp", warmup_steps=2)
    model = _Block()
    opt = build_optimizer(model.named_parameters(), OptimConfig(name="sgd", lr=1.0), False)
    sched = build_scheduler(opt, cfg, 12)
    for _ in range(7):
        opt.step()
        sched.step()
    state = sched.state_dict()
    opt2 = build_optimizer(model.named_parameters(), OptimConfig(name="sgd", lr=1.0), False)
    sched2 = build_scheduler(opt2, cfg, 22)  # longer run on resume
    sched2.load_state_dict(state)
    opt2.step()
    sched2.step()
    assert sched2.last_epoch == 8
    assert opt2.param_groups[0]["lr"] == pytest.approx((22 - 8) / 20)


@pytest.mark.parametrize("cfg,max_steps,match", [
    (SchedConfig(name="Cosine"), 10, "unknown schedule 'Cosine'"),
    (SchedConfig(constant_steps=2), 10, "only CosineAnnealing use constant_steps; remove it for Linear"),
    (SchedConfig(name="CosineAnnealing", min_lr=1.0), 10, "model.optim.sched.min_lr"),
    (SchedConfig(), 0, "schedule length must be >= 1"),
    (SchedConfig(warmup_steps=-1), 10, "must be >= 0"),
])
def test_bad_schedule_settings_error(cfg: SchedConfig, max_steps: int, match: str) -> None:
    opt = build_optimizer(_Block().named_parameters(), OptimConfig(lr=1e-3), False)
    with pytest.raises(ValueError, match=match):
        build_scheduler(opt, cfg, max_steps)


@pytest.mark.parametrize("name", ["CosineAnnealing", "LinearAnnealingWithWarmUp", "WarmupPolicy"])
def test_run_shorter_than_its_warmup_trains_a_truncated_warmup(name: str, caplog: pytest.LogCaptureFixture) -> None:
    """NeMo runs warmup_steps >= the schedule length (NxDT's demo-style warm-up 15 with trainer.max_steps 6): the
    learning rate follows the 15-step ramp for all 6 steps, never reaching lr; warned, not refused (issue 25).
    Expected values are NeMo's ramps written out: CosineAnnealing / WarmupPolicy lr * (s + 1) / (W + 1),
    LinearAnnealingWithWarmUp lr * s / W."""
    opt = build_optimizer(_Block().named_parameters(), OptimConfig(name="sgd", lr=1.0), False)
    with caplog.at_level("WARNING"):
        sched = build_scheduler(opt, SchedConfig(name=name, warmup_steps=15), 6)
    assert "warmup_steps: 15 >= the schedule length 6" in caplog.text and "truncated" in caplog.text
    lrs = []
    for _ in range(6):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    expected = [s / 15 for s in range(6)] if name == "LinearAnnealingWithWarmUp" else [(s + 1) / 16 for s in range(6)]
    assert lrs == pytest.approx(expected)


def test_warmup_hold_beyond_the_run_is_warned(caplog: pytest.LogCaptureFixture) -> None:
    opt = build_optimizer(_Block().named_parameters(), OptimConfig(name="sgd", lr=1.0), False)
    with pytest.raises(ValueError, match="must be >= 0"):
        build_scheduler(opt, SchedConfig(name="WarmupHoldPolicy", warmup_steps=-1), 10)
    with caplog.at_level("WARNING"):
        sched = build_scheduler(opt, SchedConfig(name="WarmupHoldPolicy", warmup_steps=6, hold_steps=6), 10)
    assert "warmup 6 + constant 0 + hold 6 exceed the schedule length 10" in caplog.text
    assert sched.get_last_lr()[0] == pytest.approx(1 / 7)  # NeMo's ramp lr * (0 + 1) / (W + 1) at step 0


def test_cosine_constant_steps_beyond_the_run_hold_min_lr_after_warmup(caplog: pytest.LogCaptureFixture) -> None:
    """NxDT's megatron_gpt example (warmup 750 + constant 80000 > max_steps 20000): NeMo's formula has negative
    decay steps D = M - C - W, so every step after warm-up is past W + D and gets min_lr; warned, not refused."""
    opt = build_optimizer(_Block().named_parameters(), OptimConfig(lr=1.0), False)
    cfg = SchedConfig(name="CosineAnnealing", warmup_steps=4, constant_steps=20, min_lr=0.1)
    with caplog.at_level("WARNING"):
        sched = build_scheduler(opt, cfg, 10)
    assert "holds min_lr 0.1 from the end of warm-up" in caplog.text
    lrs = []
    for _ in range(9):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs == pytest.approx([0.0, 0.25, 0.5, 0.75, 1.0, 0.1, 0.1, 0.1, 0.1])


# ------------------------------------------------------------------------------- more NeMo optimizers (issue 5)

@pytest.mark.parametrize("name,kwargs,cls,expected", [
    ("adadelta", {"rho": 0.8, "eps": 1e-6, "weight_decay": 0.1}, torch.optim.Adadelta,
     {"rho": 0.8, "eps": 1e-6}),
    ("adamax", {"betas": [0.8, 0.9]}, torch.optim.Adamax, {"betas": (0.8, 0.9)}),
    ("adagrad", {"lr_decay": 0.01, "initial_accumulator_value": 0.5}, torch.optim.Adagrad,
     {"lr_decay": 0.01, "initial_accumulator_value": 0.5}),
    ("rmsprop", {"alpha": 0.9, "momentum": 0.5, "centered": True}, torch.optim.RMSprop,
     {"alpha": 0.9, "momentum": 0.5, "centered": True}),
    ("rprop", {"etas": [0.4, 1.3], "step_sizes": [1e-5, 10.0]}, torch.optim.Rprop,
     {"etas": (0.4, 1.3), "step_sizes": (1e-5, 10.0)}),
    ("adam", {"amsgrad": True}, torch.optim.Adam, {"amsgrad": True}),
    ("adafactor", {"decay_rate": -0.5, "clip_threshold": 2.0, "eps": 1e-30}, torch.optim.Adafactor,
     {"beta2_decay": -0.5, "d": 2.0, "eps": (1e-30, 1e-3)}),
])
def test_torch_optimizers_get_nemo_arguments(name: str, kwargs: dict, cls: type, expected: dict) -> None:
    opt = build_optimizer(_Block().named_parameters(), OptimConfig(name=name, lr=0.05, **kwargs), False)
    assert type(opt) is cls
    group = opt.param_groups[0]
    assert group["lr"] == 0.05
    for key, value in expected.items():
        assert group[key] == value, key


@pytest.mark.parametrize("name,kwargs,key", [
    ("rprop", {"weight_decay": 0.1}, "weight_decay"),
    ("adafactor", {"betas": [0.5, 0.9]}, "betas"),
    ("adagrad", {"capturable": True}, "capturable"),
    ("sgd", {"rho": 0.5}, "rho"),
    ("adamw", {"grad_averaging": True}, "grad_averaging"),
    ("novograd", {"momentum": 0.9}, "momentum"),
])
def test_key_the_optimizer_cannot_use_is_an_error(name: str, kwargs: dict, key: str) -> None:
    with pytest.raises(ValueError, match=f"model.optim.{key}: .* is not used by {name}; remove"):
        build_optimizer(_Block().named_parameters(), OptimConfig(name=name, **kwargs), False)


@pytest.mark.parametrize("name", sorted(NEMO_OPTIMIZERS))
def test_every_optimizer_reduces_a_quadratic(name: str) -> None:
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(4, 4))
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    lr = 1.0 if name == "adadelta" else 0.05
    opt = build_optimizer([("w", w)], OptimConfig(name=name, lr=lr), True)
    losses = []
    for _ in range(10):
        opt.zero_grad()
        loss = ((x @ w - y) ** 2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0], (name, losses)


def test_novograd_matches_hand_computed_steps() -> None:
    # betas (0.95, 0.98), eps 0, lr 0.1. Step 1: g = [3, 4], n = 25, d = g / 5 = [0.6, 0.8], m = d.
    p = nn.Parameter(torch.tensor([1.0, 2.0], dtype=torch.float64))
    opt = Novograd([p], lr=0.1, betas=(0.95, 0.98), eps=0.0)
    p.grad = torch.tensor([3.0, 4.0], dtype=torch.float64)
    opt.step()
    torch.testing.assert_close(p.detach(), torch.tensor([1.0 - 0.06, 2.0 - 0.08], dtype=torch.float64))
    # Step 2: g = [0, 5]: n = 0.98 * 25 + 0.02 * 25 = 25, d = [0, 1], m = 0.95 * [0.6, 0.8] + [0, 1].
    p.grad = torch.tensor([0.0, 5.0], dtype=torch.float64)
    opt.step()
    torch.testing.assert_close(p.detach(), torch.tensor([0.94 - 0.057, 1.92 - 0.176], dtype=torch.float64))
    assert opt.state[p]["step"] == 2 and float(opt.state[p]["exp_avg_sq"]) == pytest.approx(25.0)


def test_novograd_weight_decay_grad_averaging_and_amsgrad() -> None:
    # wd 0.5, grad_averaging: d = ([0.6, 0.8] + 0.5 * [1, 2]) * (1 - 0.95) = [0.055, 0.09].
    p = nn.Parameter(torch.tensor([1.0, 2.0], dtype=torch.float64))
    opt = Novograd([p], lr=0.1, betas=(0.95, 0.98), eps=0.0, weight_decay=0.5, grad_averaging=True,
                   amsgrad=True)
    grad = torch.tensor([3.0, 4.0], dtype=torch.float64)
    p.grad = grad.clone()
    opt.step()
    torch.testing.assert_close(p.detach(), torch.tensor([1.0 - 0.0055, 2.0 - 0.009], dtype=torch.float64))
    torch.testing.assert_close(p.grad, grad)  # the gradient is not modified
    # amsgrad: a smaller gradient keeps the max n = 25; n itself becomes 0.98 * 25 + 0.02 * 1.
    p.grad = torch.tensor([0.0, 1.0], dtype=torch.float64)
    opt.step()
    assert float(opt.state[p]["max_exp_avg_sq"]) == pytest.approx(25.0)
    assert float(opt.state[p]["exp_avg_sq"]) == pytest.approx(24.52)
    with pytest.raises(ValueError, match="betas"):
        Novograd([p], betas=(0.9, 1.0))


def test_novograd_built_by_name_uses_param_groups() -> None:
    model = _Block()
    opt = build_optimizer(model.named_parameters(), OptimConfig(name="novograd", betas=[0.95, 0.98],
                                                                weight_decay=0.01), False)
    assert type(opt) is Novograd
    assert [g["weight_decay"] for g in opt.param_groups] == [0.01, 0.0]
    assert opt.param_groups[0]["betas"] == (0.95, 0.98)


# -------------------------------------------------------------------------------- more NeMo schedules (issue 5)

def _expect(lrs: list[float], expected: dict[int, float]) -> None:
    for step, value in expected.items():
        assert lrs[step] == pytest.approx(value, abs=1e-12), step


def test_warmup_policy_and_warmup_hold_policy() -> None:
    # WarmupPolicy: (step+1)/(W+1) up to W = 4, then lr, min_lr past M = 50.
    _expect(_lr_trajectory(SchedConfig(name="WarmupPolicy", warmup_steps=4, min_lr=0.1), 50, 52),
            {0: 0.2, 2: 0.6, 4: 1.0, 5: 1.0, 50: 1.0, 51: 0.1, 52: 0.1})
    # WarmupHoldPolicy: warm-up to W = 4, hold H = 10 steps at lr, constant body, min_lr past M.
    cfg = SchedConfig(name="WarmupHoldPolicy", warmup_steps=4, hold_steps=10, min_lr=0.1)
    _expect(_lr_trajectory(cfg, 50, 52), {0: 0.2, 4: 1.0, 5: 1.0, 13: 1.0, 14: 1.0, 50: 1.0, 51: 0.1})


def test_square_annealing() -> None:
    # W = 9, M = 109: warm-up (step+1)/10, then max(0.01, ((109 - step) / 100) ** 2).
    cfg = SchedConfig(name="SquareAnnealing", warmup_steps=9, min_lr=0.01)
    _expect(_lr_trajectory(cfg, 109, 112), {0: 0.1, 4: 0.5, 9: 1.0, 10: 0.99 ** 2, 59: 0.25, 84: 0.0625,
                                            104: 0.01, 109: 0.01, 110: 0.01, 112: 0.01})


def test_warmup_annealing() -> None:
    # W = 9, M = 109, min_lr 0.1: 0.1 + (1 - (step - 9) / 100) * 0.9 after warm-up.
    cfg = SchedConfig(name="WarmupAnnealing", warmup_steps=9, min_lr=0.1)
    _expect(_lr_trajectory(cfg, 109, 111), {0: 0.1, 4: 0.5, 9: 1.0, 10: 0.991, 59: 0.55, 109: 0.1, 111: 0.1})


def test_noam_annealing() -> None:
    # d_model 16 -> 0.25; W = 4 -> W^-1.5 = 0.125. s = max(1, step): 0.25 * min(s^-0.5, 0.125 s).
    # min_lr 0.05 applies only for s > W; past M = 100 -> min_lr.
    cfg = SchedConfig(name="NoamAnnealing", warmup_steps=4, d_model=16, min_lr=0.05)
    _expect(_lr_trajectory(cfg, 100, 101), {0: 0.03125, 1: 0.03125, 2: 0.0625, 4: 0.125, 16: 0.0625,
                                            64: 0.05, 100: 0.05, 101: 0.05})
    # No warm-up: 0.5 * s^-0.5 with d_model 4.
    _expect(_lr_trajectory(SchedConfig(name="NoamAnnealing", d_model=4), 100, 16), {0: 0.5, 1: 0.5, 4: 0.25,
                                                                                    16: 0.125})
    assert noam_annealing_lr(101, 1.0, 16, 4, 100, 0.0) == 0.0


def test_step_lr_and_exponential_lr_match_torch() -> None:
    _expect(_lr_trajectory(SchedConfig(name="StepLR", step_size=3, gamma=0.5), 100, 9),
            {0: 1.0, 2: 1.0, 3: 0.5, 5: 0.5, 6: 0.25, 9: 0.125})
    _expect(_lr_trajectory(SchedConfig(name="StepLR", step_size=3), 100, 3), {3: 0.1})  # torch default gamma
    ours = _lr_trajectory(SchedConfig(name="ExponentialLR", gamma=0.9), 100, 10, lr=0.3)
    w = nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([w], lr=0.3)
    ref = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.9)
    theirs = [opt.param_groups[0]["lr"]]
    for _ in range(10):
        opt.step()
        ref.step()
        theirs.append(opt.param_groups[0]["lr"])
    assert ours == pytest.approx(theirs, rel=1e-12) and ours[10] == pytest.approx(0.3 * 0.9 ** 10)
    assert step_lr(7, 2.0, 2, 0.5) == 0.25 and exponential_lr(2, 2.0, 0.5) == 0.5


@pytest.mark.parametrize("cfg,match", [
    (SchedConfig(name="NoamAnnealing"), "model.optim.sched.d_model: NoamAnnealing needs d_model"),
    (SchedConfig(name="StepLR"), "model.optim.sched.step_size: StepLR needs step_size"),
    (SchedConfig(name="ExponentialLR"), "model.optim.sched.gamma: ExponentialLR needs gamma"),
    (SchedConfig(name="ExponentialLR", gamma=-1.0), "model.optim.sched.gamma: must be > 0"),
    (SchedConfig(name="StepLR", step_size=0), "StepLR needs step_size >= 1"),
    (SchedConfig(name="ExponentialLR", gamma=0.9, warmup_steps=2), "model.optim.sched.warmup_steps: only"),
    (SchedConfig(name="StepLR", step_size=2, min_lr=0.1), "model.optim.sched.min_lr: only"),
    (SchedConfig(name="CosineAnnealing", hold_steps=2), "only WarmupHoldPolicy use hold_steps"),
    (SchedConfig(name="WarmupAnnealing", d_model=8), "only NoamAnnealing use d_model"),
])
def test_new_schedule_settings_errors(cfg: SchedConfig, match: str) -> None:
    opt = build_optimizer(_Block().named_parameters(), OptimConfig(lr=1.0), False)
    with pytest.raises(ValueError, match=match):
        build_scheduler(opt, cfg, 10)


@pytest.mark.parametrize("sched", [
    {"name": "WarmupAnnealing", "warmup_steps": 3},
    {"name": "NoamAnnealing", "warmup_steps": 3, "d_model": 16},
    {"name": "StepLR", "step_size": 5, "gamma": 0.5},
])
def test_sched_max_steps_interpolation_from_trainer(sched: dict) -> None:
    raw = {
        "trainer": {"devices": 1, "num_nodes": 1, "max_steps": 20},
        "data": {"micro_batch_size": 1, "global_batch_size": 1},
        "model": {"model_config": str(TINY_JSON), "encoder_seq_length": 64,
                  "optim": {"name": "novograd", "lr": 1.0, "sched": {**sched, "max_steps": "${trainer.max_steps}"}}},
    }
    cfg = load_config(raw)
    check_supported(cfg)  # no "not supported yet" for the new names
    assert cfg.model.optim.sched.max_steps == 20
    opt = build_optimizer(_Block().named_parameters(), cfg.model.optim, False)
    sched_obj = build_scheduler(opt, cfg.model.optim.sched, 999)  # sched.max_steps (20) wins
    lrs = [opt.param_groups[0]["lr"]]
    for _ in range(21):
        opt.step()
        sched_obj.step()
        lrs.append(opt.param_groups[0]["lr"])
    if sched["name"] == "WarmupAnnealing":  # W = 3, M = 20: 1 - (step - 3) / 17
        _expect(lrs, {0: 0.25, 3: 1.0, 20: 0.0, 21: 0.0})
        assert lrs[10] == pytest.approx(1 - 7 / 17)
    elif sched["name"] == "NoamAnnealing":  # past M = 20 -> min_lr 0
        assert lrs[20] == pytest.approx(0.25 * 20 ** -0.5) and lrs[21] == 0.0
    else:
        _expect(lrs, {4: 1.0, 5: 0.5, 20: 0.0625})
