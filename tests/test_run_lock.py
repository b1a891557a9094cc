"""The run-directory lock: one job per log_dir, stale locks taken over, released at the end."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from typing import Any

import pytest

from nxd_lc.config.errors import ConfigError
from nxd_lc.lightning.run_lock import LOCK_FILE, RunLock

pytestmark = pytest.mark.compat  # torch-2.9 compatibility subset (lane 2; docs/testing.md)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _other_process_acquires(log_dir: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    code = ("import sys; from nxd_lc.lightning.run_lock import RunLock\n"
            "from nxd_lc.config.errors import ConfigError\n"
            f"lock = RunLock({log_dir!r})\n"
            "try:\n    lock.acquire()\nexcept ConfigError as e:\n    print(e); sys.exit(3)\n"
            "print('acquired'); lock.release()\n")
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=False,
                          env=dict(os.environ, **(env or {})), timeout=120)


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_second_job_is_refused_and_lock_is_released(tmp_path: Any) -> None:
    lock = RunLock(str(tmp_path))
    lock.acquire()
    owner = json.load(open(tmp_path / LOCK_FILE))
    assert owner["pid"] == os.getpid() and owner["host"] == socket.gethostname()
    out = _other_process_acquires(str(tmp_path))
    assert out.returncode == 3, out.stdout + out.stderr
    assert f"is in use by pid {os.getpid()} on host {socket.gethostname()}" in out.stdout
    assert str(tmp_path / LOCK_FILE) in out.stdout
    lock.acquire()  # re-entrant in the owning process
    lock.release()
    assert not (tmp_path / LOCK_FILE).exists()
    assert "acquired" in _other_process_acquires(str(tmp_path)).stdout


def test_stale_lock_of_a_dead_pid_is_taken_over(tmp_path: Any, caplog: Any) -> None:
    (tmp_path / LOCK_FILE).write_text(json.dumps({"pid": _dead_pid(), "host": socket.gethostname()}))
    lock = RunLock(str(tmp_path))
    lock.acquire()
    assert json.load(open(tmp_path / LOCK_FILE))["pid"] == os.getpid()
    assert any("taking over the lock" in r.getMessage() and "is gone" in r.getMessage() for r in caplog.records)
    lock.release()


def test_other_host_blocks_unless_same_slurm_job(tmp_path: Any, monkeypatch: Any) -> None:
    (tmp_path / LOCK_FILE).write_text(json.dumps({"pid": 1, "host": "some-other-node", "slurm_job_id": "77"}))
    with pytest.raises(ConfigError, match="in use by pid 1 on host some-other-node"):
        RunLock(str(tmp_path)).acquire()
    monkeypatch.setenv("SLURM_JOB_ID", "77")  # the same job, requeued onto this node
    lock = RunLock(str(tmp_path))
    lock.acquire()
    assert json.load(open(tmp_path / LOCK_FILE))["slurm_job_id"] == "77"
    lock.release()


def test_release_never_deletes_another_owners_lock(tmp_path: Any) -> None:
    lock = RunLock(str(tmp_path))
    lock.acquire()
    (tmp_path / LOCK_FILE).write_text(json.dumps({"pid": 1, "host": "some-other-node"}))  # taken over meanwhile
    lock.release()
    assert (tmp_path / LOCK_FILE).exists()


def test_same_job_on_this_host_is_decided_by_the_pid(tmp_path: Any, monkeypatch: Any) -> None:
    """Within one SLURM job (or torchrun run) a live owner on this host is a concurrent step: refused; on another
    host the same torchrun run id means torchrun restarted its workers (the old ones are stopped): taken over."""
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        monkeypatch.setenv("SLURM_JOB_ID", "77")
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run-a")
        (tmp_path / LOCK_FILE).write_text(json.dumps({"pid": sleeper.pid, "host": socket.gethostname(),
                                                      "slurm_job_id": "77", "torchelastic_run_id": "run-a"}))
        with pytest.raises(ConfigError, match=f"in use by pid {sleeper.pid} on host {socket.gethostname()}"):
            RunLock(str(tmp_path)).acquire()
    finally:
        sleeper.kill()
        sleeper.wait()
    monkeypatch.delenv("SLURM_JOB_ID")
    (tmp_path / LOCK_FILE).write_text(json.dumps({"pid": 5, "host": "node-7", "torchelastic_run_id": "run-b"}))
    with pytest.raises(ConfigError, match="in use by pid 5 on host node-7"):  # another torchrun run
        RunLock(str(tmp_path)).acquire()
    (tmp_path / LOCK_FILE).write_text(json.dumps({"pid": 5, "host": "node-7", "torchelastic_run_id": "run-a"}))
    lock = RunLock(str(tmp_path))
    lock.acquire()
    assert json.load(open(tmp_path / LOCK_FILE))["pid"] == os.getpid()
    lock.release()
    assert not (tmp_path / LOCK_FILE).exists()
