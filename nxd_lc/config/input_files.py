"""Reading the text and JSON files a run is given (data, config.json, tokenizer files), and finding data files.

Every problem is one ``ValueError`` that names the file (and its line and byte offset) and says what to do,
never a raw ``UnicodeDecodeError`` / ``RecursionError`` from inside ``json``:

* text is UTF-8. A UTF-8 byte-order mark is dropped; a UTF-16 / UTF-32 byte-order mark, bytes that are not
  UTF-8, and NUL bytes (binary data, or UTF-16 text without a mark) are refused naming file, line and byte;
* JSON (:func:`parse_json`) is ``json.loads`` (RFC 8259) without Python's extensions: ``NaN`` / ``Infinity``,
  numbers that overflow a 64-bit float (``1e999`` would read as ``inf``), integers longer than Python converts
  (``sys.get_int_max_str_digits()``, 4300 digits) and nesting deeper than the parser's recursion limit are
  refused naming file and line. Syntax errors stay ``json.JSONDecodeError`` (a ``ValueError``), which each
  caller words for its file kind;
* a glob pattern (:func:`glob_files`) matches what ``glob.glob(pattern, recursive=True)`` matches (``**`` is any
  number of directories; ``*`` / ``**`` skip names starting with ``.``), but each real directory is visited
  once per ``**`` (identity ``(st_dev, st_ino)``) and each real file is returned once: a symbolic link to a
  directory above it (glob reads every file ~41 times through it, two such links never end) or a second path
  to the same directory / file is skipped with a warning naming it.
"""

from __future__ import annotations

import codecs
import fnmatch
import json
import logging
import math
import os
import stat
import sys
from collections.abc import Iterator
from typing import Any

log = logging.getLogger(__name__)

_FOREIGN_BOMS = ((codecs.BOM_UTF32_LE, "UTF-32 (little-endian)"), (codecs.BOM_UTF32_BE, "UTF-32 (big-endian)"),
                 (codecs.BOM_UTF16_LE, "UTF-16 (little-endian)"), (codecs.BOM_UTF16_BE, "UTF-16 (big-endian)"))
_MAGIC = frozenset("*?[")


def _prefixed(key: str | None, message: str) -> str:
    return f"{key}: {message}" if key else message


# ---- text ------------------------------------------------------------------------------------------------------
def _check_bom(head: bytes, path: str, key: str | None) -> int:
    """Length of a UTF-8 byte-order mark at the start of the file (0 without one); refuse other encodings' marks."""
    for bom, name in _FOREIGN_BOMS:
        if head.startswith(bom):
            raise ValueError(_prefixed(key, f"{path} is {name} text (it starts with that byte-order mark); nxd_lc "
                                            f"reads UTF-8 only: re-encode it, e.g. iconv -f {name.split()[0]} "
                                            f"-t UTF-8 {os.path.basename(path)} > utf8/{os.path.basename(path)}"))
    return len(codecs.BOM_UTF8) if head.startswith(codecs.BOM_UTF8) else 0


def _decode(data: bytes, path: str, key: str | None, line: int, offset: int) -> str:
    """``data`` (the bytes from file offset ``offset``, starting on line ``line``) as UTF-8 text, NUL-free."""
    nul = data.find(b"\0")
    if nul >= 0:
        at = line + data.count(b"\n", 0, nul)
        raise ValueError(_prefixed(key, f"{path}:{at}: a NUL byte at byte {offset + nul} of the file; UTF-8 text "
                                        "never holds one (a binary file, or UTF-16 / UTF-32 text without a "
                                        "byte-order mark): re-encode it as UTF-8, or keep it out of the data"))
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        at = line + data.count(b"\n", 0, e.start)
        raise ValueError(_prefixed(key, f"{path}:{at}: not UTF-8 ({e.reason} at byte {offset + e.start} of the "
                                        "file); re-encode the file as UTF-8 (e.g. iconv -f <its encoding> -t "
                                        "UTF-8), or keep it out of the data")) from None


def read_text(path: str, *, key: str | None = None) -> str:
    """The whole file ``path`` as UTF-8 text (a UTF-8 byte-order mark is dropped).

    Args:
        path: the file.
        key: config key the path came from, put before the message (None: none).
    Raises:
        OSError: the file cannot be read.
        ValueError: a UTF-16 / UTF-32 byte-order mark, a NUL byte, or bytes that are not UTF-8 (names the file,
            line and byte offset, and says to re-encode it).
    """
    with open(path, "rb") as f:
        data = f.read()
    skip = _check_bom(data[:4], path, key)
    return _decode(data[skip:], path, key, 1, skip)


