"""Collators and optimizer-step counts for each `data.batching` mode."""

from __future__ import annotations

import math

from transformers import DataCollatorForSeq2Seq, DataCollatorWithFlattening

from finetune.config import Config, DataConfig, RecipeError


def make_collator(data: DataConfig, tokenizer):
    if data.batching in ("padded", "length_grouped"):
        # Pads input_ids with the pad token, labels with -100, and builds the attention mask.
        return DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=-100, return_tensors="pt")
    if data.batching == "packed":
        # One padding-free row per micro-batch; position_ids restart at 0 for each sequence (the model derives a
        # block-diagonal mask from them), and each sequence's first label becomes -100 so no target crosses a boundary.
        return DataCollatorWithFlattening(return_position_ids=True, separator_id=-100)
    raise RecipeError(f"data.batching={data.batching} is not available yet; use data.batching=padded")


def count_optimizer_steps(cfg: Config, rows: int, ranks: int, accumulation: int) -> int:
    """Optimizer steps of the run, counted as the Trainer counts them (the schedule's `total_steps`)."""
    if cfg.train.max_steps > 0:
        return cfg.train.max_steps
    batches_per_rank = math.ceil(math.ceil(rows / cfg.train.micro_batch_size) / ranks)
    steps_per_epoch = max(math.ceil(batches_per_rank / accumulation), 1)
    return math.ceil(cfg.train.epochs * steps_per_epoch)
