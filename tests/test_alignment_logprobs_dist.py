"""Sequence log-probs from vocab-parallel logits: single-process reference, TP=2 and CP=2 (gloo) equal the full
computation in values AND in gradients w.r.t. the logits (through a DPO loss, so the gradient is non-trivial)."""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_distributed

from nxd_lc.alignment import dpo_loss, mean_log_probs, sequence_log_probs, split_chosen_rejected
from nxd_lc.context import shard_batch_for_context_parallel
from nxd_lc.distributed import parallel_state

B, S, V = 4, 8, 12  # 2 preference pairs (chosen rows 0-1, rejected rows 2-3)


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Full logits [B, S, V] fp32, labels [B, S] with prompt/padding positions at -100, ref log-probs [B]."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(B, S, V, generator=g) * 3.0
    labels = torch.randint(0, V, (B, S), generator=g)
    prompt = torch.tensor([2, 3, 1, 5])  # first tokens of each row carry no label
    labels[torch.arange(S).unsqueeze(0) < prompt.unsqueeze(1)] = -100
    labels[1, -2:] = -100  # right padding
    ref = -torch.rand(B, generator=g) * 20.0
    return logits, labels, ref


def _reference(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """log_softmax over the whole vocab, gathered at the labels, summed over labelled tokens (float64)."""
    logp = torch.log_softmax(logits.double(), dim=-1)
    valid = labels != -100
    token = logp.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (token * valid).sum(dim=1), valid.sum(dim=1)


def _dpo_of(sum_logps: torch.Tensor, num_tokens: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """A DPO (sigmoid + sft) loss of the per-sequence log-probs: a non-linear function of every row."""
    pc, pr = split_chosen_rejected(sum_logps.float())
    rc, rr = split_chosen_rejected(ref)
    nll = -split_chosen_rejected(mean_log_probs(sum_logps.float(), num_tokens))[0]
    return dpo_loss(pc, pr, rc, rr, beta=0.3, loss_type=["sigmoid", "sft"], chosen_nll=nll, sft_loss_weight=0.5)[0]


def _reference_grad() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    logits, labels, ref = _inputs()
    leaf = logits.clone().requires_grad_()
    sums, counts = _reference(leaf, labels)
    _dpo_of(sums, counts, ref).backward()
    return sums.detach(), counts, leaf.grad.double()


@pytest.mark.compat
def test_single_process_matches_log_softmax_and_gradients() -> None:
    logits, labels, ref = _inputs()
    leaf = logits.clone().requires_grad_()
    sums, counts = sequence_log_probs(leaf, labels)
    ref_sums, ref_counts, ref_grad = _reference_grad()
    assert sums.dtype == torch.float32 and counts.dtype == torch.int64 and sums.shape == (B,)
    torch.testing.assert_close(sums.double(), ref_sums, rtol=1e-5, atol=1e-5)
    assert counts.tolist() == ref_counts.tolist() == [6, 3, 7, 3]
    _dpo_of(sums, counts, ref).backward()
    torch.testing.assert_close(leaf.grad.double(), ref_grad, rtol=1e-4, atol=1e-6)
    assert (leaf.grad[labels == -100] == 0).all()  # unlabelled positions get no gradient


def test_bf16_logits_and_fully_masked_row() -> None:
    logits, labels, _ = _inputs()
    labels[0] = -100
    sums, counts = sequence_log_probs(logits.bfloat16(), labels)
    ref_sums, _ = _reference(logits.bfloat16().float(), labels)
    torch.testing.assert_close(sums.double(), ref_sums, rtol=1e-5, atol=1e-4)
    assert sums[0].item() == 0.0 and counts[0].item() == 0 and mean_log_probs(sums, counts)[0].item() == 0.0


def test_input_errors() -> None:
    logits, labels, _ = _inputs()
    with pytest.raises(ValueError, match=r"\[B, S, V/tp\]"):
        sequence_log_probs(logits[0], labels[0])
    with pytest.raises(ValueError, match="target shape"):
        sequence_log_probs(logits, labels[:, :-1])
    with pytest.raises(ValueError, match="integer"):
        sequence_log_probs(logits, labels.float())
    with pytest.raises(ValueError, match="chosen rows then rejected"):
        split_chosen_rejected(torch.zeros(3))
    with pytest.raises(ValueError, match="same shape"):
        mean_log_probs(torch.zeros(2), torch.ones(3, dtype=torch.long))


def _tp_worker(rank: int, world: int) -> None:
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    logits, labels, ref = _inputs()
    ref_sums, ref_counts, ref_grad = _reference_grad()
    vocab_local = V // world  # this rank's slice of the vocab-parallel lm head output
    local = logits[..., rank * vocab_local:(rank + 1) * vocab_local].clone().requires_grad_()
    sums, counts = sequence_log_probs(local, labels)
    torch.testing.assert_close(sums.double(), ref_sums, rtol=1e-5, atol=1e-5)
    assert counts.tolist() == ref_counts.tolist()
    _dpo_of(sums, counts, ref).backward()
    expected = ref_grad[..., rank * vocab_local:(rank + 1) * vocab_local]
    torch.testing.assert_close(local.grad.double(), expected, rtol=1e-4, atol=1e-6)


def _cp_worker(rank: int, world: int) -> None:
    parallel_state.initialize_model_parallel(context_parallel_size=world)
    for algo in ("ring", "ulysses"):
        _cp_check(world, algo)


def _cp_check(world: int, algo: str) -> None:
    cp_rank = parallel_state.get_context_parallel_rank()
    logits, labels, ref = _inputs()
    ref_sums, ref_counts, ref_grad = _reference_grad()
    shard = shard_batch_for_context_parallel({"logits": logits, "labels": labels, "grad": ref_grad}, cp_rank,
                                             world, algo)
    local = shard["logits"].clone().requires_grad_()
    partial, partial_counts = sequence_log_probs(local, shard["labels"], reduce_context_parallel=False)
    assert partial_counts.sum() < ref_counts.sum()  # a shard holds only part of every sequence
    sums, counts = sequence_log_probs(local, shard["labels"])
    torch.testing.assert_close(sums.double(), ref_sums, rtol=1e-5, atol=1e-5)
    assert counts.tolist() == ref_counts.tolist()
    _dpo_of(sums, counts, ref).backward()  # replicated loss; identity backward of the CP all-reduce
    torch.testing.assert_close(local.grad.double(), shard["grad"], rtol=1e-4, atol=1e-6)


def _tp_cp_worker(rank: int, world: int) -> None:
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2, context_parallel_size=2)
    tp_rank, cp_rank = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_context_parallel_rank()
    logits, labels, ref = _inputs()
    ref_sums, _, ref_grad = _reference_grad()
    shard = shard_batch_for_context_parallel({"logits": logits, "labels": labels, "grad": ref_grad}, cp_rank, 2,
                                             "ring")
    cols = slice(tp_rank * V // 2, (tp_rank + 1) * V // 2)
    local = shard["logits"][..., cols].clone().requires_grad_()
    sums, counts = sequence_log_probs(local, shard["labels"])
    torch.testing.assert_close(sums.double(), ref_sums, rtol=1e-5, atol=1e-5)
    _dpo_of(sums, counts, ref).backward()
    torch.testing.assert_close(local.grad.double(), shard["grad"][..., cols], rtol=1e-4, atol=1e-6)


@pytest.mark.distributed
def test_tp2_log_probs_and_gradients_match_single_process() -> None:
    run_distributed(_tp_worker, 2)


@pytest.mark.compat
@pytest.mark.distributed
def test_cp2_ring_and_ulysses_log_probs_and_gradients_match_single_process() -> None:
    run_distributed(_cp_worker, 2)


@pytest.mark.distributed
@pytest.mark.slow
def test_tp2_cp2_log_probs_and_gradients_match_single_process() -> None:
    run_distributed(_tp_cp_worker, 4)
