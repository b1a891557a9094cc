"""``model.moe`` / ``expert_model_parallel_size`` / ``precision.fp32_grads_cc`` configuration, ZeRO-1 with expert
parameters, checkpoint file names with ``ep_rank``, and the tiny Mixtral config trained at EP 2 through train.py."""

from __future__ import annotations

import glob
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_utils import run_distributed, shard_files
from torch import nn

from nxd_lc.app.validation import load_config
from nxd_lc.config.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]
TINY_MIXTRAL = str(REPO / "conf" / "tiny_mixtral_config.json")
TINY_LLAMA = str(REPO / "conf" / "tiny_llama_config.json")


def _raw(model_config: str = TINY_MIXTRAL, moe: dict[str, Any] | None = None, devices: int = 2,
         **ds: Any) -> dict[str, Any]:
    model: dict[str, Any] = {"model_config": model_config, "encoder_seq_length": 64}
    if moe is not None:
        model["moe"] = moe
    return {"trainer": {"devices": devices, "num_nodes": 1, "max_steps": 10},
            "distributed_strategy": {"tensor_model_parallel_size": 1, **ds},
            "data": {"micro_batch_size": 1, "global_batch_size": devices}, "model": model}


def _problems(raw: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(raw, world_size=raw["trainer"]["devices"])
    return str(e.value)


@pytest.mark.compat
def test_moe_keys_validate_against_the_model_config() -> None:
    load_config(_raw(moe={"num_experts": 8, "top_k": 2, "capacity_factor": 2.0}, expert_model_parallel_size=2),
                world_size=2)
    text = _problems(_raw(TINY_LLAMA, moe={"num_experts": 8}))
    assert "model.moe: " in text and "model_type 'llama', a dense model" in text
    text = _problems(_raw(moe={"routing_algorithm": "sinkhorn", "dropout": 0.1, "frequency": 0, "top_k": 9}))
    assert "not supported yet: model.moe.routing_algorithm='sinkhorn'" in text
    assert "not supported yet: model.moe.dropout=0.1" in text
    assert "model.moe.frequency: must be >= 1" in text
    assert "model.moe.top_k: experts per token must be an int in [1, 8] (num_experts), got 9" in text
    # EP: divides DP and the number of experts, only for MoE models
    assert "must divide the data-parallel size 4" in _problems(_raw(devices=4, expert_model_parallel_size=3))
    text = _problems(_raw(devices=6, moe={"num_experts": 8}, expert_model_parallel_size=3))
    assert "8 experts (model.moe.num_experts) are not divisible by EP 3" in text
    assert "needs a mixture-of-experts model" in _problems(_raw(TINY_LLAMA, expert_model_parallel_size=2))
    # combinations not built yet say so
    load_config({**_raw(devices=4, pipeline_model_parallel_size=2, expert_model_parallel_size=2)}, world_size=4)
    text = _problems({**_raw(), "model": {"model_config": TINY_MIXTRAL, "encoder_seq_length": 64, "compile": True}})
    assert "not supported yet: model.compile with mixture-of-experts" in text


def test_a_moe_key_overriding_a_different_config_json_value_is_said(caplog: pytest.LogCaptureFixture) -> None:
    """model.moe wins over config.json (NxDT), but a disagreement was silent (config.json's num_local_experts of
    10^9 trained as the YAML's 8 without a word): a warning names both."""
    with caplog.at_level("WARNING", logger="nxd_lc.moe.config"):
        load_config(_raw(moe={"num_experts": 4, "top_k": 2}), world_size=2)
    text = caplog.text
    assert f"model.moe.num_experts: 4 overrides num_local_experts=8 of {TINY_MIXTRAL}" in text, text
    assert "model.moe.top_k" not in text, text  # equal to config.json's: nothing to say


@pytest.mark.compat
def test_moe_options_follow_nxdt_dispatch_rules() -> None:
    from nxd_lc.config.schema import MoEConfig
    from nxd_lc.moe.config import moe_hf_overrides, moe_options

    assert moe_options(MoEConfig(capacity_factor=2.0, dropless=False)).capacity_factor == 2.0
    for moe in (MoEConfig(capacity_factor=2.0, dropless=True), MoEConfig(capacity_factor=0.0),
                MoEConfig(capacity_factor=None)):
        opts = moe_options(moe)
        assert opts.capacity_factor is None and opts.dropless
    assert moe_options(None).dropless and moe_options(MoEConfig(frequency=2)).frequency == 2
    assert moe_hf_overrides(MoEConfig(num_experts=4, top_k=1, router_aux_loss_coef=0.5)) == {
        "num_local_experts": 4, "num_experts_per_tok": 1, "router_aux_loss_coef": 0.5}


@pytest.mark.compat
def test_build_model_reads_mixtral_and_moe_overrides_config_json() -> None:
    from nxd_lc.app.build import build_model
    from nxd_lc.models.mixtral import MixtralForCausalLM
    from nxd_lc.moe.layer import MoE

    cfg = load_config(_raw(devices=1, moe={"num_experts": 4, "top_k": 1, "frequency": 2, "capacity_factor": 1.5,
                                           "output_router_logits": False}), world_size=1)
    hf, model = build_model(cfg)
    assert isinstance(model, MixtralForCausalLM) and hf.num_local_experts == 4 and hf.num_experts_per_tok == 1
    kinds = [type(layer.mlp).__name__ for layer in model.layers]
    assert kinds == ["MoE", "LlamaMLP", "MoE", "LlamaMLP"]  # frequency 2: layers 0 and 2
    moe = model.layers[0].mlp
    assert isinstance(moe, MoE) and moe.capacity_factor == 1.5 and moe.experts.gate_up_proj.shape[0] == 4
    assert not model.output_router_logits  # model.moe wins over config.json's true


@pytest.mark.compat
def test_router_weight_stays_fp32_in_bf16_modes() -> None:
    from nxd_lc.app.build import build_model
    from nxd_lc.precision.policy import apply_precision, resolve_precision

    cfg = load_config({**_raw(devices=1), "precision": {"type": "mixed_precision"}}, world_size=1)
    _, model = build_model(cfg)
    apply_precision(model, resolve_precision(cfg))
    moe = model.layers[0].mlp
    assert moe.router.weight.dtype == torch.float32
    assert moe.experts.gate_up_proj.dtype == torch.bfloat16 and model.embed_tokens.weight.dtype == torch.bfloat16


@pytest.mark.compat
def test_checkpoint_names_carry_ep_rank(tmp_path: Path) -> None:
    from nxd_lc.checkpoint import sharded
    from nxd_lc.checkpoint.reshard import saved_layout

    assert sharded.checkpoint_file_name(0, 1, 0, 3) == "dp_rank_00_ep_rank_03_tp_rank_01_pp_rank_00.pt"
    assert sharded.checkpoint_file_name(2, 0, 1) == "dp_rank_02_tp_rank_00_pp_rank_01.pt"
    # one process plays both EP ranks: stage both files, then publish once
    staged = [sharded.stage_checkpoint(str(tmp_path), "t", model_state={"w": torch.full((2,), float(ep))},
                                       optim_state={"s": ep}, user_content={"step": 1}, dp_rank=0, tp_rank=0,
                                       pp_rank=0, is_global_zero=ep == 0, write_model=True, write_optim=True,
                                       use_xser=False, ep_rank=ep) for ep in (0, 1)]
    for s in staged:
        s.write()
    staged[0].publish()
    tag = tmp_path / "t"
    assert sorted(os.listdir(tag / "model")) == ["dp_rank_00_ep_rank_00_tp_rank_00_pp_rank_00.pt",
                                                 "dp_rank_00_ep_rank_01_tp_rank_00_pp_rank_00.pt"]
    assert sorted(os.listdir(tag / "optim")) == ["dp_rank_00_ep_rank_00_tp_rank_00_pp_rank_00.pt",
                                                 "dp_rank_00_ep_rank_01_tp_rank_00_pp_rank_00.pt"]
    layout = saved_layout(str(tag))
    assert (layout.tp, layout.pp, layout.ep, layout.optim_dp) == (1, 1, 2, 1)
    model, optim, _ = sharded.load_checkpoint(str(tmp_path), "t", dp_rank=1, tp_rank=0, pp_rank=0, ep_rank=1)
    assert torch.equal(model["w"], torch.ones(2)) and optim == {"s": 1}  # EP rank 1's files, DP rank 0's optim


def _fp32_grads_cc_worker(rank: int, world: int) -> None:
    from nxd_lc.distributed import collectives, grads
    from nxd_lc.distributed import parallel_state as ps

    ps.initialize_model_parallel()
    values = [1.0 + 2.0 ** -7, 3 * 2.0 ** -8]  # both exact in bf16
    real, seen = collectives.all_reduce, []

    def spy(t: torch.Tensor, group: Any, op: str = "sum") -> torch.Tensor:
        seen.append(t.dtype)
        return real(t, group, op)

    collectives.all_reduce = spy  # our own module, observed for the test
    try:
        for fp32 in (False, True):
            p = nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))
            p.grad = torch.full((3,), values[rank], dtype=torch.bfloat16)
            grads.allreduce_data_parallel_gradients([p], fp32=fp32)
            assert p.grad.dtype == torch.bfloat16
            # the mean computed in fp32 and rounded once to bf16 (both paths agree on these values)
            expected = torch.tensor(sum(values) / 2, dtype=torch.float32).to(torch.bfloat16)
            assert torch.equal(p.grad, expected.expand(3)), (fp32, p.grad)
    finally:
        collectives.all_reduce = real
    assert seen == [torch.bfloat16, torch.float32], seen


