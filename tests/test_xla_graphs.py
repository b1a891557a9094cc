"""XLA-CPU lane: the training and validation steps compile a fixed set of graphs (static-graph discipline).

Trains a tiny Llama (1 layer, hidden 64) for 20 optimizer steps on packed real text (stdlib ``__init__.py``
files: documents from a few tokens to several sequences long, so every batch has a different number and length
of documents in its ``segment_ids``) through :func:`nxd_lc.app.run.run` with ``trainer.accelerator=xla`` on
``PJRT_DEVICE=CPU``, validating every 5 steps, printing metrics every 5 steps and checkpointing (xser) every 10.
A callback snapshots ``torch_xla.debug.metrics`` (:func:`nxd_lc.runtime.xla.graph_stats`) after every optimizer
step and every validation.

Expected graphs (measured with torch-xla 2.9 on CPU; also in docs/trainium.md), gradient accumulation 2 (global
batch 4 = 2 micro-batches of 2), compile counter after each optimizer step / validation:

* training warm-up: ``TRAIN_GRAPHS_AFTER_WARMUP`` = 6 graphs by the end of step 2 (forward+backward with the
  gradients created, forward+backward accumulating, the optimizer step with gradient reductions / norm /
  clipping / AdamW / metrics, its first-step variant creating AdamW's state, and the graphs of the first
  learning rates and Lightning's first metric bookkeeping); steps 3-5 compile nothing;
* first validation (step 5): ``FIRST_VALIDATION_GRAPHS`` = 3 (first batch, later batches, the epoch-end
  ``val_loss`` reduction); the first training step after it: 1 (the step graph without the pending metric
  ops that the validation read-back consumed);
* second validation (step 10, together with the first checkpoint save) and the step after it: 1 each;
* from step 12 on: no compile at all, for training steps and for the validations at steps 15 and 20.
  ``TOTAL_GRAPHS`` = 12.

Run in the XLA venv: ``PJRT_DEVICE=CPU .venv-xla/bin/pytest tests/test_xla_graphs.py``. Skipped without
torch-xla.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig

import pytest

pytest.importorskip("torch_xla")
pytestmark = pytest.mark.xla  # lane 2 (make test-xla); the whole module needs torch-xla

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_STEPS = 20
TRAIN_GRAPHS_AFTER_WARMUP = 6  # compiled by the end of optimizer step 2
FIRST_VALIDATION_GRAPHS = 3  # compiled by the first validation (step 5)
TOTAL_GRAPHS = 12  # compiled in the whole run; all of them by step 11
STEADY_FROM_STEP = 11  # no compile after this optimizer step (training or validation)


def _corpus(dst: str, limit: int = 200) -> str:
    """Real text with varied document lengths: the stdlib's smallest modules (20 B to 1.5 kB, sorted by path)."""
    root = sysconfig.get_paths()["stdlib"]
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "test", "tests", "idlelib"))
        found += [os.path.join(dirpath, n) for n in sorted(filenames) if n.endswith(".py")
                  and 20 <= os.path.getsize(os.path.join(dirpath, n)) <= 1500]
    os.makedirs(dst, exist_ok=True)
    for i, src in enumerate(sorted(found)[:limit]):
        shutil.copy(src, os.path.join(dst, f"doc_{i:03d}.py"))
    return dst


