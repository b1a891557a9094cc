"""Data-file fuzzing (issue 32, item 7): byte-level mutations of every file kind a run reads, each read through the
entry point the run uses for it, starting from a small valid file.

Mutations (Hypothesis, seeded with ``derandomize``): truncation at any byte, bytes overwritten (random, or
boundary values such as 0xff.., 2**31, 2**63 - 1, biased towards the header) or inserted or deleted; for text
kinds also re-encoding (UTF-16 with and without a byte-order mark, UTF-32, Latin-1) and NUL / invalid UTF-8 bytes;
for JSON kinds a type swap (parse, replace the value at a random path by a value of another JSON type, or by
``NaN`` / ``1e999`` / a 5000-digit integer / 3000-deep nesting / a lone surrogate, dump).

The oracle, for every case: EITHER the read succeeds and gives what an independent reference reading of the
mutated file gives (a strict stdlib-json parser for JSON and text kinds; ``struct`` / ``numpy`` / ``zipfile``
parsers written here for binary kinds), OR it raises one error of the module's own kind (``ValueError``, or
``CheckpointIntegrityError`` / ``UnsafeCheckpointError`` where the module raises those; a damaged checkpoint or
reference cache is a warning and a fallback instead) whose message names the file. Anything else fails: another
exception type (TypeError, KeyError, IndexError, UnicodeDecodeError, RecursionError, struct.error, ...), a message
without the file, a different sample count without a word, or a read taking longer than :data:`DEADLINE_S`
(``signal.setitimer``; a case that hangs is stopped). Where the reference says the file is valid, the read must
also succeed (no false refusal). Memory is bounded by keeping every file below a few KB (an ``RLIMIT_AS`` cap
would need a subprocess per case, too slow here): a check that allocated from a damaged count would be slow
enough to hit the deadline.

Weaker oracles, where the format allows a mutation to change the content legally: Megatron ``.bin`` and the
packed-sample ``.npy`` have no checksum, so a changed token id or a changed row count is legal when the reference
reading of the mutated file gives the same; ``torch.save`` files (LoRA adapters, the DPO reference cache) carry a
CRC-32 per zip record that torch does not check, so a value changed inside a tensor record is accepted silently
(the test requires that exactly then the record's CRC no longer matches: documented in docs/robustness.md).

``NXD_LC_FUZZ_DATA_EXAMPLES`` multiplies the number of examples (default 1: ~30 s on a 2-core machine).
"""

from __future__ import annotations

import ast
import contextlib
import io
import json
import logging
import math
import os
import shutil
import signal
import struct
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.compat  # torch-2.9 compatibility subset (lane 2; docs/testing.md)

SCALE = float(os.environ.get("NXD_LC_FUZZ_DATA_EXAMPLES", "1"))
DEADLINE_S = 5.0


def _settings(examples: int) -> Callable[[Any], Any]:
    """Hypothesis settings of one fuzz test: ``examples`` x ``NXD_LC_FUZZ_DATA_EXAMPLES``, seeded, no database."""
    return settings(max_examples=max(1, round(examples * SCALE)), deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                           HealthCheck.data_too_large])


# ---- the oracle ----------------------------------------------------------------------------------------------------
class _Hang(BaseException):
    """Raised by the timer: a BaseException, so that no ``except Exception`` in the code under test swallows it."""


@contextlib.contextmanager
def _deadline(seconds: float = DEADLINE_S) -> Iterator[None]:
    """Stop the block with :class:`_Hang` after ``seconds`` (SIGALRM; main thread only)."""
    def fire(signum: int, frame: Any) -> None:
        raise _Hang(f"the read did not finish within {seconds} s (a hang, or work / memory without bound)")

    previous = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class Invalid(Exception):
    """The reference reading refuses the file (the reason is the message)."""


def _read(read: Callable[[], Any], names: list[str], errors: tuple[type[BaseException], ...] = (ValueError,)
          ) -> tuple[bool, Any]:
    """``(True, read())``, or ``(False, error)`` when ``read`` raises one of ``errors`` naming one of ``names``
    (paths or file names); any other exception, a message naming none of them, or a read past the deadline fails."""
    with _deadline():
        try:
            return True, read()
        except errors as e:
            message = str(e)
            assert any(n in message for n in names), (
                f"{type(e).__name__} does not name the file (any of {names}): {message[:600]}")
            return False, e


def _judge(ok: bool, got: Any, reference: Callable[[], Any], same: Callable[[Any, Any], None], *,
           exact: bool = True) -> None:
    """Compare the read with the reference reading: both succeed with the same content, or the read refused; with
    ``exact`` the reference covers every rule of the kind, so a file it accepts must also be read."""
    event("read ok" if ok else "read refused")
    try:
        expected = reference()
    except Invalid as why:
        assert not ok, f"the read accepted a file the reference refuses ({why}); it gave {str(got)[:300]}"
        return
    if not exact and not ok:
        return  # the reference checks the layout only (e.g. GGUF metadata semantics are the converter's)
    assert ok, f"the read refused a file the reference accepts: {got}"
    same(got, expected)


# ---- mutations -----------------------------------------------------------------------------------------------------
_BOUNDARY = [b"\x00", b"\xff", b"\x7f", b"\x80", b"\x00" * 8, b"\xff" * 8, struct.pack("<q", -1),
             struct.pack("<Q", 2**31), struct.pack("<Q", 2**32 + 1), struct.pack("<Q", 2**63 - 1),
             struct.pack("<i", -7), struct.pack("<I", 2**31 - 1), b"\xff\xff\xff\x7f"]


@st.composite
def byte_mutation(draw: Any, data: bytes, hot: int = 64) -> bytes:
    """``data`` truncated, overwritten, with bytes inserted or deleted; positions biased to the first ``hot``
    bytes (headers), sizes unchanged by an overwrite."""
    n = len(data)
    at = st.one_of(st.integers(0, max(0, min(hot, n) - 1)), st.integers(0, max(0, n - 1)))
    kind = draw(st.sampled_from(["truncate", "overwrite", "overwrite", "insert", "delete"]))
    if kind == "truncate":
        return data[:draw(st.integers(0, n - 1))]
    out = bytearray(data)
    if kind == "overwrite":
        for _ in range(draw(st.integers(1, 3))):
            pos = draw(at)
            chunk = draw(st.one_of(st.binary(min_size=1, max_size=4), st.sampled_from(_BOUNDARY)))[:n - pos]
            out[pos:pos + len(chunk)] = chunk
        return bytes(out)
    pos = draw(at)
    if kind == "insert":
        return bytes(out[:pos] + draw(st.one_of(st.binary(min_size=1, max_size=16), st.sampled_from(_BOUNDARY)))
                     + out[pos:])
    return bytes(out[:pos] + out[pos + draw(st.integers(1, 16)):])


