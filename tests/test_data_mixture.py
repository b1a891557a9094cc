"""Long-context data: weighted mixtures (deterministic schedule, exact resume), ProLong length upsampling, and the
synthetic long-dependency source (documents consistent with their needles, held-out stream)."""

from __future__ import annotations

import os
import sysconfig
from typing import Any

import numpy as np
import pytest

from nxd_lc.config.schema import DataConfig, TokenizerConfig
from nxd_lc.data.datamodule import PretrainingDataModule
from nxd_lc.data.mixture import MixtureDataset, blend_schedule, upsample_long_documents
from nxd_lc.data.sampler import PretrainingSampler
from nxd_lc.data.synthetic import synthetic_rows
from nxd_lc.data.tokenizer import train_bytelevel_bpe

pytestmark = pytest.mark.compat  # torch-2.9 compatibility subset (lane 2; docs/testing.md)


def test_blend_schedule_proportions_and_wrap() -> None:
    source, row = blend_schedule([0.7, 0.3], [100, 5], 1000)
    assert np.bincount(source).tolist() == [700, 300]
    for i in range(1, 1001):  # every prefix is within one sample of its share
        counts = np.bincount(source[:i], minlength=2)
        assert abs(counts[0] - 0.7 * i) < 1 + 1e-9 and abs(counts[1] - 0.3 * i) < 1 + 1e-9
    assert row[source == 1].tolist() == [k % 5 for k in range(300)]  # the small source repeats in order
    assert row[source == 0].tolist() == [k % 100 for k in range(700)]
    again = blend_schedule([7, 3], [100, 5], 1000)  # weights are normalised; deterministic
    assert (again[0] == source).all() and (again[1] == row).all()


def test_mixture_dataset_rows_and_errors() -> None:
    a = np.arange(30, dtype=np.int32).reshape(10, 3)
    b = -np.arange(6, dtype=np.int32).reshape(2, 3) - 1
    mix = MixtureDataset([a, b], [1.0, 1.0], num_samples=8)
    assert [mix[i].tolist() for i in range(4)] == [a[0].tolist(), b[0].tolist(), a[1].tolist(), b[1].tolist()]
    assert mix[5].tolist() == b[0].tolist() and mix.counts() == [4, 4] and mix.seq_length == 2
    with pytest.raises(ValueError, match="weights must be > 0"):
        MixtureDataset([a, b], [1.0, 0.0])
    with pytest.raises(ValueError, match="rows of different lengths"):
        MixtureDataset([a, np.zeros((2, 4), np.int32)], [1.0, 1.0])


def test_length_upsampling_repeats_long_documents_only() -> None:
    docs = [np.full(n, i) for i, n in enumerate([10, 50, 60, 5, 45])]
    out = list(upsample_long_documents(iter(docs), min_tokens=40, factor=3.0, seed=1))
    assert [d[0] for d in out[:5]] == [0, 1, 2, 3, 4]  # originals first, in order
    extra = sorted(int(d[0]) for d in out[5:])
    assert extra == [1, 1, 2, 2, 4, 4]
    many = [np.full(50, i) for i in range(2000)]
    n_extra = len(list(upsample_long_documents(iter(many), 40, 1.5, seed=2))) - 2000
    assert 900 < n_extra < 1100  # factor 1.5: half of the long documents get one copy
    assert list(upsample_long_documents(iter(docs), 100, 2.0, 0)) == docs  # none long enough
    with pytest.raises(ValueError, match="data.length_upsampling"):
        list(upsample_long_documents(iter(docs), 10, 0.5, 0))


@pytest.fixture(scope="module")
def tok() -> Any:
    root = sysconfig.get_paths()["stdlib"]
    texts = [open(os.path.join(root, n)).read() for n in ("bisect.py", "heapq.py", "textwrap.py", "calendar.py")]
    return train_bytelevel_bpe(texts, 800)


