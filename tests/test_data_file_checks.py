"""Every text / JSON file the run reads is checked, with one error naming the file (issue 32, item 4: text and
JSON files and data directories): directory link loops (each real file read once), encodings (non-UTF-8,
UTF-16, NUL bytes), deep nesting and huge numbers in JSON, wrong JSON types in records and in config.json,
damaged tokenizer files, datasets directories with wrong column types or a damaged arrow file."""

from __future__ import annotations

import codecs
import json
import logging
import os
from pathlib import Path
from typing import Any

import pytest

from nxd_lc.app.validation import load_config
from nxd_lc.app.validation.data import path_problems
from nxd_lc.config.errors import ConfigError
from nxd_lc.config.input_files import glob_files
from nxd_lc.data.alignment_datamodule import read_records
from nxd_lc.data.alignment_format import RecordFormatter
from nxd_lc.data.sources import iter_documents, resolve_source
from nxd_lc.data.tokenizer import train_bytelevel_bpe
from nxd_lc.models.hf_config import build_llama_config

pytestmark = pytest.mark.compat  # torch-2.9 compatibility subset (lane 2; docs/testing.md)

TINY_JSON = str(Path(__file__).resolve().parents[1] / "conf" / "tiny_llama_config.json")


def _tiny(**model: Any) -> dict[str, Any]:
    return {"trainer": {"devices": 1, "num_nodes": 1, "max_steps": 10},
            "data": {"micro_batch_size": 1, "global_batch_size": 1},
            "model": {"model_config": TINY_JSON, "encoder_seq_length": 64, **model}}


# ---- directory link loops ----------------------------------------------------------------------------------------
def _corpus(root: Path) -> None:
    (root / "sub").mkdir(parents=True)
    for i, rel in enumerate(("a.jsonl", "b.jsonl", "sub/c.jsonl")):
        (root / rel).write_text("".join(json.dumps({"text": f"doc {i} {j}", "input": "q", "output": f"a{i}{j}"})
                                        + "\n" for j in range(3)))


LOOPS = {
    "link to itself": [("self", ".")],
    "two links to itself": [("self", "."), ("again", ".")],
    "link to its parent": [("sub/up", "..")],
    "links to parent and grandparent": [("sub/up", ".."), ("sub/up2", "../..")],
}


@pytest.mark.parametrize("links", LOOPS.values(), ids=LOOPS.keys())
def test_data_directory_with_a_link_loop_reads_each_file_once(tmp_path: Path, links: list[tuple[str, str]],
                                                              caplog: pytest.LogCaptureFixture) -> None:
    clean, looped = tmp_path / "clean", tmp_path / "top" / "looped"
    _corpus(clean)
    _corpus(looped)
    for name, target in links:
        os.symlink(target, looped / name)
    caplog.set_level(logging.WARNING)
    docs = list(iter_documents(resolve_source(str(looped), key_name="data.train_dir")))
    assert len(docs) == len(list(iter_documents(resolve_source(str(clean))))) == 9
    assert len(read_records(str(looped), "data.train_dir")) == len(read_records(str(clean), "data.train_dir")) == 9
    assert path_problems(load_config(_tiny() | {"data": {"micro_batch_size": 1, "global_batch_size": 1,
                                                         "train_dir": str(looped / "**" / "*.jsonl")}})) == []
    warned = caplog.text
    assert "data.train_dir" in warned and "a directory it is inside of (a loop); not followed" in warned
    assert str(looped / links[0][0]) in warned


def test_a_file_reached_through_two_links_is_read_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    outside = tmp_path / "shared"
    _corpus(outside)
    data = tmp_path / "data"
    data.mkdir()
    os.symlink(outside, data / "one")
    os.symlink(outside, data / "two")
    os.symlink(outside / "a.jsonl", data / "direct.jsonl")
    caplog.set_level(logging.WARNING)
    files = glob_files(str(data / "**" / "*.jsonl"), key="data.train_dir")
    # every path goes through a link here, so the first in sorted order is kept: a.jsonl as direct.jsonl
    assert [os.path.relpath(f, data) for f in files] == ["direct.jsonl", "one/b.jsonl", "one/sub/c.jsonl"]
    assert len(list(iter_documents(resolve_source(str(data))))) == 9
    assert "a directory already read as" in caplog.text and "is the same file as" in caplog.text