def _worker(out_json: str, corpus: str, run_dir: str) -> None:
    """Train in this process (XLA device) and write the per-step graph statistics to ``out_json``."""
    import pytorch_lightning as pl
    from hydra import compose, initialize_config_dir

    from nxd_lc.app.run import run
    from nxd_lc.runtime import xla as xla_runtime

    class GraphRecorder(pl.Callback):
        def __init__(self) -> None:
            self.steps: list[dict] = []
            self.vals: list[dict] = []
            self.docs_per_row: list[int] = []
            self._last = -1

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # noqa: ANN001
            seg = batch["segment_ids"].cpu()  # uploaded data: a transfer, never a compile
            self.docs_per_row += [int(r.max() - r.min()) + 1 for r in seg]

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
            if trainer.global_step != self._last:
                self._last = trainer.global_step
                self.steps.append({"step": trainer.global_step, **vars(xla_runtime.graph_stats())})

        def on_validation_end(self, trainer, pl_module) -> None:  # noqa: ANN001
            self.vals.append({"step": trainer.global_step, **vars(xla_runtime.graph_stats())})

    overrides = [
        "trainer.accelerator=xla", "trainer.devices=1", f"trainer.max_steps={MAX_STEPS}",
        "trainer.log_every_n_steps=5", "trainer.val_check_interval=5", "trainer.limit_val_batches=3",
        "+trainer.enable_progress_bar=false",
        "distributed_strategy.tensor_model_parallel_size=1", "distributed_strategy.sequence_parallel=false",
        "data.micro_batch_size=2", "data.global_batch_size=4", "~data.builtin_corpus",
        f"+data.train_dir={corpus}", "+data.file_glob=*.py", "data.val_fraction=0.1",
        "data.tokenizer.vocab_size=512", f"+data.tokenizer.cache_dir={run_dir}/tok",
        "model.encoder_seq_length=128", "+model.num_layers=1", "+model.hidden_size=64",
        "model.optim.sched.warmup_steps=2", f"exp_manager.explicit_log_dir={run_dir}/run",
        "exp_manager.create_tensorboard_logger=false",
        "exp_manager.checkpoint_callback_params.every_n_train_steps=10",
    ]
    with initialize_config_dir(config_dir=os.path.join(REPO, "conf"), version_base=None):
        raw = compose(config_name="cpu_tiny_llama_config", overrides=overrides)
    recorder = GraphRecorder()
    import nxd_lc.lightning.trainer as trainer_module

    build = trainer_module.build_trainer

    def build_with_recorder(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - test-only wrapper
        trainer = build(*args, **kwargs)
        trainer.callbacks.append(recorder)
        return trainer

    trainer_module.build_trainer = build_with_recorder
    run(raw)
    with open(out_json, "w") as f:
        json.dump({"steps": recorder.steps, "vals": recorder.vals, "docs_per_row": recorder.docs_per_row}, f)


if __name__ == "__main__":
    _worker(*sys.argv[1:4])


def _measure(tmp_path) -> dict:  # noqa: ANN001
    corpus = _corpus(str(tmp_path / "corpus"))
    out = str(tmp_path / "graphs.json")
    env = dict(os.environ, PJRT_DEVICE="CPU", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), out, corpus, str(tmp_path)], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    with open(out) as f:
        result = json.load(f)
    result["log"] = proc.stdout + proc.stderr
    return result


@pytest.mark.slow
def test_training_and_validation_compile_a_fixed_graph_set(tmp_path) -> None:  # noqa: ANN001
    r = _measure(tmp_path)
    steps = {d["step"]: d for d in r["steps"]}
    vals = {d["step"]: d for d in r["vals"]}
    summary = ([(k, d["compiles"]) for k, d in sorted(steps.items())], [(k, d["compiles"]) for k, d in vals.items()])
    assert len(set(r["docs_per_row"])) >= 3, "the data must vary the number of documents per sequence"
    assert sorted(steps) == list(range(MAX_STEPS + 1)) and sorted(vals) == [5, 10, 15, 20], summary
    assert steps[2]["compiles"] == TRAIN_GRAPHS_AFTER_WARMUP, summary
    assert steps[5]["compiles"] == steps[2]["compiles"], summary  # steady training before the 1st validation
    assert vals[5]["compiles"] - steps[5]["compiles"] == FIRST_VALIDATION_GRAPHS, summary
    assert steps[MAX_STEPS]["compiles"] == TOTAL_GRAPHS, summary
    steady = [steps[k]["compiles"] for k in range(STEADY_FROM_STEP, MAX_STEPS + 1)]
    steady += [vals[15]["compiles"], vals[20]["compiles"]]
    assert set(steady) == {TOTAL_GRAPHS}, f"graphs compiled after warm-up: {summary}"
    assert "step 20/20 | loss" in r["log"], r["log"][-2000:]  # MetricsPrinter lines still printed


def test_xla_document_masked_attention_matches_per_document_sdpa() -> None:
    """The XLA path (one SDPA with a device-built boolean mask) equals the CPU per-document SDPA path."""
    import torch

    from nxd_lc.context.local import local_attention
    from nxd_lc.runtime import xla as xla_runtime

    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 12, 8), torch.randn(2, 2, 12, 8), torch.randn(2, 2, 12, 8)
    seg = torch.tensor([[0] * 5 + [1] * 4 + [2] * 3, [0] * 12])
    ref = local_attention(q, k, v, scale=8 ** -0.5, segment_ids=seg)
    dev = xla_runtime.xla_device()
    out = local_attention(q.to(dev), k.to(dev), v.to(dev), scale=8 ** -0.5, segment_ids=seg.to(dev))
    torch.testing.assert_close(out.cpu(), ref, rtol=1e-5, atol=1e-5)
