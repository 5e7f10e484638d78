"""Packed image rows for the multimodal-RoPE family (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, GLM-4V): each sequence's rope
rows are the model's own for that sequence alone, attention stays within each sequence, and training on packed rows
(several images per sequence and per packed row, images of different grids) is exact against the float64
per-sequence reference: one sequence at a time, unpadded, the model computing its own positions from its token
types."""

import copy
import io
from types import SimpleNamespace

import pytest
import torch
from PIL import Image
from transformers import Qwen2VLImageProcessorPil

from finetune import TokenNormTrainer
from finetune.core.meter import batch_counts
from finetune.data.batching import row_collator
from finetune.data.image_inputs import ImageInputs
from finetune.data.images import open_image
from finetune.data.vision import VisionCollator
from finetune.model.image_rows import image_inputs, packing_refusal
from finetune.model.packed_attention import use_for_packed_rows
from finetune.recipe import Batching
from finetune.testing.reference import reference_gradient, relative_error
from finetune.testing.toy import VOCAB, SnapshotCallback, sgd_args, tiny_qwen_vl

IMAGE, VIDEO, START, END = VOCAB - 1, VOCAB - 2, VOCAB - 3, VOCAB - 4
SIZES = {"square": (56, 56), "wide": (112, 56)}  # 14 px patches merged 2×2: 4 and 8 image tokens


def image_processor():
    return Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=56 * 112, patch_size=14, merge_size=2)


def tiny(family: str):
    """A tiny model of `family` whose vision tokens are IMAGE, VIDEO, START, END."""
    if family == "qwen2_5_vl":
        return tiny_qwen_vl()
    torch.manual_seed(0)
    text = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        pad_token_id=0,
    )
    tokens = dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END)
    if family == "qwen2_vl":
        from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

        text["rope_scaling"] = {"type": "mrope", "mrope_section": [2, 1, 1]}
        vision = dict(depth=1, embed_dim=16, hidden_size=32, num_heads=2, mlp_ratio=2)
        config = Qwen2VLConfig(text_config=text, vision_config=vision, attn_implementation="sdpa", **tokens)
        return Qwen2VLForConditionalGeneration(config)
    if family == "glm4v":
        from transformers import Glm4vConfig, Glm4vForConditionalGeneration

        text["rope_parameters"] = {"rope_type": "default", "mrope_section": [2, 1, 1], "partial_rotary_factor": 1.0}
        vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, image_size=56)
        glm_tokens = dict(
            image_token_id=IMAGE, video_token_id=VIDEO, image_start_token_id=START, image_end_token_id=END
        )
        config = Glm4vConfig(text_config=text, vision_config=vision, attn_implementation="sdpa", **glm_tokens)
        return Glm4vForConditionalGeneration(config)
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    text.update(
        head_dim=8, rope_scaling={"rope_type": "default", "mrope_section": [2, 1, 1], "mrope_interleaved": True}
    )
    vision = dict(
        depth=2,
        hidden_size=16,
        intermediate_size=32,
        num_heads=2,
        out_hidden_size=32,
        patch_size=14,
        num_position_embeddings=64,
        deepstack_visual_indexes=[1],
    )
    config = Qwen3VLConfig(text_config=text, vision_config=vision, attn_implementation="sdpa", **tokens)
    return Qwen3VLForConditionalGeneration(config)


def png(size: tuple[int, int], seed: int) -> bytes:
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (size[1], size[0], 3), generator=g, dtype=torch.uint8).numpy()
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def row(name: str, sizes: list[str], seed: int) -> dict:
    """A sequence: prompt text, each image as START + its image tokens + END, an answer that is trained on."""
    g = torch.Generator().manual_seed(seed)
    words = lambda n: torch.randint(3, VOCAB - 5, (n,), generator=g).tolist()  # noqa: E731
    ids, labels = words(3), [-100] * 3
    for size in sizes:
        w, h = SIZES[size]
        tokens = (w // 28) * (h // 28)
        ids += [START] + [IMAGE] * tokens + [END] + words(2)
        labels += [-100] * (tokens + 4)
    answer = words(4 + seed % 3)
    ids, labels = ids + answer, labels + [-100] + answer[1:]
    images = [{"bytes": png(SIZES[s], seed * 10 + k), "path": None} for k, s in enumerate(sizes)]
    return {"input_ids": ids, "labels": labels, "images": images, "row": name, "length": len(ids)}


ROWS = [  # 3 rows per packed row, 2 packed rows per window: several images per sequence and per packed row
    row("two images", ["square", "wide"], 1),
    row("text only", [], 2),
    row("one wide", ["wide"], 3),
    row("one square", ["square"], 4),
    row("three images", ["wide", "square", "square"], 5),
    row("text again", [], 6),
]


def alone(model, seq: dict, processor) -> dict:
    """One sequence's inputs as a user would give them: the model computes its own positions from the token types."""
    ids = torch.tensor([seq["input_ids"]])
    inputs = {"input_ids": ids, "mm_token_type_ids": (ids == IMAGE).long()}
    if seq["images"]:
        pixels = processor([open_image(i["bytes"]) for i in seq["images"]], return_tensors="pt")
        inputs.update(pixel_values=pixels["pixel_values"].to(model.dtype), image_grid_thw=pixels["image_grid_thw"])
    return inputs


class Recording:
    def __init__(self, inner):
        self.inner, self.batches, self.packed = inner, [], []

    def __call__(self, rows):
        self.batches.append([dict(r) for r in rows])
        batch = self.inner(rows)
        self.packed.append(batch)
        return batch


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "glm4v"])
def test_packed_rows_carry_each_sequences_own_rope_positions(family):
    model = tiny(family).eval()
    assert packing_refusal(model.config) is None
    inputs = image_inputs(model.config)
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
        assert use_for_packed_rows(model).startswith("attention: packed_sdpa")
    processor = image_processor()
    inner = VisionCollator(
        row_collator(Batching("packed", 1, None), None),
        SimpleNamespace(image_processor=processor),
        image_inputs(model.config),
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


@pytest.mark.subprocess
def test_packed_mrope_rows_on_two_ranks_match_the_float64_reference(tmp_path):
    """Two CPU ranks (gloo), each a packed row of 3 sequences: one optimizer step's update is the float64 token-mean
    gradient over all six sequences."""
    from tests.launch import torchrun

    out = str(tmp_path / "two_ranks.pt")
    torchrun(["tests/workers/mrope_worker.py", out])
    snapshots = torch.load(out, weights_only=True)["snapshots"]
    processor = image_processor()
    grads, _ = reference_gradient(
        tiny("qwen2_5_vl"), ROWS, lambda model, seq: model(**alone(model, seq, processor), use_cache=False).logits
    )
    applied = {n: snapshots[0][n] - snapshots[1][n] for n in grads}
    assert relative_error(applied, grads) <= 1e-5
