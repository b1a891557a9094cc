"""Tensor-parallel layers vs a single-process reference built from the same full weights.

Each distributed check runs the sharded layer on every rank and compares outputs AND gradients
(input and weights) with plain ``torch.nn.functional`` on the full weights, computed in the same
process. Loss = sum(output * dy) with a fixed random ``dy``, so that summed over ranks it equals
the reference loss.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from dist_utils import run_distributed

from nxd_lc.distributed import collectives, grads, parallel_state
from nxd_lc.layers import (
    ColumnParallelLinear,
    GQAQKVColumnParallelLinear,
    ParallelEmbedding,
    RowParallelLinear,
    gather_full_parameter,
    parallel_cross_entropy,
    shard_full_parameter,
    split_tensor_for_rank,
    validate_gqa_sharding,
)

pytestmark = pytest.mark.compat  # torch-2.9 compatibility subset (lane 2; docs/testing.md)

B, S, H = 2, 4, 8
close = torch.testing.assert_close


def _chunk(t: torch.Tensor, dim: int) -> torch.Tensor:
    world = parallel_state.get_tensor_model_parallel_world_size()
    return t.chunk(world, dim=dim)[parallel_state.get_tensor_model_parallel_rank()]


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_(True)


def _load(layer: torch.nn.Module, **full: torch.Tensor) -> None:
    with torch.no_grad():
        for name, t in full.items():
            getattr(layer, name).copy_(shard_full_parameter(t, getattr(layer, name)))


def _check_column(sp: bool) -> None:
    torch.manual_seed(1)
    out = 12
    w, b, x, dy = torch.randn(out, H), torch.randn(out), torch.randn(B, S, H), torch.randn(B, S, out)
    xr = _leaf(x)
    ref = F.linear(xr, w.requires_grad_(), b.requires_grad_())
    (ref * dy).sum().backward()
    layer = ColumnParallelLinear(H, out, sequence_parallel_enabled=sp)
    _load(layer, weight=w, bias=b)
    xl = _leaf(_chunk(x, 1) if sp else x)
    y = layer(xl)
    close(y, _chunk(ref, -1).detach())
    (y * _chunk(dy, -1)).sum().backward()
    close(xl.grad, _chunk(xr.grad, 1) if sp else xr.grad)
    close(layer.weight.grad, _chunk(w.grad, 0))
    close(layer.bias.grad, _chunk(b.grad, 0))
    gathered = ColumnParallelLinear(H, out, gather_output=True)
    _load(gathered, weight=w, bias=b)
    close(gathered(x), ref.detach())


def _check_row(sp: bool) -> None:
    torch.manual_seed(2)
    inp = 12
    w, b, x, dy = torch.randn(H, inp), torch.randn(H), torch.randn(B, S, inp), torch.randn(B, S, H)
    xr = _leaf(x)
    ref = F.linear(xr, w.requires_grad_(), b.requires_grad_())
    (ref * dy).sum().backward()
    layer = RowParallelLinear(inp, H, sequence_parallel_enabled=sp)
    _load(layer, weight=w, bias=b)
    xl = _leaf(_chunk(x, -1))
    y = layer(xl)
    close(y, _chunk(ref, 1).detach() if sp else ref.detach())
    (y * (_chunk(dy, 1) if sp else dy)).sum().backward()
    grads.allreduce_sequence_parallel_gradients(layer)
    close(xl.grad, _chunk(xr.grad, -1))
    close(layer.weight.grad, _chunk(w.grad, 1))
    close(layer.bias.grad, b.grad)
    assert getattr(layer.bias, "sequence_parallel_enabled", False) == sp
    full_input = RowParallelLinear(inp, H, input_is_parallel=False)
    _load(full_input, weight=w, bias=b)
    close(full_input(x), ref.detach())


def _check_mlp_block_sp() -> None:
    """Column(H->F, SP) -> gelu -> Row(F->H, SP): [B, S/tp, H] -> [B, S/tp, H]."""
    torch.manual_seed(3)
    ffn = 16
    w1, w2 = torch.randn(ffn, H).requires_grad_(), torch.randn(H, ffn).requires_grad_()
    x, dy = torch.randn(B, S, H), torch.randn(B, S, H)
    xr = _leaf(x)
    ref = F.linear(F.gelu(F.linear(xr, w1)), w2)
    (ref * dy).sum().backward()
    up = ColumnParallelLinear(H, ffn, bias=False, sequence_parallel_enabled=True)
    down = RowParallelLinear(ffn, H, bias=False, sequence_parallel_enabled=True)
    _load(up, weight=w1)
    _load(down, weight=w2)
    xl = _leaf(_chunk(x, 1))
    y = down(F.gelu(up(xl)))
    close(y, _chunk(ref, 1).detach())
    (y * _chunk(dy, 1)).sum().backward()
    close(xl.grad, _chunk(xr.grad, 1))
    close(up.weight.grad, _chunk(w1.grad, 0))
    close(down.weight.grad, _chunk(w2.grad, 1))


def _qkv_reference_loss(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, hd: int) -> torch.Tensor:
    """GQA-shaped bilinear loss: query head h pairs with kv head h // (nq / nkv)."""
    nq, nkv = q.shape[-1] // hd, k.shape[-1] // hd
    qh, kh, vh = (t.unflatten(-1, (-1, hd)) for t in (q, k, v))
    kv_of_q = torch.arange(nq) // (nq // nkv)
    return (qh * kh[..., kv_of_q, :]).sum() + 0.5 * (qh * vh[..., kv_of_q, :] ** 2).sum()


