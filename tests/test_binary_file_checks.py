"""Binary files a run reads, damaged or foreign (issue 32, item 4 for binary formats, and item 5): Megatron
``.idx`` / ``.bin`` and their sample-index cache, the packed-sample cache, GGUF, safetensors files and their index,
and the HF conversion cache. Each damaged file gives one ValueError naming the file (and the sequence, field, tensor
or entry) and the fix, with bounded work; a cache that does not fit the data is rebuilt (sample index, HF
conversion) or refused naming the file (packed samples). docs/robustness.md lists the cases."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from nxd_lc.config.schema import DataConfig, TokenizerConfig
from nxd_lc.data import megatron_indexed as mi
from nxd_lc.data.megatron_dataset import GPTSamples, build_datasets

pytestmark = pytest.mark.compat  # torch-2.9 compatibility subset (lane 2; docs/testing.md)


# ---- Megatron .idx / .bin ----------------------------------------------------------------------------------------
def _idx(tmp_path: Path, sizes: list[int], pointers: list[int], docs: list[int], code: int = 8,
         tail: bytes = b"", name: str = "p") -> str:
    """A hand-made ``.idx`` (layout in nxd_lc.data.megatron_indexed) next to a 64-byte ``.bin``."""
    prefix = str(tmp_path / name)
    head = mi.INDEX_HEADER + struct.pack("<QBQQ", 1, code, len(sizes), len(docs))
    body = (np.asarray(sizes, np.int32).tobytes() + np.asarray(pointers, np.int64).tobytes()
            + np.asarray(docs, np.int64).tobytes())
    Path(prefix + ".idx").write_bytes(head + body + tail)
    Path(prefix + ".bin").write_bytes(bytes(64))
    return prefix


@pytest.mark.parametrize("case,kwargs,match", [
    ("float ids", {"code": 7}, r"p\.idx stores token ids as float32 .* truncated; preprocess the data again"),
    ("pointer past .bin", {"pointers": [0, 1 << 40]},
     r"sequence 1 of .*p\.idx \(length 2 tokens at byte 1099511627776\) lies outside .*p\.bin \(64 bytes\)"),
    ("negative length", {"sizes": [3, -5]}, r"sequence 1 of .*p\.idx \(length -5 tokens"),
    ("negative pointer", {"pointers": [0, -8]}, r"sequence 1 of .*p\.idx \(length 2 tokens at byte -8\)"),
    ("length past .bin", {"sizes": [3, 40]}, r"sequence 1 of .*p\.idx \(length 40 tokens at byte 6\) lies outside"),
    ("trailing bytes", {"tail": b"\x00" * 8}, r"p\.idx is not a Megatron mmap index: 90 bytes, but its header .* "
                                              r"needs exactly 82"),
    ("document indices", {"docs": [0, 2, 1]}, r"document indices of .*p\.idx are not 0, then non-decreasing"),
])
def test_damaged_idx_is_refused_naming_file_and_sequence(tmp_path: Path, case: str, kwargs: dict[str, Any],
                                                         match: str) -> None:
    args: dict[str, Any] = {"sizes": [3, 2], "pointers": [0, 6], "docs": [0, 1, 2], **kwargs}
    prefix = _idx(tmp_path, **args)
    with pytest.raises(ValueError, match=r"data\.data_prefix: .*" + match):
        mi.IndexedDataset(prefix)


def test_huge_counts_are_refused_before_any_array_is_mapped(tmp_path: Path) -> None:
    """A 34-byte .idx claiming 2**60 sequences: refused from the file size alone (no allocation, no scan)."""
    prefix = str(tmp_path / "huge")
    Path(prefix + ".idx").write_bytes(mi.INDEX_HEADER + struct.pack("<QBQQ", 1, 8, 1 << 60, 2))
    Path(prefix + ".bin").write_bytes(b"")
    with pytest.raises(ValueError, match=r"huge\.idx is not a Megatron mmap index: 34 bytes, but its header "
                                         r"\(1152921504606846976 sequences, 2 document indices\) needs exactly"):
        mi.IndexedDataset(prefix)


def test_float_dtype_is_not_written_either(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"dtype float32 is not a Megatron token dtype"):
        mi.IndexedDatasetWriter(str(tmp_path / "f"), np.float32)


def _cfg(prefix: str, cache: Path) -> DataConfig:
    return DataConfig(data_prefix=prefix, splits_string="1,0,0", shuffle=False,
                      index_mapping_dir=str(cache)).resolved()


@pytest.mark.parametrize("case,bad_id,match", [
    ("beyond the vocabulary", 150, r"holds token id 150, outside \[0, 100\)"),
    ("wraps around in int32", 2**32 + 5, r"holds token id 4294967301, outside \[0, 100\)"),
    ("negative", -3, r"holds token id -3, outside \[0, 100\)"),
])
def test_token_ids_outside_the_vocabulary_stop_before_training(tmp_path: Path, case: str, bad_id: int,
                                                                 match: str) -> None:
    """int64 ids are refused at data setup naming the .bin and the sequence; an id of 2**32 + 5 used to be cast
    to int32 as 5 and train without a word."""
    docs = [[1, 2, 3, 4, 5]] * 3 + [[6, 7, bad_id, 8]] + [[9] * 6]
    prefix = str(tmp_path / "c")
    mi.write_indexed_dataset(prefix, docs, np.int64)
    with pytest.raises(ValueError, match=r"data\.data_prefix: sequence 3 of .*c\.bin " + match
                                         + r" .*preprocess it again"):
        build_datasets(_cfg(prefix, tmp_path / "maps"), seq_length=4, seed=1, vocab_limit=100)


def test_a_bin_changed_behind_the_cached_token_range_stops_at_the_read(tmp_path: Path) -> None:
    """The id range of a .bin is cached (keyed by the .idx content and the .bin's size, mtime and inode); a .bin
    rewritten in place with its mtime restored still stops when the row is read, naming the sequence, instead of
    wrapping the id around in int32."""
    prefix = str(tmp_path / "c")
    mi.write_indexed_dataset(prefix, [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]], np.int64)
    train, _ = build_datasets(_cfg(prefix, tmp_path / "maps"), seq_length=4, seed=1, vocab_limit=100)
    assert len(list((tmp_path / "maps").glob("c-tokens-*.json"))) == 1
    st = os.stat(prefix + ".bin")
    with open(prefix + ".bin", "r+b") as f:
        f.seek(8 * 6)  # sequence 1, token 1
        f.write(np.int64(2**32 + 7).tobytes())
    os.utime(prefix + ".bin", ns=(st.st_atime_ns, st.st_mtime_ns))
    train, _ = build_datasets(_cfg(prefix, tmp_path / "maps"), seq_length=4, seed=1, vocab_limit=100)
    assert train[0].tolist() == [1, 2, 3, 4, 5]
    with pytest.raises(ValueError, match=r"sequence 1 of .*c\.bin holds token id 4294967303, outside \[0, 100\)"):
        train[1]


def _rows(ds: GPTSamples) -> list[list[int]]:
    return [ds[i].tolist() for i in range(len(ds))]


def test_reordered_data_with_equal_counts_never_reuses_the_sample_index(tmp_path: Path) -> None:
    """Same number of sequences and tokens, another order: the old key (count, token sum) reused the stale index
    and read the wrong tokens (or crashed); the key is now the .idx content."""
    prefix = str(tmp_path / "c")
    mi.write_indexed_dataset(prefix, [[1] * 3, [2] * 9, [3] * 4])
    first = GPTSamples(mi.IndexedDataset(prefix), (0, 3), 4, seed=None, cache_dir=str(tmp_path / "maps"))
    assert _rows(first) == [[1, 1, 1, 2, 2], [2, 2, 2, 2, 2], [2, 2, 2, 2, 3]]
    mi.write_indexed_dataset(prefix, [[2] * 9, [1] * 3, [3] * 4])
    again = GPTSamples(mi.IndexedDataset(prefix), (0, 3), 4, seed=None, cache_dir=str(tmp_path / "maps"))
    assert again.cache != first.cache
    assert _rows(again) == [[2, 2, 2, 2, 2], [2, 2, 2, 2, 2], [2, 1, 1, 1, 3]]


@pytest.mark.parametrize("case,edit", [
    ("shuffle out of range", lambda d: np.save(d / "shuffle.npy", np.array([0, 1, 99], np.int64))),
    ("wrong dtype", lambda d: np.save(d / "doc_ends.npy", np.array([3, 12, 16], np.float64))),
    ("stale ends", lambda d: np.save(d / "doc_ends.npy", np.array([3, 12, 15], np.int64))),
    ("not an array", lambda d: (d / "doc_order.npy").write_bytes(b"garbage")),
])
def test_a_damaged_sample_index_is_rebuilt_with_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                          case: str, edit: Callable[[Path], Any]) -> None:
    prefix = str(tmp_path / "c")
    mi.write_indexed_dataset(prefix, [[1] * 3, [2] * 9, [3] * 4])
    first = GPTSamples(mi.IndexedDataset(prefix), (0, 3), 4, seed=3, cache_dir=str(tmp_path / "maps"))
    expected = _rows(first)
    edit(Path(first.cache))
    with caplog.at_level(logging.WARNING, logger="nxd_lc.data.megatron_dataset"):
        again = GPTSamples(mi.IndexedDataset(prefix), (0, 3), 4, seed=3, cache_dir=str(tmp_path / "maps"))
    assert "does not fit" in caplog.text and "building it again" in caplog.text
    assert _rows(again) == expected


# ---- packed-sample cache -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from nxd_lc.data.tokenizer import train_bytelevel_bpe

    path = tmp_path_factory.mktemp("tok") / "tokenizer"
    train_bytelevel_bpe(["the quick brown fox jumps over the lazy dog"] * 20, 300).save_pretrained(path)
    return path


def _datamodule(tmp_path: Path, tokenizer_dir: Path) -> Any:
    from nxd_lc.data.datamodule import PretrainingDataModule

    corpus = tmp_path / "corpus.jsonl"
    if not corpus.exists():
        corpus.write_text("".join(json.dumps({"text": f"the quick brown fox {i} jumps over the lazy dog"}) + "\n"
                                  for i in range(40)))
    cfg = DataConfig(micro_batch_size=1, global_batch_size=1, train_dir=str(corpus), val_fraction=0.0,
                     tokenizer=TokenizerConfig(type=str(tokenizer_dir), cache_dir=str(tmp_path / "cache")))
    return PretrainingDataModule(cfg, seq_length=16, seed=0, model_vocab_size=320, data_parallel_rank=0,
                                 data_parallel_size=1, global_batch_size=1)


@pytest.mark.parametrize("case,tamper,match", [
    ("rows of another length", lambda a: a[:, :9].copy(), r"holds rows of 9 tokens, but data\.seq_length \+ 1 = 17"),
    ("another dtype", lambda a: a.astype(np.int64), r"holds int64 values, not int32 token ids"),
    ("ids beyond the vocabulary", lambda a: np.where(a == a.max(), 5000, a).astype(np.int32),
     r"holds token id 5000, outside \[0, 320\)"),
    ("one dimension", lambda a: a.reshape(-1), r"must be \[N, seq_length \+ 1\]"),
])
def test_a_tampered_packed_cache_is_refused_naming_the_file(tmp_path: Path, tokenizer_dir: Path, case: str,
                                                            tamper: Callable[[np.ndarray], np.ndarray],
                                                            match: str) -> None:
    """Today's failure: a cache with rows of 9 tokens trained at sequence length 8 without a word."""
    dm = _datamodule(tmp_path, tokenizer_dir)
    dm.setup("fit")
    assert dm.train_dataset.seq_length == 16
    (path,) = (tmp_path / "cache" / "packed").glob("*.npy")
    np.save(path, tamper(np.load(path)))
    with pytest.raises(ValueError, match=r"packed-sample cache .*\.npy " + match + r".*delete it, it is rebuilt"):
        _datamodule(tmp_path, tokenizer_dir).setup("fit")
    path.unlink()
    again = _datamodule(tmp_path, tokenizer_dir)
    again.setup("fit")
    assert again.train_dataset.seq_length == 16 and len(again.train_dataset) == len(dm.train_dataset)


# ---- GGUF ----------------------------------------------------------------------------------------------------------
def _s(text: str) -> bytes:
    raw = text.encode()
    return struct.pack("<Q", len(raw)) + raw


def _gguf_bytes(*, kv_count: int | None = None, tensor_count: int | None = None, array_len: int = 3,
                string_len: int | None = None, dims: tuple[int, ...] = (4, 2), ggml_type: int = 0,
                offset: int = 0, key: bytes | None = None, u8_len: int = 2) -> bytes:
    """A small GGUF v3 file made byte by byte (ggml docs/gguf.md): 4 metadata entries, one F32 tensor [2, 4]."""
    kvs = [
        _s("general.flags") + struct.pack("<IIQ", 9, 0, u8_len) + b"\x01\x02",
        _s("general.architecture") + struct.pack("<I", 8) + _s("llama"),
        (key or _s("tokenizer.ggml.tokens")) + struct.pack("<IIQ", 9, 8, array_len) + b"".join(
            _s(t) for t in ("a", "b", "c")),
        _s("general.name") + struct.pack("<I", 8) + (
            _s("tiny") if string_len is None else struct.pack("<Q", string_len) + b"tiny"),
    ]
    info = _s("token_embd.weight") + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims)
    info += struct.pack("<IQ", ggml_type, offset)
    head = b"GGUF" + struct.pack("<IQQ", 3, 1 if tensor_count is None else tensor_count,
                                 len(kvs) if kv_count is None else kv_count)
    meta = head + b"".join(kvs) + info
    meta += bytes(-len(meta) % 32)
    return meta + np.arange(8, dtype=np.float32).tobytes()


