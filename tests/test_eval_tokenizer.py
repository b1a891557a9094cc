"""The evaluation CLIs use the evaluated model's tokenizer (issue 50 item 2): ``--hf-dir``'s tokenizer when it is the
config's (recorded with its path and hashes in retrieval.json / the loss-by-position JSON), a refusal naming both
when it is not, ``--tokenizer`` to override, the config's (warned) when the HF directory has none; and the retrieval
grid logs why it has no KV cache and its progress (samples done, elapsed, time left)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import sysconfig
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from nxd_lc.cli import loss_by_position as lbp_cli
from nxd_lc.cli import retrieval as retrieval_cli
from nxd_lc.eval import retrieval
from nxd_lc.eval.retrieval import GridProgress
from tests.dist_utils import set_launch_env_of_one
from tests.test_retrieval_eval import _hf_tiny, tiny_run_config

_STDLIB = sysconfig.get_paths()["stdlib"]
_CORPUS = ("bisect.py", "heapq.py", "textwrap.py", "calendar.py", "shlex.py", "string.py")


def _texts(names: tuple[str, ...]) -> list[str]:
    return [open(os.path.join(_STDLIB, n)).read() for n in names]


@pytest.fixture(scope="module")
def bed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A corpus, the config's tokenizer A (trained on it), another tokenizer B (trained on other files, same size),
    a tiny HF Llama (vocab 1000) and HF directories of it: with A's files, with B's, and without any."""
    from nxd_lc.data.tokenizer import train_bytelevel_bpe

    root = tmp_path_factory.mktemp("evaltok")
    (root / "text").mkdir()
    for name, text in zip(_CORPUS, _texts(_CORPUS)):
        (root / "text" / name).write_text(text)
    train_bytelevel_bpe(_texts(_CORPUS), 1000).save_pretrained(str(root / "tok_a"))
    train_bytelevel_bpe(_texts(("argparse.py", "inspect.py")), 1000).save_pretrained(str(root / "tok_b"))
    _hf_tiny().save_pretrained(str(root / "hf_none"))
    for name, tok in (("hf_a", "tok_a"), ("hf_b", "tok_b")):
        shutil.copytree(root / "hf_none", root / name)
        for f in os.listdir(root / tok):
            shutil.copyfile(root / tok / f, root / name / f)
    (root / "conf").mkdir()
    (root / "conf" / "tiny.yaml").write_text(yaml.safe_dump(tiny_run_config(root, "tok_a", "hf_none")))
    return {"root": root, "conf": root / "conf"}


@pytest.fixture
def launch_env(monkeypatch: pytest.MonkeyPatch) -> None:
    set_launch_env_of_one(monkeypatch.setenv)


def _passkey(bed: dict[str, Path], hf: str, out: str, *extra: str) -> int:
    return retrieval_cli.main(["--config-name", "tiny", "--config-dir", str(bed["conf"]),
                               "--hf-dir", str(bed["root"] / hf), "--tasks", "passkey", "--lengths", "300",
                               "--depths", "0,1", "--num-samples", "1", "--out", str(bed["root"] / out), *extra],
                              prog="python -m nxd_lc.cli.passkey")


def _files_sha256(directory: Path, names: list[str]) -> str:
    """The documented hash: SHA-256 over each file's base name, a NUL and the SHA-256 of its bytes, in order."""
    h = hashlib.sha256()
    for n in names:
        h.update(n.encode() + b"\0" + hashlib.sha256((directory / n).read_bytes()).digest())
    return h.hexdigest()


def test_hf_dir_with_another_tokenizer_is_refused_naming_both(bed: dict[str, Path], launch_env: None,
                                                              capsys: pytest.CaptureFixture) -> None:
    assert _passkey(bed, "hf_b", "pk_b") == 2
    err = capsys.readouterr().err
    assert str(bed["root"] / "hf_b") in err and str(bed["root"] / "tok_a") in err, err
    assert "--tokenizer" in err and not (bed["root"] / "pk_b").exists()
    code = lbp_cli.main(["--config-name", "tiny", "--config-dir", str(bed["conf"]), "--hf-dir",
                         str(bed["root"] / "hf_b"), "--edges", "0,64,128", "--num-samples", "1"])
    err = capsys.readouterr().err
    assert code == 2 and str(bed["root"] / "hf_b") in err and str(bed["root"] / "tok_a") in err, err


