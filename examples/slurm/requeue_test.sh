#!/bin/bash
# `make test-slurm`: submit a 2-process nxd_lc job to a local single-node SLURM cluster, preempt it with
# `scontrol requeue` while it trains, and check that the requeued job resumes from the preemption checkpoint
# and finishes. Exit status 0 on success. Needs root (local_cluster.sh installs and starts SLURM).
set -euo pipefail
cd "$(dirname "$0")/../.."
REPO=$PWD
examples/slurm/local_cluster.sh start >/dev/null
WORK=$(mktemp -d /tmp/nxd_lc_slurm.XXXXXX)
NAME=nxd_lc_slurm_test
OUT=$WORK/job.out
STEPS=40
JOB=$(NPROC_PER_NODE=2 PYTHON_BIN=$REPO/.venv/bin/python LOG_DIR=$WORK/run OMP_NUM_THREADS=1 \
  sbatch --parsable --job-name=$NAME --output="$OUT" --chdir="$REPO" examples/slurm/train.sbatch \
  --config-name cpu_tiny_llama_config trainer.max_steps=$STEPS trainer.log_every_n_steps=1 \
  trainer.val_check_interval=1000 trainer.limit_val_batches=0 +trainer.enable_progress_bar=false \
  exp_manager.checkpoint_callback_params.every_n_train_steps=1000 model.encoder_seq_length=128 \
  data.tokenizer.vocab_size=1024 +data.tokenizer.cache_dir=$WORK/cache)
echo "submitted job $JOB (output $OUT)"
wait_for() {  # wait_for <seconds> <command...>
  local deadline=$((SECONDS + $1)); shift
  until "$@"; do
    if [ $SECONDS -ge $deadline ]; then echo "timed out waiting for: $*"; tail -50 "$OUT" || true; exit 1; fi
    sleep 2
  done
}
wait_for 300 grep -q "step 3/$STEPS" "$OUT"
echo "job $JOB is training: requeue (preempt) it"
scontrol requeue "$JOB"
wait_for 600 bash -c "sacct -n -X -j $JOB -o State 2>/dev/null | grep -q COMPLETED || \
  squeue -h -j $JOB -o %T 2>/dev/null | grep -q . && grep -q 'Trainer.fit. stopped: .max_steps=$STEPS' '$OUT'"
grep -q "preemption checkpoint of step" "$OUT" || { echo "FAIL: no preemption checkpoint"; tail -60 "$OUT"; exit 1; }
SAVED=$(grep -o "preemption checkpoint of step [0-9]*" "$OUT" | head -1 | awk '{print $NF}')
grep -q "resuming from .*step=$SAVED-" "$OUT" || { echo "FAIL: the requeued job did not resume from step $SAVED"; \
  tail -60 "$OUT"; exit 1; }
grep -q "step $STEPS/$STEPS" "$OUT" || { echo "FAIL: the requeued job did not finish"; tail -60 "$OUT"; exit 1; }
grep -E "restart [0-9]|preemption|resuming from|step $STEPS/$STEPS" "$OUT" | grep -v "^ " | cut -c1-160
echo "OK: job $JOB was preempted at step $SAVED (checkpoint saved), requeued, resumed from it and finished step $STEPS"
rm -rf "$WORK"
