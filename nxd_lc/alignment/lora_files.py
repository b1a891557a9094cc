"""The adapter files of a LoRA run (``model_alignment_strategy.peft``), written at its end and read by
``load_lora_from_ckpt``.

Layout under ``<log_dir>/lora/`` (NxD's ``LoraConfig`` switches):

* ``merge_sharded_lora: true`` (default): ``adapters.pt``, the adapters gathered over TP into full, TP-independent
  tensors (``A [r, in]``, ``B [out, r]``; :func:`nxd_lc.layers.lora.lora_state_dict` with ``full=True``), loadable
  at any TP size. ``false``: ``adapters_tp_rank_XX_pp_rank_XX.pt``, each rank's own shard (no gather), written by
  DP / CP rank 0 of each (TP, PP) position, loadable at the same TP size by pointing ``lora_ckpt_path`` at the
  directory.
* ``save_lora_config_adapter: true`` (default): each adapter file also holds the LoRA settings under
  ``lora_config``; ``false``: they go to ``adapter_config.json`` beside the adapters. Either way, loading checks
  ``lora_rank``, ``lora_alpha`` and ``target_modules`` against the run's (a different ``lora_alpha`` would rescale
  the trained update without any shape error).
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from nxd_lc.checkpoint.xser import UnsafeCheckpointError, safe_torch_load
from nxd_lc.config.input_files import read_json
from nxd_lc.config.peft_schema import PEFT_KEY, PeftConfig

log = logging.getLogger(__name__)

#: Key of the LoRA settings inside an adapter file (``save_lora_config_adapter: true``), as NxD names it.
LORA_CONFIG_KEY = "lora_config"
#: File holding the LoRA settings beside the adapters (``save_lora_config_adapter: false``).
ADAPTER_CONFIG_FILE = "adapter_config.json"
#: The settings saved with the adapters; the first three must match when they are loaded.
_CHECKED = ("lora_rank", "lora_alpha", "target_modules")
_SAVED = (*_CHECKED, "lora_dropout", "lora_bias")


def lora_settings(peft: PeftConfig) -> dict[str, Any]:
    """The settings saved with the adapters (plain Python values)."""
    out = {k: getattr(peft, k) for k in _SAVED}
    out["target_modules"] = sorted(out["target_modules"])
    return out


def shard_file_name() -> str:
    """This rank's adapter shard file (``merge_sharded_lora: false``)."""
    from nxd_lc.distributed import parallel_state as ps

    return (f"adapters_tp_rank_{ps.get_tensor_model_parallel_rank():02d}_"
            f"pp_rank_{ps.get_pipeline_model_parallel_rank():02d}.pt")


def _atomic_write(path: str, write: Any) -> None:
    """``write(tmp_path)`` then rename onto ``path``: readers never see a partial file."""
    write(path + ".tmp")
    os.replace(path + ".tmp", path)


def _write_json(obj: Any, path: str) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


def save_adapters(model: nn.Module, peft: PeftConfig, out_dir: str, is_rank0: bool) -> str:
    """Write the adapters of ``model`` under ``out_dir`` (module doc). Collective over TP with
    ``merge_sharded_lora`` (every rank calls it). Returns the adapter file (or shard directory)."""
    from nxd_lc.distributed import parallel_state as ps
    from nxd_lc.distributed.gather import gather_pipeline_stages
    from nxd_lc.layers.lora import lora_state_dict

    if peft.merge_sharded_lora:  # full over TP, and every pipeline stage's adapters in the one file
        adapters = gather_pipeline_stages(lora_state_dict(model, full=True), rank0_only=True)
        name, writer = "adapters.pt", is_rank0
    else:
        adapters, name = lora_state_dict(model, full=False), shard_file_name()
        writer = ps.get_data_parallel_rank() == 0 and ps.get_context_parallel_rank() == 0
    settings = lora_settings(peft)
    if writer:
        os.makedirs(out_dir, exist_ok=True)
        content: dict[str, Any] = {**adapters, LORA_CONFIG_KEY: settings} if peft.save_lora_config_adapter \
            else dict(adapters)
        _atomic_write(os.path.join(out_dir, name), lambda p: torch.save(content, p))
    if is_rank0 and not peft.save_lora_config_adapter:
        os.makedirs(out_dir, exist_ok=True)
        _atomic_write(os.path.join(out_dir, ADAPTER_CONFIG_FILE), lambda p: _write_json(settings, p))
    target = os.path.join(out_dir, name) if peft.merge_sharded_lora else out_dir
    if is_rank0:
        log.info("LoRA adapters saved: %s", target)
    return target


def _check_settings(saved: dict[str, Any], peft: PeftConfig, where: str) -> None:
    """Raise ValueError naming each ``peft`` key whose value differs from the one the adapters were saved with."""
    run = lora_settings(peft)
    saved = {**saved, "target_modules": sorted(saved["target_modules"])}
    bad = [f"{PEFT_KEY}.{k}: {run[k]!r} but the adapters in {where} were trained with {saved[k]!r}"
           for k in _CHECKED if saved[k] != run[k]]
    if bad:
        raise ValueError("; ".join(bad))


