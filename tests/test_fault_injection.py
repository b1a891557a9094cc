"""Fault injection through torchrun (TP=2 on 2 gloo processes): kill -9 at three moments, SIGTERM mid-step and
mid-save (the mid-save faults with asynchronous saves), a flipped byte and a truncated file, each followed by a
restart of the same command. After every
restart the loss of every step trained must be bitwise equal to an uninterrupted run's, and the run must resume
from the newest checkpoint that was published and verifies (the documented bound: a kill -9 loses the steps since
the last published checkpoint, a SIGTERM loses none).

The faults come from ``NXD_LC_FAULT`` (:mod:`nxd_lc.runtime.faults`); one chain of launches shares a run
directory so that each launch both checks a restart and injects the next fault.
"""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys
import time
from typing import Any

import pytest

from nxd_lc.checkpoint import sharded
from tests.test_e2e import _small_corpus

pytestmark = [pytest.mark.slow, pytest.mark.lane1_only]

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")
MAX_STEPS = 10


def _launch(log_dir: str, corpus: str, cache: str, fault: str = "", max_steps: int = MAX_STEPS,
            extra: tuple[str, ...] = ()) -> tuple[subprocess.CompletedProcess, float]:
    cmd = [TORCHRUN, "--standalone", "--nproc_per_node=2", "train.py", "--config-name", "cpu_tiny_llama_config",
           f"exp_manager.explicit_log_dir={log_dir}", f"trainer.max_steps={max_steps}",
           "trainer.log_every_n_steps=1", "trainer.val_check_interval=100", "trainer.limit_val_batches=0",
           "+trainer.enable_progress_bar=false", "exp_manager.checkpoint_callback_params.every_n_train_steps=2",
           "exp_manager.checkpoint_callback_params.save_top_k=3", "~data.builtin_corpus", f"+data.train_dir={corpus}",
           "+data.file_glob=**/*.py", "data.val_fraction=0.1", "data.tokenizer.vocab_size=1024",
           f"+data.tokenizer.cache_dir={cache}", "model.encoder_seq_length=128", "model.optim.sched.warmup_steps=1",
           *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", NXD_LC_FAULT=fault)
    start = time.monotonic()
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600, check=False)
    with open(os.path.join(os.path.dirname(log_dir), f"launch-{len(os.listdir(os.path.dirname(log_dir)))}.log"),
              "w") as f:  # kept for debugging a failure
        f.write(out.stdout + out.stderr)
    return out, time.monotonic() - start