class _Raw(str):
    """A JSON text put verbatim into a dumped document (NaN, 1e999, deep nesting ...)."""


_SWAP_VALUES: list[Any] = [None, True, False, 0, -1, 7, 2**40, 1.5, -0.0, "", "x", "\u00e9\u4e2d", [], [1, "a"], {},
                           {"a": [None]}, _Raw("NaN"), _Raw("-Infinity"), _Raw("1e999"), _Raw("9" * 5000),
                           _Raw("[" * 3000 + "]" * 3000), _Raw('"\\ud800"'), _Raw("1.0")]


def _paths(doc: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every path (keys / indices) to a value inside ``doc``, the root excluded."""
    out = []
    items = doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) else ()
    for k, v in items:
        out.append(prefix + (k,))
        out += _paths(v, prefix + (k,))
    return out


def _dump(doc: Any) -> bytes:
    """``json.dumps`` with each :class:`_Raw` value written verbatim."""
    raws: list[str] = []

    def mark(v: Any) -> Any:
        if isinstance(v, _Raw):
            raws.append(str(v))
            return f"\u0001RAW{len(raws) - 1}\u0001"
        if isinstance(v, dict):
            return {k: mark(x) for k, x in v.items()}
        if isinstance(v, list):
            return [mark(x) for x in v]
        return v

    text = json.dumps(mark(doc), ensure_ascii=False)
    for i, raw in enumerate(raws):
        text = text.replace(json.dumps(f"\u0001RAW{i}\u0001", ensure_ascii=False), raw)
    return text.encode()


@st.composite
def type_swap(draw: Any, doc: Any) -> bytes:
    """``doc`` with the value at one random path replaced by a value of another JSON type (or a key renamed)."""
    doc = json.loads(json.dumps(doc))
    paths = _paths(doc)
    if not paths:
        return _dump(draw(st.sampled_from(_SWAP_VALUES)))
    path = draw(st.sampled_from(paths))
    parent = doc
    for k in path[:-1]:
        parent = parent[k]
    old = parent[path[-1]]
    if isinstance(parent, dict) and draw(st.booleans()) and draw(st.booleans()):
        parent[draw(st.sampled_from(["", "x", path[-1] + "_", path[-1].upper()]))] = parent.pop(path[-1])
    else:
        parent[path[-1]] = draw(st.sampled_from([v for v in _SWAP_VALUES if type(v) is not type(old)]))
    return _dump(doc)


@st.composite
def text_mutation(draw: Any, data: bytes) -> bytes:
    """A byte mutation, a re-encoding of the whole text, or a NUL / invalid UTF-8 byte inserted."""
    kind = draw(st.sampled_from(["bytes", "bytes", "encoding", "insert"]))
    if kind == "bytes":
        return draw(byte_mutation(data))
    if kind == "encoding":
        text = data.decode("utf-8")
        encoding = draw(st.sampled_from(["utf-16", "utf-16-le", "utf-16-be", "utf-32", "latin-1", "cp1252"]))
        return text.encode(encoding, errors="replace")
    pos = draw(st.integers(0, len(data)))
    bad = draw(st.sampled_from([b"\0", b"\xe9", b"\xff\xfe", b"\xc3", b"\xed\xa0\x80", b"\r"]))
    return data[:pos] + bad + data[pos:]


# ---- strict JSON (the reference for every JSON and text kind) ------------------------------------------------------
def _refuse_constant(literal: str) -> Any:
    raise Invalid(f"{literal} is not JSON")


def _finite(literal: str) -> float:
    value = float(literal)
    if not math.isfinite(value):
        raise Invalid(f"{literal} overflows a float")
    return value


def strict_text(data: bytes, *, bom: bool = True) -> str:
    """RFC 3629 UTF-8 without NUL bytes (a UTF-8 byte-order mark dropped when ``bom``), else :class:`Invalid`."""
    if bom and data.startswith(b"\xef\xbb\xbf"):
        data = data[3:]
    if b"\0" in data:
        raise Invalid("a NUL byte")
    try:
        return data.decode("utf-8", errors="strict")
    except UnicodeDecodeError as e:
        raise Invalid(f"not UTF-8: {e}") from None


def strict_json(text: str) -> Any:
    """RFC 8259 JSON: no NaN / Infinity, finite numbers, integers Python converts, nesting the parser follows, no
    lone surrogate escapes."""
    try:
        value = json.loads(text, parse_constant=_refuse_constant, parse_float=_finite)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, an integer over sys.get_int_max_str_digits()
        raise Invalid(f"not JSON: {type(e).__name__}: {str(e)[:80]}") from None
    try:  # RFC 8259 8.2: a lone surrogate escape ("\ud800") is no Unicode character
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise Invalid("a lone UTF-16 surrogate escape") from None
    except RecursionError:
        raise Invalid("nesting the encoder cannot follow") from None
    return value


# ---- Megatron .idx / .bin ------------------------------------------------------------------------------------------
_MM_DOCS = [[1, 2, 3, 4, 5], [6, 7, 8], [9, 10, 11, 12, 13, 14, 15], [16, 17], [18, 19, 20, 21, 22, 23]]
_MM_VOCAB, _MM_SEQ = 100, 4
_MM_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 8: np.uint16}


@pytest.fixture(scope="module")
def megatron_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    from nxd_lc.data import megatron_indexed as mi

    prefix = str(tmp_path_factory.mktemp("mm") / "c")
    mi.write_indexed_dataset(prefix, _MM_DOCS, np.uint16)
    return {ext: Path(prefix + ext).read_bytes() for ext in (".idx", ".bin")}


def megatron_reference(idx: bytes, binary: bytes) -> list[list[int]]:
    """Rows ``[S + 1]`` of the training split (file order, splits 1,0,0) per the Megatron mmap format (layout in
    nxd_lc.data.megatron_indexed), read with struct / numpy; :class:`Invalid` for a file that breaks it."""
    if len(idx) < 34 or idx[:9] != b"MMIDIDX\x00\x00":
        raise Invalid("magic")
    version, code, count, ndocs = struct.unpack_from("<QBQQ", idx, 9)
    if version != 1 or code not in _MM_DTYPES:
        raise Invalid(f"version {version} / dtype code {code}")
    if len(idx) != 34 + 12 * count + 8 * ndocs:
        raise Invalid("size")
    dtype = np.dtype(_MM_DTYPES[code])
    sizes = np.frombuffer(idx, "<i4", count, 34).astype(np.int64)
    pointers = np.frombuffer(idx, "<i8", count, 34 + 4 * count)
    docs = np.frombuffer(idx, "<i8", ndocs, 34 + 12 * count)
    if ndocs == 0 or docs[0] != 0 or docs[-1] > count or (np.diff(docs) < 0).any():
        raise Invalid("document indices")
    stream: list[int] = []
    for s, p in zip(sizes.tolist(), pointers.tolist()):
        if s < 0 or p < 0 or p + s * dtype.itemsize > len(binary):
            raise Invalid("a sequence outside .bin")
        tokens = np.frombuffer(binary, dtype.newbyteorder("<"), s, p).tolist()
        if any(not 0 <= t < _MM_VOCAB for t in tokens):
            raise Invalid("a token id outside the vocabulary")
        stream += tokens
    n = (len(stream) - 1) // _MM_SEQ
    if n <= 0:
        raise Invalid("fewer tokens than one sample")
    return [stream[i * _MM_SEQ:i * _MM_SEQ + _MM_SEQ + 1] for i in range(n)]


@_settings(60)
@given(data=st.data())
def test_fuzz_megatron_indexed(megatron_files: dict[str, bytes], data: Any) -> None:
    """``build_datasets`` (what the data module calls for ``data.data_prefix``), then every sample read."""
    from nxd_lc.config.schema import DataConfig
    from nxd_lc.data.megatron_dataset import build_datasets

    ext = data.draw(st.sampled_from([".idx", ".idx", ".bin"]), label="file")
    files = dict(megatron_files)
    files[ext] = data.draw(byte_mutation(files[ext], hot=80), label="bytes")
    with tempfile.TemporaryDirectory() as tmp:
        prefix = os.path.join(tmp, "c")
        for e, b in files.items():
            Path(prefix + e).write_bytes(b)
        cfg = DataConfig(data_prefix=prefix, splits_string="1,0,0", shuffle=False,
                         index_mapping_dir=os.path.join(tmp, "maps")).resolved()

        def read() -> list[list[int]]:
            train, _ = build_datasets(cfg, seq_length=_MM_SEQ, seed=1, vocab_limit=_MM_VOCAB)
            return [train[i].tolist() for i in range(len(train))]

        ok, got = _read(read, [prefix])
    _judge(ok, got, lambda: megatron_reference(files[".idx"], files[".bin"]),
           lambda got, want: _equal(got, want, "samples"))


def _equal(got: Any, want: Any, what: str) -> None:
    assert got == want, f"the read gave other {what} than the reference reading: {str(got)[:300]} != {str(want)[:300]}"


# ---- the packed-sample cache (.npy) -------------------------------------------------------------------------------
_PACK_SEQ, _PACK_VOCAB = 16, 320


@pytest.fixture(scope="module")
def packed_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Callable[[], Any], Path, bytes]:
    """``(make a data module, the cache file it reads, the file's bytes)`` of a tiny pretraining run."""
    from nxd_lc.config.schema import DataConfig, TokenizerConfig
    from nxd_lc.data.datamodule import PretrainingDataModule
    from nxd_lc.data.tokenizer import train_bytelevel_bpe

    root = tmp_path_factory.mktemp("packed")
    train_bytelevel_bpe(["the quick brown fox jumps over the lazy dog"] * 20, 300).save_pretrained(root / "tok")
    (root / "corpus.jsonl").write_text("".join(json.dumps({"text": f"the quick brown fox {i} jumps over"}) + "\n"
                                               for i in range(12)))
    cfg = DataConfig(micro_batch_size=1, global_batch_size=1, train_dir=str(root / "corpus.jsonl"), val_fraction=0.0,
                     tokenizer=TokenizerConfig(type=str(root / "tok"), cache_dir=str(root / "cache")))

    def make() -> Any:
        return PretrainingDataModule(cfg, seq_length=_PACK_SEQ, seed=0, model_vocab_size=_PACK_VOCAB,
                                     data_parallel_rank=0, data_parallel_size=1, global_batch_size=1)

    make().setup("fit")
    (path,) = (root / "cache" / "packed").glob("*.npy")
    return make, path, path.read_bytes()


def npy_reference(data: bytes) -> list[list[int]]:
    """Rows of an ``.npy`` packed cache read with struct / ast (format: numpy ``lib/format.py`` docs): a 2-d array
    of little-endian int32 ``[N, S + 1]`` (C or Fortran order), ids in the vocabulary, the data filling the file."""
    if data[:6] != b"\x93NUMPY" or len(data) < 10 or data[6] not in (1, 2, 3):
        raise Invalid("magic / version")
    (hlen,), start = ((struct.unpack_from("<H", data, 8), 10) if data[6] == 1
                      else (struct.unpack_from("<I", data, 8), 12))
    try:
        header = ast.literal_eval(data[start:start + hlen].decode("latin-1" if data[6] < 3 else "utf-8"))
    except (ValueError, SyntaxError, UnicodeDecodeError, MemoryError, RecursionError) as e:
        raise Invalid(f"header: {e}") from None
    if not isinstance(header, dict) or set(header) != {"descr", "fortran_order", "shape"}:
        raise Invalid("header keys")
    shape, order = header["shape"], header["fortran_order"]
    if header["descr"] not in ("<i4",) or type(order) is not bool or not isinstance(shape, tuple) or len(shape) != 2:
        raise Invalid(f"descr / shape {header}")
    rows, width = shape
    if type(rows) is not int or type(width) is not int or width != _PACK_SEQ + 1 or rows < 0:
        raise Invalid(f"shape {shape}")
    offset = start + hlen
    if len(data) != offset + 4 * rows * width:
        raise Invalid(f"{len(data)} bytes for {shape} after a {offset}-byte header")
    arr = np.frombuffer(data, "<i4", rows * width, offset).reshape(shape, order="F" if order else "C")
    if arr.size and (arr.min() < 0 or arr.max() >= _PACK_VOCAB):
        raise Invalid("a token id outside the vocabulary")
    return arr.tolist()


@_settings(50)
@given(data=st.data())
def test_fuzz_packed_sample_cache(packed_run: tuple[Callable[[], Any], Path, bytes], data: Any) -> None:
    """The data module's setup over a mutated cache file (at the path the run computes), then every row read."""
    make, path, original = packed_run
    mutated = data.draw(byte_mutation(original, hot=128), label="bytes")
    path.write_bytes(mutated)
    try:
        def read() -> list[list[int]]:
            dm = make()
            dm.setup("fit")
            return [dm.train_dataset[i].tolist() for i in range(len(dm.train_dataset))]

        ok, got = _read(read, [str(path)])
    finally:
        path.write_bytes(original)
    _judge(ok, got, lambda: npy_reference(mutated), lambda got, want: _equal(got, want, "rows"))


# ---- GGUF ----------------------------------------------------------------------------------------------------------
_GG_V, _GG_H, _GG_I, _GG_HEADS = 16, 8, 16, 2
_GG_SHAPES = {"token_embd.weight": (_GG_V, _GG_H), "output_norm.weight": (_GG_H,), "blk.0.attn_norm.weight": (_GG_H,),
              "blk.0.ffn_norm.weight": (_GG_H,), "blk.0.attn_q.weight": (_GG_H, _GG_H),
              "blk.0.attn_k.weight": (_GG_H // _GG_HEADS, _GG_H), "blk.0.attn_v.weight": (_GG_H // _GG_HEADS, _GG_H),
              "blk.0.attn_output.weight": (_GG_H, _GG_H), "blk.0.ffn_gate.weight": (_GG_I, _GG_H),
              "blk.0.ffn_up.weight": (_GG_I, _GG_H), "blk.0.ffn_down.weight": (_GG_H, _GG_I)}


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """A complete 1-layer llama GGUF (F32 tensors, a GPT-2 style tokenizer), ~4.5 KB, made with gguf.GGUFWriter."""
    import gguf

    path = tmp_path_factory.mktemp("gguf") / "m.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(32)
    w.add_embedding_length(_GG_H)
    w.add_feed_forward_length(_GG_I)
    w.add_head_count(_GG_HEADS)
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([chr(ord("a") + i) for i in range(_GG_V - 2)] + ["ab", "cd"])
    w.add_token_types([1] * _GG_V)
    w.add_token_merges(["a b", "c d"])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    rng = np.random.default_rng(0)
    for name, shape in _GG_SHAPES.items():
        w.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path.read_bytes()


class _Cursor:
    """Reads little-endian GGUF fields from ``data``; :class:`Invalid` past the end or for a non-UTF-8 string."""

    def __init__(self, data: bytes) -> None:
        self.data, self.at = data, 0

    def take(self, fmt: str) -> Any:
        n = struct.calcsize("<" + fmt)
        if self.at + n > len(self.data):
            raise Invalid("past the end")
        (value,) = struct.unpack_from("<" + fmt, self.data, self.at)
        self.at += n
        return value

    def string(self) -> str:
        n = self.take("Q")
        if n > len(self.data) - self.at:
            raise Invalid("a string past the end")
        raw = self.data[self.at:self.at + n]
        self.at += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise Invalid("a string that is not UTF-8") from None

    def value(self, vtype: int, depth: int = 0) -> Any:
        formats = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
        if vtype in formats:
            return self.take(formats[vtype])
        if vtype == 8:
            return self.string()
        if vtype != 9 or depth > 7:
            raise Invalid(f"value type {vtype}")
        itype, count = self.take("I"), self.take("Q")
        if count > len(self.data) - self.at:
            raise Invalid("an array past the end")
        return [self.value(itype, depth + 1) for _ in range(count)]


def gguf_reference(data: bytes) -> dict[str, np.ndarray]:
    """The F32 tensors of a GGUF file (GGUF spec, ggml docs/gguf.md) read with struct, by GGUF name;
    :class:`Invalid` for a file that breaks the layout or is not a complete llama file of F32 tensors."""
    c = _Cursor(data)
    if data[:4] != b"GGUF":
        raise Invalid("magic")
    c.at = 4
    if c.take("I") not in (2, 3):
        raise Invalid("version")
    tensor_count, kv_count = c.take("Q"), c.take("Q")
    if kv_count * 13 + tensor_count * 24 > len(data):
        raise Invalid("counts")
    meta = {}
    for _ in range(kv_count):
        key = c.string()
        meta[key] = c.value(c.take("I"))
    infos = []
    for _ in range(tensor_count):
        name, n_dims = c.string(), c.take("I")
        if not 1 <= n_dims <= 4:
            raise Invalid("n_dims")
        dims = [c.take("Q") for _ in range(n_dims)]
        infos.append((name, dims, c.take("I"), c.take("Q")))
    alignment = meta.get("general.alignment", 32)
    start = -(-c.at // alignment) * alignment
    out = {}
    for name, dims, ggml_type, offset in infos:
        if ggml_type != 0 or name in out:
            raise Invalid(f"tensor {name}: type {ggml_type} (the reference reads F32 only) or a duplicate")
        n = math.prod(dims)
        if start + offset + 4 * n > len(data):
            raise Invalid(f"tensor {name} past the end")
        out[name] = np.frombuffer(data, "<f4", n, start + offset).reshape(dims[::-1])
    if meta.get("general.architecture") != "llama" or set(out) != set(_GG_SHAPES) or any(
            out[k].shape != s for k, s in _GG_SHAPES.items()):
        raise Invalid("not the complete 1-layer llama file of this test")
    return out


def _same_gguf_weights(got: dict[str, torch.Tensor], want: dict[str, np.ndarray]) -> None:
    from nxd_lc.models.llama.gguf_import import _hf_name

    assert len(got) == len(want), f"{len(got)} converted tensors, the file holds {len(want)}"
    for name, values in want.items():
        hf = got[_hf_name(name, 1)]
        if name.endswith(("attn_q.weight", "attn_k.weight")):  # rows reordered (unpermute_qk): same rows as a set
            rows = [np.ascontiguousarray(a, np.float32).view(np.uint32) for a in (hf.numpy(), values)]  # NaN == NaN
            assert sorted(map(tuple, rows[0].tolist())) == sorted(map(tuple, rows[1].tolist())), name
        else:
            assert np.array_equal(hf.numpy(), values, equal_nan=True), name


@_settings(60)
@given(data=st.data())
def test_fuzz_gguf(gguf_file: bytes, data: Any) -> None:
    """``convert_gguf_to_hf`` (check, gguf reader, config, weights, tokenizer) of a mutated GGUF file."""
    from safetensors.torch import load_file

    from nxd_lc.models.llama.gguf_import import convert_gguf_to_hf

    mutated = data.draw(byte_mutation(gguf_file, hot=1200), label="bytes")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "m.gguf"
        path.write_bytes(mutated)
        ok, got = _read(lambda: load_file(str(convert_gguf_to_hf(path, Path(tmp) / "hf") / "model.safetensors")),
                        [str(path)])
    _judge(ok, got, lambda: gguf_reference(mutated), _same_gguf_weights, exact=False)


# ---- safetensors files and their index ----------------------------------------------------------------------------
def _tiny_llama(vocab: int = 64) -> Any:
    from transformers import LlamaConfig

    from nxd_lc.models.llama.model import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                        tie_word_embeddings=False))


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    """The files of a sharded HF checkpoint of a tiny Llama: two or more safetensors shards and their index."""
    from nxd_lc.models.llama.hf_adapter import save_hf_weights

    path = tmp_path_factory.mktemp("hf") / "ckpt"
    save_hf_weights(_tiny_llama(), path, max_shard_bytes=16 << 10)
    return {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.name != "config.json"}


_ST_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}


def safetensors_reference(files: dict[str, bytes]) -> dict[str, torch.Tensor]:
    """Every tensor the index names, read from its shard with struct / json (safetensors format: 8-byte length,
    JSON header, data; tensors contiguous from 0 to the end, no overlap); :class:`Invalid` otherwise."""
    index = strict_json(strict_text(files["model.safetensors.index.json"], bom=False))
    if not isinstance(index, dict) or not isinstance(index.get("weight_map"), dict):
        raise Invalid("index shape")
    out = {}
    for name, shard in index["weight_map"].items():
        if not isinstance(shard, str) or shard not in files or shard.endswith(".json"):
            raise Invalid(f"index entry {name} -> {shard!r}")
        data = files[shard]
        if len(data) < 8:
            raise Invalid("short file")
        (n,) = struct.unpack_from("<Q", data)
        if n > len(data) - 8:
            raise Invalid("header length")
        header = strict_json(strict_text(data[8:8 + n], bom=False))
        if not isinstance(header, dict):
            raise Invalid("header type")
        header.pop("__metadata__", None)
        offsets = [v.get("data_offsets") if isinstance(v, dict) else None for v in header.values()]
        if not all(isinstance(o, list) and len(o) == 2 and all(type(x) is int for x in o) for o in offsets):
            raise Invalid("data_offsets not two integers")
        spans = sorted(tuple(o) for o in offsets)
        if [e for _, e in spans[:-1]] != [b for b, _ in spans[1:]] or not spans or spans[0][0] != 0 or \
                spans[-1][1] != len(data) - 8 - n or len(spans) != len(header):
            raise Invalid("tensors not contiguous over the data")
        info = header.get(name)
        if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"} or \
                info["dtype"] not in _ST_DTYPES or not isinstance(info["shape"], list) or \
                not all(type(d) is int and d >= 0 for d in info["shape"]) or \
                not all(type(o) is int for o in info["data_offsets"]):
            raise Invalid(f"tensor {name}: {str(info)[:80]}")
        dtype = _ST_DTYPES[info["dtype"]]
        begin, end = info["data_offsets"]
        count = math.prod(info["shape"])
        if end - begin != count * dtype.itemsize:
            raise Invalid(f"tensor {name}: size")
        raw = bytearray(data[8 + n + begin:8 + n + end])
        out[name] = torch.frombuffer(raw, dtype=dtype, count=count).reshape(info["shape"]) if count else \
            torch.zeros(info["shape"], dtype=dtype)
    expected = {k: tuple(v.shape) for k, v in _tiny_llama().state_dict().items()}
    return out if _hf_shapes_fit(out, expected) else _raise(Invalid("the tensors do not fit the model"))


def _raise(e: BaseException) -> Any:
    raise e


def _hf_shapes_fit(tensors: dict[str, torch.Tensor], params: dict[str, tuple[int, ...]]) -> bool:
    from nxd_lc.models.llama.hf_adapter import export_hf_state_dict

    wanted = {k: tuple(v.shape) for k, v in export_hf_state_dict(_tiny_llama()).items()}
    return {k: tuple(v.shape) for k, v in tensors.items() if k in wanted} == wanted


@_settings(60)
@given(data=st.data())
def test_fuzz_hf_safetensors_checkpoint(hf_checkpoint: dict[str, bytes], data: Any) -> None:
    """``load_hf_weights`` (model.hf_weights_dir) of a sharded checkpoint with one file mutated: a shard's bytes,
    or the index (bytes or a JSON type swap)."""
    from nxd_lc.models.llama.hf_adapter import export_hf_state_dict, load_hf_weights

    files = dict(hf_checkpoint)
    name = data.draw(st.sampled_from(sorted(files)), label="file")
    if name.endswith(".json") and data.draw(st.booleans(), label="type swap"):
        files[name] = data.draw(type_swap(json.loads(files[name])), label="json")
    else:
        files[name] = data.draw(byte_mutation(files[name], hot=400), label="bytes")
    with tempfile.TemporaryDirectory() as tmp:
        for n, b in files.items():
            Path(tmp, n).write_bytes(b)
        model = _tiny_llama()

        def read() -> dict[str, torch.Tensor]:
            load_hf_weights(model, tmp)
            return export_hf_state_dict(model)

        ok, got = _read(read, [os.path.join(tmp, name), tmp])

    def same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
        for k, v in got.items():
            w = want[k].to(v.dtype)  # a byte edit in the data may make a NaN: NaN == NaN here, bit for bit
            assert v.shape == w.shape and torch.equal(v.isnan(), w.isnan()) and \
                torch.equal(v.nan_to_num(0.0), w.nan_to_num(0.0)), f"tensor {k} differs from the file's"

    _judge(ok, got, lambda: safetensors_reference(files), same)


# ---- torch.save files: the zip records (LoRA adapters, the DPO reference cache) -----------------------------------
def zip_crc_problem(data: bytes) -> str | None:
    """Why the zip archive ``data`` fails its own CRC-32 / structure check (zipfile), or None when it passes."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            bad = archive.testzip()
    except Exception as e:  # noqa: BLE001 - any failure of the stdlib reader is the answer
        return f"{type(e).__name__}: {e}"
    return f"record {bad} fails its CRC-32" if bad else None


def _same_or_crc(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], mutated: bytes, what: str) -> None:
    """Same names, shapes and dtypes as the original; values may differ only where the zip CRC-32 (which torch does
    not check) no longer matches."""
    assert {k: (tuple(v.shape), v.dtype) for k, v in got.items()} == \
        {k: (tuple(v.shape), v.dtype) for k, v in want.items()}, f"{what}: other tensors than the file's"
    if any(not torch.equal(got[k], want[k]) for k in want):
        event("values changed inside a tensor record (zip CRC-32 not checked by torch)")
        assert zip_crc_problem(mutated), f"{what}: values changed although every zip record passes its CRC-32"


@pytest.fixture(scope="module")
def lora_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, dict[str, bytes], dict[str, torch.Tensor]]:
    """``(peft settings, {adapters.pt, adapter_config.json}: bytes, the saved adapter tensors)``."""
    from nxd_lc.alignment.lora_files import save_adapters
    from nxd_lc.config.peft_schema import PeftConfig
    from nxd_lc.layers.lora import apply_lora, lora_state_dict

    peft = PeftConfig(lora_rank=2, lora_alpha=4.0, lora_dropout=0.0, target_modules=["qkv_proj"],
                      save_lora_config_adapter=False)
    model = _tiny_llama()
    apply_lora(model, peft)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5)
    path = save_adapters(model, peft, str(tmp_path_factory.mktemp("lora") / "lora"), is_rank0=True)
    folder = Path(path).parent
    files = {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}
    return peft, files, {k: v.detach().clone() for k, v in lora_state_dict(model).items()}


@_settings(50)
@given(data=st.data())
def test_fuzz_lora_adapters(lora_files: tuple[Any, dict[str, bytes], dict[str, torch.Tensor]], data: Any) -> None:
    """``load_adapters`` (model_alignment_strategy.peft.lora_ckpt_path) with adapters.pt or adapter_config.json
    mutated (bytes; the JSON also by type swaps)."""
    from nxd_lc.alignment.lora_files import load_adapters
    from nxd_lc.checkpoint.xser import UnsafeCheckpointError
    from nxd_lc.layers.lora import apply_lora, lora_state_dict

    peft, original, saved = lora_files
    files = dict(original)
    name = data.draw(st.sampled_from(sorted(files)), label="file")
    if name.endswith(".json") and data.draw(st.booleans(), label="type swap"):
        files[name] = data.draw(type_swap(json.loads(files[name])), label="json")
    else:
        files[name] = data.draw(byte_mutation(files[name], hot=200) if name.endswith(".json") else
                                byte_mutation(files[name], hot=700), label="bytes")
    model = _tiny_llama()
    apply_lora(model, peft)
    before = {k: v.detach().clone() for k, v in lora_state_dict(model).items()}
    with tempfile.TemporaryDirectory() as tmp:
        for n, b in files.items():
            Path(tmp, n).write_bytes(b)
        path = os.path.join(tmp, "adapters.pt")

        def read() -> dict[str, torch.Tensor]:
            load_adapters(model, peft, path)
            return {k: v.detach().clone() for k, v in lora_state_dict(model).items()}

        ok, got = _read(read, [os.path.join(tmp, name)], (ValueError, UnsafeCheckpointError))
    if not ok:
        after = lora_state_dict(model)
        assert all(torch.equal(after[k], v) for k, v in before.items()), "a refused file was half loaded"
        return
    if name.endswith(".json"):  # accepted settings must be this run's (strict JSON, same rank / alpha / targets)
        doc = strict_json(strict_text(files[name]))
        assert isinstance(doc, dict) and doc.get("lora_rank") == 2 and doc.get("lora_alpha") == 4.0 and \
            sorted(doc.get("target_modules", [])) == ["qkv_proj"], f"settings accepted: {doc}"
        assert all(torch.equal(got[k], v) for k, v in saved.items())
    else:
        _same_or_crc(got, saved, files[name], "adapters.pt")


_REF_SIZES = {"train": 6, "val": 4}


@pytest.fixture(scope="module")
def reference_cache(tmp_path_factory: pytest.TempPathFactory) -> tuple[bytes, dict[str, torch.Tensor]]:
    from nxd_lc.alignment.reference import save_reference_tables

    g = torch.Generator().manual_seed(0)
    tables = {k: torch.stack([-torch.rand(n, generator=g) * 50, torch.randint(1, 40, (n,), generator=g).float(),
                              -torch.rand(n, generator=g) * 50, torch.randint(1, 40, (n,), generator=g).float()], 1)
              for k, n in _REF_SIZES.items()}
    path = tmp_path_factory.mktemp("ref") / "train.jsonl.ref_logps-key.pt"
    assert save_reference_tables(str(path), "key", tables)
    return path.read_bytes(), tables


@_settings(50)
@given(data=st.data())
def test_fuzz_dpo_reference_cache(reference_cache: tuple[bytes, dict[str, torch.Tensor]], data: Any,
                                  caplog: pytest.LogCaptureFixture) -> None:
    """``load_reference_tables`` (precompute_ref_log_probs): the tables, or None (recomputed) with one warning
    naming the file; never an error, never tables other than the saved ones' shapes."""
    from nxd_lc.alignment.reference import load_reference_tables
    from nxd_lc.checkpoint.xser import UnsafeCheckpointError

    original, tables = reference_cache
    mutated = data.draw(byte_mutation(original, hot=700), label="bytes")
    caplog.clear()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "train.jsonl.ref_logps-key.pt")
        Path(path).write_bytes(mutated)
        with caplog.at_level(logging.WARNING, logger="nxd_lc.alignment.reference"):
            ok, got = _read(lambda: load_reference_tables(path, "key", _REF_SIZES, torch.device("cpu")), [path],
                            (UnsafeCheckpointError,))
    if not ok:
        return  # a global planted in the pickle: refused naming the file (nothing run)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    if got is None:
        assert len(warnings) == 1 and path in warnings[0], f"not one warning naming the file: {warnings}"
        return
    assert not warnings, warnings
    _same_or_crc(got, tables, mutated, "reference cache")


