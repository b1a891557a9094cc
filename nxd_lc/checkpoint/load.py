"""Loading a checkpoint of the NxD layout (:mod:`nxd_lc.checkpoint.sharded`): this rank's files, verified against
the checkpoint's manifest, read with the restricted unpickler; missing shards are reported with the layout found.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import Any

from nxd_lc.checkpoint import integrity
from nxd_lc.checkpoint.layout import (
    DONE_FILE,
    MODEL_DIR,
    OPTIM_DIR,
    USER_CONTENT_FILE,
    check_tag,
    checkpoint_file_name,
    is_complete,
    ranks_found,
)
from nxd_lc.checkpoint.nxd_format import from_nxd_names
from nxd_lc.checkpoint.retention import list_checkpoints
from nxd_lc.checkpoint.xser import UnsafeCheckpointError, load_structure, load_xser

__all__ = ["detect_xser", "is_unmarked_nxd_checkpoint", "load_checkpoint", "rank_files", "read_shard",
           "verify_checkpoint", "warn_unmarked"]


def _missing_shard_error(path: str, tag_dir: str) -> FileNotFoundError:
    _, tps, pps = ranks_found(os.path.join(tag_dir, MODEL_DIR))
    dps, _, _ = ranks_found(os.path.join(tag_dir, OPTIM_DIR))
    found = (f"model shards for TP size {max(tps) + 1}, PP size {max(pps) + 1}" if tps
             else "no model shards")
    found += f"; optimizer shards for DP size {max(dps) + 1}" if dps else "; no optimizer shards"
    return FileNotFoundError(
        f"checkpoint shard {path!r} is missing: the checkpoint is incomplete or was saved with a "
        f"different TP/PP size ({tag_dir!r} has {found}). Load it with the parallel sizes it was "
        f"saved with.")


def detect_xser(tag_dir: str, use_xser: bool | None) -> bool:
    """Whether checkpoint ``tag_dir`` is in xser format (it has ``*.tensors`` directories); warns when that differs
    from an explicit ``use_xser`` (the detected format is the one used)."""
    detected = False
    for sub in (MODEL_DIR, OPTIM_DIR):
        folder = os.path.join(tag_dir, sub)
        if os.path.isdir(folder) and any(n.endswith(".tensors") for n in os.listdir(folder)):
            detected = True
    if use_xser is not None and use_xser != detected:
        warnings.warn(f"use_xser={use_xser} but checkpoint {tag_dir!r} is "
                      f"{'xser' if detected else 'plain torch.save'}; loading it in the detected format",
                      stacklevel=3)
    return detected


def read_shard(path: str, tag_dir: str, use_xser: bool) -> Any:
    """Read shard file ``path`` of checkpoint ``tag_dir`` (CPU tensors) with the restricted unpickler.

    Raises:
        FileNotFoundError: ``path`` is missing (names the layout the checkpoint was saved with).
        integrity.CheckpointIntegrityError: the file is truncated or not a checkpoint (names it).
        UnsafeCheckpointError: the file names a global outside the allowed set.
    """
    if not os.path.isfile(path):
        raise _missing_shard_error(path, tag_dir)
    return _named_read(path, lambda: load_xser(path) if use_xser else load_structure(path))


def _named_read(path: str, read: Callable[[], Any]) -> Any:
    """``read()``, turning an unreadable file (truncated, not a pickle) into an error that names ``path``."""
    try:
        return read()
    except (FileNotFoundError, integrity.CheckpointIntegrityError, UnsafeCheckpointError):
        raise
    except Exception as e:  # noqa: BLE001 - torch.load raises RuntimeError / UnpicklingError / EOFError ...
        raise integrity.CheckpointIntegrityError(
            path, f"checkpoint file {path!r} (or a tensor file under it) cannot be read: {type(e).__name__}: {e}. "
                  f"It is truncated or corrupt; resume from an earlier checkpoint") from e


def _optim_path(tag_dir: str, dp_rank: int, tp_rank: int, pp_rank: int, ep_rank: int | None = None) -> str:
    """Own DP rank's optimizer file; DP rank 0's (of this EP rank) when the optimizer was saved unsharded (no
    zero1)."""
    folder = os.path.join(tag_dir, OPTIM_DIR)
    own = os.path.join(folder, checkpoint_file_name(dp_rank, tp_rank, pp_rank))
    dps, _, _ = ranks_found(folder)
    if os.path.isfile(own) or dps - {0}:
        return own
    return os.path.join(folder, checkpoint_file_name(0, tp_rank, pp_rank, ep_rank))


def rank_files(tag_dir: str, *, dp_rank: int, tp_rank: int, pp_rank: int, load_optim: bool = True,
               ep_rank: int | None = None) -> list[str]:
    """Paths (relative to ``tag_dir``) of the structure files this rank reads: its model shard, its optimizer
    shard (when ``load_optim`` and the checkpoint has an ``optim/`` directory) and ``user_content.pt`` if present.
    """
    rels = [f"{MODEL_DIR}/{checkpoint_file_name(0, tp_rank, pp_rank, ep_rank)}"]
    if load_optim and os.path.isdir(os.path.join(tag_dir, OPTIM_DIR)):
        path = _optim_path(tag_dir, dp_rank, tp_rank, pp_rank, ep_rank)
        rels.append(os.path.relpath(path, tag_dir).replace(os.sep, "/"))
    if os.path.isfile(os.path.join(tag_dir, USER_CONTENT_FILE)):
        rels.append(USER_CONTENT_FILE)
    return rels


def verify_checkpoint(ckpt_root: str, tag: str, *, dp_rank: int, tp_rank: int, pp_rank: int,
                      load_optim: bool = True, ep_rank: int | None = None) -> bool:
    """Check what this rank would load from ``<ckpt_root>/<tag>`` (local, no collectives).

    With a manifest (checked first: :func:`~nxd_lc.checkpoint.integrity.read_manifest`, and it must list a model
    shard): every listed file exists with its size (the whole checkpoint), and this rank's files
    (:func:`rank_files`, each with its xser tensor files) match their SHA-256. When this rank's model shard is
    not in the checkpoint (saved at another TP/PP layout, which is not an integrity problem: the resume plan
    reports it), every model and optimizer file is hashed. Without a manifest (written before checksums, or by
    NxD): one warning, and the files this rank reads must exist (their contents cannot be checked).

    Returns:
        True when the checkpoint has a manifest and passed; False when it has none (unverifiable but present).

    Raises:
        FileNotFoundError: no such checkpoint, or it has no ``done`` marker (unless NxD wrote it without one:
            :func:`is_unmarked_nxd_checkpoint`).
        integrity.CheckpointIntegrityError: a file is missing, truncated or corrupt (names the file).
    """
    tag_dir = _complete_dir(ckpt_root, tag)
    manifest = integrity.read_manifest(tag_dir)
    rels = rank_files(tag_dir, dp_rank=dp_rank, tp_rank=tp_rank, pp_rank=pp_rank, load_optim=load_optim,
                      ep_rank=ep_rank)
    if manifest is None:
        integrity.warn_unverified(tag_dir)
        if not all(os.path.isfile(os.path.join(tag_dir, rel)) for rel in rels[:2]):
            _check_other_layout(tag_dir)  # saved at another layout (re-sharded on load): all its shards must exist
            return False
        for rel in rels:
            if not os.path.isfile(os.path.join(tag_dir, rel)):
                raise _missing_shard_error(os.path.join(tag_dir, rel), tag_dir)
        return False
    integrity.check_present(tag_dir, manifest)
    integrity.check_lists_folder(tag_dir, manifest, MODEL_DIR)
    if any(rel not in manifest for rel in rels[:2]):  # saved at another TP / PP / ZeRO-1 layout: verify every shard
        rels = sorted({r.split(".tensors/")[0] for r in manifest if r.startswith((MODEL_DIR + "/", OPTIM_DIR + "/"))}
                      | {r for r in rels[1:] if r in manifest})
    for rel in rels:
        if rel not in manifest:
            raise _missing_shard_error(os.path.join(tag_dir, rel), tag_dir)
        integrity.verify_files(tag_dir, integrity.files_under(tag_dir, rel), manifest)
    return True


def _check_other_layout(tag_dir: str) -> None:
    """A checkpoint without manifest whose shards for this rank's coordinates do not exist (saved at another
    layout): every model shard of its own layout, and its optimizer shards for every (TP, PP) position, must exist.

    Raises:
        FileNotFoundError: naming the first missing shard and the sizes found.
    """
    _, tps, pps = ranks_found(os.path.join(tag_dir, MODEL_DIR))
    dps, _, _ = ranks_found(os.path.join(tag_dir, OPTIM_DIR))
    if not tps:
        raise _missing_shard_error(os.path.join(tag_dir, MODEL_DIR, checkpoint_file_name(0, 0, 0)), tag_dir)
    for t in range(max(tps) + 1):
        for p in range(max(pps) + 1):
            wanted = [(MODEL_DIR, 0)] + [(OPTIM_DIR, d) for d in range(max(dps) + 1 if dps else 0)]
            for sub, d in wanted:
                path = os.path.join(tag_dir, sub, checkpoint_file_name(d, t, p))
                if not os.path.isfile(path):
                    raise _missing_shard_error(path, tag_dir)


_warned_unmarked: set[str] = set()


def is_unmarked_nxd_checkpoint(tag_dir: str) -> bool:
    """True for a checkpoint directory without ``done`` that nxd_lc did not write: it has a model shard for every
    (TP, PP) rank its file names imply, and neither nxd_lc's manifest nor its per-rank checksum lists (nxd_lc
    publishes a tag only once ``done`` is written, so a visible tag of its own always has one). NxD's converter
    writes only ``model/`` (no markers), and NxD loads an explicitly named tag without them; such a tag is loaded
    when named, with a warning, never picked as the newest.
    """
    if is_complete(tag_dir) or not os.path.isdir(tag_dir):
        return False
    if os.path.exists(os.path.join(tag_dir, integrity.MANIFEST_FILE)) or \
            os.path.isdir(os.path.join(tag_dir, integrity.RANK_MANIFEST_DIR)):
        return False
    folder = os.path.join(tag_dir, MODEL_DIR)
    _, tps, pps = ranks_found(folder)
    names = set(os.listdir(folder)) if tps else set()
    return bool(tps) and all(checkpoint_file_name(0, t, p) in names or checkpoint_file_name(0, t, p, 0) in names
                             for t in range(max(tps) + 1) for p in range(max(pps) + 1))


def warn_unmarked(tag_dir: str) -> None:
    """Warn once per process that ``tag_dir`` (:func:`is_unmarked_nxd_checkpoint`) is loaded without markers."""
    if tag_dir not in _warned_unmarked:
        _warned_unmarked.add(tag_dir)
        integrity.mark_warned_unverified(tag_dir)  # this is the one warning: no second one for the manifest
        warnings.warn(f"checkpoint {tag_dir!r} has no '{DONE_FILE}' marker and no manifest (NxD's converter writes "
                      f"neither): loading it as named, unverified; its shards must all be there", stacklevel=3)


def _complete_dir(ckpt_root: str, tag: str) -> str:
    check_tag(tag)
    tag_dir = os.path.join(ckpt_root, tag)
    if not os.path.isdir(tag_dir):
        raise FileNotFoundError(f"checkpoint {tag_dir!r} does not exist; complete checkpoints in "
                                f"{ckpt_root!r}: {list_checkpoints(ckpt_root)}")
    if is_unmarked_nxd_checkpoint(tag_dir):
        warn_unmarked(tag_dir)
        return tag_dir
    if not is_complete(tag_dir):
        raise FileNotFoundError(
            f"checkpoint {tag_dir!r} has no '{DONE_FILE}' marker: it is incomplete (its save was "
            f"interrupted): pick another tag")
    return tag_dir


def load_checkpoint(ckpt_root: str, tag: str, *, dp_rank: int, tp_rank: int, pp_rank: int,
                    load_optim: bool = True, use_xser: bool | None = None, verify: bool = True,
                    read_model: bool = True, ep_rank: int | None = None) -> tuple[Any, Any, Any]:
    """Load this rank's shards of ``<ckpt_root>/<tag>`` (CPU tensors), verified against its manifest.

    Args:
        ckpt_root, tag: the checkpoint directory is ``<ckpt_root>/<tag>``.
        dp_rank, tp_rank, pp_rank: this rank's coordinates. The model shard is read from DP rank
            0's file; the optimizer from this DP rank's file, or DP rank 0's when the checkpoint
            holds only DP rank 0 optimizer files (saved without zero1).
        load_optim: read the optimizer shard (else ``None`` is returned for it).
        read_model: read the model shard (else ``None`` is returned for it: a checkpoint saved at another
            layout, re-sharded by :mod:`nxd_lc.checkpoint.reshard`).
        use_xser: expected format; ``None`` auto-detects (``*.tensors`` dirs). The detected format
            is always used; a mismatch with an explicit value only warns.
        verify: :func:`verify_checkpoint` first (SHA-256 of the files read; files already verified
            in this process and unchanged since are not hashed again).
        ep_rank: this rank's EP rank when the checkpoint was saved with expert parallelism (None: without).

    Returns:
        ``(model_state, optim_state or None, user_content or None)``; the model state under the LightningModule's
        names (NxD's ``lm_head.*`` read as ``model.lm_head.*``: :func:`nxd_lc.checkpoint.nxd_format.from_nxd_names`).

    Raises:
        FileNotFoundError: the checkpoint is missing or has no ``done`` marker, or a shard file is
            missing (message gives the TP/PP/DP sizes found in the directory).
        integrity.CheckpointIntegrityError: a file fails verification or cannot be read (names it).
    """
    tag_dir = _complete_dir(ckpt_root, tag)
    if verify:
        verify_checkpoint(ckpt_root, tag, dp_rank=dp_rank, tp_rank=tp_rank, pp_rank=pp_rank, load_optim=load_optim,
                          ep_rank=ep_rank)
    xser = detect_xser(tag_dir, use_xser)
    model_path = os.path.join(tag_dir, MODEL_DIR, checkpoint_file_name(0, tp_rank, pp_rank, ep_rank))
    model_state = from_nxd_names(read_shard(model_path, tag_dir, xser)) if read_model else None
    optim_state = None
    if load_optim:
        optim_state = read_shard(_optim_path(tag_dir, dp_rank, tp_rank, pp_rank, ep_rank), tag_dir, xser)
    uc_path = os.path.join(tag_dir, USER_CONTENT_FILE)
    user_content = _named_read(uc_path, lambda: load_structure(uc_path)) if os.path.isfile(uc_path) else None
    return model_state, optim_state, user_content
