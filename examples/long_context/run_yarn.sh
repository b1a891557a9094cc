#!/usr/bin/env bash
# Long-context continuation of the CPU demo with YaRN + context parallelism, measured by loss per position.
#
#   examples/long_context/run_yarn.sh            # from anywhere; runs in the repository root
#
# (a) make sure the main job (conf/cpu_tiny_llama_config.yaml: TP=2 + SP, seq 2048) has a checkpoint (runs
#     the demo if not);
# (b) convert its newest checkpoint (NxD layout, TP=2 shards) to an HF directory, 2 processes;
# (c) evaluate the held-out loss per position bucket at seq 8192 BEFORE continuing: the main job's model with
#     its unscaled RoPE, and with YaRN (factor 4) applied zero-shot;
# (d) continue training at seq 8192 with YaRN, CP=2 (ring), TP=1 on 2 processes (cpu_tiny_llama_yarn_config);
# (e) convert the continuation's checkpoint (TP=1) to HF and evaluate AFTER.
# Results: nxd_lc_runs/long_context/{before_rope,before_yarn,after_yarn}.json and the printed tables.
#
# Environment: VENV (default .venv), NUM_SAMPLES (held-out 8192-token sequences, default 8), FRESH=0 keeps an
# existing continuation run (resumes it; by default it is removed so the continuation starts from the main job).
set -euo pipefail
cd "$(dirname "$0")/../.."

VENV=${VENV:-.venv}
NUM_SAMPLES=${NUM_SAMPLES:-8}
FRESH=${FRESH:-1}
EDGES=0,2048,8192
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
TORCHRUN="$VENV/bin/torchrun --standalone"

MAIN_CKPTS=nxd_lc_runs/cpu_tiny_llama/checkpoints
YARN_RUN=nxd_lc_runs/cpu_tiny_llama_yarn
HF_MAIN=nxd_lc_runs/hf/cpu_tiny_llama          # = model.hf_weights_dir of cpu_tiny_llama_yarn_config
HF_YARN=nxd_lc_runs/hf/cpu_tiny_llama_yarn
OUT=nxd_lc_runs/long_context
mkdir -p "$OUT"

step() { printf '\n=== %s\n' "$*"; }
evaluate() {  # evaluate <hf dir> <json name> <label> [overrides...]
  local hf=$1 name=$2 label=$3; shift 3
  $TORCHRUN --nproc_per_node=2 -m nxd_lc.cli.loss_by_position --config-name cpu_tiny_llama_yarn_config \
    --hf-dir "$hf" --edges "$EDGES" --num-samples "$NUM_SAMPLES" --json "$OUT/$name.json" --label "$label" "$@"
}

step "(a) main job checkpoint"
if ! compgen -G "$MAIN_CKPTS/*/done" > /dev/null; then
  echo "no complete checkpoint in $MAIN_CKPTS: running the demo (make demo)"
  make demo
fi
echo "newest: $(tail -n 1 "$MAIN_CKPTS/newest")"

step "(b) convert the main job's newest checkpoint (TP=2) -> $HF_MAIN"
$TORCHRUN --nproc_per_node=2 -m nxd_lc.cli.convert --config-name cpu_tiny_llama_config \
  --checkpoint "$MAIN_CKPTS" --output "$HF_MAIN" --overwrite true

step "(c) before: loss by position at seq 8192"
evaluate "$HF_MAIN" before_rope "before, unscaled RoPE (the main job's model as is)" model.hf_config_overrides=null
evaluate "$HF_MAIN" before_yarn "before, YaRN factor 4 zero-shot"

step "(d) continue at seq 8192 with YaRN, CP=2 ring, TP=1"
if [ "$FRESH" = 1 ]; then rm -rf "$YARN_RUN"; fi
$TORCHRUN --nproc_per_node=2 train.py --config-name cpu_tiny_llama_yarn_config

step "(e) convert the continuation (TP=1, one process) -> $HF_YARN, and evaluate after"
$TORCHRUN --nproc_per_node=1 -m nxd_lc.cli.convert --config-name cpu_tiny_llama_yarn_config \
  --checkpoint "$YARN_RUN/checkpoints" --output "$HF_YARN" --overwrite true
evaluate "$HF_YARN" after_yarn "after 10 steps at 8192 with YaRN"

step "summary (mean loss per position bucket, nats)"
"$VENV/bin/python" - "$OUT" <<'PY'
import json, sys, pathlib
out = pathlib.Path(sys.argv[1])
runs = [(n, json.loads((out / f"{n}.json").read_text())) for n in ("before_rope", "before_yarn", "after_yarn")]
labels = list(runs[0][1]["buckets"]) + ["all"]
print(f"{'':>12}" + "".join(f"{lab:>16}" for lab in labels))
for name, r in runs:
    rows = [r["buckets"][lab] if lab != "all" else r["overall"] for lab in labels]
    print(f"{name:>12}" + "".join(f"{x['loss']:>16.4f}" for x in rows))
print(f"{'tokens':>12}" + "".join(f"{x:>16d}" for x in [runs[0][1]['buckets'][lab]['num_tokens'] for lab in labels[:-1]] + [runs[0][1]['overall']['num_tokens']]))
PY
