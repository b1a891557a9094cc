"""Dropless mixture-of-experts on torch-xla (lane 2): static shapes, no host read, the CPU result.

Found by NxDT's ``hf_mixtral_8x7b_dropless_config`` and ``megatron_mixtral_8x7b_dropless_config`` shrunk to
TP 2 x PP 2 on the multi-device test bed (issue 39): the dropless capacity was the largest expert load, read back to
the host in every MoE layer (a new graph, i.e. a compile, for every new value, and under pipeline parallelism the
reads broke the stages' ordered graph cuts: XLA's collective abort). On XLA a dropless layer now keeps ``T`` slots
per expert (an expert takes a token at most once: nothing is dropped, as NxD's dropless training computes every
expert over every token). One XLA device against the same layer on CPU (:func:`xla_scenarios_nxdt.
dropless_moe_steps`): outputs and input gradients within 1e-5 relative, and after the first batch no device-to-host
read and, for the third batch's other expert loads, no compile.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch_xla")
pytestmark = pytest.mark.xla  # lane 2 (make test-xla)

from xla_testbed import run_on_xla_devices  # noqa: E402


def test_dropless_moe_on_xla_has_static_shapes_and_the_cpu_result() -> None:
    (r,) = run_on_xla_devices("xla_scenarios_nxdt:dropless_moe_steps", 1, {"batches": 3}).results
    assert r["out"] < 1e-5 and r["grads"] < 1e-5, r
    assert r["reads_after_first"] == [0, 0], r
    assert r["compiles_after_first"][-1] == 0, r  # batch 2 compiles the gradient accumulation once
