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



def test_nxdt_pipeline_config_trains_shrunk_on_xla_equal_to_one_device(tmp_path) -> None:  # noqa: ANN001
    """NxDT's ``hf_llama3_70B_config`` (TP 32 x PP 8, mixed precision, sequence parallel; the file unchanged),
    shrunk by ``tests/test_nxdt_examples.py``'s overrides to a tiny 4-layer Llama (PP 2, TP 1 on the 2 devices of
    the test bed, global batch 4 of micro-batches of 1: 4 micro-batches per step through the lockstep schedule),
    trains 2 steps through ``train.py``'s path with ``trainer.accelerator=xla`` (its selective activation
    checkpointing included), a validation (the pipeline's forward-only schedule) and an xser checkpoint at step 2
    holding both stages' shards -- and equals the same shrunk file on one XLA device (PP 1): losses, gradient norms
    and the validation loss within one bf16 rounding step (the file's mixed precision: bf16 compute, and the pipeline
    sums micro-batch gradients in another order; measured: equal at step 1, the step-2 norm one bf16 step apart,
    1.578125 vs 1.5703125). No divergent graph in any stage."""
    import json
    from pathlib import Path

    import yaml
    from test_nxdt_examples import EXAMPLES, _tiny_model_json, shrink_overrides

    name = "hf_llama3_70B_config"
    config_dir = EXAMPLES if (EXAMPLES / f"{name}.yaml").is_file() else Path(__file__).resolve().parents[1] / "conf"
    tree = yaml.safe_load((config_dir / f"{name}.yaml").read_text())
    from test_xla_graphs import _corpus

    files = {"corpus": Path(_corpus(str(tmp_path / "corpus"), limit=60)), "cache": tmp_path / "cache",
             "pretrain_json": _tiny_model_json(tmp_path / "config.json", 512)}

    def job(run: str, tp_pp: tuple[int, int]) -> list[dict]:
        overrides, _ = shrink_overrides(tree, files, tmp_path / run)
        layout = {"distributed_strategy.tensor_model_parallel_size": tp_pp[0],
                  "distributed_strategy.pipeline_model_parallel_size": tp_pp[1], "trainer.devices": tp_pp[1]}
        overrides = [o for o in overrides if o.split("=")[0].lstrip("+") not in layout]
        # validation at step 2 (the file's limit_val_batches is 0): the pipeline's forward-only schedule too
        overrides += [f"{k}={v}" for k, v in layout.items()] + ["trainer.limit_val_batches=1",
                                                                "+data.val_fraction=0.1"]
        kwargs = {"config_dir": str(config_dir), "config_name": name, "overrides": overrides}
        return run_on_xla_devices("xla_scenarios:nxdt_job", tp_pp[1], kwargs, timeout_s=600,
                                  wait_timeout_s=120).results

    (one,) = job("one_device", (1, 1))
    pipeline = job("pp2", (1, 2))
    assert sorted(one["steps"]) == ["1", "2"] and sorted(one["vals"]) == ["2"], json.dumps(one)
    bf16_ulp = 2.0 ** -7  # relative: the file's mixed precision computes in bf16 and logs bf16-rounded values
    for r in pipeline:
        assert r["global_step"] == 2
        for step in ("1", "2"):
            for key in ("loss", "norm"):
                assert r["steps"][step][key] == pytest.approx(one["steps"][step][key], rel=bf16_ulp), (step, key)
        assert r["vals"] == pytest.approx(one["vals"], rel=bf16_ulp)
    (ckpt,) = [p for p in Path(tmp_path, "pp2", "run", "checkpoints").iterdir() if "step=2" in p.name]
    assert (ckpt / "done").is_file(), sorted(p.name for p in ckpt.iterdir())
    shards = sorted(p.name for p in (ckpt / "model").iterdir() if p.suffix == ".pt")
    assert shards == ["dp_rank_00_tp_rank_00_pp_rank_00.pt", "dp_rank_00_tp_rank_00_pp_rank_01.pt"], shards
