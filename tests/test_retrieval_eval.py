"""The retrieval harness (nxd_lc.eval.retrieval): exact needle placement, hand-checked scoring, a perfect copier
scores 1 and a random model scores near chance, and TP / CP layouts give transformers' log-likelihoods."""

from __future__ import annotations

import glob
import json
import math
import os
import sysconfig
from typing import Any

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from tokenizers import decoders as tk_decoders
from transformers import PreTrainedTokenizerFast

from nxd_lc.data import retrieval_tasks as tasks
from nxd_lc.data.retrieval_tasks import build_sample
from nxd_lc.eval import retrieval
from nxd_lc.eval.retrieval import candidate_logprobs, evaluate_grid, score_sample
from tests.dist_utils import run_distributed


def _tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE (vocab 1000) trained on the task templates and a few stdlib files."""
    root = sysconfig.get_paths()["stdlib"]
    texts = [open(os.path.join(root, n)).read() for n in ("bisect.py", "heapq.py", "textwrap.py")]
    texts += [tasks.PASSKEY_INTRO, tasks.PASSKEY_FILLER * 3, tasks.NIAH_INTRO, tasks.VT_INTRO]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk_decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=1000, special_tokens=["<eos>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerFast:
    return _tokenizer()


@pytest.fixture(scope="module")
def hay(tok: PreTrainedTokenizerFast) -> list[int]:
    root = sysconfig.get_paths()["stdlib"]
    return tok.encode(open(os.path.join(root, "calendar.py")).read())


@pytest.mark.compat
@pytest.mark.parametrize("task", tasks.TASKS)
def test_needle_placement_is_exact_at_every_depth(tok: Any, hay: list[int], task: str) -> None:
    enc = lambda t: tok.encode(t, add_special_tokens=False)  # noqa: E731
    for depth in (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0):
        s = build_sample(task, tok, hay, 400, depth, seed=3, index=1)
        assert len(s.input_ids) == 400
        intro = enc({"passkey": tasks.PASSKEY_INTRO, "variable_tracking": tasks.VT_INTRO}.get(
            task, tasks.NIAH_INTRO))
        assert s.input_ids[:len(intro)] == intro
        needle_tokens = sum(b - a for a, b in s.needle_spans)
        text_ids = [t for i, t in enumerate(s.input_ids)
                    if not any(a <= i < b for a, b in s.needle_spans)]
        start, stop = s.needle_spans[0]
        before = sum(b - a for a, b in s.needle_spans[1:] if b <= start)  # needles inserted before the primary one
        question = _question(task, s, enc)
        budget = 400 - len(intro) - len(question) - needle_tokens
        assert start == len(intro) + round(depth * budget) + before, (task, depth)
        primary = _primary_needle(task, s)
        assert s.input_ids[start:stop] == enc(primary)
        assert s.input_ids[-len(question):] == question
        hay_part = text_ids[len(intro):len(text_ids) - len(question)]
        assert len(hay_part) == budget
        if task != "passkey":  # a contiguous window of the held-out stream
            joined = hay * 2
            assert any(joined[i:i + 20] == hay_part[:20] for i in range(len(hay)))


def _question(task: str, s: tasks.RetrievalSample, enc: Any) -> list[int]:
    if task == "passkey":
        return enc(tasks.PASSKEY_QUESTION)
    if task == "variable_tracking":
        value = _vt_value(s)
        return enc(tasks.VT_QUESTION.format(value=value))
    key = _niah_key(task, s)
    template = tasks.NIAH_QUESTION_ALL if task == "niah_multivalue" else tasks.NIAH_QUESTION
    return enc(template.format(key=key))


def _decoded(s: tasks.RetrievalSample) -> str:
    return _TOK.decode(s.input_ids)


def _niah_key(task: str, s: tasks.RetrievalSample) -> str:
    text = _decoded(s)
    tail = text.rsplit("The special magic number", 1)[1]
    return tail.split(" for ", 1)[1].split(" ", 1)[0]


def _vt_value(s: tasks.RetrievalSample) -> str:
    return _decoded(s).rsplit("assigned the value ", 1)[1].split(" ", 1)[0]


def _primary_needle(task: str, s: tasks.RetrievalSample) -> str:
    if task == "passkey":
        return tasks.PASSKEY_NEEDLE.format(key=s.answers[0])
    if task == "variable_tracking":
        return tasks.VT_FIRST.format(var=s.answers[0], value=_vt_value(s))
    return tasks.NIAH_NEEDLE.format(key=_niah_key(task, s), value=s.answers[0])


_TOK = _tokenizer()


def test_sample_errors_and_determinism(tok: Any, hay: list[int]) -> None:
    a = build_sample("niah_multikey", tok, hay, 600, 0.5, seed=1, index=2)
    assert a == build_sample("niah_multikey", tok, hay, 600, 0.5, seed=1, index=2)
    assert a.input_ids != build_sample("niah_multikey", tok, hay, 600, 0.5, seed=1, index=3).input_ids
    assert len(a.needle_spans) == 4 and a.answers[0] in a.candidates and len(a.candidates) == 10
    with pytest.raises(ValueError, match="length 20 is too short .* use lengths >= "):
        build_sample("passkey", tok, hay, 20, 0.5, seed=0)
    with pytest.raises(ValueError, match="retrieval task 'nope' unknown"):
        build_sample("nope", tok, hay, 300, 0.5, seed=0)
    with pytest.raises(ValueError, match=r"depth must be in \[0, 1\]"):
        build_sample("passkey", tok, hay, 300, 1.5, seed=0)


class _Scripted:
    """A model that, whatever the input, predicts the tokens of ``text`` in order after ``len(prompt)`` tokens, and
    gives every other token logit 0 (hand-checkable scores)."""

    def __init__(self, tok: Any, prompt_len: int, text: str, vocab: int) -> None:
        self.ids, self.start, self.vocab = tok.encode(text, add_special_tokens=False), prompt_len, vocab

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor, segment_ids: Any) -> torch.Tensor:
        b, s = input_ids.shape
        logits = torch.zeros(b, s, self.vocab)
        for t in range(s):
            k = t + 1 - self.start  # logits at t predict token t + 1
            if 0 <= k < len(self.ids):
                logits[:, t, self.ids[k]] = 10.0
        return logits


@pytest.mark.compat
def test_scoring_hand_checked(tok: Any, hay: list[int]) -> None:
    vocab = len(tok)
    s = build_sample("passkey", tok, hay, 200, 0.5, seed=0)
    key = s.answers[0]
    right = _Scripted(tok, 200, f" {key}.", vocab)
    res = score_sample(right, tok, s, vocab)
    assert res["generate"] and res["output"].startswith(f" {key}") and res["rank"] and res["ranked"] == [key]
    wrong = s.candidates[1]
    res = score_sample(_Scripted(tok, 200, f" {wrong}.", vocab), tok, s, vocab)
    assert not res["generate"] and not res["rank"] and res["ranked"] == [wrong]
    # log p of a scripted continuation: each token has logit 10 against vocab-1 zeros
    lp = candidate_logprobs(right, s.input_ids, [tok.encode(f" {key}", add_special_tokens=False)])[0]
    n = len(tok.encode(f" {key}", add_special_tokens=False))
    assert lp == pytest.approx(n * (10 - math.log(math.exp(10) + vocab - 1)), rel=1e-5)
    # multi-answer: every value must appear (string_match_all), the top-k set must be the answers
    mv = build_sample("niah_multivalue", tok, hay, 300, 0.2, seed=0, num_values=2)
    both = score_sample(_Scripted(tok, 300, f" {mv.answers[0]}, {mv.answers[1]}.", vocab), tok, mv, vocab,
                        scorings=("generate",))
    one = score_sample(_Scripted(tok, 300, f" {mv.answers[0]}, {mv.candidates[3]}.", vocab), tok, mv, vocab,
                       scorings=("generate",))
    assert both["generate"] and not one["generate"]


class _Copier:
    """Induction by longest suffix match: at position t, the tokens that followed the earlier occurrences of the
    longest suffix of ``input_ids[:t+1]`` get logit 30 (ties share it); a perfect copier of the context."""

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor, segment_ids: Any) -> torch.Tensor:
        b, s = input_ids.shape
        logits = torch.zeros(b, s, self.vocab)
        for i in range(b):
            ids = input_ids[i]
            match = torch.zeros(s, dtype=torch.long)  # match[j]: suffix match length of (t, j), for the current t
            for t in range(s):
                eq = (ids[:s] == ids[t]).long()
                prev = torch.cat([torch.zeros(1, dtype=torch.long), match[:-1]])
                match = eq * (1 + prev)
                match[t:] = 0  # only earlier positions
                best = int(match.max())
                if best:
                    js = (match == best).nonzero().flatten()
                    logits[i, t, ids[js + 1]] = 30.0
        return logits


@pytest.mark.parametrize("task", ["passkey", "niah_single", "niah_multikey"])
def test_perfect_copier_scores_one_and_random_model_near_chance(tok: Any, hay: list[int], task: str) -> None:
    vocab = len(tok)
    res = evaluate_grid(_Copier(vocab), tok, hay, tasks=[task], lengths=[256, 384], depths=[0.0, 0.5, 1.0],
                        num_samples=2, vocab_size=vocab, seed=5)
    r = res["tasks"][task]
    assert all(c["generate"] == 1.0 and c["rank"] == 1.0 for c in r["cells"]), r["cells"]
    assert r["effective_length"] == {"generate": 384, "rank": 384}
    gen = torch.Generator().manual_seed(0)

    def random_model(input_ids: torch.Tensor, position_ids: torch.Tensor, segment_ids: Any) -> torch.Tensor:
        return torch.randn(*input_ids.shape, vocab, generator=gen)

    res = evaluate_grid(random_model, tok, hay, tasks=[task], lengths=[256], depths=[0.0, 0.25, 0.5, 0.75, 1.0],
                        num_samples=8, vocab_size=vocab, seed=6)
    cells = res["tasks"][task]["cells"]
    rank = sum(c["rank"] for c in cells) / len(cells)
    assert sum(c["generate"] for c in cells) == 0
    assert rank <= 0.3  # chance 1/10; P(>= 12 of 40 at p = 0.1) < 0.2%
    assert res["tasks"][task]["effective_length"] == {"generate": 0, "rank": 0}


@pytest.mark.compat
def test_heatmap_png_and_loss_curve(tmp_path: Any) -> None:
    from nxd_lc.eval.plots import plot_loss_by_position, plot_retrieval_heatmaps

    cells = [{"length": L, "depth": d, "n": 2, "generate": 1.0 if L < 1024 else 0.5, "rank": 1.0}
             for L in (512, 1024) for d in (0.0, 1.0)]
    result = {"meta": {"lengths": [512, 1024], "depths": [0.0, 1.0], "scorings": ["generate", "rank"]},
              "tasks": {"passkey": {"cells": cells, "by_length": {}, "effective_length": {"generate": 512,
                                                                                         "rank": 1024}}}}
    paths = plot_retrieval_heatmaps(result, str(tmp_path), "t")
    assert paths == [str(tmp_path / "passkey_heatmap.png")]
    with open(paths[0], "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    lbp = {"edges": [0, 8, 16], "buckets": {"[0, 8)": {"loss": 2.0, "ppl": 7.4, "num_tokens": 8},
                                            "[8, 16)": {"loss": 1.5, "ppl": 4.5, "num_tokens": 8}}}
    out = plot_loss_by_position({"a": lbp}, str(tmp_path / "lbp.png"))
    assert os.path.getsize(out) > 1000
    assert glob.glob(str(tmp_path / "*.png")) and json.dumps(result)


# ---------------------------------------------------------------------------------------------- layouts
def _hf_tiny() -> Any:
    from transformers import LlamaConfig
    from transformers import LlamaForCausalLM as HFLlama

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    return HFLlama(cfg).eval()


def _layout_worker(rank: int, world: int, hf_dir: str, tp: int, cp: int, expected: dict[str, Any]) -> None:
    from nxd_lc.context import set_context_parallel_algo
    from nxd_lc.distributed import parallel_state as ps
    from nxd_lc.models.hf_config import build_llama_config
    from nxd_lc.models.llama import LlamaForCausalLM, load_hf_weights

    torch.set_num_threads(1)
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp)
    if cp > 1:
        set_context_parallel_algo("ring")
    model = LlamaForCausalLM(build_llama_config(os.path.join(hf_dir, "config.json"), {}))
    load_hf_weights(model, hf_dir)
    model.eval()
    tok = _tokenizer()
    prompt, conts = expected["prompt"], expected["conts"]
    lps = candidate_logprobs(model, prompt, conts, algo="ring")
    torch.testing.assert_close(torch.tensor(lps), torch.tensor(expected["logprobs"]), rtol=1e-4, atol=1e-4)
    nxt = retrieval.next_token(model, prompt, 1000, algo="ring")
    assert nxt == expected["next"], (nxt, expected["next"])
    # KV cache (TP heads local; under CP every rank the unsharded sequence): transformers' log-likelihoods and
    # greedy tokens; auto takes it at both layouts
    assert retrieval.kv_cache_for(model) is not None
    cached = candidate_logprobs(model, prompt, conts, kv_cache=True, vocab_size=1000)
    torch.testing.assert_close(torch.tensor(cached), torch.tensor(expected["logprobs"]), rtol=1e-4, atol=1e-4)
    assert retrieval.generate_greedy(model, prompt, 8, 1000, kv_cache=True) == expected["greedy"]
    uncached = retrieval.generate_greedy(model, prompt, 8, 1000, kv_cache=False, algo="ring")
    assert uncached == expected["greedy"]
    del tok


@pytest.mark.compat
@pytest.mark.distributed
@pytest.mark.parametrize("tp,cp", [(2, 1), (1, 2)], ids=["tp2", "cp2"])
def test_layouts_match_transformers(tmp_path: Any, tp: int, cp: int) -> None:
    hf = _hf_tiny()
    hf.save_pretrained(str(tmp_path))
    tok = _tokenizer()
    hay = tok.encode(open(os.path.join(sysconfig.get_paths()["stdlib"], "calendar.py")).read())
    s = build_sample("passkey", tok, hay, 203, 0.5, seed=0)  # odd length: padded for the layout
    conts = [tok.encode(" " + c, add_special_tokens=False) for c in s.candidates[:3]]
    ref = []
    with torch.no_grad():
        for c in conts:
            ids = torch.tensor([s.input_ids + c])
            logp = torch.log_softmax(hf(ids).logits.float(), -1)[0]
            ref.append(float(sum(logp[len(s.input_ids) - 1 + k, t] for k, t in enumerate(c))))
        nxt = int(hf(torch.tensor([s.input_ids])).logits[0, -1].argmax())
    run_distributed(_layout_worker, tp * cp, str(tmp_path), tp, cp,
                    {"prompt": s.input_ids, "conts": conts, "logprobs": ref, "next": nxt,
                     "greedy": _hf_greedy(hf, s.input_ids, 8)})


def _hf_greedy(hf: Any, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy continuation, each token from a full forward over the sequence (no cache)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.mark.compat
def test_kv_cache_generation_and_ranking_match_transformers(tmp_path: Any) -> None:
    """One process: greedy decoding and candidate log-likelihoods with the KV cache (prompt once, one token or one
    candidate at a time, cache truncated between candidates) equal transformers' full forwards; the grid reports
    that it used the cache."""
    from nxd_lc.models.hf_config import build_llama_config
    from nxd_lc.models.llama import LlamaForCausalLM, load_hf_weights

    hf = _hf_tiny()
    hf.save_pretrained(str(tmp_path))
    model = LlamaForCausalLM(build_llama_config(str(tmp_path / "config.json"), {}))
    load_hf_weights(model, str(tmp_path))
    model.eval()
    tok = _tokenizer()
    hay = tok.encode(open(os.path.join(sysconfig.get_paths()["stdlib"], "calendar.py")).read())
    s = build_sample("passkey", tok, hay, 160, 0.25, seed=3)
    assert retrieval.generate_greedy(model, s.input_ids, 12, 1000, kv_cache=True) == _hf_greedy(hf, s.input_ids, 12)
    conts = [tok.encode(" " + c, add_special_tokens=False) for c in s.candidates[:4]]
    assert max(len(c) for c in conts) > 1  # multi-token candidates: several new positions over a filled cache
    with torch.no_grad():
        ref = [float(torch.log_softmax(hf(torch.tensor([s.input_ids + c])).logits.float(), -1)[0][
            torch.arange(len(s.input_ids) - 1, len(s.input_ids) - 1 + len(c)), torch.tensor(c)].sum()) for c in conts]
    got = candidate_logprobs(model, s.input_ids, conts, kv_cache=True, vocab_size=1000)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=1e-4, atol=1e-4)
    # score_sample prefills the prompt once for both scorings and agrees with the cache-less full forwards
    full_len = []
    hidden_states = model.hidden_states

    def counting(x: torch.Tensor, *a: Any, **k: Any) -> torch.Tensor:
        full_len.append(x.shape[1] == len(s.input_ids))
        return hidden_states(x, *a, **k)

    model.hidden_states = counting
    cached_res = score_sample(model, tok, s, 1000, kv_cache=True)
    assert sum(full_len) == 1 and len(full_len) > 3, full_len
    plain = score_sample(model, tok, s, 1000, kv_cache=False)
    assert (cached_res["output"], cached_res["ranked"]) == (plain["output"], plain["ranked"])
    ref_toks = _hf_greedy(hf, s.input_ids, sum(len(tok.encode(" " + a, add_special_tokens=False))
                                               for a in s.answers) + 4)
    if tok.eos_token_id in ref_toks:
        ref_toks = ref_toks[:ref_toks.index(tok.eos_token_id) + 1]
    assert cached_res["output"] == tok.decode(ref_toks)
    del model.hidden_states
    result = retrieval.evaluate_grid(model, tok, hay, tasks=["passkey"], lengths=[128], depths=[0.5], num_samples=1,
                                     vocab_size=1000)
    assert result["meta"]["kv_cache"] is True


@pytest.mark.lane1_only  # one torchrun launch; the harness itself is tested above in both lanes
@pytest.mark.distributed
@pytest.mark.slow
def test_train_py_logs_retrieval_accuracy_during_training(tmp_path: Any) -> None:
    """exp_manager.retrieval_eval through train.py at TP 2: evaluated at steps 2 and 4, scalars in TensorBoard."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from tests.test_e2e import _run, _small_corpus, _train_cmd

    corpus = _small_corpus(str(tmp_path))
    log_dir = str(tmp_path / "run")
    out = _run(_train_cmd(log_dir, corpus, str(tmp_path / "cache"), max_steps=4)
               + ["+exp_manager.retrieval_eval={every_n_steps:2,lengths:[256],depths:[0.0,1.0],num_samples:1,"
                  "scorings:[rank,generate],tasks:[passkey,niah_single]}"])
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    assert "retrieval at step 2:" in out.stdout and "retrieval at step 4:" in out.stdout
    acc = EventAccumulator(glob.glob(os.path.join(log_dir, "tensorboard", "events.out.tfevents.*"))[0])
    acc.Reload()
    tags = acc.Tags()["scalars"]
    for tag in ("retrieval/passkey/rank@256", "retrieval/niah_single/generate@256",
                "retrieval/passkey/rank/effective_length"):
        assert tag in tags, tags
        values = [e.value for e in acc.Scalars(tag)]
        assert [e.step for e in acc.Scalars(tag)] == [2, 4] and all(0 <= v <= 256 for v in values)


