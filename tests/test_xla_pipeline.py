"""Pipeline parallelism on torch-xla (lane 2): the lockstep schedule (:mod:`nxd_lc.pipeline.lockstep`, stage-to-stage
traffic as collective permutes in graphs of their own) on the multi-device test bed, against ONE XLA device.

The scenario is :func:`xla_scenarios.train` (nxd_lc's ``training_step`` -- here the whole step's micro-batches through
the pipeline --, ``on_before_optimizer_step``, clipping, AdamW) on a 4-layer Llama; the reference is the same model,
weights and data on one XLA device without pipelining. Losses and global gradient norms of 2 steps must agree within
1e-5 on every rank, and at TP = 1 the last step's gradient of every parameter (sum and sum of squares) too. The test
bed fails a run whose ranks of one pipeline stage trace different graphs (a divergence) or that hangs.

Memory (issue 39, item 3): :func:`xla_scenarios_pipeline.activation_peaks` measures with saved-tensor hooks how many
micro-batches' activations each stage holds at once on the test bed: 1F1B's ``S - k`` at most, and the graph cuts
of a call.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch_xla")
pytestmark = pytest.mark.xla  # lane 2 (make test-xla)

from xla_testbed import run_on_xla_devices  # noqa: E402

TOL = 1e-5
LAYERS = 4
STEPS = 2


@pytest.fixture(scope="module")
def one_device() -> dict:
    return run_on_xla_devices("xla_scenarios:train", 1, {"layers": LAYERS, "steps": STEPS}).results[0]


@pytest.mark.parametrize("devices,kwargs", [
    # plain PP 2 (one stage per rank): the job test of test_xla_multidevice_job.py and the Mixtral test below
    # interleaved: 4 stages, stage k on pipeline rank k mod 2; make test-xla-acceptance (CI time: no NxDT example
    # sets virtual pipeline stages; the interleaved schedule's parity on CPU: tests/test_pipeline.py's pp2_vpp2)
    pytest.param(2, {"pp": 2, "vpp": 2}, marks=pytest.mark.xla_acceptance),
    (4, {"pp": 2, "tp": 2, "sp": True}),
], ids=["pp2_vpp2", "pp2_x_tp2_sp"])
def test_pipeline_matches_one_device(one_device: dict, devices: int, kwargs: dict) -> None:
    run = run_on_xla_devices("xla_scenarios:train", devices, {"layers": LAYERS, "steps": STEPS, **kwargs},
                             timeout_s=400)
    _assert_matches(run.results, one_device, devices, grads=kwargs.get("tp", 1) == 1)


def test_mixtral_pipeline_carries_the_router_statistics() -> None:
    """Mixtral at PP 2: the stages pass the MoE routing statistics beside the hidden states (a second permute per
    direction; the load-balancing loss (coefficient 0.02) of the last stage back-propagates through them to the first
    stage's router), equal to one XLA device, every gradient included."""
    kwargs = {"model": "mixtral", "steps": 1, "aux": 0.02}
    reference = run_on_xla_devices("xla_scenarios:train", 1, kwargs).results[0]
    run = run_on_xla_devices("xla_scenarios:train", 2, {**kwargs, "pp": 2, "layers": 2}, timeout_s=400)
    _assert_matches(run.results, reference, 2, grads=True)


def test_pipeline_holds_1f1b_activations_on_xla() -> None:
    """PP 2 (S = 2 stages) with m = 3 micro-batches on two XLA devices: stage k held at most S - k micro-batches'
    activations, measured (2 and 1; the one-tick schedule before held 3 and 1: 2 (S - 1 - k) + 1), nothing stays
    saved after the call, and both ranks took the same cuts in it: two per exchange (S = 2: m + 1 exchanges) and
    the two of the loss's isolated PP all-reduce. Virtual stages' memory: ``tests/test_pipeline_lockstep.py`` (the
    same runner on CPU); their parity on XLA: ``pp2_vpp2`` above."""
    stages, micro = 2, 3
    run = run_on_xla_devices("xla_scenarios_pipeline:activation_peaks", 2,
                             {"pp": 2, "vpp": 1, "micro": micro, "layers": 2}, timeout_s=300)
    peaks: dict[int, int] = {}
    for r in run.results:
        assert r["leaked"] == {}, r
        assert r["cuts"] == 2 * (micro + 1) + 2, r
        peaks.update({int(k): v for k, v in r["peaks"].items()})
    assert peaks == {k: min(micro, stages - k) for k in range(stages)}, peaks
    assert run.results[0]["loss"] == run.results[1]["loss"]  # the PP all-reduce gave both ranks the step loss


@pytest.mark.parametrize("pp,micros", [(2, (4, 8, 16)), (4, (8, 16))], ids=["pp2", "pp4"])
def test_step_one_compiles_as_many_graphs_whatever_the_micro_batch_count(pp: int, micros: tuple[int, ...]) -> None:
    """Issue 52, item 2: three ``train_step`` calls of the lockstep schedule compile the same graphs, rank by rank
    and call by call, for m = 4, 8, 16 micro-batches at PP 2 and m = 8, 16 at PP 4 (each m in a fresh process, 4
    layers), and the third compiles none. While each micro-batch reached the stages as a slice ``chunk(m)[i]`` of
    one device tensor, every phase graph carried its micro-batch's offset: step 1 compiled 17 / 25 / 41 graphs at
    PP 2, 43 / 67 at PP 4 (growing with m; on Neuron each is a neuronx-cc compile); now 16 and 26. The counts are
    the test bed's: only the first rank of a stage compiles, so their sum is the process's compile count."""
    counts = {}
    for micro in micros:
        run = run_on_xla_devices("xla_scenarios_pipeline:phase_compiles", pp, {"pp": pp, "micro": micro,
                                                                              "layers": 4, "steps": 3},
                                 timeout_s=400)
        assert all(r["compiled"][2] == 0 for r in run.results), run.results  # the third call: nothing new
        counts[micro] = tuple(sorted((r["pp_rank"], *r["compiled"]) for r in run.results))
    assert len(set(counts.values())) == 1, counts
    assert sum(c[1] for c in counts[micros[0]]) > 0, counts  # step 1 compiled (the count can see graphs)


def _assert_matches(results: list[dict], one_device: dict, devices: int, grads: bool) -> None:
    assert sorted(r["pp_rank"] for r in results) == sorted([0, 1] * (devices // 2))
    for r in results:
        assert r["attrs_kept"]
        assert r["losses"] == pytest.approx(one_device["losses"], abs=TOL, rel=0), r["pp_rank"]
        assert r["norms"] == pytest.approx(one_device["norms"], abs=TOL, rel=0), r["pp_rank"]
    if not grads:
        return
    seen = set()
    for r in results:  # each stage's parameters: the gradients of the unsplit model
        for name, (total, squares) in r["grads"].items():
            ref_total, ref_squares = one_device["grads"][name]
            assert total == pytest.approx(ref_total, abs=1e-5, rel=1e-4), name
            assert squares == pytest.approx(ref_squares, abs=1e-7, rel=1e-4), name
            seen.add(name)
    assert seen == set(one_device["grads"]), set(one_device["grads"]) - seen  # the stages cover the model
