"""``model.optim.capturable: true`` on torch-xla: Adam / AdamW stay finite at learning rate 0
(:mod:`nxd_lc.optim.capturable`).

torch's capturable Adam, one tensor at a time (its path on xla devices), writes ``0 / -0 = NaN`` into every
element whose second moment is 0 when lr is 0 (pytorch/pytorch#126514). Found by NxDT's ``megatron_gpt_config``
shrunk on one XLA device (issue 39): Megatron's warm-up starts at lr 0, the file sets ``capturable: True``, and
every parameter element with a zero gradient so far (embedding rows of unseen tokens) became NaN in the first
optimizer step; the second step's loss was NaN.

CPU (both lanes): nxd_lc's twins equal torch's non-capturable optimizers step for step through a schedule that
starts at lr 0, with elements whose gradient is always 0, with and without amsgrad and weight decay. XLA (lane 2,
one XLA device in a child process): ``build_optimizer(..., capturable=True)`` over XLA parameters takes the step
on the device (step count an XLA tensor) and equals the CPU result; torch's own capturable AdamW there gives NaN
(so the first check fails without the fix).
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
import torch

from nxd_lc.config.schema import OptimConfig
from nxd_lc.optim import build_optimizer
from nxd_lc.optim.capturable import CapturableAdam, CapturableAdamW

pytestmark = pytest.mark.compat

LRS = [0.0, 1e-2, 5e-3, 0.0, 2e-3]  # Megatron's warm-up starts at 0; a 0 later too


def _params(seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(6, 4, generator=gen), torch.randn(5, generator=gen)]


def _grads(step: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    g0 = torch.randn(6, 4, generator=gen)
    g0[2:4] = 0.0  # rows that never get a gradient (unseen tokens' embedding rows)
    return [g0, torch.randn(5, generator=gen)]


def _run(opt_cls: type, params: list[torch.Tensor], **kwargs: Any) -> list[torch.Tensor]:
    ps = [torch.nn.Parameter(p.clone()) for p in params]
    opt = opt_cls(ps, lr=LRS[0], **kwargs)
    for step, lr in enumerate(LRS):
        for group in opt.param_groups:
            group["lr"] = lr
        for p, g in zip(ps, _grads(step)):
            p.grad = g.to(p.device)
        opt.step()
    return [p.detach().cpu() for p in ps]


@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("twin,torch_cls,wd", [(CapturableAdamW, torch.optim.AdamW, 0.1),
                                               (CapturableAdam, torch.optim.Adam, 0.1),
                                               (CapturableAdamW, torch.optim.AdamW, 0.0)])
def test_twin_equals_torch_non_capturable_on_cpu(twin: type, torch_cls: type, wd: float, amsgrad: bool) -> None:
    params = _params()
    kwargs = {"betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": wd, "amsgrad": amsgrad}
    want = _run(torch_cls, params, **kwargs)
    got = _run(twin, params, capturable=True, foreach=False, **kwargs)
    for g, w in zip(got, want):
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-7)


def test_lr_zero_leaves_parameters_unchanged_and_advances_the_state() -> None:
    p = torch.nn.Parameter(torch.tensor([1.0, 2.0, 3.0]))
    opt = CapturableAdamW([p], lr=0.0, weight_decay=0.1, capturable=True, foreach=False)
    p.grad = torch.tensor([0.5, 0.0, -1.0])
    opt.step()
    assert torch.equal(p.detach(), torch.tensor([1.0, 2.0, 3.0]))
    state = opt.state[p]
    assert float(state["step"]) == 1.0 and float(state["exp_avg_sq"][1]) == 0.0 and float(state["exp_avg"][0]) > 0


def test_twin_refuses_settings_it_does_not_implement() -> None:
    p = torch.nn.Parameter(torch.ones(2))
    p.grad = torch.ones(2)
    with pytest.raises(ValueError, match="capturable=True"):
        CapturableAdamW([p], lr=1e-3, capturable=True, foreach=False, maximize=True).step()


def test_cpu_parameters_keep_torch_optimizer() -> None:
    """CPU parameters: capturable is dropped (torch refuses it there) and torch's own class steps."""
    opt = build_optimizer([("w", torch.nn.Parameter(torch.ones(3, 3)))], OptimConfig(name="adamw", capturable=True),
                          False)
    assert type(opt) is torch.optim.AdamW and opt.param_groups[0]["capturable"] is False


_XLA_SCRIPT = """
import json, sys, torch, torch_xla
sys.path.insert(0, {tests!r})
from test_capturable_adam import LRS, _grads, _params, _run
from nxd_lc.config.schema import OptimConfig
from nxd_lc.optim import build_optimizer
dev = torch_xla.device()
out = {{}}
for name in ("adamw", "adamw_fp32OptState", "adam"):
    ps = [torch.nn.Parameter(p.to(dev)) for p in _params()]
    opt = build_optimizer([(f"p{{i}}", p) for i, p in enumerate(ps)],
                          OptimConfig(name=name, capturable=True, betas=[0.9, 0.95], weight_decay=0.1), True)
    for step, lr in enumerate(LRS):
        for group in opt.param_groups:
            group["lr"] = lr
        for p, g in zip(ps, _grads(step)):
            p.grad = g.to(dev)
        opt.step()
    state = opt.state[ps[0]]
    out[name] = {{"type": type(opt).__name__, "step_device": state["step"].device.type,
                 "params": [p.detach().cpu().tolist() for p in ps]}}
plain = _run(lambda ps, **kw: torch.optim.AdamW(ps, **kw), [p.to(dev) for p in _params()], capturable=True,
             betas=(0.9, 0.95), weight_decay=0.1)
out["torch_capturable_finite"] = all(bool(torch.isfinite(p).all()) for p in plain)
print("RESULT" + json.dumps(out))
"""


@pytest.mark.xla
def test_capturable_adam_on_xla_is_finite_at_lr_zero_and_equals_cpu() -> None:
    pytest.importorskip("torch_xla")
    import json
    import os

    tests = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "PJRT_DEVICE": "CPU", "PYTHONPATH": os.path.dirname(tests)}
    proc = subprocess.run([sys.executable, "-c", _XLA_SCRIPT.format(tests=tests)], env=env, capture_output=True,
                          text=True, timeout=300, check=False)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT")]
    assert proc.returncode == 0 and lines, proc.stdout[-2000:] + proc.stderr[-4000:]
    out = json.loads(lines[0][len("RESULT"):])
    # torch's own path: the bug the twin avoids (if torch fixes it, the twin can go)
    assert out.pop("torch_capturable_finite") is False
    for name, torch_cls in (("adamw", torch.optim.AdamW), ("adamw_fp32OptState", torch.optim.AdamW),
                            ("adam", torch.optim.Adam)):
        r = out[name]
        assert r["type"] == ("CapturableAdam" if name == "adam" else "CapturableAdamW"), r["type"]
        assert r["step_device"] == "xla"  # the step count stays on the device (no host read per step)
        want = _run(torch_cls, _params(), betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
        for g, w in zip(r["params"], want):
            torch.testing.assert_close(torch.tensor(g), w, rtol=1e-5, atol=1e-6)
