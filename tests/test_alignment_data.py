"""Alignment data pipeline (issue 6, items 1-3): formats, chat templates, tool calls, target masks, truncation,
best-fit-decreasing packing, DPO/ORPO pairs, and the packed-loss == unpacked-loss property on a tiny Llama.

The tokenizer is built here (byte-level BPE trained on a few strings, ChatML template like SmolLM2's): no downloads.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, PreTrainedTokenizerFast

from nxd_lc.alignment.rules import validate_alignment
from nxd_lc.config.alignment_schema import (
    DPOConfig,
    ModelAlignmentStrategyConfig,
    ORPOConfig,
    SFTConfig,
)
from nxd_lc.config.errors import ConfigError
from nxd_lc.config.schema import DataConfig, TokenizerConfig
from nxd_lc.data.alignment_datamodule import ModelAlignmentDataModule, clean_arrow_record, read_records
from nxd_lc.data.alignment_format import RecordFormatter
from nxd_lc.data.alignment_packing import (
    IGNORE_INDEX,
    TruncationStats,
    best_fit_decreasing,
    fill_ratio,
    prepare_pair,
    prepare_sft_example,
)
from nxd_lc.models.llama import LlamaForCausalLM

pytestmark = pytest.mark.compat  # torch-2.9 compatibility subset (lane 2; docs/testing.md)

# SmolLM2-style ChatML: a default system turn when the conversation has none.
CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
          "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# A tool-aware template: receives `tools` and assistant `tool_calls` natively.
TOOL_TEMPLATE = ("{% if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{% endif %}"
                 "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m.get('content') %}{{ m['content'] }}"
                 "{% endif %}{% for c in m.get('tool_calls', []) %}CALL {{ c['function'] | tojson }}{% endfor %}"
                 "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TRAIN_TEXT = ["the quick brown fox jumps over the lazy dog", "hello world, how are you today?",
              "user assistant system tool weather city unit query max_results lang", '{"name": "x"} 0123456789']
SEQ = 256


# The schema's own sections: input_key / output_key unset (None) must read NxDT's {"input", "output"} records.
AlignmentTokenizerConfig = TokenizerConfig
AlignmentDataConfig = DataConfig


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerFast:
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator(TRAIN_TEXT * 5, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", bos_token="<|im_start|>",
                                   pad_token="<|endoftext|>", chat_template=CHATML)


def _targets_text(tok: PreTrainedTokenizerFast, ids: np.ndarray, mask: np.ndarray) -> str:
    return tok.decode(ids[mask].tolist())


def _chat(i: int, turns: int = 2) -> dict[str, Any]:
    msgs: list[dict[str, Any]] = [{"role": "system", "content": f"sys {i}"}] if i % 3 == 0 else []
    for t in range(turns):
        msgs += [{"role": "user", "content": "how are you " * (1 + (i + t) % 4)},
                 {"role": "assistant", "content": f"fox {i} jumps {t}" + " lazy dog" * ((i * 7 + t) % 5)}]
    return {"messages": msgs}


def _assistant_text(rec: dict[str, Any]) -> str:
    return "".join(m["content"] + "<|im_end|>\n" for m in rec["messages"] if m["role"] == "assistant")


# ---- formats and target masks ----------------------------------------------------------------------------------
def test_nxdt_input_output_targets_only_output(tok: PreTrainedTokenizerFast) -> None:
    fmt = RecordFormatter(tok, input_key="question", output_key="answer")
    enc = fmt.encode_sft({"question": "how are you?", "answer": "hello world"}, "rec")
    assert _targets_text(tok, enc.input_ids, enc.target_mask) == "hello world<|im_end|>"
    assert tok.decode(enc.input_ids[~enc.target_mask].tolist()) == "how are you?"
    with pytest.raises(ValueError, match=r"rec: .*'question' and 'answer'.*found keys \['input', 'output'\]"):
        fmt.encode_sft({"input": "a", "output": "b"}, "rec")


def test_unset_record_keys_read_nxdt_input_output(tok: PreTrainedTokenizerFast, tmp_path: Path) -> None:
    """data.input_key / data.output_key unset (None in the schema, so validation can see they were not set) read
    NxDT's SFT records {"input", "output"}; set, they name other keys."""
    recs = [{"input": f"question {i}?", "output": f"answer {i}"} for i in range(4)]
    dm = _module(tok, _write(tmp_path / "sft.jsonl", recs), ModelAlignmentStrategyConfig(sft=SFTConfig()))
    assert DataConfig().input_key is None and len(dm.train_dataset) == 4
    row = dm.train_dataset[0]
    assert tok.decode(row["labels"][row["labels"] != -100].tolist()) == "answer 0<|im_end|>"  # labels: the targets
    renamed = [{"q": r["input"], "a": r["output"]} for r in recs]
    dm = _module(tok, _write(tmp_path / "qa.jsonl", renamed), ModelAlignmentStrategyConfig(sft=SFTConfig()),
                 input_key="q", output_key="a")
    assert len(dm.train_dataset) == 4


