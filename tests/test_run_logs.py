"""What a run logs matches what it prints (issue 50, items 6 and 8), read from the files a run leaves: TensorBoard's
event files (tensorboard's ``EventAccumulator``), ``tensorboard/hparams.yaml``, the run's text log (the console's
lines) and the checkpoint directory.

Two launches of ``train.py``'s path (:func:`nxd_lc.app.run.run`, one process, a one-layer model) in one run
directory: 5 steps logging every 2nd step, validating and saving every 2 steps; then a resume from step 4 with
``trainer.max_steps`` 8, logging every step.
"""

from __future__ import annotations

import glob
import math
import os
import re
import shutil
import sysconfig
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
LR, MIN_LR, WARMUP = 5e-3, 5e-4, 1


def _cosine_lr(step: int, max_steps: int) -> float:
    """NeMo's CosineAnnealing (warm-up ``lr (s + 1) / (W + 1)`` for s <= W, then ``min_lr + (lr - min_lr) x 0.5 (1 +
    cos(pi (s - W) / (M - W)))``) after ``step`` optimizer steps: the learning rate of step ``step + 1``."""
    if step <= WARMUP:
        return LR * (step + 1) / (WARMUP + 1)
    if step > max_steps:
        return MIN_LR
    return MIN_LR + (LR - MIN_LR) * 0.5 * (1 + math.cos(math.pi * (step - WARMUP) / (max_steps - WARMUP)))


def _scalars(log_dir: Path) -> list[dict[str, dict[int, float]]]:
    """Per launch (event file, oldest first): metric -> {TensorBoard step: value}."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = []
    for f in sorted(glob.glob(str(log_dir / "tensorboard" / "events.out.tfevents.*")), key=os.path.getmtime):
        acc = EventAccumulator(f)
        acc.Reload()
        out.append({tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]})
    return out


def _launch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, overrides: list[str]) -> object:
    from dist_utils import set_launch_env_of_one
    from hydra import compose, initialize_config_dir

    from nxd_lc.app.run import _shutdown_distributed, run

    set_launch_env_of_one(monkeypatch.setenv)
    corpus = tmp_path / "corpus"
    if not corpus.is_dir():
        corpus.mkdir()
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        for i, src in enumerate(sorted(p for p in stdlib.glob("*.py") if 200 <= p.stat().st_size <= 4000)[:40]):
            shutil.copy(src, corpus / f"doc_{i:03d}.py")
    base = ["~data.builtin_corpus", f"+data.train_dir={corpus}", "+data.file_glob=*.py", "data.val_fraction=0.2",
            "data.tokenizer.vocab_size=300", f"+data.tokenizer.cache_dir={tmp_path / 'tok'}",
            "+exp_manager.preemption_signals=[]", "data.micro_batch_size=1", "data.global_batch_size=2",
            "model.encoder_seq_length=32", "+model.num_layers=1", "+model.hidden_size=64",
            "trainer.val_check_interval=2", "trainer.limit_val_batches=1",
            "exp_manager.checkpoint_callback_params.every_n_train_steps=2",
            "exp_manager.checkpoint_callback_params.save_top_k=-1", "exp_manager.name=renamed_run",
            f"exp_manager.explicit_log_dir={tmp_path / 'run'}", "+trainer.enable_progress_bar=false",
            "trainer.devices=1", "distributed_strategy.tensor_model_parallel_size=1",
            "distributed_strategy.sequence_parallel=false", f"model.optim.lr={LR}",
            f"model.optim.sched.min_lr={MIN_LR}", f"model.optim.sched.warmup_steps={WARMUP}"]
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        raw = compose(config_name="cpu_tiny_llama_config", overrides=base + overrides)
    try:
        return run(raw)
    finally:
        _shutdown_distributed()


def _console(log_dir: Path) -> str:
    (path,) = glob.glob(str(log_dir / "nxd_lc_log_globalrank-0_localrank-0.txt"))
    return Path(path).read_text()


def _printed(text: str) -> tuple[dict[int, dict[str, float]], dict[int, float]]:
    """The console's step lines (step -> {label: value}) and validation lines (step -> val_loss)."""
    steps: dict[int, dict[str, float]] = {}
    vals: dict[int, float] = {}
    for line in text.splitlines():
        m = re.search(r"nxd_lc\.metrics: step (\d+)/\d+ \| (.*)$", line)
        if m:
            steps[int(m.group(1))] = {k: float(v) for k, v in (p.rsplit(" ", 1) for p in m.group(2).split(" | "))}
        m = re.search(r"nxd_lc\.metrics: step (\d+) \| val_loss (\S+)", line)
        if m:
            vals[int(m.group(1))] = float(m.group(2))
    return steps, vals


