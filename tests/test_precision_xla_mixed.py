"""The mixed-precision modes of ``tests/test_precision_xla.py`` (same comparison, a file of its own so that
pytest-xdist can run the two halves on two workers): mixed_precision, mixed_precisionSR and manual with
``xla_downcast_bf16: '1'`` + master weights + fp32 accumulation, each under its own environment table, on one XLA
device and on TP 2 + SP x ZeRO-1 DP 2 against CPU."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("torch_xla")
pytestmark = pytest.mark.xla  # lane 2 (make test-xla)

import test_precision_xla  # noqa: E402
from test_precision_xla import ACCEPTANCE_MODES, LOCAL_MODES, MODES, check_mode  # noqa: E402

run_environment = test_precision_xla.run_environment  # the fixture, shared


@pytest.mark.parametrize("mode_id", [pytest.param(m, marks=pytest.mark.xla_acceptance) if m in ACCEPTANCE_MODES
                                     else m for m in MODES if m not in LOCAL_MODES])
def test_mode_holds_on_xla_under_the_run_environment(mode_id: str, tmp_path: Any, run_environment: Any) -> None:
    check_mode(mode_id, tmp_path, run_environment)
