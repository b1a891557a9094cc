"""xser: torch-xla's "one file per tensor" serialization, readable and writable without torch-xla.

Format (torch_xla.utils.serialization, also what NeuronX Distributed writes with ``use_xser``):

* ``<path>`` is a ``torch.save`` of the saved structure in which every tensor is replaced by a
  reference object holding an integer id ``tid``;
* ``<path>.tensors/tensor_<tid>.pt`` is a ``torch.save`` of that one CPU tensor;
* ``<path>.info.pt`` (NxD's trainer, ``trainer/checkpoint.py`` ``_save``) is a ``torch.save`` of
  ``{tid: {"dtype": torch.dtype, "shape": torch.Size, "expert_model_parallel": bool}}`` for every tensor: NxD's
  reader (``_xser_load_data``) indexes it for every reference, so a file without it cannot be read by NxD
  (``TypeError: 'NoneType' object is not subscriptable``). :func:`save_xser` writes it; :func:`load_xser` does not
  need it.

Loading reads the structure, then each referenced tensor file, and returns CPU tensors (or
tensors on ``map_location``). Saving one tensor per file keeps peak host memory at one tensor and
lets many ranks write in parallel.

Interop with torch-xla in both directions (tested in the XLA lane, ``tests/test_xla_interop.py``):

* files written here load with ``torch_xla.utils.serialization.load``: the structure file pickles each
  reference as ``torch_xla.utils.serialization.TensorReference(tid)`` (a GLOBAL + REDUCE: torch-xla's class,
  constructed with the id, exactly what torch-xla's own ``save`` leaves), written by :class:`_XserPickler`
  without importing torch-xla;
* files written by torch-xla (and by NxD, which may leave
  ``neuronx_distributed.trainer.checkpoint._InternalTensorReference`` in non-dict containers) load here:
  :func:`load_xser` maps those class names onto our :class:`TensorReference` with a custom unpickler, so
  torch-xla does not need to be installed. torch-xla's ``save`` keeps CPU tensors inline in the structure file
  (only XLA tensors become references); those load as they are.

A checkpoint is data, never code: every file is read with ``torch.load(weights_only=True)`` (torch's restricted
unpickler: containers, tensors, numbers, strings and the globals allowed by :data:`SAFE_GLOBALS`, i.e. our
:class:`TensorReference` under its own name and under torch-xla's and NxD's reference class names, so their
checkpoints keep loading without torch-xla). A file that names any other global (a ``__reduce__`` to ``os.system``,
an arbitrary class) is refused by the unpickler before the global is looked up, so nothing in it runs:
:class:`UnsafeCheckpointError` names the file and the global. NxD / torch-xla load these files with a full pickle;
a trusted legacy checkpoint with custom objects can still be read that way with
``exp_manager.checkpoint_weights_only: false`` (:func:`set_weights_only`; warned at start).
"""

from __future__ import annotations

import copy
import io
import logging
import os
import pickle
import re
import shutil
import threading
import types
import zipfile
from collections.abc import Callable
from typing import Any

import torch

__all__ = [
    "SAFE_GLOBALS",
    "TensorReference",
    "UnsafeCheckpointError",
    "compact_cpu",
    "fsync_dir",
    "info_file",
    "load_structure",
    "load_xser",
    "map_tensors",
    "save_xser",
    "set_weights_only",
    "tensor_file",
    "tensor_paths",
    "tensors_dir",
    "torch_save_file",
]

# (module, qualname) pairs written by other xser producers, loaded as our TensorReference.
_FOREIGN_REFERENCE_CLASSES = {
    ("torch_xla.utils.serialization", "TensorReference"),
    ("neuronx_distributed.trainer.checkpoint", "_InternalTensorReference"),
}


class TensorReference:
    """Placeholder for a tensor in an xser structure file.

    Attributes:
        tid: integer id; the tensor lives in ``<path>.tensors/tensor_<tid>.pt``.

    Instances carry only ``__dict__`` state (no ``__slots__``) so that a pickled torch-xla
    ``TensorReference`` (state ``{"tid": i}``) unpickles into this class unchanged.
    """

    def __init__(self, tid: int) -> None:
        self.tid = tid

    def __repr__(self) -> str:
        return f"TensorReference(tid={self.tid})"