@pytest.mark.slow
def test_tensorboard_steps_hparams_checkpoint_lines_and_the_resumed_schedule(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    log_dir = tmp_path / "run"
    _launch(tmp_path, monkeypatch, ["trainer.max_steps=5", "trainer.log_every_n_steps=2"])
    first_text = _console(log_dir)
    trainer = _launch(tmp_path, monkeypatch, ["trainer.max_steps=8", "trainer.log_every_n_steps=1"])
    assert trainer.global_step == 8
    first, second = _scalars(log_dir)
    text = _console(log_dir)
    assert text.startswith(first_text)  # one handler: the first launch's lines once, the second's appended
    first_steps, first_vals = _printed(first_text)
    second_steps, second_vals = _printed(text[len(first_text):])

    # TensorBoard's step is the optimizer step as printed: every log_every_n_steps-th step and the last one
    assert sorted(first_steps) == [2, 4, 5]
    assert sorted(first["reduced_train_loss"]) == sorted(first["lr"]) == [2, 4, 5]
    assert sorted(first_vals) == sorted(first["val_loss"]) == [2, 4]  # validation after step 2 is at 2, not 1
    for step, printed in first_steps.items():
        assert printed["lr"] == pytest.approx(first["lr"][step], rel=1e-3)  # printed with 4 digits
    for step, value in first_vals.items():
        assert value == pytest.approx(first["val_loss"][step], abs=1e-4)
    # logging every step, the printed loss is the step's own (a mean over one step)
    assert sorted(second_steps) == sorted(second["reduced_train_loss"]) == [5, 6, 7, 8]
    for step, printed in second_steps.items():
        assert printed["loss"] == pytest.approx(second["reduced_train_loss"][step], abs=1e-4)
    assert sorted(second_vals) == sorted(second["val_loss"]) == [6, 8]
    assert "epoch" not in second  # Lightning's epoch scalar is added only without a logged step
    assert second["global_step"] == {s: float(s) for s in (5, 6, 7, 8)}
    assert second["consumed_samples"] == {s: 2.0 * s for s in (5, 6, 7, 8)}  # global batch 2

    # the resume: every step after it at this run's schedule (max_steps 8), not the checkpoint's (max_steps 5)
    for step in (5, 6, 7, 8):
        assert second["lr"][step] == pytest.approx(_cosine_lr(step - 1, 8), rel=1e-6), step
    assert _cosine_lr(4, 5) != pytest.approx(_cosine_lr(4, 8), rel=1e-2)  # the check can tell the two apart
    assert first["lr"][5] == pytest.approx(_cosine_lr(4, 5), rel=1e-6)
    assert re.search(r"lr schedule: step 5 resumes at lr 3\.\d+e-03 of this run's model.optim.sched", text)

    # checkpoints: named from exp_manager.name, one line each with its path and seconds
    ckpt_root = log_dir / "checkpoints"
    tags = sorted(t for t in os.listdir(ckpt_root) if (ckpt_root / t / "done").is_file())
    assert tags == [f"renamed_run--step={s}-consumed_samples={2.0 * s}" for s in (2, 4, 6, 8)]
    saved = re.findall(r"checkpoint (\S+) saved in (\d+\.\d\d) s", text)
    assert [os.path.basename(p) for p, _ in saved] == tags
    assert all(os.path.dirname(p) == str(ckpt_root) and float(s) >= 0 for p, s in saved)
    assert "resuming from" in text[len(first_text):] and tags[1] in text[len(first_text):]

    # hparams.yaml: the resolved config of the latest launch, as the checkpoint's run_config.yaml records it
    hparams = yaml.safe_load((log_dir / "tensorboard" / "hparams.yaml").read_text())
    run_config = yaml.safe_load((ckpt_root / tags[-1] / "run_config.yaml").read_text())
    assert hparams == run_config
    assert hparams["trainer"]["max_steps"] == 8 and hparams["exp_manager"]["name"] == "renamed_run"
    assert hparams["model"]["optim"]["sched"]["max_steps"] == 8  # interpolations resolved


@pytest.mark.slow
def test_asynchronous_saves_log_the_copy_and_the_publication(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``exp_manager.async_checkpointing``: a line when the save's state is copied to host memory and one when the
    checkpoint is published, each naming the path, in that order for every checkpoint."""
    log_dir = tmp_path / "run"
    _launch(tmp_path, monkeypatch, ["trainer.max_steps=4", "trainer.log_every_n_steps=2",
                                    "exp_manager.async_checkpointing=true"])
    text = _console(log_dir)
    ckpt_root = log_dir / "checkpoints"
    tags = sorted(t for t in os.listdir(ckpt_root) if (ckpt_root / t / "done").is_file())
    assert tags == ["renamed_run--step=2-consumed_samples=4.0", "renamed_run--step=4-consumed_samples=8.0"]
    events = re.findall(r"checkpoint (\S+?):? (state copied to host memory in|published \(asynchronous save\) in) "
                        r"(\d+\.\d\d) s", text)
    assert [(os.path.basename(p), what.split()[0]) for p, what, _ in events] == [
        (tags[0], "state"), (tags[0], "published"), (tags[1], "state"), (tags[1], "published")]
    assert "saved in" not in text
