"""Smoke test of the pipeline-bubble benchmark (benchmarks/pipeline_bubble.py) at a tiny size; not a benchmark.

The whole harness runs once with ``--smoke`` (PP=2 over two gloo processes plus the PP=1 reference, tiny model,
m = 4) and the result JSON is checked: every field of the table exists, the bubble is a fraction in [0, 1), PP=2
reproduces the PP=1 loss. Two in-process checks cover the pieces the figures rest on: the 1F1B simulation gives
the closed form (p-1)/(m+p-1) for equal stages, and the hook clock sees every forward and backward.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import pipeline_bubble  # noqa: E402
from benchmarks.pipeline_schedule import StageClock, formula_bubble, simulate_1f1b  # noqa: E402


@pytest.mark.slow
@pytest.mark.distributed
def test_smoke_run_writes_the_table_fields(tmp_path: Path) -> None:
    out = tmp_path / "pipeline_bubble.json"
    assert pipeline_bubble.main(["--smoke", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    (row,) = result["analysis"]["rows"]
    assert (row["m"], row["p"]) == (4, 2)
    assert row["formula"] == pytest.approx(1 / 5)
    for key in ("bubble_idle", "bubble_alone", "bubble_simulated"):
        assert 0 <= row[key] < 1, key
    assert row["ratio"] == pytest.approx(row["bubble_idle"] / row["formula"])
    assert len(row["memory_vs_pp1"]) == 2 and all(0 < x < 1.5 for x in row["memory_vs_pp1"])
    assert row["loss_pp2"] == pytest.approx(row["loss_pp1"], abs=1e-5)
    assert all(r["hooks_saw_every_micro_batch"] for r in row["ranks"])
    assert "| 4 | 2 |" in result["analysis"]["markdown"]
    assert out.with_suffix(".md").exists()


@pytest.mark.parametrize("p,m", [(2, 2), (2, 4), (2, 8), (3, 5), (4, 8)])
def test_simulated_1f1b_with_equal_stages_is_the_formula(p: int, m: int) -> None:
    sim = simulate_1f1b([1.0] * p, [2.0] * p, m)
    assert sim["makespan_s"] == pytest.approx((m + p - 1) * 3.0)
    assert sim["bubble_per_rank"] == pytest.approx([formula_bubble(p, m)] * p)


def test_stage_clock_sees_every_forward_and_backward() -> None:
    module = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16))
    clock = StageClock(module)
    x = torch.randn(4, 16, requires_grad=True)
    module(x).sum().backward()  # not recording: nothing is kept
    assert clock.events == []
    clock.recording = True
    for _ in range(3):
        module(x).sum().backward()
    durations = clock.take()
    assert len(durations["fwd_s"]) == len(durations["bwd_s"]) == 3
    assert all(t > 0 for t in durations["fwd_s"] + durations["bwd_s"])
    assert clock.events == []
