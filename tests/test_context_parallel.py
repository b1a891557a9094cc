"""Context parallelism: batch sharding layout, ring and Ulysses attention (forward and backward against full
attention), and a tiny Llama trained one step at CP=2 (ring, Ulysses) and TP=2 x CP=2 with sequence parallelism,
compared with a single-process run on the full sequence (loss and every parameter gradient). The end-to-end
step goes through the LightningModule's ``training_step`` (batch sharding at the step boundary, CP loss
normalisation) and ``on_before_optimizer_step`` (the gradient reductions).
"""

from __future__ import annotations

import math

import pytest
import torch
from dist_utils import local_shard, run_distributed
from transformers import LlamaConfig

from nxd_lc.config.schema import NxdConfig
from nxd_lc.context import (
    context_parallel_attention,
    context_parallel_loss,
    local_chunk_ranges,
    local_global_positions,
    ring_attention,
    set_context_parallel_algo,
    shard_batch_for_context_parallel,
    ulysses_kv_replication,
)
from nxd_lc.distributed import collectives, parallel_state
from nxd_lc.lightning.module import NxDLanguageModel
from nxd_lc.models.llama import LlamaForCausalLM

ATOL = 1e-5
VOCAB, B, S = 64, 2, 16
DOCS = [[5, 7, 4], [16]]  # packed document lengths per row (sum = S)


# ---- helpers ----------------------------------------------------------------------------------------------------
def _reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seg: torch.Tensor | None) -> torch.Tensor:
    """Explicit full causal (and same-document) attention; q [B,Hq,S,D], k/v [B,Hkv,S,D]."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    n = q.shape[2]
    allowed = torch.ones(n, n, dtype=torch.bool).tril()[None, None]
    if seg is not None:
        allowed = allowed & (seg[:, :, None] == seg[:, None, :])[:, None]
    scores = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def _segments(docs: list[list[int]]) -> torch.Tensor:
    """[B, S] int32 document index of each token."""
    return torch.stack([torch.cat([torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(row)]) for row in docs])


def _positions(docs: list[list[int]]) -> torch.Tensor:
    """[B, S] int64 positions reset at each document."""
    return torch.stack([torch.cat([torch.arange(n) for n in row]) for row in docs])


def _shard_dim(x: torch.Tensor, dim: int, rank: int, cp: int, algo: str) -> torch.Tensor:
    """This CP rank's share of ``x`` along ``dim`` (same layout as shard_batch_for_context_parallel)."""
    ranges = local_chunk_ranges(x.shape[dim], rank, cp, algo)
    return torch.cat([x.narrow(dim, a, b - a) for a, b in ranges], dim=dim)


# ---- sharding (single process) ----------------------------------------------------------------------------------
def test_ring_and_ulysses_layouts() -> None:
    assert local_chunk_ranges(16, 0, 2, "ring") == [(0, 4), (12, 16)]
    assert local_chunk_ranges(16, 1, 2, "ring") == [(4, 8), (8, 12)]
    assert [local_chunk_ranges(16, r, 4, "ring") for r in range(4)] == [
        [(0, 2), (14, 16)], [(2, 4), (12, 14)], [(4, 6), (10, 12)], [(6, 8), (8, 10)]]
    assert [local_chunk_ranges(12, r, 3, "ulysses") for r in range(3)] == [[(0, 4)], [(4, 8)], [(8, 12)]]
    assert local_chunk_ranges(10, 0, 1, "ring") == [(0, 10)]
    assert local_global_positions(16, 1, 4, "ring").tolist() == [2, 3, 12, 13]