def test_glob_files_matches_glob_without_links(tmp_path: Path) -> None:
    import glob

    for sub in ("", "x", "x/y", ".hidden", "x/.q"):
        (tmp_path / sub).mkdir(parents=True, exist_ok=True)
        for name in ("a.txt", "b.jsonl", ".h.txt"):
            (tmp_path / sub / name).write_text("t")
    for pattern in ("**/*", "**/*.txt", "*", "x/**/*", "**", "x/*/*.txt", "**/y/*", ".hidden/*", "**/.h.txt",
                    "[ab].*", "**/**/*.txt"):
        full = str(tmp_path / pattern)
        # glob lists a file once per way '**/**' reaches it; glob_files once
        assert glob_files(full) == sorted({f for f in glob.glob(full, recursive=True) if os.path.isfile(f)}), pattern


# ---- encodings -------------------------------------------------------------------------------------------------------
def _pretrain_txt(path: Path) -> Any:
    return list(iter_documents(resolve_source(str(path.parent), file_glob="*.txt")))


def _pretrain_jsonl(path: Path) -> Any:
    return list(iter_documents(resolve_source(str(path))))


def _align_jsonl(path: Path) -> Any:
    return read_records(str(path), "data.train_dir")


READERS = {"pretraining .txt": ("doc.txt", _pretrain_txt, b"first line\nsecond line ", b"\n"),
           "pretraining .jsonl": ("doc.jsonl", _pretrain_jsonl, b'{"text": "one"}\n{"text": "two ', b'"}\n'),
           "alignment .jsonl": ("sft.jsonl", _align_jsonl, b'{"input": "q", "output": "a"}\n{"input": "q ',
                                b'", "output": "a"}\n'),
           "alignment .json": ("sft.json", _align_jsonl, b'[{"input": "q", "output": "a"},\n{"input": "q ',
                               b'", "output": "a"}]\n')}


@pytest.mark.parametrize(("name", "read", "head", "tail"), READERS.values(), ids=READERS.keys())
def test_text_encodings_name_file_line_and_byte(tmp_path: Path, name: str, read: Any, head: bytes,
                                                tail: bytes) -> None:
    path = tmp_path / name
    path.write_bytes(codecs.BOM_UTF8 + head + "é".encode() + tail)  # a UTF-8 BOM is accepted
    assert len(read(path)) == (1 if name.endswith(".txt") else 2)
    path.write_bytes(head + b"\xe9" + tail)  # Latin-1
    with pytest.raises(ValueError, match=rf"{name}:2: not UTF-8 \(invalid continuation byte at byte "
                                         rf"{len(head)} of the file\); re-encode the file as UTF-8"):
        read(path)
    path.write_bytes(head + b"\0" + tail)
    with pytest.raises(ValueError, match=rf"{name}:2: a NUL byte at byte {len(head)} of the file"):
        read(path)
    path.write_bytes(codecs.BOM_UTF16_LE + (head + tail).decode().encode("utf-16-le"))
    with pytest.raises(ValueError, match=rf"{name} is UTF-16 \(little-endian\) text .* re-encode it"):
        read(path)


@pytest.mark.parametrize(("data", "match"), [
    (b'{"vocab_size": 320,\n "model_type": "\xe9"}', r"config\.json:2: not UTF-8 \(invalid continuation byte"),
    (codecs.BOM_UTF16_BE + '{"vocab_size": 320}'.encode("utf-16-be"), r"config\.json is UTF-16 \(big-endian\)"),
    (b'{"vocab_size": 320,\0 "hidden_size": 64}', r"config\.json:1: a NUL byte at byte 19"),
    (b'{"a": ' * 3000 + b"1" + b"}" * 3000, r"config\.json: JSON nested deeper than the parser allows"),
    (b'{"vocab_size": 320,\n "rope_theta": 1e999}', r"config\.json:2: the number 1e999 is beyond a 64-bit float"),
    (b'{"vocab_size": 320,\n "rope_theta": NaN}', r"config\.json:2: NaN is not a JSON number"),
    (b'{"vocab_size": 320,\n\n "x": ' + b"7" * 5000 + b"}", r"config\.json:3: an integer of 5000 digits"),
])
def test_config_json_damage_is_one_error_at_the_dry_run(tmp_path: Path, data: bytes, match: str) -> None:
    """load_config is what the dry run calls: before, a non-UTF-8 config.json crashed it (UnicodeDecodeError)."""
    path = tmp_path / "config.json"
    path.write_bytes(data)
    with pytest.raises(ConfigError, match=rf"model\.model_config: .*{match}"):
        load_config(_tiny(model_config=str(path)))
    with pytest.raises(ValueError, match=match):
        build_llama_config(str(path))


