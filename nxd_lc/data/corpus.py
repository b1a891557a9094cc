"""The built-in corpus and the deterministic train/validation split by file.

``data.builtin_corpus: python_stdlib`` is the ``.py`` source of the running interpreter's standard library
(``sysconfig.get_paths()["stdlib"]``): real text that every machine has, so a run needs no download. Third-party
packages (``site-packages`` / ``dist-packages``) are excluded, and so is anything that is not a regular, readable,
UTF-8 file (the stdlib test suite ships a few deliberately mis-encoded files). The list is sorted, so it is the
same on every rank and every run of the same interpreter.

:func:`split_train_val` splits by FILE, never by sequence, so validation text is never seen in training. A file
goes to validation when a stable hash (SHA-256) of its path relative to the corpus root falls below
``val_fraction``; the result depends only on the relative paths, not on the rank, the run, the machine or the
order of the input list.
"""

from __future__ import annotations

import hashlib
import logging
import os
import stat
import sysconfig
from collections.abc import Iterable, Sequence

log = logging.getLogger(__name__)

#: Name of the built-in corpus accepted by ``data.builtin_corpus``.
PYTHON_STDLIB = "python_stdlib"
BUILTIN_CORPORA = (PYTHON_STDLIB,)
_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


def stdlib_root() -> str:
    """Absolute directory of the running interpreter's standard library (``sysconfig`` ``stdlib`` path)."""
    return os.path.realpath(sysconfig.get_paths()["stdlib"])


def is_utf8_text_file(path: str) -> bool:
    """True when ``path`` is a regular file (not a symlink) that can be read and decodes as UTF-8.

    Never raises: unreadable or missing files simply return False.
    """
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            return False
        with open(path, "rb") as f:
            f.read().decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return False
    return True


def python_stdlib_files(root: str | None = None) -> list[str]:
    """Sorted absolute paths of the standard library's ``.py`` files.

    Args:
        root: directory to scan; default :func:`stdlib_root`.
    Returns:
        Paths of regular UTF-8 ``.py`` files under ``root``, skipping ``site-packages``, ``dist-packages`` and
        ``__pycache__`` directories, sorted by their path relative to ``root``.
    Raises:
        FileNotFoundError: ``root`` is not a directory (an interpreter installed without its sources).
    """
    root = os.path.realpath(root or stdlib_root())
    if not os.path.isdir(root):
        raise FileNotFoundError(f"data.builtin_corpus: the standard library directory {root} does not exist; "
                                "this interpreter has no stdlib sources, set data.train_dir instead")
    found: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _EXCLUDED_DIRS)
        for name in filenames:
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                if is_utf8_text_file(path):
                    found.append(path)
    found.sort(key=lambda p: relative_key(p, root))
    return found


def builtin_corpus_files(name: str) -> tuple[str, list[str]]:
    """Root directory and sorted file list of the built-in corpus ``name``.

    Raises:
        ValueError: ``name`` is not a known built-in corpus (names the key ``data.builtin_corpus``).
        FileNotFoundError: the corpus has no files on this machine.
    """
    if name != PYTHON_STDLIB:
        raise ValueError(f"data.builtin_corpus: unknown corpus {name!r}; the built-in one is {PYTHON_STDLIB!r}")
    root = stdlib_root()
    files = python_stdlib_files(root)
    if not files:
        raise FileNotFoundError(f"data.builtin_corpus: no .py files found under {root}; set data.train_dir")
    return root, files


def relative_key(path: str, root: str) -> str:
    """``path`` relative to ``root`` with ``/`` separators: the platform-independent identity of a file."""
    return os.path.relpath(path, root).replace(os.sep, "/")


def stable_unit_interval(key: str) -> float:
    """Map a string to [0, 1) with SHA-256 (stable across processes, unlike ``hash()``)."""
    digest = hashlib.sha256(key.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def split_train_val(files: Sequence[str], val_fraction: float,
                    root: str | None = None) -> tuple[list[str], list[str]]:
    """Split files deterministically into (train, val) by a stable hash of their relative path.

    A file is held out when ``stable_unit_interval(relative path) < val_fraction``. When ``val_fraction > 0``
    and there are at least 2 files, validation gets at least the file with the smallest hash and training keeps
    at least the file with the largest, so neither side is empty. Both outputs keep the input order.

    Args:
        files: file paths (any order; duplicates are an error).
        val_fraction: share of files held out, in [0, 1).
        root: directory the relative paths are taken from; default the common directory of ``files``.
    Raises:
        ValueError: ``val_fraction`` outside [0, 1), or duplicate paths.
    """
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"data.val_fraction: must be in [0, 1), got {val_fraction}")
    if len(set(files)) != len(files):
        raise ValueError("split_train_val: the file list contains duplicates")
    if val_fraction == 0.0 or not files:
        return list(files), []
    root = root or _common_dir(files)
    scores = {f: stable_unit_interval(relative_key(f, root)) for f in files}
    val = {f for f in files if scores[f] < val_fraction}
    if len(files) >= 2:
        ranked = sorted(files, key=lambda f: (scores[f], relative_key(f, root)))
        val.add(ranked[0])
        val.discard(ranked[-1])
    return [f for f in files if f not in val], [f for f in files if f in val]


def _common_dir(files: Iterable[str]) -> str:
    paths = [os.path.abspath(f) for f in files]
    common = os.path.commonpath(paths)
    return os.path.dirname(common) if len(paths) == 1 or os.path.isfile(common) else common
