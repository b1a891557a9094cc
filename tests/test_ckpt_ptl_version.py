"""``exp_manager.ckpt_ptl_version``: a checkpoint that records no pytorch-lightning version is read as that
version (NxDT's NLPCheckpointIO) and Lightning's own migration upgrades it; a recorded version wins."""

from __future__ import annotations

import logging
import os
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.utilities.migration.utils import _pl_migrate_checkpoint

from nxd_lc.app.validation import load_config
from nxd_lc.checkpoint import save_checkpoint
from nxd_lc.config.errors import ConfigError
from nxd_lc.lightning.strategy import NxDStrategy
from nxd_lc.lightning.trainer import _backend_kwargs
from nxd_lc.runtime.device import RuntimeInfo

pytestmark = pytest.mark.compat  # torch-2.9 compatibility subset (lane 2; docs/testing.md)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_JSON = os.path.join(REPO, "conf", "tiny_llama_config.json")


def _foreign_checkpoint(root: str, user_content: dict[str, Any] | None) -> str:
    """An NxD-layout checkpoint as another tool writes it: model + optimizer shards, user content as given."""
    model = {"model.w": torch.arange(6.0).reshape(2, 3)}
    optim = {"optimizer_states": [{"state": {}, "param_groups": [{"lr": 1e-3, "params": [0]}]}]}
    return save_checkpoint(root, "step_3", model_state=model, optim_state=optim, user_content=user_content,
                           dp_rank=0, tp_rank=0, pp_rank=0, is_global_zero=True, write_model=True,
                           write_optim=True, use_xser=True)


def test_missing_version_is_read_as_ckpt_ptl_version_and_migrated(tmp_path: Any) -> None:
    # a PTL 1.8 checkpoint could still carry apex AMP state, which Lightning's 2.0.0 migration drops
    path = _foreign_checkpoint(str(tmp_path), {"global_step": 3, "amp_scaling_state": {"loss_scale": 1.0}})
    loaded = NxDStrategy(ckpt_ptl_version="1.8.6").load_checkpoint(path)
    assert loaded["pytorch-lightning_version"] == "1.8.6"
    assert torch.equal(loaded["state_dict"]["model.w"], torch.arange(6.0).reshape(2, 3))
    with pytest.warns(UserWarning, match="apex"):
        migrated = _pl_migrate_checkpoint(loaded, path)  # what the Trainer runs right after load_checkpoint
    assert "amp_scaling_state" not in migrated
    assert migrated["legacy_pytorch-lightning_version"] == "1.8.6"
    assert migrated["pytorch-lightning_version"] == pl.__version__


def test_a_newer_ckpt_ptl_version_skips_the_old_migrations(tmp_path: Any) -> None:
    path = _foreign_checkpoint(str(tmp_path), {"global_step": 3, "amp_scaling_state": {"loss_scale": 1.0}})
    migrated = _pl_migrate_checkpoint(NxDStrategy(ckpt_ptl_version="2.5.0").load_checkpoint(path), path)
    assert migrated["amp_scaling_state"] == {"loss_scale": 1.0}  # saved after 2.0: nothing to drop
    assert migrated["legacy_pytorch-lightning_version"] == "2.5.0"


@pytest.mark.parametrize("user_content", [None, {"global_step": 3}])
def test_missing_version_without_ckpt_ptl_version_names_the_key(tmp_path: Any, user_content: Any) -> None:
    path = _foreign_checkpoint(str(tmp_path), user_content)
    with pytest.raises(ValueError, match=r"records no pytorch-lightning version.*exp_manager\.ckpt_ptl_version"):
        NxDStrategy().load_checkpoint(path)


def test_recorded_version_wins_with_a_warning(tmp_path: Any, caplog: Any) -> None:
    path = _foreign_checkpoint(str(tmp_path), {"global_step": 3, "pytorch-lightning_version": "2.1.0"})
    with caplog.at_level(logging.WARNING, logger="nxd_lc"):
        loaded = NxDStrategy(ckpt_ptl_version="1.8.6").load_checkpoint(path)
    assert loaded["pytorch-lightning_version"] == "2.1.0"
    assert "exp_manager.ckpt_ptl_version 1.8.6 is not used" in caplog.text and "2.1.0" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="nxd_lc"):
        NxDStrategy(ckpt_ptl_version="2.1.0").load_checkpoint(path)  # same version: nothing to say
    assert "ckpt_ptl_version" not in caplog.text


def _raw(**exp_manager: Any) -> dict[str, Any]:
    return {"trainer": {"devices": 1}, "model": {"model_config": TINY_JSON, "encoder_seq_length": 64},
            "exp_manager": exp_manager}


def test_config_value_is_validated_and_reaches_the_strategy() -> None:
    with pytest.raises(ConfigError, match=r"exp_manager\.ckpt_ptl_version: 'one-eight' is not a version"):
        load_config(_raw(ckpt_ptl_version="one-eight"))
    cfg = load_config(_raw(ckpt_ptl_version="1.8.6"))
    runtime = RuntimeInfo("cpu", torch.device("cpu"), "gloo", 0, 0, 1)
    assert _backend_kwargs(cfg, runtime)["strategy"].ckpt_ptl_version == "1.8.6"
    assert _backend_kwargs(load_config(_raw()), runtime)["strategy"].ckpt_ptl_version is None
