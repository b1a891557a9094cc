"""Tiled cross-entropy, tiled MLP and activation checkpointing: same loss and gradients as the plain path
(single process and TP=2 + sequence parallelism on 2 gloo processes), NxDT checkpointing semantics and errors,
and the memory effect (peak live tensor bytes and the largest tensor, tracked op by op with a dispatch mode).
"""

from __future__ import annotations

import weakref
from typing import Any

import pytest
import torch
from dist_utils import run_distributed
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from transformers import LlamaConfig

from nxd_lc.config.schema import ModelConfig
from nxd_lc.distributed import parallel_state
from nxd_lc.distributed.grads import allreduce_kv_replica_gradients, allreduce_sequence_parallel_gradients
from nxd_lc.layers import parallel_cross_entropy
from nxd_lc.layers.tiled import tiled_apply, tiled_causal_lm_loss, tiled_cross_entropy, vocab_parallel_logits
from nxd_lc.models.common import attention
from nxd_lc.models.common.checkpointing import (
    apply_activation_checkpointing,
    apply_memory_techniques,
    recomputable_module_names,
)
from nxd_lc.models.common.mlp import LlamaMLP
from nxd_lc.models.llama import LlamaForCausalLM

pytestmark = pytest.mark.compat  # torch-2.9 compatibility subset (lane 2; docs/testing.md)

VOCAB, B, S = 97, 2, 16
# (label, model_cfg overrides): every technique alone and all together
VARIANTS: list[tuple[str, dict[str, Any]]] = [
    ("tiled_loss", {"tiled_loss_chunk_size": 5}),
    ("tiled_mlp", {"tiled_mlp_chunk_size": 3}),
    ("full", {"activations_checkpoint_granularity": "full"}),
    ("selective", {"activations_checkpoint_granularity": "selective",
                   "activations_checkpoint_recompute": ["CoreAttention", "LlamaMLP"]}),
    ("full_tiled_mlp", {"activations_checkpoint_granularity": "full", "tiled_mlp_chunk_size": 5}),
    ("full_save_attention", {"activations_checkpoint_granularity": "full", "tiled_mlp_chunk_size": 5,
                             "activations_checkpoint_save_attention": True, "tiled_loss_chunk_size": 7}),
    ("block_save_attention", {"activations_checkpoint_granularity": "full", "activations_checkpoint_method": "block",
                              "activations_checkpoint_num_layers": 1, "tiled_mlp_chunk_size": 5,
                              "activations_checkpoint_save_attention": True}),
    ("selective_save_attention", {"activations_checkpoint_granularity": "selective",
                                  "activations_checkpoint_recompute": ["LlamaAttention", "LlamaMLP"],
                                  "activations_checkpoint_save_attention": True}),
    ("full_offload", {"activations_checkpoint_granularity": "full", "tiled_mlp_chunk_size": 5,
                      "activations_offload": True}),
    ("full_save_attention_offload", {"activations_checkpoint_granularity": "full", "tiled_mlp_chunk_size": 5,
                                     "activations_checkpoint_save_attention": True, "activations_offload": True}),
    ("selective_tiled_mlp", {"activations_checkpoint_granularity": "selective", "tiled_mlp_chunk_size": 4,
                             "activations_checkpoint_recompute": ["LlamaMLP"]}),
    ("all", {"tiled_loss_chunk_size": 7, "tiled_mlp_chunk_size": 5, "activations_checkpoint_granularity": "selective",
             "activations_checkpoint_recompute": ["LlamaDecoderLayer", "CoreAttention", "LlamaMLP"]}),
]


def _config(**kw: Any) -> LlamaConfig:
    args: dict[str, Any] = {
        "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64, "rope_theta": 10000.0,
    }
    args.update(kw)
    return LlamaConfig(**args)


