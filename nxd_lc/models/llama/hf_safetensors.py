"""Reading HF safetensors checkpoints: each file's header checked against the file before the library maps it
(:func:`check_safetensors_header`), and a read-only view over one file or a sharded directory
(:class:`SafetensorsCheckpoint`, with ``model.safetensors.index.json`` confined to its directory).

Used by the HF loader (:mod:`nxd_lc.models.llama.hf_adapter`), which reads each tensor through ``get_slice`` so a
rank reads only its own shard.
"""

from __future__ import annotations

import contextlib
import os
import struct
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from typing_extensions import Self

from nxd_lc.config.input_files import parse_json
from nxd_lc.runtime.accel import HOST

__all__ = ["INDEX_FILE", "NonFiniteWeightsError", "SafetensorsCheckpoint", "all_finite", "check_safetensors_header"]

INDEX_FILE = "model.safetensors.index.json"

#: safetensors dtype names of the floating types an HF decoder checkpoint stores its weights in
_FLOAT_DTYPES = ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2")
#: bytes per element of the safetensors dtypes (sub-byte types such as F4 are checked for offsets only)
_DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "I16": 2, "U16": 2, "F16": 2,
                "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8, "C64": 8}
_MAX_HEADER_BYTES = 100_000_000  # the safetensors library's own limit


def _header_entries(file: Path, header: Any, data_bytes: int) -> list[tuple[int, int, str]]:
    """``(begin, end, name)`` of each tensor of a parsed safetensors header, each checked (ValueError names it)."""
    bad = f"safetensors file {file}: "
    fix = "; the file is damaged or not safetensors: download or save it again"
    if not isinstance(header, dict):
        raise ValueError(f"{bad}its header is a JSON {type(header).__name__}, not an object{fix}")
    spans = []
    for name, info in header.items():
        if name == "__metadata__":
            if not isinstance(info, dict) or not all(isinstance(v, str) for v in info.values()):
                raise ValueError(f"{bad}__metadata__ must map names to strings{fix}")
            continue
        if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
            raise ValueError(f"{bad}tensor {name!r} needs exactly 'dtype', 'shape' and 'data_offsets', got "
                             f"{sorted(info) if isinstance(info, dict) else type(info).__name__}{fix}")
        dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        if (not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape)
                or not isinstance(offsets, list) or len(offsets) != 2
                or not all(type(o) is int for o in offsets) or not isinstance(dtype, str)):
            raise ValueError(f"{bad}tensor {name!r} has dtype {dtype!r}, shape {shape!r}, data_offsets {offsets!r}: "
                             f"expected a dtype name, a list of sizes and two byte offsets{fix}")
        begin, end = offsets
        if not 0 <= begin <= end <= data_bytes:
            raise ValueError(f"{bad}tensor {name!r} lies at bytes [{begin}, {end}), outside the {data_bytes} data "
                             f"bytes after the header{fix}")
        elements = 1
        for d in shape:
            elements *= d
        if dtype in _DTYPE_BYTES and end - begin != elements * _DTYPE_BYTES[dtype]:
            raise ValueError(f"{bad}tensor {name!r} ({dtype} {shape}) needs {elements * _DTYPE_BYTES[dtype]} bytes, "
                             f"its data_offsets span {end - begin}{fix}")
        spans.append((begin, end, name))
    spans.sort()
    for (_, end, first), (begin, _, second) in zip(spans, spans[1:]):
        if begin < end:
            raise ValueError(f"{bad}tensors {first!r} and {second!r} overlap (bytes {begin}..{end}){fix}")
    return spans