#: Largest ``adapter_config.json`` read (ours are ~150 bytes): a bigger file is not an adapter config.
MAX_CONFIG_BYTES = 1 << 20


def _is_number(v: Any) -> bool:
    return type(v) in (int, float) and math.isfinite(v)


#: Each saved setting's check and the type it must have (``lora_dropout`` / ``lora_bias`` are checked when present).
_SETTING_TYPES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "lora_rank": (lambda v: type(v) is int and v >= 1, "a whole number >= 1"),
    "lora_alpha": (lambda v: _is_number(v) and v > 0, "a finite number > 0"),
    "target_modules": (lambda v: isinstance(v, list) and all(isinstance(m, str) for m in v),
                       "a list of module names (strings)"),
    "lora_dropout": (lambda v: _is_number(v) and 0 <= v < 1, "a number in [0, 1)"),
    "lora_bias": (lambda v: isinstance(v, str), "a string"),
}


def _settings_problems(saved: Any, where: str) -> list[str]:
    """Every problem of the saved LoRA settings ``saved`` read from ``where`` (empty when usable)."""
    if not isinstance(saved, dict):
        return [f"{where}: the LoRA settings must be a JSON object / dict of {', '.join(_CHECKED)}, got "
                f"{type(saved).__name__}"]
    out = []
    for key, (ok, what) in _SETTING_TYPES.items():
        if key not in saved:
            if key in _CHECKED:
                hint = " (a Hugging Face PEFT adapter_config.json names it 'r'; nxd_lc reads the adapters it " \
                       "saved itself)" if key == "lora_rank" and "r" in saved else ""
                out.append(f"{where}: key {key!r} is missing{hint}")
        elif not ok(saved[key]):
            out.append(f"{where}: key {key!r} must be {what}, got {str(saved[key])[:60]!r} "
                       f"({type(saved[key]).__name__})")
    return out


def _read_config_json(path: str) -> Any:
    """The settings in ``adapter_config.json`` at ``path`` (UTF-8 JSON, at most :data:`MAX_CONFIG_BYTES`).

    Raises:
        ValueError: too large, not UTF-8, not JSON, nested too deeply, NaN / over-long numbers (names the file).
    """
    size = os.path.getsize(path)
    if size > MAX_CONFIG_BYTES:
        raise ValueError(f"{PEFT_KEY}.lora_ckpt_path: {path} is {size} bytes, an adapter config is a few hundred "
                         f"(at most {MAX_CONFIG_BYTES}): it is not the {ADAPTER_CONFIG_FILE} nxd_lc wrote; remove it "
                         "or save the adapters again")
    try:
        return read_json(path, key=f"{PEFT_KEY}.lora_ckpt_path")
    except json.JSONDecodeError as e:
        raise ValueError(f"{PEFT_KEY}.lora_ckpt_path: {path}:{e.lineno}: not JSON ({e.msg}, column {e.colno}); "
                         f"restore the {ADAPTER_CONFIG_FILE} saved with the adapters, or save them again") from None


def _read_adapter_file(file: str) -> dict[str, Any]:
    """The dict in adapter file ``file`` (restricted unpickler), its keys strings.

    Raises:
        UnsafeCheckpointError: the file names a global outside the allowed set (nothing in it was run).
        ValueError: the file cannot be read as a ``torch.save`` file (truncated, random bytes: also when torch's
            restricted unpickler meets an opcode it does not know, which names no global), or holds no dict of
            named entries.
    """
    try:
        state = safe_torch_load(file)  # restricted unpickler: a file holding code is refused (UnsafeCheckpointError)
    except UnsafeCheckpointError as e:
        if e.refused:  # a named global: code planted in the file, not damage
            raise
        raise ValueError(f"{PEFT_KEY}.lora_ckpt_path: the adapter file {file} cannot be read (not a torch.save "
                         f"file: {str(e).rsplit('Detail: ', 1)[-1][:200]}): it is damaged or not an adapter file; "
                         "copy it again from the run that saved it, or save the adapters again") from None
    except Exception as e:  # noqa: BLE001 - torch.load raises RuntimeError / UnpicklingError / EOFError / KeyError
        raise ValueError(f"{PEFT_KEY}.lora_ckpt_path: the adapter file {file} cannot be read ({type(e).__name__}: "
                         f"{str(e)[:200]}): it is truncated or not an adapter file; copy it again from the run that "
                         "saved it, or save the adapters again") from None
    if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
        raise ValueError(f"{PEFT_KEY}.lora_ckpt_path: the adapter file {file} holds a {type(state).__name__}, not a "
                         "dict of named adapter tensors; point lora_ckpt_path at the adapters.pt (or the directory of "
                         "shard files) that nxd_lc saved")
    return state


