"""Pipeline parallelism end to end through ``train.py`` (torchrun, gloo): a PP=2 run trains exactly as the PP=1
run of the same config (per-step loss, gradient norm, parameter norm, validation loss; also with interleaved
1F1B, virtual_pipeline_model_parallel_size 2), writes real
``pp_rank_XX`` model and optimizer shards, resumes, and converts to the same HF weights as the PP=1 checkpoint
(the converter gathers the stages). A PP=2 x DP=2 run composes ZeRO-1, mixed precision with stochastic rounding,
gradient clipping, activation checkpointing and tiled loss / MLP, against the PP=1 x DP=2 run of that config.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import launch
import pytest
import torch
from dist_utils import shard_files
from safetensors.torch import load_file
from test_e2e import REPO, _run, _small_corpus, _train_cmd

STEP_LINE = re.compile(r"step (\d+)/\d+ \| loss ([\d.]+) \| lr \S+ \| grad_norm ([\d.]+) \| param_norm ([\d.]+)")
VAL_LINE = re.compile(r"step (\d+) \| val_loss ([\d.]+)")
PP_FP32 = ["distributed_strategy.tensor_model_parallel_size=1", "distributed_strategy.sequence_parallel=false",
           "data.micro_batch_size=1"]


def _pp_cmd(log_dir: str, corpus: str, cache: str, steps: int, pp: int, nproc: int, extra: list[str]) -> list[str]:
    cmd = _train_cmd(log_dir, corpus, cache, max_steps=steps) + PP_FP32 + [
        f"distributed_strategy.pipeline_model_parallel_size={pp}", f"trainer.devices={nproc}",
        "trainer.val_check_interval=2"] + extra
    return [c.replace("--nproc_per_node=2", f"--nproc_per_node={nproc}") for c in cmd]


def _metrics(out: subprocess.CompletedProcess) -> tuple[dict[int, tuple[float, ...]], dict[int, float]]:
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    steps = {int(m[0]): tuple(float(x) for x in m[1:]) for m in STEP_LINE.findall(out.stdout)}
    vals = {int(m[0]): float(m[1]) for m in VAL_LINE.findall(out.stdout)}
    return steps, vals


def _convert(conf_overrides: list[str], tag: str, out_dir: str, nproc: int) -> dict[str, torch.Tensor]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "nxd_lc.cli.convert", "--config-name", "cpu_tiny_llama_config", "--checkpoint", tag,
           "--output", out_dir, "--save-tokenizer", "false", *conf_overrides]
    proc = launch.run(cmd, check=False, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"},
                      capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return load_file(os.path.join(out_dir, "model.safetensors"))


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.lane1_only
def test_pp2_trains_as_pp1_checkpoints_resumes_and_converts(tmp_path) -> None:
    corpus, cache = _small_corpus(str(tmp_path)), str(tmp_path / "cache")
    pp2_dir, pp1_dir = str(tmp_path / "pp2"), str(tmp_path / "pp1")
    pp2 = _metrics(_run(_pp_cmd(pp2_dir, corpus, cache, 4, pp=2, nproc=2, extra=[])))
    pp1 = _metrics(_run(_pp_cmd(pp1_dir, corpus, cache, 4, pp=1, nproc=1, extra=[])))
    assert sorted(pp2[0]) == [1, 2, 3, 4] and sorted(pp2[1]) == [2, 4]
    for step in (1, 2, 3, 4):  # loss, grad norm, param norm as printed (4 decimals / 3 / 2)
        assert pp2[0][step] == pytest.approx(pp1[0][step], abs=2e-4), (step, pp2[0][step], pp1[0][step])
    assert pp2[1] == pytest.approx(pp1[1], abs=2e-4)
    # interleaved 1F1B (2 stages per rank, 4 micro-batches) and its forward-only validation: the same numbers
    vpp = _metrics(_run(_pp_cmd(str(tmp_path / "vpp"), corpus, cache, 4, pp=2, nproc=2,
                                extra=["distributed_strategy.virtual_pipeline_model_parallel_size=2"])))
    for step in (1, 2, 3, 4):
        assert vpp[0][step] == pytest.approx(pp1[0][step], abs=2e-4), (step, vpp[0][step], pp1[0][step])
    assert vpp[1] == pytest.approx(pp1[1], abs=2e-4)
    assert pp2[0][4][0] < pp2[0][1][0]  # it learns
    tag = "cpu_tiny_llama--step=4-consumed_samples=16.0"
    last = os.path.join(pp2_dir, "checkpoints", tag)
    for sub in ("model", "optim"):
        names = shard_files(os.path.join(last, sub))
        assert names == ["dp_rank_00_tp_rank_00_pp_rank_00.pt", "dp_rank_00_tp_rank_00_pp_rank_01.pt"], names
    # the converter gathers both stages: the same HF weights as the PP=1 checkpoint of the same step
    ours = _convert(PP_FP32 + ["distributed_strategy.pipeline_model_parallel_size=2"], last,
                    str(tmp_path / "hf_pp2"), nproc=1)
    ref = _convert(PP_FP32, os.path.join(pp1_dir, "checkpoints", tag), str(tmp_path / "hf_pp1"), nproc=1)
    assert set(ours) == set(ref) and len(ref) > 10
    for name, t in ref.items():
        torch.testing.assert_close(ours[name], t, atol=1e-5, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")
    resumed = _run(_pp_cmd(pp2_dir, corpus, cache, 6, pp=2, nproc=2, extra=[]))
    steps, _ = _metrics(resumed)
    assert f"resuming from {last}" in resumed.stdout
    assert sorted(steps) == [5, 6]
    # exact resume: the same steps as the PP=1 run resumed from its own step-4 checkpoint
    steps1, _ = _metrics(_run(_pp_cmd(pp1_dir, corpus, cache, 6, pp=1, nproc=1, extra=[])))
    for step in (5, 6):
        assert steps[step] == pytest.approx(steps1[step], abs=2e-4), (step, steps[step], steps1[step])


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.lane1_only
def test_pp2_dp2_zero1_mixed_precision_memory_techniques_match_pp1(tmp_path) -> None:
    corpus, cache = _small_corpus(str(tmp_path)), str(tmp_path / "cache")
    extra = ["distributed_strategy.zero1=true", "precision.type=mixed_precisionSR",
             "model.activations_checkpoint_granularity=selective",
             "+model.activations_checkpoint_recompute=[LlamaRMSNorm,ActivationMultiplyMLP]",
             "+model.tiled_loss_chunk_size=64", "+model.tiled_mlp_chunk_size=64", "trainer.gradient_clip_val=0.5"]
    pp2 = _metrics(_run(_pp_cmd(str(tmp_path / "pp2"), corpus, cache, 2, pp=2, nproc=4, extra=extra)))
    pp1 = _metrics(_run(_pp_cmd(str(tmp_path / "pp1"), corpus, cache, 2, pp=1, nproc=2, extra=extra)))
    for step in (1, 2):  # bf16 parameters: equal within bf16 rounding of the recomputed activations
        assert pp2[0][step] == pytest.approx(pp1[0][step], rel=2e-3), (step, pp2[0][step], pp1[0][step])
    tag = os.path.join(str(tmp_path / "pp2"), "checkpoints", "cpu_tiny_llama--step=2-consumed_samples=8.0")
    optim = shard_files(os.path.join(tag, "optim"))
    assert optim == [f"dp_rank_{d:02d}_tp_rank_00_pp_rank_{p:02d}.pt" for d in (0, 1) for p in (0, 1)], optim