def test_chat_every_assistant_turn_is_a_target(tok: PreTrainedTokenizerFast) -> None:
    rec = _chat(1, turns=3)
    enc = RecordFormatter(tok).encode_sft(rec, "rec")
    assert enc.text == tok.apply_chat_template(rec["messages"], tokenize=False)
    assert enc.text.startswith("<|im_start|>system\nYou are a helpful assistant.")  # the template's default turn
    assert _targets_text(tok, enc.input_ids, enc.target_mask) == _assistant_text(rec)
    prompt_part = tok.decode(enc.input_ids[~enc.target_mask].tolist())
    for m in rec["messages"]:
        assert (m["content"] in prompt_part) == (m["role"] != "assistant")


def test_null_template_is_passthrough_and_custom_jinja(tok: PreTrainedTokenizerFast) -> None:
    rec = {"messages": [{"role": "user", "content": "Q: hello "}, {"role": "assistant", "content": "world"}]}
    enc = RecordFormatter(tok, None).encode_sft(rec, "rec")
    assert enc.text == "Q: hello world<|im_end|>"
    assert _targets_text(tok, enc.input_ids, enc.target_mask) == "world<|im_end|>"
    jinja = ("{% for m in messages %}### {{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
             "{% if add_generation_prompt %}### assistant: {% endif %}")
    enc = RecordFormatter(tok, jinja).encode_sft(rec, "rec")
    assert enc.text == "### user: Q: hello \n### assistant: world\n"
    assert _targets_text(tok, enc.input_ids, enc.target_mask) == "world\n"


def test_template_errors_name_the_key(tok: PreTrainedTokenizerFast) -> None:
    bare = PreTrainedTokenizerFast(tokenizer_object=tok.backend_tokenizer, eos_token="<|im_end|>")
    with pytest.raises(ValueError, match="f.jsonl:3: data.tokenizer.chat_template is 'default' but the tokenizer"):
        RecordFormatter(bare).encode_sft(_chat(1), "f.jsonl:3")
    assert RecordFormatter(bare).encode_sft({"input": "a", "output": "b"}, "x").target_mask.any()  # plain: fine
    with pytest.raises(ValueError, match="data.tokenizer.chat_template: 'chatml' is neither"):
        RecordFormatter(tok, "chatml")
    unstable = "{{ messages | length }} turns\n{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    with pytest.raises(ValueError, match="r: the chat template is not prefix-stable at message 1"):
        RecordFormatter(tok, unstable).encode_sft(_chat(1), "r")
    with pytest.raises(ValueError, match="r: the conversation starts with an assistant message"):
        RecordFormatter(tok).encode_sft({"messages": [{"role": "assistant", "content": "a"}]}, "r")
    with pytest.raises(ValueError, match="message 1 .*has no 'content'"):
        RecordFormatter(tok).encode_sft({"messages": [{"role": "user", "content": "a"}, {"role": "assistant"}]},
                                        "r")


