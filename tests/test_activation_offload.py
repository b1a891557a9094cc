"""Activation offload with the attention kept (issue 41, item 2): ``model.activations_offload`` with
``activations_checkpoint_save_attention``, and plain ``activations_offload``.

On a CPU-only machine the device is host memory, so these tests give the layers an offloader that copies anyway
(``ActivationOffloader(copy_on_same_device=True)``): then "the device tensor is freed after forward" is observable
as a dead weak reference, which it is not for the tensors a plain checkpoint keeps (the contrast the tests also
check, so each can fail). Shown here:

* loss and every gradient equal the plain step without recomputation (packed documents, tiled MLP, a second
  backward with ``retain_graph``);
* the attention kernel runs once per layer and document (the recomputation gets its output back from the host)
  where plain full recomputation runs it twice;
* what goes to the host per layer, by shape from the config (by hand): the input ``[B, S, H]``, the attention
  output ``[B, heads, S, Dh]`` and its log-sum-exp ``[B, heads, S]`` (fp32); the RoPE tables stay;
* no device copy of a layer input or an attention output outlives the forward;
* backward brings a layer's group back when its recomputation starts, and starts the previous layer's then.

The CUDA side stream (pinned buffers, events, ``record_stream``) needs a GPU and is not exercised here.
"""

from __future__ import annotations

import weakref
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LlamaConfig

from nxd_lc.config.schema import ModelConfig
from nxd_lc.models.common.checkpointing import apply_memory_techniques
from nxd_lc.models.llama import LlamaForCausalLM
from nxd_lc.runtime import offload
from nxd_lc.runtime.offload import ActivationOffloader

pytestmark = pytest.mark.compat  # torch 2.9 too: the input offload relies on where torch's checkpoint saves inputs

B, S, H, HEADS, DH, LAYERS, VOCAB = 2, 48, 64, 4, 16, 3, 128
CFG = LlamaConfig(hidden_size=H, intermediate_size=176, num_attention_heads=HEADS, num_key_value_heads=2,
                  vocab_size=VOCAB, num_hidden_layers=LAYERS)
FLASH_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
KEEP_ATTENTION = {"activations_checkpoint_granularity": "full", "activations_offload": True,
                  "activations_checkpoint_save_attention": True}
PLAIN_OFFLOAD = {"activations_checkpoint_granularity": "full", "activations_offload": True}


def _batch(segments: bool) -> dict[str, Any]:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (B, S), generator=g)
    labels = torch.cat([ids[:, 1:], torch.full((B, 1), -100)], dim=1)
    if not segments:
        return {"input_ids": ids, "labels": labels}
    cut = S // 3  # two documents per row, positions restart
    seg = (torch.arange(S) >= cut).to(torch.int32).expand(B, S).contiguous()
    pos = torch.cat([torch.arange(cut), torch.arange(S - cut)]).expand(B, S).contiguous()
    return {"input_ids": ids, "labels": labels, "position_ids": pos, "segment_ids": seg}


def _model(keys: dict[str, Any], copy: bool = True) -> tuple[LlamaForCausalLM, ActivationOffloader | None]:
    torch.manual_seed(0)
    model = LlamaForCausalLM(CFG)
    apply_memory_techniques(model, ModelConfig(**keys))
    offloader = None
    if keys.get("activations_offload") and copy:
        offloader = ActivationOffloader(copy_on_same_device=True)
        for layer in model.layers:
            assert isinstance(layer._nxd_checkpoint_offload, ActivationOffloader)  # one per model, replaced here
            layer._nxd_checkpoint_offload = offloader
    return model, offloader


def _loss(model: LlamaForCausalLM, batch: dict[str, Any]) -> torch.Tensor:
    loss_sum, n = model.loss(batch["input_ids"], batch["labels"], batch.get("position_ids"),
                             segment_ids=batch.get("segment_ids"))
    return loss_sum / n


