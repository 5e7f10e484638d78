#!/bin/bash
# A Slurm batch job that saves before its time limit and requeues itself until the run is done (docs/runs.md).
#   sbatch docs/examples/slurm.sh
# --signal=B:TERM@120: SIGTERM to this batch shell 120 s before the time limit; the trap passes it to the run (which
# stops at the next micro-batch and saves the last optimizer step). finetune-launch exits with the run's code: 143
# (130 after SIGINT) for a stop that saved, whoever sent it, and the job is requeued; it starts again with
# train.resume_from=auto from the newest checkpoint. Any other code ends the job with it: 0 when the run finished.
#SBATCH --job-name=finetune
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=32
#SBATCH --time=04:00:00
#SBATCH --signal=B:TERM@120
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=finetune-%j.log

set -u
OUT=outputs/quickstart

finetune-launch torchrun --standalone --nproc_per_node="${SLURM_GPUS_ON_NODE:-8}" finetune/train.py \
    recipe=recipes/quickstart.yaml train.output_dir="$OUT" train.save_steps=200 train.resume_from=auto &
RUN=$!
trap 'kill -TERM "$RUN"' TERM   # finetune-launch passes it to torchrun and every rank

wait "$RUN"
CODE=$?
while kill -0 "$RUN" 2>/dev/null; do   # the trap ended the wait early: wait for the save
    wait "$RUN"
    CODE=$?
done
case "$CODE" in
    130|143) scontrol requeue "$SLURM_JOB_ID" ;;   # stopped and saved: resume in a new allocation
    *) exit "$CODE" ;;
esac
