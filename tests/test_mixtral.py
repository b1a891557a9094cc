"""nxd_lc's MixtralForCausalLM against transformers' MixtralForCausalLM with the same weights (loaded from the
safetensors files transformers writes): loss with the router's load-balancing term, the aux loss itself, logits and
every gradient, single-process and at TP 2 + SP and EP 2 (gloo), and under pipeline parallelism (PP 2, 1F1B and
interleaved) against transformers' gradient accumulation over the same micro-batches."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from dist_utils import local_shard, run_distributed
from transformers import MixtralConfig
from transformers import MixtralForCausalLM as HFMixtral

from nxd_lc.distributed import parallel_state
from nxd_lc.models.llama.hf_adapter import load_hf_weights
from nxd_lc.models.mixtral import MixtralForCausalLM
from nxd_lc.moe.config import MoEOptions

COEF = 0.05


def _config() -> MixtralConfig:
    return MixtralConfig(vocab_size=96, hidden_size=32, intermediate_size=24, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                         max_position_embeddings=64, output_router_logits=True, router_aux_loss_coef=COEF,
                         tie_word_embeddings=False)


def _save_hf(path: Path, layers: int = 2) -> None:
    torch.manual_seed(0)
    config = _config()
    config.num_hidden_layers = layers
    model = HFMixtral(config)
    with torch.no_grad():
        for p in model.parameters():  # larger than HF's init so routing and experts matter
            p.normal_(0, 0.2)
    model.save_pretrained(path)


def _hf_reference(path: Path, ids: torch.Tensor, layers: int = 2) -> dict[str, Any]:
    """transformers: loss (CE + coef * aux), aux, logits and gradients under nxd_lc's parameter names (full)."""
    model = HFMixtral.from_pretrained(path, attn_implementation="eager").float()
    assert model.config.num_hidden_layers == layers
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    g = {n: p.grad for n, p in model.named_parameters()}
    grads = {"embed_tokens.weight": g["model.embed_tokens.weight"], "norm.weight": g["model.norm.weight"],
             "lm_head.weight": g["lm_head.weight"]}
    for i in range(model.config.num_hidden_layers):
        hp, p = f"model.layers.{i}", f"layers.{i}"
        attn = [g[f"{hp}.self_attn.{n}_proj.weight"] for n in "qkv"]
        grads.update({
            f"{p}.input_layernorm.weight": g[f"{hp}.input_layernorm.weight"],
            f"{p}.post_attention_layernorm.weight": g[f"{hp}.post_attention_layernorm.weight"],
            f"{p}.self_attn.qkv_proj.weight_qkv": torch.cat(attn),
            f"{p}.self_attn.o_proj.weight": g[f"{hp}.self_attn.o_proj.weight"],
            f"{p}.mlp.router.weight": g[f"{hp}.mlp.gate.weight"],
            f"{p}.mlp.experts.gate_up_proj": g[f"{hp}.mlp.experts.gate_up_proj"],
            f"{p}.mlp.experts.down_proj": g[f"{hp}.mlp.experts.down_proj"],
        })
    return {"loss": out.loss.detach(), "aux": out.aux_loss.detach(), "logits": out.logits.detach(), "grads": grads}


def _labels(ids: torch.Tensor) -> torch.Tensor:
    return torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)


def _shard(model: torch.nn.Module, name: str, full: torch.Tensor) -> torch.Tensor:
    """This rank's part of a full tensor: experts split over EP first, then TP as :func:`local_shard`."""
    if getattr(model.get_parameter(name), "expert_model_parallel", False):
        full = full.chunk(parallel_state.get_expert_model_parallel_world_size())[
            parallel_state.get_expert_model_parallel_rank()]
    return local_shard(model, name, full)


def _check(model: MixtralForCausalLM, ids: torch.Tensor, ref: dict[str, Any], expert_grads: dict[str, torch.Tensor],
           sp: bool, msg: str) -> None:
    model.zero_grad(set_to_none=True)
    loss_sum, num = model.loss(ids, _labels(ids))
    loss = loss_sum / num
    loss.backward()
    torch.testing.assert_close(loss.detach(), ref["loss"], atol=1e-5, rtol=1e-5, msg=f"{msg} loss")
    torch.testing.assert_close(model.aux_loss().detach(), ref["aux"], atol=1e-6, rtol=1e-5, msg=f"{msg} aux")
    tp_group = parallel_state.get_tensor_model_parallel_group()
    for name, param in model.named_parameters():
        grad = param.grad
        if sp and getattr(param, "sequence_parallel_enabled", False) and tp_group is not None:
            grad = grad.clone()  # norms and the router see this rank's tokens: summed over TP in training
            torch.distributed.all_reduce(grad, group=tp_group)
        want = expert_grads.get(name, ref["grads"][name])
        torch.testing.assert_close(grad, _shard(model, name, want), atol=2e-5, rtol=1e-4, msg=f"{msg} {name}")


def _ids(seed: int) -> torch.Tensor:
    return torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(seed))