#: The globals a checkpoint / cache file may name besides torch's own weights-only set: our reference class, and the
#: foreign reference classes mapped onto it (``(object, "module.qualname")``: torch's safe_globals form, torch >= 2.6).
SAFE_GLOBALS: list[Any] = [TensorReference] + [(TensorReference, f"{m}.{n}")
                                                for m, n in sorted(_FOREIGN_REFERENCE_CLASSES)]

_WEIGHTS_ONLY = [True]  # process-wide policy: exp_manager.checkpoint_weights_only (set once at start-up)
#: torch's ``safe_globals`` context manager adds its globals to a process-wide set on entry and removes them on exit,
#: so a thread leaving it took them away from another thread still loading (that load was refused: seen with one
#: thread per XLA device on the multi-device test bed); restricted loads take this lock.
_SAFE_LOAD_LOCK = threading.Lock()
log = logging.getLogger(__name__)


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A checkpoint, cache or adapter file the restricted unpickler refused: it names a global nxd_lc does not load
    (it would run code), or it is damaged (the unpickler stopped at an opcode or object it does not read).

    The message never advises turning the safe loader off (``exp_manager.checkpoint_weights_only: false``): a
    damaged file is damaged under any loader, and a file naming a foreign global was written by other code or
    tampered with; its fix is a good copy, or a re-save as tensors from a source the user trusts.

    Attributes:
        path: the file.
        refused: the global it names (``module.name``), or None when torch's message named none (the file is
            damaged, or not written by ``torch.save``).
    """

    def __init__(self, path: str, refused: str | None, detail: str) -> None:
        self.path, self.refused = path, refused
        if refused:
            text = (f"{path}: refused: the file holds the global {refused!r}, which nxd_lc does not load (a "
                    f"checkpoint is data, never code; nothing in the file was run). What nxd_lc and NxD write holds "
                    f"only tensors, numbers, strings and containers, so other code wrote this file or it was "
                    f"altered: restore it from a good copy, or load it where you trust it and re-save its state as "
                    f"tensors (torch.save(module.state_dict())). Detail: {detail}")
        else:
            text = (f"{path}: not a readable checkpoint: the file is damaged (truncated, overwritten or corrupted "
                    f"on disk) or was not written by torch.save; the restricted loader stopped at: {detail}; nothing "
                    f"in the file was run. Restore it from a good copy (a cache is recomputed when removed)")
        super().__init__(text)


def set_weights_only(enabled: bool) -> None:
    """``exp_manager.checkpoint_weights_only``: True (default) reads every file with the restricted unpickler; False
    allows full unpickling of trusted legacy files (logged as a warning). Called once at start-up."""
    _WEIGHTS_ONLY[0] = bool(enabled)
    if not enabled:
        log.warning("exp_manager.checkpoint_weights_only: false: checkpoint files are read with full unpickling, "
                    "which runs any code they contain; load only checkpoints you trust")


class _Scanned:
    """Stands for every global a pickle names while :func:`_declared_storages` scans it: never calls anything."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> _Scanned:
        return _Scanned()

    def __setstate__(self, state: Any) -> None:
        pass

    def __setitem__(self, key: Any, value: Any) -> None:
        pass

    def append(self, item: Any) -> None:
        pass

    def extend(self, items: Any) -> None:
        pass


class _BadStorage(ValueError):
    """A storage reference in a pickle that torch's loader must not be given."""


class _StorageScan(pickle.Unpickler):
    """Reads a zip-format ``data.pkl`` recording each storage's ``(key, declared bytes)``; every global is a
    :class:`_Scanned` stand-in, so no code is looked up or run."""

    def __init__(self, data: bytes) -> None:
        super().__init__(io.BytesIO(data))
        self.declared: dict[str, int] = {}

    def find_class(self, module: str, name: str) -> Any:
        return type(name, (_Scanned,), {})

    def persistent_load(self, pid: Any) -> Any:
        name = getattr(pid[1], "__name__", "") if isinstance(pid, tuple) and len(pid) == 5 else ""
        width = 1 if name == "UntypedStorage" else _STORAGE_WIDTH.get(name, 0)
        if width == 0 or type(pid[4]) is not int or pid[4] < 0:
            raise _BadStorage(f"a storage reference it cannot hold: {str(pid)[:120]}")
        self.declared[str(pid[2])] = pid[4] * width
        return _Scanned()


