"""A training step that never waits for the host (issue 33, item 4): the preemption vote and Lightning's SIGTERM
broadcast, which on several XLA devices added a graph execution and a device-to-host read to every step.

* The vote (:func:`nxd_lc.distributed.collectives.world_max`) goes through the process group's key-value store on
  torch-xla (:func:`~nxd_lc.distributed.collectives.store_world_max`): tested here with threads sharing one store,
  with 2 gloo processes on torchrun's TCPStore (:func:`~nxd_lc.distributed.collectives.default_store`), and in a
  whole job on the multi-device XLA test bed, where the test bed counts the calls of ``xm.rendezvous`` (the old
  path, ``xm.mesh_reduce``: device all-gathers and host reads in production).
* Lightning's per-micro-batch ``_broadcast_sigterm_tensor`` is skipped by
  :class:`~nxd_lc.lightning.preemption.StepBoundaryEpochLoop` when SIGTERM is the preemption callback's; a pin test
  fails if Lightning renames the private method.
* The figures, from torch-xla's metrics (``ExecuteTime`` samples: executions; ``TransferFromDeviceTime``:
  transfers) over ordinary steps after warm-up, on one device and on 2 devices of the test bed
  (``tests/xla_scenarios_hostreads.py``): at most m + 1 executions per optimizer step (m = 2 micro-batches) and no
  transfer on a step that neither logs nor checkpoints. ``docs/experiments/xla_host_reads.md`` has the numbers
  before and after.
"""

from __future__ import annotations

import inspect
import threading
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from nxd_lc.distributed import collectives


class _Scope:
    """Stands for a world's default process group (what owns the vote counters)."""


def _vote_in_threads(store: dist.Store, rows: list[list[list[int]]], tag: str = "t") -> list[Any]:
    """Rank r (a thread) votes ``rows[r][i]`` in round i; returns each rank's results (or the exception)."""
    out: list[Any] = [None] * len(rows)

    def rank(r: int) -> None:
        scope = _Scope()
        try:
            out[r] = [collectives.store_world_max(v, tag, store, len(rows), scope) for v in rows[r]]
        except Exception as e:  # noqa: BLE001 -- handed to the test
            out[r] = e

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(len(rows))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return out


@pytest.mark.compat
def test_store_vote_is_the_elementwise_max_and_leaves_no_key() -> None:
    """3 ranks, 25 rounds of 3 flags each (mostly zeros, as on ordinary steps): every rank gets the element-wise
    maximum of that round, and the store holds no key afterwards (the last reader of a round deletes it)."""
    gen = torch.Generator().manual_seed(0)
    rows = [[[int(x) for x in (torch.rand(3, generator=gen) > 0.8)] for _ in range(25)] for _ in range(3)]
    rows[1][7] = [0, 5, 2]  # any small integers, not only flags
    store = dist.HashStore()
    out = _vote_in_threads(store, rows)
    expected = [[max(col) for col in zip(*(rows[r][i] for r in range(3)))] for i in range(25)]
    assert out == [expected] * 3
    assert expected[7] == [max(rows[0][7][0], rows[2][7][0], 0), 5, 2] and any(any(e) for e in expected)
    assert store.num_keys() == 0


@pytest.mark.compat
def test_store_vote_fails_instead_of_hanging() -> None:
    """A rank that never votes makes the others fail after the store's timeout (no hang); ranks that vote
    different numbers of values get a ValueError naming the tag."""
    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=0.5))
    with pytest.raises(dist.DistStoreError):
        collectives.store_world_max([0, 1], "alone", store, 2, _Scope())
    out = _vote_in_threads(store, [[[0, 0]], [[0, 0, 0]]], tag="mismatch")
    assert any(isinstance(e, ValueError) and "'mismatch'" in str(e) for e in out), out