def test_matching_tokenizer_is_recorded_and_progress_is_logged(bed: dict[str, Path], launch_env: None,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO):
        assert _passkey(bed, "hf_a", "pk_a", "--progress-interval", "0") == 0
    meta = json.loads((bed["root"] / "pk_a" / "retrieval.json").read_text())["meta"]
    tok = meta["tokenizer"]
    assert tok["path"] == str(bed["root"] / "hf_a") and tok["source"] == "--hf-dir"
    assert tok["config_tokenizer"] == str(bed["root"] / "tok_a") and tok["matches_config"] is True
    names = sorted(os.listdir(bed["root"] / "tok_a"), key=["tokenizer.json", "tokenizer_config.json"].index)
    assert tok["files"] == names
    assert tok["files_sha256"] == _files_sha256(bed["root"] / "hf_a", names)
    assert tok["files_sha256"] == _files_sha256(bed["root"] / "tok_a", names)  # the run's files, copied
    assert tok["num_tokens"] == 1000 and meta["kv_cache"] is True and meta["kv_cache_off_reason"] is None
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("retrieval: ")]
    assert any(m.startswith("retrieval: 2 samples on this rank") for m in lines), lines
    assert any(m.startswith("retrieval: 1/2 samples (passkey, length 300, depth 0)") and "left" in m
               for m in lines), lines
    assert any(m.startswith("retrieval: 2/2 samples (passkey, length 300, depth 1)") and m.endswith("done")
               for m in lines), lines

    out = bed["root"] / "lbp_a.json"
    assert lbp_cli.main(["--config-name", "tiny", "--config-dir", str(bed["conf"]), "--hf-dir",
                         str(bed["root"] / "hf_a"), "--edges", "0,64,128", "--num-samples", "1",
                         "--json", str(out)]) == 0
    rec = json.loads(out.read_text())["meta"]["tokenizer"]
    assert rec["path"] == str(bed["root"] / "hf_a") and rec["files_sha256"] == tok["files_sha256"]


