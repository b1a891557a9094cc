"""Tests for nxd_lc.checkpoint: xser format and the atomic NxD-layout sharded checkpoints."""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import textwrap
import types
from typing import Any

import pytest
import torch
from dist_utils import run_distributed

from nxd_lc.checkpoint import (
    checkpoint_file_name,
    cleanup_partial,
    is_complete,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    load_xser,
    remove_checkpoint,
    save_checkpoint,
    save_xser,
)
from nxd_lc.checkpoint.xser import UnsafeCheckpointError, set_weights_only

pytestmark = pytest.mark.compat  # torch-2.9 compatibility subset (lane 2; docs/testing.md)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
Point = collections.namedtuple("Point", ["x", "y"])


class _Boom:
    """Raises while being pickled: simulates a failure after some files were written."""

    def __reduce__(self) -> Any:
        raise RuntimeError("boom while pickling")


def _assert_same(a: Any, b: Any) -> None:
    """Recursive equality with exact dtype/shape for tensors."""
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a.keys()) == list(b.keys())
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same(x, y)
    else:
        assert a == b


def _states(seed: int) -> tuple[dict, dict, dict]:
    g = torch.Generator().manual_seed(seed)
    model = {"w": torch.randn(4, 3, generator=g), "b": torch.randn(3, generator=g).bfloat16(),
             "ids": torch.arange(5)}
    optim = {"state": {0: {"exp_avg": torch.randn(4, 3, generator=g), "step": torch.tensor(3.0)}},
             "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.95), "params": [0]}]}
    return model, optim, {"global_step": seed, "note": "hello"}


def _save(root: str, tag: str, model: Any, optim: Any, user: Any, use_xser: bool = True,
          **kw: Any) -> str:
    return save_checkpoint(root, tag, model_state=model, optim_state=optim, user_content=user,
                           dp_rank=kw.pop("dp_rank", 0), tp_rank=kw.pop("tp_rank", 0), pp_rank=0,
                           is_global_zero=kw.pop("is_global_zero", True),
                           write_model=kw.pop("write_model", True), write_optim=kw.pop("write_optim", True),
                           use_xser=use_xser, **kw)


# ---------------------------------------------------------------- xser


def test_xser_round_trip_nested(tmp_path: Any) -> None:
    obj = {
        "f32": torch.randn(3, 4), "bf16": torch.randn(2, 5).bfloat16(), "i64": torch.arange(7),
        "bool": torch.tensor([True, False]), "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 3),
        "nested": [1, "two", (3.0, torch.ones(2, dtype=torch.float16)), {"deep": [torch.full((1,), 9)]}],
        "named": Point(torch.ones(1), 5), "ordered": collections.OrderedDict(a=torch.zeros(2), b=None),
        "plain": {"lr": 0.1, "name": "x", "none": None},
    }
    path = str(tmp_path / "obj.pt")
    save_xser(obj, path)
    assert sorted(os.listdir(path + ".tensors")) == sorted(f"tensor_{i}.pt" for i in range(10))
    # a custom class (the namedtuple) is code, not data: refused by default, read with the documented opt-in
    # (exp_manager.checkpoint_weights_only: false; tests/test_safe_loading.py); nxd_lc's own files hold none
    with pytest.raises(UnsafeCheckpointError, match="test_checkpoint_format.Point"):
        load_xser(path)
    set_weights_only(False)
    try:
        _assert_same(obj, load_xser(path))
    finally:
        set_weights_only(True)
    del obj["named"]
    save_xser(obj, path)
    _assert_same(obj, load_xser(path))


def test_xser_views_saved_compact(tmp_path: Any) -> None:
    base = torch.arange(4096, dtype=torch.float32).reshape(64, 64)
    obj = {"row": base[3, 1:3], "t": base[:4, :2].t()}
    path = str(tmp_path / "views.pt")
    save_xser(obj, path)
    out = load_xser(path)
    for k, v in obj.items():
        assert torch.equal(out[k], v) and out[k].is_contiguous()
        assert out[k].untyped_storage().nbytes() == v.numel() * 4
    sizes = [os.path.getsize(os.path.join(path + ".tensors", n)) for n in os.listdir(path + ".tensors")]
    assert max(sizes) < 4096  # the 16 KiB base storage was not written


def test_xser_shared_storage_and_identity(tmp_path: Any) -> None:
    w = torch.randn(4, 4)
    obj = {"embed": w, "lm_head": w, "top": w[:2], "bottom": w[2:]}
    path = str(tmp_path / "tied.pt")
    save_xser(obj, path)
    assert len(os.listdir(path + ".tensors")) == 3  # the tied tensor is written once
    out = load_xser(path)
    assert out["embed"] is out["lm_head"]
    assert torch.equal(out["top"], w[:2]) and torch.equal(out["bottom"], w[2:])
    out["top"].zero_()
    assert torch.equal(out["embed"], w)  # views came back as independent compact tensors


def _fake_torch_xla_modules(cls_name: str, module: str) -> tuple[dict[str, types.ModuleType], type]:
    """Fake modules so that pickle records ``module.cls_name`` like the real package would."""
    ref_cls = type(cls_name, (), {"__init__": lambda self, tid: setattr(self, "tid", tid)})
    ref_cls.__module__, ref_cls.__qualname__ = module, cls_name
    parts = module.split(".")
    mods = {".".join(parts[:i]): types.ModuleType(".".join(parts[:i])) for i in range(1, len(parts) + 1)}
    setattr(mods[module], cls_name, ref_cls)
    return mods, ref_cls


@pytest.mark.parametrize("module,cls_name", [
    ("torch_xla.utils.serialization", "TensorReference"),
    ("neuronx_distributed.trainer.checkpoint", "_InternalTensorReference"),
])
def test_xser_loads_file_written_by_torch_xla(tmp_path: Any, monkeypatch: Any, module: str,
                                              cls_name: str) -> None:
    top = module.split(".")[0]
    for name in [m for m in sys.modules if m == top or m.startswith(top + ".")]:
        monkeypatch.delitem(sys.modules, name)  # the XLA lane may have imported the real package already
    path = str(tmp_path / "xla.pt")
    os.mkdir(path + ".tensors")
    w, m = torch.randn(3, 2).bfloat16(), torch.arange(4)
    torch.save(w, os.path.join(path + ".tensors", "tensor_0.pt"))
    torch.save(m, os.path.join(path + ".tensors", "tensor_1.pt"))
    with monkeypatch.context() as mp:
        mods, ref_cls = _fake_torch_xla_modules(cls_name, module)
        for name, mod in mods.items():
            mp.setitem(sys.modules, name, mod)
        torch.save({"model": {"w": ref_cls(0), "m": [ref_cls(1), ref_cls(0)]}, "epoch": 2}, path)
    assert top not in sys.modules
    with open(path, "rb") as f:  # the pickle really names the foreign class
        import zipfile
        with zipfile.ZipFile(f) as z:
            data = z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))
    assert module.encode() in data and cls_name.encode() in data
    out = load_xser(path)
    assert top not in sys.modules
    assert out["epoch"] == 2 and out["model"]["m"][1] is out["model"]["w"]
    _assert_same(out["model"]["w"], w)
    _assert_same(out["model"]["m"][0], m)


