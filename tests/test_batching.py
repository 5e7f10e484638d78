"""Batching modes change the layout of a window, never its gradient."""

import copy

import pytest
import torch
from transformers import DataCollatorWithFlattening

from finetune import TokenNormTrainer
from tests.reference import reference_gradient, relative_error
from tests.test_trainer import model_at
from tests.toy import SnapshotCallback, ragged_rows, sgd_args, tiny_llama


class RecordingFlattening(DataCollatorWithFlattening):
    def __init__(self):
        super().__init__(return_position_ids=True, separator_id=-100)
        self.batches = []

    def __call__(self, rows, *args, **kwargs):
        self.batches.append([dict(r) for r in rows])
        return super().__call__(rows, *args, **kwargs)


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
        model=copy.deepcopy(initial), args=sgd_args(tmp_path, 3, 2), train_dataset=ragged_rows(12, seed=4),
        data_collator=collator, callbacks=[snapshots],
    )
    trainer.train()
    windows = [collator.batches[0] + collator.batches[1], collator.batches[2] + collator.batches[3]]
    for k, window in enumerate(windows):
        grads, _ = reference_gradient(model_at(initial, snapshots.snapshots[k]), window)
        applied = {n: snapshots.snapshots[k][n] - snapshots.snapshots[k + 1][n] for n in grads}
        assert relative_error(applied, grads) <= 1e-5