# ---- tool calls: heterogeneous schemas preserved exactly ---------------------------------------------------------
def _tool_records() -> list[dict[str, Any]]:
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"}}}}}
    search = {"type": "function", "function": {"name": "search", "parameters": {
        "type": "object", "properties": {"query": {"type": "string"}, "max_results": {"type": "integer"},
                                         "lang": {"type": "string"}}}}}
    recs = []
    for tool, args, result in ((weather, {"city": "Paris", "unit": "C"}, "18 C"),
                               (search, {"query": "fox", "max_results": 3, "lang": "en"}, "3 hits")):
        name = tool["function"]["name"]
        recs.append({"tools": [tool], "messages": [
            {"role": "user", "content": "how are you today?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": name, "arguments": args}}]},
            {"role": "tool", "tool_call_id": "c1", "content": result},
            {"role": "assistant", "content": f"done: {result}"}]})
    return recs


def _keys_in(text: str) -> set[str]:
    return set(re.findall(r'"([a-z_]+)":', text))


@pytest.mark.parametrize("template", ["default", TOOL_TEMPLATE])
def test_tool_schemas_survive_jsonl_exactly(tok: PreTrainedTokenizerFast, tmp_path: Path, template: str) -> None:
    path = tmp_path / "tools.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _tool_records()))
    fmt = RecordFormatter(tok, template)
    expected = [{"type", "function", "name", "parameters", "properties", "city", "unit", "arguments"},
                {"type", "function", "name", "parameters", "properties", "query", "max_results", "lang",
                 "arguments"}]
    for (rec, where), keys in zip(read_records(str(path), "data.train_dir"), expected, strict=True):
        enc = fmt.encode_sft(rec, where)
        assert _keys_in(enc.text) == keys, enc.text
        assert "None" not in enc.text and "null" not in enc.text
        targets = _targets_text(tok, enc.input_ids, enc.target_mask)
        call_args = rec["messages"][1]["tool_calls"][0]["function"]["arguments"]
        assert json.dumps(call_args) in targets  # the assistant's tool call is a target, args verbatim
        assert targets.endswith(f"done: {rec['messages'][2]['content']}<|im_end|>\n")
        assert "<|im_start|>" not in targets and "tool_response" not in targets  # tool results are not


def test_arrow_null_fill_is_removed(tok: PreTrainedTokenizerFast, tmp_path: Path) -> None:
    import datasets

    recs = _tool_records()
    datasets.Dataset.from_list(recs).save_to_disk(str(tmp_path / "structs"))
    raw = datasets.load_from_disk(str(tmp_path / "structs"))[0]
    assert raw["tools"][0]["function"]["parameters"]["properties"]["query"] is None  # the unification hazard
    as_strings = [{**r, "tools": json.dumps(r["tools"])} for r in recs]
    datasets.Dataset.from_list(as_strings).save_to_disk(str(tmp_path / "strings"))
    jsonl_texts = [RecordFormatter(tok).encode_sft(r, "x").text for r in recs]
    for name in ("structs", "strings"):
        got = read_records(str(tmp_path / name), "data.train_dir")
        texts = [RecordFormatter(tok).encode_sft(r, w).text for r, w in got]
        assert texts == jsonl_texts, name
    assert clean_arrow_record({"tools": "[1]", "messages": [{"role": "u", "content": "a", "x": None}]}) == (
        {"tools": [1], "messages": [{"role": "u", "content": "a"}]}, True)


