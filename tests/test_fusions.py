"""Fewer, larger kernels (issue 27, item 2): ``model.fusions.*`` and ``model.compile: auto``.

* Op count: one decoder layer's forward + backward, counted at the ATen dispatcher (every op that reaches ATen is a
  kernel launch on CUDA, a graph node on Neuron), for nxd_lc's layer and for transformers' ``LlamaDecoderLayer``
  with the same shape in the same test; nxd_lc must not exceed transformers, in all ops and in the ops that compute
  (views and metadata ops excluded), in bf16 (what the accelerator step runs) and fp32.
* The ``torch`` kernels equal transformers' ``LlamaRMSNorm`` / ``apply_rotary_pos_emb`` bit for bit in bf16, and
  the whole bf16 layer matches transformers' layer.
* The ``liger`` wiring: with a stand-in ``liger_kernel.transformers.functional`` (plain torch formulas written in
  this test, recording each call) every fused site calls it with the documented arguments and the loss / gradients
  equal the ``torch`` kernels'. The real Triton kernels need CUDA: ``test_liger_kernels_on_cuda`` compares them
  with the ``torch`` kernels there (run by the device script; skipped here).
* Choice rules: auto / torch / liger per device, TP, tiled loss and compiled layers; every refusal names its key.
"""

from __future__ import annotations

import collections
import logging
import sys
import types
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LlamaConfig
from transformers.models.llama import modeling_llama as hf_llama

from nxd_lc.layers import fusions
from nxd_lc.models.common.compile import compile_enabled
from nxd_lc.models.common.fusions import apply_fusions
from nxd_lc.models.common.rope import apply_rotary_pos_emb
from nxd_lc.models.llama import LlamaForCausalLM

#: ATen ops that only make views or touch metadata (no kernel runs on an accelerator)
VIEW_OPS = {"aten.view", "aten._unsafe_view", "aten.t", "aten.transpose", "aten.detach", "aten.expand",
            "aten.unsqueeze", "aten.squeeze", "aten.slice", "aten.split", "aten.split_with_sizes", "aten.alias",
            "aten.permute", "aten.select", "aten.chunk", "aten.unbind", "aten.as_strided"}


class _OpCounter(TorchDispatchMode):
    """Counts every ATen op (by overload packet) dispatched inside the mode."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))

    def compute_ops(self) -> int:
        return sum(n for op, n in self.ops.items() if op not in VIEW_OPS)


def _config() -> LlamaConfig:
    return LlamaConfig(hidden_size=64, intermediate_size=160, num_attention_heads=4, num_key_value_heads=2,
                       vocab_size=96, num_hidden_layers=1, rms_norm_eps=1e-5, attn_implementation="sdpa")


def _layers(dtype: torch.dtype) -> tuple[Any, Any, LlamaForCausalLM]:
    """(transformers layer, nxd_lc layer with transformers' weights, nxd_lc model)."""
    torch.manual_seed(0)
    cfg = _config()
    hf = hf_llama.LlamaDecoderLayer(cfg, 0).to(dtype)
    model = LlamaForCausalLM(cfg).to(dtype)
    ours = model.layers[0]
    with torch.no_grad():
        a = hf.self_attn
        ours.self_attn.qkv_proj.weight_qkv.copy_(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]))
        ours.self_attn.o_proj.weight.copy_(a.o_proj.weight)
        ours.mlp.gate_up_proj.weight.copy_(torch.cat([hf.mlp.gate_proj.weight, hf.mlp.up_proj.weight]))
        ours.mlp.down_proj.weight.copy_(hf.mlp.down_proj.weight)
        for n in ("input_layernorm", "post_attention_layernorm"):
            w = torch.rand(64, dtype=dtype) + 0.5
            getattr(ours, n).weight.copy_(w)
            getattr(hf, n).weight.copy_(w)
    return hf, ours, model


