"""Bad data input handled in bounded memory or refused (issue 50 item 8): one very long document is tokenized in
pieces (nxd_lc.data.long_text), a chat template's rendered text is bounded per record (nxd_lc.data.chat_sandbox),
a resumed run keeps its tokenizer or stops naming what changed (nxd_lc.lightning.run_tokenizer). The bounds are
made small here; nothing large is allocated."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from nxd_lc.data import long_text, sources, tokenizer
from nxd_lc.data.chat_sandbox import ChatTemplateLimitError, RenderLimits, SandboxedChatTemplate
from nxd_lc.data.long_text import encode_documents, text_pieces
from nxd_lc.data.packing import pack_token_stream, tokenize_documents

WORDS = ["alpha", "beta", "gamma", "delta", "  spaced", "\n\nnew", "tab\tbed", "x1234567", "épée", "   "]


def _text(n_words: int, seed: int) -> str:
    rng = np.random.default_rng(seed)
    return " ".join(WORDS[i] for i in rng.integers(0, len(WORDS), n_words))


@pytest.fixture(scope="module")
def bpe() -> Any:
    return tokenizer.train_bytelevel_bpe([_text(400, s) for s in range(4)], 300)


def test_pieces_join_back_fit_the_bound_and_cut_before_the_last_space_of_a_run() -> None:
    text = _text(3000, 1)
    pieces = text_pieces(text, max_chars=100)
    assert "".join(pieces) == text and len(pieces) > 1
    for piece, nxt in zip(pieces, pieces[1:]):
        assert len(piece) <= 100
        assert re.match(r"\s\S", nxt), repr(nxt[:3])  # the next piece starts at the last whitespace of a run
    blob = "b" * 250  # no whitespace: cut hard at the bound
    assert [len(p) for p in text_pieces(blob, max_chars=100)] == [100, 100, 50]
    assert text_pieces("short", max_chars=100) == ["short"]


def test_long_documents_get_the_ids_of_the_whole_text(bpe: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    docs = [_text(n, s) for s, n in enumerate([5, 2000, 1, 700, 3000, 40])]
    reference = [bpe.backend_tokenizer.encode(d, add_special_tokens=False).ids for d in docs]  # whole texts
    monkeypatch.setattr(long_text, "MAX_ENCODE_CHARS", 64)
    monkeypatch.setattr(long_text, "MAX_BATCH_CHARS", 200)
    calls: list[list[str]] = []
    backend = bpe.backend_tokenizer

    class Spy:
        def encode_batch_fast(self, batch: list[str], add_special_tokens: bool) -> Any:
            calls.append(batch)
            return backend.encode_batch_fast(batch, add_special_tokens=add_special_tokens)

    got = list(encode_documents(docs, Spy(), batch_size=8))
    assert [g.tolist() for g in got] == reference
    assert all(len(b) <= 8 and sum(map(len, b)) <= 200 for b in calls)
    assert max(len(p) for b in calls for p in b) <= 64
    assert len(calls) > len(docs)  # the long ones really went in pieces


def test_a_long_txt_file_and_jsonl_line_pack_as_with_no_bound(bpe: Any, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    long_doc = _text(5000, 7)
    (tmp_path / "txt").mkdir()
    (tmp_path / "txt" / "a.txt").write_text(long_doc)
    (tmp_path / "txt" / "b.txt").write_text("short one")
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text(json.dumps({"text": "short one"}) + "\n" + json.dumps({"text": long_doc}) + "\n")
    for path in (str(tmp_path / "txt"), str(jsonl)):
        src = sources.resolve_source(path)
        unbounded = pack_token_stream(tokenize_documents(sources.iter_documents(src), bpe), 16, bpe.eos_token_id)
        with monkeypatch.context() as m:
            m.setattr(long_text, "MAX_ENCODE_CHARS", 128)
            m.setattr(long_text, "MAX_BATCH_CHARS", 512)
            bounded = pack_token_stream(tokenize_documents(sources.iter_documents(src), bpe), 16, bpe.eos_token_id)
        assert np.array_equal(bounded[0], unbounded[0]) and bounded[1] == unbounded[1], path
        assert bounded[1].num_documents == 2


def test_bpe_training_sees_no_input_longer_than_the_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(long_text, "MAX_ENCODE_CHARS", 50)
    text = _text(500, 3)
    pieces = list(tokenizer._limited_texts([text, "tail"], max_bytes=10**6))
    assert "".join(pieces) == text + "tail" and max(map(len, pieces)) <= 50
    assert "".join(tokenizer._limited_texts([text], max_bytes=120)) == text.encode()[:120].decode(errors="ignore")


def _system_prompt_template(n: int) -> str:
    return ("{{ '<sys>' ~ ('p' * " + str(n) + ") ~ '</sys>' }}"
            "{% for m in messages %}{{ m['content'] }}{% endfor %}")


def test_rendered_text_is_bounded_per_record_not_only_in_total() -> None:
    limits = RenderLimits(max_chars=10**6, max_output_chars=1000, output_chars_per_input_char=2)
    record = [{"role": "user", "content": "hello"}]
    ok = SandboxedChatTemplate(_system_prompt_template(900), {}, limits).render(record)
    assert ok == "<sys>" + "p" * 900 + "</sys>hello"  # the reference: what the template says
    bomb = SandboxedChatTemplate(_system_prompt_template(5000), {}, limits)  # within max_chars, past the output
    with pytest.raises(ChatTemplateLimitError, match=r"RenderLimits.max_output_chars 1,000 \+ 2 per character"):
        bomb.render(record)
    longer = [{"role": "user", "content": "h" * 6000}]  # the bound grows with the record: 1000 + 2 x ~6000
    assert bomb.render(longer).endswith("h" * 6000)
    default = RenderLimits()
    assert (default.max_output_chars, default.output_chars_per_input_char) == (2**20, 8)


def _run_start(log_dir: Path, tok: Any, src: Any) -> None:
    """What SaveRunTokenizer does at a run's first start on rank 0: save the tokenizer, record the corpus."""
    from nxd_lc.lightning import run_tokenizer as rt

    rt.save_run_tokenizer(tok, str(log_dir))
    (log_dir / rt.RUN_DATA_RECORD).write_text(json.dumps(rt.corpus_record(src)))


