"""End-to-end smoke tests of ``train.py``: dry run, config errors, and a real torchrun TP=2 + SP run that
checkpoints (xser, NxD layout) and resumes at the right step and consumed-sample count."""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sys
import sysconfig

import launch
import pytest
import torch
from dist_utils import shard_files

from nxd_lc.checkpoint import sharded

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")


def _run(args: list[str], timeout: float = 600, real_torchrun: bool = False) -> subprocess.CompletedProcess:
    """Run a command from the repository root; a torchrun command's ranks are forks of the tests' fork server
    (``tests/launch.py``) unless ``real_torchrun``."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    runner = subprocess.run if real_torchrun else launch.run
    return runner(args, check=False, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.compat
def test_dry_run_validates_nxdt_8b_config() -> None:
    out = _run([sys.executable, "train.py", "--config-name", "hf_llama3_8B_config", "+dry_run=true"])
    # valid, but a launch would stop: NxDT's data path is not on this host, and the file names no tokenizer
    assert out.returncode == 3, out.stderr
    assert "config is valid, but launching it on this host would stop (2 problem(s)" in out.stdout
    assert "at launch: data.train_dir: no such file" in out.stdout and "at launch: data.tokenizer.type: not set" \
        in out.stdout
    assert "world size 128 = TP 32 x PP 1 x CP 1 x DP 4" in out.stdout
    # NxDT's misspelled key is read as the canonical one and mapped to the environment
    assert re.search(r"NEURON_RT_ASYNC_EXEC_MAX_INFLIGHT_REQUESTS\s+async_exec_max_inflight_requests\s+\S+\s+5",
                     out.stdout)
    assert "not supported yet" not in out.stdout  # zero1 + mixed_precision are implemented
    assert ("# precision mixed_precision: params bf16, compute bf16, grad accumulation fp32, master weights fp32, "
            "optimizer state fp32, bf16 update rounding nearest, TP/SP reductions fp32") in out.stdout
    assert "activations_checkpoint_granularity" not in out.stdout.split("would stop with:")[-1]


def test_config_errors_are_reported_together_with_keys() -> None:
    out = _run([sys.executable, "train.py", "--config-name", "cpu_tiny_llama_config",
                "+trainer.max_step=3", "data.global_batch_size=3", "+model.hidden_sise=8"])
    assert out.returncode == 2
    err = out.stderr
    assert "trainer.max_step: unknown key; did you mean 'trainer.max_steps'?" in err
    assert "model.hidden_sise: unknown key; did you mean 'model.hidden_size'?" in err


def _small_corpus(tmp_path: str) -> str:
    """~40 real stdlib files copied into a temp dir (the full corpus is for the demo)."""
    root = sysconfig.get_paths()["stdlib"]
    names = ["argparse.py", "ast.py", "bisect.py", "calendar.py", "csv.py", "dataclasses.py", "difflib.py",
             "enum.py", "fractions.py", "functools.py", "gettext.py", "heapq.py", "inspect.py", "ipaddress.py",
             "json/decoder.py", "json/encoder.py", "locale.py", "numbers.py", "operator.py", "optparse.py",
             "pathlib.py", "pprint.py", "queue.py", "random.py", "shlex.py", "shutil.py", "statistics.py",
             "string.py", "textwrap.py", "threading.py", "tokenize.py", "typing.py", "uuid.py", "warnings.py",
             "weakref.py", "zipfile.py", "abc.py", "base64.py", "colorsys.py", "contextlib.py"]
    dst = os.path.join(tmp_path, "corpus")
    for n in names:
        src = os.path.join(root, n)
        if os.path.isfile(src):
            os.makedirs(os.path.dirname(os.path.join(dst, n)), exist_ok=True)
            shutil.copy(src, os.path.join(dst, n))
    return dst


def _train_cmd(log_dir: str, corpus: str, cache: str, max_steps: int) -> list[str]:
    return [TORCHRUN, "--standalone", "--nproc_per_node=2", "train.py", "--config-name", "cpu_tiny_llama_config",
            f"exp_manager.explicit_log_dir={log_dir}", f"trainer.max_steps={max_steps}",
            "trainer.log_every_n_steps=1", "trainer.val_check_interval=4", "trainer.limit_val_batches=2",
            "+trainer.enable_progress_bar=false",
            "exp_manager.checkpoint_callback_params.every_n_train_steps=2",
            "exp_manager.checkpoint_callback_params.save_top_k=2",
            "~data.builtin_corpus", f"+data.train_dir={corpus}", "+data.file_glob=**/*.py",
            "data.val_fraction=0.1", "data.tokenizer.vocab_size=1024", f"+data.tokenizer.cache_dir={cache}",
            "model.encoder_seq_length=256", "model.optim.sched.warmup_steps=1"]


@pytest.mark.lane1_only  # end-to-end; the torch-2.9 lane covers its parts in unit-level tests
@pytest.mark.distributed
@pytest.mark.slow
def test_torchrun_tp2_sp_train_checkpoint_resume(tmp_path) -> None:
    corpus = _small_corpus(str(tmp_path))
    log_dir, cache = str(tmp_path / "run"), str(tmp_path / "cache")
    first = _run(_train_cmd(log_dir, corpus, cache, max_steps=4), real_torchrun=True)
    assert first.returncode == 0, first.stdout[-4000:] + first.stderr[-4000:]
    ckpt_root = os.path.join(log_dir, "checkpoints")
    tags = sorted(t for t in os.listdir(ckpt_root) if os.path.isdir(os.path.join(ckpt_root, t)))
    # save_top_k=2 by monitor=step, mode=max: the last two saves survive
    assert tags == ["cpu_tiny_llama--step=2-consumed_samples=8.0", "cpu_tiny_llama--step=4-consumed_samples=16.0"]
    last = os.path.join(ckpt_root, tags[-1])
    assert os.path.isfile(os.path.join(last, "done"))
    for tp in (0, 1):  # NxD layout, xser: structure file + one file per tensor
        shard = os.path.join(last, "model", f"dp_rank_00_tp_rank_{tp:02d}_pp_rank_00.pt")
        assert os.path.isfile(shard) and glob.glob(shard + ".tensors/tensor_*.pt")
        assert os.path.isfile(os.path.join(last, "optim", f"dp_rank_00_tp_rank_{tp:02d}_pp_rank_00.pt"))
    assert glob.glob(os.path.join(log_dir, "tensorboard", "events.out.tfevents.*"))
    assert "val_loss" in first.stdout + first.stderr or glob.glob(os.path.join(log_dir, "*.txt"))

    second = _run(_train_cmd(log_dir, corpus, cache, max_steps=6), real_torchrun=True)
    assert second.returncode == 0, second.stdout[-4000:] + second.stderr[-4000:]
    assert f"resuming from {last}" in second.stdout
    tags = sorted(t for t in os.listdir(ckpt_root) if os.path.isdir(os.path.join(ckpt_root, t)))
    assert tags == ["cpu_tiny_llama--step=4-consumed_samples=16.0", "cpu_tiny_llama--step=6-consumed_samples=24.0"]


@pytest.mark.compat
@pytest.mark.distributed
@pytest.mark.slow
def test_torchrun_context_parallel_with_memory_techniques(tmp_path) -> None:
    """CP=2 (ring) + full activation checkpointing + tiled loss/MLP through train.py; the checkpoint has one
    model shard (CP ranks hold identical weights, one writer)."""
    corpus = _small_corpus(str(tmp_path))
    log_dir = str(tmp_path / "run")
    cmd = _train_cmd(log_dir, corpus, str(tmp_path / "cache"), max_steps=2) + [
        "distributed_strategy.tensor_model_parallel_size=1", "distributed_strategy.context_parallel_size=2",
        "+distributed_strategy.context_parallel_algo=ring", "distributed_strategy.sequence_parallel=false",
        "model.activations_checkpoint_granularity=full", "+model.tiled_loss_chunk_size=64",
        "+model.tiled_mlp_chunk_size=64"]
    out = _run(cmd)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    assert "activation checkpointing (full): 4 modules" in out.stdout
    tag = os.path.join(log_dir, "checkpoints", "cpu_tiny_llama--step=2-consumed_samples=8.0")
    assert sorted(os.listdir(os.path.join(tag, "model"))) == ["dp_rank_00_tp_rank_00_pp_rank_00.pt",
                                                             "dp_rank_00_tp_rank_00_pp_rank_00.pt.info.pt",
                                                             "dp_rank_00_tp_rank_00_pp_rank_00.pt.tensors"]


@pytest.mark.lane1_only  # end-to-end; the torch-2.9 lane covers its parts in unit-level tests
@pytest.mark.distributed
@pytest.mark.slow
def test_torchrun_zero1_mixed_precision_sr_checkpoint_resume(tmp_path) -> None:
    """DP=2 with ZeRO-1 and mixed_precisionSR through train.py: one optimizer shard per DP rank, fp32 master
    weights written as the model weights (use_master_weights_in_ckpt), and a resume that continues."""
    corpus = _small_corpus(str(tmp_path))
    log_dir, cache = str(tmp_path / "run"), str(tmp_path / "cache")
    extra = ["distributed_strategy.tensor_model_parallel_size=1", "distributed_strategy.sequence_parallel=false",
             "distributed_strategy.zero1=true", "precision.type=mixed_precision_SR",
             "exp_manager.checkpoint_callback_params.use_master_weights_in_ckpt=true"]
    first = _run(_train_cmd(log_dir, corpus, cache, max_steps=2) + extra)
    assert first.returncode == 0, first.stdout[-4000:] + first.stderr[-4000:]
    assert "precision mixed_precisionSR: params bf16" in first.stdout  # NxDT's other spelling, canonical name
    tag = os.path.join(log_dir, "checkpoints", "cpu_tiny_llama--step=2-consumed_samples=8.0")
    optim = shard_files(os.path.join(tag, "optim"))
    assert optim == ["dp_rank_00_tp_rank_00_pp_rank_00.pt", "dp_rank_01_tp_rank_00_pp_rank_00.pt"]
    model_state, _, _ = sharded.load_checkpoint(os.path.dirname(tag), os.path.basename(tag), dp_rank=0, tp_rank=0,
                                                pp_rank=0, load_optim=False)
    weights = [v for k, v in model_state.items() if k.endswith("weight")]
    assert weights and all(v.dtype == torch.float32 for v in weights)  # masters, not the bf16 params
    second = _run(_train_cmd(log_dir, corpus, cache, max_steps=4) + extra)
    assert second.returncode == 0, second.stdout[-4000:] + second.stderr[-4000:]
    assert f"resuming from {tag}" in second.stdout


def _val_losses(log_dir: str) -> dict[int, float]:
    """``val_loss`` by TensorBoard step, every launch's event file of ``log_dir`` merged."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: dict[int, float] = {}
    for f in sorted(glob.glob(os.path.join(log_dir, "tensorboard", "events.out.tfevents.*")), key=os.path.getmtime):
        acc = EventAccumulator(f)
        acc.Reload()
        if "val_loss" in acc.Tags()["scalars"]:
            out.update({e.step: e.value for e in acc.Scalars("val_loss")})
    return out


