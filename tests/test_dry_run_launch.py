"""The dry run's promise (issue 50, item 4 and the dry-run cases of item 8): what the dry run accepts launches, and
what a launch would stop at is refused (or listed, with exit status 3) before anything is built, naming the key and
the fix. The summary comes first; the resolved config goes to a file.

* NxDT's 8B example with ``data.train_dir`` set but no tokenizer: refused naming ``data.tokenizer.type`` (the launch
  stopped after the model was built); the precision log line says what the environment table sets.
* ``model.enable_cuda_graph`` on ``trainer.accelerator: auto`` without CUDA: refused, judged on the resolved
  accelerator (it trained on CPU with the key ignored).
* ``model.activations_memory_budget`` of 400 digits: a named config error (a raw ``OverflowError`` before).
* ``NEURON_EXTRACT_GRAPHS_ONLY``: ``0`` (which NxD counts as set) and a cpu run are refused; the extraction run's
  start-up line says what it skips.
* ``data.global_batch_size`` of 10^12 on text: refused by validation against a bound from the files' bytes.
* exit status: 0 (would launch), 2 (invalid), 3 (valid, but a launch on this host would stop).
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from hydra import compose, initialize_config_dir
from test_dry_run_bounds import _json, _launch_problems, _raw, _with_run_dir

from nxd_lc.app.run import LaunchWouldStop, dry_run, hydra_task, run
from nxd_lc.app.validation import load_config
from nxd_lc.app.validation.launch import MIN_BPE_VOCAB, accelerator_launch_problems, tokenizer_launch_problems
from nxd_lc.app.validation.resources import TOKENS_PER_BYTE_BOUND, TOKENS_PER_FILE_BOUND
from nxd_lc.config.errors import ConfigError
from nxd_lc.config.run_record import resolved_config_yaml
from nxd_lc.config.structure import typed_config
from nxd_lc.models.common.memory_plan import parse_budget
from nxd_lc.runtime.prewarm import GRAPHS_ONLY_ENV, graph_extraction_problems, run_prewarm

REPO = Path(__file__).resolve().parents[1]
NXDT_8B = REPO.parent / "shared" / "reference" / "nxdt_examples" / "hf_llama3_8B_config.yaml"
CONF_8B = REPO / "conf" / "hf_llama3_8B_config.yaml"


def _corpus(tmp_path: Path, files: int = 3) -> Path:
    root = tmp_path / "text"
    root.mkdir(exist_ok=True)
    for i in range(files):
        (root / f"doc{i}.txt").write_text(f"document {i}: " + "some text to tokenize " * (10 + i))
    return root


def _8b_overrides(tmp_path: Path) -> list[str]:
    """NxDT's 8B file as a user points it at this host: its data path and run directory replaced (and the model's
    config.json, which NxDT's file leaves at /home/ubuntu); no tokenizer key. The text (640 KB) can hold the global
    batch of 1024 x 8192 tokens (the bound of 16 tokens per byte)."""
    corpus = tmp_path / "text"
    corpus.mkdir()
    (corpus / "a.txt").write_text("some text " * 64_000)
    return [f"data.train_dir={corpus}", f"model.model_config={REPO / 'conf' / 'llama3_8B_hf_config.json'}",
            f"exp_manager.explicit_log_dir={tmp_path / 'run'}"]


@pytest.mark.compat
def test_nxdt_8b_without_a_tokenizer_is_refused_naming_the_key(tmp_path: Path) -> None:
    """Acceptance: train.py's dry run of NxDT's own 8B file (nxd_lc's copy without ../shared) exits 3, its only
    problem ``data.tokenizer.type``; the summary comes first, with no config YAML before it (it printed ~230 lines of
    config first), the resolved config is in the file the report names, and the precision log line agrees with the
    environment table's XLA_DOWNCAST_BF16."""
    config = NXDT_8B if NXDT_8B.is_file() else CONF_8B
    env = dict(os.environ, OMP_NUM_THREADS="1", TMPDIR=str(tmp_path))
    env.pop(GRAPHS_ONLY_ENV, None)
    proc = subprocess.run([sys.executable, "train.py", "--config-dir", str(config.parent), "--config-name",
                           config.stem, "+dry_run=true", *_8b_overrides(tmp_path)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    out = proc.stdout
    assert proc.returncode == 3, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = out[out.index("# nxd_lc dry run"):].splitlines()
    assert report[0] == ("# nxd_lc dry run: config is valid, but launching it on this host would stop (1 problem(s), "
                         "listed at the end; exit status 3)")
    (problem,) = [line for line in report if line.startswith("#   - ")]
    assert problem.startswith("#   - at launch: data.tokenizer.type: not set; every run loads a tokenizer"), problem
    assert "exit status 3" in proc.stderr
    # summary first: the layout is the report's second line; no YAML section of the config anywhere in it
    assert report[1] == "# world size 128 = TP 32 x PP 1 x CP 1 x DP 4; seq_length 8192", report[:3]
    assert not [line for line in report if re.match(r"^(trainer|data|model|exp_manager):", line)]
    (written,) = [line for line in report if line.startswith("# resolved config (")]
    path = Path(written.rsplit(": ", 1)[1])
    assert path.parent == tmp_path and path.is_file(), written
    saved = load_config(yaml.safe_load(path.read_text()))
    assert saved.data.train_dir == str(tmp_path / "text") and saved.distributed_strategy.tensor_model_parallel_size \
        == 32 and resolved_config_yaml(saved) == path.read_text()
    # the log line about precision.xla_downcast_bf16 says the value the table sets, not NxDT's 1
    (row,) = [line.split() for line in report if line.startswith("XLA_DOWNCAST_BF16 ")]
    (logged,) = [line for line in out.splitlines() if "precision.xla_downcast_bf16 '0'" in line]
    assert row[-1] == "0" and f"XLA_DOWNCAST_BF16={row[-1]}, as its environment table shows" in logged, logged
    assert "uses '1'" not in logged


def _tiny(tmp_path: Path, *overrides: str) -> Any:
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        return compose(config_name="cpu_tiny_llama_config", overrides=[
            f"exp_manager.explicit_log_dir={tmp_path / 'run'}", f"compiler_cache_url={tmp_path / 'cache'}",
            "trainer.devices=1", "distributed_strategy.tensor_model_parallel_size=1",
            "distributed_strategy.sequence_parallel=false", *overrides])


def _exit_status(raw: Any) -> int:
    """What train.py exits with for ``raw`` (:func:`hydra_task`)."""
    try:
        hydra_task(raw)
    except SystemExit as e:
        return int(e.code)
    return 0


def test_exit_status_tells_valid_invalid_and_would_stop(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """0: the launch would pass its checks; 2: an invalid config; 3: valid, but a launch here would stop."""
    assert _exit_status(_tiny(tmp_path, "+dry_run=true")) == 0
    assert "# nxd_lc dry run: config is valid\n" in capsys.readouterr().out
    assert _exit_status(_tiny(tmp_path, "+dry_run=true", "+trainer.max_step=3")) == 2
    assert "trainer.max_step: unknown key" in capsys.readouterr().err
    assert _exit_status(_tiny(tmp_path, "+dry_run=true", "~data.builtin_corpus",
                              f"+data.train_dir={tmp_path / 'missing'}")) == 3
    captured = capsys.readouterr()
    assert "#   - at launch: data.train_dir: no such file" in captured.out and "exit status 3" in captured.err
    with pytest.raises(LaunchWouldStop) as e:  # the programmatic entry: the report is printed, then raised
        run(_tiny(tmp_path, "+dry_run=true", "~data.builtin_corpus", f"+data.train_dir={tmp_path / 'missing'}"))
    (problem,) = e.value.problems
    assert problem.startswith("at launch: data.train_dir") and problem in capsys.readouterr().out
    assert not (tmp_path / "run").exists()  # the dry run built and wrote nothing there


@pytest.mark.skipif(torch.cuda.is_available(), reason="judges a host without CUDA")
def test_cuda_graphs_on_auto_without_cuda_are_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``++model.enable_cuda_graph=true`` with ``trainer.accelerator=auto`` validated and trained on CPU with the key
    ignored (rc 0); with accelerator cpu it was refused. Now the launch judges ``auto`` on this host: refused before
    anything is built, and the dry run lists it (exit 3). On a CUDA host (simulated) it is accepted."""
    raw = _tiny(tmp_path, "trainer.accelerator=auto", "++model.enable_cuda_graph=true")
    with pytest.raises(ConfigError) as e:
        run(raw)
    (problem,) = e.value.problems
    assert problem == ("model.enable_cuda_graph: true needs CUDA, but trainer.accelerator auto resolves to cpu on "
                       "this host (no CUDA device), where the key would be ignored; set model.enable_cuda_graph: "
                       "false, or launch on a CUDA host (trainer.accelerator gpu)")
    assert not (tmp_path / "run").exists()
    assert f"at launch: {problem}" in dry_run(load_config(raw)).launch_problems
    assert _exit_status(_tiny(tmp_path, "trainer.accelerator=auto", "++model.enable_cuda_graph=true",
                              "+dry_run=true")) == 3
    cfg = load_config(raw)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the rule alone: nothing else asks CUDA here
    assert accelerator_launch_problems(cfg) == []


@pytest.mark.parametrize("budget", ["9" * 400 + "GiB", "1" + "0" * 300 + "GiB"])
def test_an_overflowing_memory_budget_is_a_named_error(tmp_path: Path, budget: str) -> None:
    """400 digits (or 10^300 GiB: a float overflow to inf) raised a raw OverflowError from the memory planner."""
    with pytest.raises(ConfigError) as e:
        load_config(_raw(_json(tmp_path), model={"activations_memory_budget": budget}))
    (problem,) = e.value.problems
    assert problem.startswith("model.activations_memory_budget: '") and "more than any device's memory" in problem
    assert len(problem) < 300, problem  # the value is cut, not printed whole
    assert parse_budget("1024GiB") == ("bytes", 1024 * 2**30)  # an ordinary size still parses


def test_four_hundred_nines_as_a_yaml_float_is_the_fraction_one(tmp_path: Path) -> None:
    """``0.999...9`` (400 nines) is the float 1.0 in YAML: the budget that keeps every activation, accepted."""
    value = yaml.safe_load("0." + "9" * 400)
    assert value == 1.0 and parse_budget(value) == ("fraction", 1.0)
    cfg = load_config(_raw(_json(tmp_path), model={"activations_memory_budget": value}))
    assert cfg.model.activations_memory_budget == 1.0


@pytest.mark.parametrize("value", ["0", "false", "OFF"])
def test_extraction_variable_that_reads_as_off_is_refused(tmp_path: Path, value: str) -> None:
    """NxD counts any non-empty value as set: ``0`` on a run directory with a checkpoint ran 3 steps from scratch
    (no resume), saved nothing, rc 0. Refused, also where extraction is real (xla), naming what it would skip."""
    cfg = load_config(_raw(_json(tmp_path), accelerator="xla"))
    (problem,) = graph_extraction_problems(cfg, {GRAPHS_ONLY_ENV: value})
    assert problem.startswith(f"NEURON_EXTRACT_GRAPHS_ONLY={value!r}: set, so graph extraction is on"), problem
    assert "save no checkpoint and not resume" in problem and "unset it to train" in problem
    assert graph_extraction_problems(cfg, {GRAPHS_ONLY_ENV: "1"}) == []  # neuron_parallel_compile's own value
    assert graph_extraction_problems(cfg, {GRAPHS_ONLY_ENV: ""}) == graph_extraction_problems(cfg, {}) == []
    gpu = load_config(_raw(_json(tmp_path), accelerator="gpu"))
    (on_gpu,) = graph_extraction_problems(gpu, {GRAPHS_ONLY_ENV: "1"})
    assert "trainer.accelerator gpu runs on gpu on this host, which has no Neuron compiler" in on_gpu


def test_extraction_start_up_line_says_what_is_skipped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    cfg = load_config(_raw(_json(tmp_path), accelerator="xla"))
    monkeypatch.setenv(GRAPHS_ONLY_ENV, "1")
    got: list[Any] = []
    with caplog.at_level(logging.INFO, logger="nxd_lc"):
        run_prewarm(cfg, got.append)
    (record,) = [r for r in caplog.records if "graph extraction" in r.getMessage()]
    assert record.levelno == logging.WARNING
    text = record.getMessage()
    assert f"{got[0].trainer.max_steps} optimizer step(s) of trainer.max_steps {cfg.trainer.max_steps}" in text
    for said in ("no checkpoints (none is saved)", "no resume (an existing checkpoint is not loaded)",
                 "unset NEURON_EXTRACT_GRAPHS_ONLY to train"):
        assert said in text, text
    assert not got[0].exp_manager.create_checkpoint_callback and not got[0].exp_manager.resume_if_exists


def test_a_global_batch_above_what_the_text_can_hold_is_refused(tmp_path: Path) -> None:
    """``data.global_batch_size`` of 10^12 on text validated and was refused after the model was built. The bound:
    16 tokens per byte + 4 per file, in samples of seq_length with stride seq_length; at the bound it validates."""
    corpus = _corpus(tmp_path)
    size = sum(p.stat().st_size for p in corpus.iterdir())
    bound = (TOKENS_PER_BYTE_BOUND * size + TOKENS_PER_FILE_BOUND * 3 - 1) // 64  # S = 64 (test_dry_run_bounds)
    data = {"train_dir": str(corpus), "tokenizer": {"type": "bytelevel_bpe"}}
    with pytest.raises(ConfigError) as e:
        load_config(_raw(_json(tmp_path), data={**data, "global_batch_size": 10**12}))
    (problem,) = e.value.problems
    assert problem.startswith(f"data.global_batch_size: {10**12} exceeds the samples the training text can hold at "
                              f"seq_length 64: fewer than {bound + 1} (data.train_dir: {size} bytes in 3 file(s)"), \
        problem
    assert load_config(_raw(_json(tmp_path), data={**data, "global_batch_size": bound})).data.global_batch_size == \
        bound
    with pytest.raises(ConfigError):
        load_config(_raw(_json(tmp_path), data={**data, "global_batch_size": bound + 1}))
    up = {**data, "global_batch_size": bound + 1, "length_upsampling": {"min_tokens": 1, "factor": 1.5}}
    assert load_config(_raw(_json(tmp_path), data=up))  # every document repeated up to twice: twice the bound


def test_the_text_bound_holds_for_a_real_tokenizer(tmp_path: Path) -> None:
    """The bound is above what a tokenizer really packs: the corpus tokenized by the data module (a byte-level
    BPE trained on it) gives fewer samples than the bound."""
    from nxd_lc.app.validation.resources import text_samples_bound
    from nxd_lc.data.datamodule import PretrainingDataModule

    raw = _raw(_json(tmp_path), data={"train_dir": str(_corpus(tmp_path, files=20)), "val_fraction": 0.0,
                                      "tokenizer": {"type": "bytelevel_bpe", "vocab_size": 300,
                                                    "cache_dir": str(tmp_path / "tok")}})
    cfg = load_config(raw)
    dm = PretrainingDataModule(cfg.data, seq_length=8, seed=0, model_vocab_size=301, data_parallel_rank=0,
                               data_parallel_size=1, global_batch_size=1)
    dm.setup()
    bound = text_samples_bound(typed_config({**raw, "data": {**raw["data"], "seq_length": 8},
                                             "model": {**raw["model"], "encoder_seq_length": 8}}))
    assert bound is not None and 0 < len(dm.train_dataset) <= bound[0], (len(dm.train_dataset), bound)


def test_tokenizer_keys_the_data_modules_refuse_are_refused_at_launch(tmp_path: Path) -> None:
    base = _with_run_dir(_raw(_json(tmp_path)), explicit_log_dir=str(tmp_path / "run"))
    assert _launch_problems(base) == []
    unset = {**base, "data": {**base["data"], "tokenizer": {}}}
    (problem,) = _launch_problems(unset)
    assert problem.startswith("data.tokenizer.type: not set"), problem

    def problems(**data: Any) -> list[str]:
        return tokenizer_launch_problems(typed_config({**base, "data": {**base["data"], **data}}))

    (small,) = problems(tokenizer={"type": "bytelevel_bpe", "vocab_size": MIN_BPE_VOCAB - 1})
    assert small.startswith(f"data.tokenizer.vocab_size: {MIN_BPE_VOCAB - 1} is below {MIN_BPE_VOCAB}"), small
    assert problems(tokenizer={"type": "bytelevel_bpe", "vocab_size": MIN_BPE_VOCAB}) == []
    from nxd_lc.data.tokenizer import train_bytelevel_bpe

    with pytest.raises(ValueError, match="data.tokenizer.vocab_size"):  # the same bound as the trainer's
        train_bytelevel_bpe(["abc"], MIN_BPE_VOCAB - 1)
    (megatron,) = problems(builtin_corpus=None, data_prefix=[1.0, str(tmp_path / "x")])
    assert megatron.startswith("data.tokenizer.type: 'bytelevel_bpe' is trained on text, but data.data_prefix"), \
        megatron
    aligned = typed_config({**base, "model_alignment_strategy": {"sft": {}}})
    (sft,) = tokenizer_launch_problems(aligned)
    assert "alignment fine-tuning (model_alignment_strategy) needs the pretrained model's own" in sft
    assert problems(tokenizer={"library": "megatron", "type": "GPT2BPETokenizer"}) == []  # its files: other rules
