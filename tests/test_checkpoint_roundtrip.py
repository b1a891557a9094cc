"""Checkpoint round trip at TP=2 + sequence parallel (2 gloo processes): save a trained model and its AdamW
state in NxD's xser layout, load them into a freshly initialised model/optimizer, and get identical logits,
identical optimizer state, and an identical next training step."""

from __future__ import annotations

import os

import pytest
import torch
from dist_utils import run_distributed
from transformers import LlamaConfig

from nxd_lc.checkpoint import sharded
from nxd_lc.distributed import grads
from nxd_lc.distributed import parallel_state as ps
from nxd_lc.models.common.loss import causal_lm_loss
from nxd_lc.models.llama.model import LlamaForCausalLM

pytestmark = pytest.mark.compat  # torch-2.9 compatibility subset (lane 2; docs/testing.md)


def _config() -> LlamaConfig:
    return LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


def _train_step(model: LlamaForCausalLM, opt: torch.optim.Optimizer, ids: torch.Tensor) -> None:
    opt.zero_grad()
    loss_sum, n = causal_lm_loss(model(ids[:, :-1]), ids[:, 1:])
    (loss_sum / n).backward()
    grads.allreduce_sequence_parallel_gradients(model)
    opt.step()


def _build(seed: int) -> tuple[LlamaForCausalLM, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = LlamaForCausalLM(_config(), sequence_parallel=True)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _tensors(obj: object) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for k in sorted(obj, key=str) for t in _tensors(obj[k])]
    if isinstance(obj, (list, tuple)):
        return [t for x in obj for t in _tensors(x)]
    return []


def _roundtrip_worker(rank: int, world_size: int, root: str) -> None:
    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    ids = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(0))
    model, opt = _build(seed=1)
    for _ in range(2):
        _train_step(model, opt, ids)
    ranks = dict(dp_rank=0, tp_rank=ps.get_tensor_model_parallel_rank(), pp_rank=0)
    sharded.save_checkpoint(root, "step=2", model_state=model.state_dict(), optim_state=opt.state_dict(),
                            user_content={"global_step": 2}, is_global_zero=rank == 0, write_model=True,
                            write_optim=True, use_xser=True, **ranks)
    assert sharded.latest_checkpoint(root) == "step=2"
    shard = os.path.join(root, "step=2", "model", f"dp_rank_00_tp_rank_{rank:02d}_pp_rank_00.pt")
    assert os.path.isdir(shard + ".tensors")

    fresh, fresh_opt = _build(seed=99)  # different init: everything must come from the checkpoint
    with torch.no_grad():
        assert not torch.equal(fresh(ids[:, :-1]), model(ids[:, :-1]))
    model_state, optim_state, content = sharded.load_checkpoint(root, "step=2", **ranks)
    fresh.load_state_dict(model_state)
    fresh_opt.load_state_dict(optim_state)
    assert content["global_step"] == 2
    with torch.no_grad():
        assert torch.equal(fresh(ids[:, :-1]), model(ids[:, :-1]))
    a, b = _tensors(opt.state_dict()["state"]), _tensors(fresh_opt.state_dict()["state"])
    assert len(a) == len(b) > 0 and all(torch.equal(x, y) for x, y in zip(a, b))
    _train_step(model, opt, ids)
    _train_step(fresh, fresh_opt, ids)
    for (name, p), q in zip(model.named_parameters(), fresh.parameters()):
        assert torch.equal(p, q), name


@pytest.mark.distributed
def test_checkpoint_roundtrip_tp2_sp(tmp_path) -> None:
    run_distributed(_roundtrip_worker, 2, str(tmp_path / "ckpt"))
