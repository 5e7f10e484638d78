#!/bin/bash
# A Slurm batch job that saves before its time limit and requeues itself until the run is done (docs/runs.md).
#   sbatch docs/examples/slurm.sh
# --signal=B:TERM@120: SIGTERM to this batch shell 120 s before the time limit; the trap passes it to the run (which
# stops at the next micro-batch and saves the last optimizer step), then requeues the job. The requeued job starts
# with train.resume_from=auto from the newest checkpoint; a finished run exits at once.
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

torchrun --standalone --nproc_per_node="${SLURM_GPUS_ON_NODE:-8}" finetune/train.py \
    recipe=recipes/quickstart.yaml train.output_dir="$OUT" train.save_steps=200 train.resume_from=auto &
RUN=$!

stop_and_requeue() {
    kill -TERM "$RUN"           # torchrun passes it to every rank
    wait "$RUN"                 # the checkpoint lands (seconds: one micro-batch plus the save)
    scontrol requeue "$SLURM_JOB_ID"
    exit 0
}
trap stop_and_requeue TERM

wait "$RUN"                     # returns early when the trap fires
