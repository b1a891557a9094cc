"""benchmarks/profile_step.py: op names fall into the intended categories, and a smoke run's profiled GEMM FLOPs
match the recomputation each configuration is supposed to do (closed form from the model's shapes, not from
the benchmark)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.common import SMOKE_MODEL
from benchmarks.profile_step import categorise, main


@pytest.mark.parametrize(("name", "category"), [
    ("aten::mm", "gemm"), ("aten::addmm", "gemm"), ("aten::bmm", "gemm"),
    ("aten::_scaled_dot_product_flash_attention_for_cpu", "attention"),
    ("aten::_scaled_dot_product_flash_attention_for_cpu_backward", "attention"),
    ("aten::_log_softmax", "loss"), ("aten::nll_loss_forward", "loss"),
    ("aten::copy_", "copy_layout"), ("aten::cat", "copy_layout"),
    ("aten::mul", "other"), ("aten::silu", "other"), ("Optimizer.step#AdamW.step", "other"),
])
def test_categorise(name: str, category: str) -> None:
    assert categorise(name) == category


def _gemm_factors(m: dict) -> dict[str, float]:
    """Expected profiled GEMM FLOPs / (6 x matmul parameters x tokens) per configuration.

    One step without recomputation does 6 FLOPs per matmul parameter per token (2 forward + 4 backward). Full
    checkpointing re-runs each decoder layer's forward once more (+2 per layer parameter, not the LM head) except
    the tiled MLP's chunks, which its own backward re-runs instead (so +2 per MLP parameter once, not twice);
    selective recomputation of CoreAttention + LlamaMLP with the tiled MLP: the MLP forward once more (+2 per MLP
    parameter; flash attention has no GEMM)."""
    h, inter, layers, vocab = m["hidden_size"], m["intermediate_size"], m["num_hidden_layers"], m["vocab_size"]
    kv = h // m["num_attention_heads"] * m["num_key_value_heads"]
    attn, mlp = 2 * h * h + 2 * h * kv, 3 * h * inter
    total = layers * (attn + mlp) + h * vocab
    return {"hf": 1.0, "no_recompute": 1.0,
            "memory": 1 + 2 * layers * (attn + mlp) / (6 * total),
            "selective": 1 + 2 * layers * mlp / (6 * total)}


@pytest.mark.extended  # make test-extended (CI time: a benchmark harness; recomputation itself is tested by
@pytest.mark.slow  # tests/test_memory_techniques.py and tests/test_compiled_memory.py)
def test_smoke_run_recomputes_what_each_configuration_should(tmp_path: Path) -> None:
    out = tmp_path / "profile_step.json"
    expected = _gemm_factors(SMOKE_MODEL)
    assert main(["--smoke", "--lens", "256", "--threads", "1", "--configs", ",".join(expected),
                 "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    md_rows = [ln for ln in out.with_suffix(".md").read_text().splitlines() if ln.startswith("| ")]
    assert len(md_rows) == len(expected) + 1  # header + one row each
    rows = {a["config"]: a for a in result["analysis"]}
    assert set(rows) == set(expected)
    for config, factor in expected.items():
        assert rows[config]["gemm_recompute_factor"] == pytest.approx(factor, rel=0.01), config
        assert rows[config]["tokens_per_s"] > 0 and 0 < rows[config]["mfu"]
    assert rows["hf"]["vs_hf"] == pytest.approx(1.0)
    by_config = {r["config"]: r for r in result["rows"]}
    for r in by_config.values():
        assert r["step_s"] == pytest.approx(r["forward_s"] + r["backward_s"] + r["optimizer_s"])
        assert r["category_s"]["gemm"] > 0
    # the same weights and tokens: every configuration computes the same loss
    for config in expected:
        assert by_config[config]["loss"] == pytest.approx(by_config["hf"]["loss"], rel=1e-4), config