def _with(cmd: list[str], **overrides: object) -> list[str]:
    """``cmd`` with the Hydra overrides of the given keys (dots as ``__``) replaced or added."""
    keys = {k.replace("__", "."): v for k, v in overrides.items()}
    kept = [a for a in cmd if a.split("=", 1)[0].lstrip("+~") not in keys]
    return kept + [f"{k}={v}" for k, v in keys.items()]


@pytest.mark.lane1_only  # three train.py launches; the sampler's rewind is unit-tested in test_data.py
@pytest.mark.distributed
@pytest.mark.slow
def test_validation_reads_a_fixed_set_every_pass_and_after_resume(tmp_path) -> None:
    """Validation is cut short by ``limit_val_batches`` (2 of the held-out set's batches): with the weights frozen
    (lr 0) every pass gives the same loss; a run resumed from its step-2 checkpoint validates at step 4 as the
    uninterrupted run does (before: each pass continued where the previous stopped, resumed runs restarted)."""
    corpus, cache = _small_corpus(str(tmp_path)), str(tmp_path / "cache")
    frozen_dir = str(tmp_path / "frozen")
    base = _with(_train_cmd(frozen_dir, corpus, cache, max_steps=4), data__val_fraction=0.3,
                 trainer__val_check_interval=1)
    out = _run(_with(base, model__optim__lr=0.0, model__optim__sched__min_lr=0.0,
                     exp_manager__create_checkpoint_callback="false"))
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    frozen = _val_losses(frozen_dir)
    assert len(frozen) == 4, frozen
    values = list(frozen.values())
    assert max(values) - min(values) <= 1e-6, frozen
    full_dir, resumed_dir = str(tmp_path / "full"), str(tmp_path / "resumed")
    trained = _with(base, trainer__val_check_interval=2)
    out = _run(_with(trained, exp_manager__explicit_log_dir=full_dir))
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    ckpt = os.path.join(full_dir, "checkpoints", "cpu_tiny_llama--step=2-consumed_samples=8.0")
    out = _run(_with(trained, exp_manager__explicit_log_dir=resumed_dir,
                     exp_manager__resume_from_checkpoint=f"'{ckpt}'"))
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    full, resumed = _val_losses(full_dir), _val_losses(resumed_dir)
    assert len(full) == 2 and len(resumed) == 1, (full, resumed)
    last = max(full)
    assert resumed[last] == pytest.approx(full[last], rel=1e-5, abs=0), (full, resumed)
    assert full[min(full)] != pytest.approx(full[last], rel=1e-3)  # the weights moved: the check can tell