def iter_text_lines(path: str, *, key: str | None = None) -> Iterator[tuple[int, str]]:
    """``(line number from 1, line text with its newline)`` of ``path``, read and checked one line at a time.

    Lines end at ``\\n`` (a ``\\r`` before it stays in the text). Checks and errors are those of
    :func:`read_text`, raised when the offending line is reached.
    """
    with open(path, "rb") as f:
        offset = 0
        for lineno, raw in enumerate(f, start=1):
            skip = _check_bom(raw[:4], path, key) if lineno == 1 else 0
            yield lineno, _decode(raw[skip:], path, key, lineno, offset + skip)
            offset += len(raw)


# ---- JSON ------------------------------------------------------------------------------------------------------
class _NumberError(ValueError):
    def __init__(self, literal: str, why: str) -> None:
        super().__init__(why)
        self.literal, self.why = literal, why


def _parse_float(literal: str) -> float:
    value = float(literal)
    if not math.isfinite(value):
        raise _NumberError(literal, f"the number {literal[:40]} is beyond a 64-bit float (it would read as "
                                    "infinity); write a finite number")
    return value


def _max_digits() -> int:
    return getattr(sys, "get_int_max_str_digits", lambda: 4300)()  # Python >= 3.10.7


def _parse_int(literal: str) -> int:
    try:
        return int(literal)
    except ValueError:  # longer than sys.get_int_max_str_digits()
        raise _NumberError(literal, f"an integer of {len(literal)} digits ({literal[:20]}...) is longer than "
                                    f"the {_max_digits()} digits Python converts; write a shorter "
                                    "number (or a string)") from None


def _parse_constant(literal: str) -> Any:
    raise _NumberError(literal, f"{literal} is not a JSON number (RFC 8259 has no NaN / Infinity); write a "
                                "finite number or null")


def _line_of(text: str, literal: str) -> int | None:
    at = text.find(literal)
    return None if at < 0 else text.count("\n", 0, at) + 1


