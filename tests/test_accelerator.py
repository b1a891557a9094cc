"""``trainer.accelerator`` selection for the native Neuron device (TorchNeuron, PrivateUse1) and the torch-xla path,
with the detection mocked (no Neuron hardware here), and the rule that model code names no device type."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from nxd_lc.app.validation import load_config
from nxd_lc.config.errors import ConfigError
from nxd_lc.runtime import accel, device, xla

pytestmark = pytest.mark.compat

REPO = Path(__file__).resolve().parents[1]
TINY_JSON = str(REPO / "conf" / "tiny_llama_config.json")


@pytest.fixture(autouse=True)
def _fresh_probes() -> Any:
    accel.native_neuron_available.cache_clear()
    yield
    accel.native_neuron_available.cache_clear()


ISOLATED_ENV = "NXD_LC_PRIVATEUSE1_CHILD"


@pytest.fixture
def neuron_device_type() -> str:
    """Make ``torch.device("neuron")`` constructible, as importing torch_neuronx does (it names the PrivateUse1
    backend ``neuron``). The rename is process-wide and irreversible, and afterwards ``torch.accelerator`` reports
    a ``neuron`` accelerator with no ``torch.neuron`` module, which breaks ``torch.utils.checkpoint`` for the
    rest of the process; so tests using this fixture run only in the child interpreter that
    :func:`test_privateuse1_tests_in_a_fresh_interpreter` starts."""
    if os.environ.get(ISOLATED_ENV) != "1":
        pytest.skip("renames PrivateUse1: runs in a fresh interpreter (test_privateuse1_tests_in_a_fresh_interpreter)")
    if torch._C._get_privateuse1_backend_name() == "privateuseone":
        torch.utils.rename_privateuse1_backend(accel.NEURON_DEVICE_TYPE)
    assert torch._C._get_privateuse1_backend_name() == accel.NEURON_DEVICE_TYPE
    return accel.NEURON_DEVICE_TYPE


PRIVATEUSE1_TESTS = ["test_accelerator_device_selects_the_local_rank", "test_native_neuron_trainer_arguments"]


def test_privateuse1_tests_in_a_fresh_interpreter() -> None:
    """Runs the tests that rename the PrivateUse1 backend in a child pytest, and requires every one to pass."""
    if os.environ.get(ISOLATED_ENV) == "1":
        pytest.skip("this is the child run")
    env = {**os.environ, ISOLATED_ENV: "1"}
    ids = [f"{Path(__file__).relative_to(REPO)}::{name}" for name in PRIVATEUSE1_TESTS]
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *ids],
                          check=False, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert f"{len(PRIVATEUSE1_TESTS)} passed" in proc.stdout, proc.stdout[-2000:]


def _host(monkeypatch: pytest.MonkeyPatch, *, torch_version: tuple[int, int], neuronx_imports: bool,
          accelerator_type: str | None, xla_neuron: bool = False) -> None:
    """A host as torch-neuronx would present it: torch version, whether torch_neuronx imports, the
    ``torch.accelerator`` device type, and whether the torch-xla based neuron stack is there."""
    monkeypatch.setattr(accel, "torch_version", lambda: torch_version)
    monkeypatch.setattr(accel, "_torch_neuronx_imports", lambda: neuronx_imports)
    monkeypatch.setattr(accel, "current_accelerator_type", lambda: accelerator_type)
    monkeypatch.setattr(xla, "neuron_available", lambda: xla_neuron)


@pytest.mark.parametrize("torch_version, neuronx, acc_type, expected", [
    ((2, 13), True, "neuron", True),  # TorchNeuron on torch 2.13: the native device
    ((2, 10), True, "neuron", True),  # the first native release
    ((2, 9), True, "neuron", False),  # torch 2.9's torch-neuronx is torch-xla based, whatever it registers
    ((2, 13), False, "neuron", False),  # PyPI's placeholder torch-neuronx raises ImportError
    ((2, 13), True, None, False),  # torch_neuronx imports but no device is registered / present
    ((2, 13), True, "cuda", False),  # a CUDA host with torch_neuronx installed
])
def test_native_neuron_detection(monkeypatch: pytest.MonkeyPatch, torch_version: tuple[int, int], neuronx: bool,
                                 acc_type: str | None, expected: bool) -> None:
    _host(monkeypatch, torch_version=torch_version, neuronx_imports=neuronx, accelerator_type=acc_type)
    assert accel.native_neuron_available() is expected


def test_neuron_resolves_to_the_native_device_on_torch_2_10_and_later(monkeypatch: pytest.MonkeyPatch) -> None:
    _host(monkeypatch, torch_version=(2, 13), neuronx_imports=True, accelerator_type="neuron", xla_neuron=False)
    assert device.resolve_accelerator("neuron") == "neuron_native"
    assert device.resolve_accelerator("auto") == "neuron_native"  # auto: neuron first
    assert not device.is_xla_accelerator("neuron_native")
    assert not device.is_lazy_config_accelerator("neuron")


def test_neuron_resolves_to_torch_xla_on_torch_2_9(monkeypatch: pytest.MonkeyPatch) -> None:
    _host(monkeypatch, torch_version=(2, 9), neuronx_imports=True, accelerator_type=None, xla_neuron=True)
    assert device.resolve_accelerator("neuron") == "neuron"
    assert device.resolve_accelerator("auto") == "neuron"
    assert device.is_xla_accelerator("neuron")
    assert device.is_lazy_config_accelerator("neuron") and device.is_lazy_config_accelerator("auto")


def test_neuron_without_torch_neuronx_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    _host(monkeypatch, torch_version=(2, 13), neuronx_imports=False, accelerator_type=None, xla_neuron=False)
    with pytest.raises(ConfigError, match="trainer.accelerator: 'neuron'.*torch-neuronx >= 2.10"):
        device.resolve_accelerator("neuron")
    assert device.resolve_accelerator("auto") in ("cpu", "gpu")  # auto falls through to CUDA / CPU


def _ring_raw(accelerator: str) -> dict[str, Any]:
    return {"trainer": {"devices": 2, "num_nodes": 1, "max_steps": 2, "accelerator": accelerator},
            "distributed_strategy": {"context_parallel_size": 2, "context_parallel_algo": "ring"},
            "data": {"micro_batch_size": 1, "global_batch_size": 1},
            "model": {"model_config": TINY_JSON, "encoder_seq_length": 64}}


def test_ring_context_parallelism_on_either_neuron_resolution(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ring CP is accepted for the torch-xla based neuron (collective permute) and on the native (eager) device."""
    _host(monkeypatch, torch_version=(2, 9), neuronx_imports=True, accelerator_type=None, xla_neuron=True)
    assert load_config(_ring_raw("neuron"), world_size=None,
                       check_paths=False).distributed_strategy.context_parallel_algo == "ring"
    accel.native_neuron_available.cache_clear()
    _host(monkeypatch, torch_version=(2, 13), neuronx_imports=True, accelerator_type="neuron", xla_neuron=False)
    cfg = load_config(_ring_raw("neuron"), world_size=None, check_paths=False)
    assert cfg.distributed_strategy.context_parallel_algo == "ring"


