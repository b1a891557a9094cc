"""Training samples from Megatron indexed data (``data.data_prefix``), as Megatron-LM's ``GPTDataset`` builds them.

Keys (``data.*``; effective defaults in :data:`nxd_lc.config.schema.MEGATRON_DATA_KEY_DEFAULTS`):

* ``data_prefix``: a prefix string, a blend ``[w1, prefix1, w2, prefix2, ...]`` (a list of prefixes only: equal
  weights), or ``{train: blend, validation: blend, test: blend}`` (``train`` required; no ``splits_string``).
* ``splits_string`` ``"a,b,c"``: each prefix's documents ``[0, n)`` are cut into train / validation / test ranges by
  Megatron's rule (:func:`split_indices`): shares normalised to sum 1, each boundary ``round(share * n)`` added up,
  then all boundaries shifted so the last is ``n``. The test range (and the ``test`` blend of the dict form) is held
  out: nxd_lc, like NxDT's training script, runs no test loop.
* A document is one sequence of the ``.idx`` (Megatron's GPTDataset counts sequences).

Samples of one split of one prefix (:class:`GPTSamples`): the split's documents in a seeded random order (file
order with ``data.shuffle: false``) are concatenated into one token stream of ``T`` tokens (documents carry their
EOD when preprocessed with ``--append-eod``); sample ``j`` is ``stream[j*S : j*S + S + 1]`` (``S`` = seq_length;
neighbours share one token), ``N = (T - 1) // S``; with ``no_seqlen_plus_one_input_tokens`` it is
``stream[j*S : (j+1)*S]`` plus a -100 entry (``N = T // S``), so its last position has no label. Sample ``i`` of
the dataset is sample ``shuffle[i]`` (a seeded permutation; identity with ``data.shuffle: false``). Several prefixes
are blended by weight (:class:`nxd_lc.data.mixture.MixtureDataset`, Megatron's BlendableDataset schedule).
Differences from Megatron: one pass over the documents is an epoch (Megatron concatenates as many epochs as the
run needs, each reshuffled); the random streams are numpy's ``default_rng`` seeded with ``(seed, split, prefix
index)``, so orders are deterministic but not Megatron's bit for bit.

The index arrays (document order, cumulative document ends, sample permutation) are built once per node and cached
as ``.npy`` files in ``<index_mapping_dir or the prefix's directory>/<prefix name>-<split>-<key>-index/`` (key: the
prefix path, the SHA-256 of its whole ``.idx`` -- every sequence's size and pointer, so reordered or resized data
never reuses an index --, the document range, S, seed, shuffle and the extra token), then memory-mapped by every
rank and DataLoader worker. The arrays are checked on load (shapes, dtypes, the stream length, positions in range);
an index that does not fit is built again with a warning by the builder (local rank 0); a rank that still finds
it damaged after the build stops naming it.

Token ids: each ``.bin`` is scanned once (its id range cached next to the index, :func:`check_token_ids`) and every
row again when read, in the file's dtype before the int32 cast, so ids >= the model's vocab_size, negative ids or
int64 ids that would wrap around in int32 stop the run naming the file and the sequence.

Rows are int32 ``[S + 1]``; -100 marks a position without a token (the no-plus-one tail, validation padding):
the collate function reads it as no label and input id 0.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch.utils.data

from nxd_lc.config.access import resolve_path
from nxd_lc.config.schema import MEGATRON_DATA_KEY_DEFAULTS, DataConfig
from nxd_lc.data.megatron_indexed import IndexedDataset, data_path, index_path, token_id_error
from nxd_lc.data.tokenizer import build_once, default_is_builder

log = logging.getLogger(__name__)

SPLITS = ("train", "validation", "test")
IGNORE = -100  # a row entry without a token
_FORMAT_VERSION = "megatron-index-v2"
_INT32_LIMIT = 2**31  # rows are int32: a larger id would wrap around
Blend = list[tuple[float, str]]


@dataclass(frozen=True)
class DataPrefix:
    """Parsed ``data.data_prefix``: ``blends[split]`` = [(weight, prefix)]; the single key ``"all"`` when the
    prefixes are divided by ``data.splits_string``."""

    blends: dict[str, Blend]

    @property
    def by_splits_string(self) -> bool:
        """Whether ``splits_string`` divides the documents (list / string form)."""
        return "all" in self.blends

    def prefixes(self) -> list[str]:
        """Every prefix named, in order."""
        return [p for blend in self.blends.values() for _, p in blend]


def _blend(value: Any, key: str) -> Blend:
    if isinstance(value, str):
        return [(1.0, value)]
    if not isinstance(value, Sequence) or not value:
        raise ValueError(f"{key}: expected a prefix or a non-empty list [w1, prefix1, ...], got {value!r}")
    items = list(value)
    if all(isinstance(v, str) for v in items):
        return [(1.0, v) for v in items]
    pairs = list(zip(items[0::2], items[1::2]))
    if len(items) % 2 or any(isinstance(w, bool) or not isinstance(w, (int, float)) or not isinstance(p, str)
                             for w, p in pairs):
        raise ValueError(f"{key}: expected [w1, prefix1, w2, prefix2, ...] (number, path pairs), got {items!r}")
    if any(w <= 0 for w, _ in pairs):
        raise ValueError(f"{key}: blend weights must be > 0, got {[w for w, _ in pairs]}")
    return [(float(w), p) for w, p in pairs]


def parse_data_prefix(value: Any) -> DataPrefix:
    """Parse ``data.data_prefix`` (module doc).

    Raises:
        ValueError: any other shape, a non-positive weight, an unknown or missing dict key (names the key).
    """
    if isinstance(value, Mapping):
        unknown = sorted(set(value) - set(SPLITS))
        if unknown or value.get("train") is None:
            raise ValueError(f"data.data_prefix: a dict needs a 'train' blend and only the keys {list(SPLITS)}, got "
                             f"{sorted(value)}")
        return DataPrefix({s: _blend(value[s], f"data.data_prefix.{s}") for s in SPLITS if value.get(s) is not None})
    return DataPrefix({"all": _blend(value, "data.data_prefix")})


def parse_splits_string(text: str) -> list[float]:
    """``"980,10,10"`` (or ``/``-separated; missing shares are 0) -> three shares summing to 1.

    Raises:
        ValueError: not 1-3 non-negative numbers with a positive sum (names ``data.splits_string``).
    """
    parts = [p.strip() for p in str(text).replace("/", ",").split(",")]
    try:
        shares = [float(p) for p in parts]
    except ValueError:
        shares = []
    if not 1 <= len(shares) <= 3 or any(s < 0 for s in shares) or sum(shares) <= 0:
        raise ValueError(f"data.splits_string: {text!r} is not 1-3 comma-separated shares >= 0 with a positive sum "
                         "(train,validation,test, e.g. 980,10,10)")
    shares += [0.0] * (3 - len(shares))
    return [s / sum(shares) for s in shares]


def split_indices(shares: Sequence[float], num_documents: int) -> list[int]:
    """Megatron's document boundaries ``[0, end_train, end_validation, num_documents]`` (module doc)."""
    bounds = [0]
    for share in shares:
        bounds.append(bounds[-1] + int(round(share * float(num_documents))))
    excess = bounds[-1] - num_documents
    return [0] + [b - excess for b in bounds[1:]]


