"""Sharded checkpoints in NeuronX Distributed's layout, saved atomically across ranks.

Layout (NxD ``neuronx_distributed.trainer.checkpoint``)::

    <ckpt_root>/
      newest                                   # complete tags, one per line, oldest -> newest
      <tag>/
        checkpoint                             # "1": marks the directory as a checkpoint (NxD)
        model/dp_rank_00_tp_rank_XX_pp_rank_XX.pt   # model shard, written by DP rank 0 only
        optim/dp_rank_XX_tp_rank_XX_pp_rank_XX.pt   # optimizer shard (every DP rank under zero1)
        user_content.pt                        # trainer/user state, written by global rank 0
        manifest.json                          # SHA-256 and size of every file above (nxd_lc.checkpoint.integrity)
        done                                   # completion marker (JSON: tag, step, time, manifest), last

With xser each shard ``<f>.pt`` is a structure file plus ``<f>.pt.tensors/tensor_<i>.pt``
(:mod:`nxd_lc.checkpoint.xser`). With expert parallelism (EP > 1) each EP rank holds other experts, so model
shards (and optimizer shards saved without zero1) carry the EP rank as NxD names them,
``dp_rank_00_ep_rank_XX_tp_rank_XX_pp_rank_XX.pt``, written by expert-data-parallel rank 0 of each
(EP, TP, PP) position; ZeRO-1 optimizer shards stay ``dp_rank_<DP x CP rank>_tp_rank_XX_pp_rank_XX.pt``.
``newest`` follows NxD 2.16 (the last line is the newest tag);
later NxD releases find checkpoints by their ``done`` file instead, which we also write.

Atomicity (our addition; NxD writes in place): every rank writes into the hidden staging
directory ``<ckpt_root>/.<tag>.partial``; after all ranks agree that their writes succeeded,
global rank 0 writes ``done`` there and renames the directory to ``<ckpt_root>/<tag>`` (moving an
older ``<tag>`` aside first and deleting it only after the rename), then rewrites ``newest`` via a
temporary file and ``os.replace``. Files and directories are fsynced. Hidden (dot) directories
are never listed, so a crashed save is invisible to :func:`latest_checkpoint`;
:func:`cleanup_partial` removes its leftovers. The root must be one filesystem visible to all
ranks (as in NxD). Checkpoint files are read with the restricted unpickler
(:func:`~nxd_lc.checkpoint.xser.safe_torch_load`): a file that names a global outside the allowed set is refused
(:class:`~nxd_lc.checkpoint.xser.UnsafeCheckpointError`), never run.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
import uuid
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from nxd_lc.checkpoint import integrity
from nxd_lc.checkpoint.xser import (
    UnsafeCheckpointError,
    compact_cpu,
    fsync_dir,
    load_structure,
    load_xser,
    map_tensors,
    save_xser,
    torch_save_file,
)
from nxd_lc.config.input_files import read_json
from nxd_lc.distributed import collectives
from nxd_lc.runtime import faults

logger = logging.getLogger(__name__)

MODEL_DIR = "model"
OPTIM_DIR = "optim"
USER_CONTENT_FILE = "user_content.pt"
DONE_FILE = "done"
NEWEST_FILE = "newest"
CHECKPOINT_MARKER = "checkpoint"
_SHARD_RE = re.compile(r"^dp_rank_(\d+)(?:_ep_rank_(?P<ep>\d+))?_tp_rank_(\d+)_pp_rank_(\d+)\.pt$")
_PARTIAL_RE = re.compile(r"^\.(?P<tag>.+)\.partial$")
_TRASH_RE = re.compile(r"^\..+\.trash-[0-9a-f]{32}$")
_BF16_SOURCE_DTYPES = (torch.float16, torch.float32, torch.float64)


def checkpoint_file_name(dp_rank: int, tp_rank: int, pp_rank: int, ep_rank: int | None = None) -> str:
    """NxD shard file name, e.g. ``(0, 1, 0) -> "dp_rank_00_tp_rank_01_pp_rank_00.pt"``; with an ``ep_rank``
    (expert parallelism) ``(0, 1, 0, 3) -> "dp_rank_00_ep_rank_03_tp_rank_01_pp_rank_00.pt"``.

    Raises:
        ValueError: a rank is not a non-negative int.
    """
    ranks = (("dp_rank", dp_rank), ("tp_rank", tp_rank), ("pp_rank", pp_rank))
    for name, r in ranks + ((("ep_rank", ep_rank),) if ep_rank is not None else ()):
        if isinstance(r, bool) or not isinstance(r, int) or r < 0:
            raise ValueError(f"{name} must be a non-negative int, got {r!r}")
    ep = f"_ep_rank_{ep_rank:02d}" if ep_rank is not None else ""
    return f"dp_rank_{dp_rank:02d}{ep}_tp_rank_{tp_rank:02d}_pp_rank_{pp_rank:02d}.pt"


def _check_tag(tag: str) -> None:
    bad = (not isinstance(tag, str) or not tag or tag.startswith(".") or "/" in tag
           or os.sep in tag or tag == NEWEST_FILE)
    if bad:
        raise ValueError(f"checkpoint tag {tag!r} is invalid: use a non-empty name without '/', not "
                         f"starting with '.' and not {NEWEST_FILE!r} (e.g. 'step_100')")


def _staging_dir(ckpt_root: str, tag: str) -> str:
    return os.path.join(ckpt_root, f".{tag}.partial")


def _trash_dir(ckpt_root: str, tag: str) -> str:
    return os.path.join(ckpt_root, f".{tag}.trash-{uuid.uuid4().hex}")


def all_ranks_ok(ok: bool) -> bool:
    """Collective over the world group: True iff ``ok`` on every rank (a barrier with a vote,
    :func:`nxd_lc.distributed.collectives.world_max`). Without torch.distributed it returns ``ok``."""
    return collectives.world_max([0 if ok else 1], tag="nxd_lc_all_ranks_ok")[0] == 0


def _collective_phase(phase: str, tag: str, fn: Callable[[], None]) -> None:
    """Run ``fn`` on this rank, then vote; every rank raises if any rank's ``fn`` raised."""
    err: Exception | None = None
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - re-raised below, once the other ranks have voted
        err = e
    all_ok = all_ranks_ok(err is None)
    if err is not None:
        raise err
    if not all_ok:
        raise RuntimeError(f"saving checkpoint {tag!r} failed on another rank during {phase} (see that "
                           f"rank's error); no checkpoint was published and the previous one is intact")