#: Bytes per element of torch's typed storage classes (as a pickle names them).
_STORAGE_WIDTH = {"DoubleStorage": 8, "FloatStorage": 4, "HalfStorage": 2, "BFloat16Storage": 2, "LongStorage": 8,
                  "IntStorage": 4, "ShortStorage": 2, "CharStorage": 1, "ByteStorage": 1, "BoolStorage": 1,
                  "ComplexDoubleStorage": 16, "ComplexFloatStorage": 8, "QInt8Storage": 1, "QUInt8Storage": 1,
                  "QInt32Storage": 4, "QUInt4x2Storage": 1, "QUInt2x4Storage": 1}


def check_stored_records(path: str) -> None:
    """Refuse a zip-format ``torch.save`` file whose records torch would over-allocate or over-read, before
    ``torch.load`` reads it (docs/robustness.md, "torch's restricted loader").

    ``torch.save`` stores every record uncompressed, and torch's reader bounds a stored record by the file's size;
    but it also inflates deflate-compressed records, allocating each one's declared uncompressed size first (a
    1 MB file inflates to 1 GiB, and a header may claim any size). And torch 2.9 builds each storage with the size
    the pickle declares over a buffer of the record's size, without comparing them (torch 2.13 compares): a 5 KB
    file gives a 4 TiB "tensor" over a 4 KB buffer, whose reads run past it. So: every record must be stored and no
    larger than the file, and every storage the pickle declares must have exactly its record's size. Cost: the zip
    directory and the pickle record are read once more (no tensor data); the scan runs no code. A file that is not a
    zip archive (torch's legacy format, or damaged) is left to torch's reader.

    Raises:
        ValueError: names the file and the record (or storage) and what is wrong with it.
    """
    try:
        with zipfile.ZipFile(path) as archive:
            records = archive.infolist()
            size = os.path.getsize(path)
            for rec in records:
                if rec.compress_type != zipfile.ZIP_STORED or rec.file_size > size:
                    raise ValueError(f"{path}: record {rec.filename[:200]!r} is compressed or claims {rec.file_size} "
                                     f"bytes uncompressed in a {size}-byte file; torch.save never writes such a "
                                     f"record, so the file was not written by torch.save (or was altered): refused "
                                     f"before reading it")
            pkl = [r for r in records if r.filename.endswith("/data.pkl") and r.filename.count("/") == 1]
            data = {r.filename.split("/", 1)[1][len("data/"):]: r.file_size for r in records
                    if r.filename.count("/") == 2 and r.filename.split("/")[1] == "data"}
            scan = _StorageScan(archive.read(pkl[0])) if len(pkl) == 1 else None
    except ValueError:
        raise
    except Exception:  # noqa: BLE001 - not a zip archive (or not one zipfile can read): torch reports it
        return
    if scan is None:
        return
    try:
        scan.load()
    except _BadStorage as e:
        raise ValueError(f"{path}: the pickle holds {e}; the file was altered or damaged: refused") from None
    except Exception:  # noqa: BLE001 - a pickle the scan cannot follow: torch's unpickler reports it (or refuses)
        return
    for key, nbytes in scan.declared.items():
        if data.get(key) != nbytes:
            raise ValueError(f"{path}: the pickle declares storage {key[:40]!r} of {nbytes} bytes but its record "
                             f"holds {data.get(key, 'no')} bytes; the file was altered or damaged: refused before "
                             f"torch reads past the record")


