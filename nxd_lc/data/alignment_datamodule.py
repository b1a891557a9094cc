"""``ModelAlignmentDataModule``: SFT / DPO / ORPO data (read -> format -> truncate -> pack -> sampler -> collate).

Sources (``data.train_dir`` / ``data.val_dir``): a ``.jsonl`` (or JSON-lines ``.json``) file, a directory of
them (sorted, recursive), or a ``datasets`` ``save_to_disk`` directory (a ``DatasetDict``: split ``train`` for
train_dir; ``validation`` / ``valid`` / ``val`` / ``test`` for val_dir, else ``train``). ``data.dev_choose_samples``
keeps the first N records. Records go through :mod:`~nxd_lc.data.alignment_format` (formats, chat templates,
tool calls, target masks) and :mod:`~nxd_lc.data.alignment_packing` (truncation, BFD packing, rows).

Files are found and read as in :mod:`~nxd_lc.data.sources` (each real file once, UTF-8 only, JSON checked by
:func:`nxd_lc.config.input_files.parse_json`). Schemas are kept exactly: jsonl is read with the ``json`` module,
record by record, never through pyarrow / ``datasets``, which unify the schema of all records and fill every key a
record lacks with null (a tool whose parameters are ``{city}`` would gain ``query: null`` from another record).
Arrow data has already been unified when it was saved, so the reader (:func:`clean_arrow_record`) parses ``tools``
stored as a JSON string and removes null-valued keys inside ``messages`` / ``prompt`` / ``chosen`` / ``rejected`` /
``tools`` (a filled null cannot be told from a real one there: store tools and tool-call arguments as JSON strings
to keep real nulls); the number of records affected is logged.

Batches (dicts of tensors; B = ``data.micro_batch_size``, S = seq_length; row layout in ``alignment_packing``):

* SFT: ``input_ids``, ``labels``, ``position_ids`` int64 and ``segment_ids`` int32, each ``[B, S]``. With
  ``sft.packing`` a row holds several examples (document-masked); else one example padded to S. A micro batch
  is B rows either way, and ``data.global_batch_size`` counts rows.
* DPO / ORPO: B pairs become ``[2B, S]`` tensors with the same four keys: rows ``0..B-1`` are ``prompt + chosen``
  and rows ``B..2B-1`` are ``prompt + rejected`` of the same pairs in the same order (one forward pass; split with
  ``chunk(2)``), plus ``sample_index`` int64 ``[B]``: the dataset index of each pair (key for cached reference
  log-probs). Pairs are not packed. ``data.micro_batch_size`` / ``global_batch_size`` count pairs (NxDT).

Validation data comes from ``data.val_dir`` only (``data.val_fraction`` is a pretraining key, not used here).
Resume and sampling are those of :class:`~nxd_lc.data.datamodule.PretrainingDataModule` (Megatron sampler over
rows / pairs, ``consumed_samples`` in the checkpoint). Tokenized data is rebuilt at each ``setup`` (no cache).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.utils.data
from torch.utils.data import DataLoader

from nxd_lc.config.access import resolve_path
from nxd_lc.config.alignment_schema import ModelAlignmentStrategyConfig, resolved_max_prompt_length
from nxd_lc.config.errors import ConfigError
from nxd_lc.config.input_files import glob_files, iter_text_lines, parse_json, read_text
from nxd_lc.config.schema import DataConfig
from nxd_lc.data.alignment_format import RecordFormatter
from nxd_lc.data.alignment_packing import (
    Example,
    TruncationStats,
    best_fit_decreasing,
    build_row,
    fill_ratio,
    prepare_pair,
    prepare_sft_example,
)
from nxd_lc.data.datamodule import PretrainingDataModule
from nxd_lc.data.sources import load_saved_dataset
from nxd_lc.data.tokenizer import BYTELEVEL_BPE, check_vocab, load_tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

log = logging.getLogger(__name__)

_DATASETS_MARKERS = ("dataset_dict.json", "state.json", "dataset_info.json")
_VAL_SPLITS = ("validation", "valid", "val", "test")
_MESSAGE_FIELDS = ("messages", "prompt", "chosen", "rejected", "tools")
Record = tuple[dict[str, Any], str]  # (record, "where": file:line or dir[split]#row, named in errors)


# ---- readers ---------------------------------------------------------------------------------------------------
def read_records(path: str, key_name: str, limit: int | None = None, *, validation: bool = False,
                 file_glob: str = "**/*") -> list[Record]:
    """The records at ``path`` (jsonl file / dir of jsonl / datasets dir), at most the first ``limit``.

    Args:
        path: ``data.train_dir`` / ``data.val_dir``.
        key_name: that key, named in errors.
        limit: ``data.dev_choose_samples``.
        validation: prefer a validation split of a ``DatasetDict``.
        file_glob: ``data.file_glob``: pattern inside a directory; of its matches the .jsonl / .json files are read.

    Raises:
        FileNotFoundError: nothing at ``path`` (names ``key_name``).
        ValueError: a bad JSON line or a non-object record (names file and line), a file that is not UTF-8 text
            (names file, line and byte), a damaged datasets directory, no records.
    """
    full = resolve_path(path)
    if os.path.isdir(full) and any(os.path.isfile(os.path.join(full, m)) for m in _DATASETS_MARKERS):
        records = list(_limited(_iter_arrow(full, validation, key_name), limit))
    elif os.path.isdir(full) or os.path.isfile(full):
        files = [full] if os.path.isfile(full) else [
            f for f in glob_files(os.path.join(full, file_glob), key=key_name) if f.endswith((".jsonl", ".json"))]
        if not files:
            raise ValueError(f"{key_name}: {full} holds no .jsonl / .json files matching data.file_glob "
                             f"{file_glob!r} and is not a datasets directory")
        records = list(_limited((r for f in files for r in _iter_jsonl(f, key_name)), limit))
    else:
        raise FileNotFoundError(f"{key_name}: no such file or directory: {full}")
    if not records:
        raise ValueError(f"{key_name}: {full} holds no records")
    return records


def _limited(it: Iterator[Record], limit: int | None) -> Iterator[Record]:
    for n, rec in enumerate(it):
        if limit is not None and n >= limit:
            return
        yield rec


def _iter_jsonl(path: str, key_name: str) -> Iterator[Record]:
    with open(path, "rb") as f:
        head = f.read(4)
    if head.removeprefix(b"\xef\xbb\xbf")[:1] == b"[":  # a .json file holding one array of records
        yield from ((rec, f"{path}[{i}]") for i, rec in enumerate(_json_array(read_text(path, key=key_name), path)))
        return
    for lineno, line in iter_text_lines(path, key=key_name):
        if not line.strip():
            continue
        try:
            rec = parse_json(line, path, line=lineno)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg}); one JSON object per line") from e
        if not isinstance(rec, dict):
            raise ValueError(f"{path}:{lineno}: a record must be a JSON object, got {type(rec).__name__}")
        yield rec, f"{path}:{lineno}"


def _json_array(text: str, path: str) -> list[dict[str, Any]]:
    try:
        recs = parse_json(text, path)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e.msg} at line {e.lineno}); a .json data file holds one array "
                         "of record objects (or one object per line)") from e
    if not isinstance(recs, list):
        raise ValueError(f"{path}: a .json data file starting with '[' must be one array of records, got a JSON "
                         f"{type(recs).__name__}")
    for i, rec in enumerate(recs):
        if not isinstance(rec, dict):
            raise ValueError(f"{path}[{i}]: a record must be a JSON object, got {type(rec).__name__}")
    return recs


def _iter_arrow(path: str, validation: bool, key_name: str) -> Iterator[Record]:
    import datasets

    ds = load_saved_dataset(path, key_name)
    split = None
    if isinstance(ds, datasets.DatasetDict):
        names = list(ds.keys())
        wanted = [s for s in (_VAL_SPLITS if validation else ()) if s in ds] + ["train"]
        split = next((s for s in wanted if s in ds), names[0])
        ds = ds[split]
    nulls = 0
    for i, row in enumerate(ds):
        rec, removed = clean_arrow_record(row, f"{path}[{split or 'dataset'}]#{i}")
        nulls += removed
        yield rec, f"{path}[{split or 'dataset'}]#{i}"
    if nulls:
        log.warning("%s: removed null-valued keys from %d records (arrow fills keys a record lacks with null); "
                    "store tools / tool-call arguments as JSON strings to keep real nulls", path, nulls)


def _strip_nulls(obj: Any) -> tuple[Any, bool]:
    if isinstance(obj, dict):
        out, removed = {}, False
        for k, v in obj.items():
            if v is None:
                removed = True
                continue
            out[k], r = _strip_nulls(v)
            removed |= r
        return out, removed
    if isinstance(obj, list):
        items = [_strip_nulls(v) for v in obj]
        return [v for v, _ in items], any(r for _, r in items)
    return obj, False


def clean_arrow_record(row: dict[str, Any], where: str = "dataset row") -> tuple[dict[str, Any], bool]:
    """A dataset row with ``tools`` JSON strings parsed and null-filled keys removed (module doc).

    Args:
        row: the row as ``datasets`` gives it.
        where: the row, named in errors (``<dir>[split]#<row>``).
    Returns:
        ``(record, removed)``: the cleaned record and whether any null was removed.
    Raises:
        ValueError: ``tools`` is a string that is not JSON (or JSON nested too deep / with out-of-range numbers).
    """
    rec, removed = dict(row), False
    if isinstance(rec.get("tools"), str):
        try:
            rec["tools"] = parse_json(rec["tools"], f"{where} 'tools'")
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: 'tools' is a string but not JSON ({e.msg})") from e
    for key in _MESSAGE_FIELDS:
        if isinstance(rec.get(key), (list, dict)):
            rec[key], r = _strip_nulls(rec[key])
            removed |= r
    return rec, removed


# ---- datasets and collation --------------------------------------------------------------------------------------
class SFTRowsDataset(torch.utils.data.Dataset):
    """Rows of SFT examples: ``dataset[i]`` is :func:`build_row` of the examples in ``rows[i]`` (``[S]`` arrays)."""

    def __init__(self, examples: list[Example], rows: list[list[int]], seq_length: int, pad_id: int,
                 packed: bool) -> None:
        self.examples, self.rows = examples, rows
        self.seq_length, self.pad_id, self.packed = seq_length, pad_id, packed

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        return build_row([self.examples[i] for i in self.rows[index]], self.seq_length, self.pad_id, self.packed)


class PreferenceDataset(torch.utils.data.Dataset):
    """Preference pairs: ``dataset[i]`` is ``{"chosen": row, "rejected": row, "index": i}`` (unpacked rows)."""

    def __init__(self, pairs: list[tuple[Example, Example]], seq_length: int, pad_id: int) -> None:
        self.pairs, self.seq_length, self.pad_id = pairs, seq_length, pad_id

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, index: int) -> dict[str, Any]:
        chosen, rejected = self.pairs[index]
        return {"chosen": build_row([chosen], self.seq_length, self.pad_id, False),
                "rejected": build_row([rejected], self.seq_length, self.pad_id, False), "index": index}


def collate_rows(rows: list[dict[str, np.ndarray]]) -> dict[str, torch.Tensor]:
    """Stack ``[S]`` rows into ``[B, S]`` tensors (int64; ``segment_ids`` int32)."""
    return {k: torch.from_numpy(np.stack([r[k] for r in rows])) for k in rows[0]}


def collate_pairs(items: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """B pairs -> ``[2B, S]`` tensors, chosen rows first, and ``sample_index`` int64 ``[B]`` (module doc)."""
    batch = collate_rows([it["chosen"] for it in items] + [it["rejected"] for it in items])
    batch["sample_index"] = torch.tensor([it["index"] for it in items], dtype=torch.long)
    return batch


# ---- the data module -------------------------------------------------------------------------------------------
class ModelAlignmentDataModule(PretrainingDataModule):
    """SFT / DPO / ORPO data with Megatron-style sampling and exact resume (module doc for the batch layout).

    Args:
        data_cfg: the ``data:`` section with the alignment keys (``dev_choose_samples``, ``input_key``,
            ``output_key``, ``tokenizer.chat_template``; see ``nxd_lc.config.alignment_schema``).
        alignment_cfg: ``model_alignment_strategy`` (exactly one of sft / dpo / orpo).
        seq_length, seed, model_vocab_size, data_parallel_rank, data_parallel_size, global_batch_size, barrier:
            as :class:`~nxd_lc.data.datamodule.PretrainingDataModule`.
        tokenizer: an already loaded tokenizer (tests); default: ``data.tokenizer.type`` (an HF tokenizer dir).
    Attributes (after ``setup``):
        train_stats, val_stats: :class:`TruncationStats` per split (val None without ``val_dir``).
        train_fill_ratio, val_fill_ratio: non-padding share of the rows' tokens.
    Raises:
        ValueError: bad sizes / sections (here), or bad data / tokenizer (``setup``), naming the key.
    """

    #: validation comes from data.val_dir only (data.val_fraction is a pretraining key, refused here)
    VALIDATION_FIX = "add records to data.val_dir, or remove data.val_dir to train without validation"

    def __init__(self, data_cfg: DataConfig, alignment_cfg: ModelAlignmentStrategyConfig, *, seq_length: int,
                 seed: int, model_vocab_size: int, data_parallel_rank: int, data_parallel_size: int,
                 global_batch_size: int, tokenizer: PreTrainedTokenizerFast | None = None,
                 barrier: Callable[[], None] | None = None) -> None:
        super().__init__(data_cfg, seq_length=seq_length, seed=seed, model_vocab_size=model_vocab_size,
                         data_parallel_rank=data_parallel_rank, data_parallel_size=data_parallel_size,
                         global_batch_size=global_batch_size, barrier=barrier)
        self.alignment_cfg = alignment_cfg
        self.algorithm = alignment_cfg.algorithm
        self._tokenizer = tokenizer
        self.train_stats: TruncationStats | None = None
        self.val_stats: TruncationStats | None = None
        self.train_fill_ratio: float | None = None
        self.val_fill_ratio: float | None = None

    @property
    def num_truncated(self) -> int:
        """Truncated records over train and val (after ``setup``)."""
        return sum(s.num_truncated for s in (self.train_stats, self.val_stats) if s is not None)

    @property
    def num_dropped(self) -> int:
        """Dropped records over train and val (after ``setup``)."""
        return sum(s.num_dropped for s in (self.train_stats, self.val_stats) if s is not None)

    @property
    def pad_token_id(self) -> int:
        """Padding id: the tokenizer's pad token, else its EOS."""
        pad = self.tokenizer.pad_token_id
        return int(self.tokenizer.eos_token_id if pad is None else pad)

    def _load_tokenizer(self) -> PreTrainedTokenizerFast:
        if self._tokenizer is None:
            if self.cfg.tokenizer.type == BYTELEVEL_BPE:
                raise ValueError("data.tokenizer.type: alignment fine-tuning needs the pretrained model's tokenizer "
                                 "directory, not 'bytelevel_bpe'")
            self._tokenizer = load_tokenizer(self.cfg.tokenizer, None, barrier=self.barrier)
        check_vocab(self._tokenizer, self.model_vocab_size)
        return self._tokenizer

    def setup(self, stage: str | None = None) -> None:
        """Load the tokenizer, then read, format, truncate and (SFT) pack train and val (idempotent).

        Raises:
            ValueError / FileNotFoundError: bad paths, records, templates or sizes, naming the key or file:line.
        """
        if self.train_dataset is not None:
            return
        if self.cfg.train_dir is None:
            raise ValueError(f"data.train_dir: not set; model_alignment_strategy.{self.algorithm} needs a .jsonl "
                             "file, a directory of .jsonl files or a datasets save_to_disk directory")
        tok = self._load_tokenizer()
        formatter = RecordFormatter(tok, self.cfg.tokenizer.chat_template, input_key=self.cfg.input_key,
                                    output_key=self.cfg.output_key)
        self.train_dataset, self.train_stats, self.train_fill_ratio = self._build(formatter, self.cfg.train_dir,
                                                                                  "data.train_dir")
        if self.cfg.val_dir is not None:
            self.val_dataset, self.val_stats, self.val_fill_ratio = self._build(formatter, self.cfg.val_dir,
                                                                                "data.val_dir")
        self._check_val_size()

    def _build(self, formatter: RecordFormatter, path: str,
               key: str) -> tuple[torch.utils.data.Dataset, TruncationStats, float]:
        records = read_records(path, key, self.cfg.dev_choose_samples, validation=key == "data.val_dir",
                               file_glob=self.cfg.file_glob)
        stats = TruncationStats()
        if self.algorithm == "sft":
            dataset, lengths, rows = self._sft_dataset(formatter, records, stats)
        else:
            dataset, lengths, rows = self._pair_dataset(formatter, records, stats)
        ratio = fill_ratio(lengths, rows, self.seq_length)
        level = logging.WARNING if stats.num_truncated or stats.num_dropped else logging.INFO
        log.log(level, "%s (%s): %d records -> %d kept, %d truncated, %d dropped (%d over-long, %d truncated to no "
                "target, %d without any target%s); %d %s of %d tokens, fill ratio %.3f", key, self.algorithm,
                stats.num_records, stats.num_kept, stats.num_truncated, stats.num_dropped, stats.num_dropped_overlong,
                stats.num_dropped_no_target, stats.num_dropped_empty,
                f", e.g. {', '.join(stats.empty_records)}" if stats.empty_records else "", len(dataset),
                "rows" if self.algorithm == "sft" else "pairs", self.seq_length, ratio)
        if not len(dataset):
            # a ConfigError: train.py prints it as "error: ..." with exit status 2, as the validation's problems
            raise ConfigError([f"{key}: no usable records in {resolve_path(path)}: "
                               + "; ".join(self._drop_causes(stats))])
        return dataset, stats, ratio

    def _drop_causes(self, stats: TruncationStats) -> list[str]:
        """Each cause of dropped records with its count and its fix (for the no-usable-records error)."""
        seq, sub = self.seq_length, f"model_alignment_strategy.{self.algorithm}"
        causes = []
        if stats.num_dropped_empty:
            causes.append(f"{stats.num_dropped_empty} of {stats.num_records} records have no target token (e.g. "
                          f"{', '.join(stats.empty_records)}): their output / chosen / rejected text is empty after "
                          "an empty prompt, or they have no assistant turn; fix or remove those records")
        if stats.num_dropped_no_target:
            fix = f"lower {sub}.max_prompt_length" if self.algorithm != "sft" else f"set {sub}.truncation_mode: " \
                "keep_end"
            causes.append(f"{stats.num_dropped_no_target} lost every target token to truncation at data.seq_length "
                          f"{seq} (the prompt fills it): raise data.seq_length or {fix}")
        if stats.num_dropped_overlong:
            causes.append(f"{stats.num_dropped_overlong} were longer than data.seq_length {seq} and dropped "
                          f"({sub}.drop_overlong): raise data.seq_length or set {sub}.drop_overlong: false")
        return causes or [f"{stats.num_records} records read, none kept"]

    def _sft_dataset(self, formatter: RecordFormatter, records: list[Record],
                     stats: TruncationStats) -> tuple[SFTRowsDataset, list[int], list[list[int]]]:
        sft = self.alignment_cfg.sft
        examples = []
        for rec, where in records:
            ex = prepare_sft_example(formatter.encode_sft(rec, where), self.seq_length, sft.truncation_mode,
                                     sft.drop_overlong, stats, where)
            if ex is not None:
                examples.append(ex)
        lengths = [ids.shape[0] for ids, _ in examples]
        rows = best_fit_decreasing(lengths, self.seq_length) if sft.packing else [[i] for i in range(len(examples))]
        return SFTRowsDataset(examples, rows, self.seq_length, self.pad_token_id, sft.packing), lengths, rows

    def _pair_dataset(self, formatter: RecordFormatter, records: list[Record],
                      stats: TruncationStats) -> tuple[PreferenceDataset, list[int], list[list[int]]]:
        sub = getattr(self.alignment_cfg, self.algorithm)
        max_prompt = resolved_max_prompt_length(sub.max_prompt_length, self.seq_length)
        key = f"model_alignment_strategy.{self.algorithm}"
        pairs = []
        for rec, where in records:
            pair = prepare_pair(formatter.encode_preference(rec, where), self.seq_length, max_prompt,
                                sub.truncation_mode, stats, key=key, where=where)
            if pair is not None:
                pairs.append(pair)
        lengths = [ex[0].shape[0] for pair in pairs for ex in pair]
        return PreferenceDataset(pairs, self.seq_length, self.pad_token_id), lengths, [[i] for i in
                                                                                       range(len(lengths))]

    def _loader(self, dataset: torch.utils.data.Dataset | None, sampler: Any) -> DataLoader:
        collate = collate_rows if self.algorithm == "sft" else collate_pairs
        return DataLoader(dataset, batch_sampler=sampler, num_workers=self.cfg.num_workers, collate_fn=collate,
                          persistent_workers=False)