def _write_shard(state: Any, path: str, use_xser: bool) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if use_xser:
        save_xser(state, path, fsync=True)
    else:
        torch_save_file(map_tensors(state, compact_cpu), path, fsync=True)
        fsync_dir(os.path.dirname(path))


def _to_bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16) if t.dtype in _BF16_SOURCE_DTYPES else t


def _step_of(step: int | None, user_content: Any) -> int | None:
    if step is not None:
        return int(step)
    if isinstance(user_content, Mapping):
        for key in ("global_step", "step"):
            v = user_content.get(key)
            if isinstance(v, int) and not isinstance(v, bool):
                return v
    return None


def _prepare_staging(ckpt_root: str, staging: str) -> None:
    os.makedirs(ckpt_root, exist_ok=True)
    if os.path.lexists(staging):  # leftover of a crashed save of the same tag
        shutil.rmtree(staging)
    os.mkdir(staging)
    with open(os.path.join(staging, CHECKPOINT_MARKER), "w") as f:
        f.write("1")
    fsync_dir(ckpt_root)


def _commit(ckpt_root: str, tag: str, staging: str, step: int | None) -> None:
    """Rank 0: write ``manifest.json``, mark ``staging`` done and publish it as ``<ckpt_root>/<tag>``."""
    n_files = integrity.merge_rank_manifests(staging)
    done = {"tag": tag, "step": step, "saved_at": time.time(), "writer": "nxd_lc",
            "manifest": integrity.MANIFEST_FILE, "algorithm": integrity.ALGORITHM, "files": n_files}
    with open(os.path.join(staging, DONE_FILE), "w") as f:
        json.dump(done, f)
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(staging)
    final = os.path.join(ckpt_root, tag)
    trash = None
    if os.path.lexists(final):  # keep the old copy until the new one is in place
        trash = _trash_dir(ckpt_root, tag)
        os.replace(final, trash)
    try:
        os.replace(staging, final)
    except OSError:
        if trash is not None:  # put the old checkpoint back
            os.replace(trash, final)
        raise
    fsync_dir(ckpt_root)
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)
    _write_newest(ckpt_root)


