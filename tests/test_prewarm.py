"""Prewarm manifest (issue 4 item 4): the manifest logic everywhere; on XLA-CPU (XLA lane) the contract that the
prewarm's recorded graph set equals the training run's."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap

import pytest

from nxd_lc.config.schema import NxdConfig
from nxd_lc.runtime.compile_cache import (
    MANIFEST_NAME,
    check_manifest,
    compare_graphs,
    manifest_path,
    read_manifest,
    recorded_graphs,
    write_manifest,
)
from nxd_lc.runtime.prewarm import (
    GRAPH_RECORD_SUBDIR,
    begin_graph_recording,
    check_run_graphs,
    end_graph_recording,
    finish_prewarm,
    prewarm_config,
    prewarm_schedule,
    prewarm_steps,
)

pytestmark = pytest.mark.compat  # torch-2.9 compatibility subset (lane 2; docs/testing.md)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_manifest_round_trip_and_compare(tmp_path, caplog: pytest.LogCaptureFixture) -> None:
    path = manifest_path(str(tmp_path / "cache"))
    assert path.endswith(os.path.join("cache", MANIFEST_NAME))
    write_manifest(path, ["3", "1", "2", "1"], steps=3, config_name="tiny")
    assert read_manifest(path) == ["1", "2", "3"]
    assert json.load(open(path))["steps"] == 3
    r = compare_graphs(["1", "2", "9"], ["1", "2", "3"])
    assert r.hits == ("1", "2") and r.misses == ("9",) and r.unused == ("3",) and not r.matches
    assert compare_graphs(["2", "1"], ["1", "2"]).matches
    with caplog.at_level(logging.INFO, logger="nxd_lc"):
        res = check_manifest(path, ["1", "9"])
    assert res is not None and res.misses == ("9",)
    assert "1 hit(s), 1 miss(es), 2 prewarmed graph(s) unused" in caplog.text
    assert "graph 9 was not seen by the prewarm" in caplog.text


def test_manifest_errors(tmp_path, caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(ValueError, match="local directory"):
        manifest_path("s3://bucket/cache")
    missing = str(tmp_path / MANIFEST_NAME)
    with pytest.raises(FileNotFoundError, match=r"\+prewarm=true"):
        read_manifest(missing)
    with caplog.at_level(logging.INFO, logger="nxd_lc"):
        assert check_manifest(missing, ["1"]) is None  # a run without a prewarm: one info line
    assert "run the prewarm first" in caplog.text
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        read_manifest(str(bad))
    bad.write_text(json.dumps({"version": 99, "graphs": []}))
    with pytest.raises(ValueError, match="rerun the prewarm"):
        read_manifest(str(bad))
    with pytest.raises(FileNotFoundError):
        recorded_graphs(str(tmp_path / "nope"))


def test_prewarm_config_and_finish(tmp_path) -> None:
    cfg = NxdConfig()
    cfg.trainer.max_steps, cfg.trainer.log_every_n_steps = 100, 10
    cfg.compiler_cache_url = str(tmp_path / "cache")
    pw = prewarm_config(cfg)
    assert pw.trainer.max_steps == prewarm_steps(cfg) == 11 and cfg.trainer.max_steps == 100
    assert not pw.exp_manager.create_checkpoint_callback and not pw.exp_manager.create_tensorboard_logger
    assert not pw.exp_manager.resume_if_exists and cfg.exp_manager.create_checkpoint_callback
    cfg.trainer.max_steps = 2
    assert prewarm_steps(cfg) == 2
    rec = tmp_path / "rec"
    rec.mkdir()
    for h in ("11", "22"):
        (rec / h).write_bytes(b"")
    path = finish_prewarm(cfg, str(rec), steps=2)
    assert read_manifest(path) == ["11", "22"]
    assert check_run_graphs(cfg, str(rec)).matches


@pytest.mark.parametrize(("log_every", "val_every", "max_steps", "expected"), [
    (10, 1.0, 100, (11, None)),  # fractional interval: no periodic validation, steps for the first logging step
    (2, 5, 12, (12, 5)),  # 5 + lcm(2, 5) + 1 = 16 >= 12 steps: the whole schedule, interval unchanged
    (2, 5, 18, (10, 3)),  # 3 = 5 (mod 2): validations on and off logging steps, 3 + 6 + 1 steps
    (5, 45, 180, (11, 5)),  # the demo config: 45 = 5 (mod 5) -> 5, 5 + 5 + 1
    (1, 1000, 10000, (7, 3)),  # NxDT-like: log every step
    (1, 1, 50, (3, 1)),
])
def test_prewarm_schedule_covers_validation_pattern(log_every: int, val_every: object, max_steps: int,
                                                    expected: tuple) -> None:
    cfg = NxdConfig()
    t = cfg.trainer
    t.log_every_n_steps, t.val_check_interval, t.max_steps = log_every, val_every, max_steps
    assert prewarm_schedule(cfg) == expected
    pw = prewarm_config(cfg)
    assert pw.trainer.max_steps == expected[0] and pw.trainer.log_every_n_steps == log_every
    assert pw.trainer.val_check_interval == (val_every if expected[1] is None else expected[1])
    cfg.trainer.limit_val_batches = 0  # validation off: only the logging rule
    assert prewarm_schedule(cfg) == (min(max(3, log_every + 1), max_steps), None)


def test_graph_recording_off_where_it_cannot_or_must_not_record(tmp_path, monkeypatch: pytest.MonkeyPatch,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    cfg = NxdConfig()
    cfg.compiler_cache_url = str(tmp_path / "cache")
    assert begin_graph_recording(cfg, "cpu", 0) is None  # no lazy graphs
    assert begin_graph_recording(cfg, "xla", 1) is None  # rank 0 records for the job
    monkeypatch.setenv("XLA_PERSISTENT_CACHE_PATH", str(tmp_path / "users_cache"))
    with caplog.at_level(logging.INFO, logger="nxd_lc"):
        assert begin_graph_recording(cfg, "neuron", 0) is None  # the user's torch-xla cache is left alone
    assert "XLA_PERSISTENT_CACHE_PATH" in caplog.text and "is kept" in caplog.text
    monkeypatch.delenv("XLA_PERSISTENT_CACHE_PATH")
    cfg.compiler_cache_url = "s3://bucket/cache"
    with caplog.at_level(logging.INFO, logger="nxd_lc"):
        assert begin_graph_recording(cfg, "xla", 0) is None
    assert "not a local directory" in caplog.text
    assert end_graph_recording(cfg, None, 3) is None


def test_end_graph_recording_writes_then_checks_and_removes_the_record(tmp_path) -> None:
    cfg = NxdConfig()
    cfg.compiler_cache_url = str(tmp_path / "cache")
    rec = tmp_path / "cache" / GRAPH_RECORD_SUBDIR / "run-1"
    for prewarm, graphs in ((True, ("11", "22")), (False, ("11", "33"))):
        rec.mkdir(parents=True)
        for h in graphs:
            (rec / h).write_bytes(b"serialized executable")
        cfg.prewarm = prewarm
        result = end_graph_recording(cfg, str(rec), 3)
        assert not rec.exists() and not rec.parent.exists()
    assert read_manifest(manifest_path(cfg.compiler_cache_url)) == ["11", "22"]
    assert result is not None and result.hits == ("11",) and result.misses == ("33",) and result.unused == ("22",)


_LOOP = textwrap.dedent("""
    import sys, torch, torch_xla
    from nxd_lc.runtime.compile_cache import recorded_graphs, start_graph_recording
    rec, steps = start_graph_recording(sys.argv[1]), int(sys.argv[2])
    torch.manual_seed(0)
    dev = torch_xla.device()
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4)).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(steps):
        x = torch.randn(4, 8).to(dev)  # new values every step, same shape: same graph
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch_xla.sync()
    print(" ".join(recorded_graphs(rec)))
