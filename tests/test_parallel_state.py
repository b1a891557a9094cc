"""parallel_state rank layout / groups and the collectives module (single process and gloo)."""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_distributed

from nxd_lc.distributed import collectives, parallel_state
from nxd_lc.runtime.device import default_backend

pytestmark = pytest.mark.compat  # torch-2.9 compatibility subset (lane 2; docs/testing.md)


def test_rank_layout_tp2_cp2() -> None:
    layout = parallel_state.rank_layout(4, tensor_model_parallel_size=2, context_parallel_size=2)
    assert layout["tp"] == [[0, 1], [2, 3]]
    assert layout["cp"] == [[0, 2], [1, 3]]
    assert layout["dp"] == [[0], [1], [2], [3]]
    assert layout["dp_cp"] == [[0, 2], [1, 3]]
    assert layout["pp"] == [[0], [1], [2], [3]]
    assert layout["mp"] == [[0, 1], [2, 3]]


def test_rank_layout_pp_dp_cp_tp_order() -> None:
    # 16 ranks = PP 2 x DP 2 x CP 2 x TP 2: rank = ((pp*2 + dp)*2 + cp)*2 + tp
    layout = parallel_state.rank_layout(16, 2, 2, 2)
    assert layout["tp"][0] == [0, 1]
    assert [0, 2] in layout["cp"]
    assert [0, 4] in layout["dp"]
    assert [0, 2, 4, 6] in layout["dp_cp"]
    assert [0, 8] in layout["pp"]
    assert [0, 1, 8, 9] in layout["mp"]
    for groups in layout.values():  # every kind partitions the world
        assert sorted(r for g in groups for r in g) == list(range(16))


