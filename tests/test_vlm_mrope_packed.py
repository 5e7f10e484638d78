"""Packed image rows for the multimodal-RoPE family (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, GLM-4V): each sequence's rope
rows are the model's own for that sequence alone, attention stays within each sequence, and training on packed rows
(several images per sequence and per packed row, images of different grids) is exact against the float64
per-sequence reference: one sequence at a time, unpadded, the model computing its own positions from its token
types."""

import copy
from types import SimpleNamespace

import pytest
import torch

from finetune import TokenNormTrainer
from finetune.core.meter import batch_counts
from finetune.data.batching import row_collator
from finetune.data.image_inputs import ImageInputs
from finetune.data.vision import VisionCollator
from finetune.model.image_rows import forward_inputs, packing_refusal
from finetune.model.packed_attention import use_for_packed_rows
from finetune.recipe import Batching
from finetune.testing.reference import reference_gradient, relative_error
from finetune.testing.toy import SnapshotCallback, sgd_args
from tests.mrope_models import ROWS, alone, image_processor, tiny
from tests.vlm_models import Recording


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "glm4v"])
def test_packed_rows_carry_each_sequences_own_rope_positions(family):
    model = tiny(family).eval()
    assert packing_refusal(model.config) is None
    inputs = ImageInputs(**forward_inputs(model.config))
    assert inputs.type_ids_key == "mm_token_type_ids" and inputs.rope_index is not None
    processor = image_processor()
    collate = VisionCollator(
        row_collator(Batching("packed", 1, None), None), SimpleNamespace(image_processor=processor), inputs
    )
    batch = collate(ROWS[:3])
    assert batch["position_ids"].shape == (4, 1, sum(len(r["input_ids"]) for r in ROWS[:3]))
    start = 0
    for seq in ROWS[:3]:
        end = start + len(seq["input_ids"])
        own, _ = model.model.get_rope_index(
            **{k: v for k, v in alone(model, seq, processor).items() if k != "pixel_values"}
        )
        assert torch.equal(batch["position_ids"][1:, :, start:end], own)  # the model's rope rows for it alone
        assert batch["position_ids"][0, 0, start:end].tolist() == list(range(end - start))  # the text row restarts
        start = end
    assert batch_counts(batch)[3] == 3  # three sequences in the packed row

    # the packed row's logits are the sequences' own, one at a time
    with torch.no_grad():
        packed = model(**{k: v for k, v in batch.items() if k != "labels"}, use_cache=False).logits[0]
        start = 0
        for seq in ROWS[:3]:
            end = start + len(seq["input_ids"])
            own = model(**alone(model, seq, processor), use_cache=False).logits[0]
            torch.testing.assert_close(packed[start:end], own, atol=2e-5, rtol=1e-4)
            start = end


@pytest.mark.parametrize(
    "family,attention",
    [
        ("qwen2_5_vl", "packed_sdpa"),
        ("qwen2_5_vl", "sdpa"),
        ("qwen2_vl", "packed_sdpa"),
        ("qwen3_vl", "packed_sdpa"),
        ("glm4v", "packed_sdpa"),
    ],
)
def test_packed_mrope_rows_match_the_float64_per_sequence_reference(family, attention, tmp_path):
    """Tower, merger and language model all train (a misplaced image or position would move their gradients); 3 rows
    per packed row, 2 packed rows per window."""
    initial = tiny(family)
    model = copy.deepcopy(initial)
    if attention == "packed_sdpa":
        assert use_for_packed_rows(model, "data.batching=padded").startswith("attention: packed_sdpa")
    processor = image_processor()
    inner = VisionCollator(
        row_collator(Batching("packed", 1, None), None),
        SimpleNamespace(image_processor=processor),
        ImageInputs(**forward_inputs(model.config)),
    )
    collator = Recording(inner)
    import datasets

    trainer = TokenNormTrainer(
        model=model,
        train_dataset=datasets.Dataset.from_list(ROWS),
        data_collator=collator,
        args=sgd_args(tmp_path, 3, 2, train_sampling_strategy="sequential"),
    )
    snapshots = SnapshotCallback()
    trainer.add_callback(snapshots)
    trainer.train()
    assert [len(b) for b in collator.batches] == [3, 3]
    assert all(b["position_ids"].shape[0] == 4 for b in collator.packed)

    def forward(reference, seq):
        inputs = alone(reference, seq, processor)
        return reference(**inputs, use_cache=False).logits

    reference = copy.deepcopy(initial)
    grads, _ = reference_gradient(reference, collator.batches[0] + collator.batches[1], forward)
    applied = {n: snapshots.snapshots[0][n] - snapshots.snapshots[1][n] for n in grads}
    assert relative_error(applied, grads) <= 1e-5
    moved = {n for n, g in grads.items() if float(g.abs().max()) > 0}
    assert any(n.startswith("model.visual") for n in moved) and any("language_model" in n for n in moved)


def test_one_row_positions_without_the_models_own_would_be_wrong():
    """The check above can fail: plain 1-D positions restarting per sequence (what packing LLaVA rows uses) give
    other logits for a Qwen2.5-VL sequence with an image than the model's own rope rows."""
    model = tiny("qwen2_5_vl").eval()
    processor = image_processor()
    plain = VisionCollator(
        row_collator(Batching("packed", 1, None), None), SimpleNamespace(image_processor=processor), ImageInputs()
    )
    batch = plain(ROWS[:1])
    assert batch["position_ids"].dim() == 2
    with torch.no_grad():
        packed = model(**{k: v for k, v in batch.items() if k != "labels"}, use_cache=False).logits[0]
        own = model(**alone(model, ROWS[0], processor), use_cache=False).logits[0]
    assert float((packed - own).abs().max()) > 2e-4  # 4× what the logits check above allows, at these sizes


@pytest.mark.distributed
def test_packed_mrope_rows_on_two_ranks_match_the_float64_reference(tmp_path):
    """Two CPU ranks (gloo), each a packed row of 3 sequences: one optimizer step's update is the float64 token-mean
    gradient over all six sequences."""
    from tests.launch import forked_ranks
    from tests.workers import mrope_worker

    out = str(tmp_path / "two_ranks.pt")
    forked_ranks(mrope_worker.main, out)
    snapshots = torch.load(out, weights_only=True)["snapshots"]
    processor = image_processor()
    grads, _ = reference_gradient(
        tiny("qwen2_5_vl"), ROWS, lambda model, seq: model(**alone(model, seq, processor), use_cache=False).logits
    )
    applied = {n: snapshots[0][n] - snapshots[1][n] for n in grads}
    assert relative_error(applied, grads) <= 1e-5
