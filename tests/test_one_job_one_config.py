"""One job, one config, checked at start-up (issue 50, item 5): the ranks compare their resolved configs through the
rendezvous store and stop together naming the differing keys; processes per node must be ``trainer.devices``; after
a preemption save every rank exits with 128 + signal so that every torchrun agent exits at once.

The two-"node" tests start two real torchrun agents on loopback (``--nnodes 2 --node_rank 0/1``, one process each),
as two hosts would: the keys one node's command line changes are the reference the error must name.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nxd_lc.config.errors import ConfigError
from nxd_lc.config.run_record import config_differences

REPO = Path(__file__).resolve().parent.parent
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")


def test_config_differences_name_the_keys() -> None:
    a = "model:\n  optim:\n    lr: 0.005\n  num_layers: 4\ntrainer:\n  devices: 2\n"
    b = "model:\n  optim:\n    lr: 0.001\n  num_layers: 4\ntrainer:\n  devices: 2\n  extra: 1\n"
    assert config_differences(a, b) == ["model.optim.lr: 0.005 vs 0.001", "trainer.extra: '<unset>' vs 1"]
    assert config_differences(a, a) == []
    many = config_differences("x: {" + ", ".join(f"k{i}: 0" for i in range(12)) + "}",
                              "x: {" + ", ".join(f"k{i}: 1" for i in range(12)) + "}", limit=3)
    assert len(many) == 4 and many[-1] == "... and 9 more keys"


def test_processes_per_node_must_be_trainer_devices() -> None:
    """``num_nodes 2, devices 2`` started as 4 processes on one node passes the world-size check (4 = 2 x 2):
    refused naming both numbers; 2 per node, or no torchrun variables, pass."""
    import dataclasses

    from nxd_lc.app.convert import compose_run_config
    from nxd_lc.app.run import check_processes_per_node

    cfg = compose_run_config("cpu_tiny_llama_config", str(REPO / "conf"))
    cfg = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, devices=2, num_nodes=2))
    with pytest.raises(ConfigError, match=r"trainer.devices: 2 processes per node, but torchrun started 4 on this "
                                          r"node \(LOCAL_WORLD_SIZE\)"):
        check_processes_per_node(cfg, {"LOCAL_WORLD_SIZE": "4", "WORLD_SIZE": "4"})
    check_processes_per_node(cfg, {"LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "4"})
    check_processes_per_node(cfg, {})


def _check_worker(rank: int, world: int, texts: list[str], out: str) -> None:
    from nxd_lc.distributed.startup import check_same_config

    try:
        digest = check_same_config(texts[rank], config_differences)
        Path(out, f"rank{rank}.txt").write_text("ok " + digest)
    except ConfigError as e:
        Path(out, f"rank{rank}.txt").write_text("error " + str(e))


@pytest.mark.compat
@pytest.mark.distributed
def test_ranks_with_different_configs_all_stop_naming_the_key(tmp_path: Path) -> None:
    """Three gloo ranks, rank 2's ``model.optim.lr`` differs: every rank raises the same error naming rank 2 and the
    key; with equal texts every rank returns the same digest."""
    from dist_utils import run_distributed

    same = "model:\n  optim:\n    lr: 0.005\n"
    other = "model:\n  optim:\n    lr: 0.001\n"
    run_distributed(_check_worker, 3, [same, same, other], str(tmp_path))
    results = [Path(tmp_path, f"rank{r}.txt").read_text() for r in range(3)]
    assert all(r.startswith("error ") for r in results), results
    assert len(set(results)) == 1 and "rank 2 (node ?)'s resolved config differs from rank 0's" in results[0]
    assert "model.optim.lr: 0.005 vs 0.001" in results[0]
    ok = tmp_path / "ok"
    ok.mkdir()
    run_distributed(_check_worker, 3, [same, same, same], str(ok))
    results = {Path(ok, f"rank{r}.txt").read_text() for r in range(3)}
    assert len(results) == 1 and next(iter(results)).startswith("ok ")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _node_cmd(node: int, port: int, log_dir: Path, corpus: str, cache: Path, extra: list[str]) -> list[str]:
    return [TORCHRUN, "--nnodes=2", f"--node_rank={node}", "--nproc_per_node=1", "--master_addr=127.0.0.1",
            f"--master_port={port}", "train.py", "--config-name", "cpu_tiny_llama_config", "trainer.num_nodes=2",
            "trainer.devices=1", f"exp_manager.explicit_log_dir={log_dir}", "trainer.log_every_n_steps=1",
            "trainer.val_check_interval=100", "trainer.limit_val_batches=0", "+trainer.enable_progress_bar=false",
            "exp_manager.checkpoint_callback_params.every_n_train_steps=100", "~data.builtin_corpus",
            f"+data.train_dir={corpus}", "+data.file_glob=**/*.py", "data.val_fraction=0.1",
            "data.tokenizer.vocab_size=1024", f"+data.tokenizer.cache_dir={cache}", "model.encoder_seq_length=128",
            "model.optim.sched.warmup_steps=1", *extra]


def _two_nodes(tmp_path: Path, extra: tuple[list[str], list[str]], fault: str = "",
               timeout: float = 400) -> list[tuple[int, str, float]]:
    """Start both agents; ``(returncode, output, seconds to exit)`` of each."""
    from tests.test_e2e import _small_corpus

    corpus, cache, log_dir, port = _small_corpus(str(tmp_path)), tmp_path / "cache", tmp_path / "run", _free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", NXD_LC_FAULT=fault)
    start = time.monotonic()
    procs = [subprocess.Popen(_node_cmd(n, port, log_dir, corpus, cache, extra[n]), cwd=REPO, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for n in (0, 1)]
    results: list[tuple[int, str, float]] = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=max(1.0, timeout - (time.monotonic() - start)))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.send_signal(signal.SIGKILL)
            raise
        results.append((p.returncode, out, time.monotonic() - start))
    (tmp_path / "node0.log").write_text(results[0][1])
    (tmp_path / "node1.log").write_text(results[1][1])
    return results


@pytest.mark.lane1_only  # two real torchrun agents; the store check itself runs in both lanes above
@pytest.mark.distributed
@pytest.mark.slow
def test_two_nodes_with_different_learning_rates_stop_before_step_1(tmp_path: Path) -> None:
    results = _two_nodes(tmp_path, ([], ["model.optim.lr=1e-3"]), timeout=300)
    for rc, out, _ in results:
        assert rc != 0, out[-3000:]
        assert re.search(r"rank 1 \(node 1\)'s resolved config differs from rank 0's \(model\.optim\.lr: "
                         r"[0-9.e-]+ vs 0\.001\)", out), out[-3000:]
        assert "step 1/" not in out, out[-3000:]


@pytest.mark.lane1_only
@pytest.mark.distributed
@pytest.mark.slow
def test_a_preempted_two_node_job_exits_on_both_nodes_without_the_exit_barrier_wait(tmp_path: Path) -> None:
    """SIGTERM to node 0's torchrun in the middle of step 3: both ranks save step 3 and exit with 143; node 1's
    agent exits at once (with exit status 0 it waited 300 s at its exit barrier for node 0's agent)."""
    results = _two_nodes(tmp_path, (["trainer.max_steps=50"], ["trainer.max_steps=50"]),
                         fault="sigterm_launcher@mid_step:3:0", timeout=280)
    (rc0, out0, t0), (rc1, out1, t1) = results
    assert "preemption checkpoint of step 3 saved" in out0, out0[-3000:]
    assert rc1 != 0 and "exit status 143" in out1, out1[-3000:]
    assert abs(t1 - t0) < 60, (t0, t1)
    tags = os.listdir(tmp_path / "run" / "checkpoints")
    assert any("step=3-" in t for t in tags), tags