@pytest.mark.compat
@pytest.mark.distributed
def test_fp32_grads_cc_reduces_bf16_gradients_in_fp32() -> None:
    run_distributed(_fp32_grads_cc_worker, 2)


def _zero1_ep_worker(rank: int, world: int) -> None:
    from nxd_lc.distributed import parallel_state as ps
    from nxd_lc.moe.layer import mark_expert_parameter
    from nxd_lc.optim.wrapper import NxDOptimizer
    from nxd_lc.precision.policy import PrecisionPolicy

    torch.set_num_threads(1)
    ps.initialize_model_parallel(expert_model_parallel_size=2)  # DP 4 = expert-DP 2 x EP 2
    ep = ps.get_expert_model_parallel_rank()
    dense = nn.Parameter(torch.randn(7, 3, generator=torch.Generator().manual_seed(0)))
    expert = mark_expert_parameter(nn.Parameter(torch.randn(2, 5, 3, generator=torch.Generator().manual_seed(10 + ep))))
    ref = [nn.Parameter(dense.detach().clone()), nn.Parameter(expert.detach().clone())]
    policy = PrecisionPolicy(mode="fp32", param_dtype=torch.float32, autocast_dtype=None, master_weights=False,
                             fp32_grad_acc=False, stochastic_rounding=False, optim_state_dtype=torch.float32,
                             reduce_dtype=torch.float32)

    def adamw(groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
        return torch.optim.AdamW(groups, lr=0.1, weight_decay=0.01)

    opt = NxDOptimizer([{"params": [dense, expert]}], adamw, policy, zero1=True)
    ref_opt = adamw([{"params": ref}])
    # shards: dense over DP 4 (ceil(21 / 4) = 6), experts over their expert-DP group of 2 (ceil(30 / 2) = 15)
    assert [s.shard_numel for s in opt.slots] == [6, 15]
    assert [s.domain.world for s in opt.slots] == [4, 2]
    for step in range(3):  # reduced gradients: equal over DP for the dense weight, over expert-DP for experts
        g_dense = torch.randn(7, 3, generator=torch.Generator().manual_seed(100 + step))
        g_expert = torch.randn(2, 5, 3, generator=torch.Generator().manual_seed(200 + 10 * step + ep))
        for p, q, g in ((dense, ref[0], g_dense), (expert, ref[1], g_expert)):
            p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        ref_opt.step()
        torch.testing.assert_close(dense.detach(), ref[0].detach(), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(expert.detach(), ref[1].detach(), rtol=1e-6, atol=1e-6)
    masters = opt.full_master_weights()
    assert [m.shape for _, m in masters] == [(7, 3), (2, 5, 3)]
    torch.testing.assert_close(masters[1][1], ref[1].detach(), rtol=1e-6, atol=1e-6)
    assert opt.state_dict()["nxd"]["zero1_expert_world"] == 2


@pytest.mark.compat
@pytest.mark.distributed
def test_zero1_shards_expert_parameters_over_expert_data_parallel_group() -> None:
    """ZeRO-1 with EP 2 on 4 ranks steps dense and expert parameters exactly as plain torch AdamW on the full
    tensors, each expert parameter sharded over the 2 ranks that hold the same experts."""
    run_distributed(_zero1_ep_worker, 4)


@pytest.mark.lane1_only  # end-to-end; the torch-2.9 lane covers its parts in the unit tests above
@pytest.mark.distributed
@pytest.mark.slow
def test_tiny_mixtral_config_trains_at_ep2_and_resumes(tmp_path: Path) -> None:
    """conf/cpu_tiny_mixtral_config.yaml (EP 2, ZeRO-1, capacity factor 2.0, aux loss) in bf16 mixed precision with
    fp32 gradient collectives: trains, writes NxD's EP-named shards (each EP rank's own experts), resumes."""
    from test_e2e import TORCHRUN, _run, _small_corpus

    from nxd_lc.checkpoint import sharded

    corpus, log_dir = _small_corpus(str(tmp_path)), tmp_path / "run"

    def cmd(steps: int) -> list[str]:
        return [TORCHRUN, "--standalone", "--nproc_per_node=2", "train.py", "--config-name",
                "cpu_tiny_mixtral_config", f"exp_manager.explicit_log_dir={log_dir}", f"trainer.max_steps={steps}",
                "trainer.log_every_n_steps=1", "trainer.val_check_interval=2", "trainer.limit_val_batches=1",
                "+trainer.enable_progress_bar=false", "exp_manager.checkpoint_callback_params.every_n_train_steps=2",
                "~data.builtin_corpus", f"+data.train_dir={corpus}", "+data.file_glob=**/*.py",
                "data.tokenizer.vocab_size=1024", f"+data.tokenizer.cache_dir={tmp_path / 'cache'}",
                "model.encoder_seq_length=128", "model.optim.sched.warmup_steps=1",
                "precision.type=mixed_precision", "+precision.fp32_grads_cc=true"]

    first = _run(cmd(2))
    assert first.returncode == 0, first.stdout[-4000:] + first.stderr[-4000:]
    assert "step 2/2 | loss" in first.stdout + first.stderr
    tag = log_dir / "checkpoints" / "cpu_tiny_mixtral--step=2-consumed_samples=8.0"
    model_files = shard_files(tag / "model")
    assert model_files == ["dp_rank_00_ep_rank_00_tp_rank_00_pp_rank_00.pt",
                           "dp_rank_00_ep_rank_01_tp_rank_00_pp_rank_00.pt"]
    optim_files = shard_files(tag / "optim")
    assert optim_files == ["dp_rank_00_tp_rank_00_pp_rank_00.pt", "dp_rank_01_tp_rank_00_pp_rank_00.pt"]
    states = [sharded.load_checkpoint(str(tag.parent), tag.name, dp_rank=0, tp_rank=0, pp_rank=0, ep_rank=e,
                                      load_optim=False)[0] for e in (0, 1)]
    key = "model.layers.0.mlp.experts.gate_up_proj"
    assert states[0][key].shape == (4, 2 * 344, 256)  # 8 experts / EP 2, [gate; up] rows
    assert not torch.equal(states[0][key], states[1][key])  # each EP rank saved its own experts
    router = "model.layers.0.mlp.router.weight"
    assert states[0][router].dtype == torch.float32 and states[0][key].dtype == torch.bfloat16
    assert torch.equal(states[0][router], states[1][router])  # the router is replicated over EP
    assert glob.glob(str(tag / "model" / "*.pt.tensors"))  # xser
    second = _run(cmd(4))
    assert second.returncode == 0, second.stdout[-4000:] + second.stderr[-4000:]
    assert f"resuming from {tag}" in second.stdout
    assert "step 4/4 | loss" in second.stdout + second.stderr
    last = log_dir / "checkpoints" / "cpu_tiny_mixtral--step=4-consumed_samples=16.0"
    assert json.loads((last / "done").read_text())["step"] == 4
    # the EP 2 checkpoint converts to HF on 2 processes (one per EP rank); transformers reads every expert back
    out = tmp_path / "hf"
    conv = _run([TORCHRUN, "--standalone", "--nproc_per_node=2", "-m", "nxd_lc.cli.convert", "--config-name",
                 "cpu_tiny_mixtral_config", "--checkpoint", str(last), "--output", str(out),
                 "--save-tokenizer", "false"])
    assert conv.returncode == 0, conv.stdout[-4000:] + conv.stderr[-4000:]
    from transformers import MixtralForCausalLM as HFMixtral

    hf = HFMixtral.from_pretrained(out).state_dict()
    shards = [sharded.load_checkpoint(str(last.parent), last.name, dp_rank=0, tp_rank=0, pp_rank=0, ep_rank=e,
                                      load_optim=False)[0] for e in (0, 1)]
    full = torch.cat([shards[0][key], shards[1][key]]).float()  # experts 0-3 from EP rank 0, 4-7 from EP rank 1
    assert torch.equal(hf["model.layers.0.mlp.experts.gate_up_proj"].float(), full)
    assert torch.equal(hf["model.layers.0.mlp.gate.weight"].float(), shards[0][router].float())
