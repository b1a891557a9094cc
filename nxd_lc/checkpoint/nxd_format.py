"""What an NxD checkpoint holds beyond the file layout (:mod:`nxd_lc.checkpoint.layout`): the names of its model
tensors, the metadata nxd_lc adds in its ``done`` file, and what a checkpoint without that metadata (written by
NxD's converter or trainer) says about itself through its files. The one home of these facts (DESIGN principle 22);
the files NxD's own tools wrote are ``../shared/reference/nxd_checkpoints/``.

Tensor names. nxd_lc's LightningModule holds the decoder as ``self.model``, so its state dict names the decoder's
tensors ``model.<name>``: ``model.embed_tokens.weight``, ``model.layers.<i>...``, ``model.norm.weight`` are NxD's
and HF's names too, but the head is ``model.lm_head.weight`` where NxD's converter, NxD's trainer (NxDT's module
state dict) and HF write ``lm_head.weight``. Model shards are written with NxD's name (:func:`to_nxd_names`) and
read under either spelling (:func:`from_nxd_names`): checkpoints nxd_lc wrote before this naming still load.

Metadata. nxd_lc's ``done`` file is JSON (``writer: "nxd_lc"``); from this version on it has a ``layout`` entry
(:func:`layout_metadata`): the KV-replica layout of the run (:mod:`nxd_lc.distributed.kv_layout`). NxD's ``done``
holds ``"1"`` and its converter writes none: their KV-replica layout is named by the loading run's config
(:func:`checkpoint_kv_layout`). The pipeline split of any checkpoint is read from its files (:func:`stage_layers`).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping
from typing import Any

from nxd_lc.checkpoint.layout import DONE_FILE, MODEL_DIR, checkpoint_file_name
from nxd_lc.checkpoint.xser import load_structure
from nxd_lc.distributed import parallel_state
from nxd_lc.distributed.kv_layout import KV_REPLICA_LAYOUTS

__all__ = ["HEAD_NXD", "HEAD_MODULE", "MODEL_PREFIX", "checkpoint_kv_layout", "from_nxd_names", "head_spelling",
           "key_mismatch_message", "layout_metadata", "read_done", "set_unrecorded_kv_layout", "stage_layers",
           "to_nxd_names"]

MODEL_PREFIX = "model."  # the LightningModule holds the decoder as ``self.model``
HEAD_MODULE = "model.lm_head."  # the head under the LightningModule's names
HEAD_NXD = "lm_head."  # the head under NxD's and HF's names
#: the KV-replica layout of nxd_lc checkpoints written before the layout was recorded (nxd_lc placed replicas on
#: adjacent TP ranks, as NxD does on Trn2)
LEGACY_NXD_LC_KV_LAYOUT = "adjacent"
_LAYER_RE = re.compile(r"^(?:model\.)?layers\.(\d+)\.")


def to_nxd_names(state: Mapping[str, Any]) -> dict[str, Any]:
    """A LightningModule model state dict (``model.<name>``) under NxD's names: ``model.lm_head.*`` ->
    ``lm_head.*``; every other key as it is (insertion order kept)."""
    return {(HEAD_NXD + k[len(HEAD_MODULE):] if isinstance(k, str) and k.startswith(HEAD_MODULE) else k): v
            for k, v in state.items()}


def from_nxd_names(state: Any) -> Any:
    """The inverse of :func:`to_nxd_names` for a model shard read from a checkpoint: ``lm_head.*`` ->
    ``model.lm_head.*`` in a shard that names the decoder's tensors ``model.<name>`` (NxD's and nxd_lc's naming).
    Returned as it is: a shard that already names ``model.lm_head.*`` (written by nxd_lc before NxD's naming), one
    without ``model.*`` keys (a bare module's state dict), anything that is not a dict."""
    keys = [k for k in state if isinstance(k, str)] if isinstance(state, dict) else []
    if any(k.startswith(HEAD_MODULE) for k in keys) or not any(k.startswith(MODEL_PREFIX) for k in keys):
        return state
    return {(HEAD_MODULE + k[len(HEAD_NXD):] if isinstance(k, str) and k.startswith(HEAD_NXD) else k): v
            for k, v in state.items()}


def head_spelling(keys: Iterable[Any]) -> str:
    """How the head is named among ``keys``, for error messages ('lm_head.weight (NxD's and HF's name)', ...)."""
    keys = [str(k) for k in keys]
    if any(k.startswith(HEAD_NXD) for k in keys):
        return f"'{HEAD_NXD}weight' (NxD's and HF's name)"
    if any(k.startswith(HEAD_MODULE) for k in keys):
        return (f"'{HEAD_MODULE}weight' (the LightningModule's name: nxd_lc's older shards, or NxD's "
                f"'{HEAD_NXD}weight' as read)")
    return "no head (lm_head) at all (a pipeline stage other than the last, or tied embeddings)"


def key_mismatch_message(where: str, expected: Iterable[Any], found: Iterable[Any], error: Exception) -> str:
    """A load that failed on tensor names: which keys are missing and unexpected, and how the checkpoint names the
    head (:func:`head_spelling`), with the config keys that decide the names."""
    expected, found = {str(k) for k in expected}, {str(k) for k in found}
    missing, extra = sorted(expected - found), sorted(found - expected)
    return (f"checkpoint {where} does not fit this run's model: missing {missing[:6]}"
            f"{' ...' if len(missing) > 6 else ''}, unexpected {extra[:6]}{' ...' if len(extra) > 6 else ''}; it "
            f"names the head {head_spelling(found)}; model.model_config, hf_config_overrides, fuse_qkv, qkv_linear "
            f"and kv_replicator must be those of the run that saved it ({type(error).__name__}: "
            f"{str(error).splitlines()[0][:300]})")


def read_done(tag_dir: str) -> dict[str, Any] | None:
    """The JSON of ``<tag_dir>/done`` when nxd_lc wrote it; None for NxD's (``"1"``), an empty or missing file."""
    try:
        with open(os.path.join(tag_dir, DONE_FILE)) as f:
            done = json.load(f)
    except (OSError, ValueError):
        return None
    return done if isinstance(done, dict) else None


def layout_metadata(kv_replica_layout: str) -> dict[str, Any]:
    """The ``layout`` entry of nxd_lc's ``done`` file: the run's KV-replica layout."""
    return {"kv_replica_layout": kv_replica_layout}


_UNRECORDED: list[str | None] = [None]  # process-wide: exp_manager.checkpoint_kv_replica_layout (None: auto)


def set_unrecorded_kv_layout(layout: str | None) -> None:
    """``exp_manager.checkpoint_kv_replica_layout``, set once at start-up: the KV-replica layout of a checkpoint that
    records none (NxD's); None (``auto``): the run's own layout, which is what NxD's loader assumes.

    Raises:
        ValueError: an unknown layout.
    """
    if layout is not None and layout not in KV_REPLICA_LAYOUTS:
        raise ValueError(f"exp_manager.checkpoint_kv_replica_layout: {layout!r} is not one of auto, "
                         f"{', '.join(KV_REPLICA_LAYOUTS)}")
    _UNRECORDED[0] = layout


def checkpoint_kv_layout(tag_dir: str, run_layout: str | None = None) -> tuple[str, str]:
    """``(layout, how it is known)``: the KV-replica layout of checkpoint ``tag_dir``.

    From nxd_lc's metadata when recorded; ``adjacent`` for an nxd_lc checkpoint written before it was recorded;
    for a checkpoint without nxd_lc's metadata (NxD's converter or trainer) ``exp_manager.checkpoint_kv_replica_layout``
    (:func:`set_unrecorded_kv_layout`), by default the loading run's own layout: ``run_layout``, else
    :func:`nxd_lc.distributed.parallel_state.get_kv_replica_layout`.
    """
    done = read_done(tag_dir)
    if done is None or done.get("writer") != "nxd_lc":
        if _UNRECORDED[0] is not None:
            return _UNRECORDED[0], "exp_manager.checkpoint_kv_replica_layout (the checkpoint records none)"
        return (run_layout or parallel_state.get_kv_replica_layout(),
                "not recorded (written by NxD): taken as this run's distributed_strategy.kv_replica_layout, as "
                "NxD's loader does; exp_manager.checkpoint_kv_replica_layout names another")
    layout = (done.get("layout") or {}).get("kv_replica_layout")
    if layout:
        return str(layout), "recorded in its done file"
    return LEGACY_NXD_LC_KV_LAYOUT, "an nxd_lc checkpoint from before the layout was recorded (adjacent)"


def stage_layers(tag_dir: str, pp: int, xser: bool) -> list[list[int]]:
    """The decoder-layer indices each pipeline rank's model shards of ``tag_dir`` hold (``out[p]``, sorted), from
    the tensor names of TP rank 0's shard of each pipeline rank (an xser structure file holds no tensor data; a
    plain file is memory-mapped, its tensors not read).

    Raises:
        FileNotFoundError: a pipeline rank's shard is missing.
    """
    out = []
    for p in range(pp):
        path = os.path.join(tag_dir, MODEL_DIR, checkpoint_file_name(0, 0, p))
        if not os.path.isfile(path):  # a checkpoint with expert parallelism names its EP rank
            path = os.path.join(tag_dir, MODEL_DIR, checkpoint_file_name(0, 0, p, 0))
        keys = load_structure(path, mmap=not xser).keys()
        out.append(sorted({int(m.group(1)) for m in map(_LAYER_RE.match, map(str, keys)) if m}))
    return out