def _losses(log_dir: str) -> list[dict[int, float]]:
    """``reduced_train_loss`` by step, one dict per TensorBoard event file (one file per launch), in launch order."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = sorted(glob.glob(os.path.join(log_dir, "tensorboard", "events.out.tfevents.*")), key=os.path.getmtime)
    out = []
    for f in files:
        acc = EventAccumulator(f)
        acc.Reload()
        tags = acc.Tags()["scalars"]
        # TensorBoard's step is the optimizer step s, as in the checkpoint names
        out.append({e.step: e.value for e in acc.Scalars("reduced_train_loss")} if "reduced_train_loss" in tags
                   else {})
    return out


def _resumed_step(out: subprocess.CompletedProcess) -> int | None:
    m = re.search(r"resuming from \S*step=(\d+)-", out.stdout + out.stderr)
    return int(m.group(1)) if m else None


def _steps(log_dir: str) -> list[int]:
    return [int(re.search(r"step=(\d+)-", t).group(1))  # type: ignore[union-attr]
            for t in sharded.list_checkpoints(os.path.join(log_dir, "checkpoints"))]


def _tensor_file(tag_dir: str) -> str:
    return sorted(glob.glob(os.path.join(tag_dir, "model", "*.tensors", "tensor_*.pt")))[0]


def _flip_byte(path: str) -> None:
    data = bytearray(open(path, "rb").read())
    data[len(data) // 3] ^= 0xFF  # inside the tensor bytes of a small zip
    open(path, "wb").write(bytes(data))


def test_faults_then_restart_match_an_uninterrupted_run(tmp_path: Any) -> None:
    corpus, cache = _small_corpus(str(tmp_path)), str(tmp_path / "cache")
    ref_dir, run = str(tmp_path / "ref"), str(tmp_path / "run")
    out, _ = _launch(ref_dir, corpus, cache)
    assert out.returncode == 0, out.stderr[-3000:]
    (ref,) = _losses(ref_dir)
    assert sorted(ref) == list(range(1, MAX_STEPS + 1))

    def launch(fault: str, resumed_from: int | None, expect_ok: bool, asynchronous: bool = False,
               extra: tuple[str, ...] = ()) -> tuple[subprocess.CompletedProcess, float]:
        out, seconds = _launch(run, corpus, cache, fault,
                               extra=extra + (("exp_manager.async_checkpointing=true",) if asynchronous else ()))
        text = out.stdout + out.stderr
        assert (out.returncode == 0) == expect_ok or "got signal: 15" in text, text[-3000:]
        assert _resumed_step(out) == resumed_from, text[-3000:]
        return out, seconds

    # 1. kill -9 of rank 1 in the middle of step 3: steps 1-2 and checkpoint 2 survive
    launch("kill9@mid_step:3:1", None, expect_ok=False)
    assert _steps(run) == [2]
    # 2. restart: resumes from 2; kill -9 of rank 0 just after checkpoint 4 is published
    launch("kill9@after_publish:4:0", 2, expect_ok=False)
    assert _steps(run) == [2, 4]
    # 3.-5. with asynchronous saves (the writes run in a background thread; the checkpoints are the same)
    # 3. restart: resumes from 4; kill -9 of rank 1 in the middle of writing checkpoint 6 (staging half written)
    launch("kill9@mid_save:6:1", 4, expect_ok=False, asynchronous=True)
    assert _steps(run) == [2, 4]
    # 4. restart: resumes from 4; SIGTERM to torchrun in the middle of step 5: the workers save step 5, exit 0
    out, seconds = launch("sigterm_launcher@mid_step:5:0", 4, expect_ok=True, asynchronous=True)
    assert _steps(run) == [2, 4, 5]
    assert "preemption checkpoint of step 5 saved" in out.stdout + out.stderr
    assert seconds < 90  # the whole launch; the signal-to-saved time is logged and checked below
    secs = float(re.search(r"step 5 saved ([\d.]+) s after the signal", out.stdout + out.stderr).group(1))  # type: ignore[union-attr]
    assert secs < 30
    # 5. restart: resumes from 5; SIGTERM while checkpoint 6 is being written: that save completes, the step
    #    running when the signal is seen (7) is saved too, exit 0
    launch("sigterm_launcher@mid_save:6:0", 5, expect_ok=True, asynchronous=True)
    assert _steps(run) == [5, 6, 7]
    # 6. damage: a flipped byte in checkpoint 7, a truncated file in checkpoint 6; the restart skips both (warning
    #    naming them), moves them aside, resumes from 5, the newest that verifies, and trains to the end
    tags = sharded.list_checkpoints(os.path.join(run, "checkpoints"))
    _flip_byte(_tensor_file(os.path.join(run, "checkpoints", tags[2])))
    uc = os.path.join(run, "checkpoints", tags[1], "user_content.pt")
    os.truncate(uc, os.path.getsize(uc) // 2)
    out, _ = launch("", 5, expect_ok=True, extra=("+exp_manager.enable_recovery_time_instrumentation=true",))
    text = out.stdout + out.stderr
    # recovery-time instrumentation: every phase reported once, non-negative, adding up to the total
    total = float(re.search(r"recovery time \(resume from \S*step=5\S*\): ([\d.]+) s from process start to the "
                            r"end of step 6", text).group(1))  # type: ignore[union-attr]
    phases = {m.group(1): float(m.group(2))
              for m in re.finditer(r"recovery_timing\]\s+(\w+_s)\s+([\d.]+) s$", text, re.M)}
    assert list(phases) == ["startup_s", "distributed_init_s", "model_build_s", "data_setup_s", "restore_s",
                            "first_step_s"]
    assert all(v >= 0 for v in phases.values()) and abs(sum(phases.values()) - total) < 0.05
    assert phases["startup_s"] > 0.5 and phases["first_step_s"] > 0  # imports alone take seconds
    assert re.search(r"skipping checkpoint \S*step=7\S*: checkpoint file \S*tensor_\d+\.pt' is corrupt", text)
    assert re.search(r"skipping checkpoint \S*step=6\S*: checkpoint file \S*user_content\.pt' has \d+ bytes", text)

    aside = sorted(n for n in os.listdir(os.path.join(run, "checkpoints")) if ".corrupt-" in n)
    assert [re.search(r"step=(\d+)-", n).group(1) for n in aside] == ["6", "7"]  # type: ignore[union-attr]
    # save_top_k=3 holds across restarts: the checkpoint resumed from (5) was removed once 3 newer ones existed
    assert _steps(run) == [6, 8, 10]

    launches = _losses(run)
    assert len(launches) == 6
    trained = [sorted(d) for d in launches]
    # the bound: each restart redoes exactly the steps after the checkpoint it resumed from
    # a kill right after publishing checkpoint 4 keeps step 4's scalars (written before the publication)
    assert trained[0] == [1, 2] and trained[1] == [3, 4] and trained[2][0] == 5 and trained[3] == [5]
    assert trained[4] == [6, 7] and trained[5] == [6, 7, 8, 9, 10]
    for d in launches:
        for step, loss in d.items():
            assert loss == ref[step], (step, loss, ref[step])  # bitwise: the float32 values are equal


def _children(pid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = open(f"/proc/{d}/stat").read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:  # field 4: ppid
                out.append(int(d))
    return out


def _alive(pid: int) -> bool:
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_workers_stop_and_save_when_torchrun_dies(tmp_path: Any) -> None:
    """A second job on the same run directory is refused; kill -9 of the torchrun parent: the workers notice at the
    next step boundary, save, exit and release the run-directory lock."""
    import signal

    corpus, cache, run = _small_corpus(str(tmp_path)), str(tmp_path / "cache"), str(tmp_path / "run")
    cmd = [TORCHRUN, "--standalone", "--nproc_per_node=2", "train.py", "--config-name", "cpu_tiny_llama_config",
           f"exp_manager.explicit_log_dir={run}", "trainer.max_steps=400", "trainer.log_every_n_steps=1",
           "trainer.val_check_interval=1000", "trainer.limit_val_batches=0", "+trainer.enable_progress_bar=false",
           "exp_manager.checkpoint_callback_params.every_n_train_steps=1000", "~data.builtin_corpus",
           f"+data.train_dir={corpus}", "+data.file_glob=**/*.py", "data.val_fraction=0.1",
           "data.tokenizer.vocab_size=1024", f"+data.tokenizer.cache_dir={cache}", "model.encoder_seq_length=128"]
    log_path = str(tmp_path / "out.log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"),
                                stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while "step 2/400" not in open(log_path).read():
            assert proc.poll() is None and time.monotonic() < deadline, open(log_path).read()[-3000:]
            time.sleep(0.5)
        # a second job on the same run directory is refused while this one holds it
        second = subprocess.run(cmd, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True,
                                text=True, timeout=300, check=False)
        assert second.returncode != 0 and "is in use by pid" in second.stderr, second.stderr[-3000:]
        workers = _children(proc.pid)
        assert len(workers) == 2
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 60
        while any(_alive(w) for w in workers):
            assert time.monotonic() < deadline, "workers still running 60 s after their launcher died"
            time.sleep(0.5)
    text = open(log_path).read()
    assert "launcher (torchrun) died" in text, text[-3000:]
    assert not os.path.exists(os.path.join(run, ".nxd_lc.lock"))  # released by the exiting workers
    steps = _steps(run)
    assert len(steps) == 1 and 2 <= steps[0] < 400  # saved at the step boundary where the death was noticed


def test_sigterm_during_startup_stops_within_seconds_and_writes_nothing_half(tmp_path: Any) -> None:
    """SIGTERM to rank 0 while it has written the tokenizer cache to its temporary path and not yet published it
    (``mid_cache_build``; to the process itself, so the signal lands exactly there): rank 0 stops at once with
    128 + SIGTERM, torchrun then stops rank 1 (waiting for the cache) the same way; no step, no checkpoint, the
    cache is not published and its temporary directory is gone. Before issue 25 the signal only set a flag acted on
    at the first step boundary: start-up ran on (published the cache, trained a step, saved)."""
    log_dir, cache = str(tmp_path / "run" / "log"), str(tmp_path / "cache")
    corpus = _small_corpus(tmp_path)
    out, seconds = _launch(log_dir, corpus, cache, fault="sigterm@mid_cache_build:0:0", max_steps=4)
    text = out.stdout + out.stderr
    assert out.returncode != 0, text[-3000:]
    assert "SIGTERM before the first training step" in text, text[-3000:]
    assert "reduced_train_loss" not in text and _steps(log_dir) == []
    leftovers = [os.path.relpath(p, cache) for p in glob.glob(os.path.join(cache, "**", "*"), recursive=True)
                 if ".tmp-" in os.path.basename(p)]
    assert leftovers == []
    assert not glob.glob(os.path.join(cache, "**", "*.json"), recursive=True)  # the tokenizer was not published
    assert seconds < 120, f"took {seconds:.0f} s"