def test_xser_missing_tensor_file_names_it(tmp_path: Any) -> None:
    path = str(tmp_path / "x.pt")
    save_xser({"a": torch.ones(1), "b": torch.zeros(1)}, path)
    os.remove(os.path.join(path + ".tensors", "tensor_1.pt"))
    with pytest.raises(FileNotFoundError, match="tensor_1.pt"):
        load_xser(path)
    with pytest.raises(FileNotFoundError, match="nope.pt"):
        load_xser(str(tmp_path / "nope.pt"))


# ---------------------------------------------------------------- layout, single process


def test_checkpoint_file_name() -> None:
    assert checkpoint_file_name(0, 1, 0) == "dp_rank_00_tp_rank_01_pp_rank_00.pt"
    assert checkpoint_file_name(3, 12, 7) == "dp_rank_03_tp_rank_12_pp_rank_07.pt"
    with pytest.raises(ValueError, match="tp_rank"):
        checkpoint_file_name(0, -1, 0)


@pytest.mark.parametrize("use_xser", [True, False])
def test_save_load_round_trip_layout(tmp_path: Any, use_xser: bool) -> None:
    root = str(tmp_path / "ckpt")
    model, optim, user = _states(7)
    path = _save(root, "step_7", model, optim, user, use_xser=use_xser)
    assert path == os.path.join(root, "step_7")
    files = sorted(os.listdir(path))
    assert files == ["checkpoint", "done", "manifest.json", "model", "optim", "user_content.pt"]
    name = "dp_rank_00_tp_rank_00_pp_rank_00.pt"
    assert os.path.isfile(os.path.join(path, "model", name))
    assert os.path.isfile(os.path.join(path, "optim", name))
    assert os.path.isdir(os.path.join(path, "model", name + ".tensors")) == use_xser
    assert [n for n in os.listdir(root) if n.startswith(".")] == []
    with open(os.path.join(root, "newest")) as f:
        assert f.read() == "step_7\n"
    with open(os.path.join(path, "done")) as f:
        assert json.load(f)["step"] == 7
    m, o, u = load_checkpoint(root, "step_7", dp_rank=0, tp_rank=0, pp_rank=0)
    _assert_same(m, model)
    _assert_same(o, optim)
    assert u == user
    assert load_checkpoint(root, "step_7", dp_rank=0, tp_rank=0, pp_rank=0, load_optim=False)[1] is None
    with pytest.warns(UserWarning, match="detected format"):
        load_checkpoint(root, "step_7", dp_rank=0, tp_rank=0, pp_rank=0, use_xser=not use_xser)


