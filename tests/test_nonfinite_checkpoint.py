"""A checkpoint whose state holds NaN or inf is never published (issue 32, item 2, the save-time half): the save
fails on every rank naming the tensor, the staging directory is removed and the previous checkpoint stays the
newest. (Before this, a run clipping with NaN published NaN checkpoints and exited 0.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from nxd_lc.checkpoint import sharded

pytestmark = pytest.mark.compat  # torch-2.9 compatibility subset (lane 2; docs/testing.md)


def _save(root: Path, step: int, model: dict, optim: dict | None = None, xser: bool = False) -> str:
    return sharded.save_checkpoint(str(root), f"step={step}", model_state=model, optim_state=optim,
                                   user_content={"global_step": step}, dp_rank=0, tp_rank=0, pp_rank=0,
                                   is_global_zero=True, write_model=True, write_optim=optim is not None,
                                   use_xser=xser, step=step)


@pytest.mark.parametrize("xser", [False, True])
@pytest.mark.parametrize("bad,where,key", [
    (float("nan"), "model", "layers.0.weight"),
    (float("inf"), "model", "layers.0.weight"),
    (float("nan"), "optim", "state.0.exp_avg"),
    (-float("inf"), "optim", "state.0.exp_avg"),
])
def test_a_non_finite_state_is_not_published(tmp_path: Path, xser: bool, bad: float, where: str, key: str) -> None:
    good_model = {"layers.0.weight": torch.ones(3, 4), "step": torch.tensor(7)}
    good_optim = {"state": {0: {"exp_avg": torch.zeros(3, 4), "step": torch.tensor(1.0)}}, "param_groups": [{}]}
    _save(tmp_path, 1, good_model, good_optim, xser)
    model = {"layers.0.weight": torch.ones(3, 4), "step": torch.tensor(7)}
    optim = {"state": {0: {"exp_avg": torch.zeros(3, 4), "step": torch.tensor(2.0)}}, "param_groups": [{}]}
    target = model["layers.0.weight"] if where == "model" else optim["state"][0]["exp_avg"]
    target[1, 2] = bad
    with pytest.raises(sharded.NonFiniteCheckpointError, match=rf"step=2.*'{key}' holds NaN or infinite"):
        _save(tmp_path, 2, model, optim, xser)
    assert sharded.list_checkpoints(str(tmp_path)) == ["step=1"]
    assert sharded.latest_checkpoint(str(tmp_path)) == "step=1"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["newest", "step=1"]  # no staging left behind


def test_finite_states_of_every_dtype_pass() -> None:
    sharded.check_finite({"a": torch.randn(5, dtype=torch.bfloat16), "b": [torch.arange(4), torch.zeros(0)],
                          "c": (torch.tensor(True), "text", 3.0)}, "here")
