"""Batching modes change the layout of a window, never its gradient."""

import copy

import pytest
import torch
from transformers import DataCollatorWithFlattening

from finetune import TokenNormTrainer
from finetune.testing.reference import reference_gradient, relative_error
from finetune.testing.toy import SnapshotCallback, model_at, ragged_rows, sgd_args, tiny_llama
from tests.attention import RecordingFlattening


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_logits_equal_per_sequence_logits(attn):
    model = tiny_llama()
    model.config._attn_implementation = attn
    rows = ragged_rows(5, seed=2)
    batch = DataCollatorWithFlattening(return_position_ids=True, separator_id=-100)([dict(r) for r in rows])
    assert batch["input_ids"].shape[0] == 1 and "attention_mask" not in batch
    packed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits[0]
    alone = torch.cat([model(input_ids=torch.tensor([r["input_ids"]]), use_cache=False).logits[0] for r in rows])
    assert (packed - alone).abs().max() <= 1e-5
    # and the first token of every packed sequence is never a target of the one before it
    starts = (batch["position_ids"][0] == 0).nonzero().flatten()
    assert len(starts) == len(rows) and (batch["labels"][0, starts] == -100).all()


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_training_is_exact(attn, tmp_path):
    initial = tiny_llama()
    initial.config._attn_implementation = attn
    collator, snapshots = RecordingFlattening(), SnapshotCallback()
    trainer = TokenNormTrainer(
        model=copy.deepcopy(initial),
        args=sgd_args(tmp_path, 3, 2),
        train_dataset=ragged_rows(12, seed=4),
        data_collator=collator,
        callbacks=[snapshots],
    )
    trainer.train()
    windows = [collator.batches[0] + collator.batches[1], collator.batches[2] + collator.batches[3]]
    for k, window in enumerate(windows):
        grads, _ = reference_gradient(model_at(initial, snapshots.snapshots[k]), window)
        applied = {n: snapshots.snapshots[k][n] - snapshots.snapshots[k + 1][n] for n in grads}
        assert relative_error(applied, grads) <= 1e-5


def test_token_budget_groups_respect_the_budget_and_use_every_row_once():
    from finetune.data.batching import budget_groups

    lengths = [len(r["input_ids"]) for r in ragged_rows(300, seed=9, max_len=60)]
    for padded in (True, False):
        groups = budget_groups(lengths, 128, padded=padded, seed=0)
        assert sorted(i for g in groups for i in g) == list(range(300))
        for g in groups:
            cost = len(g) * max(lengths[i] for i in g) if padded else sum(lengths[i] for i in g)
            assert cost <= 128
        assert groups == budget_groups(lengths, 128, padded=padded, seed=0)
        assert groups != budget_groups(lengths, 128, padded=padded, seed=1)
        # few micro-batches are left far under budget: little computed padding
        computed = sum(len(g) * max(lengths[i] for i in g) if padded else sum(lengths[i] for i in g) for g in groups)
        assert computed >= 0.8 * 128 * len(groups)


@pytest.mark.parametrize("padded", [True, False], ids=["token_budget", "packed_budget"])
def test_token_budget_training_is_exact(padded, tmp_path):
    from finetune.data.batching import MicroBatchCollator, MicroBatches, budget_groups
    from finetune.testing.toy import RecordingCollator

    initial = tiny_llama()
    rows = ragged_rows(20, seed=6)
    groups = budget_groups([len(r["input_ids"]) for r in rows], 64, padded=padded, seed=0)
    inner = RecordingCollator() if padded else RecordingFlattening()
    snapshots = SnapshotCallback()
    trainer = TokenNormTrainer(
        model=copy.deepcopy(initial),
        args=sgd_args(tmp_path, 1, 3),
        train_dataset=MicroBatches(rows, groups),
        data_collator=MicroBatchCollator(inner),
        callbacks=[snapshots],
    )
    trainer.train()
    assert len({len(b) for b in inner.batches}) > 1, "row counts per micro-batch should vary"
    windows = [sum(inner.batches[i : i + 3], []) for i in range(0, len(inner.batches), 3)]
    for k, window in enumerate(windows):
        grads, _ = reference_gradient(model_at(initial, snapshots.snapshots[k]), window)
        applied = {n: snapshots.snapshots[k][n] - snapshots.snapshots[k + 1][n] for n in grads}
        assert relative_error(applied, grads) <= 1e-5