def safe_torch_load(path: str, map_location: Any = "cpu", mmap: bool = False) -> Any:
    """``torch.load`` of ``path`` with the restricted unpickler and :data:`SAFE_GLOBALS` (full unpickling only
    under ``set_weights_only(False)``), after :func:`check_stored_records`. Thread-safe: restricted loads of one
    process run one at a time (torch's allow-list is process-wide). ``mmap``: map the file's tensor data instead of
    reading it (for reading a file's keys; a file in torch's legacy format is read).

    Raises:
        UnsafeCheckpointError: the file names a global outside the allowed set (names the file and the global).
        ValueError: a zip record is compressed or larger than the file (:func:`check_stored_records`).
    """
    check_stored_records(path)
    mmap = mmap and zipfile.is_zipfile(path)
    if not _WEIGHTS_ONLY[0]:
        return torch.load(path, map_location=map_location, pickle_module=_xser_pickle_module, weights_only=False,
                          mmap=mmap)
    try:
        with _SAFE_LOAD_LOCK, torch.serialization.safe_globals(SAFE_GLOBALS):
            return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        text = str(e)
        if "Weights only load failed" not in text:
            raise
        found = re.search(r"GLOBAL ([\w.]+)", text) or re.search(r"global[: ]+'?([\w.]+)", text)
        detail = next((line.strip() for line in text.splitlines() if "Unsupported" in line or "GLOBAL" in line),
                      text.splitlines()[0])
        raise UnsafeCheckpointError(path, found.group(1) if found else None, detail) from None


#: How a reference is named in the structure files we write: torch-xla's own class (see the module docstring).
_XLA_REFERENCE_CLASS = ("torch_xla.utils.serialization", "TensorReference")


class _ForeignGlobal:
    """A class named by ``(module, qualname)`` that the saving process need not be able to import."""

    def __init__(self, module: str, name: str) -> None:
        self.module, self.name = module, name

    def __call__(self, *args: Any) -> Any:
        """Never called: exists because pickle's ``save_reduce`` requires a callable."""
        raise TypeError(f"{self.module}.{self.name} is a pickling placeholder, not a class")


_XLA_REFERENCE_GLOBAL = _ForeignGlobal(*_XLA_REFERENCE_CLASS)


class _XserPickler(pickle._Pickler):  # the pure-Python pickler: its dispatch table can name foreign classes
    """Pickler writing each :class:`TensorReference` as ``torch_xla.utils.serialization.TensorReference(tid)``.

    ``reducer_override`` turns a reference into the reduce tuple ``(torch-xla's class, (tid,))``; the class is a
    :class:`_ForeignGlobal`, written as a GLOBAL opcode (protocol < 4) or STACK_GLOBAL (protocol >= 4) without the
    import check the standard ``save_global`` makes. Everything else pickles as usual; used only for the
    (small) structure file, so the pure-Python speed is irrelevant.
    """

    dispatch = dict(pickle._Pickler.dispatch)

    def reducer_override(self, obj: Any) -> Any:
        if type(obj) is TensorReference:
            return _XLA_REFERENCE_GLOBAL, (obj.tid,)
        return NotImplemented

    def _save_foreign_global(self, obj: _ForeignGlobal) -> None:
        if self.proto >= 4:
            self.save(obj.module)
            self.save(obj.name)
            self.write(pickle.STACK_GLOBAL)
        else:
            self.write(pickle.GLOBAL + f"{obj.module}\n{obj.name}\n".encode())
        self.memoize(obj)

    dispatch[_ForeignGlobal] = _save_foreign_global


class _XserUnpickler(pickle.Unpickler):
    """Unpickler that resolves foreign xser reference classes to :class:`TensorReference`."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _FOREIGN_REFERENCE_CLASSES:
            return TensorReference
        return super().find_class(module, name)


def _pickle_load(file: Any, **kwargs: Any) -> Any:
    return _XserUnpickler(file, **kwargs).load()


# torch.load(pickle_module=...) needs a module-like object with ``Unpickler`` (zip format) and
# ``load`` (legacy format); everything else falls through to the standard pickle module.
_xser_pickle_module = types.ModuleType("nxd_lc_xser_pickle")
_xser_pickle_module.__dict__.update({k: v for k, v in vars(pickle).items() if not k.startswith("__")})
_xser_pickle_module.Unpickler = _XserUnpickler  # type: ignore[attr-defined]
_xser_pickle_module.load = _pickle_load  # type: ignore[attr-defined]
_xser_pickle_module.Pickler = _XserPickler  # type: ignore[attr-defined]


def tensors_dir(path: str) -> str:
    """Return the tensor directory of xser structure file ``path``: ``<path>.tensors``."""
    return path + ".tensors"


def info_file(path: str) -> str:
    """Return the tensor-info file NxD's xser reader indexes for structure file ``path``: ``<path>.info.pt``."""
    return path + ".info.pt"


