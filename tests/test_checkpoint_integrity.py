"""Checkpoint integrity: SHA-256 manifest written before ``done``, verification on load, resume fall-back."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from typing import Any

import pytest
import torch
from omegaconf import OmegaConf

from nxd_lc.checkpoint import integrity, sharded
from nxd_lc.config.errors import ConfigError
from nxd_lc.config.schema import NxdConfig
from nxd_lc.lightning import exp_manager
from tests.dist_utils import run_distributed

pytestmark = pytest.mark.compat  # torch-2.9 compatibility subset (lane 2; docs/testing.md)


def _cfg(**exp: object) -> NxdConfig:
    base = OmegaConf.structured(NxdConfig)
    base.exp_manager = OmegaConf.merge(base.exp_manager, exp)
    return OmegaConf.to_object(base)  # type: ignore[return-value]


def _states(seed: int) -> tuple[dict[str, Any], dict[str, Any]]:
    g = torch.Generator().manual_seed(seed)
    model = {"w": torch.randn(8, 4, generator=g), "b": torch.randn(4, generator=g)}
    optim = {"state": {0: {"exp_avg": torch.randn(8, 4, generator=g)}}, "param_groups": [{"lr": 0.1}]}
    return model, optim


def _save(root: str, tag: str, step: int, *, use_xser: bool = True, tp_rank: int = 0,
          is_global_zero: bool = True) -> str:
    model, optim = _states(step * 10 + tp_rank)
    return sharded.save_checkpoint(root, tag, model_state=model, optim_state=optim, user_content={"global_step": step},
                                   dp_rank=0, tp_rank=tp_rank, pp_rank=0, is_global_zero=is_global_zero,
                                   write_model=True, write_optim=True, use_xser=use_xser)


def _all_files(tag_dir: str) -> dict[str, tuple[int, str]]:
    out = {}
    for dirpath, _, names in os.walk(tag_dir):
        for n in names:
            path = os.path.join(dirpath, n)
            data = open(path, "rb").read()
            out[os.path.relpath(path, tag_dir)] = (len(data), hashlib.sha256(data).hexdigest())
    return out


def _flip_byte(path: str, offset_from_end: int = 20) -> None:
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) - offset_from_end)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))


@pytest.mark.parametrize("use_xser", [True, False])
def test_manifest_lists_every_file_with_its_sha256(tmp_path: Any, use_xser: bool) -> None:
    tag_dir = _save(str(tmp_path), "step_1", 1, use_xser=use_xser)
    doc = json.load(open(os.path.join(tag_dir, "manifest.json")))
    assert doc["algorithm"] == "sha256"
    on_disk = _all_files(tag_dir)
    expected = {k: v for k, v in on_disk.items() if k not in ("done", "manifest.json")}
    assert {k: (v["bytes"], v["sha256"]) for k, v in doc["files"].items()} == expected
    assert any(".tensors/" in k for k in expected) == use_xser
    assert json.load(open(os.path.join(tag_dir, "done")))["manifest"] == "manifest.json"
    assert not os.path.exists(os.path.join(tag_dir, "manifest.d"))


def test_flipped_byte_in_tensor_file_is_named(tmp_path: Any) -> None:
    tag_dir = _save(str(tmp_path), "step_1", 1)
    victim = os.path.join(tag_dir, "model", "dp_rank_00_tp_rank_00_pp_rank_00.pt.tensors", "tensor_0.pt")
    data = open(victim, "rb").read()
    raw = torch.load(victim).numpy().tobytes()  # flip a byte inside the tensor's own data, not the zip framing
    _flip_byte(victim, offset_from_end=len(data) - data.index(raw) - 5)
    with pytest.raises(integrity.CheckpointIntegrityError, match="tensor_0.pt' is corrupt: sha256") as e:
        sharded.load_checkpoint(str(tmp_path), "step_1", dp_rank=0, tp_rank=0, pp_rank=0)
    assert e.value.path == victim
    # unverified, the flipped byte would load silently as a different value (what the manifest prevents)
    m, _, _ = sharded.load_checkpoint(str(tmp_path), "step_1", dp_rank=0, tp_rank=0, pp_rank=0, verify=False)
    assert not torch.equal(m["w"], _states(10)[0]["w"])


@pytest.mark.parametrize("what", ["user_content", "optim_dir", "other_rank_tensor"])
def test_truncated_or_missing_files_are_named(tmp_path: Any, what: str) -> None:
    root = str(tmp_path)
    tag_dir = _save(root, "step_1", 1)
    if what == "user_content":
        victim = os.path.join(tag_dir, "user_content.pt")
        os.truncate(victim, os.path.getsize(victim) // 2)
        match = "user_content.pt' has .* bytes, manifest.json records"
    elif what == "optim_dir":
        import shutil

        shutil.rmtree(os.path.join(tag_dir, "optim"))
        match = "optim/dp_rank_00_tp_rank_00_pp_rank_00.pt' is missing"
    else:  # a file this rank never reads is still checked for presence and size
        victim = os.path.join(tag_dir, "optim", "dp_rank_00_tp_rank_00_pp_rank_00.pt.tensors", "tensor_0.pt")
        os.truncate(victim, 10)
        match = "tensor_0.pt' has 10 bytes"
    with pytest.raises(integrity.CheckpointIntegrityError, match=match):
        sharded.load_checkpoint(root, "step_1", dp_rank=0, tp_rank=0, pp_rank=0, load_optim=what != "other_rank_tensor")


def test_unreadable_file_without_manifest_names_the_file(tmp_path: Any, caplog: Any) -> None:
    root = str(tmp_path)
    tag_dir = _save(root, "step_1", 1, use_xser=False)
    os.remove(os.path.join(tag_dir, "manifest.json"))  # as written before checksums existed
    with caplog.at_level(logging.WARNING, logger="nxd_lc.checkpoint.integrity"):
        m, o, u = sharded.load_checkpoint(root, "step_1", dp_rank=0, tp_rank=0, pp_rank=0)
        sharded.load_checkpoint(root, "step_1", dp_rank=0, tp_rank=0, pp_rank=0)
    assert torch.equal(m["w"], _states(10)[0]["w"]) and u == {"global_step": 1}
    assert len([r for r in caplog.records if "has no manifest.json" in r.getMessage()]) == 1  # one warning
    victim = os.path.join(tag_dir, "model", "dp_rank_00_tp_rank_00_pp_rank_00.pt")
    os.truncate(victim, os.path.getsize(victim) // 2)
    with pytest.raises(integrity.CheckpointIntegrityError, match="pp_rank_00.pt. .* cannot be read"):
        sharded.load_checkpoint(root, "step_1", dp_rank=0, tp_rank=0, pp_rank=0)


def test_resume_if_exists_falls_back_past_a_corrupt_newest(tmp_path: Any, caplog: Any) -> None:
    cfg = _cfg(explicit_log_dir=str(tmp_path / "run"))
    paths = exp_manager.experiment_paths(cfg)
    older = _save(paths.checkpoint_dir, "step=2", 2)
    newest = _save(paths.checkpoint_dir, "step=4", 4)
    assert exp_manager.resume_plan(cfg, paths) == (newest, None)
    _flip_byte(os.path.join(newest, "optim", "dp_rank_00_tp_rank_00_pp_rank_00.pt.tensors", "tensor_0.pt"))
    with caplog.at_level(logging.WARNING, logger="nxd_lc.lightning.exp_manager"):
        assert exp_manager.resume_plan(cfg, paths) == (older, None)
    assert any("skipping checkpoint" in r.getMessage() and "step=4" in r.getMessage() and "tensor_0.pt" in
               r.getMessage() for r in caplog.records)
    # the damaged one was moved aside (hidden, kept for inspection)
    (aside,) = [n for n in os.listdir(paths.checkpoint_dir) if n.startswith(".step=4.corrupt-")]
    assert sharded.list_checkpoints(paths.checkpoint_dir) == ["step=2"]
    # an explicit resume_from_checkpoint fails loudly instead
    newest = os.path.join(str(tmp_path), "explicit", "step=4")
    os.makedirs(os.path.dirname(newest))
    os.replace(os.path.join(paths.checkpoint_dir, aside), newest)
    explicit = _cfg(explicit_log_dir=str(tmp_path / "other"), resume_from_checkpoint=newest)
    with pytest.raises(ConfigError, match="resume_from_checkpoint: .*step=4 failed verification: .*corrupt"):
        exp_manager.resume_plan(explicit, exp_manager.experiment_paths(explicit))
    # nothing verifies: an error, not a silent fresh start, and nothing is moved
    os.truncate(os.path.join(older, "user_content.pt"), 3)
    with pytest.raises(ConfigError, match="no checkpoint under .* passed verification"):
        exp_manager.resume_plan(cfg, paths)
    assert sharded.list_checkpoints(paths.checkpoint_dir) == ["step=2"]


def _fallback_worker(rank: int, world_size: int, root: str) -> None:
    for step in (2, 4):
        _save(root, f"step={step}", step, tp_rank=rank, is_global_zero=rank == 0)
    if rank == 1:  # only rank 1's shard of the newest is damaged: rank 0 must fall back too
        _flip_byte(os.path.join(root, "step=4", "model", "dp_rank_00_tp_rank_01_pp_rank_00.pt.tensors",
                                "tensor_1.pt"))
    torch.distributed.barrier()
    from nxd_lc.distributed import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    cfg = _cfg(explicit_log_dir=os.path.dirname(root))
    cfg.distributed_strategy.tensor_model_parallel_size = 2
    assert exp_manager.resume_plan(cfg, exp_manager.experiment_paths(cfg)) == (os.path.join(root, "step=2"), None)
    ps.destroy_model_parallel()


@pytest.mark.slow
def test_fallback_is_agreed_by_all_ranks(tmp_path: Any) -> None:
    root = str(tmp_path / "run" / "checkpoints")
    run_distributed(_fallback_worker, 2, root)


def _two_tp_shards(root: str) -> None:
    """A checkpoint whose model/ holds the shards of two TP ranks (rank 1's added beside rank 0's save)."""
    _save(root, "step=2", 2, use_xser=False)
    torch.save(_states(21)[0], os.path.join(root, "step=2", "model", "dp_rank_00_tp_rank_01_pp_rank_00.pt"))


def test_checkpoint_of_another_tp_size_is_resumed_with_a_warning_but_not_for_lora(tmp_path: Any, caplog: Any) -> None:
    """A checkpoint of another TP size is re-sharded on load (tests/test_reshard.py): the plan picks it and says
    so; a LoRA run cannot be re-sharded: a config error naming both layouts and the ways on."""
    from nxd_lc.config.alignment_schema import ModelAlignmentStrategyConfig, SFTConfig
    from nxd_lc.config.peft_schema import PeftConfig

    cfg = _cfg(explicit_log_dir=str(tmp_path / "run"))  # TP 1
    paths = exp_manager.experiment_paths(cfg)
    _two_tp_shards(paths.checkpoint_dir)
    with caplog.at_level(logging.WARNING):
        assert exp_manager.resume_plan(cfg, paths)[0] == os.path.join(paths.checkpoint_dir, "step=2")
    assert "was saved with TP 2 x PP 1; this run (TP 1 x PP 1) re-shards its weights and optimizer state" in caplog.text
    cfg.model_alignment_strategy = ModelAlignmentStrategyConfig(sft=SFTConfig(), peft=PeftConfig())
    with pytest.raises(ConfigError, match=r"exp_manager.resume_if_exists: checkpoint \S+step=2 was saved with "
                                          r"tensor_model_parallel_size 2 and pipeline_model_parallel_size 1, this run "
                                          r"has 1 and 1; re-sharding a LoRA run .*tensor_model_parallel_size=2"):
        exp_manager.resume_plan(cfg, paths)
    cfg.distributed_strategy.tensor_model_parallel_size = 2
    assert exp_manager.resume_plan(cfg, paths)[0] == os.path.join(paths.checkpoint_dir, "step=2")
