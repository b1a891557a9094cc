"""Memory by budget (issue 27, items 4-5): ``model.activations_memory_budget`` and ``model.activations_offload``.

* The estimate of every plan is an upper bound of the activation peak the real step allocates, measured with the
  FakeTensor live-bytes tracker of the benchmarks (``benchmarks/memory_estimate.py``) on a small Llama in bf16 and
  fp32, and not a loose one (within 2.2x): so a plan chosen under a budget really stays under it.
* The planner picks the fastest plan that fits: no recomputation for a generous budget, then selective, full, the
  tiled MLP, offload as the budget shrinks; a budget below every plan is an error naming the key.
* Offload: the layer inputs go through the host-offload hooks once per layer, and loss and gradients equal the
  plain (no recomputation) step.
* Config: budget forms, and the keys the budget chooses refused when also set by hand.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from transformers import LlamaConfig

from benchmarks.memory_estimate import LiveBytesTracker
from nxd_lc.config.schema import ModelConfig
from nxd_lc.models.common import memory_plan as mp
from nxd_lc.models.common.checkpointing import apply_memory_techniques
from nxd_lc.models.llama import LlamaForCausalLM

S = 512
CFG = LlamaConfig(hidden_size=64, intermediate_size=176, num_attention_heads=4, num_key_value_heads=2,
                  vocab_size=128, num_hidden_layers=3)


def _shape(dtype: torch.dtype, **kw: Any) -> mp.PlanShape:
    base = dict(tokens=S, hidden=64, head_dim=16, heads_local=4, kv_heads_local=2, intermediate_local=176,
                vocab_local=128, layers=3, element_size=dtype.itemsize)
    return mp.PlanShape(**{**base, **kw})


def _measured_activation_peak(keys: dict[str, Any], dtype: torch.dtype) -> int:
    """Peak live bytes of one fake forward + backward, less the gradients (parameter-sized)."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(CFG).to(dtype)
    apply_memory_techniques(model, ModelConfig(**keys))
    grads = sum(p.numel() * p.element_size() for p in model.parameters())
    with FakeTensorMode(allow_non_fake_inputs=True), LiveBytesTracker() as tracker:
        ids, labels = torch.randint(0, 128, (1, S)), torch.randint(0, 128, (1, S))
        start = tracker.live
        loss_sum, n = model.loss(ids, labels)
        (loss_sum / n).backward()
        return tracker.peak - start - grads


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_estimates_bound_the_measured_peak(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype) -> None:
    monkeypatch.setattr(mp, "PLAN_MLP_CHUNK", 64)  # a chunk smaller than the 512 tokens, so tiling shows
    monkeypatch.setattr(mp, "PLAN_LOSS_CHUNK", 32)
    measured = {}
    for name in ("none", "selective", "full_save_attention", "full", "full_tiled_mlp"):  # offload: fake host = device
        for loss_chunk in (None, 32):
            keys = mp._plan(name, loss_chunk, 0, 0, 0).model_keys()
            peak = _measured_activation_peak(keys, dtype)
            estimate = mp.estimate_bytes(_shape(dtype), name, loss_chunk)[0]
            assert peak <= estimate <= 2.2 * peak, (name, loss_chunk, peak, estimate)
            measured[name, loss_chunk] = peak
    # the plans really are in decreasing memory order, as the planner assumes
    assert measured["none", None] > measured["selective", None] > measured["full_save_attention", None] \
        > measured["full", None] > measured["full_tiled_mlp", None]


@pytest.mark.compat
def test_planner_takes_the_fastest_plan_that_fits() -> None:
    s = _shape(torch.bfloat16, tokens=131072, hidden=2048, head_dim=64, heads_local=32, kv_heads_local=8,
               intermediate_local=8192, vocab_local=128256, layers=16)
    none = mp.estimate_bytes(s, "none")[0]
    assert mp.choose_memory_plan(s, 1.0).name == "none" and mp.choose_memory_plan(s, 1.0).tiled_loss_chunk_size is None
    previous = 0
    for budget in (0.9, 0.6, 0.3, 0.1, 0.05, 0.03, 0.026):
        plan = mp.choose_memory_plan(s, budget)
        assert plan.estimate_bytes <= budget * none, (budget, plan)
        index = mp.PLAN_ORDER.index(plan.name)
        assert index >= previous, (budget, plan.name)  # less memory never buys a faster plan
        previous = index
    assert previous == mp.PLAN_ORDER.index("full_offload")
    kept_attention = mp.choose_memory_plan(s, 0.03)  # inputs, attention outputs (bf16) and log-sum-exps (fp32)
    assert kept_attention.name == "full_save_attention_offload" and kept_attention.offload
    assert kept_attention.save_attention and kept_attention.tiled_mlp_chunk_size == mp.PLAN_MLP_CHUNK
    assert kept_attention.host_bytes == 16 * 131072 * (2048 * 2 + 32 * 64 * 2 + 32 * 4)
    offload = mp.choose_memory_plan(s, 0.026)
    assert offload.name == "full_offload" and offload.host_bytes == 16 * 131072 * 2048 * 2  # every layer input
    full = mp.choose_memory_plan(s, f"{mp.estimate_bytes(s, 'full', 1024)[0] / 2**30 + 0.01:.3f}GiB",
                                 allow_offload=False)
    assert full.name == "full" and full.tiled_mlp_chunk_size is None  # tiled MLP only where its chunk matters
    with pytest.raises(ValueError, match="model.activations_memory_budget: '1MiB'.*below the smallest plan"):
        mp.choose_memory_plan(s, "1MiB")
    compiled = mp.choose_memory_plan(s, 0.06, allow_offload=False)
    assert compiled.name == "full_tiled_mlp" and not compiled.offload
    assert mp.offload_allowed("gpu", compiled=False) and mp.offload_allowed("neuron_native", compiled=False)
    assert not mp.offload_allowed("gpu", compiled=True) and not mp.offload_allowed("cpu", compiled=False)