# ---- checkpoint directories (manifest, done record, shards) -------------------------------------------------------
def _ckpt_state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {"model_state": {"w": torch.randn(4, 3, generator=g)},
            "optim_state": {"state": {0: {"exp_avg": torch.randn(4, 3, generator=g)}}, "param_groups": [{"lr": 0.1}]},
            "user_content": {"global_step": step}}


@pytest.fixture(scope="module")
def checkpoint_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Any]:
    """``(pristine run directory, work directory, config)``: two complete checkpoints (step=2, step=4), xser format
    with manifests; the config resumes from the work directory (a fresh copy of the pristine one per case)."""
    from omegaconf import OmegaConf

    from nxd_lc.checkpoint import sharded
    from nxd_lc.config.schema import NxdConfig

    top = tmp_path_factory.mktemp("ckpt")
    root, work = top / "run", top / "work"
    for step in (2, 4):
        sharded.save_checkpoint(str(root / "checkpoints"), f"step={step}", **_ckpt_state(step), dp_rank=0, tp_rank=0,
                                pp_rank=0, is_global_zero=True, write_model=True, write_optim=True, use_xser=True)
    base = OmegaConf.structured(NxdConfig)
    base.exp_manager = OmegaConf.merge(base.exp_manager, {"explicit_log_dir": str(work)})
    return root, work, OmegaConf.to_object(base)


