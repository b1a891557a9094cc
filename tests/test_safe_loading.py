"""A checkpoint is data, never code (issue 26): every file nxd_lc reads from a checkpoint, cache or adapter
directory goes through torch's restricted unpickler with an explicit allowlist (nxd_lc.checkpoint.xser.SAFE_GLOBALS).

Each crafted file below holds an object whose ``__reduce__`` is ``os.system("touch <marker>")`` (what an attacker
plants); the file is refused with an error naming the file and the global, and the marker file proves that nothing
ran. Our own files, and torch-xla / NxD xser files (tests/test_checkpoint_format.py::
test_xser_loads_file_written_by_torch_xla, now through the same restricted loader), keep loading; the documented opt-in
(``exp_manager.checkpoint_weights_only: false``) reads a trusted legacy file with a custom object."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

from nxd_lc.checkpoint import sharded, xser
from nxd_lc.checkpoint.xser import UnsafeCheckpointError, set_weights_only

pytestmark = pytest.mark.compat  # torch-2.9 compatibility subset (lane 2; docs/testing.md)


class Planted:
    """Unpickling this runs ``touch <marker>`` (the attack)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (os.system, (f"touch {self.marker}",))


@dataclass
class LegacyPoint:
    """A harmless custom object a trusted legacy checkpoint might hold."""

    x: int