@pytest.mark.parametrize("algo", ["ring", "ulysses"])
def test_shard_batch_covers_every_token_once_and_positions_follow(algo: str) -> None:
    ids = torch.arange(B * S).reshape(B, S)
    labels = torch.cat([ids[:, 1:], torch.full((B, 1), -100)], dim=1)  # shifted before sharding
    batch = {"input_ids": ids, "labels": labels, "position_ids": _positions(DOCS), "segment_ids": _segments(DOCS),
             "meta": "kept", "scalar": torch.tensor(3)}
    cp = 4 if algo == "ring" else 2
    shards = [shard_batch_for_context_parallel(batch, r, cp, algo) for r in range(cp)]
    order = torch.cat([local_global_positions(S, r, cp, algo) for r in range(cp)])
    assert sorted(order.tolist()) == list(range(S))  # every global token exactly once
    for key in ("input_ids", "labels", "position_ids", "segment_ids"):
        local = torch.cat([s[key] for s in shards], dim=1)
        assert local.shape == (B, S) and local.dtype == batch[key].dtype
        assert torch.equal(local, batch[key][:, order]), key  # tokens, targets, RoPE positions stay aligned
    for r, shard in enumerate(shards):
        assert shard["input_ids"].shape == (B, S // cp)
        assert shard["meta"] == "kept" and shard["scalar"] is batch["scalar"]
        pos = local_global_positions(S, r, cp, algo)
        assert torch.equal(shard["labels"], labels[:, pos])  # no target lost at a chunk edge
    assert shard_batch_for_context_parallel(batch, 0, 1, "ring")["input_ids"] is ids


def test_shard_errors_name_the_key() -> None:
    batch = {"input_ids": torch.zeros(1, 12, dtype=torch.long)}
    with pytest.raises(ValueError, match=r"data\.seq_length.*2 x context_parallel_size = 8"):
        shard_batch_for_context_parallel(batch, 0, 4, "ring")
    with pytest.raises(ValueError, match=r"data\.seq_length.*context_parallel_size = 5"):
        shard_batch_for_context_parallel({"input_ids": torch.zeros(1, 12)}, 0, 5, "ulysses")
    with pytest.raises(ValueError, match="context_parallel_algo"):
        shard_batch_for_context_parallel(batch, 0, 2, "zigzag")
    with pytest.raises(ValueError, match="disagree on the sequence length"):
        shard_batch_for_context_parallel({"input_ids": torch.zeros(1, 12), "labels": torch.zeros(1, 8)}, 0, 2, "ring")
    with pytest.raises(ValueError, match="context_parallel_algo"):
        set_context_parallel_algo("Ring")


def test_ulysses_kv_replication_and_head_error() -> None:
    assert ulysses_kv_replication(4, 2, 2) == 1
    assert ulysses_kv_replication(4, 1, 2) == 2
    assert ulysses_kv_replication(8, 2, 4) == 2
    assert ulysses_kv_replication(12, 4, 6) == 3
    with pytest.raises(ValueError, match=r"num_attention_heads.*context_parallel_size \(2\)"):
        ulysses_kv_replication(3, 1, 2)
    with pytest.raises(ValueError, match="num_attention_heads / tensor_model_parallel_size"):
        ulysses_kv_replication(6, 2, 4)


@pytest.mark.compat
@pytest.mark.parametrize("with_segments", [False, True])
def test_ring_kernel_single_rank_tiles(with_segments: bool) -> None:
    """CP size 1: the tiled fp32 kernel alone (tile 3 over S=16: partial and skipped tiles) vs full attention."""
    torch.manual_seed(0)
    q, k, v = torch.randn(B, 4, S, 8), torch.randn(B, 2, S, 8), torch.randn(B, 2, S, 8)
    seg = _segments(DOCS) if with_segments else None
    grad = torch.randn(B, 4, S, 8)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = ring_attention(*leaves, segment_ids=seg, tile_size=3)
    out.backward(grad)
    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = _reference_attention(*ref_leaves, seg)
    ref.backward(grad)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)
    for ours, theirs in zip(leaves, ref_leaves):
        torch.testing.assert_close(ours.grad, theirs.grad, atol=ATOL, rtol=0)