def test_the_hand_made_gguf_is_valid_for_the_gguf_reader(tmp_path: Path) -> None:
    import gguf

    from nxd_lc.models.llama.gguf_import import check_gguf_file

    path = tmp_path / "ok.gguf"
    path.write_bytes(_gguf_bytes())
    check_gguf_file(path)
    reader = gguf.GGUFReader(str(path))
    assert [t.name for t in reader.tensors] == ["token_embd.weight"]
    assert reader.tensors[0].data.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert reader.fields["tokenizer.ggml.tokens"].contents() == ["a", "b", "c"]


@pytest.mark.parametrize("case,kwargs,match", [
    ("kv_count", {"kv_count": 1 << 40}, r"header claims 1099511627776 metadata entries \(kv_count\)"),
    ("tensor_count", {"tensor_count": 1 << 50}, r"header claims 4 metadata entries \(kv_count\) and "
                                                r"1125899906842624 tensors"),
    ("uint8 array length", {"u8_len": 1 << 60}, r"metadata 'general\.flags' claims 1152921504606846976 bytes"),
    ("array length", {"array_len": 1 << 60}, r"metadata 'tokenizer\.ggml\.tokens' claims 1152921504606846976 "
                                             r"entries"),
    ("string length", {"string_len": 1 << 40}, r"metadata 'general\.name' claims 1099511627776 bytes"),
    ("key not UTF-8", {"key": struct.pack("<Q", 2) + b"\xff\xfe"}, r"metadata key 2 is not UTF-8"),
    ("dimensions", {"dims": (4, 2, 1, 1, 1)}, r"tensor 'token_embd\.weight' has 5 dimensions"),
    ("ggml type", {"ggml_type": 999}, r"tensor 'token_embd\.weight' has unknown ggml type 999"),
    ("tensor offset", {"offset": 1 << 40}, r"tensor 'token_embd\.weight' \(32 bytes at data offset 1099511627776\) "
                                           r"reaches past the end"),
    ("tensor size", {"dims": (4, 1 << 40)}, r"tensor 'token_embd\.weight' \(17592186044416 bytes"),
])
def test_a_damaged_gguf_is_refused_before_the_gguf_reader_allocates(tmp_path: Path, case: str,
                                                                    kwargs: dict[str, Any], match: str) -> None:
    """~300-byte files with one count or length damaged: the gguf package read past the end as empty slices and
    grew without bound (a uint8 array claiming 2**60 entries: memory grows until the process is killed) or failed
    deep inside numpy; the conversion now stops at once naming the file and the field."""
    from nxd_lc.models.llama.gguf_import import convert_gguf_to_hf

    path = tmp_path / "bad.gguf"
    path.write_bytes(_gguf_bytes(**kwargs))
    with pytest.raises(ValueError, match=r"GGUF file .*bad\.gguf: " + match + r".*download or convert it again"):
        convert_gguf_to_hf(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_truncated_gguf_names_the_field_it_stops_in(tmp_path: Path) -> None:
    from nxd_lc.models.llama.gguf_import import check_gguf_file

    data = _gguf_bytes()
    for cut, match in ((10, r"shorter than the 24-byte GGUF header"),
                       (40, r"header claims 4 metadata entries \(kv_count\) and 1 tensors"),
                       (150, r"metadata 'tokenizer\.ggml\.tokens' length runs past the end of the file"),
                       (170, r"metadata 'tokenizer\.ggml\.tokens' claims 3 entries of >= 8 bytes, more than the 17"),
                       (len(data) - 4, r"tensor 'token_embd\.weight' .* reaches past the end")):
        path = tmp_path / "cut.gguf"
        path.write_bytes(data[:cut])
        with pytest.raises(ValueError, match=r"GGUF file .*cut\.gguf: .*" + match):
            check_gguf_file(path)


# ---- safetensors files and their index ---------------------------------------------------------------------------
def _safetensors(path: Path, header: Any, data: bytes = bytes(32), length: int | None = None) -> Path:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + data)
    return path


