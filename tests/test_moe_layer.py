"""The MoE layer (nxd_lc.moe) against transformers' MixtralSparseMoeBlock and load_balancing_loss_func, and token
dropping against a plain-Python reference; multi-process: TP 2 with and without SP, EP 2 (carved from DP 2) and
TP 2 x EP 2, outputs and every gradient against the single-process transformers block."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from dist_utils import run_distributed
from transformers import MixtralConfig
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock, load_balancing_loss_func

from nxd_lc.distributed import parallel_state
from nxd_lc.moe.layer import MoE
from nxd_lc.moe.routing import RouterStats, expert_capacity, load_balancing_loss, route_top_k

H, INTER, E, K = 16, 12, 4, 2


def _hf_block(seed: int = 0) -> MixtralSparseMoeBlock:
    torch.manual_seed(seed)
    cfg = MixtralConfig(hidden_size=H, intermediate_size=INTER, num_local_experts=E, num_experts_per_tok=K)
    block = MixtralSparseMoeBlock(cfg)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.3)
    return block


def _full_weights(block: MixtralSparseMoeBlock) -> dict[str, torch.Tensor]:
    """HF (transformers 5) block weights under nxd_lc's names (same layouts)."""
    return {"router.weight": block.gate.weight.detach(), "experts.gate_up_proj": block.experts.gate_up_proj.detach(),
            "experts.down_proj": block.experts.down_proj.detach()}