def check_safetensors_header(file: str | Path) -> None:
    """Check a safetensors file's header against the file before the library maps it.

    Layout: an 8-byte little-endian header length ``n``, ``n`` bytes of UTF-8 JSON (``{name: {dtype, shape,
    data_offsets: [begin, end]}, "__metadata__": {...}}``), then the data; offsets count from the data's start.
    Checked: ``n`` within the file (and the library's 100 MB limit), the JSON, each tensor's fields, its bytes
    inside the data and matching its shape and dtype, and no two tensors overlapping. Reads only the header.

    Raises:
        ValueError: the first problem, naming the file (and the tensor) and the fix.
    """
    file = Path(file)
    size = file.stat().st_size
    fix = "; the file is damaged or not safetensors: download or save it again"
    with file.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"safetensors file {file}: {size} bytes, shorter than the 8-byte header length{fix}")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8 or n > _MAX_HEADER_BYTES:
            raise ValueError(f"safetensors file {file}: header length {n} bytes, but the file holds {size - 8} after "
                             f"the length field (limit {_MAX_HEADER_BYTES}){fix}")
        raw = f.read(n)
    try:
        header = parse_json(raw.decode("utf-8"), str(file))  # no NaN / inf / over-long numbers / deep nesting
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ValueError(f"safetensors file {file}: its header is not UTF-8 JSON ({type(e).__name__}: "
                         f"{str(e)[:120]}){fix}") from None
    _header_entries(file, header, size - 8 - n)


def _open(file: Path) -> Any:
    """``safe_open`` of a checked file; an error the library still raises names the file."""
    check_safetensors_header(file)
    try:
        return safe_open(str(file), framework="pt", device=HOST.type)
    except (SafetensorError, OSError) as e:
        raise ValueError(f"safetensors file {file} cannot be read ({e}); download or save it again") from e


class NonFiniteWeightsError(ValueError):
    """A weight read from an HF checkpoint holds NaN or infinite values (the message names the file and tensor)."""


def all_finite(t: torch.Tensor) -> bool:
    """Whether floating-point tensor ``t`` holds no NaN and no infinity: one reduction (float8 tensors, which
    ``torch.isfinite`` does not take, are widened to float16 first, exactly)."""
    if t.element_size() == 1:
        t = t.to(torch.float16)
    return bool(torch.isfinite(t).all())


class SafetensorsCheckpoint:
    """Read-only view over a safetensors checkpoint: one file, or a directory (sharded with
    ``model.safetensors.index.json``, or any ``*.safetensors`` files). Use as a context manager.

    Raises:
        FileNotFoundError: path missing, or no safetensors file in the directory.
        ValueError: malformed index json, an index entry naming a file outside the directory (absolute, ``..``, a
            symlink leading out) or a missing file, or a damaged safetensors header (each names the file / entry).
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.weight_map = self._build_weight_map()
        self._handles: dict[Path, object] = {}
        self._stack = contextlib.ExitStack()

    def _build_weight_map(self) -> dict[str, Path]:
        p = self.path
        if p.is_file():
            return dict.fromkeys(_keys(p), p)
        if not p.is_dir():
            raise FileNotFoundError(f"HF checkpoint {p} does not exist (expected a directory or a .safetensors file)")
        index = p / INDEX_FILE
        if index.is_file():
            return _index_weight_map(index)
        shards = sorted(p.glob("*.safetensors"))
        if not shards:
            raise FileNotFoundError(f"no *.safetensors files (nor {INDEX_FILE}) in {p}; save the HF model with "
                                    f"save_pretrained(..., safe_serialization=True)")
        return {name: f for f in shards for name in _keys(f)}

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()
        self._handles.clear()

    def _slice(self, name: str):
        if name not in self.weight_map:
            raise ValueError(f"tensor {name!r} is missing from the HF checkpoint {self.path}")
        file = self.weight_map[name]
        if file not in self._handles:
            self._handles[file] = self._stack.enter_context(_open(file))
        try:
            return self._handles[file].get_slice(name)
        except SafetensorError as e:  # the index names a file that does not hold the tensor
            raise ValueError(f"safetensors file {file}: tensor {name!r} cannot be read ({e}); the checkpoint or "
                             f"its {INDEX_FILE} is damaged: download or save it again") from e

    def shape(self, name: str) -> tuple[int, ...]:
        """Full shape of tensor ``name`` (read from the header only)."""
        return tuple(self._slice(name).get_shape())

    def read(self, name: str, dim: int | None = None, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Tensor ``name``, or only indices ``[start, stop)`` of dim ``dim`` (0 or 1), read from disk.

        The values read are checked to be finite (one reduction over the host tensor, once per read).

        Raises:
            ValueError: ``name`` is missing, or stored with a non-floating dtype (every decoder weight is a float;
                an integer / bool tensor would be cast silently), naming the tensor, its dtype and file.
            NonFiniteWeightsError: the values read hold a NaN or an infinity (names the file and the tensor).
        """
        sl = self._slice(name)
        dtype = sl.get_dtype()
        if dtype not in _FLOAT_DTYPES:
            raise ValueError(f"tensor {name!r} in {self.file_of(name)} is stored as {dtype}, not a floating type; "
                             "the file is not an HF checkpoint of this model (model.hf_weights_dir)")
        if dim is None:
            t = sl[:]
        elif dim == 0:
            t = sl[start:stop]
        elif dim == 1:
            t = sl[:, start:stop]
        else:
            raise ValueError(f"can only slice dim 0 or 1, got {dim}")
        if not all_finite(t):
            raise NonFiniteWeightsError(
                f"safetensors file {self.file_of(name)}: tensor {name!r} holds NaN or infinite values, so the model "
                "would train on broken weights (the loss is NaN from the first step); the checkpoint is damaged or "
                "was saved from a diverged run: download or save it again, or point model.hf_weights_dir at "
                "another checkpoint")
        return t

    def file_of(self, name: str) -> Path:
        """The file that holds tensor ``name``."""
        return self.weight_map[name]


