"""How rows become micro-batches, for each batching mode (the table: finetune/recipe/batch_modes.py), and how many
optimizer steps that makes.

- padded / length_grouped: `train.micro_batch_size` rows per micro-batch, padded to the longest (length_grouped
  uses the Trainer's LengthGroupedSampler so rows of similar length share a micro-batch).
- packed: padding-free rows with position_ids restarting per sequence and the sequences' bounds (`cu_seq_lens_q/k`,
  `max_length_q/k`, as transformers' flash-attention path reads them); `train.micro_batch_size` sequences per row,
  or as many as fit `data.max_tokens_per_micro_batch` when it is set.
- token_budget: as many rows as fit `data.max_tokens_per_micro_batch` computed tokens (rows × padded length).

Budgeted micro-batches are formed here once and handed to the Trainer as a dataset whose items are whole
micro-batches (per-device batch size 1), so its sampler still shuffles, shards over ranks and skips on resume.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DataCollatorForSeq2Seq, DataCollatorWithFlattening

from finetune.core.labels import IGNORE_INDEX
from finetune.recipe import Batching, TrainConfig

# Rows are sorted by length in windows of about this many budgeted micro-batches before grouping: rows of a micro-batch
# have similar lengths (little padding), and micro-batches still come from a random order of rows.
SORT_WINDOW_MICRO_BATCHES = 64


@dataclass
class Batches:
    dataset: Any  # what the Trainer samples from: rows, or whole micro-batches
    collator: Callable
    per_device_batch_size: int
    group_by_length: bool = False


def row_collator(batching: Batching, tokenizer) -> Callable:
    if batching.packs:
        # Each sequence's first label becomes IGNORE_INDEX so no target crosses a boundary; attention stays within each
        # sequence by the restarting position_ids: train.build switches sdpa to per-sequence sdpa
        # (finetune/model/packed_attention.py); others derive a block-diagonal mask from them (only without a KV
        # cache: the trainer runs without one). The varlen kernels (ours on CUDA, flash_attention_2) read the
        # sequence bounds made here once per micro-batch on the host: cu_seq_lens_q/k (int32, cumulative from 0) and
        # max_length_q/k (ints); without them flash_attention_2 re-derives them with host syncs in every layer.
        return DataCollatorWithFlattening(
            return_position_ids=True, separator_id=IGNORE_INDEX, return_flash_attn_kwargs=True
        )
    # Pads input_ids with the pad token and labels with IGNORE_INDEX, and builds the attention mask.
    return DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=IGNORE_INDEX, return_tensors="pt")


def budget_groups(lengths: list[int], max_tokens: int, padded: bool, seed: int) -> list[list[int]]:
    """Row indices per micro-batch, each costing at most `max_tokens` computed tokens; deterministic in `seed`."""
    rng = random.Random(seed)
    order = list(range(len(lengths)))
    rng.shuffle(order)
    groups: list[list[int]] = []
    rows_per_micro_batch = max(1, max_tokens // max(1, sorted(lengths)[len(lengths) // 2]))  # at the median length
    sort_window = max(512, SORT_WINDOW_MICRO_BATCHES * rows_per_micro_batch)
    for start in range(0, len(order), sort_window):
        window = sorted(order[start : start + sort_window], key=lambda i: -lengths[i])
        group: list[int] = []
        longest = used = 0
        for i in window:
            cost = (len(group) + 1) * max(longest, lengths[i]) if padded else used + lengths[i]
            if group and cost > max_tokens:
                groups.append(group)
                group, longest, used = [], 0, 0
            group.append(i)
            longest, used = max(longest, lengths[i]), used + lengths[i]
        if group:
            groups.append(group)
    rng.shuffle(groups)
    return groups


class MicroBatches(torch.utils.data.Dataset):
    """Items are whole micro-batches (lists of rows)."""

    def __init__(self, rows: list[dict], groups: list[list[int]]):
        self.rows, self.groups = rows, groups

    def __len__(self) -> int:
        return len(self.groups)

    def __getitem__(self, index: int) -> list[dict]:
        return [self.rows[i] for i in self.groups[index]]


class MicroBatchCollator:
    def __init__(self, inner: Callable):
        self.inner = inner

    def __call__(self, items: list[list[dict]]):
        return self.inner([row for item in items for row in item])


def prepare(batching: Batching, dataset, tokenizer, seed: int) -> Batches:
    """The training micro-batches: rows the Trainer samples `batching.rows_per_micro_batch` at a time, or (budgeted)
    whole micro-batches formed here once, deterministic in `seed`."""
    collator = row_collator(batching, tokenizer)
    if not batching.budgeted:
        return Batches(dataset, collator, batching.rows_per_micro_batch, batching.groups_by_length)
    rows = dataset.to_list() if hasattr(dataset, "to_list") else list(dataset)
    lengths = [len(r["input_ids"]) for r in rows]
    groups = budget_groups(lengths, batching.max_tokens, batching.counts_padding, seed)
    return Batches(MicroBatches(rows, groups), MicroBatchCollator(collator), 1)


def count_optimizer_steps(train: TrainConfig, batches: Batches, ranks: int, accumulation: int) -> int:
    """Optimizer steps of the run, counted as the Trainer counts them (the schedule's `total_steps`)."""
    if train.max_steps > 0:
        return train.max_steps
    batches_per_rank = math.ceil(math.ceil(len(batches.dataset) / batches.per_device_batch_size) / ranks)
    steps_per_epoch = max(math.ceil(batches_per_rank / accumulation), 1)
    return math.ceil(train.epochs * steps_per_epoch)