def tensor_file(path: str, tid: int) -> str:
    """Return the file of tensor ``tid`` of xser structure file ``path``."""
    return os.path.join(tensors_dir(path), f"tensor_{tid}.pt")


def fsync_dir(path: str) -> None:
    """fsync directory ``path`` so that renames/creations inside it are durable.

    Filesystems that cannot fsync a directory (some network filesystems raise EINVAL) are
    tolerated: the call is then a no-op.
    """
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def torch_save_file(obj: Any, path: str, fsync: bool, pickle_module: Any = pickle) -> None:
    """``torch.save(obj, pickle_module=pickle_module)`` into ``path``, flushing and fsyncing when ``fsync``."""
    with open(path, "wb") as f:
        torch.save(obj, f, pickle_module=pickle_module)
        if fsync:
            f.flush()
            os.fsync(f.fileno())


def compact_cpu(t: torch.Tensor) -> torch.Tensor:
    """Return ``t`` detached, on CPU, contiguous and owning exactly its own storage.

    Views (``storage_offset != 0`` or a storage larger than the view), non-contiguous tensors and
    tensors with lazy conjugate/negative bits are cloned, so that ``torch.save`` writes only the
    tensor's own ``numel * element_size`` bytes. dtype and shape are preserved; ``nn.Parameter``
    becomes a plain tensor (``requires_grad`` is not saved). Non-strided layouts (sparse) are only
    detached and moved to CPU.
    """
    t = t.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    if t.layout != torch.strided:
        return t
    t = t.resolve_conj().resolve_neg()
    own_bytes = t.numel() * t.element_size()
    if (not t.is_contiguous() or t.storage_offset() != 0
            or t.untyped_storage().nbytes() != own_bytes):
        t = t.clone(memory_format=torch.contiguous_format)
    return t


def _transform(obj: Any, is_leaf: Callable[[Any], bool], key: Callable[[Any], Any],
               fn: Callable[[Any], Any]) -> Any:
    """Copy nested dict/list/tuple ``obj``, replacing leaves by ``fn(leaf)`` memoized on ``key``."""
    memo: dict[Any, Any] = {}

    def walk(x: Any) -> Any:
        if is_leaf(x):
            k = key(x)
            if k not in memo:
                memo[k] = fn(x)
            return memo[k]
        if isinstance(x, dict):
            out = copy.copy(x)
            for k, v in x.items():
                out[k] = walk(v)
            return out
        if isinstance(x, list):
            return [walk(v) for v in x]
        if isinstance(x, tuple):
            items = [walk(v) for v in x]
            return type(x)(*items) if hasattr(x, "_fields") else type(x)(items)
        return x

    return walk(obj)


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """Return a copy of the nested structure ``obj`` with every tensor ``t`` replaced by ``fn(t)``.

    Containers walked: ``dict`` and subclasses (``OrderedDict``, ``defaultdict``: the type and
    ``default_factory`` are kept), ``list``, ``tuple`` and named tuples. Other objects (including
    tensors inside sets or custom classes) are returned as they are. ``fn`` is called once per
    distinct tensor object, so a tensor referenced twice maps to one result object (tied weights
    stay tied). ``obj`` itself is not modified.
    """
    return _transform(obj, lambda x: isinstance(x, torch.Tensor), id, fn)


def tensor_paths(obj: Any, path: str = "") -> list[tuple[str, torch.Tensor]]:
    """``(dotted key path, tensor)`` of every tensor in nested dict / list / tuple ``obj`` (``a.b.0``; a bare tensor
    has the path ``""``), in traversal order; a tensor referenced twice appears twice."""
    if isinstance(obj, torch.Tensor):
        return [(path, obj)]
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, (list, tuple)) else ()
    out: list[tuple[str, torch.Tensor]] = []
    for key, value in items:
        out += tensor_paths(value, f"{path}.{key}" if path else str(key))
    return out