def test_planner_keeps_attention_outputs_between_selective_and_full() -> None:
    """Issue 41, item 2: a budget between full recomputation's estimate and that plus each layer's attention output
    and log-sum-exp ([T, Hq] bf16 + [heads, T] fp32 per layer, by hand below) keeps them (the recomputation skips
    the attention); below it, they and the layer inputs go to the host, or (no offload) full recomputation; on
    torch-xla (lazy) never (no selective policy there)."""
    t, layers, heads, dh = 131072, 16, 32, 64
    s = _shape(torch.bfloat16, tokens=t, hidden=2048, head_dim=dh, heads_local=heads, kv_heads_local=8,
               intermediate_local=8192, vocab_local=128256, layers=layers)
    full = mp.estimate_bytes(s, "full", 1024)[0]
    kept_attention = layers * t * (2 * heads * dh + 4 * heads)
    assert mp.estimate_bytes(s, "full_save_attention", 1024)[0] == full + kept_attention
    budget = f"{(full + kept_attention) / 2**30 + 0.01:.3f}GiB"
    plan = mp.choose_memory_plan(s, budget)
    assert plan.name == "full_save_attention" and plan.granularity == "full" and plan.save_attention
    assert plan.model_keys()["activations_checkpoint_save_attention"] is True
    below = f"{(full + kept_attention) / 2**30 - 0.01:.3f}GiB"
    assert mp.choose_memory_plan(s, below, allow_offload=False).name == "full"
    # where offload can run: they go to the host with each layer's input; the device keeps two layers' worth (the
    # one whose backward runs, the one prefetched) on top of the tiled working set
    offloaded = mp.choose_memory_plan(s, below)
    assert offloaded.name == "full_save_attention_offload" and offloaded.save_attention and offloaded.offload
    layer_input, attention = t * 2048 * 2, t * (2 * heads * dh + 4 * heads)
    assert offloaded.host_bytes == layers * (layer_input + attention)
    assert offloaded.estimate_bytes == (mp.estimate_bytes(s, "full_offload", 1024)[0] + 2 * attention)
    lazy = mp.choose_memory_plan(s, budget, lazy=True)
    assert lazy.name == "full" and not lazy.save_attention
    tiled = mp.estimate_bytes(s, "full_tiled_mlp", 1024)[0]  # below it only offload, which torch-xla cannot run
    assert mp.choose_memory_plan(s, f"{tiled / 2**30 + 0.01:.3f}GiB", lazy=True).name == "full_tiled_mlp"
    with pytest.raises(ValueError, match="below the smallest plan.*tiled MLP and loss\\)"):
        mp.choose_memory_plan(s, f"{tiled / 2**30 - 0.01:.3f}GiB", lazy=True)


def test_budget_forms() -> None:
    assert mp.parse_budget(0.5) == ("fraction", 0.5) and mp.parse_budget(1) == ("fraction", 1.0)
    assert mp.parse_budget("40GiB") == ("bytes", 40 * 2**30)
    assert mp.parse_budget("512 MiB") == ("bytes", 512 * 2**20)
    for bad in (0, 1.5, -1, "lots", "0GiB", True):
        with pytest.raises(ValueError, match="model.activations_memory_budget"):
            mp.parse_budget(bad)