def build_index(sizes: np.ndarray, seq_length: int, rng: np.random.Generator | None,
                add_extra_token: bool = True) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(doc_order, doc_ends, shuffle)`` of one split (module doc).

    Args:
        sizes: tokens of each document of the split (in file order).
        rng: shuffles documents, then samples; None keeps both in order.
    Returns:
        int64 ``doc_order [D]`` (positions into ``sizes``), ``doc_ends [D]`` (stream offset after each ordered
        document) and ``shuffle [N]`` (sample order).
    """
    doc_order = np.arange(len(sizes), dtype=np.int64)
    if rng is not None:
        rng.shuffle(doc_order)
    doc_ends = np.cumsum(np.asarray(sizes, dtype=np.int64)[doc_order])
    total = int(doc_ends[-1]) if len(doc_ends) else 0
    n = max(0, (total - int(add_extra_token)) // seq_length)
    shuffle = rng.permutation(n).astype(np.int64) if rng is not None else np.arange(n, dtype=np.int64)
    return doc_order, doc_ends, shuffle


class GPTSamples(torch.utils.data.Dataset):
    """Samples of documents ``[lo, hi)`` of one indexed dataset (module doc); ``dataset[i]`` is int32 ``[S + 1]``.

    Args:
        indexed: the prefix's :class:`IndexedDataset`.
        doc_range: ``(lo, hi)`` sequence indices of the split.
        seq_length: S.
        seed: the run's seed (with ``stream``: the split and prefix position) or None for file order.
        add_extra_token: false for ``no_seqlen_plus_one_input_tokens``.
        cache_dir: ``index_mapping_dir`` (None: the prefix's directory).
        vocab_limit: token ids must be below it (the model's vocab_size).
        barrier: see :func:`nxd_lc.data.tokenizer.build_once`.
    Raises:
        ValueError: the split has fewer tokens than one sample; the cache directory is not writable.
    """

    def __init__(self, indexed: IndexedDataset, doc_range: tuple[int, int], seq_length: int, *, seed: int | None,
                 stream: tuple[int, ...] = (), add_extra_token: bool = True, cache_dir: str | None = None,
                 vocab_limit: int | None = None, split: str = "train",
                 barrier: Callable[[], None] | None = None) -> None:
        self.indexed, self.seq_length, self.extra = indexed, seq_length, int(add_extra_token)
        self.lo, self.vocab_limit = doc_range[0], vocab_limit
        sizes = indexed.sizes[doc_range[0]:doc_range[1]]
        parts = (_FORMAT_VERSION, os.path.abspath(indexed.prefix), indexed.content_digest, doc_range, seq_length,
                 seed, stream, self.extra)
        key = hashlib.sha256(repr(parts).encode()).hexdigest()[:16]
        root = resolve_path(cache_dir) if cache_dir else os.path.dirname(os.path.abspath(indexed.prefix))
        self.cache = os.path.join(root, f"{os.path.basename(indexed.prefix)}-{split}-{key}-index")
        total = int(sizes.sum(dtype=np.int64))
        self._expected = (len(sizes), total, max(0, (total - self.extra) // seq_length))
        self._arrays: dict[str, np.ndarray] | None = None

        def build(tmp: str) -> None:
            rng = None if seed is None else np.random.default_rng([seed, *stream])
            os.makedirs(tmp)
            for name, arr in zip(("doc_order", "doc_ends", "shuffle"), build_index(sizes, seq_length, rng,
                                                                                 add_extra_token)):
                np.save(os.path.join(tmp, name + ".npy"), arr)

        builder = default_is_builder()
        if builder and os.path.exists(self.cache):
            problem = self._cache_problem()
            if problem:
                log.warning("the sample index %s does not fit %s (%s): building it again", self.cache,
                            indexed.prefix, problem)
                shutil.rmtree(self.cache, ignore_errors=True)
                if os.path.lexists(self.cache):
                    os.remove(self.cache)
        try:
            build_once(self.cache, build, is_builder=builder, barrier=barrier)
        except PermissionError as e:
            raise ValueError(f"data.index_mapping_dir: cannot write the sample index {self.cache} ({e}); set "
                             "data.index_mapping_dir to a writable directory") from e
        problem = self._cache_problem()
        if problem:
            raise ValueError(f"data.index_mapping_dir: the sample index {self.cache} does not fit {indexed.prefix} "
                             f"({problem}); delete it, it is rebuilt at the next start")
        self.num_samples = len(self._load()["shuffle"])
        if self.num_samples == 0:
            raise ValueError(f"data.splits_string: the {split} split of {indexed.prefix} (documents {doc_range}) has "
                             f"{total} tokens, fewer than one sample of {seq_length + self.extra}; lower "
                             "data.seq_length or give the split a larger share")

    def _cache_problem(self) -> str | None:
        """Why the cached index arrays do not fit this split (None when they do): unreadable files, shapes or
        dtypes, the stream length, or positions out of range (min / max over the maps, no copies)."""
        self._arrays = None
        docs, total, n = self._expected
        try:
            a = self._load()
        except (OSError, ValueError, EOFError) as e:
            self._arrays = None
            return f"cannot be read: {e}"
        for name, length in (("doc_order", docs), ("doc_ends", docs), ("shuffle", n)):
            if a[name].dtype != np.int64 or a[name].shape != (length,):
                return f"{name}.npy is {a[name].dtype} {a[name].shape}, expected int64 ({length},)"
        if docs and (int(a["doc_ends"][-1]) != total or int(a["doc_order"].min()) < 0
                     or int(a["doc_order"].max()) >= docs or int(a["doc_ends"].min()) < 0):
            return "its document order or ends do not match the data's sequence sizes"
        if n and (int(a["shuffle"].min()) < 0 or int(a["shuffle"].max()) >= n):
            return "its sample order points outside the samples"
        return None

    def _load(self) -> dict[str, np.ndarray]:
        if self._arrays is None:
            self._arrays = {n: np.load(os.path.join(self.cache, n + ".npy"), mmap_mode="r")
                            for n in ("doc_order", "doc_ends", "shuffle")}
        return self._arrays

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_arrays": None}

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> np.ndarray:
        a = self._load()
        start, need = int(a["shuffle"][index]) * self.seq_length, self.seq_length + self.extra
        k = int(np.searchsorted(a["doc_ends"], start, side="right"))
        pieces, offset = [], start - (int(a["doc_ends"][k - 1]) if k else 0)
        limit = _INT32_LIMIT if self.vocab_limit is None else self.vocab_limit
        while need:
            doc = self.lo + int(a["doc_order"][k])
            take = min(need, int(self.indexed.sizes[doc]) - offset)
            piece = self.indexed.get(doc, offset, take)
            if piece.size and (int(piece.min()) < 0 or int(piece.max()) >= limit):  # before the int32 cast
                bad = piece[(piece < 0) | (piece >= limit)][0]
                raise token_id_error(self.indexed, doc, int(bad), limit)
            pieces.append(piece)
            need, offset, k = need - take, 0, k + 1
        row = np.concatenate(pieces).astype(np.int32)
        return row if self.extra else np.append(row, np.int32(IGNORE))


def check_token_ids(indexed: IndexedDataset, limit: int, *, cache_dir: str | None = None,
                    barrier: Callable[[], None] | None = None) -> None:
    """Refuse a ``.bin`` with token ids outside ``[0, limit)`` before training (``limit``: the model's vocab_size).

    The id range of each ``.bin`` is computed once by the builder (a vectorised pass over the file) and cached as
    ``<cache dir>/<prefix name>-tokens-<key>.json``, keyed by the ``.idx`` content and the ``.bin``'s size and
    mtime; each sample is checked again when it is read (:class:`GPTSamples`), so a ``.bin`` changed behind the
    cache's back still stops with the same error, naming the sequence.

    Raises:
        ValueError: an id out of range (names the ``.bin``, the sequence and the fix).
    """
    st = os.stat(data_path(indexed.prefix))
    parts = (_FORMAT_VERSION, indexed.content_digest, indexed.dtype.str, st.st_size, st.st_mtime_ns, st.st_ino)
    key = hashlib.sha256(repr(parts).encode()).hexdigest()[:16]
    root = resolve_path(cache_dir) if cache_dir else os.path.dirname(os.path.abspath(indexed.prefix))
    path = os.path.join(root, f"{os.path.basename(indexed.prefix)}-tokens-{key}.json")

    def build(tmp: str) -> None:
        low, high = indexed.token_range()
        with open(tmp, "w") as f:
            json.dump({"min": low, "max": high}, f)

    try:
        build_once(path, build, barrier=barrier)
        with open(path) as f:
            rec = json.load(f)
        low, high = int(rec["min"]), int(rec["max"])
    except PermissionError as e:
        raise ValueError(f"data.index_mapping_dir: cannot write {path} ({e}); set data.index_mapping_dir to a "
                         "writable directory") from e
    except (OSError, ValueError, KeyError, TypeError) as e:
        log.warning("the token-range cache %s cannot be read (%s): scanning %s", path, e, data_path(indexed.prefix))
        low, high = indexed.token_range()
    if low < 0 or high >= limit:
        indexed.check_token_ids(limit)  # locates the sequence for the error


class PaddedDataset(torch.utils.data.Dataset):
    """``dataset`` followed by rows of -100 (no tokens, no labels) up to ``length`` rows (validation padding)."""

    def __init__(self, dataset: Any, length: int, row_length: int) -> None:
        self.dataset, self.length, self.row_length = dataset, length, row_length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> np.ndarray:
        if index < len(self.dataset):
            return self.dataset[index]
        return np.full(self.row_length, IGNORE, dtype=np.int32)


def padded_length(num_samples: int, multiple: int) -> int:
    """``num_samples`` rounded up to a multiple of ``multiple``."""
    return -(-num_samples // multiple) * multiple


def build_datasets(cfg: DataConfig, *, seq_length: int, seed: int, vocab_limit: int | None = None,
                   barrier: Callable[[], None] | None = None) -> tuple[Any, Any | None]:
    """``(train, validation or None)`` datasets of ``cfg.data_prefix`` (``cfg``: resolved ``data``).

    Raises:
        ValueError / FileNotFoundError: bad keys or files (each names its ``data.*`` key).
    """
    from nxd_lc.data.mixture import MixtureDataset

    prefix = parse_data_prefix(cfg.data_prefix)
    indexed: dict[str, IndexedDataset] = {}
    for p in prefix.prefixes():
        if p not in indexed:
            indexed[p] = IndexedDataset(resolve_path(p))
            if cfg.skip_warmup is False:
                indexed[p].warmup()
            check_token_ids(indexed[p], _INT32_LIMIT if vocab_limit is None else vocab_limit,
                            cache_dir=cfg.index_mapping_dir, barrier=barrier)
    shares = parse_splits_string(cfg.splits_string) if prefix.by_splits_string else None
    out: dict[str, Any] = {}
    for s_idx, split in enumerate(SPLITS):
        blend = prefix.blends.get("all" if shares else split)
        if not blend or (shares is not None and shares[s_idx] == 0.0):
            continue
        parts, weights = [], []
        for p_idx, (weight, p) in enumerate(blend):
            ds = indexed[p]
            bounds = split_indices(shares, len(ds)) if shares else [0, len(ds)]
            lo, hi = (bounds[s_idx], bounds[s_idx + 1]) if shares else (0, len(ds))
            if split == "test":
                log.info("data.data_prefix: %s held-out test documents [%d, %d) are not read (no test loop)", p, lo, hi)
                continue
            parts.append(GPTSamples(ds, (lo, hi), seq_length, seed=seed if cfg.shuffle else None,
                                    stream=(s_idx, p_idx), add_extra_token=not cfg.no_seqlen_plus_one_input_tokens,
                                    cache_dir=cfg.index_mapping_dir, vocab_limit=vocab_limit, split=split,
                                    barrier=barrier))
            weights.append(weight)
        if parts:
            out[split] = parts[0] if len(parts) == 1 else MixtureDataset(parts, weights)
            log.info("data.data_prefix %s: %d samples of %d+%d tokens from %d prefix(es)", split, len(out[split]),
                     seq_length, int(not cfg.no_seqlen_plus_one_input_tokens), len(parts))
    return out["train"], out.get("validation")


_SOURCE_KEYS = {"train_dir": "give either data.train_dir or data.data_prefix",
                "builtin_corpus": "give either data.builtin_corpus or data.data_prefix",
                "val_dir": "validation comes from data.splits_string or data_prefix's 'validation' blend",
                "val_fraction": "the validation share is data.splits_string",
                "text_key": "indexed data is already tokenized",
                "cross_document_attention": "use data.reset_attention_mask / reset_position_ids / eod_mask_loss",
                "mixture": "blend prefixes by weight in data.data_prefix: [w1, prefix1, w2, prefix2]",
                "length_upsampling": "not supported with data.data_prefix yet",
                "curriculum": "not supported with data.data_prefix yet"}


def megatron_data_problems(d: DataConfig, *, alignment: bool) -> list[str]:
    """Config errors of the Megatron indexed-data keys (each names its key and the fix). ``d`` is the unresolved
    ``data`` section (an unset key is None)."""
    set_keys = [k for k in MEGATRON_DATA_KEY_DEFAULTS if getattr(d, k) is not None]
    if d.data_prefix is None:
        return [f"data.{k}: applies to Megatron indexed data only; set data.data_prefix or remove it" for k in set_keys]
    p: list[str] = []
    if alignment:
        p.append("data.data_prefix: pretraining data only; alignment (model_alignment_strategy) reads records from "
                 "data.train_dir")
    p += [f"data.{k}: not used with data.data_prefix ({why}); remove it" for k, why in _SOURCE_KEYS.items()
          if getattr(d, k) is not None]
    try:
        prefix = parse_data_prefix(d.data_prefix)
    except ValueError as e:
        return p + [str(e)]
    if d.splits_string is not None and not prefix.by_splits_string:
        p.append("data.splits_string: not used when data.data_prefix is a {train, validation, test} dict; remove it")
    elif prefix.by_splits_string:
        try:
            parse_splits_string(d.splits_string or MEGATRON_DATA_KEY_DEFAULTS["splits_string"])
        except ValueError as e:
            p.append(str(e))
    if d.data_impl not in (None, "mmap"):
        p.append(f"data.data_impl: {d.data_impl!r} is not supported; only 'mmap' (Megatron's memory-mapped "
                 ".bin/.idx, what preprocess_data.py and python -m nxd_lc.data.megatron_indexed write)")
    if d.dataloader_type not in (None, "single", "cyclic"):
        p.append(f"data.dataloader_type: unknown value {d.dataloader_type!r}; choose single or cyclic")
    if d.pad_samples_to_global_batch_size and d.validation_drop_last is not False:
        p.append("data.pad_samples_to_global_batch_size: pads the last partial validation batch, which exists only "
                 "with data.validation_drop_last: false; set that, or remove this key")
    if d.tokenizer.type == "bytelevel_bpe" and d.tokenizer.library is None:
        p.append("data.tokenizer.type: 'bytelevel_bpe' is trained on text, but data.data_prefix is already "
                 "tokenized; give the tokenizer the data was preprocessed with")
    return p


def megatron_path_problems(d: DataConfig) -> list[str]:
    """Each prefix of ``data.data_prefix`` must have its ``.bin`` and ``.idx`` (checked at launch)."""
    try:
        prefixes = parse_data_prefix(d.data_prefix).prefixes() if d.data_prefix is not None else []
    except ValueError:
        return []  # reported by megatron_data_problems
    return [f"data.data_prefix: no such file {path}" for p in prefixes
            for path in (index_path(resolve_path(p)), data_path(resolve_path(p))) if not os.path.isfile(path)]