_A = {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}
_B = {"dtype": "F32", "shape": [2, 2], "data_offsets": [16, 32]}


@pytest.mark.parametrize("case,kwargs,match", [
    ("header length beyond the file", {"length": 1 << 40}, r"header length 1099511627776 bytes, but the file holds"),
    ("not JSON", {"header": b"{not json" + b" " * 60}, r"its header is not UTF-8 JSON"),
    ("not UTF-8", {"header": b"\xff\xfe{}"}, r"its header is not UTF-8 JSON \(UnicodeDecodeError"),
    ("deep nesting", {"header": b"[" * 100_000 + b"]" * 100_000},
     r"its header is not UTF-8 JSON \(ValueError: .*nested deeper"),
    ("a list", {"header": [1, 2]}, r"its header is a JSON list, not an object"),
    ("offsets beyond", {"header": {"a": {**_A, "data_offsets": [16, 48]}, "b": _B}},
     r"tensor 'a' lies at bytes \[16, 48\), outside the 32 data bytes"),
    ("overlapping", {"header": {"a": {**_A, "data_offsets": [8, 24]}, "b": _B}},
     r"tensors 'a' and 'b' overlap \(bytes 16\.\.24\)"),
    ("size and shape disagree", {"header": {"a": {**_A, "shape": [5]}, "b": _B}},
     r"tensor 'a' \(F32 \[5\]\) needs 20 bytes, its data_offsets span 16"),
    ("a field missing", {"header": {"a": {"dtype": "F32", "shape": [4]}}}, r"tensor 'a' needs exactly 'dtype'"),
    ("float shape", {"header": {"a": {**_A, "shape": [4.0]}}}, r"tensor 'a' has dtype 'F32', shape \[4\.0\]"),
    ("short file", {"header": b"", "data": b"", "length": 0}, r""),
])
def test_a_damaged_safetensors_header_names_the_file(tmp_path: Path, case: str, kwargs: dict[str, Any],
                                                     match: str) -> None:
    from nxd_lc.models.llama.hf_adapter import SafetensorsCheckpoint

    args: dict[str, Any] = {"header": {"a": _A, "b": _B}, **kwargs}
    path = _safetensors(tmp_path / "model.safetensors", **args)
    if case == "short file":
        path.write_bytes(b"\x01\x02")
        match = r"2 bytes, shorter than the 8-byte header length"
    with pytest.raises(ValueError, match=r"safetensors file .*model\.safetensors: " + match):
        SafetensorsCheckpoint(tmp_path)
    with pytest.raises(ValueError, match=r"safetensors file .*model\.safetensors: " + match):
        SafetensorsCheckpoint(path)


