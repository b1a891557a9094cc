"""Every file a run reads is checked (issue 32, item 4) -- the checkpoint side: checkpoint manifests and ``done``
records, LoRA adapter files (``adapters.pt`` / shard files and ``adapter_config.json``), the DPO reference
log-prob cache, and the zip records of every ``torch.save`` file nxd_lc reads (item 6: no compressed record is
inflated).

What the user sees: a damaged manifest on the newest checkpoint makes resume fall back to the previous one with a
warning naming the manifest (as a flipped byte in a shard does); a damaged ``done`` record never stops a start; a
damaged adapter file or adapter config is one ValueError naming the file and the key / tensor; a damaged reference
cache is recomputed with a warning naming it; a zip record that ``torch.save`` would never write is refused before
``torch.load`` inflates it.
"""

from __future__ import annotations

import json
import logging
import os
import zipfile
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from omegaconf import OmegaConf
from transformers import LlamaConfig

from nxd_lc.alignment.lora_files import load_adapters, save_adapters
from nxd_lc.alignment.reference import load_reference_tables, save_reference_tables
from nxd_lc.checkpoint import integrity, sharded
from nxd_lc.checkpoint.xser import check_stored_records, safe_torch_load
from nxd_lc.config.peft_schema import PeftConfig
from nxd_lc.config.schema import NxdConfig
from nxd_lc.layers.lora import apply_lora, lora_state_dict
from nxd_lc.lightning import exp_manager
from nxd_lc.models.llama.model import LlamaForCausalLM

pytestmark = pytest.mark.compat  # torch-2.9 compatibility subset (lane 2; docs/testing.md)

CPU = torch.device("cpu")


# ---- checkpoint manifests and done records ---------------------------------------------------------------------
def _cfg(log_dir: Path) -> NxdConfig:
    base = OmegaConf.structured(NxdConfig)
    base.exp_manager = OmegaConf.merge(base.exp_manager, {"explicit_log_dir": str(log_dir)})
    return OmegaConf.to_object(base)  # type: ignore[return-value]


def _save(root: str, tag: str, step: int) -> str:
    g = torch.Generator().manual_seed(step)
    model = {"w": torch.randn(4, 3, generator=g)}
    optim = {"state": {0: {"exp_avg": torch.randn(4, 3, generator=g)}}, "param_groups": [{"lr": 0.1}]}
    return sharded.save_checkpoint(root, tag, model_state=model, optim_state=optim, user_content={"global_step": step},
                                   dp_rank=0, tp_rank=0, pp_rank=0, is_global_zero=True, write_model=True,
                                   write_optim=True, use_xser=True)


def _edit_manifest(edit: Callable[[dict[str, Any]], Any]) -> Callable[[str], None]:
    """A damage that rewrites the parsed manifest with ``edit`` (which changes it in place)."""
    def damage(path: str) -> None:
        with open(path) as f:
            doc = json.load(f)
        edit(doc)
        with open(path, "w") as f:
            json.dump(doc, f)
    return damage


def _write(data: bytes) -> Callable[[str], None]:
    def damage(path: str) -> None:
        with open(path, "wb") as f:
            f.write(data)
    return damage


def _first_entry(doc: dict[str, Any]) -> dict[str, Any]:
    return doc["files"][sorted(doc["files"])[0]]


