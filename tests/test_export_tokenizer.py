"""The HF export uses the tokenizer its checkpoint was trained with (issue 40, item 12): a training run saves its
tokenizer in its run directory, the export copies those files even when its own config would build another
tokenizer, refuses to train one when the run saved none, and the command line takes Hydra's ``~key`` / ``+key``
/ ``++key`` overrides."""

from __future__ import annotations

import shutil
import sysconfig
from pathlib import Path

import pytest

from nxd_lc.app.convert import compose_run_config, convert_checkpoint_to_hf
from nxd_lc.cli.convert import main as convert_main

REPO = Path(__file__).resolve().parent.parent


def _corpus(dst: Path) -> Path:
    dst.mkdir()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for i, src in enumerate(sorted(p for p in stdlib.glob("*.py") if 200 <= p.stat().st_size <= 4000)[:40]):
        shutil.copy(src, dst / f"doc_{i:03d}.py")
    return dst


def _overrides(tmp: Path, corpus: Path, vocab_size: int) -> list[str]:
    return ["~data.builtin_corpus", f"+data.train_dir={corpus}", "+data.file_glob=*.py", "data.val_fraction=0.1",
            f"data.tokenizer.vocab_size={vocab_size}", f"+data.tokenizer.cache_dir={tmp / 'tok'}",
            "trainer.max_steps=2", "+exp_manager.preemption_signals=[]", "data.micro_batch_size=1",
            "data.global_batch_size=1", "model.encoder_seq_length=32", "+model.num_layers=1", "+model.hidden_size=64",
            "trainer.val_check_interval=100", "exp_manager.checkpoint_callback_params.every_n_train_steps=2",
            f"exp_manager.explicit_log_dir={tmp / 'run'}", "exp_manager.create_tensorboard_logger=false",
            "+trainer.enable_progress_bar=false", "trainer.devices=1",
            "distributed_strategy.tensor_model_parallel_size=1", "distributed_strategy.sequence_parallel=false"]


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A 2-step run of the demo config (a byte-level BPE of 300 tokens trained on its corpus), checkpointed."""
    from dist_utils import set_launch_env_of_one
    from hydra import compose, initialize_config_dir

    from nxd_lc.app.run import _shutdown_distributed, run

    tmp = tmp_path_factory.mktemp("export_tok")
    corpus = _corpus(tmp / "corpus")
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        raw = compose(config_name="cpu_tiny_llama_config", overrides=_overrides(tmp, corpus, 300))
    with pytest.MonkeyPatch.context() as mp:  # module scope: its own MonkeyPatch, undone after the run
        set_launch_env_of_one(mp.setenv)
        try:
            run(raw)
        finally:
            _shutdown_distributed()
    return tmp, corpus


def test_the_run_saves_its_tokenizer_and_the_export_uses_it(trained_run: tuple[Path, Path], tmp_path: Path) -> None:
    """Exported with the run's keys except the BPE's vocabulary size (it would train another tokenizer): the HF
    directory holds the run's tokenizer files, byte for byte."""
    tmp, corpus = trained_run
    saved = tmp / "run" / "tokenizer"
    assert (saved / "tokenizer.json").is_file()
    cfg = compose_run_config("cpu_tiny_llama_config", str(REPO / "conf"),
                             _overrides(tmp_path, corpus, 280))  # another cache dir and vocab size
    out = Path(convert_checkpoint_to_hf(cfg, str(tmp / "run" / "checkpoints"), str(tmp_path / "hf")))
    assert (out / "tokenizer.json").read_bytes() == (saved / "tokenizer.json").read_bytes()
    assert not (tmp_path / "tok").exists()  # nothing trained


def test_an_export_without_the_runs_tokenizer_refuses_to_train_one(trained_run: tuple[Path, Path],
                                                                   tmp_path: Path) -> None:
    """The checkpoint copied away from its run directory: a ``bytelevel_bpe`` config is refused naming the missing
    directory and the way out, before anything is built; ``--save-tokenizer false`` exports the weights."""
    tmp, corpus = trained_run
    ckpt_root = tmp_path / "moved" / "checkpoints"
    shutil.copytree(tmp / "run" / "checkpoints", ckpt_root)
    cfg = compose_run_config("cpu_tiny_llama_config", str(REPO / "conf"), _overrides(tmp_path, corpus, 300))
    with pytest.raises(ValueError, match=r"tokenizer is not saved with the checkpoint \(no .*moved/tokenizer.*"
                                         r"--save-tokenizer false"):
        convert_checkpoint_to_hf(cfg, str(ckpt_root), str(tmp_path / "hf"))
    assert not (tmp_path / "hf").exists() and not (tmp_path / "tok").exists()
    out = Path(convert_checkpoint_to_hf(cfg, str(ckpt_root), str(tmp_path / "hf"), save_tokenizer=False))
    assert (out / "model.safetensors").is_file() and not (out / "tokenizer.json").exists()


def test_the_cli_takes_hydra_delete_and_add_overrides(trained_run: tuple[Path, Path], tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """``~data.builtin_corpus`` and ``+data.train_dir=...`` were refused ("overrides must be key=value"); a
    malformed override is still a usage error naming it."""
    from dist_utils import set_launch_env_of_one

    tmp, corpus = trained_run
    set_launch_env_of_one(monkeypatch.setenv)  # one process of a torchrun launch (the CLI joins a group of one)
    args = ["--config-name", "cpu_tiny_llama_config", "--config-dir", str(REPO / "conf"),
            "--checkpoint", str(tmp / "run" / "checkpoints"), "--output", str(tmp_path / "hf")]
    assert convert_main([*args, *_overrides(tmp_path, corpus, 300), "++model.fuse_qkv=true"]) == 0
    assert (tmp_path / "hf" / "tokenizer.json").is_file()
    with pytest.raises(SystemExit):
        convert_main([*args, "data.tokenizer.vocab_size==3"])
    assert "override 'data.tokenizer.vocab_size==3' is not a Hydra override" in capsys.readouterr().err