def _check_qkv(nq: int, nkv: int, kv_replicator: int, fuse: bool, sp: bool) -> None:
    torch.manual_seed(4)
    hd = 2
    wq, wk, wv = torch.randn(nq * hd, H), torch.randn(nkv * hd, H), torch.randn(nkv * hd, H)
    x = torch.randn(B, S, H)
    xr = _leaf(x)
    full = [w.clone().requires_grad_() for w in (wq, wk, wv)]
    ref = [F.linear(xr, w) for w in full]
    _qkv_reference_loss(*ref, hd).backward()

    layer = GQAQKVColumnParallelLinear(H, nq, nkv, hd, kv_replicator=kv_replicator, fuse_qkv=fuse,
                                       sequence_parallel_enabled=sp)
    layer.load_full_qkv_weights(wq, wk, wv)
    for got, want in zip(layer.gather_full_qkv_weights(), (wq, wk, wv)):
        close(got, want)
    xl = _leaf(_chunk(x, 1) if sp else x)
    q, k, v = layer(xl)
    heads = layer._kv_head_ids()
    # this rank's block of query heads: its own rank's unless replicas are interleaved (NxD's Trn1 layout)
    block = layer.query_block()
    close(q, ref[0].chunk(parallel_state.get_tensor_model_parallel_world_size(), -1)[block].detach())
    close(k, ref[1].unflatten(-1, (nkv, hd))[..., heads, :].flatten(-2).detach())
    close(v, ref[2].unflatten(-1, (nkv, hd))[..., heads, :].flatten(-2).detach())
    _qkv_reference_loss(q, k, v, hd).backward()
    grads.allreduce_kv_replica_gradients(layer)
    close(xl.grad, _chunk(xr.grad, 1) if sp else xr.grad)
    want = layer.shard_qkv_weights(*(w.grad for w in full))
    for name, g in want.items():
        close(getattr(layer, name).grad, g)


def _check_embedding(sp: bool) -> None:
    torch.manual_seed(5)
    vocab = 8
    w = torch.randn(vocab, H)
    ids = torch.tensor([[0, 7, 3, 4], [5, 1, 7, 2]])
    dy = torch.randn(B, S, H)
    wr = w.clone().requires_grad_()
    ref = F.embedding(ids, wr)
    (ref * dy).sum().backward()
    layer = ParallelEmbedding(vocab, H, sequence_parallel_enabled=sp)
    _load(layer, weight=w)
    y = layer(ids)
    close(y, _chunk(ref, 1).detach() if sp else ref.detach())
    (y * (_chunk(dy, 1) if sp else dy)).sum().backward()
    close(layer.weight.grad, _chunk(wr.grad, 0))


def _check_cross_entropy(dtype: torch.dtype) -> None:
    torch.manual_seed(6)
    vocab = 16
    logits = (torch.randn(B, S, vocab) * 3).to(dtype)
    target = torch.randint(0, vocab, (B, S))
    target[0, 1] = target[1, 3] = -100
    dloss = torch.rand(B, S)
    lr = logits.float().requires_grad_()
    ref = F.cross_entropy(lr.transpose(1, 2), target, ignore_index=-100, reduction="none")
    (ref * dloss).sum().backward()
    ll = _leaf(_chunk(logits, -1))
    loss = parallel_cross_entropy(ll, target)
    assert loss.dtype == torch.float32 and loss.shape == (B, S)
    assert loss[0, 1] == 0 and loss[1, 3] == 0
    close(loss, ref.detach(), atol=1e-5, rtol=1e-5)
    (loss * dloss).sum().backward()
    assert ll.grad.dtype == dtype
    close(ll.grad.float(), _chunk(lr.grad, -1), atol=1e-2 if dtype == torch.bfloat16 else 1e-6, rtol=1e-2)


def _check_cpu_initialization_matches_tp1() -> None:
    torch.manual_seed(7)
    bound = 1 / H**0.5
    master_col = torch.empty(12, H).uniform_(-bound, bound)
    master_qkv = [torch.empty(n * 2, H).uniform_(-bound, bound) for n in (4, 2, 2)]
    torch.manual_seed(7)
    col = ColumnParallelLinear(H, 12)
    qkv = GQAQKVColumnParallelLinear(H, 4, 2, 2)
    close(col.weight.data, _chunk(master_col, 0))
    close(gather_full_parameter(col.weight), master_col)
    for got, want in zip(qkv.gather_full_qkv_weights(), master_qkv):
        close(got, want)


