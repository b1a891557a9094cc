"""Megatron indexed data (``data.data_prefix``): the .bin/.idx format, GPTDataset-style samples, Megatron's
document switches, the Megatron / HF tokenizer keys, the preprocessing CLI and every new key's error path."""

from __future__ import annotations

import json
import pickle
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from nxd_lc.app.validation import load_config, path_problems, unsupported_features
from nxd_lc.config.errors import ConfigError
from nxd_lc.config.schema import DataConfig, TokenizerConfig
from nxd_lc.data import megatron_indexed as mi
from nxd_lc.data.datamodule import PretrainingDataModule, collate_documents
from nxd_lc.data.megatron_dataset import (
    GPTSamples,
    build_datasets,
    parse_data_prefix,
    parse_splits_string,
    split_indices,
)
from nxd_lc.data.tokenizer import load_tokenizer, tokenizer_vocab_size

pytestmark = pytest.mark.compat  # torch-2.9 compatibility subset (lane 2; docs/testing.md)

REPO = Path(__file__).resolve().parents[1]
TINY_JSON = str(REPO / "conf" / "tiny_llama_config.json")
NXDT = REPO.parent / "shared" / "reference" / "nxdt_examples"
EOD = 0


def _write(tmp_path: Path, docs: list[list[int]], name: str = "corpus") -> str:
    prefix = str(tmp_path / name)
    mi.write_indexed_dataset(prefix, docs)
    return prefix


# ---- format ---------------------------------------------------------------------------------------------------
def test_idx_header_bytes_match_the_documented_layout(tmp_path: Path) -> None:
    """Hand-built bytes of the Megatron .idx / .bin layout, compared with the writer and read by the reader."""
    expected_idx = (b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", 8)  # magic, version, uint16
                    + struct.pack("<Q", 2) + struct.pack("<Q", 3)  # 2 sequences; document_indices has 3 entries
                    + struct.pack("<2i", 3, 2)  # sequence lengths
                    + struct.pack("<2q", 0, 6)  # byte pointers: 3 uint16 tokens = 6 bytes
                    + struct.pack("<3q", 0, 1, 2))  # document indices
    expected_bin = struct.pack("<5H", 1, 2, 3, 4, 65535)
    prefix = _write(tmp_path, [[1, 2, 3], [4, 65535]])
    assert Path(prefix + ".idx").read_bytes() == expected_idx
    assert Path(prefix + ".bin").read_bytes() == expected_bin
    (tmp_path / "hand.idx").write_bytes(expected_idx)
    (tmp_path / "hand.bin").write_bytes(expected_bin)
    ds = mi.IndexedDataset(str(tmp_path / "hand"))
    assert ds.dtype == np.uint16 and len(ds) == 2 and ds.document_indices.tolist() == [0, 1, 2]
    assert ds[0].tolist() == [1, 2, 3] and ds[1].tolist() == [4, 65535] and ds.get(0, 1, 2).tolist() == [2, 3]


def test_writer_reader_round_trip_int32_multi_sequence_documents(tmp_path: Path) -> None:
    prefix = str(tmp_path / "sub" / "p")
    seqs = [[5, 70000], [], [1, 2, 3, 4]]
    with mi.IndexedDatasetWriter(prefix, np.int32) as w:
        w.add_sequence(seqs[0])
        w.add_sequence(seqs[1])
        w.end_document()
        w.add_document(seqs[2])
    ds = pickle.loads(pickle.dumps(mi.IndexedDataset(prefix)))  # DataLoader workers get a pickled copy
    assert ds.dtype == np.int32 and ds.sizes.tolist() == [2, 0, 4] and ds.pointers.tolist() == [0, 8, 8]
    assert ds.document_indices.tolist() == [0, 2, 3] and [ds[i].tolist() for i in range(3)] == seqs
    with pytest.raises(ValueError, match="do not fit uint16"):
        mi.IndexedDatasetWriter(str(tmp_path / "q")).add_sequence([70000])


