"""The lockstep pipeline schedule of torch-xla (:mod:`nxd_lc.pipeline.lockstep`), checked without XLA.

* the phase plan against the data dependencies of a pipeline, derived here from first principles (an activation
  leaves stage ``k`` at least one phase before stage ``k + 1`` uses it, a gradient likewise backwards; one unit of
  work per stage and phase), for many shapes; the micro-batches each stage holds between a forward and its
  backward, from the plan's phases, are 1F1B's ``min(m, S - k)``; the number of exchanges the docstring states;
* the runner on CPU, with an exchange written here from the permute's definition, against plain autograd over the
  unsplit model (loss and every gradient), for 2, 3 and 4 stages and interleaved stages; the activations each stage
  holds, measured with saved-tensor hooks (``tests/activation_probe.py``), at most ``S - k`` micro-batches (the
  one-tick schedule before held ``2 (S - 1 - k) + 1``), and the graph cuts per call;
* the permute pairs (:func:`nxd_lc.distributed.collectives.shift_pairs`; a ring only with virtual stages).

The runner on real XLA collectives (the same schedule on the multi-device test bed, against one XLA device):
``tests/test_xla_pipeline.py``.
"""

from __future__ import annotations

import pytest
import torch
from activation_probe import ActivationProbe
from torch import nn

from nxd_lc.distributed.collectives import shift_pairs
from nxd_lc.pipeline.lockstep import LockstepPlan, LockstepRunner, lockstep_in_flight

SHAPES = [(s, m) for s in (1, 2, 3, 4, 6) for m in (1, 2, 3, 5, 8)]


@pytest.mark.parametrize("stages,micro", SHAPES)
def test_plan_respects_the_pipeline_dependencies(stages: int, micro: int) -> None:
    plan = LockstepPlan(stages, micro, train=True)
    fwd: dict[tuple[int, int], int] = {}
    bwd: dict[tuple[int, int], int] = {}
    for t in range(plan.num_phases):
        for k in range(stages):
            if (i := plan.forward_of(k, t)) is not None:
                assert (k, i) not in fwd
                fwd[(k, i)] = t
            if (j := plan.backward_of(k, t)) is not None:
                assert (k, j) not in bwd
                bwd[(k, j)] = t
    every = {(k, i) for k in range(stages) for i in range(micro)}
    assert set(fwd) == every and set(bwd) == every  # each forward and backward exactly once
    for k, i in every:
        if k > 0:  # the activation crossed one exchange
            assert fwd[(k, i)] >= fwd[(k - 1, i)] + 1
        if k < stages - 1:  # the gradient crossed one exchange back
            assert bwd[(k, i)] >= bwd[(k + 1, i)] + 1
            assert bwd[(k, i)] > fwd[(k, i)]
        else:  # the last stage: loss and backward with the forward
            assert bwd[(k, i)] == fwd[(k, i)]
    for k in range(stages - 1):  # one unit of work per stage and phase (a forward or a backward)
        phases = [fwd[(k, i)] for i in range(micro)] + [bwd[(k, i)] for i in range(micro)]
        assert len(set(phases)) == len(phases), k
    # an exchange happens exactly when something crosses it
    crossing = 0
    for t in range(plan.num_phases):
        f = any(fwd.get((k, i)) == t for k in range(stages - 1) for i in range(micro))
        b = any(bwd.get((k, i)) == t for k in range(1, stages) for i in range(micro))
        assert plan.sends_forward(t) == f and plan.sends_backward(t) == b
        crossing += f or b
    assert plan.num_exchanges == crossing
    assert max(bwd.values()) == plan.num_phases - 1  # no idle phase at the end
    # memory: stage k keeps micro-batch i from its forward's phase to its backward's; at most 1F1B's S - k at once
    for k in range(stages):
        held = max(sum(fwd[(k, i)] <= t < bwd[(k, i)] or fwd[(k, i)] == t for i in range(micro))
                   for t in range(plan.num_phases))
        assert held == min(micro, stages - k), (k, held)


@pytest.mark.parametrize("stages,micro", SHAPES)
def test_exchanges_per_call_as_documented(stages: int, micro: int) -> None:
    """The module docstring's count of exchanges (a call cuts twice as many graphs)."""
    if stages == 1:
        expected = 0
    elif micro == 1:
        expected = 2 * stages - 2
    elif stages == 2:
        expected = micro + 1
    else:
        expected = 2 * micro + 2 * stages - 3
    assert LockstepPlan(stages, micro, train=True).num_exchanges == expected
    assert LockstepPlan(stages, micro, train=False).num_exchanges == (micro + stages - 2 if stages > 1 else 0)


def test_forward_only_plan() -> None:
    plan = LockstepPlan(3, 4, train=False)
    assert plan.num_phases == 4 + 3 - 1
    assert [plan.forward_of(2, t) for t in range(plan.num_phases)] == [None, None, 0, 1, 2, 3]
    assert all(plan.backward_of(k, t) is None for k in range(3) for t in range(plan.num_phases))
    assert not any(plan.sends_backward(t) for t in range(plan.num_phases))


def test_shift_pairs() -> None:
    groups = [[0, 2, 4], [1, 3, 5]]  # PP = 3 over two (DP/TP) positions
    assert shift_pairs(groups, 1, ring=False) == [(0, 2), (1, 3), (2, 4), (3, 5)]
    assert shift_pairs(groups, -1, ring=False) == [(2, 0), (3, 1), (4, 2), (5, 3)]
    assert shift_pairs(groups, 1, ring=True) == [(0, 2), (1, 3), (2, 4), (3, 5), (4, 0), (5, 1)]
    assert shift_pairs(groups, -1, ring=True) == [(0, 4), (1, 5), (2, 0), (3, 1), (4, 2), (5, 3)]
    assert shift_pairs([[7]], 1, ring=True) == []  # a group of one rank sends nothing


