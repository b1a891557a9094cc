"""Document-masked packing and attention dispatch (issue 3, item 2).

* packing ids: position reset at each document, segment ids, a row starting mid-document, the
  ``cross_document_attention`` switch, EOS labels;
* core_attention: the per-document SDPA path equals the eager block-diagonal reference (outputs and grads);
* the Llama model on a packed batch with 3 documents equals running each document alone (logits and every
  parameter gradient, fp32, 1e-5) for ``flash_attention`` True and False; cross-document attention equals plain
  causal attention;
* the flash path never allocates an [S, S]-sized tensor (S = 4096), and takes torch's flash kernel;
* TP=2 + sequence parallel on 2 gloo processes equals the single-process run on the same packed batch.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from dist_utils import local_shard, run_distributed
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers import LlamaConfig

from nxd_lc.config.schema import DataConfig, TokenizerConfig
from nxd_lc.context.attention import core_attention
from nxd_lc.context.local import document_lengths
from nxd_lc.data.datamodule import PretrainingDataModule, collate_packed
from nxd_lc.data.packing import pack_token_stream, packed_document_ids
from nxd_lc.distributed import collectives, parallel_state
from nxd_lc.distributed.grads import allreduce_kv_replica_gradients, allreduce_sequence_parallel_gradients
from nxd_lc.models.common.loss import causal_lm_loss
from nxd_lc.models.llama import LlamaForCausalLM

pytestmark = pytest.mark.compat  # torch-2.9 compatibility subset (lane 2; docs/testing.md)

EOS, VOCAB, S = 0, 96, 16
ATOL = 1e-5


def _tiny_config() -> LlamaConfig:
    return LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                       rms_norm_eps=1e-5, rope_theta=10000.0)


def _packed_batch(cross_document_attention: bool = False) -> dict[str, torch.Tensor]:
    """Two rows of S=16: row 0 holds documents of 7, 5 and (the first 4 tokens of) 8 tokens; row 1 starts in
    the middle of that third document, then a 5-token document, then the start of a third one."""
    rng = np.random.default_rng(0)
    docs = [rng.integers(1, VOCAB, n) for n in (6, 4, 7, 4, 9)]  # + EOS each: 7, 5, 8, 5, 10 tokens
    samples, _ = pack_token_stream(docs, seq_length=S, eos_id=EOS)
    return collate_packed([samples[0], samples[1]], eos_id=EOS, cross_document_attention=cross_document_attention)


# ---- packing ids ---------------------------------------------------------------------------------------------
def test_packed_document_ids_reset_positions_and_number_documents() -> None:
    ids = torch.tensor([[5, 6, EOS, 7, 8, EOS, 9, 1],     # three documents, the last one cut
                        [3, EOS, 4, 4, 4, 4, 4, 4],       # starts mid-document (position 0), then one more
                        [EOS, 2, 3, EOS, EOS, 2, 2, 2],   # a lone EOS ends the previous sample's document
                        [1, 2, 3, 4, 5, 6, 7, 8]])        # no EOS: one document
    pos, seg = packed_document_ids(ids, EOS)
    assert pos.dtype == torch.long and seg.dtype == torch.int32
    assert pos.tolist() == [[0, 1, 2, 0, 1, 2, 0, 1], [0, 1, 0, 1, 2, 3, 4, 5],
                            [0, 0, 1, 2, 0, 0, 1, 2], list(range(8))]
    assert seg.tolist() == [[0, 0, 0, 1, 1, 1, 2, 2], [0, 0, 1, 1, 1, 1, 1, 1],
                            [0, 1, 1, 1, 2, 3, 3, 3], [0] * 8]
    assert document_lengths(seg) == [[3, 3, 2], [2, 6], [1, 3, 1, 3], [8]]
    with pytest.raises(ValueError, match="integer"):
        packed_document_ids(ids.float(), EOS)


def test_collate_cross_document_flag_and_eos_labels() -> None:
    masked, causal = _packed_batch(False), _packed_batch(True)
    for batch in (masked, causal):
        assert set(batch) == {"input_ids", "labels", "position_ids", "segment_ids"}
        assert all(v.shape == (2, S) for v in batch.values())
        assert batch["segment_ids"].dtype == torch.int32 and batch["labels"].dtype == torch.long
    torch.testing.assert_close(masked["input_ids"], causal["input_ids"])
    # documents of 7, 5, 8 tokens: row 0 = 7 + 5 + 4, row 1 = the other 4 of the third, 5, then 7 of the next
    assert masked["segment_ids"].tolist() == [[0] * 7 + [1] * 5 + [2] * 4, [0] * 4 + [1] * 5 + [2] * 7]
    assert masked["position_ids"].tolist() == [[*range(7), *range(5), *range(4)], [*range(4), *range(5), *range(7)]]
    assert causal["position_ids"].tolist() == [list(range(S))] * 2
    assert not causal["segment_ids"].any()
    is_eos = masked["input_ids"] == EOS
    assert is_eos.sum() == 4 and bool((masked["labels"][is_eos] == -100).all())
    torch.testing.assert_close(masked["labels"][~is_eos], causal["labels"][~is_eos])
    assert bool((causal["labels"][:, :-1] == causal["input_ids"][:, 1:]).all())
    plain = collate_packed([np.arange(S + 1)], eos_id=None)  # no separator known: one document per row
    assert plain["position_ids"].tolist() == [list(range(S))] and not plain["segment_ids"].any()


@pytest.mark.parametrize("cross_document_attention", [False, True])
def test_datamodule_batches_follow_the_config_flag(tmp_path, cross_document_attention: bool) -> None:
    for i in range(6):
        (tmp_path / "corpus").mkdir(exist_ok=True)
        (tmp_path / "corpus" / f"f{i}.txt").write_text(f"doc {i} " + "words and more words " * (i + 1))
    cfg = DataConfig(micro_batch_size=2, global_batch_size=2, train_dir=str(tmp_path / "corpus"), val_fraction=0.0,
                     cross_document_attention=cross_document_attention,
                     tokenizer=TokenizerConfig(type="bytelevel_bpe", vocab_size=300, cache_dir=str(tmp_path / "c")))
    dm = PretrainingDataModule(cfg, seq_length=32, seed=1, model_vocab_size=320, data_parallel_rank=0,
                               data_parallel_size=1, global_batch_size=2)
    dm.setup("fit")
    batches = [b for _, b in zip(range(3), dm.train_dataloader())]
    ids = torch.cat([b["input_ids"] for b in batches])
    seg = torch.cat([b["segment_ids"] for b in batches])
    pos = torch.cat([b["position_ids"] for b in batches])
    assert bool((ids == dm.eos_token_id).any())
    if cross_document_attention:
        assert not seg.any() and pos.tolist() == [list(range(32))] * len(ids)
    else:
        expected_pos, expected_seg = packed_document_ids(ids, dm.eos_token_id)
        assert seg.tolist() == expected_seg.tolist() and pos.tolist() == expected_pos.tolist()
        assert bool(seg.any())


# ---- core attention ------------------------------------------------------------------------------------------
def _sdpa_per_document(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seg: torch.Tensor) -> torch.Tensor:
    """Reference: each document of each row alone through eager causal attention."""
    rows = []
    for b, lengths in enumerate(document_lengths(seg)):
        parts = zip(*(t[b:b + 1].split(lengths, dim=2) for t in (q, k, v)))
        rows.append(torch.cat([core_attention(*p, flash_attention=False) for p in parts], dim=2))
    return torch.cat(rows, dim=0)


@pytest.mark.parametrize("same_rows", [True, False])
def test_core_attention_document_mask_matches_per_document(same_rows: bool) -> None:
    torch.manual_seed(0)
    seg = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2, 2], [0, 1, 1, 1, 1, 1, 1, 3, 3, 3]], dtype=torch.int32)
    if same_rows:
        seg = seg[:1].repeat(2, 1)
    q = torch.randn(2, 4, 10, 8, requires_grad=True)
    k, v = (torch.randn(2, 2, 10, 8, requires_grad=True) for _ in range(2))
    grad_out = torch.randn(2, 4, 10, 8)
    results = []
    for fn in (lambda: core_attention(q, k, v, segment_ids=seg),
               lambda: core_attention(q, k, v, segment_ids=seg, flash_attention=False),
               lambda: _sdpa_per_document(q, k, v, seg)):
        out = fn()
        grads = torch.autograd.grad(out, (q, k, v), grad_out)
        results.append((out, *grads))
    for got in results[:2]:
        for a, b in zip(got, results[2]):
            # fp32 summation order differs between the masked and the per-document kernels: up to 1.5e-6 measured
            # on an AVX-512 machine (2026-11-27); the masked-vs-causal check below is what the mask must change
            torch.testing.assert_close(a, b, atol=5e-6, rtol=0)
    causal = core_attention(q, k, v)
    assert not torch.allclose(results[0][0], causal)  # the mask does something
    torch.testing.assert_close(core_attention(q, k, v, segment_ids=torch.zeros_like(seg)), causal)


def test_core_attention_rejects_bad_segment_ids() -> None:
    q, k = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="non-decreasing.*row 0 goes from 1 to 0 at position 2"):
        core_attention(q, k, k, segment_ids=torch.tensor([[0, 1, 0, 0]]))
    with pytest.raises(ValueError, match=r"segment_ids must be \[B, S\]"):
        core_attention(q, k, k, segment_ids=torch.zeros(1, 5, dtype=torch.int32))
    with pytest.raises(ValueError, match="integer"):
        core_attention(q, k, k, segment_ids=torch.zeros(1, 4))


# ---- the model on packed batches -----------------------------------------------------------------------------
def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _packed_run(model: LlamaForCausalLM, batch: dict[str, torch.Tensor],
                with_segments: bool = True) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """(logits, loss_sum, grads) of one packed forward/backward."""
    model.zero_grad()
    logits = model(batch["input_ids"], batch["position_ids"], batch["segment_ids"] if with_segments else None)
    loss_sum, _ = causal_lm_loss(logits, batch["labels"])
    loss_sum.backward()
    return logits.detach(), loss_sum.detach(), _grads(model)


def _per_document_run(model: LlamaForCausalLM,
                      batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Each document alone (default positions 0..n-1, no segment ids); logits pasted back, losses summed."""
    model.zero_grad()
    logits = torch.empty(2, S, VOCAB)
    total = torch.zeros(())
    for b, lengths in enumerate(document_lengths(batch["segment_ids"])):
        start = 0
        for n in lengths:
            doc_logits = model(batch["input_ids"][b:b + 1, start:start + n])
            loss_sum, _ = causal_lm_loss(doc_logits, batch["labels"][b:b + 1, start:start + n])
            loss_sum.backward()
            logits[b, start:start + n] = doc_logits[0].detach()
            total += loss_sum.detach()
            start += n
    return logits, total, _grads(model)