@pytest.mark.compat  # torch-2.9 compatibility subset (lane 2)
def test_single_process_matches_transformers(tmp_path: Path) -> None:
    _save_hf(tmp_path)
    ids = _ids(0)
    ref = _hf_reference(tmp_path, ids)
    model = MixtralForCausalLM(_config())
    load_hf_weights(model, tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(model(ids)[..., :96], ref["logits"], atol=1e-5, rtol=1e-5)
    _check(model, ids, ref, {}, sp=False, msg="tp1")
    assert ref["aux"] > 0


def test_frequency_and_unsupported_settings() -> None:
    model = MixtralForCausalLM(_config(), moe=MoEOptions(frequency=2))
    kinds = [type(layer.mlp).__name__ for layer in model.layers]
    assert kinds == ["MoE", "LlamaMLP"]  # layer 0 % 2 == 0 is MoE, as NxDT's HF Mixtral
    cfg = _config()
    cfg.router_jitter_noise = 0.1
    with pytest.raises(ValueError, match="router_jitter_noise 0.1 .*not supported yet"):
        MixtralForCausalLM(cfg)
    with pytest.raises(ValueError, match="model.moe.frequency must be >= 1"):
        MixtralForCausalLM(_config(), moe=MoEOptions(frequency=0))


def _dist_worker(rank: int, world: int, path: str, tp: int, ep: int, sp: bool,
                 capacity_factor: float | None = None) -> None:
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep)
    dp_ranks = parallel_state.get_group_ranks("dp")
    refs = [_hf_reference(Path(path), _ids(d)) for d in range(len(dp_ranks))]  # one micro-batch per DP rank
    mine = refs[parallel_state.get_data_parallel_rank()]
    ep_peers = [dp_ranks.index(r) for r in parallel_state.get_group_ranks("ep")]
    expert_grads = {n: sum(refs[d]["grads"][n] for d in ep_peers) for n in mine["grads"] if ".experts." in n}
    options = MoEOptions(capacity_factor=capacity_factor, dropless=capacity_factor is None)
    model = MixtralForCausalLM(_config(), moe=options, sequence_parallel=sp)
    load_hf_weights(model, path)
    _check(model, _ids(parallel_state.get_data_parallel_rank()), mine, expert_grads, sp,
           msg=f"tp={tp} ep={ep} sp={sp} cf={capacity_factor} rank={rank}")


@pytest.mark.distributed
@pytest.mark.parametrize(("tp", "ep", "sp", "cf"), [
    (2, 1, True, None), (1, 2, False, None),
    pytest.param(2, 2, True, 4.0, marks=pytest.mark.slow)], ids=["tp2_sp", "ep2", "tp2_sp_ep2_capacity"])
def test_parallel_matches_transformers(tmp_path: Path, tp: int, ep: int, sp: bool, cf: float | None) -> None:
    """EP 2 is carved from DP 2: each rank has its own micro-batch; an expert's gradient sums both ranks'. TP 2 x
    SP x EP 2 on 4 processes with capacity-factor dispatch at a factor large enough to drop nothing (4.0 with 4
    experts, top 2: C = min(T, 2T) = T, and no expert gets a token twice) equals transformers too."""
    _save_hf(tmp_path)
    run_distributed(_dist_worker, tp * ep, str(tmp_path), tp, ep, sp, cf)


def _pp_reference(path: Path, ids: torch.Tensor, layers: int) -> dict[str, Any]:
    """transformers, one process: the mean over micro-batches (one row each) of each micro-batch's loss (CE +
    coef * aux, the aux pooled over that micro-batch's MoE layers), and its gradients under nxd_lc's names."""
    ref = _hf_reference(path, ids[:1], layers)
    grads = {k: v / ids.shape[0] for k, v in ref["grads"].items()}
    loss = ref["loss"] / ids.shape[0]
    for m in range(1, ids.shape[0]):
        r = _hf_reference(path, ids[m:m + 1], layers)
        loss = loss + r["loss"] / ids.shape[0]
        grads = {k: v + r["grads"][k] / ids.shape[0] for k, v in grads.items()}
    return {"loss": loss, "grads": grads}


def _pp_worker(rank: int, world: int, path: str, virtual: int, layers: int) -> None:
    from nxd_lc.pipeline import PipelineEngine, stage_layer_ranges

    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=world)
    ids = torch.randint(0, 96, (4, 12), generator=torch.Generator().manual_seed(7))
    ref = _pp_reference(Path(path), ids, layers)
    ranges = stage_layer_ranges(layers, world, virtual)
    stages = [s for s in range(world * virtual) if s % world == parallel_state.get_pipeline_model_parallel_rank()]
    config = _config()
    config.num_hidden_layers = layers
    model = MixtralForCausalLM(config, keep_layers={i for s in stages for i in ranges[s]},
                               keep_embedding=0 in stages, keep_head=world * virtual - 1 in stages)
    load_hf_weights(model, path)
    engine = PipelineEngine(model, ranges, virtual_size=virtual, micro_batch_size=1, sequence_parallel=False)
    loss = engine.train_step({"input_ids": ids, "labels": _labels(ids),
                              "position_ids": torch.arange(12).expand_as(ids)})
    torch.testing.assert_close(loss, ref["loss"], atol=1e-5, rtol=1e-5)
    names = [n for n, _ in model.named_parameters()]
    assert any(".mlp.router." in n for n in names)
    for name, param in model.named_parameters():  # this rank's stages: every gradient equals transformers'
        torch.testing.assert_close(param.grad, ref["grads"][name], atol=2e-5, rtol=1e-4, msg=f"{name}")