def _equal_states(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal_states(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_equal_states(x, y) for x, y in zip(a, b))
    return bool(a == b)


@_settings(40)
@given(data=st.data())
def test_fuzz_checkpoint_resume(checkpoint_run: tuple[Path, Path, Any], data: Any,
                                caplog: pytest.LogCaptureFixture) -> None:
    """``resume_plan`` + ``load_checkpoint`` (exp_manager.resume_if_exists) with one file of the newest checkpoint
    mutated (the manifest mostly, by bytes or JSON type swaps): the newest is loaded and equal to what was saved,
    or it is skipped with one warning naming a file of it and the previous checkpoint is taken."""
    from nxd_lc.checkpoint import sharded
    from nxd_lc.lightning import exp_manager

    pristine, run, cfg = checkpoint_run
    newest_files = sorted(str(p.relative_to(pristine / "checkpoints" / "step=4"))
                          for p in (pristine / "checkpoints" / "step=4").rglob("*") if p.is_file())
    rel = data.draw(st.one_of(st.just("manifest.json"), st.sampled_from(newest_files)), label="file")
    caplog.clear()
    shutil.rmtree(run, ignore_errors=True)
    shutil.copytree(pristine, run)
    target = run / "checkpoints" / "step=4" / rel
    raw = target.read_bytes()
    if rel.endswith(".json") and data.draw(st.booleans(), label="type swap"):
        target.write_bytes(data.draw(type_swap(json.loads(raw)), label="json"))
    else:
        target.write_bytes(data.draw(byte_mutation(raw, hot=400), label="bytes"))
    paths = exp_manager.experiment_paths(cfg)
    with caplog.at_level(logging.WARNING, logger="nxd_lc.lightning.exp_manager"):
        ok, plan = _read(lambda: exp_manager.resume_plan(cfg, paths), [str(target)])
    assert ok, f"resume_plan refused: {plan}"
    chosen = plan[0]
    skipped = [r.getMessage() for r in caplog.records if "skipping checkpoint" in r.getMessage()]
    newest = os.path.join(paths.checkpoint_dir, "step=4")
    if chosen == newest:
        assert not skipped, skipped
        state = sharded.load_checkpoint(paths.checkpoint_dir, "step=4", dp_rank=0, tp_rank=0, pp_rank=0)
        want = _ckpt_state(4)
        assert _equal_states(list(state), [want["model_state"], want["optim_state"], want["user_content"]]), \
            "the newest checkpoint loads with other contents than were saved"
        event("newest loaded")
    else:
        assert chosen == os.path.join(paths.checkpoint_dir, "step=2"), plan
        if rel == sharded.DONE_FILE:  # done only orders the checkpoints: a changed step may reorder them
            event("done record reordered")
            return
        assert len(skipped) == 1 and newest in skipped[0], f"not one warning naming the newest: {skipped}"
        event("fell back")


# ---- text and JSON files: pretraining jsonl / txt, alignment jsonl, config.json, tokenizer files --------------------
@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from nxd_lc.data.tokenizer import train_bytelevel_bpe

    path = tmp_path_factory.mktemp("tok") / "tok"
    texts = ["the quick brown fox jumps over the lazy dog, caf\u00e9 \u4e2d"] * 20
    train_bytelevel_bpe(texts, 300).save_pretrained(path)
    return path


_PRETRAIN_JSONL = "".join(json.dumps({"text": t, "id": i}, ensure_ascii=i % 2 == 0) + "\n" for i, t in enumerate(
    ["the quick brown fox", "caf\u00e9 au lait", "", "\u4e2d\u6587 text", "jumps over\nthe lazy dog"])).encode()


def pretrain_jsonl_reference(data: bytes) -> list[str]:
    """The non-empty ``text`` values of a jsonl file, one strict JSON object per non-blank line."""
    docs = []
    for line in strict_text(data).split("\n"):
        if line.strip():
            obj = strict_json(line)
            if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
                raise Invalid("a line that is not an object with a string 'text'")
            if obj["text"]:
                docs.append(obj["text"])
    if not docs:
        raise Invalid("no document")
    return docs


def _tokenizer(path: Path) -> Any:
    from nxd_lc.config.schema import TokenizerConfig
    from nxd_lc.data.tokenizer import load_tokenizer

    return load_tokenizer(TokenizerConfig(type=str(path)), None)


def _swap_one_line(data: Any, jsonl: bytes) -> bytes:
    """``jsonl`` with one drawn line's record replaced by a :func:`type_swap` of it."""
    records = [json.loads(x) for x in jsonl.decode().splitlines()]
    at = data.draw(st.integers(0, len(records) - 1), label="line")
    out = [_dump(r) for r in records]
    out[at] = data.draw(type_swap(records[at]), label="record")
    return b"\n".join(out) + b"\n"


@_settings(80)
@given(data=st.data())
def test_fuzz_pretraining_jsonl(tokenizer_dir: Path, data: Any) -> None:
    """``iter_documents(resolve_source(data.train_dir))`` and the run's tokenization of every document."""
    from nxd_lc.data.packing import tokenize_documents
    from nxd_lc.data.sources import iter_documents, resolve_source

    kind = data.draw(st.sampled_from(["text", "text", "swap"]), label="kind")
    if kind == "swap":
        mutated = _swap_one_line(data, _PRETRAIN_JSONL)
    else:
        mutated = data.draw(text_mutation(_PRETRAIN_JSONL), label="bytes")
    tok = _tokenizer(tokenizer_dir)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "corpus.jsonl")
        Path(path).write_bytes(mutated)

        def read() -> list[str]:
            docs = list(iter_documents(resolve_source(path, key_name="data.train_dir")))
            assert len(list(tokenize_documents(docs, tok))) == len(docs)
            return docs

        ok, got = _read(read, [path])
    _judge(ok, got, lambda: pretrain_jsonl_reference(mutated), lambda got, want: _equal(got, want, "documents"))


