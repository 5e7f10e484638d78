"""main() on 2 CPU ranks with the environment `accelerate launch --config_file accelerate_configs/ddp.yaml
--num_processes 2` gives them (forked by tests.launch.forked_ranks, or under that launcher): count DDP's gradient
all-reduces per optimizer step, with and without train.sync_each_batch, through finetune.assemble.build.

A DDP communication hook (registered on the wrapped model when training begins) records which micro-batch's
backward reduced gradients; a wrapper around torch.distributed.all_reduce records the other all-reduces (the
window's label-token count). Rank 0 saves what tests/test_sync_count.py asserts.
"""

import sys

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from transformers import TrainerCallback

from finetune.assemble import build
from finetune.env import exit_process
from finetune.recipe import load_config


class CommunicationLog(TrainerCallback):
    def __init__(self):
        self.trainer = None
        self.micro_batch = 0  # backward passes so far (1-based once the first starts)
        self.gradient_syncs: list[int] = []  # the micro-batch of every gradient bucket all-reduced
        self.other_all_reduces: list[tuple[int, str]] = []  # (micro-batch, dtype) outside DDP's hook
        self.in_hook = False

    def attach(self, trainer):
        self.trainer = trainer
        training_step = trainer.training_step

        def counted_training_step(*args, **kwargs):
            self.micro_batch += 1
            return training_step(*args, **kwargs)

        trainer.training_step = counted_training_step
        self.all_reduce = all_reduce = dist.all_reduce

        def logged_all_reduce(tensor, *args, **kwargs):
            if not self.in_hook:
                self.other_all_reduces.append((self.micro_batch, str(tensor.dtype)))
            return all_reduce(tensor, *args, **kwargs)

        dist.all_reduce = logged_all_reduce  # accelerate looks it up at call time

    def detach(self):
        dist.all_reduce = self.all_reduce

    def on_train_begin(self, args, state, control, **kwargs):
        ddp = self.trainer.model_wrapped
        assert isinstance(ddp, torch.nn.parallel.DistributedDataParallel), type(ddp)

        def counting_hook(process_group, bucket):
            self.gradient_syncs.append(self.micro_batch)
            self.in_hook = True  # its all_reduce is this bucket's, counted above
            try:
                return allreduce_hook(process_group, bucket)  # DDP's own: average over ranks
            finally:
                self.in_hook = False

        ddp.register_comm_hook(None, counting_hook)


def run(overrides: list[str]) -> dict:
    cfg = load_config(overrides)
    log = CommunicationLog()
    trainer = build(cfg, callbacks=(log,))
    log.attach(trainer)
    try:
        trainer.train()
    finally:
        log.detach()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e and "train_loss" not in e]
    return {
        "accumulation": trainer.args.gradient_accumulation_steps,
        "world_size": trainer.args.world_size,
        "steps": trainer.state.global_step,
        "micro_batches": log.micro_batch,
        "gradient_syncs": log.gradient_syncs,
        "other_all_reduces": log.other_all_reduces,
        "losses": losses,
        "weights": {n: p.detach().clone() for n, p in trainer.model.named_parameters()},
    }


def main(out: str, *overrides: str) -> None:
    results = {flag: run([*overrides, f"train.sync_each_batch={flag}"]) for flag in ("false", "true")}
    if dist.get_rank() == 0:
        torch.save(results, out)
    dist.barrier()
    # no destroy_process_group: freeing the group right after a gloo collective can deadlock (finetune.env.exit_process)


if __name__ == "__main__":
    main(sys.argv[1], *sys.argv[2:])
    exit_process(0)  # no object teardown: see finetune.env.exit_process
