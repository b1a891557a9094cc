"""Tokenize documents and pack them into fixed-length training samples (cached on disk).

Stages 2-3 of the data chain. Documents are tokenized in batches with the fast tokenizer's backend (no special
tokens added) and concatenated into one token stream with ``eos`` after every document, so documents are
separated by exactly one EOS. Already tokenized corpora (``input_ids``) are concatenated as they are: their
tokenization decides the separators.

The stream of ``T`` tokens is cut GPT/Megatron style (Megatron-LM ``GPTDataset``): sample ``i`` is
``stream[i*S : i*S + S + 1]`` (``S`` = seq_length), so consecutive samples share one boundary token and every
token after the first is a label exactly once. The result is a numpy int32 array ``[N, S + 1]`` with
``N = (T - 1) // S``; ``input_ids = sample[:-1]`` and ``labels = sample[1:]``. The ``T - (N*S + 1)`` tail
tokens are dropped and reported through logging.

Document boundaries (:func:`packed_document_ids`, applied per batch by the collate function): the EOS that ends a
document belongs to that document, so a new document starts right after each EOS; a sample that starts in the
middle of a document starts a document at position 0. ``position_ids`` restart at 0 with each document and
``segment_ids`` number the documents of a row 0, 1, 2, ... (non-decreasing along S). With cross-document
attention (Nemotron-UltraLong style) the whole row is one segment: positions ``0..S-1``, segment ids all 0.

Packed arrays are cached as ``<cache_dir>/packed/<key>.npy`` with key = SHA-256 of (source fingerprint: every
file's content SHA-256, tokenizer fingerprint, seq_length, length upsampling, format version), built once per node
by :func:`build_once` and memory-mapped by every rank (and DataLoader worker). On load the cache is verified
against the run (:class:`PackedDataset`): int32, rows of exactly ``seq_length + 1`` tokens, ids within the model's
vocabulary. A cache that does not match is refused naming the file ("delete it, it is rebuilt"), not rebuilt
silently: its name is the key of the right content, so a mismatch means the file was damaged or replaced, and
every rank has it mapped at once (one rank rebuilding it under the others would race).
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
import tokenize
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.utils.data

from nxd_lc.config.access import resolve_path
from nxd_lc.data.long_text import encode_documents
from nxd_lc.data.sources import DocumentSource, iter_documents
from nxd_lc.data.tokenizer import build_once, tokenizer_fingerprint

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

log = logging.getLogger(__name__)

_FORMAT_VERSION = "pack-v1"


@dataclass(frozen=True)
class PackStats:
    """Counts from one packing run (all in tokens unless named otherwise)."""

    num_documents: int
    num_tokens: int
    num_samples: int
    dropped_tokens: int


def tokenize_documents(texts: Iterable[str], tokenizer: PreTrainedTokenizerFast,
                       batch_size: int = 64) -> Iterator[np.ndarray]:
    """Token ids of each text, in order, as int32 arrays (no special tokens added).

    Uses the fast backend's batched ``encode_batch_fast`` (parallel in Rust, no offsets) in bounded memory: a long
    document is tokenized in pieces, a batch holds a bounded number of characters
    (:func:`nxd_lc.data.long_text.encode_documents`).
    """
    return encode_documents(texts, tokenizer.backend_tokenizer, batch_size)


def pack_token_stream(docs: Iterable[Sequence[int] | np.ndarray], seq_length: int,
                      eos_id: int | None) -> tuple[np.ndarray, PackStats]:
    """Concatenate token documents (``eos_id`` after each, unless None) and cut ``[N, seq_length + 1]`` samples.

    Args:
        docs: token ids per document.
        seq_length: S, tokens per training sequence (>= 1).
        eos_id: separator appended after every document; None concatenates as is (pretokenized input).
    Returns:
        ``(samples, stats)``: int32 ``[N, S + 1]`` with ``samples[i] = stream[i*S : i*S + S + 1]``.
    Raises:
        ValueError: ``seq_length < 1``, a negative token id, or ids that do not fit int32.
    """
    if seq_length < 1:
        raise ValueError(f"data.seq_length: must be >= 1, got {seq_length}")
    pieces: list[np.ndarray] = []
    eos = None if eos_id is None else np.asarray([eos_id], dtype=np.int32)
    num_docs = 0
    for doc in docs:
        arr = np.asarray(doc, dtype=np.int64)
        if arr.size and (arr.min() < 0 or arr.max() > np.iinfo(np.int32).max):
            raise ValueError(f"document {num_docs}: token ids must be in [0, 2**31), got range "
                             f"[{arr.min()}, {arr.max()}]")
        pieces.append(arr.astype(np.int32))
        if eos is not None:
            pieces.append(eos)
        num_docs += 1
    stream = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int32)
    samples = cut_samples(stream, seq_length)
    used = samples.shape[0] * seq_length + 1 if samples.shape[0] else 0
    return samples, PackStats(num_docs, int(stream.size), int(samples.shape[0]), int(stream.size - used))


def cut_samples(stream: np.ndarray, seq_length: int) -> np.ndarray:
    """``[N, S + 1]`` windows of ``stream`` with stride S (neighbours share one token); N = (T - 1) // S."""
    n = max(0, (stream.size - 1) // seq_length)
    out = np.empty((n, seq_length + 1), dtype=np.int32)
    if n:
        out[:, :seq_length] = stream[: n * seq_length].reshape(n, seq_length)
        out[:, seq_length] = stream[seq_length: (n + 1) * seq_length: seq_length]
    return out


def packed_document_ids(input_ids: torch.Tensor, eos_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-document ``(position_ids, segment_ids)`` of packed rows ``input_ids [B, S]``.

    A document ends with (and includes) each ``eos_id`` token; the next token starts a new document. The first
    token of a row always starts a document (a row may begin mid-document).

    Returns:
        ``position_ids`` int64 ``[B, S]`` (offset of each token inside its document, 0 at each start) and
        ``segment_ids`` int32 ``[B, S]`` (0-based document index within the row, non-decreasing).
    Raises:
        ValueError: ``input_ids`` is not a 2-D integer tensor.
    """
    if input_ids.dim() != 2 or input_ids.is_floating_point():
        raise ValueError(f"input_ids must be an integer [B, S] tensor, got {input_ids.dtype} "
                         f"{tuple(input_ids.shape)}")
    b, s = input_ids.shape
    is_eos = input_ids == eos_id
    starts = torch.zeros_like(is_eos)
    starts[:, 1:] = is_eos[:, :-1]
    segment_ids = starts.cumsum(dim=1).to(torch.int32)  # 0 for the first document (starts[:, 0] is False)
    ar = torch.arange(s, device=input_ids.device).expand(b, s)
    start_pos = torch.where(starts, ar, torch.zeros_like(ar)).cummax(dim=1).values
    return ar - start_pos, segment_ids


def mask_document_end_labels(labels: torch.Tensor, input_ids: torch.Tensor, eos_id: int,
                             ignore_index: int = -100) -> torch.Tensor:
    """Copy of ``labels [B, S]`` with ``ignore_index`` where ``input_ids`` is ``eos_id``.

    Under document masking the EOS position only sees its own document, and run alone that document has no
    next token: its label (the first token of the next document) is not a target. This makes the loss of a
    packed row the sum of its documents' losses.
    """
    return labels.masked_fill(input_ids == eos_id, ignore_index)


def packed_cache_path(cache_dir: str, source: DocumentSource, tokenizer: PreTrainedTokenizerFast,
                      seq_length: int, upsample: tuple[int, float, int] | None = None) -> str:
    """Path of the cached ``.npy`` for ``source`` packed with ``tokenizer`` into ``seq_length`` samples (and the
    length upsampling ``(min_tokens, factor, seed)`` when given)."""
    parts: tuple[Any, ...] = (_FORMAT_VERSION, source.fingerprint(), tokenizer_fingerprint(tokenizer), seq_length)
    if upsample is not None:
        parts += ("length_upsampling", *upsample)
    key = hashlib.sha256(repr(parts).encode()).hexdigest()[:24]
    return os.path.join(resolve_path(cache_dir), "packed", f"{key}-s{seq_length}.npy")


def build_packed_samples(source: DocumentSource, tokenizer: PreTrainedTokenizerFast, seq_length: int,
                         cache_dir: str, *, is_builder: bool | None = None,
                         barrier: Callable[[], None] | None = None,
                         upsample: tuple[int, float, int] | None = None) -> str:
    """Tokenize + pack ``source`` once (cached) and return the ``.npy`` path of its ``[N, S+1]`` int32 samples.

    ``upsample = (min_tokens, factor, seed)`` repeats documents of ``>= min_tokens`` tokens ``factor`` times in
    all (:func:`nxd_lc.data.mixture.upsample_long_documents`, ``data.length_upsampling``).

    Raises:
        ValueError: empty corpus (from :func:`iter_documents`), or fewer than ``seq_length + 1`` tokens
            (names the source's config key and suggests a shorter ``data.seq_length``).
    """
    path = packed_cache_path(cache_dir, source, tokenizer, seq_length, upsample)

    def build(tmp: str) -> None:
        start = time.perf_counter()
        docs: Iterable[Any] = iter_documents(source)
        if not source.pretokenized:
            docs = tokenize_documents(docs, tokenizer)
        if upsample is not None:
            from nxd_lc.data.mixture import upsample_long_documents

            docs = upsample_long_documents((np.asarray(d) for d in docs), upsample[0], upsample[1], upsample[2])
        samples, stats = pack_token_stream(docs, seq_length, None if source.pretokenized else
                                           tokenizer.eos_token_id)
        if stats.num_samples == 0:
            raise ValueError(f"{source.key_name}: {source.path} gives {stats.num_tokens} tokens, fewer than "
                             f"seq_length + 1 = {seq_length + 1}; add text or lower data.seq_length")
        with open(tmp, "wb") as f:
            np.save(f, samples)
        log.info("packed %s: %d documents, %d tokens -> %d samples of %d+1 tokens, %d tail tokens dropped "
                 "(%.1f s) -> %s", source.path, stats.num_documents, stats.num_tokens, stats.num_samples,
                 seq_length, stats.dropped_tokens, time.perf_counter() - start, path)

    if not build_once(path, build, is_builder=is_builder, barrier=barrier):
        log.info("packed samples of %s: reusing cache %s", source.path, path)
    return path


class PackedDataset(torch.utils.data.Dataset):
    """Map-style dataset over a packed ``[N, S + 1]`` int32 array (an in-memory array or a cached ``.npy``).

    A path is memory-mapped lazily in each process, so pickling the dataset into DataLoader workers copies only
    the path. ``dataset[i]`` is the int32 row ``[S + 1]``.

    Args:
        samples: the array, or the path of its ``.npy`` cache.
        seq_length: the run's S; the rows must hold exactly S + 1 tokens (None: any length >= 2).

    Raises:
        ValueError: a cache file that cannot be read, is not a 2-D int32 array, or whose rows are not S + 1 long
            (names the file; the fix is to delete it, it is rebuilt from the data at the next start).
    """

    def __init__(self, samples: np.ndarray | str, seq_length: int | None = None) -> None:
        self._path = samples if isinstance(samples, str) else None
        self._array = None if isinstance(samples, str) else samples
        arr = self._load()
        what = f"packed-sample cache {self._path}" if self._path is not None else "packed samples"
        fix = ("; delete it, it is rebuilt from the data at the next start" if self._path is not None else "")
        if arr.ndim != 2 or arr.shape[1] < 2:
            raise ValueError(f"{what} must be [N, seq_length + 1] with seq_length >= 1, got {arr.shape}{fix}")
        if arr.dtype != np.int32:
            raise ValueError(f"{what} holds {arr.dtype} values, not int32 token ids{fix}")
        if seq_length is not None and arr.shape[1] != seq_length + 1:
            raise ValueError(f"{what} holds rows of {arr.shape[1]} tokens, but data.seq_length + 1 = "
                             f"{seq_length + 1}{fix}")
        self.num_samples, self.seq_length = arr.shape[0], arr.shape[1] - 1

    def _load(self) -> np.ndarray:
        """The array (memory-mapped from the cache file on first use).

        Raises:
            ValueError: the cache file is truncated or not an ``.npy`` array (names it; it is rebuilt when deleted).
        """
        if self._array is None:
            try:
                self._array = np.load(self._path, mmap_mode="r")
            except (ValueError, OSError, EOFError, SyntaxError, tokenize.TokenError) as e:
                # numpy parses a damaged header with ast / tokenize: SyntaxError, tokenize.TokenError
                raise ValueError(f"packed-sample cache {self._path} cannot be read ({type(e).__name__}: {e}): it is "
                                 "truncated or damaged; delete it and it is rebuilt from the data at the next "
                                 "start") from e
            arr = self._array
            size = os.path.getsize(self._path)
            if isinstance(arr, np.memmap) and arr.offset + arr.nbytes != size:  # bytes after the array: not ours
                self._array = None
                raise ValueError(f"packed-sample cache {self._path} holds {size} bytes, but its header describes "
                                 f"{arr.offset + arr.nbytes} ({arr.shape} {arr.dtype}): it is damaged or was "
                                 "appended to; delete it and it is rebuilt from the data at the next start")
        return self._array

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        if self._path is not None:
            state["_array"] = None
        return state

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> np.ndarray:
        return np.asarray(self._load()[index])

    def max_token_id(self) -> int:
        """Largest token id in the samples (-1 when empty); reads the whole array."""
        return self.token_range()[1]

    def token_range(self) -> tuple[int, int]:
        """``(min, max)`` token id of the samples (``(0, -1)`` when empty); one pass over the (mapped) array."""
        arr = self._load()
        return (int(arr.min()), int(arr.max())) if arr.size else (0, -1)

    def check_token_ids(self, vocab_size: int) -> None:
        """Refuse ids outside ``[0, vocab_size)`` in a cache built from text by the run's tokenizer (such ids can
        only come from a damaged or foreign cache file).

        Raises:
            ValueError: names the file, the id, and the fix (delete it, it is rebuilt).
        """
        low, high = self.token_range()
        if low < 0 or high >= vocab_size:
            bad = low if low < 0 else high
            raise ValueError(f"packed-sample cache {self._path} holds token id {bad}, outside [0, {vocab_size}) "
                             "(the model's vocab_size); it is damaged or not this run's: delete it, it is rebuilt "
                             "from the data at the next start")
