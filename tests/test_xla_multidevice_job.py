"""The whole training job through ``train.py``'s code path on 2 XLA devices of the multi-device test bed (lane 2).

A file of its own so that pytest-xdist (``--dist loadfile``) runs it beside ``test_xla_multidevice.py``. See that
file and ``tests/xla_testbed.py`` for the test bed; ``docs/trainium.md`` for what it found.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch_xla")
pytestmark = pytest.mark.xla  # lane 2 (make test-xla)

from xla_testbed import run_on_xla_devices  # noqa: E402

TOL = 1e-5


TP2_SP = ["distributed_strategy.tensor_model_parallel_size=2", "distributed_strategy.sequence_parallel=true"]
TP1 = ["distributed_strategy.tensor_model_parallel_size=1", "distributed_strategy.sequence_parallel=false"]


def test_training_job_tp2_sp_resumes_equal_to_uninterrupted_and_to_one_device(tmp_path) -> None:  # noqa: ANN001
    """``nxd_lc.app.run.run`` (what ``train.py`` calls) with ``trainer.accelerator=xla`` on 2 XLA devices at
    TP = 2 + sequence parallel: 4 steps with validation and an xser checkpoint every 2 steps, no divergent graph
    anywhere (training, optimizer step, validation, checkpoint save and load). The same job stopped after step 2
    and started again resumes from the step-2 checkpoint and ends equal to the uninterrupted run (steps 3-4 losses
    and gradient norms, final weights); the uninterrupted run equals the job on one XLA device at TP = 1."""
    from test_xla_graphs import _corpus

    corpus = _corpus(str(tmp_path / "corpus"), limit=60)
    tok = str(tmp_path / "tok")

    def job(name: str, devices: int, overrides: list[str], stop_after: int | None = None) -> list[dict]:
        kwargs = {"run_dir": str(tmp_path / name), "corpus": corpus, "tokenizer_dir": tok, "max_steps": 4,
                  "overrides": overrides, "stop_after": stop_after}
        return run_on_xla_devices("xla_scenarios:run_job", devices, kwargs, timeout_s=600, wait_timeout_s=120).results

    one = job("one_device", 1, TP1)[0]  # trains the tokenizer and packs the corpus for the other runs
    full = job("full", 2, TP2_SP)
    first = job("resumed", 2, TP2_SP, stop_after=2)  # interrupted after the step-2 checkpoint
    resumed = job("resumed", 2, TP2_SP)

    assert sorted(one["steps"]) == ["1", "2", "3", "4"] and sorted(one["vals"]) == ["2", "4"], one
    for r in full:
        assert r["global_step"] == 4 and r["resumed_from"] is None
        for step in ("1", "2", "3", "4"):
            assert r["steps"][step]["loss"] == pytest.approx(one["steps"][step]["loss"], abs=TOL, rel=0), step
            assert r["steps"][step]["norm"] == pytest.approx(one["steps"][step]["norm"], abs=TOL, rel=0), step
        for step in ("2", "4"):
            assert r["vals"][step] == pytest.approx(one["vals"][step], abs=TOL, rel=0), step
    for r0, r1, r in zip(first, resumed, full):
        assert r0["global_step"] == 2 and r0["resumed_from"] is None
        assert r1["global_step"] == 4 and r1["resumed_from"] is not None and "step=2" in r1["resumed_from"], r1
        assert sorted(r1["steps"]) == ["3", "4"], r1["steps"]
        for step in ("3", "4"):
            assert r1["steps"][step] == pytest.approx(r["steps"][step], abs=1e-6, rel=0), step
        assert r1["weights"] == pytest.approx(r["weights"], rel=1e-6, abs=0)