def _run_hf(hf: Any, cfg: LlamaConfig, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    cos, sin = hf_llama.LlamaRotaryEmbedding(cfg)(x, pos)
    out = hf(x, attention_mask=None, position_ids=pos, position_embeddings=(cos, sin))
    return out[0] if isinstance(out, tuple) else out


def _run_ours(model: LlamaForCausalLM, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    cos, sin = model.position_encoding(pos)
    return model.layers[0](x, cos, sin)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_layer_op_count_does_not_exceed_transformers(dtype: torch.dtype) -> None:
    hf, _, model = _layers(dtype)
    cfg, pos = _config(), torch.arange(32)[None]
    counts = {}
    for name, run, params in (("transformers", lambda x: _run_hf(hf, cfg, x, pos), hf.parameters()),
                              ("nxd_lc", lambda x: _run_ours(model, x, pos), model.layers[0].parameters())):
        x = torch.randn(1, 32, 64, dtype=dtype, requires_grad=True)
        with _OpCounter() as c:
            run(x).float().pow(2).sum().backward()
        assert all(p.grad is not None for p in params), name
        counts[name] = c
    ours, theirs = counts["nxd_lc"], counts["transformers"]
    assert sum(ours.ops.values()) <= sum(theirs.ops.values()), (ours.ops, theirs.ops)
    assert ours.compute_ops() <= theirs.compute_ops(), (ours.ops, theirs.ops)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rms_norm_keeps_only_input_and_rstd(dtype: torch.dtype) -> None:
    """nxd_lc's RMSNorm saves x and the fp32 reciprocal RMS for backward (not autograd's fp32 copy of x and the
    normalised output), and its gradients are bit-equal to autograd's through transformers' formula."""
    from nxd_lc.models.common.norm import RMSNorm

    torch.manual_seed(0)
    norm = RMSNorm(64, eps=1e-5, dtype=dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(64) + 0.5)
    x = (torch.randn(3, 17, 64) * 3).to(dtype).requires_grad_()
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = norm(x)
    new_bytes = sum(t.numel() * t.element_size() for t in saved if t is not x and t is not norm.weight)
    assert new_bytes == 3 * 17 * 4  # the [3, 17, 1] fp32 reciprocal RMS, nothing else besides x and the weight
    hf = hf_llama.LlamaRMSNorm(64, eps=1e-5).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(norm.weight)
    x_ref = x.detach().clone().requires_grad_()
    y_ref = hf(x_ref)
    assert torch.equal(y, y_ref)
    g = torch.randn_like(y)
    y.backward(g)
    y_ref.backward(g)
    # the backward runs autograd's operations in autograd's order: the gradients are bit-equal, so TP layouts that
    # compare against each other at 2e-5 after several training steps (tests/test_lora.py) round alike
    assert torch.equal(x.grad, x_ref.grad)
    assert torch.equal(norm.weight.grad, hf.weight.grad)


def test_torch_kernels_equal_transformers_bitwise_in_bf16() -> None:
    torch.manual_seed(1)
    x = torch.randn(2, 16, 64, dtype=torch.bfloat16) * 3
    w = (torch.rand(64) + 0.5).to(torch.bfloat16)
    hf_norm = hf_llama.LlamaRMSNorm(64, eps=1e-5).to(torch.bfloat16)
    from nxd_lc.models.common.norm import RMSNorm

    ours = RMSNorm(64, eps=1e-5, dtype=torch.bfloat16)
    with torch.no_grad():
        hf_norm.weight.copy_(w)
        ours.weight.copy_(w)
    assert torch.equal(ours(x), hf_norm(x))
    q, k = torch.randn(2, 4, 16, 32, dtype=torch.bfloat16), torch.randn(2, 2, 16, 32, dtype=torch.bfloat16)
    angles = torch.arange(16)[:, None] * torch.linspace(0.01, 1.0, 16)[None]
    emb = torch.cat([angles, angles], -1)[None].expand(2, 16, 32)
    cos, sin = emb.cos(), emb.sin()  # fp32, as nxd_lc's RotaryEmbedding returns them
    q_hf, k_hf = hf_llama.apply_rotary_pos_emb(q, k, cos.to(q.dtype), sin.to(q.dtype))
    q_ours, k_ours = apply_rotary_pos_emb(q, k, cos, sin)
    assert torch.equal(q_ours, q_hf) and torch.equal(k_ours, k_hf)


def test_bf16_layer_matches_transformers() -> None:
    hf, _, model = _layers(torch.bfloat16)
    cfg, pos = _config(), torch.arange(32)[None]
    x = torch.randn(1, 32, 64, dtype=torch.bfloat16)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_hf, y_ours = _run_hf(hf, cfg, x1, pos), _run_ours(model, x2, pos)
    torch.testing.assert_close(y_ours, y_hf, atol=3e-2, rtol=2e-2)
    y_hf.float().sum().backward()
    y_ours.float().sum().backward()
    torch.testing.assert_close(x2.grad, x1.grad, atol=5e-2, rtol=3e-2)


# ---- the liger wiring, with a stand-in module of plain formulas -------------------------------------------------


def _stand_in_liger(calls: list[tuple[str, dict[str, Any]]]) -> types.ModuleType:
    """``liger_kernel.transformers.functional`` with Liger's signatures, computing the textbook formulas."""
    mod = types.ModuleType("liger_kernel.transformers.functional")

    def liger_rms_norm(x, w, eps, offset=0.0, casting_mode="llama", in_place=True):  # noqa: ANN001, ANN202
        calls.append(("rms_norm", {"casting_mode": casting_mode, "in_place": in_place, "offset": offset}))
        x32 = x.float()
        return (x32 / (x32.pow(2).mean(-1, keepdim=True) + eps).sqrt()).to(x.dtype) * w.to(x.dtype)

    def liger_rope(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):  # noqa: ANN001, ANN202
        calls.append(("rope", {"cos_dtype": cos.dtype, "q_shape": tuple(q.shape)}))
        c, s = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
        half = q.shape[-1] // 2

        def rot(t):  # noqa: ANN001, ANN202
            return torch.cat([-t[..., half:], t[..., :half]], -1)

        return q * c + rot(q) * s, k * c + rot(k) * s

    def liger_swiglu(a, b):  # noqa: ANN001, ANN202
        calls.append(("swiglu", {"contiguous": a.is_contiguous() and b.is_contiguous()}))
        return a * torch.sigmoid(a) * b

    def liger_fused_linear_cross_entropy(x, w, y, ignore_index=-100, reduction="mean", **_: Any):  # noqa: ANN001, ANN202
        calls.append(("cross_entropy", {"weight_rows": w.shape[0], "reduction": reduction, "x_shape": tuple(x.shape)}))
        return F.cross_entropy((x @ w.t()).float(), y, ignore_index=ignore_index, reduction=reduction)

    for f in (liger_rms_norm, liger_rope, liger_swiglu, liger_fused_linear_cross_entropy):
        setattr(mod, f.__name__, f)
    return mod


@pytest.mark.compat
def test_liger_sites_call_the_library_and_match_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, dict[str, Any]]] = []
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers.functional", _stand_in_liger(calls))
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=160, num_attention_heads=4, num_key_value_heads=2,
                      vocab_size=90, num_hidden_layers=2, rms_norm_eps=1e-5)
    ref = LlamaForCausalLM(cfg)
    fused = LlamaForCausalLM(cfg)
    fused.load_state_dict(ref.state_dict())
    counts = apply_fusions(fused, {"rms_norm": "liger", "rope": "liger", "swiglu": "liger", "cross_entropy": "liger"})
    assert counts == {"rms_norm": 5, "rope": 2, "swiglu": 2, "cross_entropy": 1}  # 2 layers x 2 norms + final norm
    ids = torch.randint(0, 90, (2, 24))
    labels = torch.randint(0, 90, (2, 24))
    labels[0, :5] = -100
    losses = []
    for model in (ref, fused):
        loss_sum, n = model.loss(ids, labels)
        (loss_sum / n).backward()
        losses.append((loss_sum.detach(), n))
    assert int(losses[0][1]) == int(losses[1][1]) == 43
    torch.testing.assert_close(losses[1][0], losses[0][0], atol=1e-4, rtol=1e-5)
    for (name, p), q in zip(ref.named_parameters(), fused.parameters()):
        torch.testing.assert_close(q.grad, p.grad, atol=1e-5, rtol=1e-4, msg=name)
    kinds = collections.Counter(c[0] for c in calls)
    assert kinds == {"rms_norm": 5, "rope": 2, "swiglu": 2, "cross_entropy": 1}
    for name, args in calls:
        if name == "rms_norm":
            assert args == {"casting_mode": "llama", "in_place": False, "offset": 0.0}
        if name == "rope":
            assert args["cos_dtype"] == torch.float32 and args["q_shape"] == (2, 4, 24, 16)
        if name == "swiglu":
            assert args["contiguous"]
        if name == "cross_entropy":  # the valid vocabulary rows, summed, all tokens as rows
            assert args == {"weight_rows": 90, "reduction": "sum", "x_shape": (48, 64)}