@pytest.fixture
def marker(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "code_ran"
    yield path
    set_weights_only(True)  # a test that opted in leaves the process as it found it


def _refused(excinfo: pytest.ExceptionInfo, path: Path | str, marker: Path) -> None:
    assert isinstance(excinfo.value, UnsafeCheckpointError)
    assert str(path) in str(excinfo.value) and excinfo.value.refused == "posix.system"
    assert "nothing in the file was run" in str(excinfo.value) and "re-save its state as tensors" in str(excinfo.value)
    assert "checkpoint_weights_only" not in str(excinfo.value), "advised turning off the safe loader"
    assert not marker.exists(), "the planted code ran"


def test_the_planted_object_really_runs_code_when_fully_unpickled(tmp_path: Path, marker: Path) -> None:
    """The crafted file is a real attack: a full unpickle (what NxD / torch-xla / nxd_lc before issue 26 did) runs
    it. Every other test shows nxd_lc's loaders refuse the same file."""
    path = tmp_path / "planted.pt"
    torch.save({"w": torch.ones(2), "x": Planted(marker)}, path)
    torch.load(path, weights_only=False)
    assert marker.exists()


@pytest.mark.parametrize("use_xser", [True, False])
@pytest.mark.parametrize("part", ["model", "optim", "user_content"])
def test_planted_checkpoint_files_are_refused(tmp_path: Path, marker: Path, use_xser: bool, part: str) -> None:
    """Model shard structure, optimizer shard (xser and plain torch.save) and ``user_content.pt``: the checkpoint
    verifies (its manifest was written with it) and loading it raises, naming the file and the global."""
    planted = {"w": torch.ones(3), "evil": Planted(marker)}
    states = {"model": {"w": torch.ones(3)}, "optim": {"state": {}}, "user_content": {"global_step": 1}}
    states[part] = planted
    sharded.save_checkpoint(str(tmp_path), "step=1", model_state=states["model"], optim_state=states["optim"],
                            user_content=states["user_content"], dp_rank=0, tp_rank=0, pp_rank=0,
                            is_global_zero=True, write_model=True, write_optim=True, use_xser=use_xser)
    with pytest.raises(UnsafeCheckpointError) as excinfo:
        sharded.load_checkpoint(str(tmp_path), "step=1", dp_rank=0, tp_rank=0, pp_rank=0)
    name = {"model": f"model/{sharded.checkpoint_file_name(0, 0, 0)}",
            "optim": f"optim/{sharded.checkpoint_file_name(0, 0, 0)}", "user_content": sharded.USER_CONTENT_FILE}
    _refused(excinfo, tmp_path / "step=1" / name[part], marker)


def test_a_damaged_file_is_called_damaged_without_advising_the_unsafe_loader(tmp_path: Path) -> None:
    """Bytes that are no pickle (a damaged shard): the error says damaged and names the file; it does not advise
    ``exp_manager.checkpoint_weights_only: false`` (issue 40, item 11: it did, for data merely damaged)."""
    path = tmp_path / "damaged.pt"
    path.write_bytes(bytes(range(256)) * 4)
    with pytest.raises(UnsafeCheckpointError) as excinfo:
        xser.safe_torch_load(str(path))
    text = str(excinfo.value)
    assert excinfo.value.refused is None and text.startswith(f"{path}: not a readable checkpoint: the file is "
                                                             "damaged"), text
    assert "checkpoint_weights_only" not in text and "full unpickling" not in text, text


def test_planted_tensor_file_of_an_xser_shard_is_refused(tmp_path: Path, marker: Path) -> None:
    path = tmp_path / "shard.pt"
    xser.save_xser({"w": torch.ones(2)}, str(path))
    tensor_file = xser.tensor_file(str(path), 0)
    torch.save(Planted(marker), tensor_file)
    with pytest.raises(UnsafeCheckpointError) as excinfo:
        xser.load_xser(str(path))
    _refused(excinfo, tensor_file, marker)


def test_own_checkpoint_files_load_under_the_allowlist(tmp_path: Path) -> None:
    """What nxd_lc writes (nested containers, tensors, numbers, strings, None, tuples) loads with the restricted
    unpickler, equal to what was saved; equal ids stay one tensor."""
    shared = torch.arange(4.0)
    state = {"a": shared, "b": [shared, (1, 2.5, "s", None)], "c": {"d": torch.ones(2, dtype=torch.bfloat16)}}
    path = tmp_path / "own.pt"
    xser.save_xser(state, str(path))
    back = xser.load_xser(str(path))
    assert back["a"] is back["b"][0] and torch.equal(back["a"], shared)
    assert back["b"][1] == (1, 2.5, "s", None) and back["c"]["d"].dtype == torch.bfloat16


def test_restricted_loads_in_two_threads_do_not_take_each_others_allowlist(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's ``safe_globals`` context adds to and removes from one process-wide set: a thread that left it while
    another was still inside its load took the allowance away (the load was refused; seen with one thread per XLA
    device on the test bed). Thread A's load is held open until thread B has finished its own (or 1 s): both
    structure files still load."""
    import threading

    paths = []
    for name in ("a", "b"):
        paths.append(tmp_path / f"{name}.pt")
        xser.save_xser({"w": torch.arange(3.0)}, str(paths[-1]))
    a_inside, b_done, results = threading.Event(), threading.Event(), {}
    real_load = torch.load

    def held_load(*args: Any, **kwargs: Any) -> Any:
        if threading.current_thread().name == "A":
            a_inside.set()
            b_done.wait(timeout=1.0)  # with the lock B cannot finish meanwhile: A goes on after the timeout
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", held_load)

    def load(name: str, path: Path) -> None:
        try:
            results[name] = xser.load_xser(str(path))["w"]
        except UnsafeCheckpointError as e:
            results[name] = e
        finally:
            if name == "B":
                b_done.set()

    a = threading.Thread(target=load, args=("A", paths[0]), name="A")
    a.start()
    assert a_inside.wait(timeout=10)  # A is inside its restricted load
    b = threading.Thread(target=load, args=("B", paths[1]), name="B")
    b.start()
    a.join()
    b.join()
    assert all(isinstance(r, torch.Tensor) and torch.equal(r, torch.arange(3.0)) for r in results.values()), results


def test_planted_user_content_next_to_a_run_runs_nothing(tmp_path: Path, marker: Path) -> None:
    """Reconciling ``save_top_k`` reads the ``user_content.pt`` of every checkpoint directory in the run directory:
    a planted directory is not counted (logged), and its code does not run."""
    from nxd_lc.lightning.callbacks import NxDModelCheckpoint

    tag = tmp_path / "checkpoints" / "planted--step=1"
    tag.mkdir(parents=True)
    torch.save({"global_step": 1, "callbacks": {"x": Planted(marker)}}, tag / sharded.USER_CONTENT_FILE)
    callback = NxDModelCheckpoint(dirpath=str(tmp_path / "checkpoints"), monitor="val_loss", save_top_k=2)
    assert callback._recorded_score(str(tag), max_step=10) is None
    assert not marker.exists()


def test_planted_lora_adapter_is_refused(tmp_path: Path, marker: Path) -> None:
    from nxd_lc.alignment.lora_files import load_adapters
    from nxd_lc.config.peft_schema import PeftConfig

    path = tmp_path / "adapter.pt"
    torch.save({"layers.0.lora_A": torch.ones(2), "evil": Planted(marker)}, path)
    with pytest.raises(UnsafeCheckpointError) as excinfo:
        load_adapters(torch.nn.Linear(2, 2), PeftConfig(), str(path))
    _refused(excinfo, path, marker)


def test_planted_dpo_reference_table_is_refused(tmp_path: Path, marker: Path) -> None:
    from nxd_lc.alignment.reference import load_reference_tables

    path = tmp_path / "train.jsonl.ref_logps-abc.pt"
    torch.save({"fingerprint": "abc", "tables": {"train": Planted(marker)}}, path)
    with pytest.raises(UnsafeCheckpointError) as excinfo:
        load_reference_tables(str(path), "abc", {"train": 1}, torch.device("cpu"))
    _refused(excinfo, path, marker)


def test_planted_hf_conversion_cache_entry_runs_nothing(tmp_path: Path, marker: Path) -> None:
    """The conversion cache is safetensors (a header and raw bytes, no pickle): a pickle planted under its name,
    with a matching checksum sidecar, fails to parse as safetensors; no code runs."""
    from nxd_lc.models.llama import hf_cache
    from nxd_lc.runtime.files import file_digest

    model = torch.nn.Linear(2, 2)
    entry = tmp_path / "key" / "tp00_pp00.safetensors"
    entry.parent.mkdir()
    torch.save({"evil": Planted(marker)}, entry)
    (tmp_path / "key" / "tp00_pp00.safetensors.sha256").write_text(file_digest(str(entry))[1])
    with pytest.raises(Exception) as excinfo:  # noqa: B017 - safetensors' own error type differs across versions
        hf_cache.load_or_convert(model, str(tmp_path / "hf"), str(tmp_path), "key", tp_rank=0, pp_rank=0,
                                 force=False, convert=lambda m, d: None)
    assert not isinstance(excinfo.value, AssertionError)
    assert not marker.exists()


def test_trusted_legacy_file_loads_with_the_opt_in(tmp_path: Path, marker: Path,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    """``exp_manager.checkpoint_weights_only: false`` (set_weights_only(False)) reads a file with a custom object,
    with a warning; by default the same file is refused, naming the class."""
    path = tmp_path / "legacy.pt"
    torch.save({"point": LegacyPoint(3), "w": torch.ones(1)}, path)
    with pytest.raises(UnsafeCheckpointError, match=r"test_safe_loading\.LegacyPoint"):
        xser.load_structure(str(path))
    with caplog.at_level(logging.WARNING):
        set_weights_only(False)
    assert "runs any code they contain" in caplog.text
    assert xser.load_structure(str(path))["point"] == LegacyPoint(3)


def test_the_opt_in_is_a_config_key_default_off() -> None:
    from nxd_lc.app.validation import load_config
    from nxd_lc.config.errors import ConfigError
    from nxd_lc.config.schema import ExpManagerConfig

    assert ExpManagerConfig().checkpoint_weights_only is True
    with pytest.raises(ConfigError, match="exp_manager.checkpoint_weights_only"):
        load_config({"exp_manager": {"checkpoint_weights_only": "maybe"}})
