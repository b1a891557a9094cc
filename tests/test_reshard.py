"""Re-sharding a training checkpoint on load (:mod:`nxd_lc.checkpoint.reshard`), 4 gloo processes.

One AdamW step with the gradient ``g = C * W0`` is taken from an HF model's weights ``W0`` at TP 2 x DP 2 with
ZeRO-1 and saved; the checkpoint is then loaded at TP 4 (``kv_replicator`` 2, no ZeRO-1, a plain torch optimizer),
saved again, loaded at TP 1 x PP 2 x DP 2 with ZeRO-1, saved again and loaded at the first layout. At every load
the weights, both Adam moments, the fp32 master weights and ``step`` are compared with the closed form of one
AdamW step (bias-corrected first step: ``W1 = W0 - lr * g / (|g| + eps)``, ``exp_avg = (1 - b1) g``,
``exp_avg_sq = (1 - b2) g^2``), computed on the full HF tensors in the test process and sliced for each rank by
the HF loader (:func:`nxd_lc.models.llama.hf_adapter.load_hf_weights`, checked against transformers elsewhere).
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from dist_utils import run_distributed
from safetensors.torch import save_file
from transformers import LlamaConfig
from transformers import LlamaForCausalLM as HFLlama

from nxd_lc.checkpoint import nxd_format, reshard, sharded
from nxd_lc.config.schema import NxdConfig
from nxd_lc.distributed import parallel_state as ps
from nxd_lc.models.llama import LlamaForCausalLM, load_hf_weights
from nxd_lc.optim import NxDOptimizer, build_optimizer
from nxd_lc.pipeline.split import rank_model_part
from nxd_lc.precision.policy import resolve_precision

pytestmark = pytest.mark.compat  # torch-2.9 compatibility subset (lane 2; docs/testing.md)

C, LR, B1, B2, EPS = 0.5, 1e-2, 0.9, 0.95, 1e-8
LAYERS = 4
# (TP, PP, kv_replicator, zero1, KV-replica layout) of the start and the four loads, in order; world size 4
# (DP = 4 / (TP * PP)); TP 4 -> TP 4 converts NxD's Trn1 layout of the replicas into its Trn2 one
LAYOUTS = [(2, 1, 1, True, "interleaved"), (4, 1, 2, False, "interleaved"), (4, 1, 2, False, "adjacent"),
           (1, 2, 1, True, "interleaved"), (2, 1, 1, True, "interleaved")]


def _hf_config(tied: bool) -> LlamaConfig:
    # vocab 66: padded to a multiple of TP 4; 4 query / 2 KV heads: KV replicated at TP 4
    return LlamaConfig(vocab_size=66, hidden_size=32, intermediate_size=48, num_hidden_layers=LAYERS,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                       tie_word_embeddings=tied)


def _write_references(root: str, tied: bool) -> None:
    """HF directories ``w0`` (the start), ``w1``, ``m`` and ``v`` (weights and moments after one AdamW step)."""
    torch.manual_seed(0)
    hf = HFLlama(_hf_config(tied))
    w0 = {k: v.detach().clone().contiguous() for k, v in hf.state_dict().items() if k != "lm_head.weight" or not tied}
    g = {k: C * v for k, v in w0.items()}
    refs = {"w0": w0,
            "w1": {k: w0[k] - LR * g[k] / (g[k].abs() + EPS) for k in w0},
            "m": {k: (1 - B1) * g[k] for k in w0},
            "v": {k: (1 - B2) * g[k] * g[k] for k in w0}}
    for name, state in refs.items():
        os.makedirs(os.path.join(root, name))
        save_file(state, os.path.join(root, name, "model.safetensors"))


def _cfg(zero1: bool) -> NxdConfig:
    cfg = NxdConfig()
    cfg.precision.type = "fp32"
    cfg.distributed_strategy.zero1 = zero1
    cfg.model.optim.name = "adamw"
    cfg.model.optim.lr = LR
    cfg.model.optim.weight_decay = 0.0
    cfg.model.optim.betas = [B1, B2]
    cfg.model.optim.eps = EPS
    return cfg


def _build(tied: bool, layout: tuple[int, int, int, bool, str], weights: str | None) -> tuple[LlamaForCausalLM, Any]:
    tp, pp, kv, zero1, kv_layout = layout
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, kv_replicator=kv,
                                 kv_replica_layout=kv_layout)
    part = rank_model_part(LAYERS, pp, ps.get_pipeline_model_parallel_rank()) if pp > 1 else {}
    torch.manual_seed(1234)  # fresh weights unlike W0: a load that skips a tensor is caught
    model = LlamaForCausalLM(_hf_config(tied), kv_replicator=kv, **part)
    if weights is not None:
        load_hf_weights(model, weights)
    cfg = _cfg(zero1)
    opt = build_optimizer(list(model.named_parameters()), cfg.model.optim, cfg.model.do_layer_norm_weight_decay,
                          policy=resolve_precision(cfg), zero1=zero1, seed=0)
    assert isinstance(opt, NxDOptimizer) == zero1
    return model, opt


def _expected(tied: bool, layout: tuple[int, int, int, bool, str], root: str) -> dict[str, dict[str, torch.Tensor]]:
    """Per reference (w1, m, v): parameter name -> this rank's slice, through the HF loader at this layout."""
    out = {}
    for ref in ("w1", "m", "v"):
        model = LlamaForCausalLM(_hf_config(tied), kv_replicator=layout[2],
                                 **(rank_model_part(LAYERS, layout[1], ps.get_pipeline_model_parallel_rank())
                                    if layout[1] > 1 else {}))
        load_hf_weights(model, os.path.join(root, ref))
        out[ref] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out