def save_xser(obj: Any, path: str, *, fsync: bool = False,
              expert_parallel: Callable[[str], bool] | None = None) -> None:
    """Save the nested structure ``obj`` in xser format at ``path``, with NxD's ``<path>.info.pt``.

    Args:
        obj: nested dict/list/tuple of tensors (any device, dtype, layout) and picklable values.
        path: structure file; tensors go to ``<path>.tensors/tensor_<i>.pt`` (an existing
            ``<path>.tensors`` directory is replaced), their dtype and shape to ``<path>.info.pt``.
        fsync: fsync every file and the directories written (for durable checkpoints).
        expert_parallel: given a tensor's dotted key path (``model.layers.0.mlp.experts.down_proj``), whether it
            is an expert-parallel tensor (``expert_model_parallel`` in the info file: NxD reads such tensors from
            each EP rank's own file and the others from EP rank 0's); None: none is.

    Each distinct tensor object is written once, as :func:`compact_cpu` of it (views and
    non-contiguous tensors become compact contiguous clones), and all references to it share one
    id. Tensors are written before the structure file. The save is not atomic by itself: crash
    safety comes from the staging directory in :mod:`nxd_lc.checkpoint.sharded`.

    Raises:
        FileNotFoundError: the parent directory of ``path`` does not exist.
    """
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise FileNotFoundError(f"xser save: directory {parent!r} for {path!r} does not exist; create it first")
    folder = tensors_dir(path)
    if os.path.isdir(folder):
        shutil.rmtree(folder)
    os.mkdir(folder)
    tensors: list[torch.Tensor] = []

    def to_ref(t: torch.Tensor) -> TensorReference:
        tensors.append(t)
        return TensorReference(len(tensors) - 1)

    ref_obj = map_tensors(obj, to_ref)
    keys: dict[int, str] = {}
    for key, t in tensor_paths(obj) if expert_parallel is not None else ():
        keys.setdefault(id(t), key)  # a shared tensor's first occurrence, as map_tensors numbers it
    info: dict[int, dict[str, Any]] = {}
    for tid, t in enumerate(tensors):
        torch_save_file(compact_cpu(t), tensor_file(path, tid), fsync)
        info[tid] = {"dtype": t.dtype, "shape": torch.Size(t.shape),
                     "expert_model_parallel": bool(expert_parallel(keys.get(id(t), ""))) if expert_parallel else False}
    torch_save_file(info, info_file(path), fsync)
    torch_save_file(ref_obj, path, fsync, pickle_module=_xser_pickle_module)
    if fsync:
        fsync_dir(folder)
        fsync_dir(parent)


def _load_tensor(path: str, tid: int, map_location: Any) -> torch.Tensor:
    fname = tensor_file(path, tid)
    if not os.path.isfile(fname):
        raise FileNotFoundError(
            f"xser tensor file {fname!r} referenced by {path!r} is missing: the checkpoint is "
            f"incomplete or {path!r} was copied without its '.tensors' directory")
    return safe_torch_load(fname, map_location)


def _resolve_refs(obj: Any, load: Callable[[int], torch.Tensor]) -> Any:
    """Replace every TensorReference in ``obj`` by ``load(tid)``; equal ids give one tensor."""
    return _transform(obj, lambda x: isinstance(x, TensorReference), lambda r: r.tid,
                      lambda r: load(r.tid))


def load_structure(path: str, *, mmap: bool = False) -> Any:
    """Load a torch.save'd file at ``path`` with the restricted unpickler, xser reference classes mapped to ours.

    Works for xser structure files (returns :class:`TensorReference` placeholders) and for plain
    ``torch.save`` files (returns CPU tensors).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        UnsafeCheckpointError: the file names a global outside :data:`SAFE_GLOBALS` (nothing in it was run).

    ``mmap``: the tensors of a plain file are memory-mapped (:func:`safe_torch_load`), for reading its keys.
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"checkpoint file {path!r} does not exist")
    return safe_torch_load(path, mmap=mmap)


def load_xser(path: str, map_location: Any = "cpu") -> Any:
    """Load a structure saved by :func:`save_xser`, torch-xla's ``xser.save`` or NxD's xser save.

    Args:
        path: the structure file (its tensors are under ``<path>.tensors/``).
        map_location: passed to ``torch.load`` for every tensor file (default CPU).

    Returns:
        The structure with each reference replaced by its tensor; references with the same id
        resolve to the same tensor object. dtype and shape are as saved.

    Raises:
        FileNotFoundError: ``path`` or a referenced tensor file is missing (message names it).
    """
    ref_obj = load_structure(path)
    return _resolve_refs(ref_obj, lambda tid: _load_tensor(path, tid, map_location))
