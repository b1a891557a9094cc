"""Listing and retention of the checkpoints in a checkpoint root (NxD layout, :mod:`nxd_lc.checkpoint.sharded`):
complete checkpoints in save order, the ``newest`` file, atomic removal, and the cleanup of crashed saves' leftovers.
Symbolic links inside the root are never treated as checkpoints, never followed and never deleted.
"""

from __future__ import annotations

import logging
import os
import shutil
import uuid

from nxd_lc.checkpoint.layout import (
    DONE_FILE,
    NEWEST_FILE,
    PARTIAL_RE,
    TRASH_RE,
    check_tag,
    is_complete,
    trash_dir,
)
from nxd_lc.checkpoint.xser import fsync_dir
from nxd_lc.config.input_files import read_json

__all__ = ["cleanup_partial", "latest_checkpoint", "list_checkpoints", "remove_checkpoint", "write_newest"]

logger = logging.getLogger(__name__)


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


def write_newest(ckpt_root: str) -> None:
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
    check_tag(tag)
    final = os.path.join(ckpt_root, tag)
    if os.path.islink(final):  # never followed for a deletion
        _warn_symlink(final)
        return
    if not os.path.isdir(final):
        raise FileNotFoundError(f"cannot remove checkpoint {final!r}: no such directory")
    trash = trash_dir(ckpt_root, tag)
    os.replace(final, trash)
    fsync_dir(ckpt_root)
    write_newest(ckpt_root)
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
        m = PARTIAL_RE.match(name)
        final = os.path.join(ckpt_root, m.group("tag")) if m else ""
        link = os.path.islink(path)  # a link is never promoted nor followed: os.remove unlinks the link itself
        if m and not link and is_complete(path) and not os.path.lexists(final):
            os.replace(path, final)
            logger.warning("published complete staged checkpoint %s as %s", path, final)
            promoted = True
        elif m or TRASH_RE.match(name) or name.startswith(f".{NEWEST_FILE}.tmp-"):
            if os.path.isdir(path) and not link:
                shutil.rmtree(path)
            else:
                os.remove(path)
            removed.append(name)
    fsync_dir(ckpt_root)
    if promoted:
        write_newest(ckpt_root)
    return removed