@dataclass
class StagedSave:
    """One rank's part of a checkpoint save whose staging directory exists (see :func:`stage_checkpoint`).

    :meth:`write` is local (no collectives: it may run in a background thread); :meth:`publish` is collective
    and must be called by every rank, after :meth:`write` returned or raised on this rank.
    """

    ckpt_root: str
    tag: str
    staging: str
    is_global_zero: bool
    step: int | None
    files: list[tuple[str, Any, bool]]  # (path relative to staging, state, xser) to write
    user_content: Any
    error: BaseException | None = None
    written: bool = False

    def write(self) -> None:
        """Write this rank's files and their checksums (``manifest.d/rank_<r>.json``) into the staging dir.

        Never raises: an error is kept in :attr:`error` and reported by :meth:`publish` on every rank. A state
        holding a NaN or an infinity is an error (:func:`check_finite`): such a checkpoint is never published.
        """
        try:
            relpaths: list[str] = []
            for rel, state, _ in self.files:  # nothing of a checkpoint holding NaN / inf is written
                check_finite(state, f"checkpoint {self.tag!r} (step {self.step}), {rel}")
            for rel, state, xser in self.files:
                _write_shard(state, os.path.join(self.staging, rel), xser)
                relpaths += integrity.files_under(self.staging, rel)
                faults.inject("mid_save", self.step if self.step is not None else -1)
            if self.is_global_zero and self.user_content is not None:
                torch_save_file(self.user_content, os.path.join(self.staging, USER_CONTENT_FILE), fsync=True)
                relpaths.append(USER_CONTENT_FILE)
            integrity.write_rank_manifest(self.staging, collectives.get_global_rank(), relpaths)
        except BaseException as e:  # noqa: BLE001 - reported collectively by publish()
            self.error = e
        finally:
            self.written = True
            self.files = []  # drop the state (host copies under async saves) as soon as it is on disk

    def publish(self) -> str:
        """Collective: vote on every rank's write; rank 0 merges the manifests, writes ``done`` and publishes.

        Returns:
            The published checkpoint directory ``<ckpt_root>/<tag>``.

        Raises:
            RuntimeError: a write failed on some rank (this rank re-raises its own error); nothing is published
                and the previous checkpoints are intact.
        """
        def failed_write() -> None:
            if self.error is not None:
                raise self.error
            if not self.written:
                raise RuntimeError(f"checkpoint {self.tag!r}: publish() called before write()")

        try:
            _collective_phase("shard writing", self.tag, failed_write)
            _collective_phase("commit", self.tag, (lambda: _commit(self.ckpt_root, self.tag, self.staging, self.step))
                              if self.is_global_zero else _noop)
            faults.inject("after_publish", self.step if self.step is not None else -1)
        except Exception:
            if self.is_global_zero and not is_complete(self.staging):  # a complete one is kept for cleanup_partial
                shutil.rmtree(self.staging, ignore_errors=True)
            raise
        return os.path.join(self.ckpt_root, self.tag)


def _noop() -> None:
    return None


class NonFiniteCheckpointError(ValueError):
    """A checkpoint's state holds NaN or infinite values: it is not published (the previous one stays newest)."""


def _float_tensors(obj: Any, path: str = "") -> list[tuple[str, torch.Tensor]]:
    """``(key path, tensor)`` of every floating-point tensor in a nested dict / list / tuple (``a.b.0``)."""
    if isinstance(obj, torch.Tensor):
        return [(path or "<root>", obj)] if obj.is_floating_point() or obj.is_complex() else []
    if isinstance(obj, dict):
        items = list(obj.items())
    elif isinstance(obj, (list, tuple)):
        items = list(enumerate(obj))
    else:
        return []
    out = []
    for key, value in items:
        out += _float_tensors(value, f"{path}.{key}" if path else str(key))
    return out


def check_finite(state: Any, where: str) -> None:
    """Raise when a floating-point tensor of ``state`` holds NaN or an infinity.

    One flag per tensor, reduced on each tensor's device and read once per device (not once per tensor); only when
    one is false are the tensors searched for the first offending key.

    Raises:
        NonFiniteCheckpointError: naming ``where`` and the tensor's key path (e.g. ``state.0.exp_avg``).
    """
    tensors = _float_tensors(state)
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for _, t in tensors:
        if t.numel():
            by_device.setdefault(t.device, []).append(torch.isfinite(t).all())
    if all(bool(torch.stack(flags).all()) for flags in by_device.values()):
        return
    bad = next(key for key, t in tensors if t.numel() and not bool(torch.isfinite(t).all()))
    raise NonFiniteCheckpointError(
        f"{where}: tensor '{bad}' holds NaN or infinite values, so this checkpoint is not published (the previous "
        "one stays the newest); the training diverged before this save: resume from the previous checkpoint with a "
        "lower model.optim.lr or with gradient clipping (trainer.gradient_clip_val)")