def test_tokenizer_flag_overrides_and_tokenizes_the_haystack(bed: dict[str, Path], launch_env: None,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    """--tokenizer B on config A: accepted (warned), recorded as not the config's, and the held-out haystack is
    B's tokens of the corpus text (decoded with B, it is text of the corpus; A's ids decoded with B are not)."""
    from nxd_lc.app.convert import compose_run_config
    from nxd_lc.eval.heldout import heldout_haystack
    from nxd_lc.eval.tokenizer import content_digest, evaluation_tokenizer

    hf_b = str(bed["root"] / "hf_b")
    with caplog.at_level(logging.WARNING):
        assert _passkey(bed, "hf_b", "pk_override", "--tokenizer", hf_b, "--scoring", "rank") == 0
    tok = json.loads((bed["root"] / "pk_override" / "retrieval.json").read_text())["meta"]["tokenizer"]
    assert tok["path"] == hf_b and tok["source"] == "--tokenizer" and tok["matches_config"] is False
    assert any("is not the config's data.tokenizer" in r.getMessage() for r in caplog.records)

    cfg = compose_run_config("tiny", str(bed["conf"]), [])
    cfg_b, ev = evaluation_tokenizer(cfg, hf_b, hf_b)
    tok_b, hay_b = heldout_haystack(cfg_b, 1000, 200)
    tok_a, hay_a = heldout_haystack(cfg, 1000, 200)
    assert content_digest(tok_b) == content_digest(ev.tokenizer) != content_digest(tok_a)
    corpus = "".join(_texts(_CORPUS))
    assert tok_b.decode(hay_b[:40]) in corpus and tok_a.decode(hay_a[:40]) in corpus
    assert tok_b.decode(hay_a[:40]) not in corpus


def test_hf_dir_without_tokenizer_uses_the_configs_with_a_warning(bed: dict[str, Path], launch_env: None,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        assert _passkey(bed, "hf_none", "pk_none", "--scoring", "rank") == 0
    tok = json.loads((bed["root"] / "pk_none" / "retrieval.json").read_text())["meta"]["tokenizer"]
    assert tok["source"] == "data.tokenizer" and tok["path"] == str(bed["root"] / "tok_a")
    assert any("has no tokenizer files" in r.getMessage() and str(bed["root"] / "hf_none") in r.getMessage()
               for r in caplog.records)


def test_tokenizer_larger_than_the_model_is_refused(bed: dict[str, Path], launch_env: None,
                                                    capsys: pytest.CaptureFixture) -> None:
    from nxd_lc.data.tokenizer import train_bytelevel_bpe

    big = bed["root"] / "tok_big"
    train_bytelevel_bpe(_texts(_CORPUS), 1200).save_pretrained(str(big))
    assert _passkey(bed, "hf_a", "pk_big", "--tokenizer", str(big)) == 2
    err = capsys.readouterr().err
    assert str(big) in err and "1200 tokens" in err and "vocab_size 1000" in err, err


def test_progress_lines_and_time_left() -> None:
    """Time left = elapsed x remaining weight / weight done; lines at most every interval, always the last."""
    now = [0.0]
    p = GridProgress([1.0, 1.0, 2.0], interval_s=15.0, clock=lambda: now[0])
    now[0] = 10.0
    assert p.step("a") is None  # 10 s < 15 s since the start
    now[0] = 20.0
    assert p.step("b") == "retrieval: 2/3 samples (b), 20s elapsed, about 20s left"  # 20 x 2 / 2
    now[0] = 25.0
    assert p.step("c") == "retrieval: 3/3 samples (c), 25s elapsed, done"
    q = GridProgress([1.0, 3.0], interval_s=0.0, clock=lambda: now[0])
    now[0] = 95.0
    assert q.step("x") == "retrieval: 1/2 samples (x), 1m10s elapsed, about 3m30s left"  # 70 x 3 / 1


def test_grid_without_kv_cache_says_why_and_what_it_costs(caplog: pytest.LogCaptureFixture) -> None:
    """A model without a KV cache (a stub with the reason LlamaForCausalLM.kv_cache_unsupported gives under PP):
    the grid says so once, with the cost, records the reason, and logs its progress."""
    from nxd_lc.data.tokenizer import train_bytelevel_bpe

    tok = train_bytelevel_bpe(_texts(("bisect.py", "heapq.py")), 400)
    hay = tok.encode(_texts(("calendar.py",))[0])

    class _NoCache:
        def kv_cache_unsupported(self) -> str:
            return "pipeline parallelism holds the layers on several ranks"

        def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor, segment_ids: Any) -> torch.Tensor:
            return torch.zeros(*input_ids.shape, len(tok))

    retrieval._LOGGED.clear()
    with caplog.at_level(logging.INFO):
        for _ in range(2):
            res = retrieval.evaluate_grid(_NoCache(), tok, hay, tasks=["passkey"], lengths=[200], depths=[0.5],
                                          num_samples=2, vocab_size=len(tok), progress_interval_s=0,
                                          sample_kwargs={"num_candidates": 4})
    assert res["meta"]["kv_cache"] is False
    assert res["meta"]["kv_cache_off_reason"] == "pipeline parallelism holds the layers on several ranks"
    msgs = [r.getMessage() for r in caplog.records]
    why = [m for m in msgs if m.startswith("retrieval: no KV cache (pipeline parallelism")]
    assert len(why) == 1 and "(answer tokens + 4) + 4 full forwards" in why[0], why
    assert sum(m.startswith("retrieval: 2/2 samples (passkey, length 200, depth 0.5)") for m in msgs) == 2, msgs
    with pytest.raises(ValueError, match="pipeline parallelism"):
        retrieval.kv_cache_for(_NoCache(), True)


def test_already_tokenized_corpus_takes_only_the_configs_tokenizer(bed: dict[str, Path]) -> None:
    """A corpus of input_ids (a datasets directory) holds data.tokenizer's ids: --tokenizer B is refused there
    (naming the config's tokenizer), the same tokenizer is accepted and recorded as pretokenized."""
    import dataclasses

    import datasets

    from nxd_lc.app.convert import compose_run_config
    from nxd_lc.eval.tokenizer import evaluation_tokenizer

    ids = datasets.Dataset.from_dict({"input_ids": [list(range(i, i + 300)) for i in range(0, 600, 20)]})
    ids.save_to_disk(str(bed["root"] / "ids"))
    cfg = compose_run_config("tiny", str(bed["conf"]), [])
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, train_dir=str(bed["root"] / "ids")))
    with pytest.raises(ValueError, match="already tokenized") as e:
        evaluation_tokenizer(cfg, str(bed["root"] / "hf_b"), str(bed["root"] / "hf_b"))
    assert str(bed["root"] / "tok_a") in str(e.value)
    _, ev = evaluation_tokenizer(cfg, str(bed["root"] / "hf_a"))
    assert ev.pretokenized and ev.matches_config is True and ev.source == "--hf-dir"
