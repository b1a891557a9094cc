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
from nxd_lc.runtime.prewarm import check_run_graphs, finish_prewarm, prewarm_config, prewarm_steps


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
    with caplog.at_level(logging.WARNING, logger="nxd_lc"):
        assert check_manifest(missing, ["1"]) is None
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
