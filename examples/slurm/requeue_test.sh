#!/bin/bash
# `make test-slurm`: two 2-process nxd_lc jobs on a local single-node SLURM cluster, each preempted while it
# trains and expected to save a preemption checkpoint, be requeued, resume from exactly that step and finish:
#   1. `scontrol requeue <job>` (what a preemption does: SIGTERM to every process of the job, then requeue);
#   2. `scancel --signal=USR1 --batch <job>` (what `#SBATCH --signal=B:USR1@90` sends before the time limit: the
#      batch script forwards SIGTERM to torchrun, then requeues the job itself).
# Exit status 0 on success. Needs root (local_cluster.sh installs and starts SLURM).
set -euo pipefail
cd "$(dirname "$0")/../.."
REPO=$PWD
examples/slurm/local_cluster.sh start >/dev/null
WORK=$(mktemp -d /tmp/nxd_lc_slurm.XXXXXX)
STEPS=30

wait_for() {  # wait_for <seconds> <file> <command...>
  local deadline=$((SECONDS + $1)) out=$2; shift 2
  until "$@"; do
    if [ $SECONDS -ge $deadline ]; then echo "timed out waiting for: $*"; tail -50 "$out" || true; exit 1; fi
    sleep 2
  done
}

run_case() {  # run_case <name> <preempt command with JOB placeholder>
  local name=$1 preempt=$2 out=$WORK/$1.out job saved
  job=$(NPROC_PER_NODE=2 PYTHON_BIN=$REPO/.venv/bin/python LOG_DIR=$WORK/$name OMP_NUM_THREADS=1 \
    sbatch --parsable --job-name="nxd_lc_$name" --output="$out" --chdir="$REPO" examples/slurm/train.sbatch \
    --config-name cpu_tiny_llama_config trainer.max_steps=$STEPS trainer.log_every_n_steps=1 \
    trainer.val_check_interval=1000 trainer.limit_val_batches=0 +trainer.enable_progress_bar=false \
    exp_manager.checkpoint_callback_params.every_n_train_steps=1000 model.encoder_seq_length=128 \
    data.tokenizer.vocab_size=1024 +data.tokenizer.cache_dir=$WORK/cache)
  echo "[$name] submitted job $job (output $out)"
  wait_for 300 "$out" grep -q "step 3/$STEPS" "$out"
  echo "[$name] job $job is training: ${preempt//JOB/$job}"
  eval "${preempt//JOB/$job}"
  wait_for 600 "$out" grep -q "step $STEPS/$STEPS" "$out"
  saved=$(grep -o "preemption checkpoint of step [0-9]*" "$out" | head -1 | awk '{print $NF}')
  [ -n "$saved" ] || { echo "FAIL [$name]: no preemption checkpoint"; tail -60 "$out"; exit 1; }
  grep -q "restart 1:" "$out" || { echo "FAIL [$name]: the job was not requeued"; tail -60 "$out"; exit 1; }
  grep -q "resuming from .*step=$saved-" "$out" || { echo "FAIL [$name]: no resume from step $saved"; \
    tail -60 "$out"; exit 1; }
  grep -E "restart [0-9]|forwarding|preemption checkpoint|requeueing|resuming from|step $STEPS/$STEPS" "$out" \
    | cut -c1-150
  echo "OK [$name]: job $job saved at step $saved when preempted, was requeued, resumed from step $saved and finished"
}

run_case requeue "scontrol requeue JOB"
run_case usr1 "scancel --signal=USR1 --batch JOB"
rm -rf "$WORK"
