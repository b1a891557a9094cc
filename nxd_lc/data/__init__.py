"""Pretraining data: a chain of small stages (source -> tokenize -> pack -> sampler -> collate).

* :mod:`~nxd_lc.data.corpus`: the built-in ``python_stdlib`` corpus and the by-file train/val split.
* :mod:`~nxd_lc.data.sources`: text / jsonl / ``datasets`` document sources.
* :mod:`~nxd_lc.data.tokenizer`: HF tokenizer dirs, cached byte-level BPE training, ``build_once`` cache helper.
* :mod:`~nxd_lc.data.packing`: tokenize + pack into ``[N, seq_length + 1]`` samples (cached ``.npy``).
* :mod:`~nxd_lc.data.sampler`: Megatron-style ``PretrainingSampler`` with exact resume.
* :mod:`~nxd_lc.data.datamodule`: ``PretrainingDataModule`` (Lightning).
"""

from nxd_lc.data.datamodule import PretrainingDataModule, collate_packed
from nxd_lc.data.packing import PackedDataset, build_packed_samples, pack_token_stream
from nxd_lc.data.sampler import PretrainingSampler
from nxd_lc.data.sources import DocumentSource, iter_documents, resolve_source, split_source
from nxd_lc.data.tokenizer import EOS_TOKEN, build_once, check_vocab, load_tokenizer

__all__ = [
    "EOS_TOKEN", "DocumentSource", "PackedDataset", "PretrainingDataModule", "PretrainingSampler",
    "build_once", "build_packed_samples", "check_vocab", "collate_packed", "iter_documents", "load_tokenizer",
    "pack_token_stream", "resolve_source", "split_source",
]