# ---- truncation --------------------------------------------------------------------------------------------------
def test_truncation_modes_and_counts(tok: PreTrainedTokenizerFast) -> None:
    fmt = RecordFormatter(tok)
    long_out = fmt.encode_sft({"input": "hello", "output": "fox " * 40}, "r")
    long_in = fmt.encode_sft({"input": "dog " * 40, "output": "fox"}, "r")
    stats = TruncationStats()
    ids, labels = prepare_sft_example(long_out, 16, "keep_start", False, stats)
    assert ids.shape == (16,) and np.array_equal(ids, long_out.input_ids[:16])
    ids, _ = prepare_sft_example(long_in, 16, "keep_end", False, stats)
    assert np.array_equal(ids, long_in.input_ids[-16:])
    assert prepare_sft_example(long_in, 16, "keep_start", False, stats) is None  # output cut away: no target
    assert prepare_sft_example(long_out, 16, "keep_start", True, stats) is None  # drop_overlong
    assert (stats.num_records, stats.num_kept, stats.num_truncated) == (4, 2, 3)
    assert (stats.num_dropped_overlong, stats.num_dropped_no_target, stats.num_dropped) == (1, 1, 2)
    with pytest.raises(ValueError, match="sft.truncation_mode: 'middle'"):
        prepare_sft_example(long_out, 16, "middle", False, stats)


# ---- packing -----------------------------------------------------------------------------------------------------
def test_best_fit_decreasing() -> None:
    assert best_fit_decreasing([5, 4, 3, 3, 2, 2, 1], 10) == [[0, 1, 6], [2, 3, 4, 5]]
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(5.5, 0.8, 2000).astype(int), 8, 2048).tolist()
    rows = best_fit_decreasing(lengths, 2048)
    assert sorted(i for r in rows for i in r) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in r) <= 2048 for r in rows)
    bfd = fill_ratio(lengths, rows, 2048)
    next_fit, room = 1, 2048  # in-order greedy concatenation, a new row when the next one does not fit
    for n in lengths:
        next_fit, room = (next_fit, room - n) if n <= room else (next_fit + 1, 2048 - n)
    assert bfd > 0.97 and bfd > sum(lengths) / (next_fit * 2048) + 0.1
    with pytest.raises(ValueError, match="length 11 > capacity 10"):
        best_fit_decreasing([11], 10)


def _module(tok: PreTrainedTokenizerFast, path: Path, strategy: ModelAlignmentStrategyConfig, *, seq: int = SEQ,
            micro: int = 2, **data: Any) -> ModelAlignmentDataModule:
    cfg = AlignmentDataConfig(micro_batch_size=micro, global_batch_size=micro, train_dir=str(path), **data)
    dm = ModelAlignmentDataModule(cfg, strategy, seq_length=seq, seed=0, model_vocab_size=512, data_parallel_rank=0,
                                  data_parallel_size=1, global_batch_size=micro, tokenizer=tok)
    dm.setup()
    return dm