def _grads(model: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("segments", [False, True], ids=["one_doc", "packed"])
@pytest.mark.parametrize(("label", "keys"), [
    ("keep_attention", KEEP_ATTENTION),
    ("keep_attention_tiled_mlp", {**KEEP_ATTENTION, "tiled_mlp_chunk_size": 20, "tiled_loss_chunk_size": 7}),
    ("plain_offload_tiled_mlp", {**PLAIN_OFFLOAD, "tiled_mlp_chunk_size": 20}),
])
@pytest.mark.parametrize("copy", [True, False], ids=["copies", "cpu_as_is"])
def test_offload_matches_the_plain_step(label: str, keys: dict[str, Any], segments: bool, copy: bool) -> None:
    batch = _batch(segments)
    ref, _ = _model({})
    ref_loss = _loss(ref, batch)
    ref_loss.backward()
    model, _ = _model(keys, copy)
    loss = _loss(model, batch)
    loss.backward()
    torch.testing.assert_close(loss, ref_loss, atol=1e-6, rtol=0)
    grads = _grads(model)
    for name, grad in _grads(ref).items():
        torch.testing.assert_close(grads[name], grad, atol=1e-6, rtol=1e-5, msg=f"{label}: grad of {name}")


def test_a_retained_graph_fetches_again() -> None:
    """A second backward of a retained graph fetches each group again and replays from the first kernel."""
    batch = _batch(True)
    grads = []
    for keys in ({}, KEEP_ATTENTION):
        model, _ = _model(keys)
        hidden = model.hidden_states(batch["input_ids"], batch["position_ids"], batch["segment_ids"])
        loss = hidden.pow(2).mean()
        loss.backward(retain_graph=True)
        first = _grads(model)
        loss.backward()
        grads.append((first, _grads(model)))
    (ref_first, ref_second), (first, second) = grads
    for name, grad in ref_first.items():
        torch.testing.assert_close(first[name], grad, atol=1e-6, rtol=1e-5, msg=name)
        torch.testing.assert_close(second[name], ref_second[name], atol=1e-6, rtol=1e-5, msg=name)


class _AttentionCalls(TorchDispatchMode):
    """Records the CPU flash-attention kernel's calls, as weak references to the memory of its outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.outputs: list[weakref.ref] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func is FLASH_CPU:
            # O [B, heads, S, Dh], log-sum-exp [B, heads, S]: their memory (a detached alias keeps it too)
            self.outputs.extend(weakref.ref(t.untyped_storage()) for t in out[:2])
        return out


def _observe(keys: dict[str, Any], batch: dict[str, Any]) -> tuple[int, int, int, int, list[offload.OffloadGroup]]:
    """One step: (attention kernel calls in forward, in all; layer inputs and attention outputs whose memory is
    alive between forward and backward; the offload groups made)."""
    model, offloader = _model(keys)
    inputs: list[weakref.ref] = []
    for layer in model.layers:
        layer.register_forward_pre_hook(lambda _m, args: inputs.append(weakref.ref(args[0].untyped_storage())))
    groups: list[offload.OffloadGroup] = []
    if offloader is not None:
        make = offloader.group
        offloader.group = lambda: groups.append(make()) or groups[-1]  # type: ignore[method-assign]
    with _AttentionCalls() as calls:
        loss = _loss(model, batch)
        forward_calls = len(calls.outputs) // 2
        alive_inputs = sum(r() is not None for r in inputs)
        alive_outputs = sum(r() is not None for r in calls.outputs)
        loss.backward()
    return forward_calls, len(calls.outputs) // 2, alive_inputs, alive_outputs, groups


@pytest.mark.parametrize("segments", [False, True], ids=["one_doc", "packed"])
def test_kept_attention_is_not_recomputed_and_its_device_copies_are_freed(segments: bool) -> None:
    docs = 2 if segments else 1
    batch = _batch(segments)
    results = {label: _observe(keys, batch) for label, keys in (
        ("keep", KEEP_ATTENTION), ("plain", PLAIN_OFFLOAD),
        ("torch_sac", {"activations_checkpoint_granularity": "full", "activations_checkpoint_save_attention": True}))}
    # with the attention kept and offloaded: one kernel call per layer and document, nothing left on the "device"
    forward_calls, total_calls, alive_inputs, alive_outputs, groups = results["keep"]
    assert (forward_calls, total_calls) == (LAYERS * docs, LAYERS * docs)
    assert (alive_inputs, alive_outputs) == (0, 0)
    assert len(groups) == LAYERS
    lengths = (S // 3, S - S // 3) if segments else (S,)  # the documents _batch packs, one kernel call each
    for group in groups:  # the input, then per document the attention output and its log-sum-exp
        shapes = [tuple(item.host.shape) for item in group._items]
        assert shapes == [(B, S, H)] + [s for n in lengths for s in ((B, HEADS, n, DH), (B, HEADS, n))], shapes
        assert all(item.host.dtype == torch.float32 for item in group._items)
    # plain offload: the inputs go, the attention is recomputed in backward
    forward_calls, total_calls, alive_inputs, _, groups = results["plain"]
    assert (forward_calls, total_calls, alive_inputs) == (LAYERS * docs, 2 * LAYERS * docs, 0)
    assert [len(g) for g in groups] == [1] * LAYERS
    # torch's selective checkpoint (no offload) keeps the inputs and the attention outputs alive on the device
    forward_calls, total_calls, alive_inputs, alive_outputs, _ = results["torch_sac"]
    assert (forward_calls, total_calls) == (LAYERS * docs, LAYERS * docs)
    assert alive_inputs == LAYERS and alive_outputs == 2 * LAYERS * docs


def test_backward_prefetches_the_previous_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    events: list[tuple[str, int]] = []
    order: dict[int, int] = {}  # id(group) -> its layer (forward order)
    make, prefetch, get = ActivationOffloader.group, offload.OffloadGroup.prefetch, offload.OffloadGroup.get

    def recording_group(self: ActivationOffloader) -> offload.OffloadGroup:
        group = make(self)
        order[id(group)] = len(order)
        return group

    def recording_prefetch(self: offload.OffloadGroup) -> None:
        if any(isinstance(i, offload._Item) and i.on_device is None for i in self._items):  # starts copies
            events.append(("prefetch", order[id(self)]))
        prefetch(self)

    def recording_get(self: offload.OffloadGroup, index: int) -> torch.Tensor:
        events.append(("get", order[id(self)]))
        return get(self, index)

    monkeypatch.setattr(ActivationOffloader, "group", recording_group)
    monkeypatch.setattr(offload.OffloadGroup, "prefetch", recording_prefetch)
    monkeypatch.setattr(offload.OffloadGroup, "get", recording_get)
    model, _ = _model(KEEP_ATTENTION)
    loss = _loss(model, _batch(False))
    assert events == []  # forward copies out, brings nothing back
    loss.backward()
    # the last layer's backward comes first; when it starts, the copies of its group and of the layer before it
    # start; each later layer's group is already on its way when its backward starts
    firsts = [events.index(("get", layer)) for layer in reversed(range(LAYERS))]
    assert firsts == sorted(firsts)
    assert events[:3] == [("get", LAYERS - 1), ("prefetch", LAYERS - 1), ("prefetch", LAYERS - 2)], events
    for layer in range(LAYERS - 1):
        assert events.index(("prefetch", layer)) < events.index(("get", layer)), events
        assert events.index(("prefetch", layer)) > events.index(("get", layer + 1)), events
    assert sum(e[0] == "prefetch" for e in events) == LAYERS  # each group brought back once


def test_a_different_kernel_in_the_recomputation_is_an_error() -> None:
    """The replay matches the n-th attention kernel call of the recomputation to the n-th of the forward: a region
    whose recomputation calls a kernel the forward did not (here the forward ran SDPA's math decomposition, the
    recomputation the flash kernel) is refused, not given another call's tensors."""
    model, _ = _model(KEEP_ATTENTION)
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        loss = _loss(model, _batch(False))
    with pytest.raises(RuntimeError, match="the recomputation calls aten._scaled_dot_product_flash_attention_for_cpu"
                                           ".default as attention kernel 0 where the forward called nothing"):
        loss.backward()


def test_offloader_copies_with_deepcopy_and_pickle() -> None:
    import copy
    import pickle

    model, offloader = _model(KEEP_ATTENTION, copy=False)
    clone = copy.deepcopy(model)
    shared = {id(layer._nxd_checkpoint_offload) for layer in clone.layers}
    assert len(shared) == 1 and shared != {id(model.layers[0]._nxd_checkpoint_offload)}
    restored = pickle.loads(pickle.dumps(ActivationOffloader(copy_on_same_device=True)))
    assert restored.copy_on_same_device and restored._previous is None
    batch = _batch(True)
    torch.testing.assert_close(_loss(clone, batch), _loss(model, batch))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the side stream, pinned buffers, prefetch)")
