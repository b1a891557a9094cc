"""xser interop with torch-xla (issue 4 item 6): our files load with ``torch_xla.utils.serialization.load`` and
files written by ``torch_xla.utils.serialization.save`` load with :func:`nxd_lc.checkpoint.xser.load_xser`.

The pickle-level checks run everywhere; the round trips through torch-xla run in the XLA lane
(``make test-xla``: torch-xla 2.9, ``PJRT_DEVICE=CPU``) and skip where torch-xla is not installed.
"""

from __future__ import annotations

import io
import os
import pickle
import pickletools
import zipfile
from collections import OrderedDict

import pytest
import torch

from nxd_lc.checkpoint.xser import TensorReference, _XserPickler, _XserUnpickler, load_xser, save_xser

pytestmark = pytest.mark.compat  # torch-2.9 compatibility subset (lane 2; docs/testing.md)


def _structure(tmp_path) -> tuple[dict, str]:
    w = torch.randn(3, 4)
    obj = {"model": OrderedDict(w=w, tied=w, b=torch.arange(5, dtype=torch.int32)),
           "optim": [{"step": 7, "m": torch.ones(2, dtype=torch.bfloat16)}], "meta": ("llama", 2)}
    path = os.path.join(tmp_path, "dp_rank_00_tp_rank_00_pp_rank_00.pt")
    save_xser(obj, path)
    return obj, path


def _globals_in(path: str) -> set[str]:
    with zipfile.ZipFile(path) as z:
        data = z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))
    return {str(arg) for op, arg, _ in pickletools.genops(data) if op.name == "GLOBAL"}


def test_structure_names_torch_xla_reference_class(tmp_path) -> None:
    obj, path = _structure(tmp_path)
    names = _globals_in(path)
    assert "torch_xla.utils.serialization TensorReference" in names
    assert not any(n.startswith("nxd_lc") for n in names)
    back = load_xser(path)  # and loads without torch-xla, through the custom unpickler
    assert back["model"]["tied"] is back["model"]["w"] and torch.equal(back["model"]["w"], obj["model"]["w"])
    assert back["optim"][0]["m"].dtype == torch.bfloat16 and back["meta"] == ("llama", 2)


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_pickler_protocols_round_trip(protocol: int) -> None:
    buf = io.BytesIO()
    _XserPickler(buf, protocol=protocol).dump({"a": [TensorReference(3), TensorReference(3)], "n": 1})
    out = _XserUnpickler(io.BytesIO(buf.getvalue())).load()
    assert isinstance(out["a"][0], TensorReference) and out["a"][0].tid == 3 and out["n"] == 1
    assert b"torch_xla.utils.serialization" in buf.getvalue()


def _torch_xla():
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    return pytest.importorskip("torch_xla", reason="torch-xla is not installed (XLA lane only: make test-xla)")


@pytest.mark.xla
def test_our_checkpoint_loads_with_torch_xla(tmp_path) -> None:
    _torch_xla()
    import torch_xla.utils.serialization as xser

    obj, path = _structure(tmp_path)
    back = xser.load(path)
    assert torch.equal(back["model"]["w"], obj["model"]["w"]) and torch.equal(back["model"]["b"], obj["model"]["b"])
    assert back["optim"][0]["m"].dtype == torch.bfloat16 and back["optim"][0]["step"] == 7
    # torch-xla's loader (ToXlaTensorArena) rebuilds tuples as lists: its behaviour, not the file's.
    assert list(back["meta"]) == ["llama", 2] and back["model"]["w"].device.type == "cpu"


@pytest.mark.xla
def test_torch_xla_checkpoint_loads_with_ours(tmp_path) -> None:
    torch_xla = _torch_xla()
    import torch_xla.utils.serialization as xser

    dev = torch_xla.device()
    w = torch.randn(4, 3)
    path = os.path.join(tmp_path, "xla.pt")
    xser.save({"w": w.to(dev), "h": [w.to(dev) * 2, torch.ones(2)], "step": 3}, path)
    assert sorted(os.listdir(path + ".tensors")) == ["tensor_0.pt", "tensor_1.pt"]
    with pytest.raises(pickle.UnpicklingError):  # the plain weights-only loader cannot resolve the references
        torch.load(path, weights_only=True)
    back = load_xser(path)
    assert torch.equal(back["w"], w) and torch.equal(back["h"][0], w * 2) and torch.equal(back["h"][1], torch.ones(2))
    assert back["step"] == 3 and back["w"].device.type == "cpu"
