#!/usr/bin/env bash
# Tiny-scale 4x context extension measured by passkey retrieval (issue 12), on 2 CPU processes.
#
#   examples/long_context/passkey_extension.sh      # from anywhere; runs in the repository root
#
# (a) stage 1: pre-train the ~2.9M Llama of conf/cpu_passkey_config.yaml at 512 tokens on stdlib text mixed with
#     synthetic passkey documents (skipped when the run already has a checkpoint at its last step);
# (b) convert its newest checkpoint to HF (nxd_lc_runs/hf/cpu_passkey);
# (c) passkey accuracy at 512 / 1024 / 2048 / 4096 of: the base model with its unscaled RoPE, and the same weights
#     with YaRN (factor 4) zero-shot;
# (d) stage 2: continue at 2048 tokens with YaRN (conf/cpu_passkey_yarn_config.yaml), bounded steps;
# (e) convert and evaluate the continuation; (f) print the summary table (README).
# Results: nxd_lc_runs/passkey_extension/{base,yarn_zero_shot,continued}/retrieval.json + passkey_heatmap.png,
# and summary.md.
#
# Environment: VENV (default .venv), NUM_SAMPLES (per length x depth cell, default 4), LENGTHS
# (default 512,1024,2048,4096), FRESH=1 restarts stage 2 from stage 1 (default: keep a finished stage 2).
set -euo pipefail
cd "$(dirname "$0")/../.."

VENV=${VENV:-.venv}
NUM_SAMPLES=${NUM_SAMPLES:-4}
LENGTHS=${LENGTHS:-512,1024,2048,4096}
FRESH=${FRESH:-0}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
TORCHRUN="$VENV/bin/torchrun --standalone --nproc_per_node=2"
PY="$VENV/bin/python"
OUT=nxd_lc_runs/passkey_extension
HF1=nxd_lc_runs/hf/cpu_passkey
HF2=nxd_lc_runs/hf/cpu_passkey_yarn
mkdir -p "$OUT"

step() { printf '\n=== %s\n' "$*"; }
evaluate() {  # evaluate <config> <hf dir> <name> <label> [overrides...]
  local config=$1 hf=$2 name=$3 label=$4; shift 4
  $TORCHRUN -m nxd_lc.cli.passkey --config-name "$config" --hf-dir "$hf" --lengths "$LENGTHS" \
    --depths 0,0.25,0.5,0.75,1 --num-samples "$NUM_SAMPLES" --out "$OUT/$name" --label "$label" "$@"
}

step "(a) stage 1: 512 tokens, corpus + synthetic passkey"
$TORCHRUN train.py --config-name cpu_passkey_config   # resumes / returns at once when already finished

step "(b) convert stage 1 -> $HF1"
$PY -m nxd_lc.cli.convert --config-name cpu_passkey_config \
  --checkpoint nxd_lc_runs/cpu_passkey/checkpoints --output "$HF1" --overwrite true

step "(c) before: base model (unscaled RoPE) and YaRN x4 zero-shot"
evaluate cpu_passkey_config "$HF1" base "base model, RoPE unscaled"
evaluate cpu_passkey_yarn_config "$HF1" yarn_zero_shot "base model + YaRN x4, zero-shot"

step "(d) stage 2: 2048 tokens with YaRN x4"
if [ "$FRESH" = 1 ]; then rm -rf nxd_lc_runs/cpu_passkey_yarn; fi
$TORCHRUN train.py --config-name cpu_passkey_yarn_config

step "(e) convert stage 2 -> $HF2 and evaluate"
$PY -m nxd_lc.cli.convert --config-name cpu_passkey_yarn_config \
  --checkpoint nxd_lc_runs/cpu_passkey_yarn/checkpoints --output "$HF2" --overwrite true
evaluate cpu_passkey_yarn_config "$HF2" continued "after the YaRN continuation at 2048"

step "(f) summary"
$PY examples/long_context/summarize_retrieval.py "$OUT" base="base model (512, RoPE unscaled)" \
  yarn_zero_shot="base + YaRN x4, zero-shot" continued="YaRN x4 + continuation at 2048" | tee "$OUT/summary.md"
