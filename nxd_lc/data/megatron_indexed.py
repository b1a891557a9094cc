"""Megatron-LM's indexed dataset format (``data_impl: mmap``): reader, writer and the preprocessing CLI.

A dataset is two files named by a prefix ``P`` (what ``data.data_prefix`` lists):

``P.bin``: the token ids of every sequence, concatenated, in the dtype the ``.idx`` names (no header).

``P.idx`` (little endian; facts from Megatron-LM ``megatron/core/datasets/indexed_dataset.py``):

=========  ==============================  ====================================================================
bytes      type                            meaning
=========  ==============================  ====================================================================
9          ``b"MMIDIDX\\x00\\x00"``          magic
8          uint64                          version, 1
1          uint8                           token dtype code (:data:`DTYPE_CODES`: 1 uint8, 2 int8, 3 int16,
                                           4 int32, 5 int64, 6 float64, 7 float32, 8 uint16)
8          uint64                          ``sequence_count``
8          uint64                          ``document_count`` = entries of ``document_indices`` (documents + 1)
4 x seq    int32[sequence_count]           ``sequence_lengths`` (tokens)
8 x seq    int64[sequence_count]           ``sequence_pointers`` (byte offset of each sequence in ``.bin``)
8 x doc    int64[document_count]           ``document_indices``: 0, then the sequence index ending each document
=========  ==============================  ====================================================================

A document is usually one sequence (Megatron splits documents into several only with ``--split-sentences``);
GPT training reads sequences and treats each as a document, as Megatron's ``GPTDataset`` does.

Preprocessing (Megatron's ``tools/preprocess_data.py`` / NeMo's ``preprocess_data_for_megatron.py``)::

    python -m nxd_lc.data.megatron_indexed --input corpus.jsonl --json-key text --output-prefix out/corpus \\
        --append-eod --library megatron --type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt

writes ``out/corpus_text_document.{bin,idx}``: one document per JSON line, tokenized without special tokens (as
NeMo's ``text_to_ids``), followed by the EOD token (the tokenizer's eos) with ``--append-eod``. Token dtype: uint16
when the vocabulary has fewer than 65500 entries, else int32 (Megatron's rule). The tokenizer flags are the
``data.tokenizer`` keys (:func:`nxd_lc.data.tokenizer.load_tokenizer`), so the training run names the same one.
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import sys
import uuid
from collections.abc import Iterable, Sequence
from types import TracebackType
from typing import Any

import numpy as np

from nxd_lc.config.input_files import iter_text_lines, parse_json
from nxd_lc.runtime.files import file_digest

INDEX_HEADER = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
#: Megatron's dtype codes (``DType`` in indexed_dataset.py)
DTYPE_CODES: dict[int, type[np.generic]] = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64,
                                            6: np.float64, 7: np.float32, 8: np.uint16}
_CODE_OF = {np.dtype(t): c for c, t in DTYPE_CODES.items()}
_HEADER_BYTES = 9 + 8 + 1 + 8 + 8
_CHECK_CHUNK = 1 << 22  # index entries checked at a time (bounded temporaries: 32 MiB of int64 per array)
_SCAN_BYTES = 64 << 20  # .bin bytes scanned at a time for token ids


def index_path(prefix: str) -> str:
    """``<prefix>.idx``."""
    return prefix + ".idx"


def data_path(prefix: str) -> str:
    """``<prefix>.bin``."""
    return prefix + ".bin"


def token_dtype(vocab_size: int) -> type[np.generic]:
    """Megatron's token dtype for a vocabulary: uint16 below 65500 entries, else int32."""
    return np.uint16 if vocab_size < 65500 else np.int32


