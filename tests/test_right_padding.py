"""Right padding trains without its attention mask where that is exact (finetune/core/heads.py
`ForwardTakes.training_inputs`): which batches the model's forward gets unmasked, and the applied gradient against the
float64 brute force (each sequence alone, unpadded) with and without the mask left out."""

import copy

import pytest
import torch

from finetune import TokenNormTrainer
from finetune.core.heads import is_right_padding
from finetune.testing.toy import (
    MeanLossLM,
    RecordingCollator,
    ragged_rows,
    step_errors,
    tiny_llama,
    tiny_qwen_vl,
    train_recording,
)


class LeftPadding(RecordingCollator):
    """Pads on the left: each row's real positions come after its padding."""

    def __call__(self, rows):
        batch = super().__call__(rows)
        lengths = batch["attention_mask"].sum(1)
        for key in ("input_ids", "attention_mask", "labels"):
            batch[key] = torch.stack([torch.cat([r[n:], r[:n]]) for r, n in zip(batch[key], lengths)])
        # a row's first label is no target of the unpadded row; left-padded, the padding before it would predict it
        width = batch["labels"].shape[1]
        batch["labels"][torch.arange(len(lengths)), width - lengths] = -100
        return batch


class LabelledPadding(RecordingCollator):
    """Pads the labels with the pad id (a collator that trains on padding, as `Trainer` would with it)."""

    def __call__(self, rows):
        batch = super().__call__(rows)
        batch["labels"][batch["attention_mask"] == 0] = self.pad_id
        return batch


def masks_seen(model) -> list[bool]:
    """Per training forward: whether it got an attention mask."""
    seen = []
    model.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append("attention_mask" in kwargs) if torch.is_grad_enabled() else None,
        with_kwargs=True,
    )
    return seen


def test_is_right_padding_reads_the_host_mask_and_the_targets():
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    targets = torch.tensor([[5, 6, -100, -100], [1, 2, 3, -100]])
    assert is_right_padding(mask, targets)
    assert not is_right_padding(mask.flip(1), targets)  # left padding
    assert not is_right_padding(torch.tensor([[1, 0, 1, 0], [1, 1, 1, 1]]), targets)  # a hole
    assert not is_right_padding(mask, torch.tensor([[5, 6, -100, 7], [1, 2, 3, -100]]))  # a target on padding
    assert not is_right_padding(mask * 2, targets)  # not a 0/1 mask
    assert not is_right_padding(None, targets)


@pytest.mark.parametrize(
    "model_fn,collator,unmasked",
    [
        (tiny_llama, RecordingCollator, True),
        (tiny_llama, LeftPadding, False),
        (tiny_llama, LabelledPadding, False),
        (tiny_qwen_vl, RecordingCollator, False),  # not a causal LM of transformers' mapping (its rope reads the mask)
    ],
    ids=["llama-right", "llama-left", "llama-labelled-padding", "qwen2_5_vl-right"],
)
def test_only_right_padding_of_a_known_causal_lm_trains_unmasked(model_fn, collator, unmasked, tmp_path):
    model = model_fn()
    seen = masks_seen(model)
    train_recording(TokenNormTrainer, model, ragged_rows(8, seed=4), tmp_path, 4, 2, collator=collator())
    assert len(seen) == 2 and seen == [not unmasked] * 2, seen


def test_a_model_outside_transformers_keeps_its_mask(tmp_path):
    model = MeanLossLM()
    model.loss_type = "ForCausalLM"  # opted in: our loss, but a forward we cannot read
    seen = masks_seen(model)
    train_recording(TokenNormTrainer, model, ragged_rows(8, seed=4), tmp_path, 4, 2)
    assert seen == [True, True], seen


@pytest.mark.parametrize("collator", [RecordingCollator, LeftPadding], ids=["right-unmasked", "left-masked"])
def test_applied_gradient_is_the_window_token_mean_either_way(collator, tmp_path):
    initial = tiny_llama()
    recorder = collator()
    _, windows, snapshots = train_recording(
        TokenNormTrainer, copy.deepcopy(initial), ragged_rows(12, seed=9), tmp_path, 4, 3, collator=recorder
    )
    errors = [e for e, _ in step_errors(initial, windows, snapshots)]
    assert len(errors) == 1 and max(errors) <= 1e-5, errors


def test_a_subclass_still_reads_the_mask_its_forward_is_spared(tmp_path):
    """What a research subclass's compute_loss gets is the batch as collated; only the model's forward goes unmasked."""
    read = []

    class ReadsTheMask(TokenNormTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            read.append(int(inputs["attention_mask"].sum()))
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    model = tiny_llama()
    seen = masks_seen(model)
    collator = RecordingCollator()
    train_recording(ReadsTheMask, model, ragged_rows(8, seed=4), tmp_path, 4, 2, collator=collator)
    assert seen == [False, False] and read == [sum(len(r["input_ids"]) for r in b) for b in collator.batches]