_SFT_JSONL = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in [
    {"input": "what is a fox?", "output": "an animal"},
    {"messages": [{"role": "user", "content": "caf\u00e9?"}, {"role": "assistant", "content": "oui"}]},
    {"input": "\u4e2d", "output": "chinese"}]).encode()


def records_reference(data: bytes) -> int:
    """Number of records of an alignment jsonl file: strict JSON objects, one per non-blank line."""
    count = 0
    for line in strict_text(data).split("\n"):
        if line.strip():
            if not isinstance(strict_json(line), dict):
                raise Invalid("a line that is not an object")
            count += 1
    if not count:
        raise Invalid("no records")
    return count


@_settings(80)
@given(data=st.data())
def test_fuzz_alignment_jsonl(tokenizer_dir: Path, data: Any) -> None:
    """``read_records`` (SFT / DPO data.train_dir) and the formatter's encoding of every record: the record count
    of the reference, or one error naming the file (a record of wrong types names the file and line)."""
    from nxd_lc.data.alignment_datamodule import read_records
    from nxd_lc.data.alignment_format import RecordFormatter

    if data.draw(st.booleans(), label="type swap"):
        mutated = _swap_one_line(data, _SFT_JSONL)
    else:
        mutated = data.draw(text_mutation(_SFT_JSONL), label="bytes")
    fmt = RecordFormatter(_tokenizer(tokenizer_dir), chat_template=None)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "sft.jsonl")
        Path(path).write_bytes(mutated)

        def read() -> int:
            records = read_records(path, "data.train_dir")
            for record, where in records:
                fmt.encode_sft(record, where)
            return len(records)

        ok, got = _read(read, [path])
    try:
        count = records_reference(mutated)
    except Invalid as why:
        assert not ok, f"the read accepted a file the reference refuses ({why})"
        return
    assert not ok or got == count, f"{got} records read, the reference reads {count}"