def tiny_run_config(root: Any, tokenizer: str, hf: str) -> dict[str, Any]:
    """A one-process run config (seq 128, fp32) over the text files of ``root/text`` (a third held out), with the
    tokenizer directory ``root/<tokenizer>`` and the model of ``root/<hf>/config.json``."""
    return {"name": "tiny_retrieval", "trainer": {"devices": 1, "num_nodes": 1, "max_steps": 1},
            "distributed_strategy": {"tensor_model_parallel_size": 1},
            "data": {"micro_batch_size": 1, "global_batch_size": 1, "seq_length": 128,
                     "train_dir": str(root / "text"), "val_fraction": 0.34,
                     "tokenizer": {"type": str(root / tokenizer), "cache_dir": str(root / "cache")}},
            "model": {"model_config": str(root / hf / "config.json"), "encoder_seq_length": 128},
            "precision": {"type": "fp32"}}


@pytest.mark.slow
def test_cli_writes_json_and_heatmaps(tmp_path: Any) -> None:
    """python -m nxd_lc.cli.passkey / nxd_lc.cli.niah on a run config (one process): table, JSON, PNGs; bad
    arguments are errors that name the flag."""
    import subprocess
    import sys

    import yaml

    from nxd_lc.data.tokenizer import train_bytelevel_bpe

    root = sysconfig.get_paths()["stdlib"]
    (tmp_path / "text").mkdir()
    texts = []
    for name in ("bisect.py", "heapq.py", "textwrap.py", "calendar.py", "shlex.py", "string.py"):
        texts.append(open(os.path.join(root, name)).read())
        (tmp_path / "text" / name).write_text(texts[-1])
    train_bytelevel_bpe(texts, 1000).save_pretrained(str(tmp_path / "tokenizer"))
    hf = _hf_tiny()
    hf.save_pretrained(str(tmp_path / "hf"))
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "tiny.yaml").write_text(yaml.safe_dump(tiny_run_config(tmp_path, "tokenizer", "hf")))
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def cli(module: str, *extra: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", module, "--config-name", "tiny", "--config-dir", str(tmp_path / "conf"),
               "--hf-dir", str(tmp_path / "hf"), *extra]
        return subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=300, check=False)

    out = cli("nxd_lc.cli.passkey", "--lengths", "300,400", "--depths", "0,1", "--num-samples", "1",
              "--out", str(tmp_path / "pk"))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "passkey  generate |" in out.stdout and "passkey      rank |" in out.stdout
    result = json.loads((tmp_path / "pk" / "retrieval.json").read_text())
    assert list(result["tasks"]) == ["passkey"] and result["meta"]["kv_cache"] is True  # auto: TP 1, no CP
    # hf/ has no tokenizer files: the config's tokenizer, said in the log and recorded
    assert result["meta"]["tokenizer"]["source"] == "data.tokenizer" and "has no tokenizer files" in out.stdout
    assert [(c["length"], c["depth"], c["n"]) for c in result["tasks"]["passkey"]["cells"]] == [
        (300, 0.0, 1), (300, 1.0, 1), (400, 0.0, 1), (400, 1.0, 1)]
    assert (tmp_path / "pk" / "passkey_heatmap.png").stat().st_size > 1000
    out = cli("nxd_lc.cli.niah", "--tasks", "niah_multivalue,variable_tracking", "--lengths", "400",
              "--depths", "0.5", "--num-samples", "1", "--scoring", "rank", "--out", str(tmp_path / "niah"))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    result = json.loads((tmp_path / "niah" / "retrieval.json").read_text())
    assert sorted(result["tasks"]) == ["niah_multivalue", "variable_tracking"]
    assert result["meta"]["scorings"] == ["rank"]
    bad = cli("nxd_lc.cli.niah", "--tasks", "needle", "--out", str(tmp_path / "x"))
    assert bad.returncode == 2 and "--tasks: unknown ['needle']" in bad.stderr
    bad = cli("nxd_lc.cli.passkey", "--depths", "0,2", "--out", str(tmp_path / "x"))
    assert bad.returncode == 2 and "--depths: need numbers in [0, 1]" in bad.stderr


