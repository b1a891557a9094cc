"""One job per run directory: ``<log_dir>/.nxd_lc.lock``, held by global rank 0 for the whole run.

Two jobs writing checkpoints into one ``log_dir`` would publish, remove and resume each other's checkpoints. The
lock file is created with ``O_CREAT | O_EXCL`` (atomic on local and NFSv3+ filesystems) and holds JSON::

    {"pid": 1234, "host": "node-1", "started_at": 1763942400.0, "process_start": 123456789,
     "slurm_job_id": "42", "torchelastic_run_id": "..."}

A lock that exists is **stale**, and taken over with a warning, when

* its host is this host and its pid is not running, or is running but started at another time (pid reused:
  ``process_start`` is field 22 of ``/proc/<pid>/stat``); or
* its host is another one and it carries this process's ``SLURM_JOB_ID`` (a requeued SLURM job is the same job
  on any node: the previous allocation is gone by the time the job runs again) or ``TORCHELASTIC_RUN_ID`` (torchrun
  restarted the worker group after a failure, with global rank 0 now on another node: every agent stops its workers
  before the new round starts).

On this host the pid decides, also within one SLURM job or torchrun run: a live owner is a concurrent job step.

Otherwise the run stops with a :class:`~nxd_lc.config.errors.ConfigError` that names the lock file, its owner and
the fix; a lock file that is not such a record (damaged) stops it too, quoting what the file holds. Taking
over is atomic between takers: of two jobs that find the same stale lock, one takes it and the other finds it
live and refuses (:meth:`RunLock._take_over`). The lock is released (the file deleted, only if it is still
ours) when the run ends, also on an exception, and at interpreter exit. A lock left by a job killed with -9 on
another host cannot be proven stale: delete it by hand once that job is gone (the message says so).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import socket
import time
import uuid
from typing import Any, Optional

from nxd_lc.config.errors import ConfigError
from nxd_lc.runtime.process import pid_alive, process_start

log = logging.getLogger(__name__)

LOCK_FILE = ".nxd_lc.lock"


def _owner_record() -> dict[str, Any]:
    pid = os.getpid()
    return {"pid": pid, "host": socket.gethostname(), "started_at": time.time(), "process_start": process_start(pid),
            "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
            "torchelastic_run_id": os.environ.get("TORCHELASTIC_RUN_ID")}


def stale_reason(owner: dict[str, Any]) -> Optional[str]:
    """Why the lock of ``owner`` may be taken over, or None when its job may still be running (see module doc)."""
    mine = _owner_record()
    if owner.get("host") != mine["host"]:
        if owner.get("slurm_job_id") and owner.get("slurm_job_id") == mine["slurm_job_id"]:
            return f"it belongs to this SLURM job ({mine['slurm_job_id']}) before a requeue"
        if owner.get("torchelastic_run_id") and owner.get("torchelastic_run_id") == mine["torchelastic_run_id"]:
            return f"it belongs to this torchrun run ({mine['torchelastic_run_id']}) before a restart of its workers"
        return None
    pid = owner.get("pid")
    if not isinstance(pid, int):
        return "it names no pid"
    if not pid_alive(pid):
        return f"its process {pid} on this host is gone"
    start = process_start(pid)
    if owner.get("process_start") is not None and start is not None and start != owner.get("process_start"):
        return f"pid {pid} was reused by another process"
    return None


class RunLock:
    """The lock of one run directory, held by this process (see the module docstring)."""

    def __init__(self, log_dir: str) -> None:
        self.path = os.path.join(log_dir, LOCK_FILE)
        self.record = _owner_record()
        self.held = False

    def _create(self) -> bool:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            json.dump(self.record, f)
            f.flush()
            os.fsync(f.fileno())
        self.held = True
        return True

    def _read_owner(self) -> dict[str, Any]:
        return self._read_record(self.path)[0]

    @staticmethod
    def _read_record(path: str) -> tuple[dict[str, Any], Optional[str]]:
        """``(owner record, None)``; ``({}, what the file holds)`` when it is not a JSON object (damaged);
        ``({}, None)`` when it cannot be read (gone)."""
        try:
            with open(path, "rb") as f:
                raw = f.read(4096)
        except OSError:
            return {}, None
        try:
            owner = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            owner = None
        if isinstance(owner, dict):
            return owner, None
        return {}, repr(raw[:200]) + (" ..." if len(raw) > 200 else "")

    def _take_over(self, judged: dict[str, Any], inode: int) -> bool:
        """Replace the stale lock ``judged`` (the file whose inode was ``inode`` when it was judged) by ours.

        Two takers may judge the same stale lock: the first one's rename moves it aside and it creates its own;
        the second one's rename then moves that NEW lock aside. The inode and the record tell them apart (a freed
        inode is often reused at once, so the record is compared too: pid and start time differ): a taker that moved
        another file than the one it judged puts it back (``os.link`` never overwrites) and does not create a lock
        (it re-reads the owner, now live, and refuses). Returns True when this process created the lock.
        """
        aside = f"{self.path}.stale-{uuid.uuid4().hex}"
        try:
            os.replace(self.path, aside)
        except FileNotFoundError:  # another taker moved it first: re-read on the next round
            return False
        if os.stat(aside).st_ino != inode or self._read_record(aside)[0] != judged:  # inodes get reused: both
            try:
                os.link(aside, self.path)  # someone's fresh lock: put it back
            except OSError:  # a third lock appeared meanwhile (or no hard links here): keep the moved one
                log.warning("the run-directory lock %s changed hands during a takeover; the lock moved aside is "
                            "kept as %s", self.path, aside)
                return False
            os.remove(aside)
            return False
        log.warning("took over the lock %s of pid %s on %s (it held %s)", self.path, judged.get("pid"),
                    judged.get("host"), json.dumps(judged))
        os.remove(aside)
        return self._create()

    def acquire(self) -> None:
        """Create the lock, taking over a stale one.

        Raises:
            ConfigError: another live job holds it (names the file, owner pid/host/start time and the fix).
        """
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        for _ in range(3):
            if self._create():
                atexit.register(self.release)
                return
            try:
                inode = os.stat(self.path).st_ino
            except FileNotFoundError:  # released between our create and this read: try again
                continue
            owner, damaged = self._read_record(self.path)
            if damaged is not None:
                raise ConfigError([
                    f"exp_manager: the run-directory lock {self.path} is damaged (it holds {damaged}, not the JSON "
                    "record of a job), so whether a job still uses this run directory cannot be told; if none "
                    f"does, delete {self.path}"])
            if owner.get("pid") == self.record["pid"] and owner.get("host") == self.record["host"]:
                self.held = True  # this process took it already (e.g. prewarm then the run)
                return
            reason = stale_reason(owner)
            if reason is None:
                started = owner.get("started_at")
                when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)) if isinstance(
                    started, (int, float)) else "?"
                raise ConfigError([
                    f"exp_manager: the run directory {os.path.dirname(self.path)} is in use by pid {owner.get('pid')} "
                    f"on host {owner.get('host')} (started {when}; lock file {self.path}). Two jobs cannot share a "
                    f"run directory: give this one another exp_manager.explicit_log_dir / exp_manager.name, or stop "
                    f"that job; if it is gone (e.g. killed on another host), delete {self.path}"])
            log.warning("taking over the lock %s of pid %s on %s: %s", self.path, owner.get("pid"),
                        owner.get("host"), reason)
            if self._take_over(owner, inode):
                atexit.register(self.release)
                return
        raise ConfigError([f"exp_manager: could not take the run-directory lock {self.path} (another job keeps "
                           f"taking it); stop the other job or use another log dir"])

    def release(self) -> None:
        """Delete the lock file if this process still holds it (idempotent)."""
        if not self.held:
            return
        self.held = False
        owner = self._read_owner()
        if owner.get("pid") == self.record["pid"] and owner.get("host") == self.record["host"]:
            try:
                os.remove(self.path)
            except FileNotFoundError:
                pass
