"""nxd_lc's torch-xla path on several XLA devices (lane 2): parity with one device, graphs that are the same on
every rank, parameter attributes kept through the device move, a barrier that waits.

Every run uses the multi-device test bed (:mod:`xla_testbed`: N XLA-CPU devices of one child process, ordered
graph cuts; a graph that compiles again on a rank > 0 fails the run as a divergence, a rank waiting too long fails
it as a hang). The reference is the same scenario on ONE XLA device (TP = DP = CP = 1) with the same weights and
data: :func:`xla_scenarios.train` runs nxd_lc's training-step code for 3 optimizer steps of 2 micro-batches (the
LightningModule's ``training_step``, ``on_before_optimizer_step``, clipping at 0.5, the optimizer it configures),
and the losses and global gradient norms must agree within 1e-5. The divergence check is strict throughout: the
forward/backward graphs, the optimizer step (reductions, norm, clipping, AdamW or ZeRO-1) and the metric read-back
of every step. Figures: ``docs/trainium.md``.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch_xla")
pytestmark = pytest.mark.xla  # lane 2 (make test-xla)

from xla_testbed import run_on_xla_devices  # noqa: E402

TOL = 1e-5  # losses and gradient norms against one XLA device


@pytest.fixture(scope="module")
def one_device() -> dict:
    """The reference: the scenario on one XLA device."""
    return run_on_xla_devices("xla_scenarios:train", 1, {"tp": 1}).results[0]


def _assert_parity(results: list[dict], reference: dict) -> None:
    for r in results:
        assert r["attrs_kept"], "a parameter lost its parallel attributes in the device move"
        assert r["losses"] == pytest.approx(reference["losses"], abs=TOL, rel=0), (r["tp_rank"], r["dp_rank"])
        assert r["norms"] == pytest.approx(reference["norms"], abs=TOL, rel=0), (r["tp_rank"], r["dp_rank"])
    by_tp_group: dict[int, list[dict]] = {}
    for r in results:
        by_tp_group.setdefault(r["dp_rank"], []).append(r)
    for group in by_tp_group.values():  # replicated (norm) weights stay identical on every TP rank
        assert all(g["norm_weights"] == group[0]["norm_weights"] for g in group)


@pytest.mark.parametrize("devices,kwargs", [
    # TP 2 without SP: make test-xla-acceptance (CI time: every NxDT example sets sequence_parallel; TP 2 + SP below)
    pytest.param(2, {"tp": 2}, marks=pytest.mark.xla_acceptance),
    (2, {"tp": 2, "sp": True}),
    (4, {"tp": 4, "sp": True, "kv": 2}),
    (2, {}),  # DP = 2
    (2, {"zero1": True}),  # ZeRO-1 over DP = 2
    # TP = 2 x DP = 2: make test-xla-acceptance (CI time; lane 2 trains NxDT's Mixtral file at TP 2 x DP 2 with EP
    # in test_nxdt_examples_train_xla, and TP 2 x CP 2 below)
    pytest.param(4, {"tp": 2, "sp": True}, marks=pytest.mark.xla_acceptance),
    (2, {"cp": 2, "algo": "ulysses"}),
    # the CP group smaller than the world: torch-xla's all-to-all had no replica groups (HLO verifier failure)
    (4, {"cp": 2, "algo": "ulysses", "tp": 2, "sp": True}),
], ids=["tp2", "tp2_sp", "tp4_sp_kv2", "dp2", "zero1_dp2", "tp2_sp_x_dp2", "cp2_ulysses", "cp2_ulysses_x_tp2_sp"])
def test_parity_with_one_device(one_device: dict, devices: int, kwargs: dict) -> None:
    run = run_on_xla_devices("xla_scenarios:train", devices, kwargs)
    assert len(run.results) == devices
    _assert_parity(run.results, one_device)


@pytest.mark.xla_acceptance  # make test-xla-acceptance (CI time): lane 2 trains EP 2 at TP 2 (docstring)
def test_mixtral_expert_parallel_parity_with_one_device() -> None:
    """Mixtral (4 experts, top 2, capacity factor 4: nothing dropped) with its experts split over EP = 2 (the DP
    ranks; tokens exchanged by all-to-all) equals one XLA device. EP 2 at TP 2 (the EP group smaller than the world):
    ``tests/test_nxdt_examples_train_xla.py``'s ``hf_mixtral_8x7b_config-ep2``, in lane 2 too."""
    reference = run_on_xla_devices("xla_scenarios:train", 1, {"model": "mixtral"}).results[0]
    run = run_on_xla_devices("xla_scenarios:train", 2, {"model": "mixtral", "ep": 2})
    _assert_parity(run.results, reference)


def test_plain_move_loses_attributes_and_the_norm(one_device: dict) -> None:
    """The bug the production move fixes, reproduced: ``module.to(xla)`` replaces every Parameter, the parallel
    attributes are gone and at TP = 2 the global gradient norm is wrong (replicated weights counted as if
    sharded) -- so the parity test above can fail."""
    run = run_on_xla_devices("xla_scenarios:train", 2, {"tp": 2, "sp": True, "move": "plain", "steps": 1})
    assert not run.results[0]["attrs_kept"]
    assert abs(run.results[0]["norms"][0] - one_device["norms"][0]) > 1e-3


def test_barrier_waits_for_a_late_rank() -> None:
    """``collectives.barrier`` on the ``xla`` backend returns only when the last rank arrives (torch-xla's own
    ``ProcessGroupXla.barrier`` returns at once)."""
    run = run_on_xla_devices("xla_scenarios:barrier_late_rank", 2, {"delay_s": 2.0})
    assert run.results[0]["waited_s"] >= 1.5, run.results
    assert run.results[1]["waited_s"] < 1.0, run.results


def test_a_rank_dependent_graph_is_reported_not_hung() -> None:
    """The test bed itself: a graph with a rank-dependent constant before a collective fails the run as a
    divergence naming the cut and the line, instead of deadlocking."""
    with pytest.raises(AssertionError, match=r"divergence at cut 0 .*xla_scenarios.py:\d+ in rank_dependent_graph"):
        run_on_xla_devices("xla_scenarios:rank_dependent_graph", 2, timeout_s=120)