""")


def _record(tmp_path, name: str, steps: int) -> list[str]:
    env = {**os.environ, "PJRT_DEVICE": "CPU", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", _LOOP, str(tmp_path / name), str(steps)], env=env, timeout=240,
                         capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.split()


@pytest.mark.xla
@pytest.mark.slow
def test_prewarm_graph_set_equals_training_run_on_xla_cpu(tmp_path) -> None:
    pytest.importorskip("torch_xla", reason="torch-xla is not installed (XLA lane only: make test-xla)")
    cfg = NxdConfig()
    cfg.compiler_cache_url = str(tmp_path / "cache")
    prewarm = _record(tmp_path, "prewarm", 3)
    assert prewarm, "the prewarm recorded no graphs"
    finish_prewarm(cfg, str(tmp_path / "prewarm"), steps=3)
    train = _record(tmp_path, "train", 8)
    result = check_run_graphs(cfg, str(tmp_path / "train"))
    assert result is not None and result.matches, (prewarm, train)
    assert sorted(train) == sorted(prewarm)


def _small_corpus(dst, limit: int = 120) -> str:  # noqa: ANN001
    """Real text of varied length: the stdlib's smallest modules (20 B - 1.5 kB), copied in path order."""
    import shutil
    import sysconfig

    found = []
    for dirpath, dirnames, filenames in os.walk(sysconfig.get_paths()["stdlib"]):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "test", "tests", "idlelib"))
        found += [os.path.join(dirpath, n) for n in sorted(filenames)
                  if n.endswith(".py") and 20 <= os.path.getsize(os.path.join(dirpath, n)) <= 1500]
    dst.mkdir()
    for i, src in enumerate(sorted(found)[:limit]):
        shutil.copy(src, dst / f"doc_{i:03d}.py")
    return str(dst)


