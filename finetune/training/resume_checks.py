"""What a checkpoint records about the run that wrote it, and what a resume compares with it: the data position.

A checkpoint is only taken between optimizer steps, so its data position is global_step × accumulation micro-batches
into the epoch (the Trainer skips them at resume); that is the same place only when the recorded figures agree.
A stream (data.streaming) has no length: one endless pass (finetune/data/streaming.py), whose position is the same
count of micro-batches from its start.
"""

from __future__ import annotations

from transformers.trainer_utils import has_length

STREAM = "stream"  # dataset_items of a streamed run

# What each entry of a checkpoint's data position comes from, in recipe keys
DATA_POSITION_KEYS = {"dataset_items": "data.source/data.limit", "seed": "train.seed", "ranks": "the number of ranks",
                      "micro_batches_per_step": "train.global_batch_size (or global_batch_tokens)",
                      "items_per_micro_batch": "train.micro_batch_size"}


def data_position(trainer) -> dict:
    """The figures that fix where in the data global_step × accumulation micro-batches lead."""
    dataset = trainer.train_dataset
    args = trainer.args
    return {"dataset_items": len(dataset) if has_length(dataset) else STREAM, "seed": args.seed,
            "ranks": args.world_size, "micro_batches_per_step": args.gradient_accumulation_steps,
            "items_per_micro_batch": args.per_device_train_batch_size}


def position_changes(saved: dict, now: dict) -> list[str]:
    """`key old → new` for each recorded figure that differs."""
    return [f"{k} {saved[k]} → {now[k]}" for k in now if k in saved and saved[k] != now[k]]


def changed_keys(saved: dict, now: dict) -> str:
    return ", ".join(DATA_POSITION_KEYS[k] for k in now if k in saved and saved[k] != now[k])