def _has_lone_surrogate(value: Any) -> bool:
    """True when a string (key or value) anywhere in the parsed JSON ``value`` holds a lone surrogate."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return False


def parse_json(text: str, path: str, *, line: int | None = None, key: str | None = None) -> Any:
    """``json.loads(text)`` of the file ``path`` with the checks of the module doc.

    Args:
        text: the JSON text (one jsonl line, or a whole file).
        path: the file, named in errors.
        line: the text's line in the file (a jsonl line); None: the text is the whole file and errors give the
            line inside it where it can be found.
        key: config key put before the message (None: none).
    Raises:
        json.JSONDecodeError: a syntax error (positions relative to ``text``), for the caller to word.
        ValueError: NaN / Infinity, a float that overflows to infinity, an integer beyond Python's digit limit,
            or nesting beyond the parser's recursion limit; names ``path:line``.
    """
    try:
        value = json.loads(text, parse_float=_parse_float, parse_int=_parse_int, parse_constant=_parse_constant)
        # valid UTF-8 cannot hold a lone UTF-16 surrogate; only a \ud800-\udfff escape can put one in a string
        # (a pair of escapes becomes one character), and tokenizers / encoders fail on it later without the file
        if "\\u" in text and _has_lone_surrogate(value):
            raise _NumberError("\\ud", "a string holds a lone UTF-16 surrogate escape "
                               "(\\ud800-\\udfff without its pair), which is no character; fix or drop the "
                               "record")
        return value
    except _NumberError as e:
        at = line if line is not None else _line_of(text, e.literal)
        where = path if at is None else f"{path}:{at}"
        raise ValueError(_prefixed(key, f"{where}: {e.why}")) from None
    except RecursionError:
        where = path if line is None else f"{path}:{line}"
        raise ValueError(_prefixed(key, f"{where}: JSON nested deeper than the parser allows (about "
                                        f"{sys.getrecursionlimit()} levels of [ / {{); flatten the data")) from None


def read_json(path: str, *, key: str | None = None) -> Any:
    """:func:`read_text` then :func:`parse_json` of the whole file (same errors)."""
    return parse_json(read_text(path, key=key), path, key=key)


# ---- finding files -----------------------------------------------------------------------------------------------
def _has_magic(part: str) -> bool:
    return any(c in _MAGIC for c in part)


def _is_dir(path: str) -> bool:
    try:
        return stat.S_ISDIR(os.stat(path).st_mode)
    except (OSError, ValueError):
        return False


def _identity(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return None
    return st.st_dev, st.st_ino


def _names(directory: str) -> list[str]:
    try:
        return sorted(os.listdir(directory))
    except OSError:
        return []


class _Matcher:
    """One :func:`glob_files` call: expands pattern parts below a directory, remembering what it reported."""

    def __init__(self, key: str | None) -> None:
        self.key = key
        self.reported: set[str] = set()

    def skip(self, path: str, message: str) -> None:
        """Warn once per ``path`` that it was left out."""
        if path not in self.reported:
            self.reported.add(path)
            log.warning("%s", _prefixed(self.key, message))

    def expand(self, directory: str, parts: list[str]) -> Iterator[str]:
        """Paths below ``directory`` matching ``parts`` (glob semantics, module doc)."""
        part, rest = parts[0], parts[1:]
        if part == "**":
            for d in self._ordered_dirs(directory):
                if rest:
                    yield from self.expand(d, rest)
                else:
                    yield d
                    yield from (os.path.join(d, n) for n in _names(d)
                                if not n.startswith(".") and not _is_dir(os.path.join(d, n)))
        elif _has_magic(part):
            for name in fnmatch.filter(_names(directory), part):
                if name.startswith(".") and not part.startswith("."):
                    continue
                path = os.path.join(directory, name)
                if not rest:
                    yield path
                elif _is_dir(path):
                    yield from self.expand(path, rest)
        else:
            path = os.path.join(directory, part)
            if not rest:
                if os.path.lexists(path):
                    yield path
            elif _is_dir(path):
                yield from self.expand(path, rest)

    def _ordered_dirs(self, top: str) -> list[str]:
        """``top`` and every non-hidden directory below it (what ``**`` matches), each real directory once.

        Real directories are taken first, links to directories after them, so a directory is listed under its
        own path rather than a link's; a directory reached again (a loop, or a second link to it) is skipped and
        reported.
        """
        out: list[str] = []
        ident = _identity(top)
        seen: dict[tuple[int, int] | None, str] = {ident: top}
        stack: list[tuple[str, tuple[tuple[int, int] | None, ...]]] = [(top, (ident,))]
        links: list[tuple[str, tuple[tuple[int, int] | None, ...]]] = []

        def take(path: str, ancestors: tuple[tuple[int, int] | None, ...]) -> None:
            sub = _identity(path)
            if sub in seen:
                what = ("a directory it is inside of (a loop)" if sub in ancestors
                        else f"a directory already read as {seen[sub]}")
                self.skip(path, f"{path} leads to {os.path.realpath(path)}, {what}; not followed, so each "
                                 "file is read once (remove the link, or point the data path past it)")
            else:
                seen[sub] = path
                stack.append((path, (*ancestors, sub)))

        while stack or links:
            if not stack:
                take(*links.pop(0))
                continue
            directory, ancestors = stack.pop()
            out.append(directory)
            for name in _names(directory):
                path = os.path.join(directory, name)
                if not name.startswith(".") and _is_dir(path):
                    if os.path.islink(path):
                        links.append((path, ancestors))
                    else:
                        take(path, ancestors)
        return out


def glob_files(pattern: str, *, key: str | None = None) -> list[str]:
    """The files matching glob ``pattern`` (``glob.glob(pattern, recursive=True)``'s matches), sorted, each real
    file once (module doc); a path without wildcards is itself when it is a file.

    Args:
        pattern: a path or glob pattern (``**`` = any number of directories).
        key: config key the pattern came from, put before the warnings.
    Returns:
        Sorted paths of regular files (symbolic links to files count as the file they lead to). A second path
        to a file already listed (a link, a hard link, a directory reached twice) is left out with a warning.
    """
    parts = pattern.split(os.sep)
    first = next((i for i, p in enumerate(parts) if _has_magic(p)), None)
    if first is None:
        return [pattern] if os.path.isfile(pattern) else []
    root = os.sep.join(parts[:first]) or (os.sep if pattern.startswith(os.sep) else os.curdir)
    if not _is_dir(root):
        return []
    matcher = _Matcher(key)
    found = matcher.expand(root, parts[first:])
    if root == os.curdir and not pattern.startswith(os.curdir):
        found = (os.path.relpath(p) if p.startswith(os.curdir + os.sep) else p for p in found)
    by_file: dict[tuple[int, int], list[str]] = {}
    for path in set(found):
        try:
            st = os.stat(path)
        except (OSError, ValueError):
            continue  # a broken link
        if stat.S_ISREG(st.st_mode):
            by_file.setdefault((st.st_dev, st.st_ino), []).append(path)
    real_root = os.path.realpath(root)

    def through_link(p: str) -> bool:  # reached through a link below the root (its own path is preferred)
        return os.path.relpath(p, root) != os.path.relpath(os.path.realpath(p), real_root)

    kept = []
    for paths in sorted(by_file.values(), key=min):  # warnings in a stable order
        paths.sort(key=lambda p: (through_link(p), p) if len(paths) > 1 else p)
        kept.append(paths[0])
        for other in paths[1:]:
            matcher.skip(other, f"{other} is the same file as {paths[0]} (a link to it); read once")
    return sorted(kept)
