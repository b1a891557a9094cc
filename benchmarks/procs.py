"""Run measurements in child processes under a resident-memory cap, so one out-of-memory run cannot take the
harness (or the machine) down.

The cap is enforced two ways, both per process:

1. **Watchdog (the cap that defines "fits")**: the parent reads every child's ``VmRSS`` from
   ``/proc/<pid>/status`` every ``poll_s`` (20 ms) and kills all children of the measurement (SIGKILL) as soon as
   one exceeds ``cap_bytes``. Afterwards a finished child's own ``VmHWM`` (peak RSS, kernel-tracked, so it also
   sees spikes shorter than the poll interval) is compared with the cap too: a run fits only if its peak RSS
   stayed <= cap.
2. **Backstop ``RLIMIT_AS``** (``resource.setrlimit``, set by the child itself before it imports torch; passed as
   ``--as-limit``) at ``cap + as_headroom``: torch's
   CPU allocator then fails with a clean ``RuntimeError`` / ``MemoryError`` instead of the kernel OOM killer
   if memory grows faster than the watchdog can react. Address space is not RSS (a torch process maps
   ~1-2 GiB of libraries and thread stacks it never touches), hence the headroom; it alone would be an
   imprecise cap, which is why the watchdog defines the result.

The watchdog also protects the other processes on the machine: if ``MemAvailable`` in ``/proc/meminfo`` drops
below ``reserve_bytes`` it kills the measurement and reports ``low_memory`` (a machine problem, not a result).

Each child writes its result as JSON to the path given as ``--out`` (see :mod:`benchmarks.step_worker`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

__all__ = ["ChildResult", "run_children"]

GIB = 1 << 30


@dataclasses.dataclass
class ChildResult:
    """Outcome of one measurement (one or more cooperating children).

    Attributes:
        status: ``ok`` | ``over_cap`` (killed by the watchdog, or peak RSS above the cap) | ``oom`` (the child's
            allocator failed under ``RLIMIT_AS``) | ``low_memory`` (machine ran low; no result) | ``timeout`` |
            ``error`` (non-zero exit; see ``log_tail``).
        results: each child's JSON result (None where it wrote none), in launch order.
        watch_peak_rss: largest ``VmRSS`` the watchdog saw, per child, in bytes.
        wall_s: seconds from launch to the last exit.
        log_tail: the last lines of the children's stderr (for errors).
    """

    status: str
    results: list[dict[str, Any] | None]
    watch_peak_rss: list[int]
    wall_s: float
    log_tail: str = ""

    def peak_rss(self) -> int:
        """Largest peak RSS of any child (its own VmHWM when it reported one, else what the watchdog saw)."""
        peaks = [max(w, (r or {}).get("peak_rss", 0)) for w, r in zip(self.watch_peak_rss, self.results)]
        return max(peaks) if peaks else 0


def _status_field(pid: int, field: str) -> int:
    """``/proc/<pid>/status`` field in bytes, 0 once the process is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError):
        pass
    return 0


def _mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 1 << 62


def _kill_all(procs: Sequence[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)  # the child's own session (it may have spawned helpers)
            except ProcessLookupError:
                pass
    for p in procs:
        p.wait()


def _watch(procs: list[subprocess.Popen[bytes]], cap: int, reserve: int, timeout_s: float,
           poll_s: float) -> tuple[str | None, list[int]]:
    """Poll until every child exits or one limit trips; returns (tripped status or None, watchdog peaks)."""
    peaks = [0] * len(procs)
    deadline = time.monotonic() + timeout_s
    while any(p.poll() is None for p in procs):
        for i, p in enumerate(procs):
            peaks[i] = max(peaks[i], _status_field(p.pid, "VmRSS"))
        if max(peaks) > cap:
            return "over_cap", peaks
        if _mem_available() < reserve:
            return "low_memory", peaks
        if time.monotonic() > deadline:
            return "timeout", peaks
        time.sleep(poll_s)
    return None, peaks


def _read_json(path: str) -> dict[str, Any] | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def _status_from_exit(procs: Sequence[subprocess.Popen[bytes]], results: Sequence[dict[str, Any] | None],
                      cap: int) -> str:
    """Status of children that all exited on their own."""
    if any(r is not None and r.get("status") == "oom" for r in results):
        return "oom"
    if any(p.returncode != 0 for p in procs) or any(r is None for r in results):
        return "error"
    if any(r.get("peak_rss", 0) > cap for r in results if r is not None):
        return "over_cap"
    return "ok"


def run_children(argvs: Sequence[Sequence[str]], *, cap_bytes: int, as_headroom: int = 6 * GIB,
                 reserve_bytes: int = GIB, timeout_s: float = 1800.0, poll_s: float = 0.02,
                 envs: Sequence[dict[str, str]] | None = None, cwd: str | None = None) -> ChildResult:
    """Launch ``python <argv...> --out <tmp.json> --as-limit <bytes>`` for each argv at once; watch them (module
    docstring).

    Args:
        argvs: argument lists after ``python``, e.g. ``["-m", "benchmarks.step_worker", "run", ...]``.
        cap_bytes: per-process resident-memory cap.
        as_headroom: ``RLIMIT_AS`` = cap + this.
        reserve_bytes: kill everything if the machine's MemAvailable drops below this.
        timeout_s: wall-clock limit for the whole measurement.
        envs: extra environment per child (e.g. RANK / WORLD_SIZE for a multi-process measurement).
        cwd: working directory of the children (the repository root, so ``benchmarks`` imports).

    Returns:
        A :class:`ChildResult`; never raises for a failing child.
    """
    envs = list(envs) if envs is not None else [{} for _ in argvs]
    outs = [tempfile.NamedTemporaryFile(prefix="nxd_bench_", suffix=".json", delete=False).name for _ in argvs]
    logs = [tempfile.TemporaryFile() for _ in argvs]
    limit = cap_bytes + as_headroom
    start = time.monotonic()
    procs = [subprocess.Popen([sys.executable, *argv, "--out", out, "--as-limit", str(limit)],
                              env={**os.environ, **env}, cwd=cwd, stdout=log, stderr=subprocess.STDOUT,
                              start_new_session=True)
             for argv, out, env, log in zip(argvs, outs, envs, logs)]
    tripped, peaks = _watch(procs, cap_bytes, reserve_bytes, timeout_s, poll_s)
    if tripped:
        _kill_all(procs)
    results = [_read_json(o) for o in outs]
    status = tripped or _status_from_exit(procs, results, cap_bytes)
    tail = ""
    for log in logs:
        log.seek(0)
        tail += log.read().decode("utf-8", errors="replace")[-3000:]
        log.close()
    for o in outs:
        os.unlink(o)
    return ChildResult(status, results, peaks, time.monotonic() - start, tail if status != "ok" else "")
