"""Gradient reductions and global norms (nxd_lc.distributed.grads) vs single-process references.

The norm tests give every FULL parameter a known full gradient, shard it exactly as the layer
shards its weight (KV replicas included) and check that the global norm over the sharded model
equals the norm over the full gradients.
"""

from __future__ import annotations

import math

import pytest
import torch
from dist_utils import run_distributed
from torch import nn

from nxd_lc.distributed import grads, parallel_state
from nxd_lc.layers import (
    ColumnParallelLinear,
    GQAQKVColumnParallelLinear,
    ParallelEmbedding,
    RowParallelLinear,
    shard_full_parameter,
)

pytestmark = pytest.mark.compat  # torch-2.9 compatibility subset (lane 2; docs/testing.md)

H = 8


class _Block(nn.Module):
    """A toy model with every kind of parameter: TP-sharded, TP-replicated (SP norm weight, row
    bias under SP), KV-replicated (fused and unfused) and vocab-sharded."""

    def __init__(self, kv_replicator: int, nkv: int) -> None:
        super().__init__()
        self.embed = ParallelEmbedding(16, H, sequence_parallel_enabled=True)
        self.norm = nn.Parameter(torch.ones(H))
        self.norm.sequence_parallel_enabled = True
        self.qkv_fused = GQAQKVColumnParallelLinear(H, 8, nkv, 2, kv_replicator=kv_replicator, fuse_qkv=True)
        self.qkv_split = GQAQKVColumnParallelLinear(H, 8, nkv, 2, kv_replicator=kv_replicator, fuse_qkv=False)
        self.up = ColumnParallelLinear(H, 12, sequence_parallel_enabled=True)
        self.down = RowParallelLinear(12, H, sequence_parallel_enabled=True)


def _full_values(seed: int, nkv: int) -> dict[str, torch.Tensor]:
    """Full (unsharded) tensors for every parameter of :class:`_Block`, keyed by a short name."""
    g = torch.Generator().manual_seed(seed)
    shapes = {"embed": (16, H), "norm": (H,), "up.w": (12, H), "up.b": (12,), "down.w": (H, 12),
              "down.b": (H,)}
    for kind in ("fused", "split"):
        shapes.update({f"{kind}.q": (16, H), f"{kind}.k": (nkv * 2, H), f"{kind}.v": (nkv * 2, H)})
    return {k: torch.randn(s, generator=g) for k, s in shapes.items()}