def _write(path: Path, recs: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


def test_packed_rows_never_label_prompt_tokens(tok: PreTrainedTokenizerFast, tmp_path: Path) -> None:
    recs = [_chat(i) for i in range(24)]
    dm = _module(tok, _write(tmp_path / "chat.jsonl", recs), ModelAlignmentStrategyConfig(sft=SFTConfig(packing=True)))
    assert dm.num_truncated == 0 and dm.num_dropped == 0 and len(dm.train_dataset) < len(recs)
    expected = sorted(_assistant_text(r) for r in recs)
    seen = []
    for batch in dm.train_dataloader():
        for ids, labels, pos, seg in zip(batch["input_ids"], batch["labels"], batch["position_ids"],
                                         batch["segment_ids"], strict=True):
            for s in seg.unique().tolist():
                where = (seg == s).nonzero().flatten()
                assert pos[where].tolist() == list(range(len(where)))
                lab = labels[where]
                assert lab[-1] == IGNORE_INDEX  # no target across the example boundary
                keep = lab != IGNORE_INDEX
                assert torch.equal(lab[:-1][keep[:-1]], ids[where][1:][keep[:-1]])
                if ids[where[0]] != dm.pad_token_id:
                    seen.append(tok.decode(lab[keep].tolist()))
                else:
                    assert not keep.any()  # padding segment
    # The targets of each packed example are exactly its assistant turns: no prompt token is ever a target
    # (NxDT's packed SFT copied labels from input_ids, which would put system/user tokens here).
    assert sorted(seen) == expected


@pytest.mark.parametrize("flash_attention", [True, False])
def test_packed_loss_equals_unpacked(tok: PreTrainedTokenizerFast, tmp_path: Path, flash_attention: bool) -> None:
    path = _write(tmp_path / "chat.jsonl", [_chat(i) for i in range(10)])
    packed = _module(tok, path, ModelAlignmentStrategyConfig(sft=SFTConfig(packing=True)), micro=1)
    plain = _module(tok, path, ModelAlignmentStrategyConfig(sft=SFTConfig(packing=False)), micro=1)
    assert len(packed.train_dataset) < len(plain.train_dataset) == 10
    assert packed.train_fill_ratio > plain.train_fill_ratio
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=48,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=SEQ), flash_attention=flash_attention)
    totals = []
    for dm in (packed, plain):
        loss, count = torch.zeros(()), 0
        with torch.no_grad():
            for i in range(len(dm.train_dataset)):
                b = {k: torch.from_numpy(v)[None] for k, v in dm.train_dataset[i].items()}
                s, n = model.loss(b["input_ids"], b["labels"], b["position_ids"], segment_ids=b["segment_ids"])
                loss, count = loss + s, count + int(n)
        totals.append((loss / count, count))
    assert totals[0][1] == totals[1][1]
    torch.testing.assert_close(totals[0][0], totals[1][0], atol=1e-5, rtol=0)
    b = {k: torch.from_numpy(v)[None] for k, v in packed.train_dataset[0].items()}
    assert len(b["segment_ids"].unique()) > 2  # several examples in the row
    with torch.no_grad():  # control: the same packed row without document masking gives another loss
        masked = model.loss(b["input_ids"], b["labels"], b["position_ids"], segment_ids=b["segment_ids"])[0]
        leaky = model.loss(b["input_ids"], b["labels"], b["position_ids"])[0]
    assert not torch.allclose(masked, leaky, atol=1e-4)


# ---- preference pairs --------------------------------------------------------------------------------------------
def test_preference_pairs_string_and_messages(tok: PreTrainedTokenizerFast) -> None:
    fmt = RecordFormatter(tok)
    pair = fmt.encode_preference({"prompt": "how are you?", "chosen": "fox", "rejected": "dog"}, "r")
    assert not pair.prompt.target_mask.any()
    assert _targets_text(tok, pair.chosen.input_ids, pair.chosen.target_mask) == "fox<|im_end|>"
    rec = {"prompt": [{"role": "user", "content": "hello"}],
           "chosen": [{"role": "assistant", "content": "world"}], "rejected": "lazy dog"}
    pair = fmt.encode_preference(rec, "r")
    assert pair.prompt.text.endswith("<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n")
    assert pair.chosen.text == "world<|im_end|>\n" and pair.rejected.text == "lazy dog<|im_end|>\n"
    assert pair.chosen.target_mask.all()
    with pytest.raises(ValueError, match=r"r: a preference record needs .*missing \['rejected'\]"):
        fmt.encode_preference({"prompt": "a", "chosen": "b"}, "r")


def test_pair_truncation(tok: PreTrainedTokenizerFast) -> None:
    fmt = RecordFormatter(tok)
    pair = fmt.encode_preference({"prompt": "dog " * 30, "chosen": "fox " * 5, "rejected": "hello"}, "r")
    stats = TruncationStats()
    for mode, sl in (("keep_start", slice(0, 20)), ("keep_end", slice(-20, None))):
        (c_ids, c_lab), (r_ids, r_lab) = prepare_pair(pair, 32, 20, mode, stats)
        assert np.array_equal(c_ids[:20], pair.prompt.input_ids[sl]) and np.array_equal(r_ids[:20], c_ids[:20])
        assert (c_lab[:19] == IGNORE_INDEX).all() and (c_lab[19:-1] != IGNORE_INDEX).all()
        assert c_ids.shape[0] <= 32 and r_ids.shape[0] <= 32
    assert (stats.num_records, stats.num_truncated, stats.num_kept) == (2, 2, 2)
    with pytest.raises(ValueError, match="dpo.max_prompt_length: 32 must be in"):
        prepare_pair(pair, 32, 32, "keep_start", stats)