def stage_checkpoint(ckpt_root: str, tag: str, *, model_state: Any, optim_state: Any, user_content: Any,
                     dp_rank: int, tp_rank: int, pp_rank: int, is_global_zero: bool, write_model: bool,
                     write_optim: bool, use_xser: bool, save_bf16: bool = False,
                     step: int | None = None, ep_rank: int | None = None,
                     optim_sharded: bool = False) -> StagedSave:
    """Collective first phase of a save: rank 0 creates the staging directory ``<ckpt_root>/.<tag>.partial``.

    Arguments as :func:`save_checkpoint`. The returned :class:`StagedSave` holds references to the given
    states: pass host copies when training goes on before :meth:`StagedSave.write` (async saves).

    Raises:
        ValueError: see :func:`save_checkpoint`.
        RuntimeError: preparing the staging directory failed on another rank.
    """
    _check_tag(tag)
    checkpoint_file_name(dp_rank, tp_rank, pp_rank, ep_rank)
    if write_model and model_state is None:
        raise ValueError("save_checkpoint: write_model=True but model_state is None")
    if write_optim and optim_state is None:
        raise ValueError("save_checkpoint: write_optim=True but optim_state is None")
    if write_model and dp_rank != 0 and not (optim_sharded and ep_rank is not None):
        raise ValueError(f"save_checkpoint: model shards are written by DP rank 0 only (NxD layout), got "
                         f"write_model=True on dp_rank={dp_rank}; pass write_model=(dp_rank == 0)")
    staging = _staging_dir(ckpt_root, tag)
    files: list[tuple[str, Any, bool]] = []
    if write_model:
        state = map_tensors(model_state, _to_bf16) if save_bf16 else model_state
        files.append((f"{MODEL_DIR}/{checkpoint_file_name(0, tp_rank, pp_rank, ep_rank)}", state, use_xser))
    if write_optim:
        name = checkpoint_file_name(dp_rank, tp_rank, pp_rank, None if optim_sharded else ep_rank)
        files.append((f"{OPTIM_DIR}/{name}", optim_state, use_xser))
    _collective_phase("preparation", tag, (lambda: _prepare_staging(ckpt_root, staging)) if is_global_zero else _noop)
    return StagedSave(ckpt_root=ckpt_root, tag=tag, staging=staging, is_global_zero=is_global_zero,
                      step=_step_of(step, user_content), files=files,
                      user_content=user_content if is_global_zero else None)


