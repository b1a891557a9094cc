"""Run-directory hygiene through ``train.py`` (one CPU process, a 1-layer model): the run-directory lock refuses a
second job (exit 2) and is released at the end, ``save_top_k`` holds across crashes, restarts and a moved run
directory, and a checkpoint's own step is in the TensorBoard event file the moment the checkpoint is published.

Faults come from ``NXD_LC_FAULT`` (:mod:`nxd_lc.runtime.faults`): ``kill9@after_publish:<step>`` kills the process
right after checkpoint ``<step>`` is published (before anything else happens), ``kill9@mid_save:<step>`` while it is
being written.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import re
import shutil
import socket
import subprocess
import sys
from typing import Any

import pytest

from nxd_lc.checkpoint import sharded
from nxd_lc.lightning import exp_manager
from nxd_lc.lightning.run_lock import LOCK_FILE, RunLock
from tests.test_e2e import _small_corpus

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def data(tmp_path_factory: Any) -> tuple[str, str]:
    """(corpus, tokenizer cache) shared by this module's runs."""
    root = str(tmp_path_factory.mktemp("retention_data"))
    return _small_corpus(root), os.path.join(root, "tok")


def _train(data: tuple[str, str], log_dir: str, max_steps: int, fault: str = "",
           extra: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    corpus, cache = data
    cmd = [sys.executable, "train.py", "--config-name", "cpu_tiny_llama_config", "trainer.devices=1",
           f"trainer.max_steps={max_steps}", "trainer.log_every_n_steps=1", "trainer.val_check_interval=100",
           "trainer.limit_val_batches=0", "+trainer.enable_progress_bar=false",
           "distributed_strategy.tensor_model_parallel_size=1", "distributed_strategy.sequence_parallel=false",
           "~data.builtin_corpus", f"+data.train_dir={corpus}", "+data.file_glob=**/*.py", "data.val_fraction=0.1",
           "data.tokenizer.vocab_size=512", f"+data.tokenizer.cache_dir={cache}", "model.encoder_seq_length=128",
           "+model.num_layers=1", "+model.hidden_size=64", "model.optim.sched.warmup_steps=1",
           f"exp_manager.explicit_log_dir={log_dir}", "exp_manager.checkpoint_callback_params.every_n_train_steps=1",
           "exp_manager.checkpoint_callback_params.save_top_k=2", *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", NXD_LC_FAULT=fault)
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=False)


def _steps(log_dir: str) -> list[int]:
    """Steps of the complete checkpoints, from their names (``cpu_tiny_llama--step=<n>-...``)."""
    return [int(re.search(r"step=(\d+)-", t).group(1))  # type: ignore[union-attr]
            for t in sharded.list_checkpoints(os.path.join(log_dir, "checkpoints"))]


def _logged_steps(log_dir: str) -> list[list[int]]:
    """Per event file (one per launch, oldest first): the steps whose ``reduced_train_loss`` it holds, in file
    order. TensorBoard's step is the optimizer step, as in the checkpoint names."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = []
    for f in sorted(glob.glob(os.path.join(log_dir, "tensorboard", "events.out.tfevents.*")), key=os.path.getmtime):
        acc = EventAccumulator(f)
        acc.Reload()
        scalars = acc.Scalars("reduced_train_loss") if "reduced_train_loss" in acc.Tags()["scalars"] else []
        out.append([e.step for e in scalars])
    return out


def _check(out: subprocess.CompletedProcess, killed: bool, resumed_from: int | None) -> None:
    text = out.stdout + out.stderr
    assert (out.returncode == -9) if killed else (out.returncode == 0), text[-3000:]
    m = re.search(r"resuming from \S*step=(\d+)-", text)
    assert (int(m.group(1)) if m else None) == resumed_from, text[-3000:]


@pytest.mark.compat
def test_startup_deletes_only_provably_unfinished_nxd_lc_saves(tmp_path: Any, caplog: Any) -> None:
    """A visible directory without ``done`` is deleted at start only when it is an unfinished nxd_lc save; a
    done-less directory in NxD's layout (it may be a complete NxD checkpoint without markers) is kept, with a
    warning naming it."""
    root = str(tmp_path / "checkpoints")
    kwargs: dict[str, Any] = dict(optim_state=None, user_content={"global_step": 2}, dp_rank=0, tp_rank=0, pp_rank=0,
                                  is_global_zero=True, write_model=True, write_optim=False, use_xser=True)
    sharded.save_checkpoint(root, "step=2", model_state={"w": 2}, **kwargs)  # complete
    staged = sharded.stage_checkpoint(root, "step=3", model_state={"w": 3}, **kwargs)
    staged.write()  # written, never published; then made visible (e.g. renamed or copied by hand)
    os.rename(os.path.join(root, ".step=3.partial"), os.path.join(root, "step=3"))
    nxd = os.path.join(root, "step=4", "model")  # NxD's layout, no marker
    os.makedirs(nxd)
    open(os.path.join(nxd, "dp_rank_00_tp_rank_00_pp_rank_00.pt"), "wb").close()
    paths = exp_manager.ExpPaths(log_dir=str(tmp_path), checkpoint_dir=root)
    with caplog.at_level(logging.WARNING, logger="nxd_lc.lightning.exp_manager"):
        exp_manager.cleanup_interrupted_saves(paths, is_global_zero=True)
    assert sorted(os.listdir(root)) == ["newest", "step=2", "step=4"]
    assert f"removed {os.path.join(root, 'step=3')}: an unfinished nxd_lc checkpoint save" in caplog.text
    assert f"{os.path.join(root, 'step=4')} has no 'done' marker" in caplog.text


def test_second_job_on_a_locked_run_dir_exits_2(tmp_path: Any, data: tuple[str, str]) -> None:
    """While this process holds the lock, ``train.py`` on the same log dir stops with exit status 2 (a config
    error) naming the lock file, the owner and the fix, and leaves the owner's lock alone."""
    lock = RunLock(str(tmp_path))
    lock.acquire()
    try:
        out = _train(data, str(tmp_path), max_steps=1)
        assert out.returncode == 2, out.stderr[-3000:]
        assert f"is in use by pid {os.getpid()} on host {socket.gethostname()}" in out.stderr
        assert str(tmp_path / LOCK_FILE) in out.stderr and "explicit_log_dir" in out.stderr
        assert json.load(open(tmp_path / LOCK_FILE))["pid"] == os.getpid()
        assert not os.path.exists(tmp_path / "checkpoints")  # refused before anything was written
    finally:
        lock.release()


@pytest.mark.slow
def test_save_top_k_holds_across_crashes_restarts_and_a_moved_run_dir(tmp_path: Any, data: tuple[str, str]) -> None:
    run = str(tmp_path / "run")
    # 1. killed right after checkpoint 3 is published, before checkpoint 1 is removed: one too many for now, and
    #    step 3's scalars are already in the event file
    out = _train(data, run, 5, fault="kill9@after_publish:3")
    _check(out, killed=True, resumed_from=None)
    assert _steps(run) == [1, 2, 3]
    assert _logged_steps(run) == [[1, 2, 3]]
    assert os.path.exists(os.path.join(run, LOCK_FILE))  # left by the kill: stale
    # 2. restart (takes the stale lock over), killed while checkpoint 4 is written: the leftover 1 was removed at
    #    the start, the checkpoint resumed from (3) is still there
    out = _train(data, run, 6, fault="kill9@mid_save:4")
    _check(out, killed=True, resumed_from=3)
    assert "taking over the lock" in out.stdout + out.stderr
    assert _steps(run) == [2, 3]
    # 3. restart to the end: exactly save_top_k=2 remain (the one resumed from, 3, removed once it dropped out)
    out = _train(data, run, 6)
    _check(out, killed=False, resumed_from=3)
    assert _steps(run) == [5, 6]
    assert not os.path.exists(os.path.join(run, LOCK_FILE))  # released at the end
    # 4. the run directory moved (Lightning then drops its restored top-k list): still exactly 2
    moved = str(tmp_path / "moved")
    shutil.move(run, moved)
    out = _train(data, moved, 8)
    _check(out, killed=False, resumed_from=6)
    assert _steps(moved) == [7, 8]
    # every launch logged each step it finished once; together they cover every step with none lost
    logged = _logged_steps(moved)
    assert logged == [[1, 2, 3], [], [4, 5, 6], [7, 8]]


@pytest.mark.compat
def test_async_save_publishes_only_after_its_step_is_logged(tmp_path: Any, data: tuple[str, str]) -> None:
    """With asynchronous saves checkpoint 2 is published at a later step boundary; a kill right after that
    publication must still find steps 1 and 2 in the event file."""
    run = str(tmp_path / "run")
    out = _train(data, run, 5, fault="kill9@after_publish:2", extra=("exp_manager.async_checkpointing=true",))
    _check(out, killed=True, resumed_from=None)
    assert _steps(run)[-1] == 2
    (logged,) = _logged_steps(run)
    assert logged[:2] == [1, 2] and len(set(logged)) == len(logged)
