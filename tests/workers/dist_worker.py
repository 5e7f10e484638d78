"""main() on 2 CPU ranks (gloo), forked by tests.launch.forked_ranks (or run under torchrun): one TokenNormTrainer
step; rank 0 saves what tests/test_distributed.py compares."""

import sys

import torch

from finetune import TokenNormTrainer
from finetune.env import exit_process
from finetune.testing.toy import RecordingCollator, SnapshotCallback, ragged_rows, sgd_args, tiny_llama


def main(out: str, micro: int, accumulation: int, rows: int, seed: int) -> None:
    snapshots = SnapshotCallback()
    collator = RecordingCollator()
    trainer = TokenNormTrainer(
        model=tiny_llama(),
        args=sgd_args(out + ".trainer", micro, accumulation),
        train_dataset=ragged_rows(rows, seed),
        data_collator=collator,
        callbacks=[snapshots],
    )
    trainer.train()
    rank = trainer.args.process_index
    rank_tokens = sum(sum(t != -100 for t in r["labels"][1:]) for b in collator.batches for r in b)
    gathered = [None] * trainer.args.world_size
    torch.distributed.all_gather_object(gathered, rank_tokens)
    if rank == 0:
        torch.save(
            {"snapshots": snapshots.snapshots, "log_history": trainer.state.log_history, "rank_label_tokens": gathered},
            out,
        )
    # Leave together: a rank that exits while its peer is still in a gloo collective can abort the peer.
    torch.distributed.barrier()
    # no destroy_process_group: freeing the group right after a gloo collective can deadlock (finetune.env.exit_process)


if __name__ == "__main__":
    main(sys.argv[1], *(int(a) for a in sys.argv[2:]))
    exit_process(0)  # no object teardown: see finetune.env.exit_process