# ---- the runner on CPU, all pipeline ranks in one process --------------------------------------------------------
H, ROWS = 8, 2


class _Stage(nn.Module):
    """A stage of the toy model: stage 0 embeds ids, every stage applies its blocks, the last returns the loss."""

    def __init__(self, k: int, num_stages: int, blocks: nn.ModuleList, emb: nn.Embedding, head: nn.Linear) -> None:
        super().__init__()
        self.stage_index, self.num_stages = k, num_stages
        self.is_first, self.is_last = k == 0, k == num_stages - 1
        self.blocks, self.emb, self.head = blocks, emb, head

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.emb(x) if self.is_first else x
        for b in self.blocks:
            h = h + torch.tanh(b(h))
        if not self.is_last:
            return h
        return nn.functional.cross_entropy(self.head(h).flatten(0, 1), labels.flatten()).reshape(1)


def _toy(num_blocks: int) -> tuple[nn.Embedding, nn.ModuleList, nn.Linear]:
    torch.manual_seed(0)
    return nn.Embedding(11, H), nn.ModuleList(nn.Linear(H, H) for _ in range(num_blocks)), nn.Linear(H, 11)


@pytest.mark.parametrize("pp,virtual,micro", [(2, 1, 2), (2, 1, 5), (3, 1, 4), (4, 1, 6), (2, 2, 2), (2, 2, 3),
                                              (2, 2, 4)])
def test_runner_equals_autograd_over_the_whole_model(pp: int, virtual: int, micro: int) -> None:
    """One thread per pipeline rank; the exchange is written here from ``collective_permute``'s definition (the
    target receives the source's buffer, zeros when no pair targets it). The loss and every parameter gradient
    equal one backward of the mean micro-batch loss over the unsplit model. Memory, measured by saved-tensor
    hooks: stage ``k`` held at most ``S - k`` micro-batches' activations (1F1B; the one-tick schedule held up to
    ``2 (S - 1 - k) + 1``, e.g. 5 on stage 0 of 3 stages); every rank cut the same number of graphs."""
    num_stages = pp * virtual
    emb, blocks, head = _toy(num_stages)
    ids = torch.randint(0, 11, (micro * ROWS, 5), generator=torch.Generator().manual_seed(1))
    labels = torch.randint(0, 11, (micro * ROWS, 5), generator=torch.Generator().manual_seed(2))

    # reference: plain autograd, the mean of the micro-batch losses
    ref_loss = sum(_Stage(0, 1, blocks, emb, head)(i, lab) for i, lab in zip(ids.chunk(micro), labels.chunk(micro)))
    ref_loss = ref_loss / micro
    params = [*emb.parameters(), *blocks.parameters(), *head.parameters()]
    ref_grads = torch.autograd.grad(ref_loss.sum(), params)

    stages = [_Stage(k, num_stages, nn.ModuleList([blocks[k]]), emb, head) for k in range(num_stages)]
    probe = ActivationProbe()
    for stage in stages:
        probe.watch(stage)
    groups = [list(range(pp))]
    cuts = [0] * pp

    import threading

    barrier = threading.Barrier(pp)
    slots: dict[tuple[int, int], torch.Tensor] = {}
    seq = [0] * pp
    results: list = [None] * pp
    errors: list[BaseException] = []

    def make_exchange(rank: int):  # noqa: ANN202
        def exchange(buf: torch.Tensor, pairs: list[tuple[int, int]]) -> torch.Tensor:
            n = seq[rank]
            seq[rank] += 1
            slots[(n, rank)] = buf.clone()
            barrier.wait()
            sources = [s for s, t in pairs if t == rank]
            got = slots[(n, sources[0])].clone() if sources else torch.zeros_like(buf)
            barrier.wait()
            return got
        return exchange

    def work(rank: int) -> None:
        try:
            torch.autograd.set_multithreading_enabled(False)
            r = LockstepRunner([stages[rank + v * pp] for v in range(virtual)], pipeline_size=pp, pipeline_rank=rank,
                               stream=[((ROWS, 5, H), torch.float32)],
                               forward_pairs=shift_pairs(groups, 1, ring=virtual > 1),
                               backward_pairs=shift_pairs(groups, -1, ring=virtual > 1), exchange=make_exchange(rank),
                               device=torch.device("cpu"))
            kwargs = [{"labels": lab} for lab in labels.chunk(micro)]
            results[rank] = r.run(micro, True, ids.chunk(micro), kwargs,
                                  cut=lambda: cuts.__setitem__(rank, cuts[rank] + 1))
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)
            barrier.abort()

    for p in params:
        p.grad = None
    threads = [threading.Thread(target=work, args=(r,)) for r in range(pp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    last_rank = (num_stages - 1) % pp
    assert all(results[r] == [] for r in range(pp) if r != last_rank)
    loss = torch.stack(results[last_rank]).sum()
    assert loss.item() == pytest.approx(ref_loss.item(), abs=1e-6)
    for p, g in zip(params, ref_grads):
        assert p.grad is not None
        torch.testing.assert_close(p.grad, g, atol=1e-6, rtol=1e-5)
    assert probe.leaked() == {}
    assert dict(probe.peak) == {k: min(micro, num_stages - k) for k in range(num_stages)}
    # the figure the dry run's memory estimate uses on torch-xla is the measured one
    assert dict(probe.peak) == {k: lockstep_in_flight(num_stages, k, micro) for k in range(num_stages)}
    assert len(set(cuts)) == 1 and cuts[0] == 2 * LockstepPlan(num_stages, micro, train=True).num_exchanges, cuts