def _assert_runs_equal(a: tuple, b: tuple, atol: float = ATOL) -> None:
    torch.testing.assert_close(a[0], b[0], atol=atol, rtol=0, msg="logits")
    torch.testing.assert_close(a[1], b[1], atol=atol, rtol=0, msg="loss")
    assert a[2].keys() == b[2].keys()
    for name in a[2]:
        torch.testing.assert_close(a[2][name], b[2][name], atol=atol, rtol=0, msg=name)


@pytest.mark.parametrize("flash_attention", [True, False])
def test_packed_batch_equals_each_document_alone(flash_attention: bool) -> None:
    torch.manual_seed(0)
    model = LlamaForCausalLM(_tiny_config(), flash_attention=flash_attention)
    batch = _packed_batch(cross_document_attention=False)
    packed = _packed_run(model, batch)
    _assert_runs_equal(packed, _per_document_run(model, batch))
    leaky = _packed_run(model, batch, with_segments=False)  # positions reset, but attention crosses documents
    assert not torch.allclose(leaky[0], packed[0], atol=1e-3)


@pytest.mark.parametrize("flash_attention", [True, False])
def test_cross_document_attention_equals_plain_causal(flash_attention: bool) -> None:
    torch.manual_seed(0)
    model = LlamaForCausalLM(_tiny_config(), flash_attention=flash_attention)
    batch = _packed_batch(cross_document_attention=True)
    model.zero_grad()
    logits = model(batch["input_ids"])
    loss_sum, _ = causal_lm_loss(logits, batch["labels"])
    loss_sum.backward()
    _assert_runs_equal(_packed_run(model, batch), (logits.detach(), loss_sum.detach(), _grads(model)), atol=0)