def test_rank_layout_kv_shared_groups_follow_nxds_arrange_kv_groups() -> None:
    """NxD's parallel_state.arrange_kv_groups: on Trn1 (interleaved, NxD's default) ranks j, j + TP/K, .. share a KV
    head; on Trn2 (adjacent) K consecutive ranks do."""
    layout = parallel_state.rank_layout(8, tensor_model_parallel_size=4, kv_replicator=2)
    assert layout["kv"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    adjacent = parallel_state.rank_layout(8, tensor_model_parallel_size=4, kv_replicator=2,
                                          kv_replica_layout="adjacent")
    assert adjacent["kv"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert parallel_state.rank_layout(8, 8, kv_replicator=4)["kv"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert parallel_state.rank_layout(4, 4, kv_replicator=4)["kv"] == [[0, 1, 2, 3]]
    with pytest.raises(ValueError, match="kv_replica_layout"):
        parallel_state.rank_layout(4, 4, kv_replicator=2, kv_replica_layout="trn1")


def test_rank_layout_expert_parallel_is_carved_from_data_parallel() -> None:
    """NxD's expert layout [PP, DP/EP, EP, TP]: dp_rank = edp_rank * EP + ep_rank. World 8, TP 2 (DP 4), EP 2:
    the DP group of TP rank 0 is [0, 2, 4, 6] (dp ranks 0..3); EP pairs dp ranks {0, 1} and {2, 3}, the expert
    replicas are dp ranks {0, 2} and {1, 3}."""
    layout = parallel_state.rank_layout(8, 2, expert_model_parallel_size=2)
    assert layout["dp"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert layout["ep"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout["edp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    with_cp = parallel_state.rank_layout(8, 1, context_parallel_size=2, expert_model_parallel_size=2)
    assert with_cp["ep"] == [[0, 2], [1, 3], [4, 6], [5, 7]]  # DP ranks stride TP * CP = 2
    assert with_cp["edp_cp"] == [[0, 1, 4, 5], [2, 3, 6, 7]]  # same EP rank, any CP rank


@pytest.mark.parametrize(
    ("world", "kwargs", "match"),
    [
        (6, {"tensor_model_parallel_size": 4}, "not divisible"),
        (8, {"tensor_model_parallel_size": 2, "context_parallel_size": 3}, "context_parallel_size"),
        (4, {"tensor_model_parallel_size": 4, "kv_replicator": 3}, "kv_replicator"),
        (4, {"tensor_model_parallel_size": 0}, "tensor_model_parallel_size"),
        (8, {"tensor_model_parallel_size": 2, "expert_model_parallel_size": 3}, "expert_model_parallel_size .3. "
         "must divide the data-parallel size 4"),
    ],
)
def test_rank_layout_errors(world: int, kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parallel_state.rank_layout(world, **kwargs)


def test_without_torch_distributed_everything_is_world_size_one() -> None:
    assert not collectives.is_initialized()
    assert parallel_state.get_tensor_model_parallel_group() is None
    assert parallel_state.get_tensor_model_parallel_world_size() == 1
    assert parallel_state.get_data_parallel_rank(with_context_parallel=True) == 0
    x = torch.arange(6.0).reshape(1, 2, 3)
    assert collectives.all_reduce(x, None) is x
    assert collectives.all_gather(x, 1, None) is x
    assert collectives.reduce_scatter(x, 1, None) is x
    with pytest.raises(ValueError, match="not divisible"):
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    parallel_state.initialize_model_parallel()
    try:
        assert parallel_state.model_parallel_is_initialized()
        assert parallel_state.get_context_parallel_group() is None
        assert parallel_state.get_group_ranks("dp_cp") == [0]
    finally:
        parallel_state.destroy_model_parallel()
    assert not parallel_state.model_parallel_is_initialized()


def test_default_backend() -> None:
    assert default_backend("cpu") == "gloo"
    assert default_backend("cuda") == "nccl"
    with pytest.raises(ValueError, match="unsupported device type"):
        default_backend("tpu")


def _group_sum(group: object) -> int:
    t = torch.tensor([float(torch.distributed.get_rank())])
    return int(collectives.all_reduce(t, group).item())


def _tp2_cp2_worker(rank: int, world_size: int) -> None:
    with pytest.raises(RuntimeError, match="initialize_model_parallel"):
        parallel_state.get_tensor_model_parallel_rank()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2, context_parallel_size=2)
    ps = parallel_state
    assert ps.get_tensor_model_parallel_rank() == rank % 2
    assert ps.get_context_parallel_rank() == rank // 2
    assert ps.get_data_parallel_world_size() == 1
    assert ps.get_data_parallel_world_size(with_context_parallel=True) == 2
    assert ps.get_group_ranks("tp") == [rank - rank % 2, rank - rank % 2 + 1]
    assert ps.get_group_ranks("cp") == [rank % 2, rank % 2 + 2]
    # the groups really connect those global ranks
    assert _group_sum(ps.get_tensor_model_parallel_group()) == sum(ps.get_group_ranks("tp"))
    assert _group_sum(ps.get_context_parallel_group()) == sum(ps.get_group_ranks("cp"))
    assert _group_sum(ps.get_data_parallel_group()) == rank
    assert _group_sum(ps.get_data_parallel_group(with_context_parallel=True)) == sum(ps.get_group_ranks("cp"))
    assert _group_sum(ps.get_pipeline_model_parallel_group()) == rank
    with pytest.raises(RuntimeError, match="already"):
        ps.initialize_model_parallel(tensor_model_parallel_size=2, context_parallel_size=2)


@pytest.mark.distributed
def test_groups_tp2_cp2_four_processes() -> None:
    run_distributed(_tp2_cp2_worker, 4)


def _collectives_worker(rank: int, world_size: int) -> None:
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world_size)
    group = parallel_state.get_tensor_model_parallel_group()
    base = torch.arange(12.0).reshape(2, 6, 1)  # [B, S, H]
    mine = base + 100 * rank
    gathered = collectives.all_gather(mine[:, :3], 1, group)
    expected = torch.cat([base[:, :3] + 100 * r for r in range(world_size)], dim=1)
    torch.testing.assert_close(gathered, expected)
    scattered = collectives.reduce_scatter(mine, 1, group)
    total = sum(base + 100 * r for r in range(world_size))
    torch.testing.assert_close(scattered, total.chunk(world_size, dim=1)[rank])
    swapped = collectives.all_to_all(mine, 1, 2, group)  # [2, 6/ws, ws]
    for r in range(world_size):
        torch.testing.assert_close(swapped[..., r:r + 1], (base + 100 * r).chunk(world_size, dim=1)[rank])
    src = torch.full((2,), float(rank))
    assert collectives.broadcast(src, 1, group).tolist() == [1.0, 1.0]
    avg = collectives.all_reduce(torch.tensor([float(rank)]), group, op="avg")
    assert avg.item() == pytest.approx(sum(range(world_size)) / world_size)
    assert collectives.all_reduce(torch.tensor([float(rank)]), group, op="max").item() == world_size - 1
    with pytest.raises(ValueError, match="not divisible"):
        collectives.reduce_scatter(torch.zeros(1, 3, 1), 1, group)
    collectives.barrier(group)


@pytest.mark.distributed
def test_collectives_gloo_two_processes() -> None:
    run_distributed(_collectives_worker, 2)


def test_kv_replica_layout_auto_is_chosen_as_nxd_chooses(monkeypatch: pytest.MonkeyPatch) -> None:
    """NxD picks the layout by the hardware (``hardware(get_platform_target())``, TRN1 by default): the platform
    torch-neuronx reports wins; else the native device and a logical NeuronCore size of 2 (NxDT's trn2 files) mean
    Trn2; else Trn1."""
    from nxd_lc.context import nki

    resolve = nki.resolve_kv_replica_layout
    monkeypatch.setattr(nki, "neuron_platform", lambda: None)
    assert resolve("auto", "cpu", None) == "interleaved"
    assert resolve("auto", "xla", 1) == "interleaved"
    assert resolve("auto", "xla", 2) == "adjacent"
    assert resolve("auto", "neuron_native", None) == "adjacent"
    assert resolve("adjacent", "cpu", None) == "adjacent"
    assert resolve("interleaved", "neuron_native", 2) == "interleaved"
    for platform, layout in (("trn1", "interleaved"), ("trn2", "adjacent"), ("trn3", "adjacent")):
        monkeypatch.setattr(nki, "neuron_platform", lambda p=platform: p)
        assert resolve("auto", "xla", 2 if platform != "trn1" else 1) == layout
        assert resolve("auto", "cpu", None) == layout  # the platform wins over the rest
    with pytest.raises(ValueError, match="distributed_strategy.kv_replica_layout"):
        resolve("trn1", "cpu", None)