def _save(model: LlamaForCausalLM, opt: Any, zero1: bool, root: str, tag: str) -> None:
    from nxd_lc.lightning.strategy import checkpoint_ranks

    ranks = checkpoint_ranks(zero1)
    writer = ps.get_data_parallel_rank() == 0
    sharded.save_checkpoint(root, tag, model_state={f"model.{k}": v for k, v in model.state_dict().items()},
                            optim_state={"optimizer_states": [opt.state_dict()], "lr_schedulers": []},
                            user_content={"global_step": 1}, is_global_zero=torch.distributed.get_rank() == 0,
                            write_model=writer, write_optim=writer or zero1, use_xser=True, step=1, **ranks)


def _check(model: LlamaForCausalLM, opt: Any, expected: dict[str, dict[str, torch.Tensor]], where: str) -> None:
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), expected["w1"][name], rtol=0, atol=1e-6, msg=f"{where} {name}")
    sd = opt.state_dict()
    names = [n for g in sd["param_groups"] for n in g["param_names"]]
    idx = [i for g in sd["param_groups"] for i in g["params"]]
    slots = opt.slots if isinstance(opt, NxDOptimizer) else None
    checked = 0
    for k, (i, name) in enumerate(zip(idx, names)):
        st = sd["state"][i]
        assert int(st["step"]) == 1, (where, name)
        for key, ref in (("exp_avg", "m"), ("exp_avg_sq", "v")):
            want = expected[ref][name]
            if slots is not None and opt.zero1:
                want = want.reshape(-1)[slots[k].start:slots[k].stop]
            torch.testing.assert_close(st[key].reshape(want.shape), want, rtol=1e-6, atol=1e-9,
                                       msg=f"{where} {key} {name}")
            checked += 1
        if slots is not None:
            master = sd["nxd"]["master_weights"][k]
            want = expected["w1"][name].reshape(-1)[slots[k].start:slots[k].stop] if opt.zero1 else \
                expected["w1"][name]
            torch.testing.assert_close(master.reshape(want.shape), want, rtol=0, atol=1e-6, msg=f"{where} master")
    assert checked == 2 * len(names) > 0