_CONFIG = Path(__file__).resolve().parents[1] / "conf" / "tiny_llama_config.json"
_CONFIG_INTS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "max_position_embeddings")


@_settings(80)
@given(data=st.data())
def test_fuzz_config_json(data: Any) -> None:
    """``build_llama_config`` (model.model_config): the sizes the reference reads, or one error naming the file."""
    from nxd_lc.models.hf_config import build_llama_config

    original = _CONFIG.read_bytes()
    mutated = (data.draw(type_swap(json.loads(original)), label="json") if data.draw(st.booleans(), label="swap")
               else data.draw(text_mutation(original), label="bytes"))
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "config.json")
        Path(path).write_bytes(mutated)
        ok, got = _read(lambda: build_llama_config(path), [path])
    if not ok:
        return  # a refusal naming the file is allowed (the schema's own rules decide beyond strict JSON)
    doc = strict_json(strict_text(mutated))  # Invalid here: the read accepted a file that is not strict JSON
    assert isinstance(doc, dict)
    for key in _CONFIG_INTS:  # a key left out takes the HF default; num_key_value_heads null: num_attention_heads
        if key not in doc:
            continue
        want = doc[key] if doc[key] is not None or key != "num_key_value_heads" else doc.get("num_attention_heads")
        assert type(want) is int and getattr(got, key) == want, f"{key}: {getattr(got, key, None)} accepted for " \
                                                                f"the file's {doc[key]!r}"


