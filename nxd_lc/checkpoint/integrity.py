"""Checkpoint integrity: a SHA-256 manifest of every file, written before ``done``, verified on load.

Layout inside a checkpoint directory ``<ckpt_root>/<tag>`` (see :mod:`nxd_lc.checkpoint.sharded`)::

    manifest.json      {"format": 1, "algorithm": "sha256",
                        "files": {"<relative path>": {"bytes": <size>, "sha256": "<hex digest>"}, ...}}

Every rank hashes the files it wrote (right after writing them, while they are in the page cache) and puts
the digests in ``manifest.d/rank_<global rank>.json`` inside the staging directory; at commit, global rank 0
merges those into ``manifest.json`` (fsynced) and only then writes ``done``. So a published checkpoint either
has a manifest naming every file of it or predates manifests.

On load the manifest itself is checked first (:func:`read_manifest`: UTF-8 JSON of the shape above, every path
relative and inside the checkpoint, every entry a size and a 64-hex-digit digest, at least one model shard listed:
:func:`check_lists_folder`); a damaged manifest makes the checkpoint a damaged one, so resume falls back to the
previous checkpoint as it does for a flipped byte in a shard. Then each rank checks the manifest's file list
against the disk (every file present with its recorded size: catches missing directories and truncation anywhere
in the checkpoint, at the cost of one ``stat`` per file) and hashes the files it is about to read. The algorithm
is SHA-256 (``hashlib.sha256``, FIPS 180-4): on this project's 2-core CI machine it hashes 1.2 GB/s per core
(:func:`nxd_lc.runtime.files.file_digest`).
Files verified once in a process are not hashed again while their size and mtime are unchanged.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Iterable, Mapping
from typing import Any

from nxd_lc.config.input_files import read_json
from nxd_lc.runtime.files import file_digest

logger = logging.getLogger(__name__)

ALGORITHM = "sha256"
MANIFEST_FILE = "manifest.json"
RANK_MANIFEST_DIR = "manifest.d"
MANIFEST_FORMAT = 1

# (abs path, size, mtime_ns) of files whose digest matched in this process
_verified: set[tuple[str, int, int]] = set()
_warned_unverified: set[str] = set()


class CheckpointIntegrityError(RuntimeError):
    """A checkpoint file is missing, truncated, altered or unreadable.

    Attributes:
        path: the offending file (or the checkpoint directory when no single file is to blame).
    """

    def __init__(self, path: str, message: str) -> None:
        super().__init__(message)
        self.path = path


def files_under(root: str, relpath: str) -> list[str]:
    """``relpath`` (a file under ``root``) and, for an xser structure file, every file of its ``.tensors`` dir and
    its ``.info.pt`` (NxD's tensor-info file, :func:`nxd_lc.checkpoint.xser.save_xser`).

    Returns:
        Paths relative to ``root`` with '/' separators, the structure file first.
    """
    out = [relpath]
    tensors = os.path.join(root, relpath + ".tensors")
    if os.path.isdir(tensors):
        out += sorted(f"{relpath}.tensors/{n}" for n in os.listdir(tensors))
    if os.path.isfile(os.path.join(root, relpath + ".info.pt")):
        out.append(f"{relpath}.info.pt")
    return out


def write_rank_manifest(staging: str, rank: int, relpaths: Iterable[str]) -> None:
    """Hash ``relpaths`` (relative to ``staging``) and write ``manifest.d/rank_<rank>.json`` there, fsynced.

    Raises:
        OSError: a file cannot be read or the manifest cannot be written.
    """
    entries: dict[str, dict[str, Any]] = {}
    for rel in relpaths:
        size, digest = file_digest(os.path.join(staging, rel))
        entries[rel] = {"bytes": size, ALGORITHM: digest}
    folder = os.path.join(staging, RANK_MANIFEST_DIR)
    os.makedirs(folder, exist_ok=True)
    _write_json(os.path.join(folder, f"rank_{rank:05d}.json"), {"algorithm": ALGORITHM, "files": entries})


def merge_rank_manifests(staging: str) -> int:
    """Rank 0 at commit: merge ``manifest.d/*.json`` into ``manifest.json`` (fsynced) and drop ``manifest.d``.

    Files written by nobody's manifest but present in ``staging`` (``checkpoint`` marker) are hashed here.

    Returns:
        The number of files the manifest lists.

    Raises:
        CheckpointIntegrityError: two ranks recorded the same file with different digests.
    """
    files: dict[str, dict[str, Any]] = {}
    folder = os.path.join(staging, RANK_MANIFEST_DIR)
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        with open(os.path.join(folder, name)) as f:
            part = json.load(f)["files"]
        for rel, entry in part.items():
            if rel in files and files[rel] != entry:
                raise CheckpointIntegrityError(os.path.join(staging, rel),
                                               f"two ranks wrote {rel!r} with different contents")
            files[rel] = entry
    for name in sorted(os.listdir(staging)):
        if name not in files and os.path.isfile(os.path.join(staging, name)) and name != MANIFEST_FILE:
            size, digest = file_digest(os.path.join(staging, name))
            files[name] = {"bytes": size, ALGORITHM: digest}
    _write_json(os.path.join(staging, MANIFEST_FILE),
                {"format": MANIFEST_FORMAT, "algorithm": ALGORITHM, "files": dict(sorted(files.items()))})
    shutil.rmtree(folder, ignore_errors=True)
    return len(files)


def _write_json(path: str, obj: Any) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=0)
        f.flush()
        os.fsync(f.fileno())


def read_manifest(tag_dir: str) -> dict[str, dict[str, Any]] | None:
    """The ``files`` table of ``<tag_dir>/manifest.json``, or None when the checkpoint has no manifest.

    The manifest is checked before anything in it is used: UTF-8 JSON (:func:`nxd_lc.config.input_files.read_json`:
    no NaN, no over-long numbers, no nesting beyond the parser's limit), an object with ``algorithm`` SHA-256,
    ``format`` :data:`MANIFEST_FORMAT` when present and a ``files`` object whose every entry is a relative path
    inside the checkpoint (``/``-separated, no ``..``, not absolute; see :func:`manifest_entry_problem`) mapped to
    ``{"bytes": <int >= 0>, "sha256": <64 hex digits>}``.

    Raises:
        CheckpointIntegrityError: the manifest exists but is unreadable, not JSON, or not of that shape (names the
            manifest and, for a bad entry, the entry); the caller treats the checkpoint as damaged.
    """
    path = os.path.join(tag_dir, MANIFEST_FILE)
    if not os.path.isfile(path):
        return None
    try:
        doc = read_json(path)
    except (ValueError, OSError) as e:  # a syntax error, bad UTF-8, NaN, nesting too deep, unreadable
        raise CheckpointIntegrityError(path, f"checkpoint manifest {path!r} is unreadable ({e}); the checkpoint "
                                             f"cannot be verified") from None
    problem = _manifest_problem(doc)
    if problem:
        raise CheckpointIntegrityError(path, f"checkpoint manifest {path!r} is damaged: {problem}; the checkpoint "
                                             f"cannot be verified")
    return dict(doc["files"])


def _manifest_problem(doc: Any) -> str | None:
    """What is wrong with a parsed manifest (None: nothing)."""
    if not isinstance(doc, dict):
        return f"expected a JSON object, got {type(doc).__name__}"
    if doc.get("algorithm") != ALGORITHM:
        return f"expected algorithm {ALGORITHM!r}, got {str(doc.get('algorithm'))[:40]!r}"
    if "format" in doc and (type(doc["format"]) is not int or doc["format"] != MANIFEST_FORMAT):
        return (f"format {str(doc['format'])[:40]!r}, this nxd_lc reads format {MANIFEST_FORMAT} (a newer nxd_lc "
                f"wrote it, or it was altered)")
    files = doc.get("files")
    if not isinstance(files, dict):
        return f"expected a 'files' object, got {type(files).__name__}"
    for rel, entry in files.items():
        problem = manifest_entry_problem(rel, entry)
        if problem:
            return f"entry {rel[:200]!r}: {problem}"
    return None


_HEX = frozenset("0123456789abcdef")


def manifest_entry_problem(rel: str, entry: Any) -> str | None:
    """What is wrong with one ``files`` entry of a manifest (None: nothing).

    ``rel`` must be a normalised relative path inside the checkpoint (no empty, ``.`` or ``..`` parts, no
    leading ``/``, no backslash or NUL), so that nothing outside the checkpoint directory is ever looked at
    through a manifest; ``entry`` must be ``{"bytes": int >= 0, "sha256": 64 lowercase hex digits}``.
    """
    parts = rel.split("/")
    if not rel or rel.startswith("/") or "\\" in rel or "\0" in rel or any(p in ("", ".", "..") for p in parts):
        return "not a relative path inside the checkpoint directory"
    if not isinstance(entry, dict):
        return f"expected {{'bytes': ..., '{ALGORITHM}': ...}}, got {type(entry).__name__}"
    size, digest = entry.get("bytes"), entry.get(ALGORITHM)
    if type(size) is not int or size < 0:
        return f"'bytes' must be a whole number >= 0, got {str(size)[:40]!r}"
    if not isinstance(digest, str) or len(digest) != 64 or not set(digest) <= _HEX:
        return f"'{ALGORITHM}' must be 64 lowercase hex digits, got {str(digest)[:80]!r}"
    return None


def check_lists_folder(tag_dir: str, manifest: Mapping[str, Any], folder: str) -> None:
    """``manifest`` lists at least one file under ``folder`` (e.g. ``model``) when ``tag_dir`` has that folder: a
    manifest emptied or cut down to a few entries would otherwise let the shards be loaded unverified.

    Raises:
        CheckpointIntegrityError: the folder exists but the manifest names nothing in it.
    """
    if os.path.isdir(os.path.join(tag_dir, folder)) and not any(rel.startswith(folder + "/") for rel in manifest):
        path = os.path.join(tag_dir, MANIFEST_FILE)
        raise CheckpointIntegrityError(path, f"checkpoint manifest {path!r} lists no file under {folder}/: it is "
                                             f"incomplete, so the checkpoint cannot be verified")


def mark_warned_unverified(tag_dir: str) -> None:
    """Count ``tag_dir`` as warned about already (a caller's own warning said it is loaded unverified)."""
    _warned_unverified.add(tag_dir)


def warn_unverified(tag_dir: str) -> None:
    """Warn once per process that ``tag_dir`` (no manifest: older nxd_lc or NxD) is loaded unverified."""
    if tag_dir not in _warned_unverified:
        _warned_unverified.add(tag_dir)
        logger.warning("checkpoint %s has no %s (written before checksums were added, or by NxD): loading it "
                       "without verifying its files", tag_dir, MANIFEST_FILE)


def check_present(tag_dir: str, manifest: Mapping[str, Mapping[str, Any]]) -> None:
    """Every file of ``manifest`` exists under ``tag_dir`` with its recorded size (one ``stat`` each).

    Raises:
        CheckpointIntegrityError: naming the first missing or wrong-sized file.
    """
    for rel, entry in manifest.items():
        path = os.path.join(tag_dir, rel)
        try:
            size = os.path.getsize(path)
        except OSError:
            raise CheckpointIntegrityError(path, f"checkpoint file {path!r} is missing (listed in "
                                                 f"{MANIFEST_FILE}): the checkpoint is incomplete") from None
        if size != entry.get("bytes"):
            raise CheckpointIntegrityError(path, f"checkpoint file {path!r} has {size} bytes, {MANIFEST_FILE} "
                                                 f"records {entry.get('bytes')}: it is truncated or was replaced")


def verify_files(tag_dir: str, relpaths: Iterable[str], manifest: Mapping[str, Mapping[str, Any]]) -> None:
    """Hash each of ``relpaths`` under ``tag_dir`` and compare with ``manifest``.

    Raises:
        CheckpointIntegrityError: a file is not in the manifest, missing, of another size, or its SHA-256
            differs (the message names the file and both digests).
    """
    for rel in relpaths:
        path = os.path.join(tag_dir, rel)
        entry = manifest.get(rel)
        if entry is None:
            raise CheckpointIntegrityError(path, f"checkpoint file {path!r} is not listed in {MANIFEST_FILE}: it "
                                                 f"was not part of the saved checkpoint")
        try:
            st = os.stat(path)
        except OSError:
            raise CheckpointIntegrityError(path, f"checkpoint file {path!r} is missing") from None
        key = (os.path.abspath(path), st.st_size, st.st_mtime_ns)
        if key in _verified:
            continue
        size, digest = file_digest(path)
        if size != entry.get("bytes") or digest != entry.get(ALGORITHM):
            raise CheckpointIntegrityError(
                path, f"checkpoint file {path!r} is corrupt: {ALGORITHM} {digest} ({size} bytes), "
                      f"{MANIFEST_FILE} records {entry.get(ALGORITHM)} ({entry.get('bytes')} bytes)")
        _verified.add(key)
