"""``torchrun`` for the tests, without an interpreter start per process: ``run(cmd, ...)`` is ``subprocess.run`` for
a ``torchrun --standalone --nproc_per_node=N <script.py | -m module> args...`` command line, whose ranks are forks of
Python's fork server (``dist_utils.start_method``), which imported torch, transformers, Lightning and nxd_lc once.

Why: a train.py launch on this project's 2-core CI machines spent most of its time importing: torchrun's agent
(~3 s of CPU) and every rank (~8 s each) before the first step. A rank here is a process of its own as under torchrun
(its own ``torch.distributed`` world over gloo, its own module state, ``RANK`` / ``LOCAL_RANK`` / ``WORLD_SIZE`` /
``LOCAL_WORLD_SIZE`` / ``MASTER_ADDR`` / ``MASTER_PORT`` / ``TORCHELASTIC_RUN_ID`` / ``TORCHELASTIC_RESTART_COUNT`` in
its environment, the script run as ``__main__`` with its arguments, non-daemon threads joined and ``atexit`` run at
its end), started from the caller's environment and directory.

What differs from torchrun, so it is not used where the test is about it:

* no elastic agent: no restarts, no signal forwarding, no ``ChildFailedError`` report. When a rank fails, the others
  get SIGTERM (torchrun does the same) and the return code is 1; the ranks' output is concatenated per stream, each
  line as the rank wrote it. Fault injection, signal and restart tests launch the real torchrun.
* modules imported by the fork server computed their import-time state without the rank's environment. Lightning's
  ``rank_zero_only.rank`` (read from ``RANK`` at import) is set to the rank here; nxd_lc reads ``NXD_LC_FAULT`` at
  import (``nxd_lc.runtime.faults``), so a command with it set runs under the real torchrun.

Any other command line (other torchrun options, a plain ``python script.py``) runs as ``subprocess.run`` would;
``NXD_LC_TEST_START_METHOD=spawn`` makes every launch the real one.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import uuid
from typing import Any

from dist_utils import _free_port, child_setup, redirect_output, start_method

_TORCHRUN_MODULE = "torch.distributed.run"


def _parse(cmd: list[str]) -> tuple[int, bool, str, list[str]] | None:
    """``(nproc, is_module, script_or_module, args)`` of a ``torchrun --standalone --nproc_per_node=N`` command line
    (``torchrun`` or ``python -m torch.distributed.run``), or None for any other command."""
    if len(cmd) >= 3 and cmd[1:3] == ["-m", _TORCHRUN_MODULE]:
        rest = cmd[3:]
    elif os.path.basename(cmd[0]) == "torchrun":
        rest = cmd[1:]
    else:
        return None
    nproc, standalone, i = None, False, 0
    while i < len(rest) and rest[i].startswith("--"):
        opt = rest[i].replace("-", "_")
        if opt == "__standalone":
            standalone = True
        elif opt.startswith("__nproc_per_node="):
            nproc = rest[i].split("=", 1)[1]
        elif opt == "__nproc_per_node" and i + 1 < len(rest):
            i += 1
            nproc = rest[i]
        else:
            return None  # an option this launcher does not model
        i += 1
    if not standalone or nproc is None or not nproc.isdigit() or i >= len(rest):
        return None
    if rest[i] == "-m":
        return (int(nproc), True, rest[i + 1], rest[i + 2:]) if i + 1 < len(rest) else None
    return int(nproc), False, rest[i], rest[i + 1:]


def _rank_main(rank: int, is_module: bool, target: str, args: list[str], env: dict[str, str], cwd: str,
               out_path: str, err_path: str) -> None:
    """One rank (a fork of the fork server): output appended to the launch's two files, the rank's torchrun
    environment, then the script or module as ``__main__``; ends as an interpreter does (non-daemon threads joined,
    ``atexit`` run) with the script's exit code."""
    import atexit
    import runpy
    import threading
    import traceback

    redirect_output(out_path, err_path, append=True)
    child_setup(env, cwd)
    from lightning_utilities.core.rank_zero import rank_zero_only

    rank_zero_only.rank = rank  # Lightning reads RANK at import, which the fork server did without it
    code = 0
    try:
        if is_module:
            sys.argv = [target, *args]
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            path = os.path.join(cwd, target)
            sys.argv = [target, *args]
            sys.path.insert(0, os.path.dirname(path))
            runpy.run_path(path, run_name="__main__")
    except SystemExit as e:
        if isinstance(e.code, int) or e.code is None:
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    try:
        threading._shutdown()  # type: ignore[attr-defined]  # what the interpreter does at exit
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def run(cmd: list[str], *, check: bool = False, cwd: str | None = None, env: dict[str, str] | None = None,
        timeout: float | None = None, **kwargs: Any) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, check=check, cwd=cwd, env=env, timeout=timeout, **kwargs)`` for a torchrun command
    line (see the module docstring), its ranks forked from the fork server; output is captured (text) as with
    ``capture_output=True, text=True``, which the caller must ask for.

    Raises:
        subprocess.TimeoutExpired: a rank ran past ``timeout`` (every rank is killed first).
    """
    env = dict(os.environ if env is None else env)
    parsed = _parse(cmd)
    if parsed is None or env.get("NXD_LC_FAULT") or start_method() == "spawn":
        return subprocess.run(cmd, check=check, cwd=cwd, env=env, timeout=timeout, **kwargs)
    if not (kwargs.get("capture_output") and kwargs.get("text")):
        raise ValueError("launch.run captures text output: pass capture_output=True, text=True")
    import multiprocessing

    nproc, is_module, target, args = parsed
    cwd = os.path.abspath(cwd or os.getcwd())
    port, run_id = _free_port(), uuid.uuid4().hex[:12]
    ctx = multiprocessing.get_context(start_method())
    with tempfile.TemporaryDirectory() as tmp:
        out_path, err_path = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        procs = []
        for rank in range(nproc):
            rank_env = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
                        "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
                        "ROLE_WORLD_SIZE": str(nproc), "ROLE_NAME": "default", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(port), "TORCHELASTIC_RUN_ID": run_id,
                        "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
                        "TORCHELASTIC_USE_AGENT_STORE": "False"}
            rank_env.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default with several processes
            p = ctx.Process(target=_rank_main, name=f"rank{rank}",
                            args=(rank, is_module, target, args, rank_env, cwd, out_path, err_path))
            p.start()
            procs.append(p)
        deadline = None if timeout is None else time.monotonic() + timeout
        failed = False
        while any(p.is_alive() for p in procs):
            if any(p.exitcode not in (None, 0) for p in procs) and not failed:
                failed = True  # as torchrun: stop the other ranks
                for p in procs:
                    if p.is_alive():
                        p.terminate()
                grace = time.monotonic() + 30
                deadline = grace if deadline is None else min(deadline, grace)
            if deadline is not None and time.monotonic() > deadline:
                for p in procs:
                    p.kill()
                for p in procs:
                    p.join()
                out, err = open(out_path).read(), open(err_path).read()
                if not failed:
                    raise subprocess.TimeoutExpired(cmd, timeout, output=out, stderr=err)
                break
            time.sleep(0.05)
        for p in procs:
            p.join()
        codes = [p.exitcode for p in procs]
        out = open(out_path, errors="replace").read() if os.path.exists(out_path) else ""
        err = open(err_path, errors="replace").read() if os.path.exists(err_path) else ""
    rc = 0 if all(c == 0 for c in codes) else 1
    if rc and check:
        raise subprocess.CalledProcessError(rc, cmd, out, err)
    return subprocess.CompletedProcess(cmd, rc, out, err)
