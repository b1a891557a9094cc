"""Several XLA devices in one process on a CPU machine: the multi-device torch-xla test bed (lane 2).

Stock torch-xla cannot run several XLA-CPU devices with collectives: one process with a thread per device
deadlocks (each thread compiles the same graph separately, gets its own HloModule id, and XLA:CPU keys a
collective's rendezvous by that id), and torchrun processes do not form a world (facts and measurements:
``../shared/reference/xla_multidevice_cpu.md``). This test bed makes N devices work and turns every way the
multi-device path can go wrong into a test failure that names the place, never a hang:

* **One process, one thread per device** (``PJRT_DEVICE=CPU CPU_NUM_DEVICES=N``), each thread with its own default
  XLA device, its own ``torch.distributed`` world (torch's test-only ``ThreadLocalWorld``, process-group names
  prefixed by the rank) of the ``xla`` backend, and its own nxd_lc parallel state
  (``parallel_state._STORE`` becomes a ``threading.local``). Autograd runs backward on the calling thread.
* **Ordered graph cuts** (the key): ``torch_xla.sync`` / ``xm.mark_step`` are replaced so that cut number k
  waits until every rank has reached cut k, then the ranks cut one after another in rank order. Rank 0
  compiles; every other rank must find the same executable in torch-xla's compile cache (same graph hash, same
  module, same collective op ids). A host read of a pending XLA tensor (``.cpu()``, ``.item()``, ``.tolist()``,
  ``.numpy()``, ``float()``, ``int()``, ``bool()``, ``.to('cpu')``) takes an ordered cut first.
* **Divergence**: if a cut compiles on a rank > 0 (torch-xla's ``CompileTime`` count grows during that rank's
  turn), that rank traced a different graph than rank 0: the run stops at once (before XLA's 10 s collective
  abort) and the test fails naming the cut, the rank and the nxd_lc / test line that took the cut. Under pipeline
  parallelism the stages trace different graphs by design, so the rule holds per pipeline stage: a rank may
  compile only if no lower rank of its stage (same pipeline rank, from nxd_lc's parallel state) took the cut.
  Collectives between stages are isolated in graphs of their own, which every rank finds in the cache; were such
  a graph different on two stages, XLA's own abort ends the run (a failed run, with less detail).
* **Hangs**: a rank that waits longer than ``wait_timeout_s`` at a cut fails the run naming the cut, where it was
  taken, and which ranks had arrived.
* Per-thread ranks where libraries keep them process-wide: torchrun's ``RANK`` / ``WORLD_SIZE`` / ... in
  ``os.environ`` and Lightning's ``rank_zero_only.rank``, so that ``train.py``'s code path (``nxd_lc.app.run``,
  the Lightning Trainer) runs in each device thread as in one process per device.
* Lightning's process-wide patch of the ``DataLoader`` classes during a dataloader hook is shared between the device
  threads (applied by the first one in, restored by the last one out), not undone by one thread under another.
* ``xm.rendezvous`` (and through it ``xm.mesh_reduce``: a rank-dependent device graph by design) is replaced by a
  host-side exchange between the threads, counted per rank (``rendezvous_calls``: in production each call is
  device work and host reads that torch-xla's metrics here do not show); ``XLA_ENABLE_PARAM_ALIASING=0`` (an
  in-place parameter update with aliasing made rank 0's sync wait for rank 1's collective).

The test bed runs in a child process (``python tests/xla_testbed.py``), started by :func:`run_on_xla_devices`:
torch-xla's device count is fixed at its first use, a divergence or a deadlock must not take the test process
down, and the XLA runtime's own abort then shows as a failed run with the last report. The scenario is a
module-level function ``fn(rank, world_size, **kwargs) -> JSON-able`` named as ``'module:function'``; its return
values come back per rank.

What it cannot show: Neuron's compiler and runtime, the real collectives' timing and memory, and multi-process
rendezvous (a Trn1 node runs one process per NeuronCore; every production change the test bed needs keeps that
case unchanged).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import threading
import time
import traceback
from collections import defaultdict
from collections.abc import Callable, Iterator, MutableMapping
from dataclasses import dataclass, field
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXIT_DIVERGENCE, EXIT_TIMEOUT, EXIT_RANK_ERROR = 3, 4, 5
#: debugging a failed run: "1" prints every cut to stderr, "stack" also the stack that took it
TRACE = os.environ.get("NXD_LC_TESTBED_TRACE", "")


# ---- parent side ---------------------------------------------------------------------------------------------------
@dataclass
class TestbedRun:
    """Outcome of one test-bed run: per-rank return values and the cut log ``[(cut, rank, where, compiled)]``."""

    results: list[Any]
    cuts: list[list[Any]] = field(default_factory=list)
    wall_s: float = 0.0


def run_on_xla_devices(target: str, devices: int, kwargs: dict[str, Any] | None = None, timeout_s: float = 300,
                       wait_timeout_s: float = 60) -> TestbedRun:
    """Run ``target`` (``'module:function'``, importable from the repository root) on ``devices`` XLA-CPU
    devices of one child process; return its per-rank results.

    Raises:
        AssertionError: the run diverged (a graph compiled again on a rank > 0), a rank waited longer than
            ``wait_timeout_s`` at a cut, a rank raised, or the child died / overran ``timeout_s``; the message
            carries the test bed's report and the child's output tail.
    """
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": str(devices), "XLA_ENABLE_PARAM_ALIASING": "0",
               "OMP_NUM_THREADS": "1",
               # torch-xla runs each graph execution on a thread of its pool, sized by default to the CPU cores (2
               # here); an execution waiting in a collective holds its thread, so with more devices than threads the
               # peers' executions never start (seen with 4 devices and 2-rank groups: pipeline stages)
               "XLA_THREAD_POOL_SIZE": str(max(8, 4 * devices)),
               "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
        cmd = [sys.executable, os.path.join(REPO, "tests", "xla_testbed.py"), "--target", target, "--devices",
               str(devices), "--out", out, "--wait-timeout-s", str(wait_timeout_s), "--kwargs",
               json.dumps(kwargs or {})]
        t0 = time.monotonic()
        rc: int | None
        from dist_utils import start_method  # tests/ is on the path: the test's own or this script's directory

        method = start_method()
        if method != "spawn":
            rc, output = _run_forked(target, devices, out, wait_timeout_s, kwargs or {}, env, tmp, timeout_s, method)
        else:
            try:
                proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s,
                                      check=False)
                output = proc.stdout[-4000:] + proc.stderr[-6000:]
                rc = proc.returncode
            except subprocess.TimeoutExpired as e:
                output = ((e.stdout or b"").decode(errors="replace")[-4000:]
                          + (e.stderr or b"").decode(errors="replace")[-6000:])
                rc = None
        report = json.load(open(out)) if os.path.exists(out) else None
        if report is not None and report.get("ok") and rc == 0:
            return TestbedRun(report["results"], report.get("cuts", []), time.monotonic() - t0)
        what = (report or {}).get("error") or (f"the test bed overran {timeout_s} s" if rc is None
                                               else f"the test bed exited with {rc} and no report")
        raise AssertionError(f"XLA test bed, {target} on {devices} devices: {what}\n--- output tail ---\n{output}")


def _run_forked(target: str, devices: int, out: str, wait_timeout_s: float, kwargs: dict[str, Any],
                env: dict[str, str], tmp: str, timeout_s: float, method: str) -> tuple[int | None, str]:
    """The test bed's child started by ``multiprocessing`` with ``method`` (``"forkserver"``: a fork of Python's fork
    server, which imported torch, transformers, Lightning and nxd_lc once, see ``dist_utils.start_method``; a
    spawned test bed re-imports them). The child takes ``env`` as its whole environment
    and the repository as its directory, writes its output to a file and runs :func:`_child`. Returns its exit code
    (None: killed after ``timeout_s``) and its output tail."""
    import multiprocessing

    log = os.path.join(tmp, "output.txt")
    proc = multiprocessing.get_context(method).Process(
        target=_forked_child, args=(target, devices, out, wait_timeout_s, kwargs, env, log), name="xla-testbed")
    proc.start()
    proc.join(timeout_s)
    rc: int | None = proc.exitcode
    if proc.is_alive():
        proc.kill()
        proc.join()
        rc = None
    text = open(log, errors="replace").read() if os.path.exists(log) else ""
    return rc, text[-10000:]


def _forked_child(target: str, devices: int, out: str, wait_timeout_s: float, kwargs: dict[str, Any],
                  env: dict[str, str], log: str) -> None:
    """Entry of a forked test bed (:func:`_run_forked`): output to ``log``, then :func:`_child`, which leaves with
    ``os._exit``; an exception before it exits with ``EXIT_RANK_ERROR`` after printing its traceback."""
    from dist_utils import child_setup, redirect_output

    try:
        redirect_output(log)
        child_setup(env, REPO)
        _child(target, devices, out, wait_timeout_s, kwargs)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
    os._exit(EXIT_RANK_ERROR)


# ---- child side ----------------------------------------------------------------------------------------------------
class _Fail(Exception):
    """Raised inside the child to stop the run with a report."""


class _Bed:
    """The in-process machinery: ordered cuts, the host rendezvous, the report."""

    def __init__(self, n: int, out: str, wait_timeout_s: float) -> None:
        self.n, self.out, self.wait_timeout_s = n, out, wait_timeout_s
        self.cv = threading.Condition()
        self.arrived: dict[int, dict[int, str]] = defaultdict(dict)  # cut -> rank -> where
        self.done: dict[int, int] = defaultdict(int)  # cut -> ranks that cut it (in rank order)
        self.keys: dict[int, dict[int, int]] = defaultdict(dict)  # cut -> rank -> pipeline stage (0 without PP)
        self.local = threading.local()
        self.cut_log: list[list[Any]] = []
        self.exchanges: dict[tuple[Any, ...], dict[int, Any]] = defaultdict(dict)
        self.exchange_seq: dict[tuple[int, Any], int] = defaultdict(int)
        #: rank -> calls of the replaced ``xm.rendezvous`` (each is device work in production: see _install)
        self.rendezvous_calls: dict[int, int] = defaultdict(int)
        self.finished = False

    # the report: written once; the process ends right after a failure (before XLA's collective abort)
    def fail(self, code: int, message: str) -> None:
        with self.cv:
            if self.finished:
                return
            self.finished = True
            self._write({"ok": False, "error": message, "cuts": self.cut_log[-40:]})
        sys.stderr.write(f"XLA test bed: {message}\n")
        sys.stderr.flush()
        os._exit(code)

    def _write(self, report: dict[str, Any]) -> None:
        tmp = self.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(report, f)
        os.replace(tmp, self.out)

    @property
    def rank(self) -> int | None:
        return getattr(self.local, "rank", None)

    @staticmethod
    def where() -> str:
        """The innermost frame of nxd_lc or of the tests (not the test bed, torch or torch-xla) on the stack."""
        for frame in reversed(traceback.extract_stack()[:-2]):
            name = frame.filename
            if name.endswith("xla_testbed.py"):
                continue
            if "/nxd_lc/" in name or "/tests/" in name or "/benchmarks/" in name:
                return f"{os.path.relpath(name, REPO)}:{frame.lineno} in {frame.name}"
        return "outside nxd_lc"

    def ordered_cut(self, do_cut: Callable[[], Any], what: str) -> Any:
        """Cut number k of this rank: wait for every rank to reach cut k, cut in rank order, check that ranks
        > 0 compiled nothing."""
        rank = self.rank
        if rank is None:  # not a device thread (e.g. the main thread before the run): plain cut
            return do_cut()
        k = self.local.cuts
        self.local.cuts += 1
        where = self.where()
        deadline = time.monotonic() + self.wait_timeout_s
        key = _stage_key(rank)
        with self.cv:
            self.arrived[k][rank] = where
            self.keys[k][rank] = key
            self.cv.notify_all()
            while not (len(self.arrived[k]) == self.n and self.done[k] == rank):
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(set(range(self.n)) - set(self.arrived[k]))
                    self.cv.release()
                    try:
                        self.fail(EXIT_TIMEOUT, f"rank {rank} waited {self.wait_timeout_s:.0f} s at cut {k} ({what} "
                                                f"at {where}); ranks that reached it: "
                                                f"{dict(sorted(self.arrived[k].items()))}, never "
                                                f"reached: {missing}, ranks that cut it: {self.done[k]}")
                    finally:
                        self.cv.acquire()
                self.cv.wait(timeout=min(left, 1.0) if left > 0 else 0.1)
        if TRACE:
            stack = "".join(traceback.format_stack(limit=14)[:-2]) if TRACE == "stack" else ""
            sys.stderr.write(f"[testbed] cut {k} rank {rank}: {what} at {where}\n{stack}")
            sys.stderr.flush()
        before = _compiles()
        try:
            result = do_cut()
        except BaseException:
            self.fail(EXIT_RANK_ERROR, f"rank {rank} raised while cutting {k} ({what} at {where}):\n"
                                       f"{traceback.format_exc()}")
            raise
        compiled = _compiles() - before
        self.local.compiled += compiled
        with self.cv:
            self.cut_log.append([k, rank, where, compiled])
        peers = [r for r, r_key in self.keys[k].items() if r < rank and r_key == key]
        if peers and compiled > 0:
            first = peers[0]
            self.fail(EXIT_DIVERGENCE, f"divergence at cut {k} ({what}): rank {rank} compiled {compiled} graph(s) "
                                       f"that rank {first} did not (the ranks traced different graphs); the cut was "
                                       f"taken at {where} (rank {first} took it at {self.arrived[k].get(first)})")
        with self.cv:
            self.done[k] += 1
            self.cv.notify_all()
        return result

    def exchange(self, tag: Any, payload: Any, ranks: list[int] | None = None) -> list[Any]:
        """Host-side all-gather of ``payload`` between the device threads of ``ranks`` (all by default)."""
        rank = self.rank
        members = tuple(sorted(ranks)) if ranks else tuple(range(self.n))
        if rank is None:
            return [payload]
        seq_key = (rank, (tag, members))
        seq = self.exchange_seq[seq_key]
        self.exchange_seq[seq_key] += 1
        key = (tag, members, seq)
        deadline = time.monotonic() + self.wait_timeout_s
        with self.cv:
            self.exchanges[key][rank] = payload
            self.cv.notify_all()
            while len(self.exchanges[key]) < len(members):
                left = deadline - time.monotonic()
                if left <= 0:
                    self.cv.release()
                    self.fail(EXIT_TIMEOUT, f"rank {rank} waited {self.wait_timeout_s:.0f} s in the host rendezvous "
                                            f"{tag!r} (at {self.where()}); arrived: {sorted(self.exchanges[key])}")
                self.cv.wait(timeout=min(left, 1.0))
            return [self.exchanges[key][r] for r in members]


_BED: _Bed | None = None


def _stage_key(rank: int) -> int:
    """The pipeline rank of device thread ``rank`` from nxd_lc's (per-thread) parallel state; 0 without pipeline
    parallelism or before the parallel state exists."""
    from nxd_lc.distributed import parallel_state

    state = getattr(parallel_state._STORE, "state", None)
    if state is None or state.pp == 1:
        return 0
    return state.ranks["pp"].index(rank)


def _compiles() -> int:
    import torch_xla.debug.metrics as met

    data = met.metric_data("CompileTime")
    return int(data[0]) if data else 0


def _install(bed: _Bed) -> None:
    """Patch torch, torch-xla and nxd_lc's parallel state for N device threads in this (child) process."""
    import torch
    import torch.distributed as dist
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.distributed.xla_backend  # noqa: F401 -- registers the 'xla' backend, patches new_group
    from torch.testing._internal.distributed.multi_threaded_pg import ThreadLocalWorld

    from nxd_lc.distributed import parallel_state

    c10d = dist.distributed_c10d
    c10d._world = ThreadLocalWorld()  # each device thread its own default group, group map and counters
    original_name = c10d._process_group_name

    def group_name(ranks: Any, use_hashed_name: bool) -> str:  # the C++ group registry is process-global
        return f"r{bed.rank}_{original_name(ranks, use_hashed_name)}"

    c10d._process_group_name = group_name

    class _ThreadStore(threading.local):
        state = None

    parallel_state._STORE = _ThreadStore()

    original_sync = torch_xla.sync

    def sync(wait: bool = False, reset_scope: bool = True) -> None:
        bed.ordered_cut(lambda: original_sync(wait=wait, reset_scope=reset_scope), "sync")

    torch_xla.sync = sync
    xm.mark_step = sync

    def needs_cut(t: Any) -> bool:
        return (bed.rank is not None and isinstance(t, torch.Tensor) and t.device.type == "xla"
                and bool(torch_xla._XLAC._check_tensor_need_materialization([t])[0]))

    def wrap_read(name: str) -> None:
        original = getattr(torch.Tensor, name)

        def read(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if needs_cut(self):
                bed.ordered_cut(lambda: original_sync(wait=False), f"host read .{name}()")
            return original(self, *args, **kwargs)

        setattr(torch.Tensor, name, read)

    for name in ("cpu", "item", "tolist", "numpy", "__float__", "__int__", "__bool__", "__index__"):
        wrap_read(name)
    original_to = torch.Tensor.to

    def to(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        dest = kwargs.get("device", args[0] if args and isinstance(args[0], (str, torch.device)) else None)
        if dest is not None and torch.device(dest).type == "cpu" and needs_cut(self):
            bed.ordered_cut(lambda: original_sync(wait=False), "host read .to('cpu')")
        return original_to(self, *args, **kwargs)

    torch.Tensor.to = to

    def rendezvous(tag: str, payload: bytes = b"", replicas: list[int] | None = None) -> list[bytes]:
        # counted: in production xm.rendezvous is a sync, two device all-gathers and host reads of their results
        # (torch_xla.core.xla_model.xla_rendezvous), which this host exchange does not show in torch-xla's metrics
        if bed.rank is not None:
            bed.rendezvous_calls[bed.rank] += 1
        return bed.exchange(("rendezvous", tag), payload, replicas)

    xm.rendezvous = rendezvous  # xm.mesh_reduce serialises CPU copies and calls it: host-side as well


#: torchrun's variables, per device thread (Lightning's TorchElasticEnvironment and nxd_lc's runtime read them)
_RANK_ENV_KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK")


class _ThreadEnviron(MutableMapping):
    """``os.environ`` with torchrun's rank variables per device thread (every other key is the process's)."""

    def __init__(self, real: Any, bed: _Bed) -> None:
        self._real, self._bed = real, bed

    def _mine(self, key: str) -> dict[str, str] | None:
        env = getattr(self._bed.local, "env", None)
        return env if env is not None and key in _RANK_ENV_KEYS else None

    def __getitem__(self, key: str) -> str:
        mine = self._mine(key)
        return mine[key] if mine is not None else self._real[key]

    def __setitem__(self, key: str, value: str) -> None:
        mine = self._mine(key)
        if mine is not None:
            mine[key] = value
        else:
            self._real[key] = value

    def __delitem__(self, key: str) -> None:
        mine = self._mine(key)
        del (mine if mine is not None else self._real)[key]

    def __iter__(self) -> Iterator[str]:
        env = getattr(self._bed.local, "env", None) or {}
        return iter(sorted(set(self._real) - set(_RANK_ENV_KEYS) | set(env)))

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def copy(self) -> dict[str, str]:
        return dict(self)


def _install_rank_views(bed: _Bed) -> None:
    """Per-thread ranks where libraries keep them process-wide: torchrun's environment variables and Lightning's
    ``rank_zero_only.rank`` (a function attribute; read through the module global, answered with the thread's
    rank)."""
    import lightning_utilities.core.rank_zero as rank_zero

    os.environ = _ThreadEnviron(os.environ, bed)  # type: ignore[assignment]  # noqa: B003 -- a view, by design
    original = rank_zero.rank_zero_only

    class _RankZeroOnly:
        def __call__(self, fn: Callable[..., Any], default: Any = None) -> Any:
            return original(fn, default)

        @property
        def rank(self) -> int:
            return bed.rank if bed.rank is not None else getattr(original, "rank", 0)

        @rank.setter
        def rank(self, value: int) -> None:  # Lightning sets it per strategy: the thread's own rank wins
            pass

    view = _RankZeroOnly()
    rank_zero.rank_zero_only = view  # type: ignore[assignment]
    # modules imported before this point (a fork server's preload: Lightning's loggers and strategies) hold the
    # original under their own names; a module imported after it binds the view
    for module in list(sys.modules.values()):
        for name, value in list(getattr(module, "__dict__", {}).items()):
            if value is original:
                setattr(module, name, view)


def _install_lightning_patch_guard() -> None:
    """Lightning patches the ``DataLoader`` / ``BatchSampler`` classes (process-wide) while a dataloader hook runs
    (``_replace_dunder_methods``) and restores them after; two device threads inside at once undo each other's patch
    (seen: ``AttributeError: type object 'DataLoader' has no attribute '__old__setattr__'``). Here the first thread in
    applies the patch and the last one out restores it."""
    import contextlib

    import pytorch_lightning.trainer.connectors.data_connector as data_connector

    original = data_connector._replace_dunder_methods
    lock = threading.Lock()
    active: dict[tuple[Any, Any], list[Any]] = {}  # (class, argument) -> [threads inside, the entered patch]

    @contextlib.contextmanager
    def shared(base_cls: type, store_explicit_arg: str | None = None) -> Iterator[None]:
        key = (base_cls, store_explicit_arg)
        with lock:
            entry = active.setdefault(key, [0, None])
            if entry[0] == 0:
                entry[1] = original(base_cls, store_explicit_arg)
                entry[1].__enter__()
            entry[0] += 1
        try:
            yield
        finally:
            with lock:
                entry[0] -= 1
                if entry[0] == 0:
                    entry[1].__exit__(None, None, None)

    data_connector._replace_dunder_methods = shared


def _device_thread(bed: _Bed, rank: int, fn: Callable[..., Any], kwargs: dict[str, Any], results: list[Any],
                   store: Any) -> None:
    import torch
    import torch.distributed as dist
    import torch_xla
    import torch_xla.core.xla_model as xm

    bed.local.rank, bed.local.cuts, bed.local.compiled = rank, 0, 0
    bed.local.env = {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(bed.n),
                     "LOCAL_WORLD_SIZE": str(bed.n), "GROUP_RANK": "0", "NODE_RANK": "0"}
    try:
        devices = xm.get_xla_supported_devices()
        torch_xla._XLAC._xla_set_default_device(devices[rank])
        xm.set_replication(torch_xla.device(), devices)  # collectives see N replicas (world size N)
        torch.autograd.set_multithreading_enabled(False)
        dist.init_process_group("xla", rank=rank, world_size=bed.n, store=store)
        results[rank] = fn(rank, bed.n, **kwargs)
        torch_xla.sync()
    except _Fail:
        raise
    except BaseException:
        bed.fail(EXIT_RANK_ERROR, f"rank {rank} raised:\n{traceback.format_exc()}")


def _child(target: str, n: int, out: str, wait_timeout_s: float, kwargs: dict[str, Any]) -> None:
    global _BED
    import torch.distributed as dist

    sys.path[:0] = [REPO, os.path.join(REPO, "tests")]
    # this file runs as __main__: a scenario's `import xla_testbed` must find this module (current_bed), not a copy
    sys.modules.setdefault("xla_testbed", sys.modules[__name__])
    module_name, fn_name = target.split(":")
    fn = getattr(importlib.import_module(module_name), fn_name)
    bed = _BED = _Bed(n, out, wait_timeout_s)
    _install(bed)
    _install_rank_views(bed)
    _install_lightning_patch_guard()
    store = dist.HashStore()
    results: list[Any] = [None] * n
    threads = [threading.Thread(target=_device_thread, args=(bed, r, fn, kwargs, results, store), daemon=True,
                                name=f"xla-device-{r}") for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    with bed.cv:
        if not bed.finished:
            bed.finished = True
            bed._write({"ok": True, "results": results, "cuts": bed.cut_log})
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown of the per-thread groups and the XLA runtime


def current_bed() -> _Bed | None:
    """The running test bed in this (child) process, or None (scenarios use it to read their rank's log)."""
    return _BED


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--devices", type=int, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--wait-timeout-s", type=float, default=60)
    parser.add_argument("--kwargs", default="{}")
    a = parser.parse_args()
    _child(a.target, a.devices, a.out, a.wait_timeout_s, json.loads(a.kwargs))