# ---- choice rules ---------------------------------------------------------------------------------------------


@pytest.mark.compat
def test_auto_is_torch_on_cpu_and_liger_on_cuda_where_allowed(monkeypatch: pytest.MonkeyPatch) -> None:
    auto = dict.fromkeys(fusions.FUSION_KEYS, "auto")
    assert set(fusions.resolve_fusions(auto, "cpu").values()) == {"torch"}
    assert set(fusions.resolve_fusions(auto, "neuron_native").values()) == {"torch"}
    monkeypatch.setattr(fusions, "liger_unavailable_reason", lambda: None)  # as on a CUDA host with liger-kernel
    assert set(fusions.resolve_fusions(auto, "gpu").values()) == {"liger"}
    compiled = fusions.resolve_fusions(auto, "gpu", compiled=True)  # inductor fuses the in-layer ops itself
    assert compiled == {"rms_norm": "torch", "rope": "torch", "swiglu": "torch", "cross_entropy": "liger"}
    assert fusions.resolve_fusions(auto, "gpu", tensor_parallel=2)["cross_entropy"] == "torch"
    assert fusions.resolve_fusions(auto, "gpu", tiled_loss=True)["cross_entropy"] == "torch"
    monkeypatch.setattr(fusions, "liger_unavailable_reason", lambda: "liger_kernel does not import here")
    assert set(fusions.resolve_fusions(auto, "gpu").values()) == {"torch"}