@pytest.mark.compat
def test_niah_sft_records_are_harness_prompts_with_their_answers(tok: Any, hay: list[int]) -> None:
    """examples/long_context/build_niah_sft.py: each record's input is the harness prompt of its task (tokens
    round-trip to the sampled length), its output the answer after it as the harness scores generations, and the
    answer occurs in the input (a needle) for the needle tasks."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "long_context",
                        "build_niah_sft.py")
    spec = importlib.util.spec_from_file_location("build_niah_sft", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rows = mod.records(tok, hay, 8, ["niah_single", "niah_multivalue", "variable_tracking"], 300, 600, seed=7)
    assert {r["task"] for r in rows} <= {"niah_single", "niah_multivalue", "variable_tracking"}
    for i, r in enumerate(rows):
        s = build_sample(r["task"], tok, hay, r["prompt_tokens"], r["depth"], 7, i)
        assert r["input"] == tok.decode(s.input_ids) and 300 <= r["prompt_tokens"] <= 600
        assert r["output"] == " " + ", ".join(s.answers) + "."
        if r["task"] != "variable_tracking":  # the value is in a needle; chain variables are the answer's names
            assert all(a in r["input"] for a in s.answers)
    assert rows != mod.records(tok, hay, 8, ["niah_single", "niah_multivalue", "variable_tracking"], 300, 600, 8)
