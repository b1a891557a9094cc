"""``bucket_size_collectives`` sizes the buckets of nxd_lc's own DP gradient all-reduce (read from the typed
config by the LightningModule, not from the BUCKET_CAP_MB environment variable): the number of all-reduce calls
follows the bucket size and the averaged gradients stay exact."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from dist_utils import run_distributed
from torch import nn

from nxd_lc.app.validation import load_config
from nxd_lc.config.errors import ConfigError
from nxd_lc.config.schema import NxdConfig
from nxd_lc.distributed import collectives, grads, parallel_state
from nxd_lc.distributed.grads import gradient_bucket_size_mb
from nxd_lc.lightning.module import NxDLanguageModel

pytestmark = pytest.mark.compat  # torch-2.9 compatibility subset (lane 2; docs/testing.md)

NUM_PARAMS = 4
IN, OUT = 256, 512  # each weight gradient: 256 * 512 fp32 = 0.5 MiB; 2 MiB in all


CASES = [  # (bucket_size_collectives, expected all-reduce calls)
    (None, 1),  # default 64 MiB: all 2 MiB in one bucket
    (1, 2),  # two 0.5 MiB gradients fill a 1 MiB bucket
    (2, 1),
]


def _reduce_counting_calls(bucket_mib: int | None, rank: int, world_size: int) -> list[int]:
    """Run the module's gradient reduction once; the sizes of the all-reduce calls it made."""
    cfg = NxdConfig()
    cfg.trainer.devices = world_size
    cfg.bucket_size_collectives = bucket_mib
    cfg.trainer.check_for_nan_in_loss_and_grad = False  # counted here: the gradient buckets, not the norm's reductions
    model = nn.Sequential(*[nn.Linear(IN, OUT, bias=False) for _ in range(NUM_PARAMS)])
    module = NxDLanguageModel(cfg, model)
    for i, p in enumerate(model.parameters()):
        p.grad = torch.full_like(p, float(10 * rank + i))
    calls: list[int] = []
    real = collectives.all_reduce

    def counting(tensor: torch.Tensor, group: Any, op: str = "sum") -> torch.Tensor:
        calls.append(tensor.numel())
        return real(tensor, group, op=op)

    grads.collectives.all_reduce = counting  # the module-level name grads.py calls
    try:
        module.on_before_optimizer_step(None)  # type: ignore[arg-type]
    finally:
        grads.collectives.all_reduce = real
    for i, p in enumerate(model.parameters()):
        assert torch.equal(p.grad, torch.full_like(p, (i + (10 + i)) / 2)), i  # the mean over the two DP ranks
    return calls


def _bucket_worker(rank: int, world_size: int) -> None:
    parallel_state.initialize_model_parallel()  # TP 1: DP = 2
    os.environ["BUCKET_CAP_MB"] = "1"  # the environment variable must not change nxd_lc's own buckets
    for bucket_mib, expected_calls in CASES:
        calls = _reduce_counting_calls(bucket_mib, rank, world_size)
        assert len(calls) == expected_calls, (bucket_mib, calls)
        assert sum(calls) == NUM_PARAMS * IN * OUT  # every gradient reduced exactly once


@pytest.mark.distributed
def test_bucket_size_collectives_sets_the_number_of_all_reduces() -> None:
    run_distributed(_bucket_worker, 2)


def test_bucket_size_is_validated_and_defaults_to_64(monkeypatch: pytest.MonkeyPatch) -> None:
    raw = {"trainer": {"devices": 1}, "model": {"model_config": "conf/tiny_llama_config.json",
                                                "encoder_seq_length": 64}}
    monkeypatch.chdir(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert gradient_bucket_size_mb(load_config(raw)) == 64.0
    assert gradient_bucket_size_mb(load_config({**raw, "bucket_size_collectives": 1024})) == 1024.0
    with pytest.raises(ConfigError, match=r"bucket_size_collectives: must be >= 1 MiB"):
        load_config({**raw, "bucket_size_collectives": 0})