# ---- JSON nesting and numbers in records --------------------------------------------------------------------------
@pytest.mark.parametrize(("line", "match"), [
    ('{"text": ' + "[" * 5000 + "]" * 5000 + "}", r":2: JSON nested deeper than the parser allows"),
    ('{"text": "x", "n": 1e999}', r":2: the number 1e999 is beyond a 64-bit float"),
    ('{"text": "x", "n": -Infinity}', r":2: -Infinity is not a JSON number"),
    ('{"text": "x", "n": ' + "9" * 4400 + "}", r":2: an integer of 4400 digits"),
])
def test_jsonl_nesting_and_numbers_name_file_and_line(tmp_path: Path, line: str, match: str) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "ok", "input": "q", "output": "a"}\n' + line + "\n")
    with pytest.raises(ValueError, match=rf"d\.jsonl{match}"):
        list(iter_documents(resolve_source(str(path))))
    with pytest.raises(ValueError, match=rf"d\.jsonl{match}"):
        read_records(str(path), "data.train_dir")


# ---- JSON types in records ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fmt() -> RecordFormatter:
    return RecordFormatter(train_bytelevel_bpe(["some text to train on, plus a little more"] * 20, 300),
                           chat_template=None)


def _chat(**assistant: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": None, **assistant}]}


SFT_CASES = {
    "tool_calls a string": (_chat(tool_calls="get_weather"), r"message 1 'tool_calls' must be a list of calls, "
                                                             r"got a string"),
    "tool call a number": (_chat(tool_calls=[3]), r"message 1 tool_calls\[0\] must be .*got a number"),
    "tool name a number": (_chat(tool_calls=[{"function": {"name": 7}}]),
                           r"message 1 tool_calls\[0\] .*got 'name' a number"),
    "arguments a list": (_chat(tool_calls=[{"function": {"name": "f", "arguments": [1]}}]),
                         r"message 1 tool_calls\[0\] 'arguments' must be a JSON string or an object, got a list"),
    "tools an object": ({**_chat(content="a"), "tools": {"name": "f"}}, r"'tools' must be a list of tool objects.*"
                                                                        r"got an object"),
    "tools of strings": ({**_chat(content="a"), "tools": ["f"]}, r"'tools' must be .*got a string in the list"),
    "messages an object": ({"messages": {"role": "user"}}, r"'messages' must be a non-empty list .*got an object"),
    "role a number": ({"messages": [{"role": 1, "content": "x"}]}, r"message 0 must be an object with a string "
                                                                   r"'role', got 'role' a number"),
    "content a list": ({"messages": [{"role": "user", "content": ["x"]}]}, r"message 0 'content' must be a string, "
                                                                           r"got a list"),
    "input a number": ({"input": 5, "output": "a"}, r"an SFT record needs .*\('input' is a number\)"),
}


@pytest.mark.parametrize(("record", "match"), SFT_CASES.values(), ids=SFT_CASES.keys())
def test_sft_record_of_wrong_types_names_line_key_and_type(fmt: RecordFormatter, record: dict[str, Any],
                                                           match: str) -> None:
    with pytest.raises(ValueError, match=rf"^sft\.jsonl:4: {match}"):
        fmt.encode_sft(record, "sft.jsonl:4")


PAIR_CASES = {
    "prompt a number": ({"prompt": 3, "chosen": "a", "rejected": "b"}, r"'prompt' must be a string or a list of "
                                                                       r"messages, got a number"),
    "chosen a number, prompt a list": ({"prompt": [{"role": "user", "content": "q"}], "chosen": 1, "rejected": "b"},
                                       r"'chosen' must be a string or a list of messages, got a number"),
    "rejected an object": ({"prompt": [{"role": "user", "content": "q"}], "chosen": "a",
                            "rejected": {"role": "assistant", "content": "b"}},
                           r"'rejected' must be a string or a list of messages, got an object"),
    "chosen a list, prompt a string": ({"prompt": "q", "chosen": [], "rejected": "b"},
                                       r"'chosen' must be a string \(as 'prompt' is\), got an empty list"),
}


@pytest.mark.parametrize(("record", "match"), PAIR_CASES.values(), ids=PAIR_CASES.keys())
def test_preference_record_of_wrong_types_names_line_key_and_type(fmt: RecordFormatter, record: dict[str, Any],
                                                                  match: str) -> None:
    with pytest.raises(ValueError, match=rf"^pref\.jsonl:2: {match}"):
        fmt.encode_preference(record, "pref.jsonl:2")


def test_json_array_with_a_non_object_names_its_index(tmp_path: Path) -> None:
    path = tmp_path / "sft.json"
    path.write_text('[{"input": "q", "output": "a"}, 5]')
    with pytest.raises(ValueError, match=r"sft\.json\[1\]: a record must be a JSON object, got int"):
        read_records(str(path), "data.train_dir")


# ---- config.json field types ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(("field", "value", "wanted"), [
    ("hidden_size", "256", "an integer >= 1"), ("num_attention_heads", True, "an integer >= 1"),
    ("num_key_value_heads", 4.0, "an integer >= 1"), ("rms_norm_eps", [1e-5], "a finite number > 0"),
    ("rope_theta", "10000", "a finite number > 0"), ("tie_word_embeddings", "false", "true or false"),
    ("rope_scaling", "linear", "an object or null"), ("eos_token_id", -1, "a token id"),
    ("attention_dropout", None, "a finite number >= 0"),
])
def test_config_json_field_of_wrong_type_names_file_and_key(tmp_path: Path, field: str, value: Any,
                                                            wanted: str) -> None:
    raw = json.loads(Path(TINY_JSON).read_text()) | {field: value}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    match = rf"model\.model_config: .*config\.json: field '{field}' is .* but must be {wanted}"
    with pytest.raises(ConfigError, match=match):
        load_config(_tiny(model_config=str(path)))
    with pytest.raises(ValueError, match=match):
        build_llama_config(str(path))