def test_liger_refused_where_it_cannot_run(monkeypatch: pytest.MonkeyPatch) -> None:
    p = fusions.fusion_problems({"rms_norm": "liger"}, "cpu")
    assert len(p) == 1 and p[0].startswith("model.fusions.rms_norm: liger needs trainer.accelerator gpu")
    monkeypatch.setattr(fusions, "liger_unavailable_reason", lambda: None)
    p = fusions.fusion_problems({"cross_entropy": "liger"}, "gpu", tensor_parallel=2)
    assert len(p) == 1 and "tensor_model_parallel_size 1" in p[0]
    p = fusions.fusion_problems({"cross_entropy": "liger"}, "gpu", tiled_loss=True)
    assert len(p) == 1 and "model.tiled_loss_chunk_size: null" in p[0]
    p = fusions.fusion_problems({"swiglu": "nki", "rope": "fast"}, "gpu")
    assert [x.split(":")[0] for x in p] == ["model.fusions.rope", "model.fusions.swiglu"]
    with pytest.raises(ValueError, match="model.fusions.rope"):
        fusions.resolve_fusions({"rope": "fast"}, "gpu")
    monkeypatch.setattr(fusions, "liger_unavailable_reason", lambda: "liger_kernel does not import here")
    p = fusions.fusion_problems({"swiglu": "liger"}, "gpu")
    assert len(p) == 1 and "does not import" in p[0]


