"""Bad input, case by case (issue 26): each broken data / model / tokenizer file a user can hand nxd_lc gives one
clear error that names the file (and line, key or tensor) and the fix, before training, never a traceback from
deep inside torch. The table in docs/robustness.md lists every case with its message; each row is a test here
(or names the existing test that covers it)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from nxd_lc.config.schema import DataConfig, TokenizerConfig
from nxd_lc.data.alignment_datamodule import read_records
from nxd_lc.data.alignment_format import RecordFormatter
from nxd_lc.data.datamodule import PretrainingDataModule
from nxd_lc.data.packing import PackedDataset
from nxd_lc.data.sources import iter_documents, resolve_source
from nxd_lc.data.tokenizer import load_tokenizer, train_bytelevel_bpe

pytestmark = pytest.mark.compat  # torch-2.9 compatibility subset (lane 2; docs/testing.md)


def test_jsonl_with_a_malformed_line_names_file_and_line(tmp_path: Path) -> None:
    sft = tmp_path / "sft.jsonl"
    sft.write_text('{"input": "a", "output": "b"}\n{"input": "c", "output"\n')
    with pytest.raises(ValueError, match=r"sft\.jsonl:2: not valid JSON"):
        list(read_records(str(sft), "data.train_dir"))
    text = tmp_path / "text.jsonl"
    text.write_text('{"text": "hello"}\nnot json\n')
    with pytest.raises(ValueError, match=r"text\.jsonl:2: malformed JSON line"):
        list(iter_documents(resolve_source(str(text))))


def test_record_missing_its_key_names_file_line_and_keys(tmp_path: Path) -> None:
    tok = train_bytelevel_bpe(["some text to train on, plus a little more"] * 20, 300)
    fmt = RecordFormatter(tok, chat_template=None)
    with pytest.raises(ValueError, match=r"sft\.jsonl:3: an SFT record needs 'messages' or string 'input' and "
                                         r"'output'.*found keys \['input', 'response'\]"):
        fmt.encode_sft({"input": "q", "response": "a"}, "sft.jsonl:3")
    with pytest.raises(ValueError, match=r"pref\.jsonl:1: a preference record needs 'prompt', 'chosen' and "
                                         r"'rejected' \(missing \['rejected'\]"):
        fmt.encode_preference({"prompt": "q", "chosen": "a"}, "pref.jsonl:1")
    text = tmp_path / "text.jsonl"
    text.write_text('{"txt": "hello"}\n')
    with pytest.raises(ValueError, match=r"text\.jsonl:1: missing key 'text' \(data\.text_key\)"):
        list(iter_documents(resolve_source(str(text))))


def test_empty_data_files_name_the_key(tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match=r"data\.train_dir: .*empty\.jsonl holds no records"):
        list(read_records(str(empty), "data.train_dir"))
    with pytest.raises(ValueError, match=r"data\.train_dir: empty corpus"):
        list(iter_documents(resolve_source(str(empty))))


def test_truncated_packed_cache_names_the_file_and_the_fix(tmp_path: Path) -> None:
    path = tmp_path / "packed.npy"
    np.save(path, np.arange(100, dtype=np.int32).reshape(10, 10))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"packed-sample cache .*packed\.npy cannot be read .* delete it"):
        PackedDataset(str(path))


def test_token_ids_beyond_the_vocabulary_stop_before_training(tmp_path: Path) -> None:
    """Pre-tokenized data with an id >= the model's vocab_size: one error at data setup naming the data key and
    the id (not an index error inside the embedding on the device). A tokenizer larger than the model's vocabulary:
    tests/test_data.py::test_datamodule_dp_ranks_and_vocab_check."""
    import datasets

    rows = [[1, 2, 3] * 30, [4, 5, 6] * 30, [7, 8, 5000] * 30, [9, 10, 11] * 30]
    datasets.Dataset.from_dict({"input_ids": rows}).save_to_disk(str(tmp_path / "tok"))
    train_bytelevel_bpe(["text the ids were tokenized with"] * 20, 300).save_pretrained(tmp_path / "tokenizer")
    cfg = DataConfig(micro_batch_size=1, global_batch_size=1, train_dir=str(tmp_path / "tok"), val_fraction=0.0,
                     tokenizer=TokenizerConfig(type=str(tmp_path / "tokenizer"), cache_dir=str(tmp_path / "cache")))
    dm = PretrainingDataModule(cfg, seq_length=16, seed=0, model_vocab_size=320, data_parallel_rank=0,
                               data_parallel_size=1, global_batch_size=1)
    with pytest.raises(ValueError, match=r"data\.train_dir: token id 5000 in .* is >= the model vocab_size 320"):
        dm.setup("fit")


def test_config_json_missing_a_required_field_names_it(tmp_path: Path) -> None:
    from nxd_lc.models.hf_config import build_llama_config

    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    with pytest.raises(ValueError, match=r"model\.model_config: .*config\.json needs a positive integer 'vocab_size'"):
        build_llama_config(str(path))


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import transformers

    root = tmp_path_factory.mktemp("hf")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2)
    transformers.LlamaForCausalLM(cfg).save_pretrained(root / "good")
    return root


@pytest.mark.parametrize("case,edit,match", [
    ("shape", lambda s: s.__setitem__("model.layers.0.mlp.down_proj.weight", torch.zeros(32, 60)),
     r"'model\.layers\.0\.mlp\.down_proj\.weight' in .*model\.safetensors has shape \(32, 60\), but the model config "
     r"expects \(32, 64\)"),
    ("dtype", lambda s: s.__setitem__("model.norm.weight", torch.zeros(32, dtype=torch.int64)),
     r"'model\.norm\.weight' in .*model\.safetensors is stored as I64, not a floating type"),
    ("missing", lambda s: s.pop("model.norm.weight"), r"'model\.norm\.weight' is missing from the HF checkpoint"),
])
def test_safetensors_with_a_wrong_tensor_names_it(hf_dir: Path, case: str, edit: object, match: str) -> None:
    from safetensors.torch import load_file, save_file

    from nxd_lc.models.hf_config import build_llama_config
    from nxd_lc.models.llama import LlamaForCausalLM, load_hf_weights

    state = load_file(str(hf_dir / "good" / "model.safetensors"))
    edit(state)  # type: ignore[operator]
    bad = hf_dir / case
    bad.mkdir(exist_ok=True)
    save_file(state, str(bad / "model.safetensors"), metadata={"format": "pt"})
    (bad / "config.json").write_text((hf_dir / "good" / "config.json").read_text())
    model = LlamaForCausalLM(build_llama_config(str(hf_dir / "good" / "config.json")))
    with pytest.raises(ValueError, match=match):
        load_hf_weights(model, str(bad))


def test_tokenizer_directory_without_a_tokenizer_names_the_key(tmp_path: Path) -> None:
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "README").write_text("no tokenizer here")
    with pytest.raises(ValueError, match=r"data\.tokenizer\.type: cannot load a tokenizer from .*tok"):
        load_tokenizer(TokenizerConfig(type=str(tmp_path / "tok")), None)
    assert os.path.isdir(tmp_path / "tok")


def test_tokenizer_directory_with_custom_code_is_refused_and_its_code_never_runs(tmp_path: Path) -> None:
    """A tokenizer directory whose tokenizer_config.json maps AutoTokenizer to Python code in the directory (HF's
    ``auto_map``): transformers asked on the terminal whether to run it; nxd_lc refuses, naming the file."""
    tok_dir = tmp_path / "tok"
    train_bytelevel_bpe(["a text to learn a few merges from"] * 20, 300).save_pretrained(tok_dir)
    marker = tmp_path / "code_ran"
    (tok_dir / "custom_tok.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n"
                                           "from transformers import PreTrainedTokenizerFast as CustomTok\n")
    config_path = tok_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["auto_map"] = {"AutoTokenizer": [None, "custom_tok.CustomTok"]}
    config_path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"data\.tokenizer\.type: .*tokenizer_config\.json maps AutoTokenizer to "
                                         r"Python code .*auto_map.*never runs code"):
        load_tokenizer(TokenizerConfig(type=str(tok_dir)), None)
    assert not marker.exists()


MODEL_AUTO_MAP = {"AutoConfig": "modeling_x.XConfig", "AutoModel": "modeling_x.XModel",
                  "AutoModelForCausalLM": "modeling_x.XForCausalLM"}


@pytest.mark.parametrize("where", ["config.json", "tokenizer_config.json"])
def test_model_only_auto_map_next_to_a_standard_tokenizer_loads(tmp_path: Path, where: str) -> None:
    """auto_map entries for model classes run no code for the tokenizer (transformers loads it with
    trust_remote_code=False): the tokenizer loads, and the model code is never run (issue 40, item 10)."""
    tok_dir = tmp_path / "tok"
    trained = train_bytelevel_bpe(["a text to learn a few merges from"] * 20, 300)
    trained.save_pretrained(tok_dir)
    marker = tmp_path / "code_ran"
    (tok_dir / "modeling_x.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    (tok_dir / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 300}))
    path = tok_dir / where
    record = json.loads(path.read_text())
    record["auto_map"] = MODEL_AUTO_MAP
    path.write_text(json.dumps(record))
    loaded = load_tokenizer(TokenizerConfig(type=str(tok_dir)), None)
    assert loaded.get_vocab() == trained.get_vocab() and loaded.eos_token == trained.eos_token
    assert not marker.exists()


def test_auto_tokenizer_entry_in_config_json_is_refused(tmp_path: Path) -> None:
    tok_dir = tmp_path / "tok"
    train_bytelevel_bpe(["a text to learn a few merges from"] * 20, 300).save_pretrained(tok_dir)
    (tok_dir / "config.json").write_text(json.dumps({"model_type": "llama", "auto_map": {
        **MODEL_AUTO_MAP, "AutoTokenizer": ["tokenization_x.XTokenizer", None]}}))
    with pytest.raises(ValueError, match=r"data\.tokenizer\.type: .*config\.json maps AutoTokenizer to Python code "
                                         r"in the directory \(auto_map\['AutoTokenizer'\]: \['tokenization_x"):
        load_tokenizer(TokenizerConfig(type=str(tok_dir)), None)
    # the dry run lists the same refusal (the launch-host checks): it said "config is valid" before
    from nxd_lc.app.validation import path_problems
    from nxd_lc.config.structure import typed_config

    cfg = typed_config({"data": {"tokenizer": {"type": str(tok_dir)}, "builtin_corpus": "python_stdlib"}})
    assert any(p.startswith("data.tokenizer.type: ") and "maps AutoTokenizer to Python code" in p
               for p in path_problems(cfg)), path_problems(cfg)