def test_context_parallel_loss_without_cp_is_the_mean() -> None:
    loss = context_parallel_loss(torch.tensor(6.0), torch.tensor(4))
    assert loss.item() == pytest.approx(1.5)
    assert context_parallel_loss(torch.tensor(0.0), torch.tensor(0)).item() == 0.0


# ---- attention at CP > 1 (gloo) ---------------------------------------------------------------------------------
def _attention_checks(world: int, cases: list[dict]) -> None:
    """Each case's CP attention (forward, dq/dk/dv) vs full attention; CP = world, parallel state initialised."""
    cp_rank = parallel_state.get_context_parallel_rank()
    for case in cases:
        torch.manual_seed(case.get("seed", 0))
        hq, hkv, algo = case["hq"], case["hkv"], case["algo"]
        q, k, v = torch.randn(B, hq, S, 8), torch.randn(B, hkv, S, 8), torch.randn(B, hkv, S, 8)
        grad = torch.randn(B, hq, S, 8)
        seg = _segments(DOCS) if case["segments"] else None
        ref_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = _reference_attention(*ref_leaves, seg)
        ref.backward(grad)
        local = [_shard_dim(t, 2, cp_rank, world, algo).requires_grad_() for t in (q, k, v)]
        local_seg = None if seg is None else _shard_dim(seg, 1, cp_rank, world, algo)
        if "tile" in case:
            out = ring_attention(*local, segment_ids=local_seg, tile_size=case["tile"])
        else:
            out = context_parallel_attention(*local, segment_ids=local_seg, scale=None, algo=algo)
        out.backward(_shard_dim(grad, 2, cp_rank, world, algo))
        msg = str(case)
        torch.testing.assert_close(out, _shard_dim(ref.detach(), 2, cp_rank, world, algo), atol=ATOL, rtol=0, msg=msg)
        for name, ours, theirs in zip("qkv", local, ref_leaves):
            expected = _shard_dim(theirs.grad, 2, cp_rank, world, algo)
            torch.testing.assert_close(ours.grad, expected, atol=ATOL, rtol=0, msg=f"d{name} {msg}")
    with pytest.raises(ValueError, match="context_parallel_size"):  # 3 query heads over CP 2 (or 4)
        context_parallel_attention(torch.randn(1, 3, 4, 8), torch.randn(1, 1, 4, 8), torch.randn(1, 1, 4, 8),
                                   segment_ids=None, scale=None, algo="ulysses")


_CP2_CASES = [
    {"algo": "ring", "hq": 4, "hkv": 2, "segments": False},
    {"algo": "ring", "hq": 4, "hkv": 2, "segments": True},
    {"algo": "ring", "hq": 4, "hkv": 1, "segments": True, "tile": 3, "seed": 1},  # GQA 4:1, multi-tile chunks
    {"algo": "ulysses", "hq": 4, "hkv": 2, "segments": False},
    {"algo": "ulysses", "hq": 4, "hkv": 2, "segments": True},
    {"algo": "ulysses", "hq": 4, "hkv": 1, "segments": True, "seed": 2},  # KV heads < CP: replicated
]


_CP4_CASES = [
    {"algo": "ring", "hq": 4, "hkv": 2, "segments": True},
    {"algo": "ring", "hq": 2, "hkv": 2, "segments": False, "tile": 3},
    {"algo": "ulysses", "hq": 4, "hkv": 2, "segments": True},  # 2 KV heads over CP 4: replicated x2
]


# ---- end to end: tiny Llama, one step -------------------------------------------------------------------------
def _tiny_config() -> LlamaConfig:
    return LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                       rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)


def _batches() -> dict[str, dict[str, torch.Tensor]]:
    """A document-packed batch (per-document positions, segment ids) and a cross-document one (no segments)."""
    torch.manual_seed(7)
    ids = torch.randint(0, VOCAB, (B, S))
    labels = torch.cat([ids[:, 1:], torch.full((B, 1), -100)], dim=1)
    labels[0, 4] = labels[0, 11] = -100  # document ends in row 0
    labels[1, :3] = -100
    packed = {"input_ids": ids, "labels": labels, "position_ids": _positions(DOCS), "segment_ids": _segments(DOCS)}
    plain = {"input_ids": ids, "labels": labels, "position_ids": torch.arange(S).expand(B, S).contiguous()}
    return {"packed": packed, "plain": plain}


