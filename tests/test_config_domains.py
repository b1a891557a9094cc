"""Numeric domains of the optimizer, schedule, clipping, seed and loader keys are checked at validation (issue 32,
item 1): each value below used to validate and then train wrongly (a negative clip value flipped every gradient,
NaN clipping published NaN checkpoints) or fail after the model was built with a raw torch / Lightning error."""

from __future__ import annotations

from typing import Any

import pytest
from test_config import _problems, _tiny

from nxd_lc.app.validation import load_config

pytestmark = pytest.mark.compat  # torch-2.9 compatibility subset (lane 2; docs/testing.md)

NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("sections,key", [
    ({"trainer": {"gradient_clip_val": -1.0}}, "trainer.gradient_clip_val"),
    ({"trainer": {"gradient_clip_val": NAN}}, "trainer.gradient_clip_val"),
    ({"trainer": {"gradient_clip_val": INF}}, "trainer.gradient_clip_val"),
    ({"model": {"optim": {"lr": NAN}}}, "model.optim.lr"),
    ({"model": {"optim": {"lr": -1e-3}}}, "model.optim.lr"),
    ({"model": {"optim": {"weight_decay": -5.0}}}, "model.optim.weight_decay"),
    ({"model": {"optim": {"betas": [2.0, 0.999]}}}, "model.optim.betas[0]"),
    ({"model": {"optim": {"betas": [0.9, 1.0]}}}, "model.optim.betas[1]"),
    ({"model": {"optim": {"eps": 0.0}}}, "model.optim.eps"),
    ({"model": {"optim": {"momentum": -0.5}}}, "model.optim.momentum"),
    ({"model": {"optim": {"lr": 1e-3, "sched": {"min_lr": 1e-2}}}}, "model.optim.sched.min_lr"),
    ({"model": {"optim": {"sched": {"min_lr": INF}}}}, "model.optim.sched.min_lr"),
    ({"seed": -5}, "seed"),
    ({"seed": 2**32}, "seed"),
    ({"data": {"num_workers": -1}}, "data.num_workers"),
])
def test_out_of_domain_value_is_one_problem_naming_the_key(sections: dict[str, Any], key: str) -> None:
    problems = _problems(_tiny(**sections), world_size=2)
    assert len(problems) == 1 and problems[0].startswith(f"{key}: "), problems


@pytest.mark.parametrize("sections", [
    {"trainer": {"gradient_clip_val": 0.0}},  # no clipping
    {"trainer": {"gradient_clip_val": None}},
    {"trainer": {"gradient_clip_val": 1e-6}},
    {"model": {"optim": {"lr": 0.0, "weight_decay": 0.0, "betas": [0.0, 0.0]}}},
    {"model": {"optim": {"lr": 1e-3, "sched": {"min_lr": 1e-3}}}},  # min_lr == lr
    {"seed": 0},
    {"seed": 2**32 - 1},
    {"data": {"num_workers": 0}},
])
def test_values_at_the_edges_of_each_domain_validate(sections: dict[str, Any]) -> None:
    load_config(_tiny(**sections), world_size=2)