# ---- tokenizer files ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tok") / "ok"
    train_bytelevel_bpe(["some text to train on, plus a little more"] * 20, 300).save_pretrained(path)
    return path


@pytest.mark.parametrize(("name", "data", "match"), [
    ("tokenizer.json", b'{"version": "1.0",', r"tokenizer\.json is not valid JSON \(line 1, column 19"),
    ("tokenizer.json", b"[" * 5000, r"tokenizer\.json: JSON nested deeper than the parser allows"),
    ("tokenizer_config.json", b'{"eos_token": "\xff"}', r"tokenizer_config\.json:1: not UTF-8"),
    ("tokenizer.json", codecs.BOM_UTF16_LE + "{}".encode("utf-16-le"), r"tokenizer\.json is UTF-16"),
    ("merges.txt", b"#version: 0.2\na\0 b\n", r"merges\.txt:2: a NUL byte"),
])
def test_damaged_tokenizer_file_is_named(tmp_path: Path, tokenizer_dir: Path, name: str, data: bytes,
                                         match: str) -> None:
    import shutil

    from nxd_lc.config.schema import TokenizerConfig
    from nxd_lc.data.tokenizer import load_tokenizer

    broken = tmp_path / "tok"
    shutil.copytree(tokenizer_dir, broken)
    (broken / name).write_bytes(data)
    with pytest.raises(ValueError, match=rf"^data\.tokenizer\.type: .*{match}"):
        load_tokenizer(TokenizerConfig(type=str(broken)), None)


# ---- datasets directories ------------------------------------------------------------------------------------------
def _saved(path: Path, columns: dict[str, Any]) -> str:
    import datasets

    datasets.Dataset.from_dict(columns).save_to_disk(str(path))
    return str(path)


@pytest.mark.parametrize(("columns", "match"), [
    ({"input_ids": [[1.0, 2.5], [3.0, 4.0]]}, r"column 'input_ids' holds list<item: double>, not lists of integer"),
    ({"input_ids": [[1, 2], [3, -4]]}, r"row 1: token ids must be in \[0, 2\*\*31\), .* from -4 to 3"),
    ({"input_ids": [[1, 2], [3, 2**40]]}, r"row 1: token ids must be in \[0, 2\*\*31\)"),
    ({"text": [1, 2]}, r"column 'text' holds int64, not text"),
])
def test_datasets_column_of_wrong_type_is_refused(tmp_path: Path, columns: dict[str, Any], match: str) -> None:
    path = _saved(tmp_path / "ds", columns)
    with pytest.raises(ValueError, match=rf"data\.train_dir: dataset .*ds.*{match}"):
        list(iter_documents(resolve_source(path)))


def test_damaged_arrow_file_is_named(tmp_path: Path) -> None:
    path = _saved(tmp_path / "ds", {"text": ["some text"] * 50, "input": ["q"] * 50, "output": ["a"] * 50})
    arrow = next(Path(path).glob("*.arrow"))
    data = arrow.read_bytes()
    arrow.write_bytes(data[: len(data) // 2])
    match = rf"data\.train_dir: {path} is a datasets save_to_disk directory that cannot be read .*its file {arrow}"
    with pytest.raises(ValueError, match=match):
        resolve_source(path)
    with pytest.raises(ValueError, match=match):
        read_records(path, "data.train_dir")