@pytest.mark.compat
def test_offload_moves_layer_inputs_and_keeps_gradients(monkeypatch: pytest.MonkeyPatch) -> None:
    from nxd_lc.runtime import offload

    offloaded: list[tuple[int, ...]] = []
    original = offload.OffloadGroup.offload

    def recording(self: offload.OffloadGroup, tensor: torch.Tensor) -> int:
        offloaded.append(tuple(tensor.shape))
        return original(self, tensor)

    monkeypatch.setattr(offload.OffloadGroup, "offload", recording)
    torch.manual_seed(0)
    ref = LlamaForCausalLM(CFG)
    off = LlamaForCausalLM(CFG)
    off.load_state_dict(ref.state_dict())
    names = apply_memory_techniques(off, ModelConfig(activations_checkpoint_granularity="full",
                                                     activations_offload=True, tiled_mlp_chunk_size=20))
    assert names == ["layers.0", "layers.1", "layers.2"]
    ids, labels = torch.randint(0, 128, (2, 48)), torch.randint(0, 128, (2, 48))
    for model in (ref, off):
        loss_sum, n = model.loss(ids, labels)
        (loss_sum / n).backward()
    assert offloaded == [(2, 48, 64)] * 3  # each layer's input, once (not the RoPE tables every layer shares)
    for (name, p), q in zip(ref.named_parameters(), off.parameters()):
        torch.testing.assert_close(q.grad, p.grad, atol=1e-6, rtol=1e-5, msg=name)
    with pytest.raises(ValueError, match="model.activations_offload: true needs"):
        apply_memory_techniques(LlamaForCausalLM(CFG), ModelConfig(activations_checkpoint_granularity="selective",
                                                                   activations_checkpoint_recompute=["LlamaMLP"],
                                                                   activations_offload=True))


@pytest.mark.compat
def test_budget_config_rules() -> None:
    from nxd_lc.app.validation import load_config
    from nxd_lc.config.errors import ConfigError

    def raw(**model: Any) -> dict[str, Any]:
        return {"trainer": {"devices": 1, "num_nodes": 1, "max_steps": 2, "accelerator": "cpu"},
                "data": {"micro_batch_size": 1, "global_batch_size": 1},
                "model": {"model_config": "conf/tiny_llama_config.json", "encoder_seq_length": 64, **model}}

    assert load_config(raw(activations_memory_budget="2GiB")).model.activations_memory_budget == "2GiB"
    with pytest.raises(ConfigError, match=r"model.tiled_mlp_chunk_size: 512 is chosen by model.activations_memory"):
        load_config(raw(activations_memory_budget=0.5, tiled_mlp_chunk_size=512))
    with pytest.raises(ConfigError, match=r"model.activations_memory_budget: 'plenty' is not a budget"):
        load_config(raw(activations_memory_budget="plenty"))
    with pytest.raises(ConfigError, match=r"model.activations_offload: true offloads the inputs of whole"):
        load_config(raw(activations_offload=True))
    from nxd_lc.app.validation import memory

    both = load_config(raw(activations_offload=True, activations_checkpoint_granularity="full",
                           activations_checkpoint_save_attention=True))  # the attention outputs go to the host too
    assert memory._plan_name(both)[0] == "full_save_attention_offload"
    assert memory._plan_name(load_config(raw(activations_offload=True, activations_checkpoint_granularity="full"))
                             )[0] == "full_offload"
    assert not memory._offload_allowed(both)  # trainer.accelerator cpu: host memory is the device's
    with pytest.raises(ConfigError, match=r"model.activations_offload: not supported with model.compile: true"):
        load_config(raw(activations_offload=True, activations_checkpoint_granularity="full", compile=True))


@pytest.mark.compat
def test_build_model_applies_the_budget_plan(caplog: pytest.LogCaptureFixture) -> None:
    """The run's model gets the keys of the plan chosen (and logged) for its shape: the budget below no
    recomputation's estimate gives a plan that recomputes, and the model is checkpointed as that plan says."""
    import logging
    import re

    from nxd_lc.app.build import build_model
    from nxd_lc.app.validation import load_config

    raw = {"trainer": {"devices": 1, "num_nodes": 1, "max_steps": 2, "accelerator": "cpu"},
           "data": {"micro_batch_size": 1, "global_batch_size": 1, "seq_length": 2048},
           "precision": {"type": "fp32"},
           "model": {"model_config": "conf/tiny_llama_config.json", "encoder_seq_length": 2048,
                     "activations_memory_budget": 0.5}}
    with caplog.at_level(logging.INFO, logger="nxd_lc.models.common.memory_plan"), \
            caplog.at_level(logging.INFO, logger="nxd_lc.train"):
        _, model = build_model(load_config(raw), "cpu")
    logged = re.search(r"plan '(\w+)'", caplog.text)
    assert logged is not None, caplog.text
    plan = mp._plan(logged.group(1), None, 0, 0, 0)
    assert plan.name != "none"
    checkpointed = {n for n, m in model.named_modules() if getattr(m, "_nxd_activation_checkpointed", False)}
    if plan.granularity == "full":
        assert checkpointed == {f"layers.{i}" for i in range(len(model.layers))}
    else:
        assert checkpointed and all(".mlp" in n or "layernorm" in n for n in checkpointed), checkpointed
    tiled = [m.tiled_chunk_size for m in model.modules() if hasattr(m, "tiled_chunk_size")]
    assert tiled and all(c == plan.tiled_mlp_chunk_size for c in tiled)