@pytest.mark.compat
def test_compile_auto_by_device(caplog: pytest.LogCaptureFixture) -> None:
    assert compile_enabled("auto", "gpu")
    with caplog.at_level(logging.INFO, logger="nxd_lc"):  # issue 39: eager on TorchNeuron until a run shows it
        assert not compile_enabled("auto", "neuron_native") and compile_enabled(True, "neuron_native")
    assert "auto stays eager on TorchNeuron's native neuron device" in caplog.text
    from nxd_lc.app.run import dry_run  # the dry run says so too, on every host
    from nxd_lc.config.schema import NxdConfig

    cfg = NxdConfig()
    assert "# model.compile: auto compiles the decoder layers on gpu (CUDA) only" in dry_run(cfg)
    cfg.model.compile = False
    assert "# model.compile:" not in dry_run(cfg)
    assert not compile_enabled("auto", "cpu") and not compile_enabled("auto", "xla")
    assert not compile_enabled("auto", "neuron")  # torch-xla based Neuron compiles its lazy graphs itself
    assert not compile_enabled("auto", "gpu", blocked_by="model_alignment_strategy.peft (LoRA)")
    assert compile_enabled(True, "cpu") and not compile_enabled(False, "gpu")
    with pytest.raises(ValueError, match="model.compile"):
        compile_enabled("yes", "gpu")


@pytest.mark.compat
def test_config_keys_validated() -> None:
    from nxd_lc.app.validation import load_config
    from nxd_lc.config.errors import ConfigError

    def raw(accelerator: str, **model: Any) -> dict[str, Any]:
        return {"trainer": {"devices": 1, "num_nodes": 1, "max_steps": 2, "accelerator": accelerator},
                "data": {"micro_batch_size": 1, "global_batch_size": 1},
                "model": {"model_config": "conf/tiny_llama_config.json", "encoder_seq_length": 64, **model}}

    assert load_config(raw("cpu"), check_paths=False).model.compile == "auto"  # the default
    assert load_config(raw("xla", compile="auto"), check_paths=False).model.compile == "auto"  # eager there, no error
    for bad in ("sometimes", 0, 1.0):
        with pytest.raises(ConfigError, match=rf"model.compile: {bad!r} is not one of true, false, auto"):
            load_config(raw("cpu", compile=bad), check_paths=False)
    with pytest.raises(ConfigError, match=r"model.fusions.rope: liger needs trainer.accelerator gpu"):
        load_config(raw("cpu", fusions={"rope": "liger"}), check_paths=False)
    with pytest.raises(ConfigError, match=r"model.fusions.swiglu: 'nki' is not a kernel choice"):
        load_config(raw("cpu", fusions={"swiglu": "nki"}), check_paths=False)
    lora = {**raw("cpu"), "data": {"train_dir": "records.jsonl"},
            "model_alignment_strategy": {"sft": {}, "peft": {"lora_rank": 4, "lora_alpha": 8,
                                                             "target_modules": ["qkv_proj"]}}}
    assert load_config(lora, check_paths=False).model.compile == "auto"  # auto stays eager with LoRA: no error


@pytest.mark.skipif(not torch.cuda.is_available(), reason="Liger-Kernel's Triton kernels need CUDA")
def test_liger_kernels_on_cuda() -> None:
    """On a CUDA host with liger-kernel: the liger kernels equal the torch kernels in loss and gradients (bf16)."""
    if fusions.liger_unavailable_reason() is not None:
        pytest.skip(fusions.liger_unavailable_reason())
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=2,
                      vocab_size=1000, num_hidden_layers=2, rms_norm_eps=1e-5)
    ref = LlamaForCausalLM(cfg).to("cuda", torch.bfloat16)
    fused = LlamaForCausalLM(cfg).to("cuda", torch.bfloat16)
    fused.load_state_dict(ref.state_dict())
    apply_fusions(fused, dict.fromkeys(fusions.FUSION_KEYS, "liger"))
    ids = torch.randint(0, 1000, (1, 512), device="cuda")
    labels = torch.randint(0, 1000, (1, 512), device="cuda")
    out = []
    for model in (ref, fused):
        loss_sum, n = model.loss(ids, labels)
        (loss_sum / n).backward()
        out.append(loss_sum / n)
    torch.testing.assert_close(out[1].float(), out[0].float(), atol=2e-2, rtol=1e-2)
    for (name, p), q in zip(ref.named_parameters(), fused.parameters()):
        torch.testing.assert_close(q.grad.float(), p.grad.float(), atol=3e-2, rtol=5e-2, msg=name)