def _local_values(model: _Block, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Shard ``full`` like the model's parameters; keys are the model's parameter names."""
    plain = {"embed.weight": "embed", "norm": "norm", "up.weight": "up.w", "up.bias": "up.b",
             "down.weight": "down.w", "down.bias": "down.b"}
    params = dict(model.named_parameters())
    local = {name: shard_full_parameter(full[key], params[name]) for name, key in plain.items()}
    for kind in ("fused", "split"):
        layer = getattr(model, f"qkv_{kind}")
        shards = layer.shard_qkv_weights(full[f"{kind}.q"], full[f"{kind}.k"], full[f"{kind}.v"])
        local.update({f"qkv_{kind}.{name}": t for name, t in shards.items()})
    assert sorted(local) == sorted(params)
    return local


def _reference_norm(full: dict[str, torch.Tensor], norm_type: float) -> float:
    flat = torch.cat([t.flatten() for t in full.values()])
    return float(torch.linalg.vector_norm(flat, ord=norm_type))


def _norm_worker(rank: int, world_size: int) -> None:
    kv, nkv = 2, 2  # 2 KV heads at TP=4: each replicated twice
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world_size, kv_replicator=kv)
    torch.manual_seed(0)
    model = _Block(kv, nkv)
    full_grads = _full_values(1, nkv)
    params = dict(model.named_parameters())
    for name, g in _local_values(model, full_grads).items():
        params[name].grad = g.clone()
    for norm_type in (2.0, 1.0, math.inf):
        got = grads.global_grad_norm(model.parameters(), norm_type)
        assert got.item() == pytest.approx(_reference_norm(full_grads, norm_type), rel=1e-5)
    full_params = _full_values(2, nkv)
    with torch.no_grad():
        for name, t in _local_values(model, full_params).items():
            params[name].copy_(t)
    assert grads.global_param_norm(model.parameters()).item() == pytest.approx(
        _reference_norm(full_params, 2.0), rel=1e-5)
    # clipping scales every local gradient by the same factor as the single-process rule
    total = grads.clip_grad_norm_(model.parameters(), max_norm=1.0)
    coef = 1.0 / (total.item() + 1e-6)
    for name, g in _local_values(model, full_grads).items():
        torch.testing.assert_close(params[name].grad, g * coef)
    assert grads.global_grad_norm(model.parameters()).item() == pytest.approx(1.0, rel=1e-4)


def _sp_and_kv_reduction_worker(rank: int, world_size: int) -> None:
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world_size, kv_replicator=2)
    model = _Block(2, 2)
    for p in model.parameters():
        p.grad = torch.full_like(p, float(rank + 1))
    grads.allreduce_sequence_parallel_gradients(model)
    grads.allreduce_kv_replica_gradients(model)
    tp_sum = float(sum(range(1, world_size + 1)))
    kv_sum = float(sum(r + 1 for r in parallel_state.get_group_ranks("kv")))
    assert torch.all(model.norm.grad == tp_sum) and torch.all(model.down.bias.grad == tp_sum)
    assert torch.all(model.up.weight.grad == rank + 1)  # TP-sharded: untouched
    assert torch.all(model.qkv_split.weight_q.grad == rank + 1)
    assert torch.all(model.qkv_split.weight_k.grad == kv_sum)
    q_rows = model.qkv_fused.q_size_local
    assert torch.all(model.qkv_fused.weight_qkv.grad[:q_rows] == rank + 1)
    assert torch.all(model.qkv_fused.weight_qkv.grad[q_rows:] == kv_sum)


@pytest.mark.distributed
def test_global_norms_and_clipping_tp4_kv_replicas() -> None:
    run_distributed(_norm_worker, 4)


@pytest.mark.distributed
def test_sequence_parallel_and_kv_replica_reductions() -> None:
    run_distributed(_sp_and_kv_reduction_worker, 4)


def _pp_and_dp_worker(rank: int, world_size: int) -> None:
    # TP=2 x PP=2: each stage holds different parameters; the norm covers both stages.
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    stage = parallel_state.get_pipeline_model_parallel_rank()
    full = [torch.randn(6, 4, generator=torch.Generator().manual_seed(10 + s)) for s in range(2)]
    layer = ColumnParallelLinear(4, 6, bias=False)
    layer.weight.grad = shard_full_parameter(full[stage], layer.weight).clone()
    expected = float(torch.cat([f.flatten() for f in full]).norm())
    assert grads.global_grad_norm(layer.parameters()).item() == pytest.approx(expected, rel=1e-5)
    parallel_state.destroy_model_parallel()

    # CP=2 x DP=2 (TP=1): averaging over DP only, or over DP x CP.
    parallel_state.initialize_model_parallel(context_parallel_size=2)
    params = [nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(2, 2, dtype=torch.float64)),
              nn.Parameter(torch.zeros(5))]
    for p in params:
        p.grad = torch.full_like(p, float(rank))
    grads.allreduce_data_parallel_gradients(params, with_context_parallel=False, bucket_size_mb=1e-5)
    dp_mean = sum(parallel_state.get_group_ranks("dp")) / 2
    assert all(torch.all(p.grad == dp_mean) for p in params)
    for p in params:
        p.grad = torch.full_like(p, float(rank))
    grads.allreduce_data_parallel_gradients(params, with_context_parallel=True)
    assert all(torch.all(p.grad == 1.5) for p in params)


@pytest.mark.distributed
def test_pipeline_norm_and_data_parallel_average() -> None:
    run_distributed(_pp_and_dp_worker, 4)


def test_single_process_norm_matches_torch() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(ColumnParallelLinear(4, 6), RowParallelLinear(6, 3))
    model(torch.randn(2, 5, 4)).square().sum().backward()
    ref = [p.grad.clone() for p in model.parameters()]
    want = torch.nn.utils.get_total_norm(ref)
    torch.testing.assert_close(grads.global_grad_norm(model.parameters()), want)
    total = grads.clip_grad_norm_(model.parameters(), max_norm=0.5)
    torch.testing.assert_close(total, want)
    for p, g in zip(model.parameters(), ref):
        torch.testing.assert_close(p.grad, g * (0.5 / (want + 1e-6)))
    with pytest.raises(ValueError, match="max_norm"):
        grads.clip_grad_norm_(model.parameters(), max_norm=0.0)
    with pytest.raises(ValueError, match="norm_type"):
        grads.global_grad_norm(model.parameters(), norm_type=-1.0)


def _expert_reduction_worker(rank: int, world: int) -> None:
    """World 4, EP 2 carved from DP 4: EP groups {0, 1}, {2, 3}; replicas of the same experts {0, 2}, {1, 3}."""
    parallel_state.initialize_model_parallel(expert_model_parallel_size=2)
    dense = torch.nn.Parameter(torch.zeros(3))
    expert = torch.nn.Parameter(torch.zeros(2))
    expert.expert_model_parallel = True
    dense.grad = torch.full((3,), float(rank + 1))
    expert.grad = (rank + 1) * torch.tensor([1.0, 2.0])
    grads.allreduce_data_parallel_gradients([dense, expert])
    torch.testing.assert_close(dense.grad, torch.full((3,), 2.5))  # (1 + 2 + 3 + 4) / 4
    # expert gradient: summed over its replicas (ranks of the same EP rank), divided by DP = 4
    want = (1 + 3) / 4 if rank in (0, 2) else (2 + 4) / 4
    torch.testing.assert_close(expert.grad, want * torch.tensor([1.0, 2.0]))
    # unique pieces: dense 3 x 2.5; EP rank 0's experts 1.0 x [1, 2]; EP rank 1's 1.5 x [1, 2]
    norm = grads.global_grad_norm([dense, expert])
    torch.testing.assert_close(norm, torch.tensor(35.0).sqrt())
    torch.testing.assert_close(grads.global_grad_norm([dense, expert], norm_type=float("inf")), torch.tensor(3.0))


@pytest.mark.distributed
def test_expert_gradients_reduced_over_their_replicas_and_counted_once_per_ep_rank() -> None:
    run_distributed(_expert_reduction_worker, 4)
