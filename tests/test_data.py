"""Tests for nxd_lc.data: sources, built-in corpus split, tokenizer cache, packing, sampler, data module."""

from __future__ import annotations

import json
import os
import random
import threading
import time

import numpy as np
import pytest
import torch
from dist_utils import run_distributed

from nxd_lc.config.schema import DataConfig, TokenizerConfig
from nxd_lc.data import corpus, packing, sources, tokenizer
from nxd_lc.data.datamodule import PretrainingDataModule, collate_packed
from nxd_lc.data.sampler import PretrainingSampler

pytestmark = pytest.mark.compat  # torch-2.9 compatibility subset (lane 2; docs/testing.md)

WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa", "lambda", "mu"]


def _write(path: str, text: str) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return path


def _doc(i: int, n_words: int = 40) -> str:
    rng = random.Random(i)
    return " ".join(rng.choice(WORDS) for _ in range(n_words)) + f" doc{i}\n"


def _text_corpus(root: str, n: int = 12) -> str:
    for i in range(n):
        _write(os.path.join(root, f"d{i // 4}", f"f{i:02d}.txt"), _doc(i))
    return root


def _bpe_cfg(cache: str, vocab: int = 300) -> TokenizerConfig:
    return TokenizerConfig(type="bytelevel_bpe", vocab_size=vocab, train_max_bytes=100_000, cache_dir=cache)


# ---- sources ------------------------------------------------------------------------------------------------
def test_directory_and_glob_sources(tmp_path):
    root = _text_corpus(str(tmp_path / "c"), n=6)
    _write(os.path.join(root, "notes.md"), "markdown doc")
    src = sources.resolve_source(root)
    assert src.kind == "text" and len(src.files) == 7
    assert src.files == tuple(sorted(src.files))
    only_txt = sources.resolve_source(root, file_glob="**/*.txt")
    assert len(only_txt.files) == 6
    pattern = sources.resolve_source(os.path.join(root, "d0", "*.txt"))
    assert [os.path.basename(f) for f in pattern.files] == ["f00.txt", "f01.txt", "f02.txt", "f03.txt"]
    assert list(sources.iter_documents(pattern))[1] == _doc(1)
    single = sources.resolve_source(os.path.join(root, "notes.md"))
    assert list(sources.iter_documents(single)) == ["markdown doc"]


def test_jsonl_sources_and_errors(tmp_path):
    good = _write(str(tmp_path / "j" / "a.jsonl"), '{"text": "one"}\n\n{"text": "two", "x": 1}\n')
    _write(str(tmp_path / "j" / "b.jsonl"), '{"text": "three"}\n')
    assert list(sources.iter_documents(sources.resolve_source(good))) == ["one", "two"]
    both = sources.resolve_source(str(tmp_path / "j"))
    assert both.kind == "jsonl" and list(sources.iter_documents(both)) == ["one", "two", "three"]
    bad = _write(str(tmp_path / "bad.jsonl"), '{"text": "ok"}\n{"text": "broken\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: malformed JSON line"):
        list(sources.iter_documents(sources.resolve_source(bad)))
    nokey = _write(str(tmp_path / "nokey.jsonl"), '{"text": "ok"}\n{"body": "x"}\n')
    with pytest.raises(ValueError, match=r"nokey\.jsonl:2: missing key 'text'"):
        list(sources.iter_documents(sources.resolve_source(nokey)))
    custom = sources.resolve_source(nokey, text_key="body")
    with pytest.raises(ValueError, match=r"nokey\.jsonl:1: missing key 'body'"):
        list(sources.iter_documents(custom))


def test_datasets_sources(tmp_path):
    import datasets

    datasets.Dataset.from_dict({"text": ["a b", "", "c d"]}).save_to_disk(str(tmp_path / "ds"))
    src = sources.resolve_source(str(tmp_path / "ds"))
    assert src.kind == "datasets" and not src.pretokenized
    assert list(sources.iter_documents(src)) == ["a b", "c d"]
    datasets.Dataset.from_dict({"input_ids": [[1, 2], [3]]}).save_to_disk(str(tmp_path / "tok"))
    tok = sources.resolve_source(str(tmp_path / "tok"))
    assert tok.pretokenized and list(sources.iter_documents(tok)) == [[1, 2], [3]]
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["t1", "t2"]}),
                               "validation": datasets.Dataset.from_dict({"text": ["v1"]})})
    dd.save_to_disk(str(tmp_path / "dd"))
    train, val = sources.split_source(sources.resolve_source(str(tmp_path / "dd")), 0.1)
    assert list(sources.iter_documents(train)) == ["t1", "t2"]
    assert list(sources.iter_documents(val)) == ["v1"]
    with pytest.raises(ValueError, match="no column 'body'"):
        sources.resolve_source(str(tmp_path / "ds"), text_key="body")