def _check_direct_init_keeps_kv_replicas_identical() -> None:
    torch.manual_seed(8)
    qkv = GQAQKVColumnParallelLinear(H, 8, 2, 2, kv_replicator=2, use_cpu_initialization=False)
    mine, other = collectives.all_gather(qkv.weight_qkv.data, 0, parallel_state.get_kv_shared_group()).chunk(2)
    rows = qkv.q_size_local
    close(mine[rows:], other[rows:])  # the two replicas of this KV head
    assert not torch.equal(mine[:rows], other[:rows])  # different query heads
    col = ColumnParallelLinear(H, 8, use_cpu_initialization=False)
    shards = collectives.all_gather(col.weight.data, 0, parallel_state.get_tensor_model_parallel_group())
    assert not torch.equal(*shards.chunk(parallel_state.get_tensor_model_parallel_world_size())[:2])


def _tp_worker(rank: int, world_size: int, kv_replicator: int) -> None:
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world_size, kv_replicator=kv_replicator)
    for sp in (False, True):
        _check_column(sp)
        _check_row(sp)
        _check_embedding(sp)
    _check_mlp_block_sp()
    for dtype in (torch.float32, torch.bfloat16):
        _check_cross_entropy(dtype)
    if kv_replicator == 1:
        for fuse in (True, False):
            _check_qkv(nq=4, nkv=world_size, kv_replicator=1, fuse=fuse, sp=fuse)
        _check_cpu_initialization_matches_tp1()
    else:  # 2 KV heads at TP=4: each KV head replicated kv_replicator=2 times, in each of NxD's two layouts
        for layout in ("interleaved", "adjacent"):
            parallel_state.destroy_model_parallel()
            parallel_state.initialize_model_parallel(tensor_model_parallel_size=world_size,
                                                     kv_replicator=kv_replicator, kv_replica_layout=layout)
            # NxD's arrange_kv_groups: trn1 {0, 2} {1, 3}; trn2 {0, 1} {2, 3}
            expected = {"interleaved": [[0, 2], [1, 3]], "adjacent": [[0, 1], [2, 3]]}[layout]
            assert parallel_state._STORE.state.ranks["kv"] in expected
            _check_direct_init_keeps_kv_replicas_identical()
            for fuse in (True, False):
                _check_qkv(nq=8, nkv=world_size // kv_replicator, kv_replicator=kv_replicator, fuse=fuse,
                           sp=not fuse)


@pytest.mark.distributed
def test_tp_layers_two_processes() -> None:
    run_distributed(_tp_worker, 2, 1)


@pytest.mark.distributed
def test_tp_layers_four_processes_kv_replicator() -> None:
    run_distributed(_tp_worker, 4, 2)


def test_single_process_layers_equal_plain_torch() -> None:
    torch.manual_seed(0)
    col, row = ColumnParallelLinear(H, 12), RowParallelLinear(12, H, bias=False)
    x = torch.randn(B, S, H)
    close(row(col(x)), F.linear(F.linear(x, col.weight, col.bias), row.weight))
    qkv = GQAQKVColumnParallelLinear(H, 4, 2, 2, fuse_qkv=True, bias=True)
    q, k, v = qkv(x)
    close(torch.cat([q, k, v], -1), F.linear(x, qkv.weight_qkv, qkv.bias_qkv))
    _check_cross_entropy(torch.float32)


def test_split_tensor_for_rank_with_stride() -> None:
    full = torch.arange(8).reshape(8, 1)  # two blocks [0..3], [4..7], each split over 2 ranks
    assert split_tensor_for_rank(full, 0, 1, 2, stride=2).flatten().tolist() == [2, 3, 6, 7]
    with pytest.raises(ValueError, match="multiple of 6"):
        split_tensor_for_rank(full, 0, 0, 3, stride=2)


@pytest.mark.parametrize(
    ("nq", "nkv", "kv", "tp", "match"),
    [
        (8, 2, 1, 4, r"kv_replicator \(1\) must equal .*kv_replicator: 2"),
        (8, 2, 4, 4, r"kv_replicator \(4\)"),
        (8, 8, 2, 4, "kv_replicator must be 1"),
        (6, 3, 1, 4, "num_attention_heads"),
        (8, 3, 1, 4, "multiple of num_key_value_heads"),
    ],
)
def test_gqa_sharding_validation(nq: int, nkv: int, kv: int, tp: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        validate_gqa_sharding(nq, nkv, kv, tp)
    validate_gqa_sharding(32, 8, 4, 32)  # NxDT llama3-8B: 8 KV heads x 4 / TP 32


def test_layer_argument_errors() -> None:
    with pytest.raises(ValueError, match="gather_output"):
        ColumnParallelLinear(H, 4, gather_output=True, sequence_parallel_enabled=True)
    with pytest.raises(ValueError, match="input_is_parallel"):
        RowParallelLinear(H, 4, input_is_parallel=False, sequence_parallel_enabled=True)
    with pytest.raises(ValueError, match="target shape"):
        parallel_cross_entropy(torch.zeros(2, 3, 5), torch.zeros(2, 4, dtype=torch.long))