def test_a_resume_keeps_the_run_tokenizer_or_stops_naming_what_changed(bpe: Any, tmp_path: Path) -> None:
    from nxd_lc.config.errors import ConfigError
    from nxd_lc.lightning.run_tokenizer import check_resumed_run

    data, log_dir = tmp_path / "data", tmp_path / "run"
    data.mkdir()
    log_dir.mkdir()
    (data / "a.txt").write_text(_text(300, 1))
    (data / "b.txt").write_text(_text(300, 2))
    src = sources.resolve_source(str(data))
    _run_start(log_dir, bpe, src)
    assert check_resumed_run(bpe, str(log_dir), src) is not None  # nothing changed: resumes
    (data / "a.txt").write_text(_text(300, 1) + " appended")
    (data / "c.txt").write_text("new file")
    src2 = sources.resolve_source(str(data))
    retrained = tokenizer.train_bytelevel_bpe(sources.iter_documents(src2), 290)  # what a retrain gives
    with pytest.raises(ConfigError) as e:
        check_resumed_run(retrained, str(log_dir), src2)
    msg = e.value.problems[0]
    assert "the corpus changed since the run started: added c.txt, changed a.txt)" in msg
    assert f"data.tokenizer.type={log_dir / 'tokenizer'}" in msg
    with pytest.raises(ConfigError, match=r"data.train_dir: the corpus changed since this run started \(added "
                                          r"c.txt, changed a.txt\).*resume_allow_changed_corpus=true"):
        check_resumed_run(bpe, str(log_dir), src2)  # the same (fixed) tokenizer: repacking refused by default
    assert check_resumed_run(bpe, str(log_dir), src2, allow_changed_corpus=True)["files"].keys() == {
        "a.txt", "b.txt", "c.txt"}
    from transformers import AutoTokenizer  # the fix the message names: the saved directory is a tokenizer

    kept = AutoTokenizer.from_pretrained(str(log_dir / "tokenizer"))
    assert kept(_text(20, 5))["input_ids"] == bpe(_text(20, 5))["input_ids"]


def test_the_callback_checks_at_train_start_only_on_a_resume(bpe: Any, tmp_path: Path) -> None:
    from types import SimpleNamespace

    from nxd_lc.config.errors import ConfigError
    from nxd_lc.lightning.run_tokenizer import SaveRunTokenizer

    other = tokenizer.train_bytelevel_bpe([_text(300, 9)], 280)
    callback = SaveRunTokenizer(str(tmp_path))
    first = SimpleNamespace(datamodule=SimpleNamespace(tokenizer=bpe), ckpt_path=None, is_global_zero=True)
    callback.setup(first, None, "fit")  # type: ignore[arg-type]
    saved = (tmp_path / "tokenizer" / "tokenizer.json").read_text()
    resumed = SimpleNamespace(datamodule=SimpleNamespace(tokenizer=other), ckpt_path="ckpt", is_global_zero=True)
    callback.setup(resumed, None, "fit")  # type: ignore[arg-type]  # never replaces before the check
    with pytest.raises(ConfigError, match="data.tokenizer: this resumed run's checkpoints were trained with"):
        callback.on_train_start(resumed, None)  # type: ignore[arg-type]
    assert (tmp_path / "tokenizer" / "tokenizer.json").read_text() == saved
    fresh = SimpleNamespace(datamodule=SimpleNamespace(tokenizer=other), ckpt_path=None, is_global_zero=True)
    callback.on_train_start(fresh, None)  # type: ignore[arg-type]  # a new run in the directory: replaced
    assert (tmp_path / "tokenizer" / "tokenizer.json").read_text() != saved