def test_empty_corpus_errors(tmp_path):
    os.makedirs(tmp_path / "empty")
    with pytest.raises(ValueError, match=r"data.train_dir: empty corpus, no files match .*empty"):
        sources.resolve_source(str(tmp_path / "empty"))
    blank = _write(str(tmp_path / "blank.jsonl"), '{"text": ""}\n')
    with pytest.raises(ValueError, match=r"empty corpus, .*blank\.jsonl has no non-empty text.*'text'"):
        list(sources.iter_documents(sources.resolve_source(blank)))
    with pytest.raises(FileNotFoundError, match="data.val_dir: no such file"):
        sources.resolve_source(str(tmp_path / "missing"), key_name="data.val_dir")


def test_split_by_file_and_record(tmp_path):
    root = _text_corpus(str(tmp_path / "c"), n=40)
    src = sources.resolve_source(root)
    train, val = sources.split_source(src, 0.25)
    assert set(train.files).isdisjoint(val.files) and set(train.files) | set(val.files) == set(src.files)
    assert 2 <= len(val.files) <= 20
    recs = sources.resolve_source(_write(str(tmp_path / "r.jsonl"),
                                         "".join(json.dumps({"text": f"d{i}"}) + "\n" for i in range(50))))
    rtrain, rval = sources.split_source(recs, 0.2)
    docs_t, docs_v = list(sources.iter_documents(rtrain)), list(sources.iter_documents(rval))
    assert sorted(docs_t + docs_v) == sorted(f"d{i}" for i in range(50)) and docs_v


def test_stdlib_corpus_split_is_deterministic_and_disjoint():
    root, files = corpus.builtin_corpus_files("python_stdlib")
    assert len(files) > 200 and all(f.endswith(".py") for f in files)
    assert not any("site-packages" in f or "dist-packages" in f for f in files)
    assert files == corpus.python_stdlib_files(root)
    train, val = corpus.split_train_val(files, 0.05, root=root)
    train2, val2 = corpus.split_train_val(list(reversed(files)), 0.05, root=root)
    assert set(train) == set(train2) and set(val) == set(val2)
    assert set(train).isdisjoint(val) and len(train) + len(val) == len(files)
    assert 0.02 < len(val) / len(files) < 0.09
    with pytest.raises(ValueError, match="unknown corpus"):
        corpus.builtin_corpus_files("wikipedia")