def test_process_group_backend_comes_from_torch_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    from nxd_lc.runtime.device import default_backend

    registry = {"cpu": "gloo", "cuda": "nccl", "neuron": "neuron"}  # what torch_neuronx's import registers
    monkeypatch.setattr(torch.distributed.Backend, "default_device_backend_map", registry)
    assert default_backend("neuron") == "neuron"
    assert default_backend("cuda") == "nccl" and default_backend("cpu") == "gloo"
    with pytest.raises(ValueError, match="unsupported device type 'tpu'"):
        default_backend("tpu")


def test_accelerator_device_selects_the_local_rank(monkeypatch: pytest.MonkeyPatch, neuron_device_type: str) -> None:
    chosen: list[int] = []
    monkeypatch.setattr(accel, "current_accelerator_type", lambda: "neuron")
    monkeypatch.setattr(torch.accelerator, "device_count", lambda: 2)
    monkeypatch.setattr(torch.accelerator, "set_device_index", chosen.append)
    assert accel.accelerator_device(1) == torch.device("neuron", 1) and chosen == [1]
    with pytest.raises(RuntimeError, match="LOCAL_RANK 2 but this node has 2 neuron device"):
        accel.accelerator_device(2)
    monkeypatch.setattr(accel, "current_accelerator_type", lambda: None)
    with pytest.raises(RuntimeError, match="no accelerator is available"):
        accel.accelerator_device(0)