@_settings(60)
@given(data=st.data())
def test_fuzz_tokenizer_files(tokenizer_dir: Path, data: Any) -> None:
    """``load_tokenizer`` (data.tokenizer.type = a directory) with one of its files mutated: a tokenizer whose
    ids fit its vocabulary, each JSON file strict JSON, or one error naming the file."""
    files = {p.name: p.read_bytes() for p in tokenizer_dir.iterdir() if p.is_file()}
    name = data.draw(st.sampled_from(sorted(files)), label="file")
    if name.endswith(".json") and data.draw(st.booleans(), label="swap"):
        files[name] = data.draw(type_swap(json.loads(files[name])), label="json")
    else:
        files[name] = data.draw(text_mutation(files[name]), label="bytes")
    with tempfile.TemporaryDirectory() as tmp:
        for n, b in files.items():
            Path(tmp, n).write_bytes(b)

        def read() -> list[int]:
            tok = _tokenizer(Path(tmp))
            ids = tok("the quick caf\u00e9 \u4e2d")["input_ids"]
            assert all(0 <= i < len(tok) for i in ids), ids
            return ids

        ok, _ = _read(read, [os.path.join(tmp, name)])
    if ok and name.endswith(".json"):
        strict_json(strict_text(files[name]))  # Invalid: the read accepted a JSON file that is not strict JSON