def save_checkpoint(ckpt_root: str, tag: str, *, model_state: Any, optim_state: Any, user_content: Any,
                    dp_rank: int, tp_rank: int, pp_rank: int, is_global_zero: bool, write_model: bool,
                    write_optim: bool, use_xser: bool, save_bf16: bool = False,
                    step: int | None = None, ep_rank: int | None = None, optim_sharded: bool = False) -> str:
    """Save this rank's shards into ``<ckpt_root>/<tag>``; collective over all ranks, atomic, checksummed.

    Every rank of the world group must call it (also ranks that write nothing): it votes three
    times (staging prepared, shards written, commit done) so that a failure on any rank makes
    every rank raise and nothing is published. Each rank records the SHA-256 of the files it
    wrote; rank 0 merges them into ``manifest.json`` before writing ``done``
    (:mod:`nxd_lc.checkpoint.integrity`). Equivalent to :func:`stage_checkpoint`, then
    :meth:`StagedSave.write` and :meth:`StagedSave.publish`.

    Args:
        ckpt_root: checkpoint directory shared by all ranks (created if missing).
        tag: checkpoint name (e.g. ``"step_100"``); an existing ``<tag>`` is replaced only once
            the new one is complete.
        model_state: this rank's model shard (nested dict of tensors), used when ``write_model``.
        optim_state: this rank's optimizer state, used when ``write_optim``.
        user_content: trainer state written by global rank 0 to ``user_content.pt`` (None: skip).
        dp_rank, tp_rank, pp_rank: this rank's coordinates (file names).
        is_global_zero: True on exactly one rank, which prepares, commits and updates ``newest``.
        write_model: write ``model/dp_rank_00_...`` (NxD: DP rank 0 of each TP/PP position).
        write_optim: write ``optim/dp_rank_<dp>_...`` (every DP rank under zero1, else DP rank 0).
        use_xser: xser format (``exp_manager.save_xser``) instead of one ``torch.save`` per shard.
        save_bf16: cast float16/32/64 model tensors to bf16 (``exp_manager.save_bf16``); other
            dtypes and the optimizer state are saved unchanged.
        step: training step recorded in ``done`` for ordering; default ``user_content['global_step']``
            or ``user_content['step']`` when present.
        ep_rank: this rank's EP rank under expert parallelism (None without): model files (and unsharded
            optimizer files) are ``dp_rank_00_ep_rank_<ep>_...``, one per EP rank.
        optim_sharded: the optimizer is ZeRO-1-sharded: ``dp_rank`` is the DP x CP rank, every rank writes its
            own optimizer file (without ``ep_rank``), and with an ``ep_rank`` the model writer's ``dp_rank`` (its
            DP x CP rank) need not be 0.

    Returns:
        The published checkpoint directory ``<ckpt_root>/<tag>``.

    Raises:
        ValueError: invalid tag/ranks, missing state for a requested write, or a model write
            requested on a DP rank other than 0.
        RuntimeError: the save failed on another rank (this rank re-raises its own error).
    """
    staged = stage_checkpoint(ckpt_root, tag, model_state=model_state, optim_state=optim_state,
                              user_content=user_content, dp_rank=dp_rank, tp_rank=tp_rank, pp_rank=pp_rank,
                              is_global_zero=is_global_zero, write_model=write_model, write_optim=write_optim,
                              use_xser=use_xser, save_bf16=save_bf16, step=step, ep_rank=ep_rank,
                              optim_sharded=optim_sharded)
    staged.write()
    return staged.publish()


def is_complete(path: str) -> bool:
    """True iff checkpoint directory ``path`` (``<ckpt_root>/<tag>``) has its ``done`` marker."""
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, DONE_FILE))


def _done_record(tag_dir: str) -> tuple[int | None, float]:
    """(step, save time) from ``done``; NxD's plain "1" marker gives (None, file mtime), and so does a damaged
    record (not UTF-8 / not JSON, nested too deeply, a number beyond a float, a step that is not a whole number):
    it only orders the checkpoints, so it never stops a start."""
    done = os.path.join(tag_dir, DONE_FILE)
    try:
        rec = read_json(done)
    except (ValueError, OSError):
        rec = None
    step = rec.get("step") if isinstance(rec, dict) else None
    saved_at = rec.get("saved_at") if isinstance(rec, dict) else None
    step = step if type(step) is int else None
    if type(saved_at) in (int, float) and abs(saved_at) < 1e300:  # a time, not an overflowing integer
        return step, float(saved_at)
    return step, os.path.getmtime(done)


def list_checkpoints(ckpt_root: str) -> list[str]:
    """Complete checkpoint tags in ``ckpt_root``, oldest -> newest.

    Only visible directories with a ``done`` marker count (staging/trash dirs start with '.').
    Order: by the step recorded in ``done`` (then save time, then tag) when every listed
    checkpoint recorded a step; otherwise (e.g. checkpoints written by NxD) by save time (the
    ``done`` record's time, else its file mtime). A missing ``ckpt_root`` gives ``[]``.
    """
    if not os.path.isdir(ckpt_root):
        return []
    records = []
    for name in os.listdir(ckpt_root):
        path = os.path.join(ckpt_root, name)
        if os.path.islink(path):  # never a checkpoint of this run: not resumed from, not counted, never deleted
            _warn_symlink(path)
            continue
        if not name.startswith(".") and is_complete(path):
            step, saved_at = _done_record(path)
            records.append((step, saved_at, name))
    if all(step is not None for step, _, _ in records):
        records.sort(key=lambda r: (r[0], r[1], r[2]))
    else:
        records.sort(key=lambda r: (r[1], r[2]))
    return [name for _, _, name in records]


_WARNED_LINKS: set[str] = set()