def test_native_neuron_trainer_arguments(monkeypatch: pytest.MonkeyPatch, neuron_device_type: str) -> None:
    """The native device gets nxd_lc's device accelerator, the NxD strategy with the 'neuron' backend, and
    autocast on the 'neuron' device type (not Lightning's 'gpu' / 'cuda' defaults)."""
    from pytorch_lightning.plugins.precision import MixedPrecision

    from nxd_lc.lightning.native import NxDDeviceAccelerator
    from nxd_lc.lightning.strategy import NxDStrategy
    from nxd_lc.lightning.trainer import _backend_kwargs

    monkeypatch.setattr(accel, "current_accelerator_type", lambda: "neuron")
    monkeypatch.setattr(torch.accelerator, "device_count", lambda: 4)
    runtime = device.RuntimeInfo("neuron_native", torch.device("neuron", 0), "neuron", 0, 0, 1)
    raw = _ring_raw("cpu")
    raw["precision"] = {"type": "autocast"}
    kwargs = _backend_kwargs(load_config(raw, world_size=None, check_paths=False), runtime)
    assert isinstance(kwargs["accelerator"], NxDDeviceAccelerator)
    assert isinstance(kwargs["strategy"], NxDStrategy)
    assert kwargs["strategy"]._process_group_backend == "neuron"
    (plugin,) = kwargs["plugins"]
    assert isinstance(plugin, MixedPrecision) and plugin.device == "neuron" and plugin.precision == "bf16-mixed"
    raw["precision"] = {"type": "fp32"}
    fp32 = _backend_kwargs(load_config(raw, world_size=None, check_paths=False), runtime)
    assert fp32["precision"] == "32-true" and "plugins" not in fp32
    acc = kwargs["accelerator"]
    assert acc.parse_devices("auto") == [0, 1, 2, 3] and acc.parse_devices(2) == [0, 1]
    assert acc.get_parallel_devices([1, 3]) == [torch.device("neuron", 1), torch.device("neuron", 3)]
    with pytest.raises(ValueError, match="trainer.devices"):
        acc.parse_devices(0)


# ---- no accelerator device type named in model code ------------------------------------------------------------

MODEL_CODE = ["models", "layers", "context", "distributed", "precision", "optim"]


def _device_literals(path: Path) -> list[str]:
    """``'cuda'`` / ``'cpu'`` string constants in ``path`` outside docstrings, as ``file:line``."""
    tree = ast.parse(path.read_text())
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr)
                  and isinstance(node.body[0].value, ast.Constant)}
    return [f"{path.relative_to(REPO)}:{node.lineno}" for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and node.value in ("cuda", "cpu") and id(node) not in docstrings]


def test_device_literal_scan_finds_literals(tmp_path: Path) -> None:
    probe = REPO / "nxd_lc" / "_probe_literals.py"
    probe.write_text('"""doc names "cpu" freely."""\nx = "cuda"\ndef f():\n    """cpu"""\n    return "cpu"\n')
    try:
        assert _device_literals(probe) == ["nxd_lc/_probe_literals.py:2", "nxd_lc/_probe_literals.py:5"]
    finally:
        probe.unlink()


def test_model_code_names_no_device_type() -> None:
    files = [p for d in MODEL_CODE for p in sorted((REPO / "nxd_lc" / d).rglob("*.py"))]
    assert len(files) > 20
    found = [hit for f in files for hit in _device_literals(f)]
    assert found == [], f"device-type literals in model code (use the tensor's device or nxd_lc.runtime.accel): {found}"