def test_save_bf16(tmp_path: Any) -> None:
    root = str(tmp_path)
    model = {"w": torch.randn(3, 3), "h": torch.randn(2).half(), "ids": torch.arange(3)}
    optim = {"m": torch.randn(3, 3)}
    _save(root, "t", model, optim, None, save_bf16=True)
    m, o, u = load_checkpoint(root, "t", dp_rank=0, tp_rank=0, pp_rank=0)
    assert m["w"].dtype == torch.bfloat16 and m["h"].dtype == torch.bfloat16
    assert torch.equal(m["w"], model["w"].bfloat16()) and torch.equal(m["ids"], model["ids"])
    assert o["m"].dtype == torch.float32 and u is None


def test_overwrite_tag_replaces_old(tmp_path: Any) -> None:
    root = str(tmp_path)
    _save(root, "last", *_states(1))
    model2, optim2, user2 = _states(2)
    _save(root, "last", model2, optim2, user2)
    m, _, u = load_checkpoint(root, "last", dp_rank=0, tp_rank=0, pp_rank=0)
    _assert_same(m, model2)
    assert u == user2 and sorted(os.listdir(root)) == ["last", "newest"]


def test_crash_mid_save_keeps_previous(tmp_path: Any) -> None:
    root = str(tmp_path)
    model1, optim1, user1 = _states(1)
    _save(root, "step_1", model1, optim1, user1)
    model2, _, user2 = _states(2)
    for tag in ("step_2", "step_1"):  # a new tag, and overwriting the existing one
        with pytest.raises(RuntimeError, match="boom"):
            _save(root, tag, model2, {"bad": _Boom()}, user2)
        assert latest_checkpoint(root) == "step_1" and list_checkpoints(root) == ["step_1"]
        assert not os.path.exists(os.path.join(root, "step_2"))
        m, o, u = load_checkpoint(root, "step_1", dp_rank=0, tp_rank=0, pp_rank=0)
        _assert_same(m, model1)
        _assert_same(o, optim1)
        assert u == user1
    assert sorted(os.listdir(root)) == ["newest", "step_1"]  # the failed staging dirs were removed