def _warn_symlink(path: str) -> None:
    """Report a symbolic link inside a checkpoint directory once per process: it is left alone (a link is not
    one of this run's checkpoints; following it for a deletion would delete something outside the run)."""
    if path not in _WARNED_LINKS:
        _WARNED_LINKS.add(path)
        logger.warning("%s is a symbolic link (to %s) inside the checkpoint directory: it is not treated as a "
                       "checkpoint and is never deleted; to resume from its target, give that path as "
                       "exp_manager.resume_from_checkpoint", path, os.path.realpath(path))


def latest_checkpoint(ckpt_root: str) -> str | None:
    """Tag of the newest complete checkpoint (last of :func:`list_checkpoints`), or None."""
    tags = list_checkpoints(ckpt_root)
    return tags[-1] if tags else None


def _write_newest(ckpt_root: str) -> None:
    """Atomically rewrite ``<ckpt_root>/newest`` with the complete tags, newest last."""
    tags = list_checkpoints(ckpt_root)
    newest = os.path.join(ckpt_root, NEWEST_FILE)
    if not tags:
        if os.path.isfile(newest):
            os.remove(newest)
        return
    tmp = os.path.join(ckpt_root, f".{NEWEST_FILE}.tmp-{uuid.uuid4().hex}")
    with open(tmp, "w") as f:
        f.write("".join(f"{t}\n" for t in tags))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, newest)
    fsync_dir(ckpt_root)


def remove_checkpoint(ckpt_root: str, tag: str) -> None:
    """Delete checkpoint ``<ckpt_root>/<tag>`` (call on global rank 0 only).

    The directory is first renamed to a hidden trash directory (atomic: it disappears from
    :func:`list_checkpoints` at once), ``newest`` is rewritten, then the trash is deleted. A symbolic link at
    ``<tag>`` is reported and left alone (never followed).

    Raises:
        FileNotFoundError: no such checkpoint directory.
        ValueError: invalid tag.
    """
    _check_tag(tag)
    final = os.path.join(ckpt_root, tag)
    if os.path.islink(final):  # never followed for a deletion
        _warn_symlink(final)
        return
    if not os.path.isdir(final):
        raise FileNotFoundError(f"cannot remove checkpoint {final!r}: no such directory")
    trash = _trash_dir(ckpt_root, tag)
    os.replace(final, trash)
    fsync_dir(ckpt_root)
    _write_newest(ckpt_root)
    shutil.rmtree(trash)


def cleanup_partial(ckpt_root: str) -> list[str]:
    """Remove leftovers of crashed saves/removals in ``ckpt_root`` (global rank 0, no save running).

    Deletes hidden staging directories ``.<tag>.partial``, trash directories and temporary
    ``newest`` files (a symbolic link of those names is unlinked, its target never touched; other links are
    left alone). Exception: a staging directory that already has ``done`` (the save crashed
    between moving the old ``<tag>`` aside and publishing the new one) is complete and is
    published as ``<tag>`` if no ``<tag>`` exists, instead of being deleted.

    Returns:
        Names of the entries deleted (sorted). A missing ``ckpt_root`` gives ``[]``.
    """
    if not os.path.isdir(ckpt_root):
        return []
    removed, promoted = [], False
    for name in sorted(os.listdir(ckpt_root)):
        path = os.path.join(ckpt_root, name)
        m = _PARTIAL_RE.match(name)
        final = os.path.join(ckpt_root, m.group("tag")) if m else ""
        link = os.path.islink(path)  # a link is never promoted nor followed: os.remove unlinks the link itself
        if m and not link and is_complete(path) and not os.path.lexists(final):
            os.replace(path, final)
            logger.warning("published complete staged checkpoint %s as %s", path, final)
            promoted = True
        elif m or _TRASH_RE.match(name) or name.startswith(f".{NEWEST_FILE}.tmp-"):
            if os.path.isdir(path) and not link:
                shutil.rmtree(path)
            else:
                os.remove(path)
            removed.append(name)
    fsync_dir(ckpt_root)
    if promoted:
        _write_newest(ckpt_root)
    return removed


def _ranks_found(folder: str) -> tuple[set[int], set[int], set[int]]:
    """DP, TP and PP ranks of the shard files in ``folder`` (EP ranks: :func:`ep_ranks_found`)."""
    dps: set[int] = set()
    tps: set[int] = set()
    pps: set[int] = set()
    if os.path.isdir(folder):
        for name in os.listdir(folder):
            m = _SHARD_RE.match(name)
            if m:
                dps.add(int(m.group(1)))
                tps.add(int(m.group(3)))
                pps.add(int(m.group(4)))
    return dps, tps, pps


