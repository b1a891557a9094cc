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
import os
from typing import Any

import torch
from torch import nn

from nxd_lc.checkpoint.xser import safe_torch_load
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
    bad = [f"{PEFT_KEY}.{k}: {run[k]!r} but the adapters in {where} were trained with {saved[k]!r}"
           for k in _CHECKED if k in saved and saved[k] != run[k]]
    if bad:
        raise ValueError("; ".join(bad))


def load_adapters(model: nn.Module, peft: PeftConfig, path: str) -> None:
    """Load adapters written by :func:`save_adapters` into the LoRA-wrapped ``model``: ``path`` is an adapter file
    (full tensors, any TP size) or a directory of shard files (this rank's, same TP size).

    Raises:
        FileNotFoundError: the file (or this rank's shard) does not exist.
        ValueError: the saved settings differ from ``peft`` (naming the keys), or the adapters do not fit.
    """
    from nxd_lc.distributed import parallel_state as ps
    from nxd_lc.layers.lora import load_lora_state_dict, lora_state_dict

    sharded = os.path.isdir(path)
    file = os.path.join(path, shard_file_name()) if sharded else path
    if not os.path.isfile(file):
        raise FileNotFoundError(f"{PEFT_KEY}.lora_ckpt_path: no adapter file {file}")
    state = safe_torch_load(file)  # restricted unpickler: a file holding code is refused (UnsafeCheckpointError)
    saved = state.pop(LORA_CONFIG_KEY, None)
    config_json = os.path.join(path if sharded else os.path.dirname(file), ADAPTER_CONFIG_FILE)
    if saved is None and os.path.isfile(config_json):
        with open(config_json) as f:
            saved = json.load(f)
    if saved is not None:
        _check_settings(saved, peft, file)
    if not sharded and ps.get_pipeline_model_parallel_world_size() > 1:  # this stage's adapters of the full file
        local = set(lora_state_dict(model, full=False))
        state = {k: v for k, v in state.items() if k in local}
    load_lora_state_dict(model, state, full=not sharded)