def test_hard_crash_leaves_hidden_staging_then_cleanup(tmp_path: Any) -> None:
    root = str(tmp_path)
    _save(root, "step_1", *_states(1))
    code = textwrap.dedent(f"""
        import os, torch
        from nxd_lc.checkpoint import save_checkpoint
        class Die:
            def __reduce__(self):
                os._exit(3)
        save_checkpoint({root!r}, "step_2", model_state={{"w": torch.ones(2)}},
                        optim_state={{"x": Die()}}, user_content=None, dp_rank=0, tp_rank=0, pp_rank=0,
                        is_global_zero=True, write_model=True, write_optim=True, use_xser=True)
    """)
    env = dict(os.environ, PYTHONPATH=REPO_ROOT, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", code], check=False, env=env,
                          capture_output=True, timeout=120)
    assert proc.returncode == 3, proc.stderr.decode()
    staging = os.path.join(root, ".step_2.partial")
    assert os.path.isfile(os.path.join(staging, "model", "dp_rank_00_tp_rank_00_pp_rank_00.pt"))
    assert latest_checkpoint(root) == "step_1"
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_checkpoint(root, "step_2", dp_rank=0, tp_rank=0, pp_rank=0)
    os.makedirs(os.path.join(root, ".step_1.trash-" + "0" * 32, "model"))
    assert cleanup_partial(root) == [".step_1.trash-" + "0" * 32, ".step_2.partial"]
    assert sorted(os.listdir(root)) == ["newest", "step_1"]


def test_cleanup_partial_publishes_complete_staging(tmp_path: Any) -> None:
    root = str(tmp_path)
    _save(root, "step_3", *_states(3))
    # crash between moving the old 'step_3' aside and publishing the new (complete) one
    os.replace(os.path.join(root, "step_3"), os.path.join(root, ".step_3.partial"))
    assert latest_checkpoint(root) is None
    assert cleanup_partial(root) == []
    assert latest_checkpoint(root) == "step_3" and is_complete(os.path.join(root, "step_3"))
    assert cleanup_partial(str(tmp_path / "missing")) == []


def test_list_order_remove_and_newest(tmp_path: Any) -> None:
    root = str(tmp_path)
    for step in (20, 5, 10):
        _save(root, f"step_{step}", *_states(step))
    assert list_checkpoints(root) == ["step_5", "step_10", "step_20"]
    os.makedirs(os.path.join(root, "not_done", "model"))  # incomplete, visible: ignored
    assert latest_checkpoint(root) == "step_20"
    remove_checkpoint(root, "step_20")
    assert list_checkpoints(root) == ["step_5", "step_10"]
    with open(os.path.join(root, "newest")) as f:
        assert f.read().splitlines() == ["step_5", "step_10"]
    with pytest.raises(FileNotFoundError, match="step_20"):
        remove_checkpoint(root, "step_20")
    nxd_tag = os.path.join(root, "nxd_written")  # NxD's plain "1" marker: no step -> save-time order
    os.makedirs(nxd_tag)
    with open(os.path.join(nxd_tag, "done"), "w") as f:
        f.write("1")
    os.utime(os.path.join(nxd_tag, "done"), (1.0, 1.0))
    assert list_checkpoints(root) == ["nxd_written", "step_5", "step_10"]


