"""exp_manager paths/resume plan and the config -> environment mapping."""

from __future__ import annotations

import logging
import os

import pytest
from omegaconf import OmegaConf

from nxd_lc.checkpoint import sharded
from nxd_lc.config.errors import ConfigError
from nxd_lc.config.schema import NxdConfig
from nxd_lc.lightning import exp_manager
from nxd_lc.runtime.env import apply_env, format_env_table

pytestmark = pytest.mark.compat  # torch-2.9 compatibility subset (lane 2; docs/testing.md)


def _cfg(**exp: object) -> NxdConfig:
    base = OmegaConf.structured(NxdConfig)
    base.exp_manager = OmegaConf.merge(base.exp_manager, exp)
    return OmegaConf.to_object(base)  # type: ignore[return-value]


def _save(root: str, tag: str, step: int, optim: bool = False) -> str:
    sharded.save_checkpoint(root, tag, model_state={"w": step}, optim_state={"o": step} if optim else None,
                            user_content={"global_step": step}, dp_rank=0, tp_rank=0, pp_rank=0, is_global_zero=True,
                            write_model=True, write_optim=optim, use_xser=False)
    return os.path.join(root, tag)


def test_paths_explicit_and_exp_dir(tmp_path) -> None:
    p = exp_manager.experiment_paths(_cfg(explicit_log_dir=str(tmp_path / "x")))
    assert p.log_dir == str(tmp_path / "x") and p.checkpoint_dir == str(tmp_path / "x" / "checkpoints")
    p = exp_manager.experiment_paths(_cfg(exp_dir=str(tmp_path), name="run"))
    assert p.log_dir == str(tmp_path / "run")


def test_resume_plan_picks_newest_complete_and_ignores_partial(tmp_path, caplog) -> None:
    cfg = _cfg(explicit_log_dir=str(tmp_path))
    paths = exp_manager.experiment_paths(cfg)
    assert exp_manager.resume_plan(cfg, paths) == (None, None)
    _save(paths.checkpoint_dir, "step=2", 2)
    newest = _save(paths.checkpoint_dir, "step=4", 4)
    os.makedirs(os.path.join(paths.checkpoint_dir, ".step=6.partial", "model"))  # an interrupted save
    assert exp_manager.resume_plan(cfg, paths) == (newest, None)
    os.makedirs(os.path.join(paths.checkpoint_dir, "step=5", "model"))  # visible, no done: not nxd_lc's
    with caplog.at_level(logging.WARNING, logger="nxd_lc.lightning.exp_manager"):
        exp_manager.cleanup_interrupted_saves(paths, is_global_zero=True)
    assert sorted(os.listdir(paths.checkpoint_dir)) == ["newest", "step=2", "step=4", "step=5"]  # kept
    assert "step=5 has no 'done' marker: it is never picked as the newest checkpoint" in caplog.text
    assert exp_manager.resume_plan(cfg, paths) == (newest, None)


def test_resume_plan_errors_and_explicit(tmp_path) -> None:
    strict = _cfg(explicit_log_dir=str(tmp_path / "a"), resume_ignore_no_checkpoint=False)
    with pytest.raises(ConfigError, match="exp_manager.resume_if_exists: no complete checkpoint"):
        exp_manager.resume_plan(strict, exp_manager.experiment_paths(strict))
    incomplete = tmp_path / "ck" / "step=1"
    incomplete.mkdir(parents=True)
    bad = _cfg(explicit_log_dir=str(tmp_path / "b"), resume_from_checkpoint=str(incomplete))
    with pytest.raises(ConfigError, match="exp_manager.resume_from_checkpoint: .* not a complete checkpoint"):
        exp_manager.resume_plan(bad, exp_manager.experiment_paths(bad))
    weights = _save(str(tmp_path / "ck"), "step=2", 2)  # no optimizer state: a full resume cannot use it
    cfg = _cfg(explicit_log_dir=str(tmp_path / "c"), resume_from_checkpoint=weights)
    with pytest.raises(ConfigError, match="holds model weights only .* model.weight_init_only: true"):
        exp_manager.resume_plan(cfg, exp_manager.experiment_paths(cfg))
    good = _save(str(tmp_path / "ck"), "step=3", 3, optim=True)
    cfg = _cfg(explicit_log_dir=str(tmp_path / "c"), resume_from_checkpoint=good)
    assert exp_manager.resume_plan(cfg, exp_manager.experiment_paths(cfg)) == (good, None)


