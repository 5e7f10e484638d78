"""main() on 2 CPU ranks (gloo), forked by tests.launch.forked_ranks: two optimizer steps of a GRPO trainer on the
tiny policy; every rank saves the micro-batches its loss saw and the gradient each step applied, which
tests/test_grpo.py compares with the float64 objective of both ranks' window."""

import torch
import trl

from finetune import TokenNormGRPOTrainer
from finetune.rl.grpo_toy import sgd_config, train_grpo

TRAINERS = {"trl": trl.GRPOTrainer, "ours": TokenNormGRPOTrainer}


def main(out: str, folder: str, trainer: str, loss_type: str, accumulation: int, steps_per_generation: int) -> None:
    args = sgd_config(out + ".trainer", accumulation, steps_per_generation, loss_type=loss_type)
    trained, steps = train_grpo(TRAINERS[trainer], folder, args)
    rank = trained.args.process_index
    seen = [{k: v.cpu() for k, v in batch.items()} for batch in trained.seen]
    torch.save({"seen": seen, "before": steps.before, "grads": steps.grads}, f"{out}.rank{rank}")
    # Leave together: a rank that exits while its peer is still in a gloo collective can abort the peer.
    torch.distributed.barrier()