def _check_tensors(model: nn.Module, state: dict[str, Any], file: str, full: bool) -> None:
    """Each adapter entry of ``state`` is a finite floating-point tensor ``A [r, *]`` / ``B [*, r]`` no larger than
    the model's full adapter could be (local size x TP), checked on the shapes BEFORE any element is read (a 1 KB
    file can hold a 2^40-element zero-stride view); every name is an adapter of the model (PP = 1; under PP the
    full file also holds the other stages').

    Raises:
        ValueError: naming the file, the entry and what it should be.
    """
    from nxd_lc.distributed import parallel_state as ps
    from nxd_lc.layers.lora import lora_state_dict

    local = lora_state_dict(model, full=False)
    tp = 1 if not full else ps.get_tensor_model_parallel_world_size()
    if ps.get_pipeline_model_parallel_world_size() == 1:
        unexpected = sorted(set(state) - set(local))
        if unexpected:
            raise ValueError(f"{PEFT_KEY}.lora_ckpt_path: {file} holds {len(unexpected)} entries that are no adapter "
                             f"of this model, e.g. {unexpected[:4]} (adapters: {sorted(local)[:4]}...); check "
                             f"{PEFT_KEY}.target_modules and that the adapters were trained for this model")
    for key, t in state.items():
        if key not in local:
            continue
        if not isinstance(t, torch.Tensor) or not (t.is_floating_point() and t.dim() == 2):
            what = f"{t.dtype} tensor of shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{PEFT_KEY}.lora_ckpt_path: {file}: {key!r} is a {what}; an adapter is a 2-d "
                             "floating-point tensor: save the adapters again")
        mine = local[key]
        r_dim = 0 if key.endswith("lora_A") else 1
        if t.shape[r_dim] != mine.shape[r_dim] or t.numel() > mine.numel() * tp:
            raise ValueError(f"{PEFT_KEY}.lora_ckpt_path: {file}: {key!r} has shape {tuple(t.shape)}, this model's "
                             f"adapter is {tuple(mine.shape)} on this rank (TP {tp}); check lora_rank, the model "
                             "config and the TP size")
        if not bool(torch.isfinite(t).all()):
            raise ValueError(f"{PEFT_KEY}.lora_ckpt_path: {file}: {key!r} holds NaN or infinite values; the "
                             "adapters diverged or the file is damaged: take them from an earlier checkpoint")


def load_adapters(model: nn.Module, peft: PeftConfig, path: str) -> None:
    """Load adapters written by :func:`save_adapters` into the LoRA-wrapped ``model``: ``path`` is an adapter file
    (full tensors, any TP size) or a directory of shard files (this rank's, same TP size).

    Every file is checked before anything is copied: the adapter file is a ``torch.save`` dict read with the
    restricted unpickler; its LoRA settings (in the file or in ``adapter_config.json``, UTF-8 JSON) have
    ``lora_rank`` / ``lora_alpha`` / ``target_modules`` of the right types, equal to the run's; each tensor is a
    finite floating-point ``A`` / ``B`` whose shape fits the model's adapter; no entry names something that is not
    an adapter of the model, and none is missing.

    Raises:
        FileNotFoundError: the file (or this rank's shard) does not exist.
        UnsafeCheckpointError: the adapter file names a global outside the allowed set (nothing in it was run).
        ValueError: a file cannot be read or holds something else, the saved settings are malformed or differ from
            ``peft`` (naming the keys), or the adapters do not fit (naming the file and the tensor).
    """
    from nxd_lc.distributed import parallel_state as ps
    from nxd_lc.layers.lora import load_lora_state_dict, lora_state_dict

    sharded = os.path.isdir(path)
    file = os.path.join(path, shard_file_name()) if sharded else path
    if not os.path.isfile(file):
        raise FileNotFoundError(f"{PEFT_KEY}.lora_ckpt_path: no adapter file {file}")
    state = _read_adapter_file(file)
    saved, where = state.pop(LORA_CONFIG_KEY, None), f"{file} ({LORA_CONFIG_KEY})"
    config_json = os.path.join(path if sharded else os.path.dirname(file), ADAPTER_CONFIG_FILE)
    if saved is None and os.path.isfile(config_json):
        saved, where = _read_config_json(config_json), config_json
    if saved is not None:
        problems = _settings_problems(saved, where)
        if problems:
            raise ValueError(f"{PEFT_KEY}.lora_ckpt_path: " + "; ".join(problems) + "; save the adapters again")
        _check_settings(saved, peft, where)  # names the file the settings came from
    _check_tensors(model, state, file, full=not sharded)
    if not sharded and ps.get_pipeline_model_parallel_world_size() > 1:  # this stage's adapters of the full file
        local = set(lora_state_dict(model, full=False))
        state = {k: v for k, v in state.items() if k in local}
    try:
        load_lora_state_dict(model, state, full=not sharded)
    except ValueError as e:  # missing adapters, or a shape that does not shard to this rank's
        raise ValueError(f"{PEFT_KEY}.lora_ckpt_path: {file}: {e}") from None