def test_cuda_side_stream_offload() -> None:
    """On CUDA (run by benchmarks/device/accel_step.sh when a GPU is lent): bf16, flash attention; the loss and
    gradients match the plain step, the host copies are pinned, and after forward the device holds less than under
    torch's selective checkpoint (attention kept on the device) by at least 90% of the layers' inputs, attention
    outputs and log-sum-exps."""
    cfg = LlamaConfig(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                      vocab_size=VOCAB, num_hidden_layers=LAYERS)
    seq = 2048
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, VOCAB, (1, seq), generator=g).cuda()
    labels = torch.roll(ids, -1, dims=1)

    def run(keys: dict[str, Any]) -> tuple[float, dict[str, torch.Tensor], int, list[Any]]:
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg)
        apply_memory_techniques(model, ModelConfig(**keys))
        model = model.to(device="cuda", dtype=torch.bfloat16)
        groups: list[offload.OffloadGroup] = []
        offloader = getattr(model.layers[0], "_nxd_checkpoint_offload", None)
        if offloader is not None:
            make = offloader.group
            offloader.group = lambda: groups.append(make()) or groups[-1]  # type: ignore[method-assign]
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        loss_sum, n = model.loss(ids, labels)
        loss = loss_sum / n
        torch.cuda.synchronize()
        torch.empty(1, device="cuda")  # the allocator frees blocks whose side-stream copies have ended
        after_forward = torch.cuda.memory_allocated() - base
        loss.backward()
        torch.cuda.synchronize()
        return float(loss), {k: p.grad.float() for k, p in model.named_parameters()}, after_forward, groups

    ref_loss, ref_grads, _, _ = run({})
    loss, grads, offloaded_bytes, groups = run(KEEP_ATTENTION)
    _, _, kept_bytes, _ = run({"activations_checkpoint_granularity": "full",
                               "activations_checkpoint_save_attention": True})
    assert abs(loss - ref_loss) < 1e-2
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, atol=2e-3, rtol=5e-2, msg=name)
    assert len(groups) == LAYERS and all(item.host.is_pinned() for g in groups for item in g._items)
    per_layer = seq * 256 * 2 + seq * 256 * 2 + 4 * seq * 4  # input + attention output (bf16) + lse (fp32)
    assert kept_bytes - offloaded_bytes >= 0.9 * LAYERS * per_layer, (kept_bytes, offloaded_bytes)