def _worker(rank: int, world: int, root: str, tied: bool) -> None:
    torch.set_num_threads(1)
    ckpt = os.path.join(root, "ckpt")
    # start: TP 2 x DP 2, ZeRO-1; one step with g = C * W0
    model, opt = _build(tied, LAYOUTS[0], os.path.join(root, "w0"))
    for p in model.parameters():
        p.grad = C * p.detach().clone()
    opt.step()
    _check(model, opt, _expected(tied, LAYOUTS[0], root), "trained")
    _save(model, opt, LAYOUTS[0][3], ckpt, "step=1")
    ps.destroy_model_parallel()
    for n, layout in enumerate(LAYOUTS[1:], start=1):
        tag = "step=1" if n == 1 else f"hop{n - 1}"
        model, _ = _build(tied, layout, None)
        template = {f"model.{k}": v for k, v in model.state_dict().items()}
        state = reshard.reshard_model_state(model, template, os.path.join(ckpt, tag))
        model.load_state_dict({k[len("model."):]: v for k, v in state.items()})
        cfg = _cfg(layout[3])  # the optimizer is built over the loaded weights (Lightning's order)
        opt = build_optimizer(list(model.named_parameters()), cfg.model.optim, False, policy=resolve_precision(cfg),
                              zero1=layout[3])
        opt_state, _ = reshard.reshard_optimizer_state(model, opt, os.path.join(ckpt, tag))
        opt.load_state_dict(opt_state)
        _check(model, opt, _expected(tied, layout, root), f"{tag} -> TP {layout[0]} PP {layout[1]}")
        _save(model, opt, layout[3], ckpt, f"hop{n}")
        ps.destroy_model_parallel()


@pytest.mark.slow
@pytest.mark.parametrize("tied", [False, pytest.param(True, marks=pytest.mark.lane1_only)], ids=["untied", "tied"])
def test_reshard_chain_matches_closed_form_adamw_step(tmp_path: Any, tied: bool) -> None:
    _write_references(str(tmp_path), tied)
    run_distributed(_worker, 4, str(tmp_path), tied)
    assert reshard.saved_layout(str(tmp_path / "ckpt" / "hop4")) == reshard.SavedLayout(tp=2, pp=1, optim_dp=2)
    assert reshard.saved_layout(str(tmp_path / "ckpt" / "hop3")) == reshard.SavedLayout(tp=1, pp=2, optim_dp=2)
    for hop, kv_layout in (("hop2", "adjacent"), ("hop1", "interleaved")):
        assert reshard.saved_layout(str(tmp_path / "ckpt" / hop)) == reshard.SavedLayout(tp=4, pp=1, optim_dp=1)
        assert nxd_format.checkpoint_kv_layout(str(tmp_path / "ckpt" / hop))[0] == kv_layout


def _losses_of(out: Any, log_dir: str) -> dict[int, float]:
    from tests.test_fault_injection import _losses

    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    merged: dict[int, float] = {}
    for launch in _losses(log_dir):
        merged.update(launch)
    return merged


@pytest.mark.lane1_only  # end-to-end (2 torchrun launches); the unit test above runs in both lanes
@pytest.mark.distributed
@pytest.mark.slow
def test_train_py_resumes_a_tp2_checkpoint_at_tp1_dp2_zero1(tmp_path: Any) -> None:
    """train.py: a TP 2 + SP run saved at step 2 resumes at TP 1 x DP 2 with ZeRO-1 (same global batch) and its
    losses at steps 3-4 are those of the uninterrupted TP 2 run (step 4's depends on the re-sharded Adam moments,
    master weights and LR-scheduler state; the exact values of those are checked by the test above)."""
    from tests.test_e2e import _run, _small_corpus, _train_cmd

    corpus = _small_corpus(str(tmp_path))
    cache = str(tmp_path / "cache")
    ref_dir = str(tmp_path / "tp2")
    ref = _losses_of(_run(_train_cmd(ref_dir, corpus, cache, max_steps=4)), ref_dir)
    ckpt = os.path.join(ref_dir, "checkpoints", "cpu_tiny_llama--step=2-consumed_samples=8.0")
    assert os.path.isfile(os.path.join(ckpt, "done")) and sorted(ref) == [1, 2, 3, 4]
    dp2 = ["distributed_strategy.tensor_model_parallel_size=1", "distributed_strategy.sequence_parallel=false",
           "distributed_strategy.zero1=true", f"exp_manager.resume_from_checkpoint='{ckpt}'"]
    new_dir = str(tmp_path / "dp2")
    out = _run(_train_cmd(new_dir, corpus, cache, max_steps=4) + dp2)
    resumed = _losses_of(out, new_dir)
    assert "re-sharded the optimizer state" in out.stdout + out.stderr
    assert sorted(resumed) == [3, 4], resumed
    for step in (3, 4):
        assert resumed[step] == pytest.approx(ref[step], rel=2e-4, abs=0), (step, resumed, ref)
