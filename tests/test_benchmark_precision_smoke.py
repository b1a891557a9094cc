"""Smoke test of the precision benchmark (benchmarks/precision.py) at a tiny size; not a benchmark itself.

Runs the core function (:func:`benchmarks.precision.measure_mode`) for every mode on the tiny model in this
process, then the analysis, and checks the JSON fields, the ratio definitions (mode / fp32 of the same run), that
the tensors hold exactly the bytes the precision policy predicts, and the worker's command-line path.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import precision  # noqa: E402
from benchmarks.common import SMOKE_MODEL, prepare_assets  # noqa: E402

SEQ_LEN = 64


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory):
    return prepare_assets(tmp_path_factory.mktemp("prec"), SMOKE_MODEL, SEQ_LEN + 1, tokens="bytes")


@pytest.fixture(scope="module")
def raw(assets) -> dict[str, list[dict]]:
    torch.set_num_threads(1)
    tokens = torch.load(assets.tokens)
    return {m.label: [precision.measure_mode(assets.hf_dir, tokens, m, SEQ_LEN, warmup_steps=1, timed_steps=2)]
            for m in precision.MODES}


def test_worker_result_fields(raw) -> None:
    for label, (point,) in raw.items():
        assert point["status"] == "ok" and point["mode"] == label and point["seq_len"] == SEQ_LEN
        assert len(point["step_s"]) == 2 and all(t > 0 for t in point["step_s"])
        assert len(point["losses"]) == 3 and all(abs(x) < 100 for x in point["losses"])
        # VmHWM / VmRSS are read from lazily synced counters: a few pages of slack (tests/test_benchmark_smoke.py)
        assert point["peak_rss"] >= point["rss_after_build"] - 2**20 and point["rss_after_build"] > 0
        assert set(point["state_bytes"]) == {"params", "grads", "master_weights", "optimizer_state", "total"}
        peak = point["step_tensor_peak"]
        assert peak["peak"] == max(peak["forward_backward"], peak["optimizer_step"]) > peak["before"] > 0
        json.dumps(point)


def test_state_bytes_follow_the_policy(raw) -> None:
    """Parameters N: fp32 16N (params 4 + grads 4 + AdamW 8), bf16SR 8N, + fp32 state 12N, mixed 18N."""
    n = raw["fp32"][0]["num_params"]
    expected = {"fp32": 16 * n, "bf16SR": 8 * n, "bf16SR + adamw_fp32OptState": 12 * n, "mixed_precision": 18 * n,
                "mixed_precisionSR": 18 * n, "autocast": 16 * n}
    for label, (point,) in raw.items():
        assert point["predicted_state_bytes"]["total"] == expected[label], label
        # measured from the tensors: the same, plus AdamW's 0-dim fp32 ``step`` counter per parameter tensor
        extra = point["state_bytes"]["total"] - expected[label]
        assert 0 <= extra <= 4 * 64, label
    assert raw["mixed_precision"][0]["state_bytes"]["master_weights"] == 4 * n
    assert raw["bf16SR"][0]["state_bytes"]["master_weights"] == 0


def test_analysis_ratios_are_to_fp32(raw) -> None:
    summary = precision.analyse(raw)["modes"]
    ref = summary["fp32"]
    for label, s in summary.items():
        steps = raw[label][0]["step_s"]
        assert s["tok_s"] == pytest.approx(SEQ_LEN / (sum(steps) / 2))  # median of two = their mean
        for key in precision._RATIO_KEYS:
            assert s[f"{key}_ratio"] == pytest.approx(s[key] / ref[key]), (label, key)
        assert s["state_matches_policy"], label
    assert ref["tok_s_ratio"] == ref["state_bytes_ratio"] == 1.0
    assert summary["bf16SR"]["state_bytes_ratio"] == pytest.approx(0.5, rel=1e-3)
    assert summary["mixed_precision"]["state_bytes_ratio"] == pytest.approx(1.125, rel=1e-3)
    table = precision.markdown_table(summary)
    assert all(f"| {label} |" in table for label in raw) and table.count("\n") == len(raw) + 1


def test_analysis_needs_fp32_and_marks_failures(raw) -> None:
    with pytest.raises(ValueError, match="fp32"):
        precision.analyse({"bf16SR": raw["bf16SR"]})
    out = precision.analyse({"fp32": raw["fp32"], "autocast": [{"status": "over_cap"}]})
    assert "failed: ['over_cap']" in out["markdown"]


def test_round_order_alternates() -> None:
    labels = [m.label for m in precision.MODES]
    assert precision._order(0, labels) == labels
    assert precision._order(1, labels) == labels[::-1]


def test_worker_command_line(assets, tmp_path: Path) -> None:
    """The child's command line (as the harness launches it, here in-process) writes its JSON result."""
    out = tmp_path / "w.json"
    assert precision.main(["worker", "--mode", "autocast", "--hf-dir", assets.hf_dir, "--tokens", assets.tokens,
                           "--seq-len", "32", "--warmup-steps", "1", "--timed-steps", "1", "--threads", "1",
                           "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["status"] == "ok" and result["precision"] == "autocast" and "step_tensor_peak" not in result
    with pytest.raises(ValueError, match="--mode"):
        precision.main(["worker", "--mode", "fp16", "--hf-dir", assets.hf_dir, "--tokens", assets.tokens,
                        "--out", str(out)])