def _step(model: LlamaForCausalLM, batch: dict[str, torch.Tensor], algo: str = "ring") -> torch.Tensor:
    """One micro-batch through the LightningModule: ``training_step`` on the FULL batch (it shards over CP and
    normalises the loss), backward, and its gradient reductions; returns the DP x CP mean of the step loss."""
    cfg = NxdConfig()
    cfg.distributed_strategy.context_parallel_algo = algo
    module = NxDLanguageModel(cfg, model)
    loss = module.training_step(batch, 0)
    loss.backward()
    module.on_before_optimizer_step(None)  # SP norms over TP, KV replicas, then the DP x CP mean
    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    return collectives.all_reduce(loss.detach().clone(), group, op="avg")


def _reference(config: LlamaConfig) -> dict[str, object]:
    """Single-process full-sequence loss and gradients for each batch, plus the full weights."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    refs = {}
    for key, batch in _batches().items():
        model.zero_grad()
        loss = _step(model, batch)
        refs[key] = {"loss": loss, "grads": {n: p.grad.clone() for n, p in model.named_parameters()}}
    return {"weights": weights, "refs": refs}


def _e2e_checks(tp: int, algos: list[str], config: LlamaConfig, ref: dict) -> None:
    """One training step per algo and batch vs the single-process reference; parallel state initialised."""
    for algo in algos:
        set_context_parallel_algo(algo)
        for key, batch in _batches().items():
            model = LlamaForCausalLM(config, sequence_parallel=tp > 1)
            with torch.no_grad():
                for name, param in model.named_parameters():
                    param.copy_(local_shard(model, name, ref["weights"][name]))
            loss = _step(model, batch, algo)
            expected = ref["refs"][key]
            msg = f"{algo} {key} tp={tp}"
            torch.testing.assert_close(loss, expected["loss"], atol=ATOL, rtol=0, msg=msg)
            for name, param in model.named_parameters():
                want = local_shard(model, name, expected["grads"][name])
                torch.testing.assert_close(param.grad, want, atol=ATOL, rtol=0, msg=f"{msg} grad {name}")
    set_context_parallel_algo("ulysses" if algos[-1] == "ring" else "ring")
    with pytest.raises(RuntimeError, match="set_context_parallel_algo"):  # startup call missing / inconsistent
        _step(LlamaForCausalLM(config, sequence_parallel=tp > 1), _batches()["plain"], algos[-1])


def _worker(rank: int, world: int, cases: list[dict], tp: int, algos: list[str], config: LlamaConfig,
            ref: dict) -> None:
    """Attention checks at CP = world, then the Llama step at TP = tp x CP = world / tp (one spawn for both)."""
    parallel_state.initialize_model_parallel(context_parallel_size=world)
    _attention_checks(world, cases)
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=world // tp)
    _e2e_checks(tp, algos, config, ref)


@pytest.mark.compat
@pytest.mark.distributed
def test_cp2_attention_and_llama_step_match_single_process() -> None:
    """CP=2 (2 processes): ring and Ulysses attention vs full attention; a Llama step with each vs one process."""
    config = _tiny_config()
    run_distributed(_worker, 2, _CP2_CASES, 1, ["ring", "ulysses"], config, _reference(config))


@pytest.mark.distributed
@pytest.mark.slow
def test_cp4_attention_and_tp2_cp2_sequence_parallel_llama_step_match_single_process() -> None:
    """4 processes: ring/Ulysses attention at CP=4; a Llama step at TP=2 x CP=2 with SP (ring) vs one process."""
    config = _tiny_config()
    run_distributed(_worker, 4, _CP4_CASES, 2, ["ring"], config, _reference(config))