def test_reader_errors_name_the_key(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"data.data_prefix: no such file .*missing.idx"):
        mi.IndexedDataset(str(tmp_path / "missing"))
    (tmp_path / "bad.idx").write_bytes(b"TNTIDX\x00\x00" + bytes(40))
    (tmp_path / "bad.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="data.data_prefix: .* not a Megatron mmap index"):
        mi.IndexedDataset(str(tmp_path / "bad"))
    prefix = _write(tmp_path, [[1, 2, 3]])
    Path(prefix + ".bin").write_bytes(b"\x01\x00")
    with pytest.raises(ValueError, match="not one dataset"):
        mi.IndexedDataset(prefix)


# ---- splits and samples -----------------------------------------------------------------------------------------
def test_splits_string_follows_megatrons_rule() -> None:
    assert split_indices([0.9, 0.09, 0.01], 1000) == [0, 900, 990, 1000]  # Megatron's docstring example
    assert split_indices(parse_splits_string("980,10,10"), 100) == [0, 98, 99, 100]
    assert split_indices(parse_splits_string("980,10,10"), 10) == [0, 10, 10, 10]  # round(0.1) = 0
    assert split_indices(parse_splits_string("1,1,1"), 10) == [0, 4, 7, 10]  # 3, 6, 9: every boundary shifted +1
    assert parse_splits_string("8/2") == [0.8, 0.2, 0.0]
    for bad in ("a,b", "1,2,3,4", "0,0,0", "-1,2"):
        with pytest.raises(ValueError, match="data.splits_string"):
            parse_splits_string(bad)


def test_samples_are_seq_length_plus_one_windows_of_the_document_stream(tmp_path: Path) -> None:
    docs = [[10, 11, 12, EOD], [13, 14, EOD], [15, 16, 17, 18, EOD]]  # stream of T = 12 tokens
    ds = mi.IndexedDataset(_write(tmp_path, docs))
    plus_one = GPTSamples(ds, (0, 3), 4, seed=None)  # N = (12 - 1) // 4 = 2
    assert [plus_one[i].tolist() for i in range(len(plus_one))] == [[10, 11, 12, 0, 13], [13, 14, 0, 15, 16]]
    exact = GPTSamples(ds, (0, 3), 4, seed=None, add_extra_token=False)  # N = 12 // 4 = 3, last entry no token
    assert [exact[i].tolist() for i in range(len(exact))] == [[10, 11, 12, 0, -100], [13, 14, 0, 15, -100],
                                                              [16, 17, 18, 0, -100]]
    shuffled = GPTSamples(ds, (0, 3), 4, seed=7, cache_dir=str(tmp_path / "maps"))
    again = pickle.loads(pickle.dumps(GPTSamples(ds, (0, 3), 4, seed=7, cache_dir=str(tmp_path / "maps"))))
    order, shuffle = (np.load(Path(shuffled.cache) / f"{n}.npy") for n in ("doc_order", "shuffle"))
    stream = np.concatenate([docs[k] for k in order])
    for i in range(len(shuffled)):
        j = shuffle[i]
        assert shuffled[i].tolist() == again[i].tolist() == stream[4 * j: 4 * j + 5].tolist()
    assert sorted(order.tolist()) == [0, 1, 2] and len(list((tmp_path / "maps").iterdir())) == 1  # one cache entry
    with pytest.raises(ValueError, match="data.splits_string: the train split"):
        GPTSamples(ds, (1, 2), 4, seed=None)  # 3 tokens < one sample


def test_splits_and_blends_build_train_and_validation(tmp_path: Path) -> None:
    docs = [[100 + 4 * d + t for t in range(3)] + [EOD] for d in range(10)]  # 10 documents of 4 tokens
    prefix = _write(tmp_path, docs)
    cfg = DataConfig(data_prefix=[1.0, prefix], splits_string="8,1,1", shuffle=False).resolved()
    train, val = build_datasets(cfg, seq_length=3, seed=1)
    assert len(train) == (32 - 1) // 3 and train[0].tolist() == docs[0]  # documents [0, 8)
    assert len(val) == 1 and val[0].tolist() == docs[8]  # document 8 (4 tokens: one sample of 3 + 1)
    other = _write(tmp_path, [[7] * 40], "other")
    cfg = DataConfig(data_prefix={"train": [3, prefix, 1, other], "validation": other}, shuffle=False).resolved()
    train, val = build_datasets(cfg, seq_length=3, seed=1)
    counts = train.counts()
    assert sum(counts) == 26 and abs(counts[0] - 0.75 * 26) <= 1 and len(val) == 13  # 3:1; validation: 'other'


def test_document_switches_match_megatron_semantics() -> None:
    """inputs [10, EOD, 13, 14, EOD], labels [EOD, 13, 14, EOD, 15] (Megatron get_ltor_masks_and_position_ids)."""
    row = np.array([10, EOD, 13, 14, EOD, 15], dtype=np.int32)

    def run(p: bool, a: bool, m: bool) -> dict[str, torch.Tensor]:
        return collate_documents([row], eos_id=EOD, reset_position_ids=p, reset_attention_mask=a, eod_mask_loss=m)

    off = run(False, False, False)
    assert off["position_ids"].tolist() == [[0, 1, 2, 3, 4]] and off["segment_ids"].tolist() == [[0] * 5]
    assert off["labels"].tolist() == [[0, 13, 14, 0, 15]] and off["input_ids"].tolist() == [[10, 0, 13, 14, 0]]
    pos = run(True, False, False)
    assert pos["position_ids"].tolist() == [[0, 1, 0, 1, 2]] and pos["segment_ids"].tolist() == [[0] * 5]
    att = run(False, True, False)  # after each EOD nothing up to and including it is visible
    assert att["position_ids"].tolist() == [[0, 1, 2, 3, 4]] and att["segment_ids"].tolist() == [[0, 0, 1, 1, 1]]
    loss = run(False, False, True)  # loss_mask[inputs == EOD] = 0
    assert loss["labels"].tolist() == [[0, -100, 14, 0, -100]]
    pad = collate_documents([np.full(6, -100, np.int32)], eos_id=EOD, reset_position_ids=True,
                            reset_attention_mask=True, eod_mask_loss=True)
    assert pad["input_ids"].tolist() == [[0] * 5] and pad["labels"].tolist() == [[-100] * 5]


# ---- tokenizers -------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gpt2_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    from tokenizers import ByteLevelBPETokenizer

    out = tmp_path_factory.mktemp("gpt2")
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(["the quick brown fox", "jumps over the lazy dog"] * 20, vocab_size=300,
                            special_tokens=["<|endoftext|>"], show_progress=False)
    vocab, merges = bpe.save_model(str(out))
    return vocab, merges


def test_gpt2_bpe_tokenizer_from_vocab_and_merges(gpt2_files: tuple[str, str], tmp_path: Path) -> None:
    from tokenizers import ByteLevelBPETokenizer

    vocab, merges = gpt2_files
    cfg = TokenizerConfig(library="megatron", type="GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)
    tok = load_tokenizer(cfg, None)
    assert tok.eos_token_id == json.loads(Path(vocab).read_text())["<|endoftext|>"]
    reference = ByteLevelBPETokenizer(vocab, merges)
    assert tok("the lazy fox", add_special_tokens=False)["input_ids"] == reference.encode("the lazy fox").ids
    assert tokenizer_vocab_size(cfg) == len(tok) == reference.get_vocab_size()
    tok.save_pretrained(str(tmp_path / "hf"))  # the same tokenizer as an HF directory, both libraries
    for library in ("huggingface", "megatron"):
        assert tokenizer_vocab_size(TokenizerConfig(library=library, type=str(tmp_path / "hf"))) == len(tok)
    no_eod = tmp_path / "vocab.json"
    no_eod.write_text(json.dumps({k: v for k, v in json.loads(Path(vocab).read_text()).items()
                                  if k != "<|endoftext|>"}))
    with pytest.raises(ValueError, match="data.tokenizer.vocab_file: .* no '<|endoftext|>'"):
        load_tokenizer(TokenizerConfig(library="megatron", type="GPT2BPETokenizer", vocab_file=str(no_eod),
                                       merge_file=merges), None)
    with pytest.raises(ValueError, match="data.tokenizer.merge_file: GPT2BPETokenizer needs an existing file"):
        tokenizer_vocab_size(TokenizerConfig(library="megatron", type="GPT2BPETokenizer", vocab_file=vocab,
                                             merge_file=str(tmp_path / "nope.txt")))
    with pytest.raises(ValueError, match="data.tokenizer.type: 'bytelevel_bpe' is trained"):
        tokenizer_vocab_size(TokenizerConfig(type="bytelevel_bpe"))
    with pytest.raises(ValueError, match="data.tokenizer.type: .* not an existing tokenizer directory"):
        tokenizer_vocab_size(TokenizerConfig(library="huggingface", type=str(tmp_path / "none")))
    with pytest.raises(ValueError, match="not supported yet: data.tokenizer.library='sentencepiece'"):
        tokenizer_vocab_size(TokenizerConfig(library="sentencepiece", type=str(tmp_path / "hf")))


def test_preprocessing_cli_and_data_module(gpt2_files: tuple[str, str], tmp_path: Path) -> None:
    vocab, merges = gpt2_files
    texts = [f"the quick brown fox {i} jumps over the lazy dog" for i in range(40)]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    tok_args = ["--library", "megatron", "--type", "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file", merges]
    assert mi.main(["--input", str(tmp_path / "in.jsonl"), "--output-prefix", str(tmp_path / "out"),
                    "--append-eod", *tok_args]) == 0
    tok_cfg = TokenizerConfig(library="megatron", type="GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)
    tok = load_tokenizer(tok_cfg, None)
    ds = mi.IndexedDataset(str(tmp_path / "out_text_document"))
    assert ds.dtype == np.uint16 and len(ds) == 40
    assert ds[3].tolist() == tok(texts[3], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert mi.main(["--input", str(tmp_path / "in.jsonl"), "--output-prefix", str(tmp_path / "x"),
                    "--json-key", "body", *tok_args]) == 2  # names the missing field

    data = DataConfig(micro_batch_size=2, global_batch_size=4, data_prefix=str(tmp_path / "out_text_document"),
                      splits_string="90,10,0", tokenizer=tok_cfg, reset_position_ids=True,
                      reset_attention_mask=True, eod_mask_loss=True, validation_drop_last=False,
                      pad_samples_to_global_batch_size=True, dataloader_type="cyclic",
                      index_mapping_dir=str(tmp_path / "maps"))

    def module(consumed: int = 0) -> PretrainingDataModule:
        dm = PretrainingDataModule(data, seq_length=16, seed=3, model_vocab_size=512, data_parallel_rank=0,
                                   data_parallel_size=1, global_batch_size=4)
        dm.load_state_dict({"consumed_samples": consumed})
        dm.setup()
        return dm

    dm = module()
    batches = [b for _, b in zip(range(4), dm.train_dataloader())]
    eod_rows = batches[0]["input_ids"] == tok.eos_token_id
    assert bool((batches[0]["labels"][eod_rows] == -100).all())  # eod_mask_loss
    resumed = next(iter(module(consumed=4).train_dataloader()))  # exact resume after one optimizer step
    assert torch.equal(resumed["input_ids"], batches[2]["input_ids"])
    val = list(dm.val_dataloader())
    rows = sum(b["input_ids"].shape[0] for b in val)
    assert rows % 4 == 0 and rows >= len(dm.val_dataset)  # padded to whole global batches
    assert bool((val[-1]["labels"][-1] == -100).all())  # a padding row has no label


# ---- config keys ------------------------------------------------------------------------------------------------
def _cfg(data: dict[str, Any], **top: Any) -> dict[str, Any]:
    return {"trainer": {"devices": 1, "max_steps": 10}, "data": {"micro_batch_size": 1, "global_batch_size": 1, **data},
            "model": {"model_config": TINY_JSON, "encoder_seq_length": 64}, **top}


def _problems(raw: dict[str, Any]) -> list[str]:
    try:
        load_config(raw)
    except ConfigError as e:
        return e.problems
    return []


@pytest.mark.parametrize("data, fragments", [
    ({"data_prefix": "p", "data_impl": "lazy", "dataloader_type": "random", "splits_string": "x", "train_dir": "d",
      "cross_document_attention": True, "mixture": [{"source": "corpus", "weight": 1}],
      "pad_samples_to_global_batch_size": True, "tokenizer": {"type": "bytelevel_bpe"}},
     ["data.data_impl: 'lazy' is not supported; only 'mmap'", "data.dataloader_type: unknown value 'random'",
      "data.splits_string: 'x' is not", "data.train_dir: not used with data.data_prefix",
      "data.cross_document_attention: not used", "data.mixture: not used",
      "data.pad_samples_to_global_batch_size: pads",
      "data.tokenizer.type: 'bytelevel_bpe' is trained"]),
    ({"data_prefix": {"train": "p", "validation": "q"}, "splits_string": "1,1,1"}, ["data.splits_string: not used"]),
    ({"data_prefix": {"valid": "p"}}, ["data.data_prefix: a dict needs a 'train' blend"]),
    ({"data_prefix": [1.0, "p", 0.5]}, ["data.data_prefix: expected [w1, prefix1"]),
    ({"data_prefix": [0, "p"]}, ["data.data_prefix: blend weights must be > 0"]),
    ({"reset_position_ids": True, "skip_warmup": False,
      "tokenizer": {"library": "megatron", "type": "GPT2BPETokenizer", "vocab_file": "v"}},
     ["data.reset_position_ids: applies to Megatron indexed data only",
      "data.skip_warmup: applies to Megatron indexed data only",
      "data.tokenizer.merge_file: library megatron, type GPT2BPETokenizer needs"]),
    ({"tokenizer": {"library": "huggingface", "type": "bytelevel_bpe"}}, ["data.tokenizer.type: 'bytelevel_bpe' is"]),
])
def test_key_errors_name_the_key(data: dict[str, Any], fragments: list[str]) -> None:
    problems = _problems(_cfg(data))
    for fragment in fragments:
        assert any(fragment in p for p in problems), (fragment, problems)


def test_alignment_and_unsupported_values(tmp_path: Path) -> None:
    raw = _cfg({"data_prefix": "p", "train_dir": str(tmp_path)}, model_alignment_strategy={"sft": {}})
    assert any(p.startswith("data.data_prefix: pretraining data only") for p in _problems(raw))
    cfg = load_config(_cfg({"tokenizer": {"library": "sentencepiece", "model": "m.model", "delimiter": ",",
                                          "sentencepiece_legacy": True, "type": "t"}, "train_dir": "d"},
                           distributed_strategy={"token_shuffle_group_size": 2}))
    keys = [p.split("=")[0] for p in unsupported_features(cfg) if "data." in p or "token_shuffle" in p]
    assert keys == ["not supported yet: data.tokenizer.library", "not supported yet: data.tokenizer.model",
                    "not supported yet: data.tokenizer.delimiter",
                    "not supported yet: data.tokenizer.sentencepiece_legacy",
                    "not supported yet: distributed_strategy.token_shuffle_group_size"]
    cfg = load_config(_cfg({"train_dir": "d", "tokenizer": {"library": "megatron", "type": "BertWordPieceCase"}}))
    assert "not supported yet: data.tokenizer.type='BertWordPieceCase' with library megatron" in \
        "".join(unsupported_features(cfg))
    cfg = load_config(_cfg({"data_prefix": [1, str(tmp_path / "p")], "tokenizer": {
        "library": "megatron", "type": "GPT2BPETokenizer", "vocab_file": "v.json", "merge_file": "m.txt"}}))
    assert sorted(p.split(":")[0] for p in path_problems(cfg)) == [
        "data.data_prefix", "data.data_prefix", "data.tokenizer.merge_file", "data.tokenizer.vocab_file"]
    assert parse_data_prefix(["a", "b"]).blends == {"all": [(1.0, "a"), (1.0, "b")]}


@pytest.mark.parametrize("name", ["gpt", "llama_7B", "llama_70b", "mistral", "mixtral_8x7b",
                                  "mixtral_8x7b_dropless"])
def test_nxdt_megatron_examples_have_no_data_problems(name: str) -> None:
    """NxDT's megatron_*.yaml: no data / tokenizer / top-level problem left (model problems are the model side's), also
    with every cross-field rule run (their model section swapped for a small valid HF one)."""
    path = NXDT / f"megatron_{name}_config.yaml"
    if not path.is_file():
        pytest.skip(f"{path} not present")
    raw = OmegaConf.to_container(OmegaConf.load(path))
    mine = ("data.", "aync", "distributed_strategy.token")
    assert [p for p in _problems(OmegaConf.to_container(OmegaConf.load(path))) if p.startswith(mine)] == []
    raw["model"], raw["model_source"] = {"model_config": TINY_JSON, "encoder_seq_length": 64}, "hf"
    raw["distributed_strategy"].update(tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                                       expert_model_parallel_size=1)
    raw["trainer"].update(devices=1, num_nodes=1)
    raw["exp_manager"]["checkpoint_callback_params"]["model_parallel_size"] = 1
    raw["data"]["global_batch_size"] = raw["data"]["micro_batch_size"]
    assert [p for p in _problems(raw) if p.startswith(mine)] == []
    cfg = load_config(raw)
    assert cfg.async_exec_max_inflight_requests in (5, 7)  # NxDT's 'aync_' spelling
    assert [p for p in unsupported_features(cfg) if "data." in p or "token_shuffle" in p] == []


@pytest.mark.parametrize("bad", ["json", "latin-1", "field", "number"])
def test_preprocessing_errors_name_file_line_and_leave_no_partial_output(gpt2_files: tuple[str, str],
                                                                         tmp_path: Path, bad: str,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """A bad line 301 (after a batch was written): the error names file:line and the fix; no .bin / .idx (or
    temporary file) is left, and a good output of an earlier run under the same prefix is kept as it was
    (issue 40, item 9)."""
    vocab, merges = gpt2_files
    tok_args = ["--library", "megatron", "--type", "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file", merges]
    good = tmp_path / "good.jsonl"
    good.write_text("".join(json.dumps({"text": f"the lazy dog {i}"}) + "\n" for i in range(300)))
    out = tmp_path / "out"
    out.mkdir()
    assert mi.main(["--input", str(good), "--output-prefix", str(out / "kept"), *tok_args]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    line = {"json": b'{"text": "fox" "dog"}\n', "latin-1": '{"text": "caf\xe9"}\n'.encode("latin-1"),
            "field": b'{"body": "fox"}\n', "number": b'{"text": 5}\n'}[bad]
    data = tmp_path / "in.jsonl"
    data.write_bytes(good.read_bytes() + line)
    for prefix in ("kept", "fresh"):
        capsys.readouterr()
        assert mi.main(["--input", str(data), "--output-prefix", str(out / prefix), *tok_args]) == 2
        err = capsys.readouterr().err
        assert f"{data}:301" in err, err
        assert {"json": "not valid JSON", "latin-1": "UTF-8", "field": "no string field 'text'",
                "number": "field 'text' is int, not a string"}[bad] in err, err
        assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # nothing new, the good output intact
    capsys.readouterr()
    missing = tmp_path / "missing.jsonl"
    assert mi.main(["--input", str(missing), "--output-prefix", str(out / "fresh"), *tok_args]) == 2
    assert f"error: --input: {missing} is not an existing file" in capsys.readouterr().err