def test_weight_init_only_then_own_checkpoints_win(tmp_path) -> None:
    init = _save(str(tmp_path / "pretrained"), "step=9", 9)
    cfg = _cfg(explicit_log_dir=str(tmp_path / "run"), resume_from_checkpoint=init)
    cfg.model.weight_init_only = True
    paths = exp_manager.experiment_paths(cfg)
    assert exp_manager.resume_plan(cfg, paths) == (None, init)
    own = _save(paths.checkpoint_dir, "step=1", 1)
    assert exp_manager.resume_plan(cfg, paths) == (own, None)


def test_log_files_follow_log_local_rank_0_only(tmp_path) -> None:
    cfg = _cfg(explicit_log_dir=str(tmp_path))
    paths = exp_manager.experiment_paths(cfg)
    assert exp_manager.setup_log_files(cfg, paths, global_rank=1, local_rank=1) is None
    cfg.exp_manager.log_local_rank_0_only = False
    path = exp_manager.setup_log_files(cfg, paths, global_rank=1, local_rank=1)
    assert path is not None and path.endswith("nxd_lc_log_globalrank-1_localrank-1.txt")


def test_env_mapping_existing_variables_win() -> None:
    cfg = _cfg()
    cfg.compiler_flags = "--model-type transformer"
    cfg.async_exec_max_inflight_requests = 5
    cfg.bucket_size_collectives = 1024
    cfg.neuron_experimental_compress_rg = False
    env = {"NEURON_RT_EXEC_TIMEOUT": "7", "NEURON_CC_FLAGS": "--foo", "BUCKET_CAP_MB": "64"}
    cfg.neuron_rt_exec_timeout = 100
    entries = {e.var: e for e in apply_env(cfg, environ=env)}
    assert env["NEURON_RT_EXEC_TIMEOUT"] == "7" and entries["NEURON_RT_EXEC_TIMEOUT"].source == "environment"
    assert env["BUCKET_CAP_MB"] == "64"
    assert env["NEURON_RT_ASYNC_EXEC_MAX_INFLIGHT_REQUESTS"] == "5"
    assert env["NEURON_EXPERIMENTAL_COMPRESS_RG"] == "0"
    assert env["NEURON_CC_FLAGS"] == "--foo --auto-cast none --model-type transformer"  # fp32 flag, then config's
    assert env["XLA_USE_BF16"] == "0" and env["XLA_DOWNCAST_BF16"] == "0"
    assert env["NEURON_COMPILE_CACHE_URL"] == "./compiler_cache" and env["NEURON_FUSE_SOFTMAX"] == "1"
    assert "NEURON_RT_EXEC_TIMEOUT" in format_env_table(list(entries.values()))
    apply_env(cfg, environ=env)  # idempotent: flags are not appended twice
    assert env["NEURON_CC_FLAGS"] == "--foo --auto-cast none --model-type transformer"


_NODE = {"MALLOC_ARENA_MAX": "128", "XLA_DISABLE_FUNCTIONALIZATION": "0"}
_EFA = {"FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1", "FI_EFA_FORK_SAFE": "1"}