def test_synthetic_rows_are_consistent_documents(tok: Any) -> None:
    hay = tok.encode(open(os.path.join(sysconfig.get_paths()["stdlib"], "shlex.py")).read())
    eos = tok.eos_token_id
    rows = synthetic_rows(tok, hay, tasks=["passkey", "niah_single"], seq_length=767, num_rows=6, seed=3,
                          split="train", min_length=300, eos_id=eos)
    assert rows.shape == (6, 768) and rows.dtype == np.int32
    assert (rows == synthetic_rows(tok, hay, tasks=["passkey", "niah_single"], seq_length=767, num_rows=6, seed=3,
                                   split="train", min_length=300, eos_id=eos)).all()
    val = synthetic_rows(tok, hay, tasks=["passkey", "niah_single"], seq_length=767, num_rows=6, seed=3,
                         split="val", min_length=300, eos_id=eos)
    assert not (val == rows).all(axis=1).any()  # the held-out stream shares no row
    docs = 0
    for r in rows:
        assert r[-1] == eos  # every row ends a document
        ends = np.flatnonzero(r == eos)
        starts = [0] + [e + 1 for e in ends[:-1]]
        for s, e in zip(starts, ends):
            assert e - s + 1 >= 300  # every document at least min_length (eos included)
            text = tok.decode(r[s:e].tolist())
            if "pass key" in text:
                key = text.rsplit("The pass key is ", 1)[1].rstrip(".")
                assert f"The pass key is {key}. Remember it. {key} is the pass key." in text
            else:
                q_key = text.rsplit("The special magic number for ", 1)[1].split(" is:")[0]
                value = text.rsplit(" is:", 1)[1].strip().rstrip(".")
                assert f"The special magic number for {q_key} is: {value}." in text.rsplit("\n", 1)[0]
            docs += 1
    assert docs > 6  # rows hold several documents
    with pytest.raises(ValueError, match=r"data.mixture\[\].min_length: 20 tokens are too few"):
        synthetic_rows(tok, hay, tasks=["passkey"], seq_length=767, num_rows=1, seed=0, split="train",
                       min_length=20, eos_id=eos)


def _corpus(root: str) -> None:
    src = sysconfig.get_paths()["stdlib"]
    os.makedirs(root, exist_ok=True)
    for n in ("bisect.py", "heapq.py", "textwrap.py", "calendar.py", "shlex.py", "string.py", "fractions.py",
              "numbers.py", "queue.py", "statistics.py"):
        with open(os.path.join(src, n)) as f, open(os.path.join(root, n), "w") as g:
            g.write(f.read())


def _dm(tmp: Any, **data_kw: Any) -> PretrainingDataModule:
    cfg = DataConfig(micro_batch_size=2, global_batch_size=4, train_dir=str(tmp / "corpus"), val_fraction=0.3,
                     tokenizer=TokenizerConfig(type="bytelevel_bpe", vocab_size=800, train_max_bytes=400_000,
                                               cache_dir=str(tmp / "cache")), **data_kw)
    dm = PretrainingDataModule(cfg, seq_length=511, seed=5, model_vocab_size=800, data_parallel_rank=0,
                               data_parallel_size=1, global_batch_size=4)
    dm.setup("fit")
    return dm


def test_datamodule_mixture_with_synthetic_source_resumes_exactly(tmp_path: Any) -> None:
    _corpus(str(tmp_path / "corpus"))
    plain = _dm(tmp_path)
    mix = [{"source": "corpus", "weight": 3.0},
           {"source": "synthetic", "weight": 1.0, "tasks": ["passkey", "niah_multikey"], "num_samples": 12,
            "min_length": 256}]
    dm = _dm(tmp_path, mixture=mix)
    train = dm.train_dataset
    assert isinstance(train, MixtureDataset) and len(train) == len(plain.train_dataset) + 12
    n_corpus, n_syn = train.counts()
    assert abs(n_corpus - 0.75 * len(train)) <= 1 and abs(n_syn - 0.25 * len(train)) <= 1
    syn = train.datasets[1]
    assert len(syn) == 12 and all(syn[i][-1] == dm.eos_token_id for i in range(12))
    assert np.array_equal(train[0], plain.train_dataset[0])  # the first sample is the corpus's first row
    val = dm.val_dataset
    assert isinstance(val, MixtureDataset) and len(val.datasets[1]) == 8  # synthetic held-out stream
    assert not any(np.array_equal(val.datasets[1][i], syn[j]) for i in range(8) for j in range(12))
    # a second start (cached files) gives the same samples, and the sampler resumes them exactly
    again = _dm(tmp_path, mixture=mix)
    assert all(np.array_equal(again.train_dataset[i], train[i]) for i in range(len(train)))
    full = [b for _, b in zip(range(6), PretrainingSampler(len(train), 0, 2, 0, 1, seed=5, global_batch_size=4))]
    resumed = [b for _, b in zip(range(4), PretrainingSampler(len(train), 8, 2, 0, 1, seed=5, global_batch_size=4))]
    assert resumed[:2] == full[4:6]  # consumed_samples 8 = 4 micro-batches of 2


def test_datamodule_length_upsampling_changes_the_corpus_only(tmp_path: Any) -> None:
    _corpus(str(tmp_path / "corpus"))
    plain = _dm(tmp_path)
    up = _dm(tmp_path, length_upsampling={"min_tokens": 3000, "factor": 2.0})
    assert len(up.train_dataset) > len(plain.train_dataset)
    assert len(up.val_dataset) == len(plain.val_dataset)  # held-out data is not upsampled