def ep_ranks_found(folder: str) -> set[int]:
    """EP ranks named by the shard files in ``folder`` (empty: saved without expert parallelism)."""
    if not os.path.isdir(folder):
        return set()
    return {int(m.group("ep")) for m in map(_SHARD_RE.match, os.listdir(folder)) if m and m.group("ep") is not None}


def _missing_shard_error(path: str, tag_dir: str) -> FileNotFoundError:
    _, tps, pps = _ranks_found(os.path.join(tag_dir, MODEL_DIR))
    dps, _, _ = _ranks_found(os.path.join(tag_dir, OPTIM_DIR))
    found = (f"model shards for TP size {max(tps) + 1}, PP size {max(pps) + 1}" if tps
             else "no model shards")
    found += f"; optimizer shards for DP size {max(dps) + 1}" if dps else "; no optimizer shards"
    return FileNotFoundError(
        f"checkpoint shard {path!r} is missing: the checkpoint is incomplete or was saved with a "
        f"different TP/PP size ({tag_dir!r} has {found}). Load it with the parallel sizes it was "
        f"saved with.")


def _detect_xser(tag_dir: str, use_xser: bool | None) -> bool:
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


def _read_shard(path: str, tag_dir: str, use_xser: bool) -> Any:
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
    dps, _, _ = _ranks_found(folder)
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
        FileNotFoundError: no such checkpoint, or it has no ``done`` marker.
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
    _, tps, pps = _ranks_found(os.path.join(tag_dir, MODEL_DIR))
    dps, _, _ = _ranks_found(os.path.join(tag_dir, OPTIM_DIR))
    if not tps:
        raise _missing_shard_error(os.path.join(tag_dir, MODEL_DIR, checkpoint_file_name(0, 0, 0)), tag_dir)
    for t in range(max(tps) + 1):
        for p in range(max(pps) + 1):
            wanted = [(MODEL_DIR, 0)] + [(OPTIM_DIR, d) for d in range(max(dps) + 1 if dps else 0)]
            for sub, d in wanted:
                path = os.path.join(tag_dir, sub, checkpoint_file_name(d, t, p))
                if not os.path.isfile(path):
                    raise _missing_shard_error(path, tag_dir)


def _complete_dir(ckpt_root: str, tag: str) -> str:
    _check_tag(tag)
    tag_dir = os.path.join(ckpt_root, tag)
    if not os.path.isdir(tag_dir):
        raise FileNotFoundError(f"checkpoint {tag_dir!r} does not exist; complete checkpoints in "
                                f"{ckpt_root!r}: {list_checkpoints(ckpt_root)}")
    if not is_complete(tag_dir):
        raise FileNotFoundError(
            f"checkpoint {tag_dir!r} has no '{DONE_FILE}' marker: it is incomplete (its save was "
            f"interrupted). If it was written by an NxD release without markers and you know it is "
            f"complete, create the empty file {os.path.join(tag_dir, DONE_FILE)!r}")
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
        ``(model_state, optim_state or None, user_content or None)``.

    Raises:
        FileNotFoundError: the checkpoint is missing or has no ``done`` marker, or a shard file is
            missing (message gives the TP/PP/DP sizes found in the directory).
        integrity.CheckpointIntegrityError: a file fails verification or cannot be read (names it).
    """
    tag_dir = _complete_dir(ckpt_root, tag)
    if verify:
        verify_checkpoint(ckpt_root, tag, dp_rank=dp_rank, tp_rank=tp_rank, pp_rank=pp_rank, load_optim=load_optim,
                          ep_rank=ep_rank)
    xser = _detect_xser(tag_dir, use_xser)
    model_path = os.path.join(tag_dir, MODEL_DIR, checkpoint_file_name(0, tp_rank, pp_rank, ep_rank))
    model_state = _read_shard(model_path, tag_dir, xser) if read_model else None
    optim_state = None
    if load_optim:
        optim_state = _read_shard(_optim_path(tag_dir, dp_rank, tp_rank, pp_rank, ep_rank), tag_dir, xser)
    uc_path = os.path.join(tag_dir, USER_CONTENT_FILE)
    user_content = _named_read(uc_path, lambda: load_structure(uc_path)) if os.path.isfile(uc_path) else None
    return model_state, optim_state, user_content
