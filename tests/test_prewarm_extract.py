"""Prewarm as Neuron users run it (issue 39, item 5): ``neuron_parallel_compile torchrun train.py ...`` sets
``NEURON_EXTRACT_GRAPHS_ONLY``; graphs are extracted, not executed, and every value read back is garbage. The run
then writes no checkpoint and no graph manifest, reads no value back to judge it (non-finite checks), and trains
at most NxDT's 10 steps (nxd_lc.runtime.prewarm). On Neuron, torch-xla's persistent cache (the graph recording)
is off. The variable is simulated here: the values are real, and a NaN gradient stands for the garbage."""

from __future__ import annotations

import logging
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_nonfinite_step import run_with_nan_step, stdlib_corpus

from nxd_lc.config.schema import NxdConfig
from nxd_lc.lightning.nonfinite import NonFiniteStepGuard, NonFiniteTrainingError
from nxd_lc.runtime import xla as xla_runtime
from nxd_lc.runtime.compile_cache import MANIFEST_NAME
from nxd_lc.runtime.prewarm import (
    EXTRACT_MAX_STEPS,
    GRAPH_RECORD_SUBDIR,
    GRAPHS_ONLY_ENV,
    begin_graph_recording,
    extracting_graphs,
    prewarm_config,
    prewarm_steps,
    run_prewarm,
)

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.compat
@pytest.mark.parametrize(("value", "on"), [("1", True), ("0", True), ("true", True), ("", False), (None, False)])
def test_the_variable_is_read_as_neuronx_distributed_reads_it(value: str | None, on: bool) -> None:
    """NxD: ``if os.environ.get("NEURON_EXTRACT_GRAPHS_ONLY", None):`` -- any non-empty value counts."""
    assert extracting_graphs({} if value is None else {GRAPHS_ONLY_ENV: value}) is on


def _cfg(tmp_path: Path) -> NxdConfig:
    cfg = NxdConfig()
    cfg.trainer.max_steps, cfg.trainer.log_every_n_steps, cfg.trainer.limit_val_batches = 50, 12, 0
    cfg.compiler_cache_url = str(tmp_path / "cache")
    return cfg


@pytest.mark.compat
def test_extraction_runs_the_prewarm_capped_at_nxdts_steps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    cfg = _cfg(tmp_path)
    assert prewarm_steps(cfg) == 13 > EXTRACT_MAX_STEPS == 10  # first logging step + 1: more than NxDT's 10
    got: list[NxdConfig] = []
    monkeypatch.setenv(GRAPHS_ONLY_ENV, "1")
    with caplog.at_level(logging.INFO, logger="nxd_lc"):
        run_prewarm(cfg, got.append)
    (pcfg,) = got
    assert pcfg.trainer.max_steps == 10 and pcfg.prewarm and cfg.trainer.max_steps == 50 and not cfg.prewarm
    assert not pcfg.exp_manager.create_checkpoint_callback and not pcfg.exp_manager.resume_if_exists
    assert "NEURON_EXTRACT_GRAPHS_ONLY='1' (neuron_parallel_compile): graph extraction" in caplog.text
    assert "no checkpoints" in caplog.text and "no non-finite / loss checks" in caplog.text
    assert "the prewarm schedule of this config has 13 steps" in caplog.text  # the cut is said
    cfg.trainer.max_steps = 4  # a shorter run is not lengthened
    assert prewarm_config(cfg, EXTRACT_MAX_STEPS).trainer.max_steps == 4
    monkeypatch.delenv(GRAPHS_ONLY_ENV)
    got.clear()
    run_prewarm(_cfg(tmp_path), got.append)  # +prewarm=true alone: the whole schedule
    assert got[0].trainer.max_steps == 13


