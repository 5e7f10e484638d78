"""main() on 2 CPU ranks (gloo), forked by tests.launch.forked_ranks (or run under `torchrun --standalone
--nproc_per_node 2`): FSDP2 (fully_shard), one window each.

Two ways, each with gradients reduced once per window (no_sync) and after every micro-batch (sync_each_batch):
- "torch": fully_shard by hand, the trainer's normalization written out (summed token loss / window tokens of all
  ranks × DP size), clip by the global norm of the DTensor gradients, SGD lr=1;
- "trainer": TokenNormTrainer on a model sharded at load time by transformers (`DistributedConfig(fsdp_size=2)`),
  the Trainer's own FSDP2 path that runs on CPU (Accelerate's FSDP plugin needs a GPU).
Rank 0 saves the applied updates (gathered full tensors) for tests/test_fsdp2.py to compare with the reference.
"""

import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM, TrainerCallback

from finetune import TokenNormTrainer
from finetune.core.loss import count_label_tokens, token_loss_sum
from finetune.env import exit_process
from finetune.testing.toy import RecordingCollator, ragged_rows, sgd_args, tiny_llama

MICRO, ACCUMULATION = 2, 3


def full_params(model) -> dict[str, torch.Tensor]:
    """Every parameter as a full float64 tensor (a collective: all ranks call it)."""
    return {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().to(torch.float64).clone()
        for n, p in model.named_parameters()
    }


def pad(rows):
    return RecordingCollator()(rows)


def torch_window(rows, max_norm: float, sync_each_batch: bool) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = tiny_llama()
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    before = full_params(model)
    share = len(rows) // world
    mine = rows[rank * share : (rank + 1) * share]
    micro_batches = [pad(mine[i : i + MICRO]) for i in range(0, len(mine), MICRO)]
    rank_tokens = sum(int(count_label_tokens(b["labels"])) for b in micro_batches)
    window_tokens = torch.tensor(rank_tokens)
    dist.all_reduce(window_tokens)  # over the data-parallel ranks: here every rank
    loss_total = torch.zeros((), dtype=torch.float64)
    for i, batch in enumerate(micro_batches):
        # FSDP2's no_sync: hold this rank's gradients until the window's last micro-batch.
        model.set_requires_gradient_sync(sync_each_batch or i == len(micro_batches) - 1)
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        loss_sum, _ = token_loss_sum(logits, batch["labels"])
        (loss_sum / window_tokens * world).backward()  # × DP size cancels FSDP's averaging over ranks
        loss_total += loss_sum.detach().double()
    grads_are_dtensors = all(isinstance(p.grad, DTensor) for p in model.parameters())
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)  # the global norm, from the DTensors
    norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
    with torch.no_grad():
        for p in model.parameters():
            p -= p.grad  # SGD, lr 1
    after = full_params(model)
    dist.all_reduce(loss_total)
    return {
        "update": {n: before[n] - after[n] for n in before},
        "grad_norm": float(norm),
        "loss": float(loss_total / window_tokens),
        "rank_tokens": gather(rank_tokens),
        "grads_are_dtensors": grads_are_dtensors,
    }


class FullSnapshots(TrainerCallback):
    def __init__(self):
        self.snapshots = []

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.snapshots = [full_params(model)]

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.snapshots.append(full_params(model))


def trainer_window(rows, folder: str, out: str, max_norm: float, sync_each_batch: bool) -> dict:
    from transformers.distributed import DistributedConfig

    model = AutoModelForCausalLM.from_pretrained(folder, distributed_config=DistributedConfig(fsdp_size=2))
    snapshots, collator = FullSnapshots(), RecordingCollator()
    args = sgd_args(
        out,
        MICRO,
        ACCUMULATION,
        max_grad_norm=max_norm,
        accelerator_config={"gradient_accumulation_kwargs": {"sync_each_batch": sync_each_batch}},
    )
    trainer = TokenNormTrainer(
        model=model, args=args, train_dataset=rows, data_collator=collator, callbacks=[snapshots]
    )
    trainer.train()
    before, after = snapshots.snapshots[0], snapshots.snapshots[1]
    rank_tokens = sum(sum(t != -100 for t in r["labels"][1:]) for b in collator.batches for r in b)
    logged = next(e for e in trainer.state.log_history if "loss" in e and "train_loss" not in e)
    return {
        "update": {n: before[n] - after[n] for n in before},
        "grad_norm": logged["grad_norm"],
        "loss": logged["loss"],
        "window_label_tokens": logged["window_label_tokens"],
        "rank_tokens": gather(rank_tokens),
        "sharded": isinstance(next(trainer.model.parameters()), DTensor),
        "sync_each_batch": trainer.accelerator.gradient_state.plugin_kwargs.get("sync_each_batch", False),
    }


def gather(value):
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def main(out: str, folder: str, rows: int, seed: int, max_norm: float) -> None:
    dist.init_process_group("gloo")
    data = ragged_rows(rows, seed)
    results = {}
    for sync_each_batch in (False, True):
        results[("torch", sync_each_batch)] = torch_window(data, max_norm, sync_each_batch)
        results[("trainer", sync_each_batch)] = trainer_window(
            data, folder, f"{out}.trainer", max_norm, sync_each_batch
        )
    if dist.get_rank() == 0:
        torch.save(results, out)
    dist.barrier()
    # no destroy_process_group: freeing the group right after a gloo collective can deadlock (finetune.env.exit_process)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5]))
    exit_process(0)  # no object teardown: see finetune.env.exit_process
