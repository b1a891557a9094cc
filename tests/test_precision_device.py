"""What a precision mode's dtypes become on the device (issue 38): torch-xla's float32 -> bf16 flags are never set
by the run and refused when preset on xla / neuron, the dry run states each tensor class's on-device dtype, and the
optimizer does not round a second time where Neuron's runtime rounds stochastically.

torch-xla's own behaviour under the flags (the source of :func:`nxd_lc.precision.policy.device_dtype`) is checked
against real XLA tensors in fresh processes (lane 2); the rest runs everywhere."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from nxd_lc.config.errors import ConfigError
from nxd_lc.config.schema import NxdConfig
from nxd_lc.precision import resolve_precision
from nxd_lc.precision.policy import device_dtype

pytestmark = pytest.mark.compat

REPO = Path(__file__).resolve().parents[1]
F32, F64, BF16 = torch.float32, torch.float64, torch.bfloat16
TINY_RAW: dict[str, Any] = {"trainer": {"devices": 1, "max_steps": 2}, "distributed_strategy": {},
                            "data": {"micro_batch_size": 1, "global_batch_size": 1},
                            "model": {"encoder_seq_length": 64,
                                      "model_config": str(REPO / "conf" / "tiny_llama_config.json")}}


def _raw(accelerator: str, ptype: str = "mixed_precision") -> dict[str, Any]:
    return {**TINY_RAW, "trainer": {**TINY_RAW["trainer"], "accelerator": accelerator},
            "precision": {"type": ptype}}


# (platform, environment) -> what float32 / float64 become; pytorch/xla torch_xla/csrc/dtype.cpp
@pytest.mark.parametrize("platform,env,f32,f64", [
    ("cpu", {"XLA_USE_BF16": "1"}, F32, F64),  # the flags mean nothing off torch-xla
    ("neuron_native", {"XLA_DOWNCAST_BF16": "1"}, F32, F64),
    ("xla", {}, F32, F64),
    ("xla", {"XLA_DOWNCAST_BF16": "1"}, BF16, F32),
    ("xla", {"XLA_USE_BF16": "true"}, BF16, BF16),
    ("xla", {"XLA_USE_BF16": "0", "XLA_DOWNCAST_BF16": "false"}, F32, F64),
    ("neuron", {}, F32, F32),  # Neuron has no f64
])
def test_device_dtype_follows_torch_xla(platform: str, env: dict[str, str], f32: torch.dtype,
                                        f64: torch.dtype) -> None:
    assert (device_dtype(F32, platform, env), device_dtype(F64, platform, env)) == (f32, f64)
    assert device_dtype(BF16, platform, env) == BF16


@pytest.mark.parametrize("var", ["XLA_USE_BF16", "XLA_DOWNCAST_BF16"])
def test_a_preset_bf16_flag_is_refused_on_xla_naming_the_variable(var: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from nxd_lc.app.validation import load_config

    monkeypatch.setenv(var, "1")
    with pytest.raises(ConfigError) as info:
        load_config(_raw("xla"))
    lines = [p for p in info.value.problems if var in p]
    assert len(lines) == 1 and lines[0].startswith(f"trainer.accelerator xla: {var}=1 is set in the environment")
    assert f"unset {var}" in lines[0]
    load_config(_raw("cpu"))  # inert off torch-xla: accepted
    monkeypatch.setenv(var, "0")
    load_config(_raw("xla"))


def test_dry_run_states_the_on_device_dtypes_on_xla() -> None:
    from nxd_lc.app.run import dry_run
    from nxd_lc.app.validation import load_config

    report = dry_run(load_config(_raw("xla")))
    line = [x for x in report.splitlines() if "on the device (xla)" in x]
    assert line == ["# mixed_precision on the device (xla): parameters bf16, gradients bf16, grad accumulation f32, "
                    "master weights f32, optimizer state f32, TP/SP reductions f32, DP reductions f32, "
                    "norm statistics f32, loss f32"]
    assert "on the device" not in dry_run(load_config(_raw("cpu")))


def test_described_dtypes_under_a_flag_are_what_torch_xla_would_hold() -> None:
    """Were XLA_DOWNCAST_BF16 set (it is refused), the report would say so rather than claim f32."""
    cfg = NxdConfig()
    cfg.precision.type = "bf16SR"
    text = resolve_precision(cfg).describe_on_device("xla", {"XLA_DOWNCAST_BF16": "1"})
    assert "SR working copy bf16" in text and "loss bf16" in text and "parameters bf16" in text


def test_hardware_rounding_only_on_a_neuron_device_with_the_runtime_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    from nxd_lc.precision import stochastic_rounding as sr

    on = {"NEURON_RT_STOCHASTIC_ROUNDING_EN": "1"}
    assert sr.hardware_rounding(SimpleNamespace(type="neuron"), on)
    assert not sr.hardware_rounding(SimpleNamespace(type="neuron"), {"NEURON_RT_STOCHASTIC_ROUNDING_EN": "0"})
    assert not sr.hardware_rounding(torch.device("cpu"), on)
    monkeypatch.setattr(sr, "xla_hardware", lambda: "NEURON")
    assert sr.hardware_rounding(SimpleNamespace(type="xla"), on)
    monkeypatch.setattr(sr, "xla_hardware", lambda: "CPU")
    assert not sr.hardware_rounding(SimpleNamespace(type="xla"), on)


@pytest.mark.parametrize("hardware", [False, True])
def test_optimizer_rounds_once(hardware: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """mixed_precisionSR: software stochastic rounding of the master into the bf16 parameter, or -- where the Neuron
    runtime rounds the cast itself -- a plain cast (round to nearest on this CPU), never both."""
    from nxd_lc.optim import wrapper
    from nxd_lc.optim.wrapper import NxDOptimizer

    monkeypatch.setattr(wrapper, "hardware_rounding", lambda device: hardware)
    cfg = NxdConfig()
    cfg.precision.type = "mixed_precisionSR"
    policy = resolve_precision(cfg)
    p = torch.nn.Parameter(torch.full((4096,), 1.0, dtype=BF16))
    opt = NxDOptimizer([{"params": [p]}], lambda groups: torch.optim.SGD(groups, lr=1.0), policy, seed=0)
    p.grad = torch.full((4096,), -1e-3, dtype=BF16)  # master 1.0 -> ~1.001: a quarter of a bf16 step above 1.0
    opt.step()
    master = opt.slots[0].work.detach()
    ups = int((p.detach() > 1.0).sum())
    if hardware:
        assert torch.equal(p.detach(), master.to(BF16)) and ups == 0
    else:  # P(up) = 0.128 (1.001 lies 0.128 of a bf16 ulp of 2**-7 above 1.0)
        assert 300 < ups < 800, ups


def _xla_types(env: dict[str, str]) -> str:
    code = ("import torch, torch_xla\n"
            "from nxd_lc.runtime.xla import device_type_name\n"
            "d = torch_xla.device()\n"
            "print(*(device_type_name(torch.ones(2, dtype=t, device=d)) for t in "
            "(torch.float32, torch.float64, torch.bfloat16)))\n")
    import os

    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PJRT_DEVICE": "CPU", **env},
                         capture_output=True, text=True, timeout=120, check=True)
    return out.stdout.split()[-3:]


@pytest.mark.xla
@pytest.mark.parametrize("env", [{}, {"XLA_DOWNCAST_BF16": "1"}, {"XLA_USE_BF16": "1"}])
def test_device_dtype_matches_torch_xla_itself(env: dict[str, str]) -> None:
    pytest.importorskip("torch_xla")
    short = {F32: "f32", F64: "f64", BF16: "bf16"}
    got = _xla_types({"XLA_USE_BF16": "0", "XLA_DOWNCAST_BF16": "0", **env})
    assert got == [short[device_dtype(t, "xla", env)] for t in (F32, F64, BF16)]