def _batch(seed: int = 0, vocab: int = VOCAB, b: int = B, s: int = S) -> dict[str, torch.Tensor]:
    """Two packed documents per row (split at s//3), position ids reset per document, some ignored labels."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (b, s), generator=g)
    labels = torch.cat([ids[:, 1:], torch.full((b, 1), -100)], dim=1)
    labels[0, :3] = -100
    cut = s // 3
    seg = (torch.arange(s) >= cut).to(torch.int32).expand(b, s).contiguous()
    pos = torch.cat([torch.arange(cut), torch.arange(s - cut)]).expand(b, s).contiguous()
    return {"input_ids": ids, "labels": labels, "position_ids": pos, "segment_ids": seg}


def _model(config: LlamaConfig, sp: bool = False, flash_attention: bool = True, **cfg: Any) -> LlamaForCausalLM:
    torch.manual_seed(1234)  # use_cpu_initialization: TP=2 shards of the same full weights as TP=1
    model = LlamaForCausalLM(config, sequence_parallel=sp, flash_attention=flash_attention)
    apply_memory_techniques(model, ModelConfig(**cfg))
    return model


def _step(model: LlamaForCausalLM, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Mean token loss and every parameter's local gradient (this TP rank's shard) after one backward."""
    model.zero_grad(set_to_none=True)
    loss_sum, num = model.loss(batch["input_ids"], batch["labels"], batch["position_ids"],
                               segment_ids=batch["segment_ids"])
    loss = loss_sum / num
    loss.backward()
    allreduce_sequence_parallel_gradients(model)
    allreduce_kv_replica_gradients(model)
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _assert_same(loss: torch.Tensor, grads: dict[str, torch.Tensor], ref: tuple[torch.Tensor, dict], atol: float,
                 label: str) -> None:
    torch.testing.assert_close(loss, ref[0], atol=atol, rtol=0, msg=f"{label}: loss")
    assert grads.keys() == ref[1].keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref[1][name], atol=atol, rtol=1e-5, msg=f"{label}: grad of {name}")


# ---- single process ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def reference() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    return _step(_model(_config()), _batch())


@pytest.mark.parametrize(("label", "cfg"), VARIANTS, ids=[v[0] for v in VARIANTS])
def test_technique_matches_plain_path(reference: tuple, label: str, cfg: dict[str, Any]) -> None:
    loss, grads = _step(_model(_config(), **cfg), _batch())
    _assert_same(loss, grads, reference, atol=1e-6, label=label)


@pytest.mark.parametrize("chunk", [1, 4, 13, 1000])
def test_tiled_cross_entropy_functions_match_untiled(chunk: int) -> None:
    """Loss sum (fused) and per-token (checkpointed) tiled CE vs parallel_cross_entropy, with padded vocab."""
    torch.manual_seed(0)
    hidden = torch.randn(2, 11, 8, requires_grad=True)
    weight = torch.randn(20, 8, requires_grad=True)  # 20 local columns, 17 real
    labels = torch.randint(0, 17, (2, 11))
    labels[1, 4:7] = -100
    per_tok = parallel_cross_entropy(vocab_parallel_logits(hidden, weight, 17), labels)
    g_out = torch.randn(2, 11)
    want_h, want_w = torch.autograd.grad((per_tok * g_out).sum(), (hidden, weight))
    tiled = tiled_cross_entropy(hidden, weight, labels, chunk_size=chunk, num_valid_vocab_local=17)
    torch.testing.assert_close(tiled, per_tok, atol=1e-6, rtol=0)
    got = torch.autograd.grad((tiled * g_out).sum(), (hidden, weight))
    for a, b in zip(got, (want_h, want_w)):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    total, num = tiled_causal_lm_loss(hidden, weight, labels, chunk_size=chunk, num_valid_vocab_local=17)
    assert num.item() == int((labels != -100).sum())
    torch.testing.assert_close(total, per_tok.sum(), atol=1e-5, rtol=0)
    got = torch.autograd.grad(total * 0.37, (hidden, weight))  # backward scales by the incoming gradient
    per_tok = parallel_cross_entropy(vocab_parallel_logits(hidden, weight, 17), labels)
    want = torch.autograd.grad(per_tok.sum() * 0.37, (hidden, weight))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    with torch.no_grad():
        torch.testing.assert_close(tiled_causal_lm_loss(hidden, weight, labels, chunk_size=chunk,
                                                        num_valid_vocab_local=17)[0], total, atol=1e-5, rtol=0)