@pytest.mark.parametrize("accelerator,nodes,expected", [
    ("cpu", 2, {}),  # NxDT's train_setup.sh settings are Trainium node settings
    ("gpu", 1, {}),
    ("xla", 1, _NODE),
    ("neuron", 1, _NODE),  # no torch-neuronx here: neuron would run on torch-xla
    ("xla", 2, {**_NODE, **_EFA}),  # EFA between nodes only
    ("native", 2, {"MALLOC_ARENA_MAX": "128", **_EFA}),  # TorchNeuron: no torch-xla
])
def test_node_settings_where_they_apply(accelerator: str, nodes: int, expected: dict[str, str],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 39: NxDT's train_setup.sh variables, one row each, only where they apply; the environment wins."""
    from nxd_lc.runtime import device
    from nxd_lc.runtime.env import NATIVE_NEFF_CACHE_VAR, NODE_ENV

    cfg = _cfg()
    cfg.trainer.accelerator, cfg.trainer.num_nodes = accelerator, nodes
    if accelerator == "native":
        cfg.trainer.accelerator = "neuron"
        monkeypatch.setattr(device, "neuron_resolution", lambda: "neuron_native")
    env: dict[str, str] = {}
    rows = {e.var: e for e in apply_env(cfg, environ=env)}
    node_vars = {var for var, _, _ in NODE_ENV}
    assert {v: env[v] for v in node_vars if v in env} == expected
    assert all(rows[v].key == ("trainer.num_nodes" if v.startswith("FI_") else "trainer.accelerator")
               for v in expected)
    assert (NATIVE_NEFF_CACHE_VAR in env) is (accelerator == "native")  # compiler_cache_url on TorchNeuron
    if accelerator == "native":
        assert env[NATIVE_NEFF_CACHE_VAR] == cfg.compiler_cache_url
        cfg.compiler_cache_url = "s3://bucket/cache"  # not a directory: TorchNeuron keeps its default
        assert NATIVE_NEFF_CACHE_VAR not in {e.var for e in apply_env(cfg, environ={})}
    if expected:
        preset = {"FI_PROVIDER": "sockets", "MALLOC_ARENA_MAX": "8"}
        rows = {e.var: e for e in apply_env(cfg, environ=preset)}
        assert preset["MALLOC_ARENA_MAX"] == "8" and rows["MALLOC_ARENA_MAX"].source == "environment"
        assert preset["FI_PROVIDER"] == "sockets"
        assert ("FI_PROVIDER" in rows) is (nodes > 1)
        assert all(rows[v].source == "environment" for v in ("FI_PROVIDER", "MALLOC_ARENA_MAX") if v in rows)


def test_malloc_arena_max_reaches_this_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """glibc reads MALLOC_ARENA_MAX at the first allocation: startup also applies it with mallopt, for the live
    process only (not for a dry run's copy of the environment, nor when the environment set it)."""
    from nxd_lc.runtime import env as env_module

    calls: list[str] = []
    monkeypatch.setattr(env_module, "limit_malloc_arenas", calls.append)
    cfg = _cfg()
    cfg.trainer.accelerator = "xla"
    apply_env(cfg, environ={})
    assert calls == []
    monkeypatch.setattr(os, "environ", {})
    apply_env(cfg)
    assert calls == ["128"]
    monkeypatch.setattr(os, "environ", {"MALLOC_ARENA_MAX": "64"})
    apply_env(cfg)
    assert calls == ["128"]
    monkeypatch.undo()
    import platform

    assert env_module.limit_malloc_arenas("128") is (platform.libc_ver()[0] == "glibc")
    assert env_module.limit_malloc_arenas("many") is False


@pytest.mark.parametrize("ptype,sr", [("bf16SR", "1"), ("mixed_precision", "0"), ("mixed_precisionSR", "1"),
                                      ("manual", "0")])
def test_precision_env_never_turns_float32_into_bf16(ptype: str, sr: str) -> None:
    """Issue 38: NxDT sets XLA_USE_BF16=1 (bf16SR) / XLA_DOWNCAST_BF16=1 (mixed_precision*), under which torch-xla
    stores every float32 tensor -- master weights included -- as bf16. nxd_lc sets both to '0' in every mode (bf16
    parameters by explicit casts) and keeps the runtime's stochastic-rounding switch of the SR modes."""
    cfg = _cfg()
    cfg.precision.type = ptype
    if ptype == "manual":
        cfg.precision.xla_downcast_bf16, cfg.precision.master_weights = "1", True
    env: dict[str, str] = {}
    apply_env(cfg, environ=env)
    got = (env["XLA_USE_BF16"], env["XLA_DOWNCAST_BF16"], env["NEURON_RT_STOCHASTIC_ROUNDING_EN"])
    assert got == ("0", "0", sr)
    if ptype != "manual":
        assert "--enable-mixed-precision-accumulation" in env["NEURON_CC_FLAGS"]


@pytest.mark.parametrize("value,on", [("1", True), ("true", True), (" 2", True), ("0", False), ("false", False),
                                      ("TRUE", False), ("", False), ("yes", False), ("-1", True)])
def test_preset_bf16_flags_read_as_torch_xla_reads_them(value: str, on: bool) -> None:
    """torch-xla's GetEnvBool: 'true' / 'false' exactly, else C atoi != 0 (pytorch/xla runtime/sys_util.cc)."""
    from nxd_lc.runtime.env import preset_bf16_flags

    lines = preset_bf16_flags({"XLA_DOWNCAST_BF16": value})
    assert bool(lines) is on
    if on:
        assert lines[0].startswith(f"XLA_DOWNCAST_BF16={value} is set in the environment") and "unset" in lines[0]