@pytest.mark.parametrize("algorithm", ["dpo", "orpo"])
def test_preference_batches(tok: PreTrainedTokenizerFast, tmp_path: Path, algorithm: str) -> None:
    recs = [{"prompt": f"how are you {i}?", "chosen": f"fox {i}", "rejected": "dog " * (i + 1)} for i in range(6)]
    recs.append({"prompt": "dog " * 400, "chosen": "fox", "rejected": "the lazy dog"})  # prompt gets truncated
    strategy = ModelAlignmentStrategyConfig(**{algorithm: (DPOConfig if algorithm == "dpo" else ORPOConfig)(
        max_prompt_length=24, truncation_mode="keep_end")})
    dm = _module(tok, _write(tmp_path / "pairs.jsonl", recs), strategy, dev_choose_samples=8)
    assert dm.train_stats.num_records == 7 and dm.num_truncated == 1 and dm.num_dropped == 0
    batches = list(dm.train_dataloader())
    seen = [i for b in batches for i in b["sample_index"].tolist()]
    assert len(seen) == len(set(seen)) == 6 and set(seen) <= set(range(7))  # shuffled, 7 // 2 batches of 2
    for b in batches:
        assert b["input_ids"].shape == (4, SEQ) and b["segment_ids"].dtype == torch.int32
        for k, idx in enumerate(b["sample_index"].tolist()):
            chosen, rejected = b["labels"][k], b["labels"][k + 2]
            rec = recs[idx]
            assert tok.decode(chosen[chosen != IGNORE_INDEX].tolist()) == rec["chosen"] + "<|im_end|>"
            assert tok.decode(rejected[rejected != IGNORE_INDEX].tolist()) == rec["rejected"] + "<|im_end|>"
            assert torch.equal(b["input_ids"][k][:5], b["input_ids"][k + 2][:5])  # shared prompt


def test_dev_choose_samples_and_val_dir(tok: PreTrainedTokenizerFast, tmp_path: Path) -> None:
    (tmp_path / "train").mkdir()
    _write(tmp_path / "train" / "a.jsonl", [_chat(i) for i in range(5)])
    _write(tmp_path / "train" / "b.jsonl", [_chat(i) for i in range(5, 9)])
    val = _write(tmp_path / "val.jsonl", [_chat(i) for i in range(4)])
    dm = _module(tok, tmp_path / "train", ModelAlignmentStrategyConfig(sft=SFTConfig()), dev_choose_samples=7,
                 val_dir=str(val))
    assert dm.train_stats.num_records == 7 and len(dm.train_dataset) == 7 and dm.val_stats.num_records == 4
    assert dm.train_dataset.rows == [[i] for i in range(7)] and len(list(dm.val_dataloader())) == 2
    fresh = [b["input_ids"] for b in dm.train_dataloader()]
    resumed = _module(tok, tmp_path / "train", ModelAlignmentStrategyConfig(sft=SFTConfig()), dev_choose_samples=7)
    resumed.load_state_dict({"consumed_samples": 2})  # as Lightning restores it from a checkpoint
    after = [b["input_ids"] for b in resumed.train_dataloader()]
    assert len(after) == len(fresh) - 1 and all(torch.equal(a, b) for a, b in zip(after, fresh[1:], strict=True))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": []}\nnot json\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not valid JSON"):
        read_records(str(bad), "data.train_dir")
    with pytest.raises(FileNotFoundError, match="data.val_dir: no such file"):
        read_records(str(tmp_path / "missing"), "data.val_dir")