@pytest.mark.distributed
@pytest.mark.parametrize(("virtual", "layers"), [(1, 2), pytest.param(2, 4, marks=pytest.mark.slow)],
                         ids=["pp2", "pp2_vpp2"])
def test_pipeline_matches_transformers(tmp_path: Path, virtual: int, layers: int) -> None:
    """The routing statistics of stage 0's MoE layers travel to the last stage with the hidden states: the loss
    (with the load-balancing term pooled over all layers of each micro-batch) and every gradient, the routers' and
    the earlier stages' experts' included, equal transformers'."""
    _save_hf(tmp_path, layers)
    run_distributed(_pp_worker, 2, str(tmp_path), virtual, layers)


def _cp_worker(rank: int, world: int, path: str, algo: str) -> None:
    from nxd_lc.context import context_parallel_loss, set_context_parallel_algo, shard_batch_for_context_parallel
    from nxd_lc.distributed import collectives
    from nxd_lc.distributed.grads import allreduce_data_parallel_gradients

    parallel_state.initialize_model_parallel(context_parallel_size=world)
    set_context_parallel_algo(algo)
    ids = _ids(0)
    ref = _hf_reference(Path(path), ids)
    model = MixtralForCausalLM(_config())
    load_hf_weights(model, path)
    batch = shard_batch_for_context_parallel(
        {"input_ids": ids, "labels": _labels(ids), "position_ids": torch.arange(ids.shape[1]).expand_as(ids)},
        parallel_state.get_context_parallel_rank(), world, algo)
    loss_sum, num = model.loss(batch["input_ids"], batch["labels"], batch["position_ids"])
    loss = context_parallel_loss(loss_sum, num)
    loss.backward()
    mean = collectives.all_reduce(loss.detach().reshape(1).clone(), parallel_state.get_context_parallel_group())[0]
    torch.testing.assert_close(mean / world, ref["loss"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(model.aux_loss().detach(), ref["aux"], atol=1e-6, rtol=1e-5)  # whole sequence
    allreduce_data_parallel_gradients(list(model.parameters()), with_context_parallel=True)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, ref["grads"][name], atol=2e-5, rtol=1e-4, msg=f"{algo} {name}")


@pytest.mark.distributed
@pytest.mark.parametrize("algo", ["ring", pytest.param("ulysses", marks=pytest.mark.slow)])
def test_context_parallel_matches_transformers(tmp_path: Path, algo: str) -> None:
    """CP 2: each rank routes its half of the sequence; the routing statistics are pooled over CP before the
    load-balancing term, so loss, aux loss and every gradient (averaged over CP as training does) equal
    transformers' on the whole sequence."""
    _save_hf(tmp_path)
    run_distributed(_cp_worker, 2, str(tmp_path), algo)


def _export_worker(rank: int, world: int, path: str, tp: int, ep: int, out: str) -> None:
    from safetensors.torch import load_file

    from nxd_lc.models.llama.hf_adapter import export_hf_state_dict, save_hf_weights

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep)
    model = MixtralForCausalLM(_config(), sequence_parallel=tp > 1)
    load_hf_weights(model, path)
    exported = export_hf_state_dict(model)
    original = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        original.update(load_file(str(f)))
    assert set(exported) == set(original), sorted(set(exported) ^ set(original))
    for name, t in original.items():  # every tensor back exactly as transformers wrote it
        assert torch.equal(exported[name], t), name
    save_hf_weights(model, out)  # and transformers reads what nxd_lc writes
    if rank == 0:
        mine, theirs = HFMixtral.from_pretrained(out).state_dict(), HFMixtral.from_pretrained(path).state_dict()
        assert set(mine) == set(theirs)
        for name, t in theirs.items():
            assert torch.equal(mine[name], t), name


@pytest.mark.distributed
@pytest.mark.parametrize(("tp", "ep"), [pytest.param(1, 1, id="tp1", marks=pytest.mark.extended),  # CI time: the
                                        pytest.param(2, 2, id="tp2_ep2")])  # sharded case gathers what TP 1 holds
def test_export_to_hf_round_trips(tmp_path: Path, tp: int, ep: int) -> None:
    """Load transformers' Mixtral safetensors into a TP x EP layout and export it back: every tensor, each expert's
    w1 / w3 / w2 included, equals the file; the written checkpoint loads in transformers."""
    _save_hf(tmp_path / "hf")
    run_distributed(_export_worker, tp * ep, str(tmp_path / "hf"), tp, ep, str(tmp_path / "out"))