MANIFEST_DAMAGE: dict[str, tuple[Callable[[str], None], str]] = {
    # name: (damage, what the warning says)
    "not_json": (_write(b'{"algorithm": "sha256", "files": {'), "unreadable"),
    "truncated": (lambda p: os.truncate(p, os.path.getsize(p) // 2), "unreadable"),
    "not_utf8": (_write('{"algorithm": "sha256", "files": {"caf\u00e9": 1}}'.encode("latin-1")), "not UTF-8"),
    "nested_too_deep": (_write(b"[" * 100_000 + b"]" * 100_000), "nested deeper"),
    "huge_integer": (_write(b'{"algorithm": "sha256", "files": {"a": {"bytes": ' + b"9" * 5000 + b"}}}"), "digits"),
    "not_an_object": (_write(b"[1, 2]"), "expected a JSON object"),
    "files_is_a_list": (_edit_manifest(lambda d: d.update(files=[])), "'files' object"),
    "entry_is_a_string": (_edit_manifest(lambda d: d["files"].update({"user_content.pt": "abc"})),
                          "entry 'user_content.pt'"),
    "bytes_is_a_string": (_edit_manifest(lambda d: _first_entry(d).update(bytes="12")), "'bytes' must be"),
    "digest_not_hex": (_edit_manifest(lambda d: _first_entry(d).update(sha256="z" * 64)), "64 lowercase hex"),
    "path_escapes": (_edit_manifest(lambda d: d["files"].update({"../step=2/user_content.pt": _first_entry(d)})),
                     "not a relative path inside"),
    "absolute_path": (_edit_manifest(lambda d: d["files"].update({"/etc/hostname": _first_entry(d)})),
                      "not a relative path inside"),
    "files_emptied": (_edit_manifest(lambda d: d.update(files={})), "lists no file under model/"),
    "future_format": (_edit_manifest(lambda d: d.update(format=2)), "this nxd_lc reads format 1"),
}


@pytest.mark.parametrize("damage", sorted(MANIFEST_DAMAGE))
def test_damaged_manifest_on_newest_falls_back_to_previous(tmp_path: Path, caplog: Any, damage: str) -> None:
    """Any damage to the newest checkpoint's manifest is a damaged checkpoint: resume skips it with a warning naming
    the manifest and why, and takes the previous one (never a traceback, never a load unverified)."""
    cfg = _cfg(tmp_path / "run")
    paths = exp_manager.experiment_paths(cfg)
    older = _save(paths.checkpoint_dir, "step=2", 2)
    newest = _save(paths.checkpoint_dir, "step=4", 4)
    mutate, says = MANIFEST_DAMAGE[damage]
    mutate(os.path.join(newest, integrity.MANIFEST_FILE))
    with caplog.at_level(logging.WARNING, logger="nxd_lc.lightning.exp_manager"):
        assert exp_manager.resume_plan(cfg, paths) == (older, None)
    (warning,) = [r.getMessage() for r in caplog.records if "skipping checkpoint" in r.getMessage()]
    assert os.path.join(newest, integrity.MANIFEST_FILE) in warning and says in warning, warning


def test_manifest_paths_never_leave_the_checkpoint(tmp_path: Path) -> None:
    """A manifest entry pointing outside the checkpoint is refused before anything is looked at through it (no
    ``stat`` or hash of a file outside), even when the entry's size and digest match that outside file."""
    tag_dir = _save(str(tmp_path / "ckpt"), "step=1", 1)
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"secret")
    size, digest = integrity.file_digest(str(outside))
    _edit_manifest(lambda d: d["files"].update({"../../outside.bin": {"bytes": size, "sha256": digest}}))(
        os.path.join(tag_dir, integrity.MANIFEST_FILE))
    with pytest.raises(integrity.CheckpointIntegrityError, match=r"entry '\.\./\.\./outside\.bin': not a relative"):
        sharded.verify_checkpoint(str(tmp_path / "ckpt"), "step=1", dp_rank=0, tp_rank=0, pp_rank=0)


@pytest.mark.parametrize("record", [b"[" * 100_000 + b"]" * 100_000, b'{"step": 4, "saved_at": 1' + b"0" * 400 + b"}",
                                    b'{"step": 4, "saved_at": NaN}', b"\xff\xfe{", b'{"step": "4"}'])
def test_damaged_done_record_never_stops_a_start(tmp_path: Path, record: bytes) -> None:
    """``done`` only orders the checkpoints: a damaged one (nesting too deep, a time beyond a float, NaN, not UTF-8,
    a step that is not a number) is read as NxD's plain marker (file time), never a crash of every later start."""
    root = str(tmp_path / "ckpt")
    _save(root, "step=2", 2)
    newest = _save(root, "step=4", 4)
    os.utime(os.path.join(root, "step=2", sharded.DONE_FILE), (1, 1))  # the older one is older by its file time too
    with open(os.path.join(newest, sharded.DONE_FILE), "wb") as f:
        f.write(record)
    assert sharded.list_checkpoints(root) == ["step=2", "step=4"]
    assert sharded.latest_checkpoint(root) == "step=4"


# ---- LoRA adapter files ----------------------------------------------------------------------------------------
def _peft(**kw: Any) -> PeftConfig:
    return PeftConfig(lora_rank=4, lora_alpha=8.0, lora_dropout=0.1, target_modules=["qkv_proj", "down_proj"], **kw)


def _lora_model(peft: PeftConfig) -> LlamaForCausalLM:
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
    apply_lora(model, peft)
    return model


@pytest.fixture
def adapters(tmp_path: Path) -> tuple[PeftConfig, LlamaForCausalLM, str]:
    """``(peft, model, adapters.pt)`` with the settings in ``adapter_config.json`` beside the file."""
    peft = _peft(save_lora_config_adapter=False)
    model = _lora_model(peft)
    return peft, model, save_adapters(model, peft, str(tmp_path / "lora"), is_rank0=True)


CONFIG_DAMAGE: dict[str, tuple[bytes, str]] = {
    "latin1": ('{"lora_rank": 4, "lora_alpha": 8.0, "target_modules": ["caf\u00e9"]}'.encode("latin-1"),
               r"adapter_config\.json:1: not UTF-8"),
    "utf16": ('{"lora_rank": 4}'.encode("utf-16"), r"adapter_config\.json is UTF-16"),
    "not_json": (b'{"lora_rank": 4,', r"adapter_config\.json:1: not JSON"),
    "nan": (b'{"lora_rank": 4, "lora_alpha": NaN, "target_modules": []}', r"adapter_config\.json:1: NaN"),
    "not_an_object": (b'["lora_rank", 4]', r"adapter_config\.json: the LoRA settings must be a JSON object"),
    "rank_is_a_string": (b'{"lora_rank": "4", "lora_alpha": 8.0, "target_modules": ["down_proj", "qkv_proj"]}',
                         r"key 'lora_rank' must be a whole number >= 1, got '4' \(str\)"),
    "alpha_is_a_bool": (b'{"lora_rank": 4, "lora_alpha": true, "target_modules": ["down_proj", "qkv_proj"]}',
                        r"key 'lora_alpha' must be a finite number > 0"),
    "targets_is_a_string": (b'{"lora_rank": 4, "lora_alpha": 8.0, "target_modules": "qkv_proj"}',
                            r"key 'target_modules' must be a list of module names"),
    "peft_spelling": (b'{"r": 4, "lora_alpha": 8.0, "target_modules": ["down_proj", "qkv_proj"]}',
                      r"key 'lora_rank' is missing \(a Hugging Face PEFT adapter_config\.json names it 'r'"),
    "too_large": (b'{"lora_rank": 4, "pad": "' + b"x" * (1 << 20) + b'"}', r"adapter_config\.json is \d+ bytes"),
}


@pytest.mark.parametrize("damage", sorted(CONFIG_DAMAGE))
def test_damaged_adapter_config_is_one_error_naming_file_and_key(adapters: Any, damage: str) -> None:
    peft, model, path = adapters
    data, says = CONFIG_DAMAGE[damage]
    config = os.path.join(os.path.dirname(path), "adapter_config.json")
    with open(config, "wb") as f:
        f.write(data)
    with pytest.raises(ValueError, match=r"model_alignment_strategy\.peft\.lora_ckpt_path: .*" + says) as excinfo:
        load_adapters(model, peft, path)
    assert config in str(excinfo.value)


def _rewrite(path: str, edit: Callable[[dict[str, Any]], Any]) -> None:
    state = torch.load(path, weights_only=True)
    edit(state)
    torch.save(state, path)


def _first(state: dict[str, Any], suffix: str) -> str:
    return sorted(k for k in state if k.endswith(suffix))[0]


ADAPTER_DAMAGE: dict[str, tuple[Callable[[str], None], str]] = {
    "truncated": (lambda p: os.truncate(p, os.path.getsize(p) // 2), r"cannot be read .*truncated or not an adapter"),
    "random_bytes": (_write(bytes(range(256)) * 4), r"cannot be read"),
    "not_a_dict": (lambda p: torch.save([torch.ones(2)], p), r"holds a list, not a dict of named adapter tensors"),
    "settings_not_a_dict": (lambda p: _rewrite(p, lambda s: s.update(lora_config="r=4")),
                            r"the LoRA settings must be a JSON object / dict"),
    "wrong_rank": (lambda p: _rewrite(p, lambda s: s.update({_first(s, "lora_A"): torch.zeros(3, 32)})),
                   r"'layers\.0\.[\w.]+\.lora_A' has shape \(3, 32\), this model's adapter is \(4, \d+\)"),
    "integer_tensor": (lambda p: _rewrite(p, lambda s: s.update({_first(s, "lora_B"): torch.zeros(48, 4).long()})),
                       r"lora_B' is a torch\.int64 tensor .* an adapter is a 2-d floating-point tensor"),
    "not_a_tensor": (lambda p: _rewrite(p, lambda s: s.update({_first(s, "lora_B"): [0.0] * 4})),
                     r"lora_B' is a list"),
    "nan_values": (lambda p: _rewrite(p, lambda s: s[_first(s, "lora_A")].fill_(float("nan"))),
                   r"lora_A' holds NaN or infinite values"),
    "zero_stride_giant": (lambda p: _rewrite(p, lambda s: s.update({_first(s, "lora_A"):
                                                                     torch.zeros(1, 1).expand(4, 1 << 40)})),
                          r"lora_A' has shape \(4, 1099511627776\)"),
    "name_of_no_module": (lambda p: _rewrite(p, lambda s: s.update({"layers.0.mlp.up.lora_A": torch.ones(4, 2)})),
                          r"1 entries that are no adapter of this model, e\.g\. \['layers\.0\.mlp\.up\.lora_A'\]"),
    "adapter_missing": (lambda p: _rewrite(p, lambda s: s.pop(_first(s, "lora_B"))),
                        r"adapters\.pt: load_lora_state_dict: missing keys \['layers\.0\.mlp\.down_proj\.lora_B'\]"),
}


@pytest.mark.parametrize("damage", sorted(ADAPTER_DAMAGE))
def test_damaged_adapter_file_is_one_error_naming_file_and_tensor(adapters: Any, damage: str) -> None:
    peft, model, path = adapters
    before = {k: v.clone() for k, v in lora_state_dict(model).items()}
    mutate, says = ADAPTER_DAMAGE[damage]
    mutate(path)
    with pytest.raises(ValueError, match=r"model_alignment_strategy\.peft\.lora_ckpt_path: .*" + says) as excinfo:
        load_adapters(model, peft, path)
    assert path in str(excinfo.value)
    assert all(torch.equal(v, before[k]) for k, v in lora_state_dict(model).items())  # nothing half-loaded


def test_intact_adapters_still_load(adapters: Any) -> None:
    peft, model, path = adapters
    saved = {k: v + 1 for k, v in lora_state_dict(model).items()}
    _rewrite(path, lambda s: s.update(saved))
    load_adapters(model, peft, path)
    assert all(torch.equal(v, saved[k]) for k, v in lora_state_dict(model).items())


# ---- the DPO reference cache -----------------------------------------------------------------------------------
SIZES = {"train": 6, "val": 4}


def _tables() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {k: torch.stack([-torch.rand(n, generator=g) * 50, torch.randint(1, 40, (n,), generator=g).float(),
                            -torch.rand(n, generator=g) * 50, torch.randint(1, 40, (n,), generator=g).float()], 1)
            for k, n in SIZES.items()}


def _payload(**tables: Any) -> dict[str, Any]:
    return {"fingerprint": "key", "version": 1, "tables": {**_tables(), **tables}}


def _nan_row() -> torch.Tensor:
    t = _tables()["train"]
    t[3, 2] = float("nan")
    return t


def _negative_count() -> torch.Tensor:
    t = _tables()["val"]
    t[0, 1] = -2.0
    return t


CACHE_DAMAGE: dict[str, tuple[Callable[[str], None], str]] = {
    "truncated": (lambda p: os.truncate(p, os.path.getsize(p) - 30), "it cannot be read"),
    "random_bytes": (_write(bytes(range(256)) * 3), "it cannot be read"),
    "empty": (_write(b""), "it cannot be read"),
    "not_a_dict": (lambda p: torch.save(torch.zeros(6, 4), p), "does not hold a dict with a 'tables' dict"),
    "other_key": (lambda p: torch.save({**_payload(), "fingerprint": "other"}, p), "does not match this run"),
    "split_missing": (lambda p: torch.save({**_payload(), "tables": {"train": _tables()["train"]}}, p),
                      "does not match this run"),
    "wrong_row_count": (lambda p: torch.save(_payload(train=torch.zeros(5, 4)), p),
                        "table 'train' has shape (5, 4), this run has 6 pairs"),
    "wrong_width": (lambda p: torch.save(_payload(val=torch.zeros(4, 3)), p), "table 'val' has shape (4, 3)"),
    "integer_table": (lambda p: torch.save(_payload(val=torch.zeros(4, 4, dtype=torch.int32)), p),
                      "table 'val' is a torch.int32 tensor"),
    "not_a_tensor": (lambda p: torch.save(_payload(val=[[0.0] * 4] * 4), p), "table 'val' is a list"),
    "nan": (lambda p: torch.save(_payload(train=_nan_row()), p),
            "table 'train' holds 1 NaN / infinite values (first: row 3, rejected_sum)"),
    "negative_count": (lambda p: torch.save(_payload(val=_negative_count()), p), "not whole numbers >= 0"),
    "zero_stride_giant": (lambda p: torch.save(_payload(train=torch.zeros(1, 1).expand(1 << 40, 4)), p),
                          "has shape (1099511627776, 4)"),
    "oversized": (lambda p: torch.save({**_payload(), "pad": torch.zeros(1 << 19)}, p),
                  "a cache of 10 pairs is at most"),
}


@pytest.mark.parametrize("damage", sorted(CACHE_DAMAGE))
def test_damaged_reference_cache_is_recomputed_with_a_warning(tmp_path: Path, caplog: Any, damage: str) -> None:
    """Never a crash, never used: the loader returns None (every rank recomputes) and warns naming the file."""
    path = str(tmp_path / "train.jsonl.ref_logps-key.pt")
    assert save_reference_tables(path, "key", _tables())
    assert load_reference_tables(path, "key", SIZES, CPU) is not None  # intact: used
    mutate, says = CACHE_DAMAGE[damage]
    mutate(path)
    with caplog.at_level(logging.WARNING, logger="nxd_lc.alignment.reference"):
        assert load_reference_tables(path, "key", SIZES, CPU) is None
    (warning,) = [r.getMessage() for r in caplog.records if "is not used" in r.getMessage()]
    assert path in warning and says in warning and "will be recomputed" in warning, warning
    # damaged data is recomputed; the safe loader is never to be turned off for it (issue 40, item 11)
    assert "checkpoint_weights_only" not in warning and "full unpickling" not in warning, warning
    assert ("it is from another run" if "does not match" in says else "it is damaged") in warning, warning


def test_damaged_cache_is_recomputed_and_rewritten_by_the_module(tmp_path: Path, caplog: Any) -> None:
    """The module's load path (``prepare_reference``): a cache with NaN rows is not used; the tables are computed
    again, equal to the first run's, and the file is rewritten so that the next run loads it."""
    import copy

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from nxd_lc.alignment import NxDPreferenceModel
    from nxd_lc.config.alignment_schema import DPOConfig, ModelAlignmentStrategyConfig
    from nxd_lc.config.schema import DataConfig
    from nxd_lc.data.alignment_datamodule import ModelAlignmentDataModule

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(["the quick brown fox", "how are you"] * 3, trainer=trainers.BpeTrainer(
        vocab_size=280, special_tokens=["<pad>", "<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", pad_token="<pad>")
    data = tmp_path / "data"
    data.mkdir()
    for name, n in (("train.jsonl", 4), ("val.jsonl", 2)):
        (data / name).write_text("".join(json.dumps({"prompt": f"how are you {i}", "chosen": "the fox " * (1 + i),
                                                     "rejected": "brown"}) + "\n" for i in range(n)))
    cfg = NxdConfig()
    cfg.data = DataConfig(micro_batch_size=2, global_batch_size=2, train_dir=str(data / "train.jsonl"),
                          val_dir=str(data / "val.jsonl"))
    cfg.model_alignment_strategy = ModelAlignmentStrategyConfig(dpo=DPOConfig(precompute_ref_log_probs=True))
    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(vocab_size=288, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                        tie_word_embeddings=False))

    def prepared() -> NxDPreferenceModel:
        module = NxDPreferenceModel(cfg, copy.deepcopy(base))
        dm = ModelAlignmentDataModule(cfg.data, cfg.model_alignment_strategy, seq_length=32, seed=0,
                                      model_vocab_size=288, data_parallel_rank=0, data_parallel_size=1,
                                      global_batch_size=2, tokenizer=tok)
        dm.setup()
        module.prepare_reference(dm)
        return module

    first = prepared()
    path = first.reference_cache_file
    assert first.reference_source == "computed" and path is not None and os.path.isfile(path)
    payload = torch.load(path, weights_only=True)
    payload["tables"]["train"][1, 0] = float("nan")
    torch.save(payload, path)
    with caplog.at_level(logging.WARNING, logger="nxd_lc.alignment.reference"):
        second = prepared()
    assert second.reference_source == "computed"
    assert any(path in r.getMessage() and "NaN" in r.getMessage() for r in caplog.records)
    assert all(torch.equal(second._ref_tables[k], first._ref_tables[k]) for k in ("train", "val"))
    third = prepared()  # the rewritten file is this run's again
    assert third.reference_source == "cache"
    assert all(torch.equal(third._ref_tables[k], first._ref_tables[k]) for k in ("train", "val"))


# ---- zip records (item 6: what torch's restricted loader would inflate) -----------------------------------------
def _deflated_copy(src: str, dst: str) -> int:
    """``dst``: ``src`` with its tensor records deflate-compressed (torch.load reads it). Returns its size."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for info in zin.infolist():
            method = zipfile.ZIP_DEFLATED if "/data/" in info.filename else zipfile.ZIP_STORED
            zout.writestr(zipfile.ZipInfo(info.filename), zin.read(info.filename), compress_type=method)
    return os.path.getsize(dst)


def test_compressed_zip_record_is_refused_before_torch_inflates_it(tmp_path: Path) -> None:
    """torch.load (weights_only too) inflates a deflated record to its full size: a 16 MiB tensor of zeros from a
    file of ~16 KB. nxd_lc's loader refuses the record (torch.save never compresses) before torch reads it, so a
    file can never make it allocate more than the file's own size for the tensor data."""
    plain = str(tmp_path / "plain.pt")
    torch.save({"t": torch.zeros(1 << 22)}, plain)  # 16 MiB of float32 zeros
    bomb = str(tmp_path / "bomb.pt")
    size = _deflated_copy(plain, bomb)
    assert size < 64 << 10
    assert torch.load(bomb, weights_only=True)["t"].numel() == 1 << 22  # torch itself inflates it: 16 MiB
    with pytest.raises(ValueError, match=r"bomb\.pt: record '.*data/0' is compressed or claims 16777216 bytes "
                                         r"uncompressed in a \d+-byte file"):
        safe_torch_load(bomb)
    check_stored_records(plain)  # torch.save's own files pass
    assert torch.equal(safe_torch_load(plain)["t"], torch.zeros(1 << 22))
    legacy = tmp_path / "legacy.pt"
    torch.save({"t": torch.ones(2)}, str(legacy), _use_new_zipfile_serialization=False)
    check_stored_records(str(legacy))  # not a zip (torch's legacy format): left to torch's own reader
    assert torch.equal(safe_torch_load(str(legacy))["t"], torch.ones(2))


def test_storage_declared_larger_than_its_record_is_refused(tmp_path: Path) -> None:
    """The pickle declares each storage's size; torch 2.9 builds the storage with it over a buffer of the record's
    size (reads run past the buffer: a 4 TiB "tensor" over 4 KB), torch 2.13 compares them. nxd_lc's loader
    compares them on every torch version before torch reads the file."""
    plain = str(tmp_path / "plain.pt")
    torch.save({"t": torch.arange(1003, dtype=torch.float32)}, plain)
    lying = str(tmp_path / "lying.pt")
    with zipfile.ZipFile(plain) as zin, zipfile.ZipFile(lying, "w") as zout:
        for info in zin.infolist():
            data = zin.read(info.filename)
            if info.filename.endswith("/data.pkl"):  # BININT2 1003 (numel and size) -> LONG1 2^40
                assert data.count(b"M\xeb\x03") == 2
                data = data.replace(b"M\xeb\x03", b"\x8a\x08" + (1 << 40).to_bytes(8, "little"))
            zout.writestr(zipfile.ZipInfo(info.filename), data)
    with pytest.raises(ValueError, match=r"lying\.pt: the pickle declares storage '0' of 4398046511104 bytes but "
                                         r"its record holds 4012 bytes"):
        safe_torch_load(lying)
    assert torch.equal(safe_torch_load(plain)["t"], torch.arange(1003, dtype=torch.float32))