def test_a_good_safetensors_header_passes(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    from nxd_lc.models.llama.hf_adapter import SafetensorsCheckpoint, check_safetensors_header

    save_file({"a": torch.arange(4.0), "b": torch.ones(2, 2, dtype=torch.bfloat16), "c": torch.zeros(0)},
              str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    check_safetensors_header(tmp_path / "model.safetensors")
    with SafetensorsCheckpoint(tmp_path) as ckpt:
        assert ckpt.read("a").tolist() == [0, 1, 2, 3] and ckpt.shape("b") == (2, 2)


def _index(model_dir: Path, weight_map: dict[str, Any]) -> None:
    (model_dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.mark.parametrize("case", ["dotdot", "absolute", "symlink"])
def test_an_index_entry_outside_the_model_directory_is_refused(tmp_path: Path, case: str) -> None:
    """Before, the index could point the load at any safetensors file on the machine."""
    from safetensors.torch import save_file

    from nxd_lc.models.llama.hf_adapter import SafetensorsCheckpoint

    outside = tmp_path / "elsewhere.safetensors"
    save_file({"w": torch.ones(2)}, str(outside))
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    save_file({"v": torch.ones(2)}, str(model_dir / "model-00001-of-00002.safetensors"))
    fname = {"dotdot": "../elsewhere.safetensors", "absolute": str(outside), "symlink": "link.safetensors"}[case]
    if case == "symlink":
        (model_dir / "link.safetensors").symlink_to(outside)
    _index(model_dir, {"v": "model-00001-of-00002.safetensors", "w": fname})
    match = (r"the file must be a name relative to" if case == "absolute" else
             r"leads outside the model directory")
    with pytest.raises(ValueError, match=r"model\.safetensors\.index\.json: weight_map entry 'w' -> .*" + match):
        SafetensorsCheckpoint(model_dir)


def test_an_index_entry_naming_a_missing_or_wrong_typed_file_names_the_entry(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    from nxd_lc.models.llama.hf_adapter import SafetensorsCheckpoint

    save_file({"v": torch.ones(2)}, str(tmp_path / "a.safetensors"))
    _index(tmp_path, {"v": "a.safetensors", "w": "b.safetensors"})
    with pytest.raises(ValueError, match=r"weight_map entry 'w' -> 'b\.safetensors': no such file in"):
        SafetensorsCheckpoint(tmp_path)
    _index(tmp_path, {"v": "a.safetensors", "w": 7})
    with pytest.raises(ValueError, match=r"weight_map entry 'w' -> 7: the file must be a name relative to"):
        SafetensorsCheckpoint(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_bytes(b'{"weight_map": {"v": "\xff"}}')
    with pytest.raises(ValueError, match=r"index\.json: not a valid safetensors index .*UnicodeDecodeError"):
        SafetensorsCheckpoint(tmp_path)


# ---- HF conversion cache ---------------------------------------------------------------------------------------------
def test_a_damaged_conversion_cache_entry_with_a_matching_sidecar_names_the_file(tmp_path: Path) -> None:
    """The sidecar SHA-256 matches the file (both replaced), but the file is not safetensors: before, a raw
    SafetensorError without the file; now one error naming the entry and the fix, which works."""
    from nxd_lc.models.llama import hf_cache

    model = torch.nn.Linear(2, 2)

    def convert(m: torch.nn.Module, hf_dir: str) -> None:
        with torch.no_grad():
            m.weight.fill_(3.0)

    entry = tmp_path / "key" / "tp00_pp00.safetensors"
    entry.parent.mkdir()
    entry.write_bytes(b"\x10" + bytes(15))
    Path(str(entry) + ".sha256").write_text(hashlib.sha256(entry.read_bytes()).hexdigest())
    with pytest.raises(ValueError, match=r"model\.hf_conversion_cache: the cache entry .*tp00_pp00\.safetensors "
                                         r"matches its \.sha256 sidecar but cannot be loaded \(SafetensorError.*"
                                         r"set model\.force_reconvert_from_hf: true"):
        hf_cache.load_or_convert(model, "unused", str(tmp_path), "key", 0, 0, force=False, convert=convert)
    assert not hf_cache.load_or_convert(model, "unused", str(tmp_path), "key", 0, 0, force=True, convert=convert)
    assert hf_cache.load_or_convert(torch.nn.Linear(2, 2), "unused", str(tmp_path), "key", 0, 0, force=False,
                                    convert=convert)