def test_tiled_apply_matches_and_rejects_bad_chunk() -> None:
    torch.manual_seed(0)
    mlp = LlamaMLP(8, 12)
    x = torch.randn(3, 5, 8, requires_grad=True)
    want = torch.autograd.grad(mlp(x).pow(2).sum(), (x, *mlp.parameters()))
    mlp.tiled_chunk_size = 4
    y = mlp(x)
    assert y.shape == (3, 5, 8)
    got = torch.autograd.grad(y.pow(2).sum(), (x, *mlp.parameters()))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="model.tiled_mlp_chunk_size"):
            tiled_apply(mlp._local_mlp, x, bad, list(mlp.parameters()))
    with pytest.raises(ValueError, match="model.tiled_loss_chunk_size"):
        tiled_causal_lm_loss(x, torch.randn(4, 8), torch.zeros(3, 5, dtype=torch.long), chunk_size=0,
                             num_valid_vocab_local=4)
    with pytest.raises(ValueError, match="disagree"):
        tiled_causal_lm_loss(x, torch.randn(4, 8), torch.zeros(3, 4, dtype=torch.long), chunk_size=2,
                             num_valid_vocab_local=4)


def _count_core_attention(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts calls of ``core_attention`` in the returned dict's ``attn`` from now on (monkeypatched)."""
    calls = {"attn": 0}
    original = attention.core_attention

    def counting(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls["attn"] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(attention, "core_attention", counting)
    return calls


def test_checkpointing_recomputes_and_names(monkeypatch: pytest.MonkeyPatch) -> None:
    """'full' re-runs every layer in backward, 'selective' only the named modules; state dict is unchanged."""
    calls = _count_core_attention(monkeypatch)
    for granularity, recompute, expect in [(None, None, 2), ("full", None, 4), ("selective", ["CoreAttention"], 4),
                                           ("selective", ["LlamaMLP"], 2)]:
        model = _model(_config())
        keys = list(model.state_dict())
        names = apply_activation_checkpointing(model, granularity, recompute)
        assert list(model.state_dict()) == keys
        calls["attn"] = 0
        _step(model, _batch())
        assert calls["attn"] == expect, (granularity, recompute)
        if granularity == "full":
            assert names == ["layers.0", "layers.1"]
        if recompute == ["LlamaMLP"]:
            assert names == ["layers.0.mlp", "layers.1.mlp"]
            assert apply_activation_checkpointing(model, granularity, recompute) == []  # idempotent
    with torch.no_grad():  # no recomputation machinery without grad
        model(_batch()["input_ids"])


@pytest.mark.parametrize(("num_layers", "expect_names"), [(0, []), (1, ["layers.0"]), (2, ["layers.0", "layers.1"]),
                                                          (5, ["layers.0", "layers.1"])])
def test_block_method_checkpoints_the_first_layers(monkeypatch: pytest.MonkeyPatch, num_layers: int,
                                                   expect_names: list[str]) -> None:
    """activations_checkpoint_method 'block': only the first num_layers layers are recomputed (one attention call
    per layer in forward, one more per checkpointed layer in backward); more than the model has means all."""
    calls = _count_core_attention(monkeypatch)
    model = _model(_config())
    names = apply_activation_checkpointing(model, "full", None, method="block", num_layers=num_layers)
    assert names == expect_names
    _step(model, _batch())
    assert calls["attn"] == 2 + len(expect_names)


@pytest.mark.parametrize(("granularity", "recompute"), [("full", None), ("selective", ["LlamaMLP"]),
                                                       ("selective", ["LlamaDecoderLayer", "LlamaMLP"])])
def test_recomputation_skips_the_tiled_mlp_forward(monkeypatch: pytest.MonkeyPatch, granularity: str,
                                                   recompute: list[str] | None) -> None:
    """Checkpointing + tiled MLP: the chunk forwards run once in forward and once in the tiled backward, not a
    third time in the checkpoint's recomputation (whose MLP output is discarded); gradients stay the reference's
    (VARIANTS above)."""
    rows: list[int] = []
    original = LlamaMLP._local_mlp

    def counting(self: LlamaMLP, x: torch.Tensor) -> torch.Tensor:
        rows.append(x.shape[0])
        return original(self, x)

    monkeypatch.setattr(LlamaMLP, "_local_mlp", counting)
    model = _model(_config(), tiled_mlp_chunk_size=5, activations_checkpoint_granularity=granularity,
                   activations_checkpoint_recompute=recompute)
    _step(model, _batch())
    tokens, layers = B * S, 2
    assert sum(rows) == 2 * layers * tokens  # forward + tiled backward; the recomputation ran no rows
    assert rows.count(0) == layers  # the recomputation only asked for the output shape


class _KernelCount(TorchDispatchMode):
    """Counts calls of the CPU flash-attention forward kernel (the op SDPA dispatches to on CPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default:
            self.calls += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("segments", [False, True])
def test_save_attention_runs_the_attention_kernel_once(segments: bool) -> None:
    """Full checkpointing recomputes the attention kernel (2 forward calls per layer and document);
    activations_checkpoint_save_attention keeps its output (1 call), with the same gradients (VARIANTS)."""
    batch = _batch()
    docs = 2 if segments else 1  # _batch packs two documents per row: one SDPA call each (flash, eager)
    if not segments:
        batch = {**batch, "segment_ids": None, "position_ids": None}
    layers = 2
    for save, expect in ((False, 2 * layers * docs), (True, layers * docs)):
        model = _model(_config(), activations_checkpoint_granularity="full",
                       activations_checkpoint_save_attention=save)
        with _KernelCount() as count:
            _step(model, batch)
        assert count.calls == expect, (save, segments)


def test_checkpointing_errors_name_the_key() -> None:
    model = _model(_config())
    valid = recomputable_module_names(model)
    assert {"CoreAttention", "LlamaMLP", "LlamaAttention", "LlamaDecoderLayer", "RMSNorm"} <= set(valid)
    with pytest.raises(ValueError, match=r"activations_checkpoint_recompute.*'CoreAtention'.*CoreAttention"):
        apply_activation_checkpointing(model, "selective", ["CoreAtention"])
    with pytest.raises(ValueError, match="activations_checkpoint_recompute.*needs module class names"):
        apply_activation_checkpointing(model, "selective", [])
    with pytest.raises(ValueError, match="activations_checkpoint_granularity: unknown value 'layer'"):
        apply_activation_checkpointing(model, "layer", None)
    with pytest.raises(ValueError, match="'layers' ModuleList"):
        apply_activation_checkpointing(torch.nn.Linear(2, 2), "full", None)
    with pytest.raises(ValueError, match="model.tiled_mlp_chunk_size"):
        apply_memory_techniques(model, ModelConfig(tiled_mlp_chunk_size=0))
    with pytest.raises(ValueError, match="activations_checkpoint_save_attention: true needs"):
        apply_memory_techniques(model, ModelConfig(activations_checkpoint_save_attention=True))
    with pytest.raises(ValueError, match="activations_checkpoint_num_layers: 'block' needs the number"):
        apply_activation_checkpointing(model, "full", None, method="block")
    with pytest.raises(ValueError, match="activations_checkpoint_method: 'block' applies to .*granularity full"):
        apply_activation_checkpointing(model, "selective", ["LlamaMLP"], method="block", num_layers=1)
    with pytest.raises(ValueError, match="activations_checkpoint_num_layers: 2 with method 'uniform'.*not supported"):
        apply_activation_checkpointing(model, "full", None, method="uniform", num_layers=2)
    with pytest.raises(ValueError, match="activations_checkpoint_method: unknown value 'blocks'"):
        apply_activation_checkpointing(model, "full", None, method="blocks", num_layers=1)


def test_deepcopy_keeps_checkpointing_bound_to_the_copy() -> None:
    import copy

    model = _model(_config(), activations_checkpoint_granularity="full")
    clone = copy.deepcopy(model)
    with torch.no_grad():
        for p in clone.parameters():
            p.zero_()
    batch = _batch()
    assert not torch.equal(model(batch["input_ids"]), clone(batch["input_ids"]))
    assert clone.layers[0].forward.args[0] is clone.layers[0]


# ---- memory effect ----------------------------------------------------------------------------------------------
class _LiveBytes(TorchDispatchMode):
    """Tracks bytes of tensor storages created inside the mode that are still alive: ``peak`` and ``largest``."""

    def __init__(self) -> None:
        super().__init__()
        self.current = self.peak = self.largest = 0
        self._live: set[int] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._track(t.untyped_storage())
        return out

    def _track(self, storage: torch.UntypedStorage) -> None:
        key, size = id(storage), storage.nbytes()
        if key in self._live:
            return
        self._live.add(key)
        self.current += size
        self.peak, self.largest = max(self.peak, self.current), max(self.largest, size)
        weakref.finalize(storage, self._free, key, size)

    def _free(self, key: int, size: int) -> None:
        self._live.discard(key)
        self.current -= size


def _measure(model: LlamaForCausalLM, batch: dict[str, torch.Tensor]) -> _LiveBytes:
    with _LiveBytes() as mode:
        loss_sum, num = model.loss(batch["input_ids"], batch["labels"], batch["position_ids"])
        (loss_sum / num).backward()
        del loss_sum
    return mode


def test_memory_effect_of_each_technique() -> None:
    """Tiled CE never holds a [L, V] tensor; tiled MLP never a [L, 2I] one; checkpointing lowers the peak."""
    tokens, batch = 256, _batch(vocab=2048, b=1, s=256)
    big_vocab = _config(vocab_size=2048, intermediate_size=64, num_hidden_layers=2)
    plain = _measure(_model(big_vocab), batch)
    logits_bytes = tokens * 2048 * 4
    assert plain.largest >= logits_bytes
    tiled_ce = _measure(_model(big_vocab, tiled_loss_chunk_size=32), batch)
    assert tiled_ce.largest < logits_bytes / 4
    assert tiled_ce.peak < plain.peak - logits_bytes
    mlp_act = tokens * 2 * 512 * 4  # [L, 2I] gate/up output
    small_vocab = _config(intermediate_size=512, num_hidden_layers=2)
    base = _measure(_model(small_vocab), _batch(b=1, s=256))
    tiled_mlp = _measure(_model(small_vocab, tiled_mlp_chunk_size=32), _batch(b=1, s=256))
    assert base.largest >= mlp_act and tiled_mlp.largest < mlp_act / 4
    assert tiled_mlp.peak < base.peak - mlp_act  # 2 layers' gate/up/silu activations are not kept
    full = _measure(_model(small_vocab, activations_checkpoint_granularity="full"), _batch(b=1, s=256))
    selective = _measure(_model(small_vocab, activations_checkpoint_granularity="selective",
                                activations_checkpoint_recompute=["LlamaMLP"]), _batch(b=1, s=256))
    assert full.peak < selective.peak < base.peak
    # 'block': the peak (end of forward) holds the activations of the layers not checkpointed; 4 layers so that
    # it is not the backward of a recomputed layer, the same in every configuration
    four = _config(intermediate_size=512, num_hidden_layers=4)
    peaks = [_measure(_model(four, activations_checkpoint_granularity="full", activations_checkpoint_method="block",
                             activations_checkpoint_num_layers=n), _batch(b=1, s=256)).peak for n in (4, 2, 0)]
    layer_mlp = 256 * 3 * 512 * 4  # gate, up and silu outputs [S, I] fp32 of one layer
    assert peaks[0] + layer_mlp < peaks[1] < peaks[2] - layer_mlp, peaks
    # NxDT's default [CoreAttention] pays off when attention keeps [B, heads, S, S] scores (non-flash path)
    eager = _measure(_model(small_vocab, flash_attention=False), _batch(b=1, s=256))
    eager_sel = _measure(_model(small_vocab, flash_attention=False, activations_checkpoint_granularity="selective",
                                activations_checkpoint_recompute=["CoreAttention"]), _batch(b=1, s=256))
    assert eager_sel.peak < eager.peak - 4 * 256 * 256 * 4  # >= one layer's [1, 4 heads, S, S] fp32 scores
    config = _config(vocab_size=2048, intermediate_size=512, num_hidden_layers=2)
    everything = _measure(_model(config), batch)
    combined = _measure(_model(config, tiled_loss_chunk_size=32, tiled_mlp_chunk_size=32,
                               activations_checkpoint_granularity="full"), batch)
    assert combined.largest < min(logits_bytes, mlp_act) / 2
    assert combined.peak < everything.peak / 3


# ---- TP=2 + sequence parallel -----------------------------------------------------------------------------------
def _tp_worker(rank: int, world: int) -> None:
    """Each technique vs the plain TP=2 + SP path on the same weights (TP=2 vs TP=1: tests/test_llama_parity.py).

    VOCAB=97 pads to 98 at TP=2, so rank 1's vocab shard holds a padded column.
    """
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    config, batch = _config(), _batch()
    plain = _step(_model(config, sp=True), batch)
    for label, cfg in VARIANTS:
        loss, grads = _step(_model(config, sp=True, **cfg), batch)
        _assert_same(loss, grads, plain, atol=1e-6, label=f"tp2+sp {label} vs tp2+sp plain")
    # offload that really copies (on a CPU machine the host is the device: tests/test_activation_offload.py)
    from nxd_lc.runtime.offload import ActivationOffloader

    model = _model(config, sp=True, **dict(VARIANTS)["full_save_attention_offload"])
    copying = ActivationOffloader(copy_on_same_device=True)
    for layer in model.layers:
        layer._nxd_checkpoint_offload = copying
    loss, grads = _step(model, batch)
    _assert_same(loss, grads, plain, atol=1e-6, label="tp2+sp offload with copies vs tp2+sp plain")
    # per-token tiled CE (recomputed chunks, collectives re-run in backward) under SP, weighted per token
    model = _model(config, sp=True)
    weights = torch.linspace(0.5, 1.5, B * S).view(B, S)
    per_token = []
    for tiled in (False, True):
        hidden = model.hidden_states(batch["input_ids"], batch["position_ids"], batch["segment_ids"])
        if tiled:
            tok = tiled_cross_entropy(hidden, model.lm_head.weight, batch["labels"], chunk_size=6,
                                      num_valid_vocab_local=model.num_valid_vocab_local)
        else:
            tok = parallel_cross_entropy(model.logits_from_hidden(hidden), batch["labels"])
        per_token.append((tok.detach(), torch.autograd.grad((tok * weights).sum(), list(model.parameters()))))
    torch.testing.assert_close(per_token[1][0], per_token[0][0], atol=1e-6, rtol=0)
    for got, want in zip(per_token[1][1], per_token[0][1]):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    # tiled CE on the local vocab shard under SP: never [L, V/tp] logits (the plain path does hold them)
    big_vocab, batch = _config(vocab_size=2048, intermediate_size=64), _batch(vocab=2048, s=64)
    logits_local_bytes = B * 64 * 2048 // world * 4
    assert _measure(_model(big_vocab, sp=True), batch).largest >= logits_local_bytes
    assert _measure(_model(big_vocab, sp=True, tiled_loss_chunk_size=16), batch).largest < logits_local_bytes / 2


@pytest.mark.distributed
@pytest.mark.slow
def test_tp2_sequence_parallel_all_techniques() -> None:
    run_distributed(_tp_worker, 2)