def _keys(file: Path) -> list[str]:
    with _open(file) as f:
        return list(f.keys())


def _index_weight_map(index: Path) -> dict[str, Path]:
    """``{tensor name: file}`` of ``model.safetensors.index.json``; every file must be a file inside its directory.

    Raises:
        ValueError: not UTF-8 JSON with a ``weight_map`` object of names to relative file names, an entry whose
            file is absolute or resolves (``..``, symlinks) outside the directory, or names a missing file.
    """
    root = index.parent
    try:
        weight_map = parse_json(index.read_bytes().decode("utf-8"), str(index))["weight_map"]
    except (UnicodeDecodeError, ValueError, RecursionError, KeyError, TypeError) as e:
        raise ValueError(f"{index}: not a valid safetensors index (needs UTF-8 JSON with a 'weight_map' object): "
                         f"{type(e).__name__}: {str(e)[:120]}") from None
    if not isinstance(weight_map, dict):
        raise ValueError(f"{index}: 'weight_map' is a {type(weight_map).__name__}, not an object of tensor names to "
                         "file names")
    real_root = root.resolve()
    files: dict[str, Path] = {}
    checked: dict[str, Path] = {}
    for name, fname in weight_map.items():
        if isinstance(fname, str) and fname in checked:  # a list / object is unhashable: refused below
            files[name] = checked[fname]
            continue
        entry = f"{index}: weight_map entry {name!r} -> {fname!r}"
        if not isinstance(fname, str) or not fname or os.path.isabs(fname) or not fname.isprintable():
            raise ValueError(f"{entry}: the file must be a name relative to {root} (printable text)")
        target = root / fname
        if not target.resolve().is_relative_to(real_root):
            raise ValueError(f"{entry} leads outside the model directory {root} (to {target.resolve()}); an index "
                             "may only name files inside its directory: copy the file in, or fix the index")
        if not target.is_file():
            raise ValueError(f"{entry}: no such file in {root}; the checkpoint is incomplete: download or save it "
                             "again")
        checked[fname] = files[name] = target
    return files

