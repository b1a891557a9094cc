#!/usr/bin/env bash
# The whole accelerator step comparison (benchmarks/accel_step.py) on one H100 / H200, in about 8.5 minutes.
#
# Run from the repository root on the device machine, with .device_wheels/ carried along
# (bash benchmarks/device/fetch_wheels.sh here first); the device tool's call is:
#     run(command="bash benchmarks/device/accel_step.sh", carry=[".device_wheels"], timeout_s=570)
# Results: $OUT/accel_step_<stamp>.{json,md,log} where OUT is set (the device tool returns $OUT), else
# benchmarks/results/.
#
# What it does: installs the carried wheels (hydra-core, omegaconf, antlr4-python3-runtime, liger-kernel) into
# $SITE_DIR, prints nvidia-smi, saves the seed-0 1.5B weights in /tmp, then runs `compare`: the baseline
# hf_liger_gc first, then issue 41's acceptance configurations (nxd_at_baseline[_compile]: the plan chosen under
# hf_liger_gc's measured peak at each length; nxd_offload_keep_attention), then the other transformers and nxd_lc
# configurations (the most telling first: the time budget skips the last ones), at 4k-128k (nxd_lc also
# 192k and 256k), each implementation in its own process and given at most ACCEL_IMPL_TIMEOUT_S seconds, all of
# it within ACCEL_TOTAL_S seconds from the start of this script (the implementations left when it is spent are
# recorded as skipped).
#
# Then benchmarks/layer_memory.py --device cuda (issue 41, item 1: the bytes a layer keeps, eager with Liger's kernels
# against compiled), at most ACCEL_LAYER_MEMORY_S seconds.
#
# Environment overrides (defaults in brackets): PYTHON [python3], SITE_DIR [/tmp/site], HF_DIR
# [/tmp/accel_step_hf1b], ACCEL_TOTAL_S [400], ACCEL_IMPL_TIMEOUT_S [100], ACCEL_STEPS [2],
# ACCEL_LAYER_MEMORY_S [100; 0 = skip], ACCEL_LAYER_MEMORY_SEQ [16384], ACCEL_LAYER_MEMORY_PLANS [full],
# ACCEL_LENS [4096,16384,65536,131072], ACCEL_NXD_EXTRA_LENS [196608,262144], ACCEL_IMPLS [all, baselines first],
# ACCEL_TINY [unset; 1 = the tiny model, for trying the script on a CPU].
set -euo pipefail
START=$SECONDS
PY=${PYTHON:-python3}
SITE=${SITE_DIR:-/tmp/site}
TOTAL_S=${ACCEL_TOTAL_S:-400}
LAYER_MEMORY_S=${ACCEL_LAYER_MEMORY_S:-100}  # after the comparison: benchmarks/layer_memory.py --device cuda
LAYER_MEMORY_SEQ=${ACCEL_LAYER_MEMORY_SEQ:-16384}
LAYER_MEMORY_PLANS=${ACCEL_LAYER_MEMORY_PLANS:-full}  # the plan of the H200 gap (nxd_fused_full vs its compile)
MARGIN_S=15  # writing the results after the budget
IMPL_TIMEOUT_S=${ACCEL_IMPL_TIMEOUT_S:-100}
STEPS=${ACCEL_STEPS:-2}
LENS=${ACCEL_LENS:-4096,16384,65536,131072}
NXD_EXTRA_LENS=${ACCEL_NXD_EXTRA_LENS:-196608,262144}
IMPLS=${ACCEL_IMPLS:-hf_liger_gc,nxd_at_baseline,nxd_at_baseline_compile,nxd_offload_keep_attention,hf_liger,nxd_fused_full_compile,nxd_fused_full_compile_cuda_graphs,nxd_offload,nxd_fused_full,nxd_budget30_compile,nxd_fused,nxd_budget15,hf_gc,hf,nxd_best,nxd_best_compile,nxd_norecompute,nxd_norecompute_compile,nxd_full_untiled,nxd_full_untiled_compile}
TINY_FLAG=${ACCEL_TINY:+--tiny}
HF_DIR=${HF_DIR:-/tmp/accel_step_hf1b${ACCEL_TINY:+_tiny}}
RESULTS=${OUT:-benchmarks/results}
STAMP=$(date -u +%Y%m%d_%H%M%S)
mkdir -p "$RESULTS"
LOG="$RESULTS/accel_step_$STAMP.log"
export PYTHONUNBUFFERED=1

main() {
  if compgen -G ".device_wheels/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .device_wheels/*.whl
  else
    echo "WARNING: no .device_wheels/*.whl: run benchmarks/device/fetch_wheels.sh and carry .device_wheels" >&2
  fi
  export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"
  nvidia-smi || echo "(nvidia-smi not available)"
  "$PY" -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'available', torch.cuda.is_available(), '| transformers', transformers.__version__)"

  # Liger-Kernel's Triton kernels against nxd_lc's torch kernels (loss and every gradient), the activation
  # offload's side stream against the plain step, compiled layers with CUDA graphs against without, ~1 min
  if "$PY" -c "import pytest" 2>/dev/null; then
    "$PY" -m pytest -q -p no:cacheprovider tests/test_fusions.py tests/test_activation_offload.py \
      tests/test_cuda_graphs.py -k cuda \
      || echo "CUDA tests (Liger kernels, side-stream offload, CUDA graphs) FAILED"
  else
    echo "(pytest not installed: the CUDA tests of test_fusions, test_activation_offload, test_cuda_graphs not run)"
  fi

  if [ ! -f "$HF_DIR/config.json" ]; then
    "$PY" -m benchmarks.accel_step prepare --hf-dir "$HF_DIR" $TINY_FLAG
  fi

  BUDGET=$(( TOTAL_S - (SECONDS - START) - MARGIN_S ))
  echo "setup took $(( SECONDS - START )) s; comparison budget ${BUDGET} s, at most ${IMPL_TIMEOUT_S} s per implementation"
  "$PY" -m benchmarks.accel_step compare --hf-dir "$HF_DIR" --lens "$LENS" --nxd-extra-lens "$NXD_EXTRA_LENS" \
    --impls "$IMPLS" --steps "$STEPS" --time-budget-s "$BUDGET" --impl-timeout-s "$IMPL_TIMEOUT_S" \
    --out "$RESULTS/accel_step_$STAMP.json"
  echo "accel_step.sh: comparison done at $(( SECONDS - START )) s"

  # issue 41, item 1: bytes a decoder layer keeps, eager (Liger's kernels) against compiled, on CUDA
  if [ -z "${ACCEL_TINY:-}" ] && [ "$LAYER_MEMORY_S" -gt 0 ]; then
    timeout "$LAYER_MEMORY_S" "$PY" -m benchmarks.layer_memory --device cuda --seq "$LAYER_MEMORY_SEQ" \
      --plans "$LAYER_MEMORY_PLANS" --out "$RESULTS/layer_memory_cuda_$STAMP.json" \
      || echo "layer_memory on CUDA: failed or out of time (${LAYER_MEMORY_S} s)"
  fi
  echo "accel_step.sh: done in $(( SECONDS - START )) s"
}

main 2>&1 | tee "$LOG"