# ---- tokenizer ----------------------------------------------------------------------------------------------
def test_bpe_training_and_cache_reuse(tmp_path, monkeypatch):
    texts = [_doc(i) for i in range(30)]
    calls = []
    real_train = tokenizer.train_bytelevel_bpe
    monkeypatch.setattr(tokenizer, "train_bytelevel_bpe", lambda *a, **k: calls.append(1) or real_train(*a, **k))
    cfg = _bpe_cfg(str(tmp_path / "cache"))
    tok = tokenizer.load_tokenizer(cfg, lambda: iter(texts), corpus_fingerprint="fp1", is_builder=True)
    assert calls == [1] and len(tok) <= 300
    assert tok.eos_token == tokenizer.EOS_TOKEN == tok.bos_token == tok.pad_token
    ids = tok("gamma delta\n  ünïcode", add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == "gamma delta\n  ünïcode"
    again = tokenizer.load_tokenizer(cfg, lambda: iter(texts), corpus_fingerprint="fp1", is_builder=True)
    assert calls == [1] and again.get_vocab() == tok.get_vocab()
    tokenizer.load_tokenizer(cfg, lambda: iter(texts), corpus_fingerprint="fp2", is_builder=True)
    assert calls == [1, 1]  # another corpus -> another cache entry
    with pytest.raises(ValueError, match="data.tokenizer.vocab_size"):
        tokenizer.load_tokenizer(_bpe_cfg(str(tmp_path), vocab=100), lambda: iter(texts), is_builder=True)
    hf_dir = tokenizer.bpe_cache_path(cfg, cfg.cache_dir, "fp1")
    from_dir = tokenizer.load_tokenizer(TokenizerConfig(type=hf_dir), None)
    assert from_dir.get_vocab() == tok.get_vocab()


def test_check_vocab_and_bad_type(tmp_path):
    tok = tokenizer.train_bytelevel_bpe([_doc(i) for i in range(5)], 280)
    tokenizer.check_vocab(tok, 280)
    with pytest.raises(ValueError, match=r"data.tokenizer: .*model.model_config\) is 256"):
        tokenizer.check_vocab(tok, 256)
    with pytest.raises(ValueError, match="data.tokenizer.type: 'nope' is neither"):
        tokenizer.load_tokenizer(TokenizerConfig(type="nope"), None)
    with pytest.raises(ValueError, match="already tokenized"):
        tokenizer.load_tokenizer(_bpe_cfg(str(tmp_path)), None)


def test_build_once_waiter_and_race(tmp_path):
    target = str(tmp_path / "artifact")
    seen = {}

    def slow_build(tmp: str) -> None:
        time.sleep(0.3)
        os.makedirs(tmp)
        _write(os.path.join(tmp, "x"), "done")

    waiter = threading.Thread(target=lambda: seen.setdefault(
        "built", tokenizer.build_once(target, slow_build, is_builder=False, poll_s=0.02)))
    waiter.start()
    assert tokenizer.build_once(target, slow_build, is_builder=True) is True
    waiter.join(5)
    assert seen["built"] is False and os.path.isfile(os.path.join(target, "x"))
    assert tokenizer.build_once(target, slow_build, is_builder=True) is False  # exists: no rebuild
    # a builder that loses the race to publish a directory discards its copy
    other = str(tmp_path / "other")
    assert tokenizer.build_once(other, lambda t: (slow_build(t), slow_build(other)), is_builder=True) is False
    assert not [p for p in os.listdir(tmp_path) if ".tmp-" in p]
    with pytest.raises(TimeoutError, match="never"):
        tokenizer.build_once(str(tmp_path / "never"), slow_build, is_builder=False, timeout_s=0.1, poll_s=0.02)


# ---- packing ------------------------------------------------------------------------------------------------
def test_pack_token_stream_eos_and_shift():
    samples, stats = packing.pack_token_stream([[1, 2, 3], [4, 5], [6]], seq_length=3, eos_id=0)
    # stream = 1 2 3 0 4 5 0 6 0 (T=9) -> N = 8 // 3 = 2 windows of 4 with stride 3, tail 2 dropped
    np.testing.assert_array_equal(samples, [[1, 2, 3, 0], [0, 4, 5, 0]])
    assert samples.dtype == np.int32
    assert (stats.num_documents, stats.num_tokens, stats.num_samples, stats.dropped_tokens) == (3, 9, 2, 2)
    raw, _ = packing.pack_token_stream([[1, 2], [3, 4, 5]], seq_length=2, eos_id=None)
    np.testing.assert_array_equal(raw, [[1, 2, 3], [3, 4, 5]])
    batch = collate_packed([samples[0], samples[1]], cross_document_attention=True)
    assert all(batch[k].dtype == torch.long and batch[k].shape == (2, 3) for k in ("input_ids", "labels",
                                                                                   "position_ids"))
    assert batch["segment_ids"].dtype == torch.int32 and not batch["segment_ids"].any()
    torch.testing.assert_close(batch["labels"][:, :-1], batch["input_ids"][:, 1:])
    torch.testing.assert_close(batch["position_ids"], torch.tensor([[0, 1, 2], [0, 1, 2]]))


def test_build_packed_samples_with_tokenizer_and_cache(tmp_path):
    root = _text_corpus(str(tmp_path / "c"), n=6)
    src = sources.resolve_source(root)
    tok = tokenizer.train_bytelevel_bpe(sources.iter_documents(src), 300)
    path = packing.build_packed_samples(src, tok, 16, str(tmp_path / "cache"), is_builder=True)
    ds = packing.PackedDataset(path)
    assert ds.seq_length == 16 and len(ds) > 5
    arr = np.load(path)
    stream = np.concatenate([arr[0]] + [row[1:] for row in arr[1:]])
    eos = tok.eos_token_id
    assert (stream == eos).sum() >= 5  # one EOS after each document seen in the kept part
    first_doc = tok(sources.iter_documents(src).__next__(), add_special_tokens=False)["input_ids"]
    np.testing.assert_array_equal(stream[: len(first_doc)], first_doc)
    assert stream[len(first_doc)] == eos
    mtime = os.path.getmtime(path)
    assert packing.build_packed_samples(src, tok, 16, str(tmp_path / "cache"), is_builder=True) == path
    assert os.path.getmtime(path) == mtime
    with pytest.raises(ValueError, match="fewer than seq_length"):
        packing.build_packed_samples(src, tok, 100_000, str(tmp_path / "cache"), is_builder=True)


# ---- sampler ------------------------------------------------------------------------------------------------
def _take(sampler: PretrainingSampler, n: int) -> list[list[int]]:
    out: list[list[int]] = []
    while len(out) < n:
        for batch in sampler:
            out.append(batch)
            if len(out) == n:
                break
    return out


def test_sampler_dp_slices_cover_each_global_step():
    dp, mb = 3, 2
    streams = [_take(PretrainingSampler(50, 0, mb, r, dp, seed=7), 16) for r in range(dp)]
    for step in range(16):
        parts = [set(streams[r][step]) for r in range(dp)]
        assert all(len(p) == mb for p in parts)
        assert len(set().union(*parts)) == mb * dp  # disjoint
    one_rank = _take(PretrainingSampler(50, 0, mb * dp, 0, 1, seed=7), 16)
    assert [[i for r in range(dp) for i in streams[r][s]] for s in range(16)] == one_rank
    assert len(PretrainingSampler(50, 0, mb, 0, dp, seed=7)) == 50 // 6
    epoch0 = [i for b in _take(PretrainingSampler(50, 0, 6, 0, 1, seed=7), 8) for i in b]
    assert len(set(epoch0)) == 48


def test_sampler_determinism_and_shuffle_modes():
    a = _take(PretrainingSampler(40, 0, 4, 0, 1, seed=3), 20)
    assert a == _take(PretrainingSampler(40, 0, 4, 0, 1, seed=3), 20)
    assert a != _take(PretrainingSampler(40, 0, 4, 0, 1, seed=4), 20)
    assert a[:10] != a[10:20]  # epoch 1 is reshuffled
    seq = _take(PretrainingSampler(10, 0, 2, 1, 2, seed=3, shuffle=False), 3)
    assert seq == [[2, 3], [6, 7], [2, 3]]
    with pytest.raises(ValueError, match="multiple"):
        PretrainingSampler(40, 3, 2, 0, 1, seed=0)
    with pytest.raises(ValueError, match="fewer than one global batch"):
        PretrainingSampler(5, 0, 2, 0, 4, seed=0)


@pytest.mark.parametrize("k", [0, 8, 36, 44, 100])
def test_sampler_resume_is_exact_continuation(k):
    dp, mb, gbs = 2, 2, 8
    full = [_take(PretrainingSampler(45, 0, mb, r, dp, seed=11, global_batch_size=gbs), 40) for r in range(dp)]
    for r in range(dp):
        resumed = _take(PretrainingSampler(45, k, mb, r, dp, seed=11, global_batch_size=gbs), 40 - k // 4)
        assert resumed == full[r][k // (mb * dp):]


def test_validation_sampler_rewinds_every_pass_training_sampler_continues():
    """A pass cut short (``limit_val_batches``) and the next pass: validation reads the same first batches again;
    training continues after the last batch it yielded."""
    def first(sampler: PretrainingSampler, n: int) -> list[list[int]]:
        out = []
        for batch in sampler:
            out.append(batch)
            if len(out) == n:
                return out
        return out

    val = PretrainingSampler(20, 0, 2, 1, 2, seed=0, shuffle=False, rewind=True)
    passes = [first(val, 2) for _ in range(3)]
    assert passes == [[[2, 3], [6, 7]]] * 3
    train = PretrainingSampler(20, 0, 2, 1, 2, seed=0, shuffle=False)
    assert [first(train, 2) for _ in range(2)] == [[[2, 3], [6, 7]], [[10, 11], [14, 15]]]


# ---- data module --------------------------------------------------------------------------------------------
def _dm(tmp_path, rank: int = 0, dp: int = 1, mb: int = 2, val_fraction: float = 0.2,
        **data_kw) -> PretrainingDataModule:
    cfg = DataConfig(micro_batch_size=mb, global_batch_size=4 * dp, train_dir=str(tmp_path / "corpus"),
                     val_fraction=val_fraction, tokenizer=_bpe_cfg(str(tmp_path / "cache")), **data_kw)
    dm = PretrainingDataModule(cfg, seq_length=16, seed=5, model_vocab_size=320, data_parallel_rank=rank,
                               data_parallel_size=dp, global_batch_size=4 * dp)
    dm.setup("fit")
    return dm


def test_validation_passes_read_the_same_batches(tmp_path):
    """Lightning keeps one validation loader over the run and stops each pass at ``limit_val_batches``: every pass
    must start at the first held-out sample (a fixed validation set), not where the previous pass stopped."""
    _text_corpus(str(tmp_path / "corpus"), n=40)
    dm = _dm(tmp_path, val_fraction=0.5)
    loader = dm.val_dataloader()
    assert len(loader) >= 4  # more batches than one cut-short pass reads

    def cut_short_pass() -> list[torch.Tensor]:
        return [b["input_ids"] for _, b in zip(range(2), loader)]

    first, second = cut_short_pass(), cut_short_pass()
    assert all(torch.equal(a, b) for a, b in zip(first, second)) and len(first) == 2
    later = [b["input_ids"] for b in loader][2:3]
    assert not torch.equal(later[0], first[0])  # the set has other batches: the test could tell them apart


def test_datamodule_batches_and_state_dict_round_trip(tmp_path):
    _text_corpus(str(tmp_path / "corpus"), n=24)
    dm = _dm(tmp_path)
    assert dm.eos_token_id == dm.tokenizer.eos_token_id and len(dm.tokenizer) <= 300
    batches = [b for _, b in zip(range(6), dm.train_dataloader())]
    b0 = batches[0]
    assert set(b0) == {"input_ids", "labels", "position_ids", "segment_ids"}
    assert all(v.shape == (2, 16) for v in b0.values()) and b0["segment_ids"].dtype == torch.int32
    assert all(b0[k].dtype == torch.long for k in ("input_ids", "labels", "position_ids"))
    # labels are the next tokens, except at a document-ending EOS (document masking: -100 there)
    not_eos = b0["input_ids"][:, :-1] != dm.eos_token_id
    torch.testing.assert_close(b0["labels"][:, :-1][not_eos], b0["input_ids"][:, 1:][not_eos])
    assert (b0["labels"][:, :-1][~not_eos] == -100).all()
    val = list(dm.val_dataloader())
    assert val and val[0]["input_ids"].shape == (2, 16)
    train_rows = {tuple(r) for r in np.load(dm.train_dataset._path)}
    assert not any(tuple(r) in train_rows for r in np.load(dm.val_dataset._path))
    dm.advance(8)  # two optimizer steps of global_batch_size 4
    state = dm.state_dict()
    assert state == {"consumed_samples": 8}
    restored = _dm(tmp_path)
    restored.load_state_dict(state)
    resumed = [b for _, b in zip(range(2), restored.train_dataloader())]
    for got, want in zip(resumed, batches[4:6]):
        torch.testing.assert_close(got["input_ids"], want["input_ids"])
    with pytest.raises(ValueError, match="consumed_samples"):
        restored.load_state_dict({})


def test_datamodule_dp_ranks_and_vocab_check(tmp_path):
    _text_corpus(str(tmp_path / "corpus"), n=24)
    r0, r1 = _dm(tmp_path, 0, 2), _dm(tmp_path, 1, 2)
    b0, b1 = next(iter(r0.train_dataloader())), next(iter(r1.train_dataloader()))
    assert not torch.equal(b0["input_ids"], b1["input_ids"])
    worker_batch = next(iter(_dm(tmp_path, 0, 2, num_workers=1).train_dataloader()))  # dataset pickles
    torch.testing.assert_close(worker_batch["input_ids"], b0["input_ids"])
    cfg = DataConfig(train_dir=str(tmp_path / "corpus"), tokenizer=_bpe_cfg(str(tmp_path / "cache")))
    small = PretrainingDataModule(cfg, seq_length=16, seed=5, model_vocab_size=200, data_parallel_rank=0,
                                  data_parallel_size=1, global_batch_size=1)
    with pytest.raises(ValueError, match="model.model_config"):
        small.setup("fit")
    with pytest.raises(ValueError, match="data.seq_length: must be >= 1"):
        PretrainingDataModule(cfg, seq_length=0, seed=5, model_vocab_size=320, data_parallel_rank=0,
                              data_parallel_size=1, global_batch_size=1)


def _tiny_lightning_run(tmp_path, max_steps: int, ckpt_in: str | None, ckpt_out: str | None) -> list[torch.Tensor]:
    import pytorch_lightning as pl

    class Recorder(pl.LightningModule):
        def __init__(self, dm: PretrainingDataModule) -> None:
            super().__init__()
            self.dm, self.seen, self.last_step = dm, [], 0
            self.emb = torch.nn.Embedding(320, 4)

        def training_step(self, batch, batch_idx):
            self.seen.append(batch["input_ids"].clone())
            return self.emb(batch["input_ids"]).pow(2).mean()

        def on_train_start(self):
            self.last_step = self.trainer.global_step

        def on_train_batch_end(self, outputs, batch, batch_idx):
            if self.trainer.global_step != self.last_step:  # an optimizer step happened
                self.last_step = self.trainer.global_step
                self.dm.advance(self.dm.global_batch_size)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    dm = _dm(tmp_path)
    model = Recorder(dm)
    trainer = pl.Trainer(max_steps=max_steps, accumulate_grad_batches=2, accelerator="cpu", devices=1,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, limit_val_batches=0, default_root_dir=str(tmp_path))
    trainer.fit(model, datamodule=dm, ckpt_path=ckpt_in)
    if ckpt_out:
        trainer.save_checkpoint(ckpt_out)
    assert dm.consumed_samples == max_steps * dm.global_batch_size
    return model.seen


def test_lightning_checkpoint_resume_continues_data_stream(tmp_path):
    _text_corpus(str(tmp_path / "corpus"), n=24)
    full = _tiny_lightning_run(tmp_path, 14, None, None)
    steps_per_epoch = len(_dm(tmp_path).train_sampler()) // 2
    assert 5 < steps_per_epoch < 14  # the resumed run crosses an epoch boundary
    ckpt = str(tmp_path / "step5.ckpt")
    first = _tiny_lightning_run(tmp_path, 5, None, ckpt)
    second = _tiny_lightning_run(tmp_path, 14, ckpt, None)
    assert len(first) == 10 and len(first) + len(second) == len(full)
    for got, want in zip(first + second, full):
        torch.testing.assert_close(got, want)


def _dist_datamodule_worker(rank: int, world_size: int, tmp: str) -> None:
    from pathlib import Path

    dm = _dm(Path(tmp), rank, world_size)  # LOCAL_RANK 0 builds the caches, rank 1 waits for them
    batch = next(iter(dm.train_dataloader()))
    torch.save(batch["input_ids"], os.path.join(tmp, f"rank{rank}.pt"))


@pytest.mark.distributed
def test_two_ranks_share_caches(tmp_path):
    _text_corpus(str(tmp_path / "corpus"), n=24)
    run_distributed(_dist_datamodule_worker, 2, str(tmp_path))
    b0, b1 = torch.load(tmp_path / "rank0.pt"), torch.load(tmp_path / "rank1.pt")
    assert b0.shape == b1.shape == (2, 16) and not torch.equal(b0, b1)
    ref = _dm(tmp_path, 0, 1, mb=4)  # one rank with micro batch 4 sees the same global micro-batch
    torch.testing.assert_close(torch.cat([b0, b1]), next(iter(ref.train_dataloader()))["input_ids"])
    assert len(os.listdir(tmp_path / "cache" / "tokenizers")) == 1
    assert not [p for p in os.listdir(tmp_path / "cache" / "packed") if ".tmp-" in p]


def test_source_fingerprint_follows_content_not_size_or_mtime(tmp_path) -> None:
    root = tmp_path / "corpus"
    root.mkdir()
    (root / "a.txt").write_text("the quick brown fox")
    (root / "b.txt").write_text("jumps over the lazy dog")
    before = sources.resolve_source(str(root)).fingerprint()
    st = os.stat(root / "a.txt")
    (root / "a.txt").write_text("the quick brown cat")  # same size, edited in place
    os.utime(root / "a.txt", ns=(st.st_atime_ns, st.st_mtime_ns))  # and the same mtime
    edited = sources.resolve_source(str(root)).fingerprint()
    assert edited != before  # the packed-data cache key changes: no training on stale tokens
    (root / "a.txt").write_text("the quick brown fox")
    assert sources.resolve_source(str(root)).fingerprint() == before