@pytest.mark.parametrize("algorithm", ["sft", "dpo"])
def test_records_without_targets_name_the_file_lines_and_cause(tok: PreTrainedTokenizerFast, tmp_path: Path,
                                                                algorithm: str) -> None:
    """All-empty strings leave nothing to learn: the error names the file, the records and that cause, not
    data.seq_length (issue 40, item 8)."""
    rec = {"input": "", "output": ""} if algorithm == "sft" else {"prompt": "", "chosen": "", "rejected": ""}
    path = _write(tmp_path / "empty.jsonl", [rec] * 3)
    strategy = ModelAlignmentStrategyConfig(**{algorithm: SFTConfig() if algorithm == "sft" else DPOConfig()})
    with pytest.raises(ConfigError) as err:  # train.py's "error: ..." (exit 2), not a traceback (DPO's was)
        _module(tok, path, strategy)
    msg = str(err.value)
    assert re.search(rf"data\.train_dir: no usable records in {path}: 3 of 3 records have no target token "
                     rf"\(e\.g\. {path}:1, {path}:2, {path}:3\)", msg), msg
    assert "empty" in msg and "seq_length" not in msg, msg


def test_records_too_long_for_seq_length_are_told_apart(tok: PreTrainedTokenizerFast, tmp_path: Path) -> None:
    recs = [{"input": "", "output": ""}, {"input": "dog " * 40, "output": "fox"}, {"input": "the " * 40, "output": "a"}]
    path = _write(tmp_path / "mixed.jsonl", recs)
    for drop, cause in ((False, r"2 lost every target token to truncation at data\.seq_length 16"),
                        (True, r"2 were longer than data\.seq_length 16 and dropped "
                                r"\(model_alignment_strategy\.sft\.drop_overlong\)")):
        strategy = ModelAlignmentStrategyConfig(sft=SFTConfig(drop_overlong=drop, truncation_mode="keep_start"))
        with pytest.raises(ValueError) as err:
            _module(tok, path, strategy, seq=16)
        msg = str(err.value)
        assert re.search(rf"no usable records in {path}: 1 of 3 records have no target token \(e\.g\. {path}:1\)",
                         msg) and re.search(cause, msg) and "raise data.seq_length" in msg, msg


# ---- config ------------------------------------------------------------------------------------------------------
def test_alignment_config_validation() -> None:
    base = OmegaConf.structured(ModelAlignmentStrategyConfig)
    merged = OmegaConf.to_object(OmegaConf.merge(base, {"dpo": {"kl_beta": 0.1, "max_prompt_length": 10}}))
    assert merged.algorithm == "dpo" and merged.dpo.loss_type == "sigmoid"
    data = AlignmentDataConfig(train_dir="x.jsonl", tokenizer=AlignmentTokenizerConfig(chat_template=None))
    assert validate_alignment(merged, data, 64) == [] and validate_alignment(None, data, 64) == []
    listed = OmegaConf.to_object(OmegaConf.merge(base, {"dpo": {"loss_type": ["sigmoid", "sft"]}}))
    assert validate_alignment(listed, data, 64) == []
    bad = ModelAlignmentStrategyConfig(dpo=DPOConfig(loss_type="kto", truncation_mode="middle", kl_beta=0,
                                                     max_prompt_length=64))
    errors = validate_alignment(bad, AlignmentDataConfig(dev_choose_samples=0), 64)
    for key in ("data.train_dir", "data.dev_choose_samples", "dpo.truncation_mode", "dpo.loss_type",
                "dpo.kl_beta", "dpo.max_prompt_length"):
        assert any(e.startswith(key) or key in e.split(":")[0] for e in errors), (key, errors)
    packed = ModelAlignmentStrategyConfig(sft=SFTConfig(packing=True))
    leaky = AlignmentDataConfig(train_dir="x", builtin_corpus="python_stdlib", cross_document_attention=True)
    assert [e.split(":")[0] for e in validate_alignment(packed, leaky, 64)] == [
        "data.builtin_corpus", "data.cross_document_attention"]
    both = ModelAlignmentStrategyConfig(sft=SFTConfig(), orpo=ORPOConfig())
    assert "exactly one of sft, dpo, orpo" in validate_alignment(both, data, 64)[0]