def _train_py(tmp_path, tag: str, *extra: str) -> str:  # noqa: ANN001
    """``python train.py`` on XLA-CPU: tiny Llama, TP=1, 18 steps, log every 2, validate every 5, checkpoint
    every 4 (xser); returns stdout + stderr."""
    corpus = tmp_path / "corpus"
    overrides = [
        "trainer.accelerator=xla", "trainer.devices=1", "trainer.max_steps=18", "trainer.log_every_n_steps=2",
        "trainer.val_check_interval=5", "trainer.limit_val_batches=2", "+trainer.enable_progress_bar=false",
        "distributed_strategy.tensor_model_parallel_size=1", "distributed_strategy.sequence_parallel=false",
        "data.micro_batch_size=2", "data.global_batch_size=4", "~data.builtin_corpus",
        f"+data.train_dir={corpus if corpus.exists() else _small_corpus(corpus)}", "+data.file_glob=*.py",
        "data.val_fraction=0.1", "data.tokenizer.vocab_size=512", f"+data.tokenizer.cache_dir={tmp_path}/tok",
        "model.encoder_seq_length=128", "+model.num_layers=1", "+model.hidden_size=64",
        "model.optim.sched.warmup_steps=2", f"exp_manager.explicit_log_dir={tmp_path}/run_{tag}",
        "exp_manager.create_tensorboard_logger=false", "exp_manager.checkpoint_callback_params.every_n_train_steps=4",
        f"compiler_cache_url={tmp_path}/cache", *extra,
    ]
    env = {**os.environ, "PJRT_DEVICE": "CPU", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("XLA_PERSISTENT_CACHE_PATH", None)
    out = subprocess.run([sys.executable, "train.py", "--config-name", "cpu_tiny_llama_config", *overrides],
                         cwd=REPO, env=env, timeout=600, capture_output=True, text=True, check=False)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-4000:]
    return log


@pytest.mark.xla
@pytest.mark.slow
def test_prewarm_then_train_through_train_py_all_graphs_hit_on_xla_cpu(tmp_path) -> None:
    """``+prewarm=true`` then the same config normally: the run's graph set equals the prewarm's, with
    validations (on and off logging steps) and xser checkpoints in the run and neither checkpoints nor loggers in
    the prewarm (10 steps, validation every 3)."""
    pytest.importorskip("torch_xla", reason="torch-xla is not installed (XLA lane only: make test-xla)")
    prewarm_log = _train_py(tmp_path, "prewarm", "+prewarm=true")
    graphs = read_manifest(manifest_path(str(tmp_path / "cache")))
    assert len(graphs) >= 6, prewarm_log[-3000:]
    assert f"prewarm: {len(graphs)} graph(s) compiled in 10 step(s)" in prewarm_log, prewarm_log[-3000:]
    assert not (tmp_path / "run_prewarm" / "checkpoints").exists()
    assert [f"step {s} | val_loss" in prewarm_log for s in (3, 6, 9)] == [True] * 3, prewarm_log[-3000:]
    run_log = _train_py(tmp_path, "train")
    assert [f"step {s} | val_loss" in run_log for s in (5, 10, 15)] == [True] * 3, run_log[-3000:]
    assert len(os.listdir(tmp_path / "run_train" / "checkpoints")) >= 2  # saves happened (top-k keeps 2)
    assert f": {len(graphs)} hit(s), 0 miss(es), 0 prewarmed graph(s) unused" in run_log, run_log[-3000:]
    assert "was not seen by the prewarm" not in run_log
    assert not (tmp_path / "cache" / GRAPH_RECORD_SUBDIR).exists()  # record directories removed
