"""The run directory cannot be escaped or wedged (issue 32, item 3, first part): names that become paths stay one
directory name (validation), and symbolic links inside ``checkpoints/`` are never followed: not listed as
checkpoints, never deleted through, never a crash at start or at a save_top_k removal."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from test_config import _problems, _tiny

from nxd_lc.checkpoint import sharded

pytestmark = pytest.mark.compat  # torch-2.9 compatibility subset (lane 2; docs/testing.md)


@pytest.mark.parametrize("sections,key", [
    ({"exp_manager": {"checkpoint_callback_params": {"filename": "../outside-{step}"}}},
     "exp_manager.checkpoint_callback_params.filename"),
    ({"exp_manager": {"checkpoint_callback_params": {"filename": "sub/{step}"}}},
     "exp_manager.checkpoint_callback_params.filename"),
    ({"exp_manager": {"checkpoint_callback_params": {"filename": ".hidden-{step}"}}},
     "exp_manager.checkpoint_callback_params.filename"),
    ({"exp_manager": {"name": "../escape"}}, "exp_manager.name"),
    ({"exp_manager": {"name": "a/b"}}, "exp_manager.name"),
    ({"exp_manager": {"name": " "}}, "exp_manager.name"),
])
def test_names_that_become_paths_are_one_directory_name(sections: dict[str, Any], key: str) -> None:
    problems = _problems(_tiny(**sections), world_size=2)
    assert len(problems) == 1 and problems[0].startswith(f"{key}: "), problems


def _save(root: Path, tag: str, step: int) -> None:
    sharded.save_checkpoint(str(root), tag, model_state={"w": torch.full((2,), float(step))}, optim_state=None,
                            user_content=None, dp_rank=0, tp_rank=0, pp_rank=0, is_global_zero=True,
                            write_model=True, write_optim=False, use_xser=False, step=step)


def test_symlinks_in_the_checkpoint_directory_are_left_alone(tmp_path: Path,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    root, outside = tmp_path / "checkpoints", tmp_path / "precious"
    _save(root, "step=1", 1)
    _save(root, "step=2", 2)
    _save(outside, "step=9", 9)  # a complete checkpoint elsewhere (another run's, say)
    (root / "step=9").symlink_to(outside / "step=9", target_is_directory=True)
    (root / ".step=3.partial").symlink_to(outside, target_is_directory=True)  # a planted "leftover"
    (root / ".step=4.trash-0123456789abcdef0123456789abcdef").symlink_to(outside / "step=9")

    assert sharded.list_checkpoints(str(root)) == ["step=1", "step=2"]  # the link is not one of this run's
    assert sharded.latest_checkpoint(str(root)) == "step=2"
    assert "symbolic link" in caplog.text and "step=9" in caplog.text

    removed = sharded.cleanup_partial(str(root))  # what every start runs: unlinks the planted links only
    assert sorted(removed) == sorted([".step=3.partial", ".step=4.trash-0123456789abcdef0123456789abcdef"])
    assert not os.path.lexists(root / ".step=3.partial")

    sharded.remove_checkpoint(str(root), "step=9")  # a save_top_k removal naming the link: reported, not followed
    assert os.path.islink(root / "step=9")
    assert sharded.is_complete(str(outside / "step=9")) and sharded.list_checkpoints(str(outside)) == ["step=9"]

    sharded.remove_checkpoint(str(root), "step=1")  # an ordinary removal still works
    assert sharded.list_checkpoints(str(root)) == ["step=2"]
    assert (root / sharded.NEWEST_FILE).read_text() == "step=2\n"