def test_default_store_skips_the_group_prefix(monkeypatch: pytest.MonkeyPatch) -> None:
    """The vote's store is the one under c10d's group-name prefix (the same key whatever the group is named)."""
    base = dist.HashStore()
    chain = dist.PrefixStore("r1_0/", dist.PrefixStore("default_pg", base))
    monkeypatch.setattr(dist.distributed_c10d, "_get_default_store", lambda: chain)
    shared = collectives.default_store()
    assert shared is not None
    shared.set("k", b"v")
    assert base.get("default_pg/k") == b"v"
    assert not base.check(["default_pg/r1_0/k"])
    assert callable(getattr(dist.distributed_c10d, "_get_default_store", None))  # pin: torch's private getter


def test_torch_xlas_dummy_store_is_recognised(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch-xla's xla:// rendezvous gives a DummyStore (no keys; the vote then falls back to ``xm.mesh_reduce``)
    exactly for TORCH_DIST_INIT_BARRIER=0 with XLA_USE_DUMMY_STORE=1."""
    monkeypatch.delenv("XLA_USE_DUMMY_STORE", raising=False)
    monkeypatch.setenv("TORCH_DIST_INIT_BARRIER", "0")
    assert not collectives.xla_store_is_dummy()
    monkeypatch.setenv("XLA_USE_DUMMY_STORE", "1")
    assert collectives.xla_store_is_dummy()
    monkeypatch.setenv("TORCH_DIST_INIT_BARRIER", "1")
    assert not collectives.xla_store_is_dummy()


def _gloo_store_vote(rank: int, world: int) -> None:
    store = collectives.default_store()
    assert store is not None
    for i in range(5):
        got = collectives.store_world_max([rank == i % world, i, 0], "gloo", store, world, dist.group.WORLD)
        assert got == [1, i, 0], (rank, i, got)
    assert collectives.world_max([rank]) == [world - 1]  # gloo's own path (a CPU all-reduce) is unchanged


@pytest.mark.compat
def test_store_vote_over_torchrun_tcpstore() -> None:
    """2 gloo processes (env:// rendezvous, the TCPStore torchrun sets up): the default store is shared and the
    store vote agrees; ``world_max`` on gloo keeps its CPU all-reduce."""
    from dist_utils import run_distributed

    run_distributed(_gloo_store_vote, 2)


@pytest.mark.compat
def test_lightning_sigterm_broadcast_is_where_it_is_skipped() -> None:
    """Pin: Lightning's training-epoch loop broadcasts SIGTERM through ``_broadcast_sigterm_tensor`` (private API)
    from ``advance``; if Lightning renames it, StepBoundaryEpochLoop silently stops skipping it: this fails then."""
    from pytorch_lightning.loops.training_epoch_loop import _TrainingEpochLoop

    from nxd_lc.lightning.preemption import StepBoundaryEpochLoop

    assert callable(getattr(_TrainingEpochLoop, "_broadcast_sigterm_tensor", None))
    assert "self._broadcast_sigterm_tensor()" in inspect.getsource(_TrainingEpochLoop.advance)
    assert StepBoundaryEpochLoop._broadcast_sigterm_tensor is not _TrainingEpochLoop._broadcast_sigterm_tensor


def _build(tmp_path: Any, signals: list[str]) -> Any:
    from nxd_lc.config.schema import NxdConfig
    from nxd_lc.lightning.exp_manager import ExpPaths
    from nxd_lc.lightning.trainer import build_trainer
    from nxd_lc.runtime.device import RuntimeInfo

    cfg = NxdConfig()
    cfg.exp_manager.preemption_signals = signals
    cfg.exp_manager.create_tensorboard_logger = False
    cfg.trainer.max_steps = 7
    cfg.trainer.val_check_interval = 5  # what validation makes of the defaults
    runtime = RuntimeInfo("cpu", torch.device("cpu"), "gloo", 0, 0, 1)
    paths = ExpPaths(log_dir=str(tmp_path), checkpoint_dir=str(tmp_path / "checkpoints"))
    return build_trainer(cfg, runtime, paths)


@pytest.mark.compat
def test_trainer_skips_lightnings_sigterm_broadcast_only_when_sigterm_is_ours(tmp_path: Any,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Default signals (SIGTERM among them): the Trainer's epoch loop is StepBoundaryEpochLoop, with the same step
    limit, and its ``_broadcast_sigterm_tensor`` issues no collective and reads nothing; without SIGTERM in
    ``exp_manager.preemption_signals`` Lightning's handler is in charge and its loop (and broadcast) stays."""
    from pytorch_lightning.loops.training_epoch_loop import _TrainingEpochLoop

    from nxd_lc.lightning.preemption import StepBoundaryEpochLoop

    ours = _build(tmp_path / "a", ["SIGTERM", "SIGUSR1"])
    loop = ours.fit_loop.epoch_loop
    assert type(loop) is StepBoundaryEpochLoop and loop.max_steps == 7 and ours.max_steps == 7
    assert loop.trainer is ours and loop.val_loop.trainer is ours
    calls: list[str] = []
    monkeypatch.setattr(torch.distributed, "broadcast", lambda *a, **k: calls.append("broadcast"))
    loop._broadcast_sigterm_tensor()
    assert calls == []
    _TrainingEpochLoop._broadcast_sigterm_tensor(loop)  # what Lightning's loop would do here
    assert calls == ["broadcast"]
    for signals in ([], ["SIGUSR1"]):
        theirs = _build(tmp_path / "b", signals)
        assert type(theirs.fit_loop.epoch_loop) is _TrainingEpochLoop


# ---- the figures, from torch-xla's metrics (lane 2) ----------------------------------------------------------------
MAX_STEPS, LOG_EVERY, MICRO_BATCHES = 10, 5, 2
ORDINARY = [3, 4, 6, 7, 8, 9]  # after warm-up (steps 1-2 compile), neither logging (5, 10) nor the end (10)


@pytest.fixture(scope="module")
def shared_data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Corpus and tokenizer cache shared by the jobs of this module (the first run trains the tokenizer)."""
    pytest.importorskip("torch_xla")
    from test_xla_graphs import _corpus

    root = tmp_path_factory.mktemp("host_reads")
    return {"corpus": _corpus(str(root / "corpus"), limit=60), "tokenizer_dir": str(root / "tok")}


def _host_reads(tmp_path: Any, shared: dict[str, str], devices: int) -> list[dict]:
    from xla_testbed import run_on_xla_devices

    kwargs = {"run_dir": str(tmp_path / f"run{devices}"), **shared, "max_steps": MAX_STEPS,
              "log_every_n_steps": LOG_EVERY}
    return run_on_xla_devices("xla_scenarios_hostreads:host_reads_job", devices, kwargs, timeout_s=600,
                              wait_timeout_s=120).results


def _per_step(result: dict, keys: tuple[str, ...] = ("executions", "transfers_from_device", "compiles",
                                                      "rendezvous")) -> dict[int, dict[str, int]]:
    """Counter differences of each optimizer step's window (the device counters: every rank's work, in rank 0's
    result; ``rendezvous``: this rank's calls)."""
    snaps = {s["before_step"]: s for s in result["steps"]}
    return {k: {n: snaps[k + 1][n] - snaps[k][n] for n in keys} for k in range(1, MAX_STEPS + 1)}


def _check_steady(results: list[dict], devices: int) -> None:
    steps = _per_step(results[0])
    summary = {k: (d["executions"], d["transfers_from_device"], d["rendezvous"]) for k, d in steps.items()}
    assert [r["global_step"] for r in results] == [MAX_STEPS] * devices
    executions = sum(steps[k]["executions"] for k in ORDINARY) / devices  # per rank (all ranks run the same)
    assert executions / len(ORDINARY) <= MICRO_BATCHES + 1, f"executions per step above m + 1: {summary}"
    assert all(steps[k]["transfers_from_device"] == 0 for k in ORDINARY), f"host reads on ordinary steps: {summary}"
    assert all(steps[k]["compiles"] == 0 for k in ORDINARY), summary
    for r in results:  # the old vote: xm.mesh_reduce -> xm.rendezvous on every step
        calls = _per_step(r, ("rendezvous",))
        assert all(d["rendezvous"] == 0 for d in calls.values()), calls
    assert steps[LOG_EVERY]["transfers_from_device"] > 0, summary  # a logging step reads (the counters count)
    assert [r["loop"] for r in results] == ["StepBoundaryEpochLoop"] * devices, summary


@pytest.mark.xla
@pytest.mark.slow  # a whole job in a child process: ~15-20 s on 2 cores
def test_steady_steps_never_wait_for_the_host_on_one_xla_device(tmp_path: Any, shared_data: dict[str, str]) -> None:
    """One XLA device, a whole job (``train.py``'s path), 2 micro-batches per step, metrics printed every 5 steps:
    over the ordinary steps after warm-up at most 3 executions per step on average and no transfer."""
    _check_steady(_host_reads(tmp_path, shared_data, 1), 1)


@pytest.mark.xla
@pytest.mark.slow  # a whole job in a child process: ~15-20 s on 2 cores
def test_steady_steps_never_wait_for_the_host_on_two_xla_devices(tmp_path: Any, shared_data: dict[str, str]) -> None:
    """Two XLA devices of the test bed, the same job (DP = 2) with the default preemption signals: the per-step
    vote goes through the store (no ``xm.rendezvous``) and Lightning's per-micro-batch SIGTERM broadcast is gone,
    so ordinary steps run at most m + 1 executions per rank on average and transfer nothing (before: 5 executions
    and 2 transfers per rank and step, the broadcast's 2 of each, plus a device rendezvous per step: the vote)."""
    _check_steady(_host_reads(tmp_path, shared_data, 2), 2)


@pytest.mark.xla
@pytest.mark.slow  # a whole job in a child process: ~35 s on 2 cores
def test_pipeline_steps_never_wait_for_the_host(tmp_path: Any, shared_data: dict[str, str]) -> None:
    """PP = 2 on two XLA devices (the lockstep schedule, 2 micro-batches per step): ordinary steps read nothing
    back and compile nothing, and run the same number of graphs every step. That number is above m + 1 by design:
    each phase's exchange is a graph between two cuts (E = m + 1 exchanges at S = 2 stages,
    nxd_lc/pipeline/lockstep.py), and the PP reductions (loss, gradient norm; tied embeddings too, not in this
    model) are isolated too (docs/experiments/xla_host_reads.md): at most 2E + 8 per rank (measured 14)."""
    from xla_testbed import run_on_xla_devices

    extra = ["model.num_layers=2", "distributed_strategy.pipeline_model_parallel_size=2",
             f"data.global_batch_size={2 * MICRO_BATCHES}"]
    kwargs = {"run_dir": str(tmp_path / "pp"), **shared_data, "max_steps": MAX_STEPS, "log_every_n_steps": LOG_EVERY,
              "extra": extra}
    results = run_on_xla_devices("xla_scenarios_hostreads:host_reads_job", 2, kwargs, timeout_s=600,
                                 wait_timeout_s=120).results
    steps = _per_step(results[0])
    assert [r["global_step"] for r in results] == [MAX_STEPS] * 2
    assert all(steps[k]["transfers_from_device"] == 0 for k in ORDINARY), steps
    assert all(steps[k]["compiles"] == 0 for k in ORDINARY), steps
    per_rank = {steps[k]["executions"] / 2 for k in ORDINARY}
    assert len(per_rank) == 1 and max(per_rank) <= 2 * (MICRO_BATCHES + 1) + 8, steps
    assert steps[LOG_EVERY]["transfers_from_device"] > 0, steps
