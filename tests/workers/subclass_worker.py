"""main() forked by tests.launch.forked_ranks, or run under torchrun: a research subclass
(tests/test_research_subclasses.py) trained on 2 CPU ranks (gloo) with TokenNormTrainer or transformers.Trainer as its
base; rank 0 saves the parameters after every step.

    torchrun --nproc_per_node 2 tests/workers/subclass_worker.py OUT BASE CASE   (BASE: ours | trainer)

CASE `model_loss`: compute_loss returns the model's own per-batch mean (MeanLossLM, no **kwargs), 12 rows, 2 × 2;
CASE `own_optimizer`: the subclass builds AdamW itself, every window without a labelled token, one step.
"""

import sys

import torch
from transformers import Trainer

from finetune import TokenNormTrainer
from finetune.env import exit_process
from finetune.testing.toy import MeanLossLM, RecordingCollator, SnapshotCallback, ragged_rows, sgd_args, tiny_llama
from tests.test_research_subclasses import empty_window_rows, model_loss, own_optimizer


def main(out: str, base: str, case: str) -> None:
    base_cls = TokenNormTrainer if base == "ours" else Trainer
    if case == "model_loss":
        trainer_cls, model, rows, steps = model_loss(base_cls), MeanLossLM(), ragged_rows(12, seed=3), -1
    else:
        trainer_cls, model, rows, steps = own_optimizer(base_cls), tiny_llama(), empty_window_rows(), 1
    snapshots = SnapshotCallback()
    trainer = trainer_cls(
        model=model, args=sgd_args(out + ".trainer", 2, 2, max_steps=steps), train_dataset=rows,
        data_collator=RecordingCollator(), callbacks=[snapshots],
    )  # fmt: skip
    trainer.train()
    if trainer.args.process_index == 0:
        torch.save({"snapshots": snapshots.snapshots}, out)
    torch.distributed.barrier()  # leave together (see tests/workers/dist_worker.py)
    # no destroy_process_group: freeing the group right after a gloo collective can deadlock (finetune.env.exit_process)


if __name__ == "__main__":
    main(*sys.argv[1:])
    exit_process(0)  # no object teardown: see finetune.env.exit_process