def test_load_errors(tmp_path: Any) -> None:
    root = str(tmp_path)
    _save(root, "ok", *_states(1))
    with pytest.raises(FileNotFoundError, match=r"complete checkpoints .*\['ok'\]"):
        load_checkpoint(root, "nope", dp_rank=0, tp_rank=0, pp_rank=0)
    os.remove(os.path.join(root, "ok", "done"))
    with pytest.raises(FileNotFoundError, match="incomplete"):
        load_checkpoint(root, "ok", dp_rank=0, tp_rank=0, pp_rank=0)
    with pytest.raises(ValueError, match="tag"):
        _save(root, ".hidden", *_states(1))
    with pytest.raises(ValueError, match="DP rank 0 only"):
        _save(root, "x", *_states(1), dp_rank=1)


def test_optimizer_dp_files(tmp_path: Any) -> None:
    root = str(tmp_path)
    model, optim, _ = _states(4)
    _save(root, "plain", model, optim, None)  # optimizer replicated over DP: only DP rank 0's file
    _, o, _ = load_checkpoint(root, "plain", dp_rank=1, tp_rank=0, pp_rank=0)
    _assert_same(o, optim)
    # zero1 with DP size 2: every DP rank has its own optimizer file (DP rank 1's copied in here)
    _save(root, "zero1", model, {"dp": torch.tensor(0)}, None, use_xser=False)
    optim_dir = os.path.join(root, "zero1", "optim")
    torch.save({"dp": torch.tensor(1)}, os.path.join(optim_dir, checkpoint_file_name(1, 0, 0)))
    for dp in (0, 1):  # the copied-in file is not in the manifest: load unverified
        assert load_checkpoint(root, "zero1", dp_rank=dp, tp_rank=0, pp_rank=0, verify=False)[1]["dp"].item() == dp
    with pytest.raises(FileNotFoundError, match="DP size 2"):
        load_checkpoint(root, "zero1", dp_rank=2, tp_rank=0, pp_rank=0)


# ---------------------------------------------------------------- two gloo ranks as TP ranks


def _tp_round_trip_worker(rank: int, world_size: int, root: str) -> None:
    model, optim, user = _states(10 + rank)
    _save(root, "step_1", model, optim, user, tp_rank=rank, is_global_zero=rank == 0)
    names = sorted(os.listdir(os.path.join(root, "step_1", "model")))
    assert names == ["dp_rank_00_tp_rank_00_pp_rank_00.pt", "dp_rank_00_tp_rank_00_pp_rank_00.pt.info.pt",
                     "dp_rank_00_tp_rank_00_pp_rank_00.pt.tensors", "dp_rank_00_tp_rank_01_pp_rank_00.pt",
                     "dp_rank_00_tp_rank_01_pp_rank_00.pt.info.pt", "dp_rank_00_tp_rank_01_pp_rank_00.pt.tensors"]
    m, o, u = load_checkpoint(root, "step_1", dp_rank=0, tp_rank=rank, pp_rank=0)
    _assert_same(m, model)
    _assert_same(o, optim)
    assert u == _states(10)[2]  # user content comes from global rank 0
    with pytest.raises(FileNotFoundError, match="TP size 2, PP size 1"):
        load_checkpoint(root, "step_1", dp_rank=0, tp_rank=2, pp_rank=0)
    torch.distributed.barrier()
    # rank 1 fails after rank 0 wrote its shards: nothing is published, step_1 stays intact
    bad_optim = {"bad": _Boom()} if rank == 1 else optim
    with pytest.raises(RuntimeError, match="boom" if rank == 1 else "failed on another rank"):
        _save(root, "step_2", model, bad_optim, user, tp_rank=rank, is_global_zero=rank == 0)
    torch.distributed.barrier()
    assert latest_checkpoint(root) == "step_1" and list_checkpoints(root) == ["step_1"]
    _assert_same(load_checkpoint(root, "step_1", dp_rank=0, tp_rank=rank, pp_rank=0)[0], model)
    assert sorted(os.listdir(root)) == ["newest", "step_1"]


@pytest.mark.distributed
def test_two_tp_ranks_round_trip_and_failure(tmp_path: Any) -> None:
    run_distributed(_tp_round_trip_worker, 2, str(tmp_path / "ckpt"))
