"""The training progress bar counts optimizer steps out of ``trainer.max_steps`` and shows no epoch total when
``max_epochs`` is -1 (issue 40, item 14: ``make demo``'s bar ended at ``Epoch 0/-2 ... 360/180``: micro-batches
counted against ``max_steps``, which is in optimizer steps, and ``max_epochs: -1`` shown as ``-2``)."""

from __future__ import annotations

import shutil
import sysconfig
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from nxd_lc.lightning.progress import OptimizerStepProgressBar

REPO = Path(__file__).resolve().parent.parent


class _Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.layer(batch).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class _BarAtStart(pl.Callback):
    """Records the bar's ``(n, total)`` when training starts (after a restore)."""

    def __init__(self, bar: OptimizerStepProgressBar) -> None:
        self.bar, self.at_start = bar, None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.at_start = (self.bar.train_progress_bar.n, self.bar.train_progress_bar.total)


def _fit(tmp_path: Path, *, batches: int, accumulate: int, max_steps: int, max_epochs: int,
         callbacks: tuple[pl.Callback, ...] = (), ckpt_path: str | None = None) -> tuple[
        OptimizerStepProgressBar, pl.Trainer]:
    bar = OptimizerStepProgressBar()
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, max_epochs=max_epochs,
                         accumulate_grad_batches=accumulate, callbacks=[bar, *callbacks, _BarAtStart(bar)],
                         logger=False, enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
                         enable_model_summary=False, default_root_dir=str(tmp_path))
    trainer.fit(_Tiny(), DataLoader(torch.randn(batches, 2), batch_size=1), ckpt_path=ckpt_path)
    return bar, trainer


def test_the_bar_counts_optimizer_steps_out_of_max_steps_across_epochs(tmp_path: Path) -> None:
    """4 micro-batches per epoch, 2 per optimizer step, max_steps 5, max_epochs -1: step 5 is in the third epoch;
    the bar ends at 5/5 (not micro-batches out of 5) and its description has no epoch total."""
    bar, trainer = _fit(tmp_path, batches=4, accumulate=2, max_steps=5, max_epochs=-1)
    assert trainer.global_step == 5
    assert (bar.train_progress_bar.n, bar.train_progress_bar.total) == (5, 5)
    assert bar.train_progress_bar.desc.rstrip(": ") == "Epoch 2"


def test_an_epoch_bound_run_counts_the_optimizer_steps_of_each_epoch(tmp_path: Path) -> None:
    """max_steps -1, max_epochs 2: each epoch's bar counts its 3 optimizer steps (5 micro-batches, 2 per step, the
    last step on the odd one out) and names the last epoch index."""
    bar, trainer = _fit(tmp_path, batches=5, accumulate=2, max_steps=-1, max_epochs=2)
    assert trainer.global_step == 6
    assert (bar.train_progress_bar.n, bar.train_progress_bar.total) == (3, 3)
    assert bar.train_progress_bar.desc.rstrip(": ") == "Epoch 1/1"


def test_a_run_resumed_inside_an_epoch_keeps_the_total(tmp_path: Path) -> None:
    """Issue 50: a run resumed from a checkpoint saved inside its (only) epoch showed ``8/?``: Lightning restarts
    the epoch without ``on_train_epoch_start``. Saved at step 2 of a 20-micro-batch epoch (2 per step), resumed
    with max_steps 6: the bar starts at 2/6 and ends at 6/6."""
    ckpt = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=2, save_top_k=-1)
    _fit(tmp_path, batches=20, accumulate=2, max_steps=2, max_epochs=-1, callbacks=(ckpt,))
    saved = ckpt.last_model_path or ckpt.best_model_path
    assert saved
    bar, trainer = _fit(tmp_path, batches=20, accumulate=2, max_steps=6, max_epochs=-1, ckpt_path=saved)
    assert trainer.global_step == 6
    at_start = [c for c in trainer.callbacks if isinstance(c, _BarAtStart)][0].at_start
    assert at_start == (2, 6)
    assert (bar.train_progress_bar.n, bar.train_progress_bar.total) == (6, 6)


def test_the_demo_config_runs_with_the_optimizer_step_bar(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``train.py``'s path (nxd_lc.app.run on the CPU demo config, shrunk) with the progress bar on and 2
    micro-batches per optimizer step: the bar is nxd_lc's and ends at max_steps/max_steps under ``Epoch 0``."""
    from dist_utils import set_launch_env_of_one
    from hydra import compose, initialize_config_dir

    from nxd_lc.app.run import _shutdown_distributed, run

    set_launch_env_of_one(monkeypatch.setenv)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for i, src in enumerate(sorted(p for p in stdlib.glob("*.py") if 200 <= p.stat().st_size <= 4000)[:40]):
        shutil.copy(src, corpus / f"doc_{i:03d}.py")
    overrides = ["~data.builtin_corpus", f"+data.train_dir={corpus}", "+data.file_glob=*.py",
                 "data.val_fraction=0.1", "data.tokenizer.vocab_size=300",
                 f"+data.tokenizer.cache_dir={tmp_path / 'tok'}", "trainer.max_steps=3",
                 "+exp_manager.preemption_signals=[]", "data.micro_batch_size=1", "data.global_batch_size=2",
                 "model.encoder_seq_length=32", "+model.num_layers=1", "+model.hidden_size=64",
                 "trainer.val_check_interval=100", "exp_manager.create_checkpoint_callback=false",
                 f"exp_manager.explicit_log_dir={tmp_path / 'run'}", "exp_manager.create_tensorboard_logger=false",
                 "trainer.devices=1", "distributed_strategy.tensor_model_parallel_size=1",
                 "distributed_strategy.sequence_parallel=false"]
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        raw = compose(config_name="cpu_tiny_llama_config", overrides=overrides)
    try:
        trainer = run(raw)
    finally:
        _shutdown_distributed()  # as train.py does: no process group left for the worker's next test
    bar = trainer.progress_bar_callback
    assert isinstance(bar, OptimizerStepProgressBar)
    assert trainer.global_step == 3
    assert (bar.train_progress_bar.n, bar.train_progress_bar.total) == (3, 3)
    assert bar.train_progress_bar.desc.rstrip(": ") == "Epoch 0"
