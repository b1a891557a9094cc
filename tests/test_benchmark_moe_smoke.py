"""Smoke test of the mixture-of-experts benchmark (benchmarks/moe.py) at its ``--smoke`` size; not a benchmark.

Runs two configurations (EP 1 dropless and EP 2 capacity, 2 gloo processes each; the other two differ from these
only in one of the two switches) and checks the JSON, the ratio definitions (against ep1_dropless of the same run),
the dropped shares and the per-rank state bytes against the closed form of what EP 2 removes: half of every expert
weight, its gradient and its two AdamW moments.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import moe  # noqa: E402


@pytest.mark.extended  # make test-extended (CI time: a benchmark harness; MoE routing, EP and dispatch are
@pytest.mark.distributed  # tested by tests/test_moe_layer.py, test_moe_config.py and test_mixtral.py)
@pytest.mark.slow
@pytest.mark.lane1_only
def test_moe_benchmark_smoke(tmp_path: Path) -> None:
    out = tmp_path / "moe.json"
    result = moe.main(["--smoke", "--configs", "ep1_dropless", "ep2_capacity", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["rows"] == result["rows"] and out.with_suffix(".md").read_text().startswith("| config |")
    rows = {r["label"]: r for r in result["rows"]}
    assert list(rows) == ["ep1_dropless", "ep2_capacity"]
    base = rows["ep1_dropless"]
    assert base["tok_s_ratio"] == 1.0 and base["rss_ratio"] == 1.0
    for r in rows.values():
        assert r["tok_s"] > 0 and r["tok_s_ratio"] == pytest.approx(r["tok_s"] / base["tok_s"])
    cfg = json.loads(moe.CONFIG.read_text())
    layers, e, h, i = 2, cfg["num_local_experts"], cfg["hidden_size"], cfg["intermediate_size"]
    expert_floats = layers * e * (2 * i * h + h * i)  # gate_up [E, 2I, H] + down [E, H, I] per layer
    removed = expert_floats // 2 * 4 * 4  # half the experts x (weight, grad, exp_avg, exp_avg_sq) x fp32 bytes
    assert rows["ep1_dropless"]["state_bytes"] - rows["ep2_capacity"]["state_bytes"] == removed
    assert rows["ep1_dropless"]["dropped"] == 0.0
    assert 0.0 <= rows["ep2_capacity"]["dropped"] < 1.0
