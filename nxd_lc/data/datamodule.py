"""Lightning data module for pretraining: source -> tokenizer -> packed samples -> sampler -> collate.

Batches are dicts of ``[B, S]`` tensors (B = micro batch, S = seq_length): ``input_ids`` int64 (tokens
``sample[:-1]``), ``labels`` int64 (``sample[1:]``, the next token at each position; -100 = no loss),
``position_ids`` int64 and ``segment_ids`` int32. ``data.cross_document_attention`` chooses how packed documents
see each other (see :func:`nxd_lc.data.packing.packed_document_ids`):

* false (default, ProLong): attention stays inside each document; ``position_ids`` restart at 0 after every EOS,
  ``segment_ids`` number the documents of the row, and the label of each EOS position is -100 (the first token
  of the next document is not predictable from the EOS's own document);
* true (Nemotron-UltraLong): the row attends causally as a whole; ``position_ids`` are ``0..S-1`` and
  ``segment_ids`` are all 0.

With ``data.data_prefix`` the samples come from Megatron indexed data (:mod:`nxd_lc.data.megatron_dataset`) and
Megatron's ``reset_position_ids`` / ``reset_attention_mask`` / ``eod_mask_loss`` replace
``cross_document_attention`` (false above is all three true; true is all three false).

Resume contract: the module keeps ``consumed_samples`` (samples consumed over ALL data-parallel ranks). The
training code must call :meth:`PretrainingDataModule.advance` with ``global_batch_size`` after every optimizer
step (e.g. from the LightningModule's ``on_train_batch_end`` when an optimizer step happened, or a callback).
Lightning saves :meth:`state_dict` in checkpoints and calls :meth:`load_state_dict` on restore, before
``train_dataloader()``, so the sampler built there continues exactly where the checkpointed run stopped.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import numpy as np
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader

from nxd_lc.config.access import num_microbatches
from nxd_lc.config.schema import DataConfig
from nxd_lc.data.mixture import MixtureDataset
from nxd_lc.data.packing import (
    PackedDataset,
    build_packed_samples,
    mask_document_end_labels,
    packed_document_ids,
)
from nxd_lc.data.sampler import GroupedBatchSampler, PretrainingSampler
from nxd_lc.data.sources import DocumentSource, builtin_source, iter_documents, resolve_source, split_source
from nxd_lc.data.tokenizer import DEFAULT_CACHE_DIR, check_vocab, load_tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

log = logging.getLogger(__name__)


def collate_packed(rows: list[np.ndarray], *, eos_id: int | None = None,
                   cross_document_attention: bool = False) -> dict[str, torch.Tensor]:
    """Stack packed rows ``[S + 1]`` into ``{input_ids, labels, position_ids, segment_ids}``, each ``[B, S]``.

    Args:
        rows: packed samples (``sample[:-1]`` are the inputs, ``sample[1:]`` the labels).
        eos_id: the document separator. None means no boundaries are known: every row is one document.
        cross_document_attention: ``data.cross_document_attention`` (module doc).
    Returns:
        int64 ``input_ids``, ``labels``, ``position_ids`` and int32 ``segment_ids`` (module doc).
    """
    per_document = not cross_document_attention
    return collate_documents(rows, eos_id=eos_id, reset_position_ids=per_document,
                             reset_attention_mask=per_document, eod_mask_loss=per_document)


def collate_documents(rows: list[np.ndarray], *, eos_id: int | None, reset_position_ids: bool,
                      reset_attention_mask: bool, eod_mask_loss: bool) -> dict[str, torch.Tensor]:
    """:func:`collate_packed` with Megatron's three document switches (``get_ltor_masks_and_position_ids``), each
    applied after every ``eos_id`` (EOD) in the inputs; ``eos_id`` None: no switch has an effect.

    Args:
        rows: int ``[S + 1]`` samples; a -100 entry is a position without a token (input id 0, label -100).
        reset_position_ids: position ids restart at 0 after each EOD (else ``0..S-1``).
        reset_attention_mask: tokens after an EOD do not attend to it or anything before it (``segment_ids``
            number the documents; else all 0).
        eod_mask_loss: no loss (label -100) at positions whose input is the EOD.
    Returns:
        int64 ``input_ids``, ``labels``, ``position_ids`` and int32 ``segment_ids``, each ``[B, S]``.
    """
    samples = torch.from_numpy(np.stack(rows).astype(np.int64))
    batch, seq = samples.shape[0], samples.shape[1] - 1
    input_ids, labels = samples[:, :-1].clamp(min=0), samples[:, 1:].contiguous()
    position_ids = torch.arange(seq, dtype=torch.long).unsqueeze(0).repeat(batch, 1)
    segment_ids = torch.zeros(batch, seq, dtype=torch.int32)
    if eos_id is not None and (reset_position_ids or reset_attention_mask):
        doc_positions, doc_segments = packed_document_ids(input_ids, eos_id)
        position_ids = doc_positions if reset_position_ids else position_ids
        segment_ids = doc_segments if reset_attention_mask else segment_ids
    if eos_id is not None and eod_mask_loss:
        labels = mask_document_end_labels(labels, input_ids, eos_id)
    return {"input_ids": input_ids, "labels": labels, "position_ids": position_ids, "segment_ids": segment_ids}


class PretrainingDataModule(pl.LightningDataModule):
    """Packed causal-LM pretraining data with Megatron-style sampling and exact resume.

    Args:
        data_cfg: the ``data:`` section.
        seq_length: S, tokens per training sequence (``data.seq_length`` or ``model.encoder_seq_length``).
        seed: the top-level ``seed`` (shuffling).
        model_vocab_size: the model's vocab_size; the tokenizer / pretokenized ids must fit.
        data_parallel_rank, data_parallel_size: this rank's DP coordinate.
        global_batch_size: samples per optimizer step over all DP ranks.
        barrier: optional callable all ranks reach after local rank 0 built a cache (else ranks poll the file).
    Raises:
        ValueError: bad sizes (here), or (in ``setup``) a bad corpus / tokenizer, each naming its ``data.*`` key.
    """

    def __init__(self, data_cfg: DataConfig, *, seq_length: int, seed: int, model_vocab_size: int,
                 data_parallel_rank: int, data_parallel_size: int, global_batch_size: int,
                 barrier: Callable[[], None] | None = None) -> None:
        super().__init__()
        if seq_length < 1:
            raise ValueError(f"data.seq_length: must be >= 1, got {seq_length}; set data.seq_length or "
                             "model.encoder_seq_length")
        num_microbatches(global_batch_size, data_cfg.micro_batch_size, data_parallel_size)  # ValueError if not whole
        self.cfg = data_cfg.resolved()  # unset pretraining / alignment keys at their effective values
        self.seq_length = seq_length
        self.seed = seed
        self.model_vocab_size = model_vocab_size
        self.data_parallel_rank = data_parallel_rank
        self.data_parallel_size = data_parallel_size
        self.global_batch_size = global_batch_size
        #: micro-batches per training batch: 1, or num_microbatches under pipeline parallelism (set by train.py)
        self.micro_batches_per_batch = 1
        self.barrier = barrier
        self.consumed_samples = 0
        self._tokenizer: PreTrainedTokenizerFast | None = None
        self.train_dataset: PackedDataset | None = None
        self.val_dataset: PackedDataset | None = None

    # ---- preparation -------------------------------------------------------------------------------------
    def _sources(self) -> tuple[DocumentSource, DocumentSource | None]:
        """(train, val) sources; val is None when ``val_dir`` is unset and ``val_fraction`` is 0."""
        c = self.cfg
        if c.train_dir is not None:
            src = resolve_source(c.train_dir, file_glob=c.file_glob, text_key=c.text_key)
        elif c.builtin_corpus is not None:
            src = builtin_source(c.builtin_corpus)
        else:
            raise ValueError("data.train_dir: not set; point it at text files/jsonl/a datasets dir, or set "
                             "data.builtin_corpus: python_stdlib")
        if c.val_dir is not None:
            return src, resolve_source(c.val_dir, file_glob=c.file_glob, text_key=c.text_key,
                                       key_name="data.val_dir")
        if c.val_fraction == 0.0:
            return src, None
        train, val = split_source(src, c.val_fraction)
        return train, val

    def setup(self, stage: str | None = None) -> None:
        """Load/train the tokenizer and build/load the packed train and val samples (idempotent).

        Local rank 0 of each node builds the caches; other ranks wait for them (see ``build_once``).
        """
        if self.train_dataset is not None:
            return
        if self.cfg.data_prefix is not None:
            self._setup_megatron()
            return
        train_src, val_src = self._sources()
        cache_dir = self.cfg.tokenizer.cache_dir or DEFAULT_CACHE_DIR
        texts: Callable[[], Iterable[str]] | None = None if train_src.pretokenized else (
            lambda: iter_documents(train_src))
        self._tokenizer = load_tokenizer(self.cfg.tokenizer, texts, cache_dir,
                                         corpus_fingerprint=train_src.fingerprint(), barrier=self.barrier)
        check_vocab(self._tokenizer, self.model_vocab_size)
        self.train_dataset = self._packed(train_src, cache_dir, upsample=True)
        if val_src is not None:
            try:
                self.val_dataset = self._packed(val_src, cache_dir)
            except ValueError as e:
                if self.cfg.val_dir is not None:
                    raise
                raise ValueError(f"data.val_fraction: the held-out split ({self.cfg.val_fraction}) of the train "
                                 f"corpus gives no validation samples ({e}); set data.val_dir, raise "
                                 f"data.val_fraction, or set it to 0 to disable validation") from e
        if self.cfg.mixture:
            self.train_dataset, self.val_dataset = self._mixture(cache_dir, self.train_dataset, self.val_dataset)
        self._check_val_size()

    def _setup_megatron(self) -> None:
        """``data.data_prefix``: the tokenizer (its EOD id and size only) and the Megatron indexed-data samples
        (:mod:`nxd_lc.data.megatron_dataset`)."""
        from nxd_lc.data.megatron_dataset import build_datasets

        self._tokenizer = load_tokenizer(self.cfg.tokenizer, None, barrier=self.barrier, require_fast=False)
        check_vocab(self._tokenizer, self.model_vocab_size)
        self.train_dataset, self.val_dataset = build_datasets(
            self.cfg, seq_length=self.seq_length, seed=self.seed, vocab_limit=self.model_vocab_size,
            barrier=self.barrier)
        if self.cfg.validation_drop_last:
            self._check_val_size()

    def _mixture(self, cache_dir: str, train: PackedDataset, val: PackedDataset | None
                 ) -> tuple[MixtureDataset, MixtureDataset | None]:
        """``data.mixture``: the weighted train mixture and the held-out mixture of the sources that have one
        (``corpus``: the configured corpus; a path: its own ``val_fraction`` split; ``synthetic``: its own seed
        stream over held-out haystacks)."""
        c = self.cfg.resolved()
        trains: list[Any] = []
        vals: list[Any] = []
        wt: list[float] = []
        wv: list[float] = []
        for i, entry in enumerate(c.mixture or []):
            kind, weight = entry["source"], float(entry["weight"])
            if kind == "corpus":
                tr, va = train, val
            elif kind == "synthetic":
                tr = self._checked(self._synthetic(entry, "train", train, cache_dir))
                va = self._checked(self._synthetic(entry, "val", val, cache_dir)) if val is not None else None
            else:
                src = resolve_source(kind, file_glob=c.file_glob, text_key=c.text_key,
                                     key_name=f"data.mixture[{i}].source")
                src_train, src_val = split_source(src, c.val_fraction) if c.val_fraction else (src, None)
                tr = self._packed(src_train, cache_dir, upsample=True)
                va = self._packed(src_val, cache_dir) if src_val is not None else None
            trains.append(tr)
            wt.append(weight)
            if va is not None:
                vals.append(va)
                wv.append(weight)
        mix = MixtureDataset(trains, wt)
        log.info("data.mixture: %d train samples from %s (weights %s)", len(mix), mix.counts(), wt)
        return mix, (MixtureDataset(vals, wv) if vals else None)

    def _synthetic(self, entry: dict[str, Any], split: str, haystack: PackedDataset, cache_dir: str) -> str:
        """Cached ``.npy`` of a synthetic mixture entry's rows for ``split`` (haystacks from ``haystack``: the
        corpus split of the same name)."""
        import hashlib
        import os

        from nxd_lc.config.access import resolve_path
        from nxd_lc.data.synthetic import synthetic_rows
        from nxd_lc.data.tokenizer import build_once, tokenizer_fingerprint

        tasks = list(entry.get("tasks", ["passkey"]))
        n = int(entry.get("num_samples", 1024))
        n = n if split == "train" else max(8, n // 20)
        min_length = int(entry.get("min_length", 256))
        rows = [np.asarray(haystack[i][:-1]) for i in range(min(len(haystack), -(-200_000 // self.seq_length)))]
        hay = np.concatenate(rows).tolist()
        key = hashlib.sha256(repr((1, tokenizer_fingerprint(self.tokenizer), tasks, n, min_length, self.seq_length,
                                   self.seed, split, hashlib.sha256(np.asarray(hay, np.int64).tobytes()).hexdigest())
                                  ).encode()).hexdigest()[:24]
        path = os.path.join(resolve_path(cache_dir), "packed", f"synthetic-{key}-s{self.seq_length}.npy")

        def build(tmp: str) -> None:
            arr = synthetic_rows(self.tokenizer, hay, tasks=tasks, seq_length=self.seq_length, num_rows=n,
                                 seed=self.seed, split=split, min_length=min_length, eos_id=self.eos_token_id)
            with open(tmp, "wb") as f:
                np.save(f, arr)
            log.info("synthetic %s data (%s): %d rows of %d+1 tokens -> %s", split, ", ".join(tasks), n,
                     self.seq_length, path)

        os.makedirs(os.path.dirname(path), exist_ok=True)
        build_once(path, build, barrier=self.barrier)
        return path

    def _packed(self, src: DocumentSource, cache_dir: str, upsample: bool = False) -> PackedDataset:
        up = self.cfg.length_upsampling
        spec = (int(up["min_tokens"]), float(up["factor"]), self.seed) if up and upsample else None
        path = build_packed_samples(src, self.tokenizer, self.seq_length, cache_dir, barrier=self.barrier,
                                    upsample=spec)
        if not src.pretokenized:
            return self._checked(path)
        ds = PackedDataset(path, seq_length=self.seq_length)
        top = ds.max_token_id()
        if top >= self.model_vocab_size:
            raise ValueError(f"{src.key_name}: token id {top} in {src.path} is >= the model vocab_size "
                             f"{self.model_vocab_size} (model.model_config); the data was tokenized for "
                             "another vocabulary")
        return ds

    def _checked(self, path: str) -> PackedDataset:
        """The packed cache ``path`` of this run's tokenizer, verified: rows of ``seq_length + 1`` int32 ids within
        the model's vocabulary (else ValueError naming the file: delete it, it is rebuilt)."""
        ds = PackedDataset(path, seq_length=self.seq_length)
        ds.check_token_ids(self.model_vocab_size)
        return ds

    #: the advice of a too-small ``data.val_dir`` (each data module's own: only keys it reads)
    VALIDATION_FIX = ("add validation text to data.val_dir, or remove data.val_dir (validation then holds out "
                      "data.val_fraction of the training text; data.val_fraction: 0 disables it)")

    def _check_val_size(self) -> None:
        if self.val_dataset is None:
            return
        step = self.cfg.micro_batch_size * self.data_parallel_size
        if len(self.val_dataset) < step:
            key = "data.val_dir" if self.cfg.val_dir is not None else "data.val_fraction"
            fix = self.VALIDATION_FIX if self.cfg.val_dir is not None else (
                "raise data.val_fraction, give validation text in data.val_dir, or set data.val_fraction: 0 to "
                "disable validation")
            if self.cfg.data_prefix is not None:
                key, fix = "data.splits_string", ("raise the validation share, set data.validation_drop_last: false "
                                                  "(pads it), or give the validation share 0 to disable validation")
            raise ValueError(f"{key}: validation gives {len(self.val_dataset)} samples, fewer than "
                             f"micro_batch_size x DP = {step}; {fix}")

    # ---- public state ------------------------------------------------------------------------------------
    @property
    def tokenizer(self) -> PreTrainedTokenizerFast:
        """The tokenizer (available after :meth:`setup`)."""
        if self._tokenizer is None:
            raise RuntimeError("PretrainingDataModule.setup() has not run yet")
        return self._tokenizer

    @property
    def eos_token_id(self) -> int:
        """Id of the document separator (EOS) token."""
        return int(self.tokenizer.eos_token_id)

    def advance(self, num_samples: int) -> None:
        """Record ``num_samples`` consumed over all DP ranks; call with ``global_batch_size`` per optimizer step.

        Raises:
            ValueError: ``num_samples`` negative.
        """
        if num_samples < 0:
            raise ValueError(f"advance(num_samples={num_samples}): must be >= 0")
        self.consumed_samples += int(num_samples)

    def state_dict(self) -> dict[str, Any]:
        """``{'consumed_samples': int}``: saved by Lightning into checkpoints."""
        return {"consumed_samples": self.consumed_samples}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore ``consumed_samples`` (Lightning calls this before ``train_dataloader()`` on resume).

        Raises:
            ValueError: the key is missing.
        """
        if "consumed_samples" not in state_dict:
            raise ValueError(f"datamodule state has no 'consumed_samples' (keys: {sorted(state_dict)}); the "
                             "checkpoint was not written by PretrainingDataModule")
        self.consumed_samples = int(state_dict["consumed_samples"])

    # ---- loaders -----------------------------------------------------------------------------------------
    def train_sampler(self) -> PretrainingSampler:
        """Sampler over the packed train samples starting at the current ``consumed_samples``."""
        if self.train_dataset is None:
            raise RuntimeError("PretrainingDataModule.setup() has not run yet")
        # data_prefix: the dataset holds the seeded order; dataloader_type cyclic reshuffles it every epoch
        shuffle = self.cfg.dataloader_type == "cyclic" if self.cfg.data_prefix is not None else self.cfg.shuffle
        return PretrainingSampler(len(self.train_dataset), self.consumed_samples, self.cfg.micro_batch_size,
                                  self.data_parallel_rank, self.data_parallel_size, self.seed,
                                  shuffle=shuffle, global_batch_size=self.global_batch_size)

    def train_dataloader(self) -> DataLoader:
        """Training batches (dicts, see module doc) for this DP rank, resuming at ``consumed_samples``; with
        ``micro_batches_per_batch = n > 1`` (pipeline parallelism) each batch holds the ``n`` micro-batches of
        one optimizer step (``n x micro_batch_size`` rows)."""
        sampler: Any = self.train_sampler()
        if self.micro_batches_per_batch > 1:
            sampler = GroupedBatchSampler(sampler, self.micro_batches_per_batch)
        return self._loader(self.train_dataset, sampler)

    def val_dataloader(self) -> DataLoader | list:
        """One sequential pass over the held-out samples, each DP rank its own slice ([] without validation). Every
        validation pass starts at the first held-out sample, also after a resume, so ``trainer.limit_val_batches``
        reads the same batches each time (a fixed validation set, as NeMo / Megatron)."""
        if self.val_dataset is None:
            return []
        dataset: Any = self.val_dataset
        if self.cfg.data_prefix is not None and not self.cfg.validation_drop_last:
            from nxd_lc.data.megatron_dataset import PaddedDataset, padded_length

            step = self.cfg.micro_batch_size * self.data_parallel_size
            multiple = self.global_batch_size if self.cfg.pad_samples_to_global_batch_size else step
            dataset = PaddedDataset(dataset, padded_length(len(dataset), multiple), len(dataset[0]))
        sampler = PretrainingSampler(len(dataset), 0, self.cfg.micro_batch_size, self.data_parallel_rank,
                                     self.data_parallel_size, self.seed, shuffle=False, rewind=True)
        return self._loader(dataset, sampler)

    def collate_fn(self) -> Callable[[list[np.ndarray]], dict[str, torch.Tensor]]:
        """The batch collate function: :func:`collate_documents` with Megatron's EOD switches (``data_prefix``) or
        the ones ``cross_document_attention`` implies (module doc)."""
        c = self.cfg
        if c.data_prefix is not None:
            flags = (c.reset_position_ids, c.reset_attention_mask, c.eod_mask_loss)
        else:
            flags = (not c.cross_document_attention,) * 3
        return functools.partial(collate_documents, eos_id=self.eos_token_id, reset_position_ids=flags[0],
                                 reset_attention_mask=flags[1], eod_mask_loss=flags[2])

    def _loader(self, dataset: PackedDataset | None, sampler: Any) -> DataLoader:
        collate = self.collate_fn()
        return DataLoader(dataset, batch_sampler=sampler, num_workers=self.cfg.num_workers,
                          collate_fn=collate, persistent_workers=False)