# ---- memory: no [S, S] tensor on the flash path --------------------------------------------------------------
class _LargestTensor(TorchDispatchMode):
    """Records the largest output (in elements) of every aten op run under it, and the op names."""

    def __init__(self) -> None:
        super().__init__()
        self.largest, self.ops = 0, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        self.ops.add(str(func.overloadpacket))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def _attention_largest(seq: int, flash_attention: bool, segment_ids: torch.Tensor | None) -> _LargestTensor:
    """Forward + backward of core_attention (B=1, 4 query / 2 KV heads, D=16) under the recorder."""
    torch.manual_seed(0)
    q = torch.randn(1, 4, seq, 16, requires_grad=True)
    k, v = (torch.randn(1, 2, seq, 16, requires_grad=True) for _ in range(2))
    with _LargestTensor() as rec:
        out = core_attention(q, k, v, flash_attention=flash_attention, segment_ids=segment_ids)
        out.sum().backward()
    return rec


@pytest.mark.parametrize("documents", [False, True])
def test_flash_path_allocates_no_seq_by_seq_tensor(documents: bool) -> None:
    seq = 4096
    seg = torch.repeat_interleave(torch.arange(3, dtype=torch.int32), torch.tensor([1000, 2000, 1096]))[None]
    rec = _attention_largest(seq, True, seg if documents else None)
    assert rec.largest <= 4 * seq * 16, rec.largest  # q/out-sized at most: 1/64 of S*S
    assert rec.largest < seq * seq // 16
    flash_ops = {"aten._scaled_dot_product_flash_attention_for_cpu",
                 "aten._scaled_dot_product_flash_attention_for_cpu_backward"}
    assert flash_ops <= rec.ops, sorted(rec.ops)  # torch's flash kernel, forward and backward
    # the recorder does see the eager reference's [B, H, S, S] scores
    small = 256
    eager = _attention_largest(small, False, seg[:, :small] if documents else None)
    assert eager.largest >= 4 * small * small