def _local(name: str, full: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a full (E, ...) tensor: experts split over EP, then TP as the parameter is marked."""
    if name == "router.weight":
        return full
    ep, ep_rank = parallel_state.get_expert_model_parallel_world_size(), parallel_state.get_expert_model_parallel_rank()
    tp, tp_rank = parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank()
    part = full.chunk(ep, dim=0)[ep_rank]
    if name == "experts.gate_up_proj":  # [gate; up] rows, each half split over TP
        gate, up = part.chunk(2, dim=1)
        return torch.cat([gate.chunk(tp, dim=1)[tp_rank], up.chunk(tp, dim=1)[tp_rank]], dim=1)
    return part.chunk(tp, dim=2)[tp_rank]


def _moe(block: MixtralSparseMoeBlock, sp: bool = False, **kw: Any) -> MoE:
    moe = MoE(H, INTER, E, K, sequence_parallel=sp, init_method=torch.nn.init.zeros_, **kw)
    with torch.no_grad():
        for name, full in _full_weights(block).items():
            moe.get_parameter(name).copy_(_local(name, full))
    return moe


def _hf_forward(block: MixtralSparseMoeBlock, x: torch.Tensor, probe: torch.Tensor, coef: float
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    """transformers: output, parameter gradients, input gradient and aux loss of sum(y * probe) + coef * aux."""
    block.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    y = block(x)
    logits = torch.nn.functional.linear(x.reshape(-1, H), block.gate.weight)
    aux = load_balancing_loss_func((logits,), E, K)
    ((y * probe).sum() + coef * aux).backward()
    grads = {"router.weight": block.gate.weight.grad, "experts.gate_up_proj": block.experts.gate_up_proj.grad,
             "experts.down_proj": block.experts.down_proj.grad}
    return y.detach(), grads, x.grad, aux.detach()


@pytest.mark.compat  # torch-2.9 compatibility subset (lane 2)
def test_router_and_aux_loss_match_transformers() -> None:
    torch.manual_seed(0)
    block = _hf_block()
    x = torch.randn(10, H)
    routing = route_top_k(x, block.gate.weight, K)
    hf_logits, hf_scores, hf_index = block.gate(x)
    torch.testing.assert_close(routing.logits, hf_logits.float())
    torch.testing.assert_close(routing.weights, hf_scores)
    assert torch.equal(routing.expert_index, hf_index)
    other = torch.randn(7, H)  # two "layers" of different token counts: pooled statistics
    stats = RouterStats.of(routing, E) + RouterStats.of(route_top_k(other, block.gate.weight, K), E)
    hf = load_balancing_loss_func((hf_logits, block.gate(other)[0]), E, K)
    torch.testing.assert_close(load_balancing_loss(stats, E), hf)
    uniform = RouterStats(torch.full((E,), 2.0 * K), torch.full((E,), 2.0), torch.tensor(2.0 * E))
    assert load_balancing_loss(uniform, E).item() == pytest.approx(K)  # closed form: k for uniform routing


def test_capacity_formula() -> None:
    assert expert_capacity(10, 4, 2, 1.0) == 5  # ceil(10 * 2 / 4)
    assert expert_capacity(10, 4, 2, 1.3) == math.ceil(6.5)
    assert expert_capacity(10, 4, 2, 100.0) == 10  # at most T
    with pytest.raises(ValueError, match="model.moe.capacity_factor"):
        expert_capacity(10, 4, 2, 0.0)


@pytest.mark.compat  # torch-2.9 compatibility subset (lane 2)
@pytest.mark.parametrize("capacity_factor", [None, 8.0])
def test_single_process_matches_transformers(capacity_factor: float | None) -> None:
    """Dropless, and a capacity large enough to drop nothing: output, aux loss and every gradient."""
    block = _hf_block()
    torch.manual_seed(1)
    x, probe = torch.randn(2, 6, H), torch.randn(2, 6, H)
    y_ref, g_ref, gx_ref, aux_ref = _hf_forward(block, x, probe, coef=0.1)
    moe = _moe(block, capacity_factor=capacity_factor, dropless=capacity_factor is None)
    xx = x.clone().requires_grad_(True)
    y, stats = moe(xx)
    aux = load_balancing_loss(stats, E)
    ((y * probe).sum() + 0.1 * aux).backward()
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(aux, aux_ref)
    torch.testing.assert_close(xx.grad, gx_ref, atol=1e-5, rtol=1e-5)
    for name, grad in g_ref.items():
        torch.testing.assert_close(moe.get_parameter(name).grad, grad, atol=1e-5, rtol=1e-5, msg=name)


def _dropping_reference(x: torch.Tensor, block: MixtralSparseMoeBlock, capacity: int) -> torch.Tensor:
    """Plain loops: tokens in (b, s) order take their experts' slots until an expert has ``capacity``; a token's
    kept affinities are renormalised; its output is the weighted sum of its kept experts' SwiGLU outputs."""
    flat = x.reshape(-1, H)
    probs = torch.softmax(flat @ block.gate.weight.T, dim=-1)
    used = [0] * E
    out = torch.zeros_like(flat)
    for t in range(flat.shape[0]):
        top = torch.topk(probs[t], K)
        kept = []
        for p, e in zip(top.values.tolist(), top.indices.tolist()):
            if used[e] < capacity:
                used[e] += 1
                kept.append((p, e))
        total = sum(p for p, _ in kept)
        for p, e in kept:
            gate, up = (block.experts.gate_up_proj[e] @ flat[t]).chunk(2)
            out[t] += p / total * (block.experts.down_proj[e] @ (torch.nn.functional.silu(gate) * up))
    return out.view_as(x)


def test_token_dropping_matches_plain_reference() -> None:
    block = _hf_block(3)
    torch.manual_seed(4)
    x = torch.randn(2, 9, H)
    moe = _moe(block, capacity_factor=0.5, dropless=False)
    capacity = expert_capacity(18, E, K, 0.5)  # ceil(0.5 * 18 * 2 / 4) = 5 of the ~9 tokens an expert gets
    with torch.no_grad():
        y, _ = moe(x)
        ref = _dropping_reference(x, block, capacity)
        full, _ = _moe(block)(x)
    torch.testing.assert_close(y, ref, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(y, full, atol=1e-3)  # something was dropped


# ---- multi-process ------------------------------------------------------------------------------------------------
def _dist_worker(rank: int, world: int, tp: int, ep: int, layouts: list[tuple[bool, float | None]]) -> None:
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep)
    for sp, capacity_factor in layouts:
        _dist_check(rank, tp, ep, sp, capacity_factor)


def _dist_check(rank: int, tp: int, ep: int, sp: bool, capacity_factor: float | None) -> None:
    block = _hf_block()
    dp, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    torch.manual_seed(7)
    xs, probes = torch.randn(dp, 2, 8, H), torch.randn(dp, 2, 8, H)  # one micro-batch per DP rank
    refs = [_hf_forward(block, xs[d], probes[d], coef=0.3) for d in range(dp)]
    moe = _moe(block, sp=sp, capacity_factor=capacity_factor, dropless=capacity_factor is None)
    x, probe = xs[dp_rank].clone(), probes[dp_rank]
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    if sp:
        x, probe = x.chunk(tp, dim=1)[tp_rank].clone(), probe.chunk(tp, dim=1)[tp_rank]
    x.requires_grad_(True)
    y, stats = moe(x)
    aux = load_balancing_loss(stats, E)
    ((y * probe).sum() + 0.3 * aux).backward()
    y_ref, _, gx_ref, aux_ref = refs[dp_rank]
    if sp:
        y_ref, gx_ref = y_ref.chunk(tp, dim=1)[tp_rank], gx_ref.chunk(tp, dim=1)[tp_rank]
    msg = f"tp={tp} ep={ep} sp={sp} cf={capacity_factor} rank={rank}"
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5, msg=msg)
    torch.testing.assert_close(aux, aux_ref, msg=msg)
    torch.testing.assert_close(x.grad, gx_ref, atol=1e-5, rtol=1e-5, msg=msg)
    router_grad = moe.router.weight.grad
    if sp:  # each TP rank holds the router gradient of its tokens; summed over TP by the SP gradient reduction
        router_grad = router_grad.clone()
        torch.distributed.all_reduce(router_grad, group=parallel_state.get_tensor_model_parallel_group())
    torch.testing.assert_close(router_grad, refs[dp_rank][1]["router.weight"], atol=1e-5, rtol=1e-5, msg=msg)
    edp = parallel_state.get_group_ranks("ep")  # experts get gradients from every EP rank's tokens
    for name in ("experts.gate_up_proj", "experts.down_proj"):
        want = sum(refs[parallel_state.get_group_ranks("dp").index(r)][1][name] for r in edp)
        torch.testing.assert_close(moe.get_parameter(name).grad, _local(name, want), atol=1e-5, rtol=1e-5,
                                   msg=f"{msg} {name}")


@pytest.mark.distributed
@pytest.mark.parametrize(("world", "tp", "ep", "layouts"), [
    (2, 2, 1, [(False, None), (True, 8.0)]),
    (2, 1, 2, [(False, None), (False, 8.0)]),
    (4, 2, 2, [(True, None)]),
], ids=["tp2_with_and_without_sp", "ep2_dropless_and_capacity", "tp2_sp_ep2"])
def test_parallel_moe_matches_transformers(world: int, tp: int, ep: int,
                                           layouts: list[tuple[bool, float | None]]) -> None:
    """(sequence_parallel, capacity_factor) layouts; capacity 8.0 is large enough to drop nothing."""
    run_distributed(_dist_worker, world, tp, ep, layouts)