@pytest.mark.compat
def test_no_graph_recording_under_extraction_or_on_neuron(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    cfg = _cfg(tmp_path)
    cfg.prewarm = True
    with caplog.at_level(logging.INFO, logger="nxd_lc"):
        monkeypatch.setenv(GRAPHS_ONLY_ENV, "1")
        assert begin_graph_recording(cfg, "xla", 0) is None
        assert "prewarm manifest off: NEURON_EXTRACT_GRAPHS_ONLY='1'" in caplog.text
        monkeypatch.delenv(GRAPHS_ONLY_ENV)
        for accelerator in ("neuron", "neuron_native"):
            caplog.clear()
            assert begin_graph_recording(cfg, accelerator, 0) is None
            assert "prewarm manifest off: " in caplog.text, accelerator
        assert "is not verified through Neuron's PJRT plugin" not in caplog.text  # native: no torch-xla at all
        caplog.clear()
        monkeypatch.setattr(xla_runtime, "torch_xla_available", lambda: True)
        monkeypatch.setattr(xla_runtime, "xla_hardware", lambda: "NEURON")  # xla with PJRT_DEVICE=NEURON
        assert begin_graph_recording(cfg, "xla", 0) is None
        assert "is not verified through Neuron's PJRT plugin" in caplog.text
    assert not (tmp_path / "cache").exists()


@pytest.mark.compat
def test_no_non_finite_check_reads_values_under_extraction(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both paths of the guard: the eager host decision at the step and the XLA path's read-back of its counters
    (here CPU tensors in place of the device counters)."""
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.1)
    nan = torch.tensor(math.nan)
    with pytest.raises(NonFiniteTrainingError):
        NonFiniteStepGuard(1).before_step(nan, 1, opt, [p])
    in_graph = NonFiniteStepGuard(1)
    in_graph.in_graph, in_graph._trip_t, in_graph._skipped_t = True, torch.tensor(3), torch.tensor(1)
    with pytest.raises(NonFiniteTrainingError, match="optimizer step 3"):
        in_graph.check()
    monkeypatch.setenv(GRAPHS_ONLY_ENV, "1")
    NonFiniteStepGuard(1).before_step(nan, 1, opt, [p])
    in_graph.check()


def _overrides(tmp_path: Path, accelerator: str) -> list[str]:
    """The tiny CPU config, 50 steps logged every 12 (the prewarm schedule: 13 steps), no validation, a checkpoint
    every 2 steps."""
    return ["~data.builtin_corpus", f"+data.train_dir={stdlib_corpus(tmp_path / 'corpus')}", "+data.file_glob=*.py",
            "data.val_fraction=0.1", "data.tokenizer.vocab_size=300", f"+data.tokenizer.cache_dir={tmp_path / 'tok'}",
            f"trainer.accelerator={accelerator}", "trainer.max_steps=50", "trainer.log_every_n_steps=12",
            "trainer.limit_val_batches=0", "+trainer.enable_progress_bar=false", "+exp_manager.preemption_signals=[]",
            "data.micro_batch_size=1", "data.global_batch_size=1", "model.encoder_seq_length=32", "+model.num_layers=1",
            "+model.hidden_size=64", "exp_manager.checkpoint_callback_params.every_n_train_steps=2",
            f"exp_manager.explicit_log_dir={tmp_path / 'run'}", "exp_manager.create_tensorboard_logger=false",
            f"compiler_cache_url={tmp_path / 'cache'}", "trainer.devices=1",
            "distributed_strategy.tensor_model_parallel_size=1", "distributed_strategy.sequence_parallel=false"]


def extraction_job(tmp: str, accelerator: str) -> int:
    """``train.py``'s path (:func:`nxd_lc.app.run.run` on the composed tiny config) with NEURON_EXTRACT_GRAPHS_ONLY
    set and the gradients of step 3 made NaN (the garbage a real extraction reads back). Returns the steps run."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        raw = compose(config_name="cpu_tiny_llama_config", overrides=_overrides(Path(tmp), accelerator))
    return int(run_with_nan_step(raw, 3, {GRAPHS_ONLY_ENV: "1"}).global_step)


def _check_outputs(tmp_path: Path, steps: int, log: str) -> None:
    assert steps == EXTRACT_MAX_STEPS, log[-3000:]  # capped (50 asked, a 13-step prewarm schedule)
    ckpts = tmp_path / "run" / "checkpoints"
    assert not ckpts.exists() or not os.listdir(ckpts)  # no checkpoint, though one was due every 2 steps
    cache = tmp_path / "cache"
    assert not (cache / MANIFEST_NAME).exists() and not (cache / GRAPH_RECORD_SUBDIR).exists()
    assert "NEURON_EXTRACT_GRAPHS_ONLY='1' (neuron_parallel_compile): graph extraction" in log, log[-3000:]


def test_extraction_on_cpu_is_refused_before_anything_is_built(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On cpu there is no Neuron compiler: the variable set (a leftover export, or neuron_parallel_compile around a
    CPU config) trained 3 steps with no checkpoint and no resume, rc 0, logging that values read back are not real
    (false on CPU). It is refused at launch, naming the variable, what the run would skip and the fix; nothing is
    written (no run directory, no cache)."""
    from hydra import compose, initialize_config_dir

    from nxd_lc.app.run import run
    from nxd_lc.config.errors import ConfigError

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        raw = compose(config_name="cpu_tiny_llama_config", overrides=_overrides(tmp_path, "cpu"))
    monkeypatch.setenv(GRAPHS_ONLY_ENV, "1")
    with pytest.raises(ConfigError) as e:
        run(raw)
    (problem,) = e.value.problems
    assert problem.startswith("NEURON_EXTRACT_GRAPHS_ONLY='1' (neuron_parallel_compile's graph extraction) is set, "
                              "but trainer.accelerator cpu runs on cpu on this host, which has no Neuron compiler"), \
        problem
    assert "train 10 optimizer step(s) of trainer.max_steps 50, save no checkpoint and not resume" in problem
    assert "unset it to train here" in problem
    assert not (tmp_path / "run").exists() and not (tmp_path / "cache").exists()


@pytest.mark.xla
@pytest.mark.slow
def test_extraction_job_on_xla_cpu(tmp_path: Path) -> None:
    """Lane 2 (torch-xla: the in-graph guard, the graph recording), in a fresh process: also no graph recording
    (the manifest is off, naming the variable), and no read-back of the NaN step's counters."""
    pytest.importorskip("torch_xla", reason="torch-xla is not installed (XLA lane only: make test-xla)")
    code = (f"import sys; sys.path.insert(0, {str(REPO / 'tests')!r}); import test_prewarm_extract as t; "
            f"print('STEPS', t.extraction_job({str(tmp_path)!r}, 'xla'))")
    env = {**os.environ, "PJRT_DEVICE": "CPU", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=str(REPO), env=env, capture_output=True, text=True,
                          timeout=600, check=False)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-5000:]
    steps = int(log.split("STEPS ")[-1].split()[0])
    _check_outputs(tmp_path, steps, log)
    assert "prewarm manifest off: NEURON_EXTRACT_GRAPHS_ONLY='1'" in log, log[-3000:]
