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


def _stale_lock(log_dir: Any) -> str:
    path = os.path.join(str(log_dir), LOCK_FILE)
    with open(path, "w") as f:
        json.dump({"pid": _dead_pid(), "host": socket.gethostname(), "started_at": 0.0}, f)
    return path


def test_two_takers_of_one_stale_lock_one_wins_the_other_refuses(tmp_path: Any, monkeypatch: Any) -> None:
    """B judges the stale lock stale; A takes it over at that moment (the race, made deterministic); B's takeover
    then must not move A's fresh lock aside (before this fix it did, created its own, and both held the run
    directory): A holds it, B refuses."""
    import nxd_lc.lightning.run_lock as run_lock

    path = _stale_lock(tmp_path)
    a, b = RunLock(str(tmp_path)), RunLock(str(tmp_path))
    b.record = {**b.record, "pid": os.getppid()}  # another live job on this host
    real, raced = run_lock.stale_reason, []

    def racing(owner: dict) -> Any:
        reason = real(owner)
        if reason is not None and not raced:
            raced.append(True)
            a.acquire()  # A wins the race right after B judged the lock stale
        return reason

    monkeypatch.setattr(run_lock, "stale_reason", racing)
    with pytest.raises(ConfigError, match="is in use by pid"):
        b.acquire()
    assert raced and a.held and not b.held
    with open(path) as f:
        assert json.load(f)["pid"] == os.getpid()  # A's lock, in place
    assert not [n for n in os.listdir(tmp_path) if ".stale-" in n]
    a.release()


@pytest.mark.parametrize("content", [b"\x00\x01garbage", b'["not", "a", "record"]', b"\xff\xfe{"])
def test_a_damaged_lock_is_reported_with_what_it_holds(tmp_path: Any, content: bytes) -> None:
    path = os.path.join(str(tmp_path), LOCK_FILE)
    with open(path, "wb") as f:
        f.write(content)
    with pytest.raises(ConfigError) as info:
        RunLock(str(tmp_path)).acquire()
    message = str(info.value)
    assert "is damaged" in message and repr(content[:200]) in message and f"delete {path}" in message
    assert os.path.exists(path)  # left for the user to judge
