"""``model.enable_cuda_graph`` (issue 41, item 3): compiled decoder layers replayed as CUDA graphs.

On CPU: the configuration rules (CUDA, compiled layers, no TP / CP / PP yet), that the layers are compiled with
inductor's ``mode="reduce-overhead"`` only when asked, and that each training step marks a new CUDA-graph step.
On CUDA (run by benchmarks/device/accel_step.sh when a GPU is lent): three training steps with CUDA graphs give the
losses and gradients of the same compiled layers without them.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from transformers import LlamaConfig

from nxd_lc.app.validation import load_config
from nxd_lc.app.validation.model import cuda_graph_problems
from nxd_lc.config.errors import ConfigError
from nxd_lc.models.common import compile as compile_mod
from nxd_lc.models.llama import LlamaForCausalLM

pytestmark = pytest.mark.compat


def _raw(accelerator: str = "auto", compile: Any = True, tp: int = 1, **model: Any) -> dict[str, Any]:
    return {"trainer": {"devices": tp, "num_nodes": 1, "max_steps": 2, "accelerator": accelerator},
            "distributed_strategy": {"tensor_model_parallel_size": tp},
            "data": {"micro_batch_size": 1, "global_batch_size": 1},
            "model": {"model_config": "conf/tiny_llama_config.json", "encoder_seq_length": 64,
                      "enable_cuda_graph": True, "compile": compile, **model}}


def _problems(raw: dict[str, Any]) -> list[str]:
    """The enable_cuda_graph problems of a config (ConfigError's list, filtered)."""
    try:
        load_config(raw)
    except ConfigError as e:
        return [p for p in e.problems if "enable_cuda_graph" in p]
    return []


def test_config_rules() -> None:
    cfg = load_config(_raw())
    assert cfg.model.enable_cuda_graph is True and cuda_graph_problems(cfg) == []
    assert load_config({**_raw(), "model": {**_raw()["model"], "enable_cuda_graph": False}}).model.enable_cuda_graph \
        is False
    assert _problems(_raw(accelerator="cpu")) == [
        "model.enable_cuda_graph: true needs CUDA (trainer.accelerator gpu), not cpu; set it false"]
    eager = _problems(_raw(compile=False))
    assert len(eager) == 1 and "model.compile is false" in eager[0]
    assert _problems(_raw(tp=2)) == [
        "not supported yet: model.enable_cuda_graph: true with distributed_strategy.tensor_model_parallel_size 2 "
        "(collectives inside captured graphs are not checked); set it false"]
    # compile auto that stays eager (activation offload blocks it): nothing to capture
    kept_eager = _problems(_raw(compile="auto", activations_checkpoint_granularity="full", activations_offload=True))
    assert len(kept_eager) == 1 and "keeps the decoder layers eager" in kept_eager[0]


def _tiny() -> LlamaForCausalLM:
    return LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                        num_key_value_heads=2, vocab_size=64, num_hidden_layers=2))


def test_layers_compile_with_reduce_overhead_only_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(nn.Module, "compile", lambda self, **kw: calls.append(kw))
    assert compile_mod.compile_decoder_layers(_tiny(), "inductor", cuda_graphs=True) == 2
    assert calls == [{"backend": "inductor", "fullgraph": True, "mode": "reduce-overhead"}] * 2
    calls.clear()
    compile_mod.compile_decoder_layers(_tiny(), "inductor")
    assert calls == [{"backend": "inductor", "fullgraph": True}] * 2
    with pytest.raises(ValueError, match="model.enable_cuda_graph: needs the inductor backend"):
        compile_mod.compile_decoder_layers(_tiny(), "neuron", cuda_graphs=True)


def test_each_training_step_marks_a_cuda_graph_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Lightning module's training_step calls the CUDA-graph step mark (before its forward) only with the key."""
    from nxd_lc.lightning import module as module_mod

    marks: list[int] = []
    monkeypatch.setattr(module_mod, "mark_cuda_graph_step", lambda: marks.append(1))
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(2))
    compile_mod.mark_cuda_graph_step()
    assert marks == [2]  # the real function is torch's step mark
    marks.clear()

    class Probe(module_mod.NxDLanguageModel):  # only what training_step touches
        def __init__(self, enabled: bool) -> None:
            nn.Module.__init__(self)
            self.cfg = type("C", (), {"model": type("M", (), {"enable_cuda_graph": enabled})()})()
            self.pipeline = None

        def _context_parallel_shard(self, batch: Any) -> Any:
            return batch

        def _loss(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
            marks.append(0)  # the forward runs after the mark
            return torch.tensor(3.0), torch.tensor(2.0)

        def _accumulate_loss(self, loss: torch.Tensor) -> None:
            pass

    for enabled, expected in ((True, [1, 0]), (False, [0])):
        marks.clear()
        Probe(enabled).training_step({}, 0)
        assert marks == expected, (enabled, marks)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_steps_match_compiled_layers() -> None:
    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(hidden_size=256, intermediate_size=512, num_attention_heads=4,
                                        num_key_value_heads=2, vocab_size=512, num_hidden_layers=2))
    ids = torch.randint(0, 512, (1, 256), generator=torch.Generator().manual_seed(1)).cuda()
    labels = torch.roll(ids, -1, dims=1)
    runs = []
    for cuda_graphs in (False, True):
        model = LlamaForCausalLM(base.config)
        model.load_state_dict(base.state_dict())
        model = model.to(device="cuda", dtype=torch.bfloat16)
        compile_mod.compile_decoder_layers(model, "inductor", cuda_graphs=cuda_graphs)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        losses = []
        for _ in range(3):
            if cuda_graphs:
                compile_mod.mark_cuda_graph_step()
            opt.zero_grad(set_to_none=True)
            loss_sum, n = model.loss(ids, labels)
            loss = loss_sum / n
            loss.backward()
            opt.step()
            losses.append(float(loss))
        runs.append((losses, {k: p.grad.float() for k, p in model.named_parameters()}))
    (ref_losses, ref_grads), (losses, grads) = runs
    assert losses == pytest.approx(ref_losses, abs=1e-2)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, atol=2e-3, rtol=5e-2, msg=name)
