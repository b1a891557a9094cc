"""ZeRO-1 (``distributed_strategy.zero1``): optimizer state and master weights sharded over DP x CP give the same
parameters as the unsharded optimizer after N steps; each DP x CP rank saves and reloads its own optimizer shard
in NxD's checkpoint layout and the resumed run continues identically (2 gloo processes)."""

from __future__ import annotations

import os

import pytest
import torch
from dist_utils import run_distributed, shard_files
from transformers import LlamaConfig

from nxd_lc.checkpoint import sharded
from nxd_lc.config.schema import NxdConfig
from nxd_lc.distributed import parallel_state as ps
from nxd_lc.lightning.module import NxDLanguageModel
from nxd_lc.models.llama import LlamaForCausalLM
from nxd_lc.optim import NxDOptimizer

STEPS = 3


def _config() -> LlamaConfig:
    # 33 x 32 embedding etc.: numels not divisible by 2 exercise the shard padding
    return LlamaConfig(vocab_size=66, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


def _module(mode: str, zero1: bool, seed: int = 0) -> tuple[NxDLanguageModel, torch.optim.Optimizer]:
    cfg = NxdConfig()
    cfg.precision.type = mode
    cfg.distributed_strategy.zero1 = zero1
    cfg.distributed_strategy.context_parallel_size = ps.get_context_parallel_world_size()
    cfg.model.optim.lr = 3e-3
    cfg.trainer.gradient_clip_val = 0.5
    torch.manual_seed(seed)
    module = NxDLanguageModel(cfg, LlamaForCausalLM(_config()))
    return module, module.configure_optimizers()["optimizer"]


def _step(module: NxDLanguageModel, opt: torch.optim.Optimizer, step: int) -> None:
    """One optimizer step of 2 micro-batches; each DP rank reads its own data, CP ranks the same sequence."""
    opt.zero_grad()
    dp = ps.get_data_parallel_rank()
    for micro in range(2):
        gen = torch.Generator().manual_seed(1000 * step + 10 * dp + micro)
        ids = torch.randint(0, 66, (2, 17), generator=gen)
        loss = module.training_step({"input_ids": ids[:, :-1], "labels": ids[:, 1:]}, micro)
        (loss / 2).backward()
    module.on_before_optimizer_step(opt)
    module.configure_gradient_clipping(opt, module.cfg.trainer.gradient_clip_val)
    opt.step()


def _params(module: NxDLanguageModel) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.model.named_parameters()}


def _equivalence_worker(rank: int, world: int, mode: str, cp: int) -> None:
    torch.set_num_threads(1)
    ps.initialize_model_parallel(context_parallel_size=cp)
    runs = {}
    for zero1 in (False, True):
        module, opt = _module(mode, zero1)
        assert isinstance(opt, NxDOptimizer) == (zero1 or mode != "fp32")
        for step in range(STEPS):
            _step(module, opt, step)
        runs[zero1] = _params(module)
        if zero1:  # each rank holds half of every parameter's state (rounded up)
            for s in opt.slots:
                assert s.work.numel() <= (s.param.numel() + 1) // 2
                st = opt.state[s.work]
                assert st["exp_avg"].numel() == s.work.numel()
    for name, p in runs[False].items():
        if mode.endswith("SR"):  # different rounding noise per shard: equal up to a few bf16 ulps
            torch.testing.assert_close(p.float(), runs[True][name].float(), atol=2e-3, rtol=2 ** -6, msg=name)
        else:
            assert torch.equal(p, runs[True][name]), name


@pytest.mark.distributed
@pytest.mark.parametrize("mode,cp", [("fp32", 1), ("mixed_precision", 1), ("mixed_precision", 2),
                                     ("mixed_precisionSR", 1)])
def test_zero1_matches_unsharded_optimizer(mode: str, cp: int) -> None:
    """DP=2 (or CP=2, where ZeRO-1 shards over the DP x CP group): parameters after 3 steps are bit-identical
    (with stochastic rounding, whose noise differs per shard, equal within bf16 rounding)."""
    run_distributed(_equivalence_worker, 2, mode, cp)


def _resume_worker(rank: int, world: int, root: str) -> None:
    torch.set_num_threads(1)
    ps.initialize_model_parallel()
    module, opt = _module("mixed_precisionSR", zero1=True)
    for step in range(2):
        _step(module, opt, step)
    dp = ps.get_data_parallel_rank(with_context_parallel=True)
    sharded.save_checkpoint(root, "step=2", model_state=module.state_dict(), optim_state=opt.state_dict(),
                            user_content={"global_step": 2}, is_global_zero=rank == 0, write_model=dp == 0,
                            write_optim=True, use_xser=True, dp_rank=dp, tp_rank=0, pp_rank=0)
    assert shard_files(os.path.join(root, "step=2", "optim")) == [
        "dp_rank_00_tp_rank_00_pp_rank_00.pt", "dp_rank_01_tp_rank_00_pp_rank_00.pt"]

    fresh, fresh_opt = _module("mixed_precisionSR", zero1=True, seed=7)
    model_state, optim_state, _ = sharded.load_checkpoint(root, "step=2", dp_rank=dp, tp_rank=0, pp_rank=0)
    fresh.load_state_dict(model_state)
    fresh_opt.load_state_dict(optim_state)
    for a, b in zip(opt.slots, fresh_opt.slots):
        assert torch.equal(a.work, b.work)  # this rank's master-weight shard
    _step(module, opt, 2)
    _step(fresh, fresh_opt, 2)
    for name, p in _params(module).items():
        assert torch.equal(p, _params(fresh)[name]), name

    plain, plain_opt = _module("mixed_precisionSR", zero1=False)
    with pytest.raises(ValueError, match="zero1 over 2 DP x CP ranks but this run uses no zero1 ranks"):
        plain_opt.load_state_dict(optim_state)


@pytest.mark.compat
@pytest.mark.distributed
def test_zero1_checkpoint_has_one_optim_shard_per_dp_rank_and_resumes(tmp_path) -> None:
    run_distributed(_resume_worker, 2, str(tmp_path))