class IndexedDataset:
    """Read-only view of ``<prefix>.idx`` / ``<prefix>.bin`` (both memory-mapped on first use, per process).

    Pickling (into DataLoader workers) copies only the prefix and the header fields.

    Args:
        prefix: path without ``.bin`` / ``.idx``.
        key: the config key named in errors (``data.data_prefix``).
    Raises:
        FileNotFoundError: a file is missing (names ``key`` and the path).
        ValueError: a bad magic, version or dtype code, a float token dtype, an ``.idx`` whose size is not what its
            counts need (checked before any array is mapped), a sequence outside ``.bin`` or document indices out
            of order (names ``key``, the file and the sequence).
    """

    def __init__(self, prefix: str, key: str = "data.data_prefix") -> None:
        self.prefix, self.key = prefix, key
        for path in (index_path(prefix), data_path(prefix)):
            if not os.path.isfile(path):
                raise FileNotFoundError(f"{key}: no such file {path} (Megatron indexed data is <prefix>.bin + "
                                        "<prefix>.idx; make it with python -m nxd_lc.data.megatron_indexed)")
        with open(index_path(prefix), "rb") as f:
            head = f.read(_HEADER_BYTES)
        bad = f"{key}: {index_path(prefix)} is not a Megatron mmap index"
        if len(head) < _HEADER_BYTES or head[:9] != INDEX_HEADER:
            raise ValueError(f"{bad} (magic {head[:9]!r}, expected {INDEX_HEADER!r}); data.data_impl: mmap only")
        version, code, self.sequence_count, self.document_count = struct.unpack("<QBQQ", head[9:])
        if version != INDEX_VERSION or code not in DTYPE_CODES:
            raise ValueError(f"{bad} (version {version}, dtype code {code}; expected version 1, codes 1-8)")
        self.dtype = np.dtype(DTYPE_CODES[code])
        if self.dtype.kind == "f":
            raise ValueError(f"{key}: {index_path(prefix)} stores token ids as {self.dtype.name} (dtype code {code}); "
                             "token ids are integers and a float id would be truncated; preprocess the data again "
                             "(python -m nxd_lc.data.megatron_indexed writes uint16 or int32)")
        expected = _HEADER_BYTES + 12 * self.sequence_count + 8 * self.document_count
        idx_size = os.path.getsize(index_path(prefix))
        if idx_size != expected:
            raise ValueError(f"{bad}: {idx_size} bytes, but its header ({self.sequence_count} sequences, "
                             f"{self.document_count} document indices) needs exactly {expected}; the file is "
                             "truncated or damaged: preprocess the data again")
        self._idx: np.memmap | None = None
        self._bin: np.memmap | None = None
        self._digest: str | None = None
        self._check_index()

    def _check_index(self) -> None:
        """Every sequence within ``.bin`` and document indices in order; vectorised over chunks of the index.

        Raises:
            ValueError: a negative length or pointer, a sequence reaching past the end of ``.bin``, or document
                indices out of order (names the file and the first bad sequence / entry).
        """
        bin_path, bin_size, item = data_path(self.prefix), os.path.getsize(data_path(self.prefix)), self.dtype.itemsize
        sizes, pointers = self.sizes, self.pointers
        for lo in range(0, self.sequence_count, _CHECK_CHUNK):
            s = sizes[lo:lo + _CHECK_CHUNK].astype(np.int64)
            p = pointers[lo:lo + _CHECK_CHUNK]
            # p <= bin_size first, so p + s * item cannot overflow int64 (s < 2**31, item <= 8)
            bad = (s < 0) | (p < 0) | (p > bin_size) | (p + s * item > bin_size)
            if bad.any():
                i = int(np.flatnonzero(bad)[0])
                raise ValueError(f"{self.key}: sequence {lo + i} of {index_path(self.prefix)} (length {int(s[i])} "
                                 f"tokens at byte {int(p[i])}) lies outside {bin_path} ({bin_size} bytes); the .bin "
                                 "and .idx are not one dataset (or one is truncated): preprocess the data again")
        docs = self.document_indices
        if self.document_count == 0 or docs[0] != 0 or docs[-1] > self.sequence_count or (
                self.document_count > 1 and bool((np.diff(docs) < 0).any())):
            raise ValueError(f"{self.key}: the document indices of {index_path(self.prefix)} are not 0, then "
                             f"non-decreasing sequence indices up to {self.sequence_count}; the file is damaged: "
                             "preprocess the data again")

    @property
    def content_digest(self) -> str:
        """SHA-256 of the whole ``.idx`` (sizes, pointers, document indices): changes with any reordering or
        resizing of the sequences (computed once, about 1 GB/s)."""
        if self._digest is None:
            self._digest = file_digest(index_path(self.prefix))[1]
        return self._digest

    def check_token_ids(self, limit: int) -> None:
        """Scan ``.bin`` for token ids outside ``[0, limit)`` (chunks of 64 MiB, vectorised; bounded memory).

        Raises:
            ValueError: the first id out of range, naming the file, the sequence that holds it and the fix.
        """
        low, high = self.token_range()
        if low >= 0 and high < limit:
            return
        item, bin_map = self.dtype.itemsize, self._data()
        order = np.argsort(self.pointers, kind="stable")
        starts = self.pointers[order]
        ends = starts + self.sizes[order].astype(np.int64) * item
        step = (_SCAN_BYTES // item) * item
        for lo in range(0, len(bin_map) - len(bin_map) % item, step):
            chunk = np.frombuffer(bin_map, self.dtype, min(step, len(bin_map) - lo) // item, lo)
            for pos in np.flatnonzero((chunk < 0) | (chunk >= limit)):
                byte = lo + int(pos) * item
                k = int(np.searchsorted(starts, byte, side="right")) - 1
                if k >= 0 and byte < ends[k]:
                    raise token_id_error(self, int(order[k]), int(chunk[pos]), limit)

    def token_range(self) -> tuple[int, int]:
        """``(min, max)`` token id over the sequences' bytes of ``.bin`` (``(0, -1)`` when empty); reads it once."""
        low, high, item, bin_map = None, None, self.dtype.itemsize, self._data()
        step = (_SCAN_BYTES // item) * item
        for lo in range(0, len(bin_map) - len(bin_map) % item, step):
            chunk = np.frombuffer(bin_map, self.dtype, min(step, len(bin_map) - lo) // item, lo)
            if chunk.size:
                cmin, cmax = int(chunk.min()), int(chunk.max())
                low, high = cmin if low is None else min(low, cmin), cmax if high is None else max(high, cmax)
        return (0, -1) if low is None or high is None else (low, high)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_idx": None, "_bin": None}

    def _data(self) -> np.memmap | np.ndarray:
        if self._bin is None:
            if os.path.getsize(data_path(self.prefix)) == 0:  # numpy cannot map an empty file
                return np.zeros(0, dtype=np.uint8)
            self._bin = np.memmap(data_path(self.prefix), mode="r", dtype=np.uint8)
        return self._bin

    def _index(self) -> np.memmap:
        if self._idx is None:
            self._idx = np.memmap(index_path(self.prefix), mode="r", dtype=np.uint8)
        return self._idx

    @property
    def sizes(self) -> np.ndarray:
        """int32 ``[sequence_count]``: tokens of each sequence."""
        return np.frombuffer(self._index(), np.int32, self.sequence_count, _HEADER_BYTES)

    @property
    def pointers(self) -> np.ndarray:
        """int64 ``[sequence_count]``: byte offset of each sequence in ``.bin``."""
        return np.frombuffer(self._index(), np.int64, self.sequence_count, _HEADER_BYTES + 4 * self.sequence_count)

    @property
    def document_indices(self) -> np.ndarray:
        """int64 ``[documents + 1]``: 0, then the sequence index that ends each document."""
        return np.frombuffer(self._index(), np.int64, self.document_count, _HEADER_BYTES + 12 * self.sequence_count)

    def __len__(self) -> int:
        return self.sequence_count

    def get(self, index: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of sequence ``index`` (to its end when ``length`` is None), a
        read-only view of the ``.bin`` map in the file's dtype."""
        size = int(self.sizes[index])
        length = size - offset if length is None else length
        if not 0 <= offset <= offset + length <= size:
            raise IndexError(f"{self.prefix}: tokens [{offset}, {offset + length}) of sequence {index} (length {size})")
        start = int(self.pointers[index]) + offset * self.dtype.itemsize
        return np.frombuffer(self._data(), self.dtype, length, start)

    def __getitem__(self, index: int) -> np.ndarray:
        return self.get(index)

    def warmup(self, chunk_bytes: int = 100 << 20) -> None:
        """Read both files through once (``data.skip_warmup: false``, legacy Megatron's ``_warmup_mmap_file``):
        later random reads then hit the page cache instead of the file system."""
        for path in (index_path(self.prefix), data_path(self.prefix)):
            with open(path, "rb") as f:
                while f.read(chunk_bytes):
                    pass


def token_id_error(dataset: IndexedDataset, sequence: int, token_id: int, limit: int) -> ValueError:
    """The error for token id ``token_id`` of sequence ``sequence`` outside ``[0, limit)`` (names the file)."""
    return ValueError(f"{dataset.key}: sequence {sequence} of {data_path(dataset.prefix)} holds token id {token_id}, "
                      f"outside [0, {limit}) (the model's vocab_size, model.model_config); the data was tokenized "
                      "for another vocabulary or the file is damaged: preprocess it again with the run's tokenizer")


class IndexedDatasetWriter:
    """Writes ``<prefix>.bin`` while sequences are added and ``<prefix>.idx`` on :meth:`finalize` (or on leaving a
    ``with`` block without an exception).

    Both are written under temporary names beside the outputs and renamed into place by :meth:`finalize`; leaving
    the ``with`` block with an exception (or :meth:`abort`) removes them, so a failed run leaves no partial file and
    never touches an earlier output of the same prefix.

    Args:
        prefix: output path without suffix (its directory is created).
        dtype: token dtype; an integer one of :data:`DTYPE_CODES` (see :func:`token_dtype`).
    Raises:
        ValueError: a dtype Megatron has no code for, or a float dtype (token ids are integers).
    """

    def __init__(self, prefix: str, dtype: type[np.generic] | np.dtype = np.uint16) -> None:
        self.prefix, self.dtype = prefix, np.dtype(dtype)
        if self.dtype not in _CODE_OF or self.dtype.kind == "f":
            raise ValueError(f"dtype {self.dtype} is not a Megatron token dtype; use one of "
                             f"{[np.dtype(t).name for t in DTYPE_CODES.values() if np.dtype(t).kind != 'f']}")
        os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
        self._tmp = f".tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._bin = open(data_path(prefix) + self._tmp, "wb")
        self.sizes: list[int] = []
        self.document_indices: list[int] = [0]

    def add_sequence(self, tokens: Sequence[int] | np.ndarray) -> None:
        """Append one sequence (token ids that must fit the dtype)."""
        arr = np.asarray(tokens)
        out = arr.astype(self.dtype)
        if arr.size and not np.array_equal(out, arr):
            raise ValueError(f"token ids [{arr.min()}, {arr.max()}] do not fit {self.dtype}")
        self._bin.write(out.tobytes(order="C"))
        self.sizes.append(int(arr.size))

    def end_document(self) -> None:
        """Close the current document (the sequences added since the last call)."""
        self.document_indices.append(len(self.sizes))

    def add_document(self, tokens: Sequence[int] | np.ndarray) -> None:
        """Append a one-sequence document."""
        self.add_sequence(tokens)
        self.end_document()

    def abort(self) -> None:
        """Close and remove the temporary files; the outputs (and any earlier ones) are left as they were."""
        self._bin.close()
        for path in (data_path(self.prefix) + self._tmp, index_path(self.prefix) + self._tmp):
            if os.path.exists(path):
                os.remove(path)

    def finalize(self) -> None:
        """Close ``.bin``, write ``.idx`` and rename both into place (``.bin`` first)."""
        try:
            self._write_index()
        except BaseException:
            self.abort()
            raise
        os.replace(data_path(self.prefix) + self._tmp, data_path(self.prefix))
        os.replace(index_path(self.prefix) + self._tmp, index_path(self.prefix))

    def _write_index(self) -> None:
        self._bin.close()
        sizes = np.asarray(self.sizes, dtype=np.int32)
        pointers = np.zeros(len(sizes), dtype=np.int64)
        if len(sizes):
            pointers[1:] = np.cumsum(sizes[:-1].astype(np.int64)) * self.dtype.itemsize
        with open(index_path(self.prefix) + self._tmp, "wb") as f:
            f.write(INDEX_HEADER)
            f.write(struct.pack("<QBQQ", INDEX_VERSION, _CODE_OF[self.dtype], len(sizes),
                                len(self.document_indices)))
            f.write(sizes.tobytes(order="C"))
            f.write(pointers.tobytes(order="C"))
            f.write(np.asarray(self.document_indices, dtype=np.int64).tobytes(order="C"))

    def __enter__(self) -> IndexedDatasetWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc_type is None:
            self.finalize()
        else:
            self.abort()


def write_indexed_dataset(prefix: str, documents: Iterable[Sequence[int] | np.ndarray],
                          dtype: type[np.generic] | np.dtype = np.uint16) -> None:
    """Write one-sequence ``documents`` as ``<prefix>.bin`` / ``<prefix>.idx``."""
    with IndexedDatasetWriter(prefix, dtype) as w:
        for doc in documents:
            w.add_document(doc)


def _batches(path: str, json_key: str, batch_size: int) -> Iterable[list[str]]:
    """The ``json_key`` texts of the .jsonl ``path`` in batches; errors name ``path:line`` and the fix."""
    batch: list[str] = []
    for lineno, line in iter_text_lines(path, key="--input"):
        if not line.strip():
            continue
        try:
            record = parse_json(line, path, line=lineno, key="--input")
        except json.JSONDecodeError as e:
            raise ValueError(f"--input: {path}:{lineno}: not valid JSON ({e.msg}, column {e.colno}); the input "
                             "holds one JSON object per line: fix or remove that line") from None
        if isinstance(record, dict) and json_key in record and not isinstance(record[json_key], str):
            raise ValueError(f"--input: {path}:{lineno}: field {json_key!r} is {type(record[json_key]).__name__}, "
                             "not a string; every document's text must be a JSON string: fix that line")
        if not isinstance(record, dict) or not isinstance(record.get(json_key), str):
            raise ValueError(f"--json-key: {path}:{lineno} has no string field {json_key!r} (found "
                             f"{sorted(record) if isinstance(record, dict) else type(record).__name__}); give "
                             "--json-key the field that holds the text, or fix that line")
        batch.append(record[json_key])
        if len(batch) == batch_size:
            yield batch
            batch = []
    if batch:
        yield batch


def preprocess(input_path: str, output_prefix: str, tokenizer: Any, *, json_key: str = "text",
               append_eod: bool = False, batch_size: int = 256) -> tuple[str, int, int]:
    """Tokenize the ``json_key`` field of each line of a .jsonl file into ``<output_prefix>_<json_key>_document``.

    Args:
        tokenizer: an HF tokenizer (``tokenizer(texts, add_special_tokens=False)``; ``eos_token_id`` is the EOD).
    Returns:
        ``(prefix written, documents, tokens)``.
    Raises:
        ValueError: a line without the field, or ``append_eod`` with a tokenizer that has no eos token.
    """
    eod = tokenizer.eos_token_id
    if append_eod and eod is None:
        raise ValueError("--append-eod: the tokenizer has no eos token to end documents with")
    prefix = f"{output_prefix}_{json_key}_document"
    docs = tokens = 0
    with IndexedDatasetWriter(prefix, token_dtype(len(tokenizer))) as w:
        for batch in _batches(input_path, json_key, batch_size):
            for ids in tokenizer(batch, add_special_tokens=False)["input_ids"]:
                w.add_document(list(ids) + ([eod] if append_eod else []))
                docs, tokens = docs + 1, tokens + len(ids) + int(append_eod)
    return prefix, docs, tokens


def main(argv: Sequence[str] | None = None) -> int:
    """CLI (module docstring). Returns the exit status."""
    from nxd_lc.config.schema import TokenizerConfig
    from nxd_lc.data.tokenizer import load_tokenizer

    ap = argparse.ArgumentParser(prog="python -m nxd_lc.data.megatron_indexed", description=__doc__.splitlines()[0])
    ap.add_argument("--input", required=True, help=".jsonl file, one document per line")
    ap.add_argument("--json-key", default="text", help="field holding the text (default: text)")
    ap.add_argument("--output-prefix", required=True, help="writes <prefix>_<json-key>_document.{bin,idx}")
    ap.add_argument("--append-eod", action="store_true", help="end every document with the EOD (eos) token")
    for key in ("library", "type", "model", "vocab_file", "merge_file", "delimiter"):
        ap.add_argument("--" + key.replace("_", "-"), default=None, help=f"data.tokenizer.{key}")
    ap.add_argument("--sentencepiece-legacy", action="store_true", help="data.tokenizer.sentencepiece_legacy")
    ap.add_argument("--use-fast", action=argparse.BooleanOptionalAction, default=None, help="data.tokenizer.use_fast")
    args = ap.parse_args(argv)
    tok_cfg = TokenizerConfig(type=args.type, library=args.library, model=args.model, vocab_file=args.vocab_file,
                              merge_file=args.merge_file, delimiter=args.delimiter,
                              sentencepiece_legacy=args.sentencepiece_legacy, use_fast=args.use_fast)
    if not os.path.isfile(args.input):
        print(f"error: --input: {args.input} is not an existing file (a .jsonl, one document per line)",
              file=sys.stderr)
        return 2
    try:
        tokenizer = load_tokenizer(tok_cfg, None, require_fast=False)
        prefix, docs, tokens = preprocess(args.input, args.output_prefix, tokenizer, json_key=args.json_key,
                                          append_eod=args.append_eod)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {prefix}.bin / .idx: {docs} documents, {tokens} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