# ---- TP=2 + sequence parallel --------------------------------------------------------------------------------
def _tp_worker(rank: int, world: int, batch: dict[str, torch.Tensor], refs: dict[bool, tuple]) -> None:
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    group = parallel_state.get_tensor_model_parallel_group()
    for flash_attention, (ref_logits, ref_loss, ref_grads) in refs.items():
        torch.manual_seed(0)
        model = LlamaForCausalLM(_tiny_config(), sequence_parallel=True, flash_attention=flash_attention)
        logits, loss_sum, _ = _packed_run(model, batch)
        allreduce_sequence_parallel_gradients(model)
        allreduce_kv_replica_gradients(model)
        torch.testing.assert_close(collectives.all_gather(logits.contiguous(), -1, group), ref_logits,
                                   atol=ATOL, rtol=0)
        # a sum over ~100 tokens (~128): summed in another order than the reference, 1.5e-5 (1 ulp) apart here
        torch.testing.assert_close(loss_sum, ref_loss, atol=ATOL, rtol=1e-6)
        for name, param in model.named_parameters():
            torch.testing.assert_close(param.grad, local_shard(model, name, ref_grads[name]), atol=ATOL,
                                       rtol=0, msg=f"{name} (flash_attention={flash_attention})")


@pytest.mark.distributed
@pytest.mark.slow
def test_tp2_sequence_parallel_packed_batch_equals_single_process() -> None:
    batch = _packed_batch(cross_document_attention=False)
    refs = {}
    for flash_attention in (True, False):
        torch.manual_seed(0)
        refs[flash_attention] = _packed_run(LlamaForCausalLM(_tiny_config(), flash_attention=flash_attention),
                                            batch)
    run_distributed(_tp_worker, 2, batch, refs)
